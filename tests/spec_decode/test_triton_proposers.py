"""Draft-model and EAGLE speculation on the Triton attention backend (the GPU path): the proposer's pool, model,
draws and draft distributions live on the target's device, and greedy outputs stay token-identical to speculation
off on the same backend, including decode steps fed through the CUDA-graph path (whose attention metadata exists
only in the graph's buffers, so EAGLE builds its own).

With a GPU this runs on it; without one, on the CPU with the kernels in Triton's interpreter (`capture=False` for
the graph path, as in tests/models/test_triton_engine.py).
"""

from __future__ import annotations

import os
from itertools import count

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.spec_decode.model_proposer import ModelProposer
from tests.conftest import assert_all_blocks_free
from tests.engine.test_spec_decode import assert_same_greedy, copy_prompts, token_ids

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and bool(os.environ.get("KVSERVE_CPU_ISA")), reason="forced ISA level: Triton tests run once"
)
K = 3


def make_llm(path: str, **kwargs) -> LLM:
    if DEVICE == "cuda":
        kwargs.setdefault("kv_cache_memory", 1 << 30)
    return LLM(path, dtype="float32", max_model_len=256, device=DEVICE, attention_backend="triton", **kwargs)


def spec_config(method: str, model: str) -> dict:
    return {"method": method, "model": model, "num_speculative_tokens": K, "adaptive": False}


@pytest.fixture(scope="module")
def plain(target_path) -> LLM:
    return make_llm(target_path, enforce_eager=True)


@pytest.mark.parametrize("method", ["draft_model", "eagle"])
def test_greedy_identical_on_the_triton_backend(method, target_path, eagle_head_path, plain):
    model = target_path if method == "draft_model" else eagle_head_path
    llm = make_llm(target_path, enforce_eager=True, speculative_config=spec_config(method, model))
    runner = llm.engine.engine_core.executor.driver_runner
    proposer = runner.proposer
    assert isinstance(proposer, ModelProposer)
    assert proposer.backend.describe(16).startswith("Triton")
    assert proposer.kv_caches[0][0].device.type == DEVICE
    # One pool of the target's block count each; the budget pays for both.
    assert proposer.kv_caches[0][0].shape[0] == runner.kv_caches[0][0].shape[0] == runner.num_blocks
    assert_same_greedy(plain, llm, copy_prompts(3, 21), max_tokens=20)
    if method == "draft_model":  # the target drafting for itself: (nearly) every draft accepted
        assert llm.stats()["spec_decoding"]["acceptance_rate"] > 0.9
    # Sampled requests draw their drafts from q on the device; a seed makes the whole output reproducible.
    params = SamplingParams(max_tokens=10, temperature=0.8, top_k=20, seed=5, ignore_eos=True)
    prompts = copy_prompts(2, 22)
    assert token_ids(llm, prompts, params) == token_ids(llm, prompts, params)
    assert_all_blocks_free(llm)


def test_eagle_after_decode_steps_replayed_from_graph_buffers(target_path, eagle_head_path, plain):
    """Every other step verifies none of the drafts proposed for it, so it is decode-only and runs through the
    graph path; the EAGLE head then mirrors a step without eager attention metadata."""
    llm = make_llm(target_path, max_num_seqs=4, speculative_config=spec_config("eagle", eagle_head_path))
    runner = llm.engine.engine_core.executor.driver_runner
    if DEVICE == "cpu":
        assert runner.graphs is None
        runner.graphs = runner.build_decode_graphs(capture=False)
    assert runner.graphs is not None
    replays = []
    run = runner.graphs.run

    def counting_run(input_ids, positions, inputs, size, fill=None):
        replays.append(size)
        return run(input_ids, positions, inputs, size, fill)

    runner.graphs.run = counting_run
    steps = count()
    scheduler = llm.engine.engine_core.scheduler
    plan = scheduler._plan_drafts
    scheduler._plan_drafts = lambda: plan() if next(steps) % 2 else {}
    assert_same_greedy(plain, llm, copy_prompts(3, 23), max_tokens=16)
    assert replays, "no decode step went through the graph path"

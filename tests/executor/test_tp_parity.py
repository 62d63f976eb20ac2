"""TP=2 against TP=1: token-identical greedy outputs in fp32, through batching, prefix hits, chunked prefill and
preemption, with worker processes (mp) and with Ray actors on a local Ray cluster.

Row-parallel layers add their partial sums in a different order than one matmul, so logits differ from TP=1 in
the last bits; the tiny models' top-2 logit gaps (tests/conftest.py) are far above that, so tokens must not."""

from __future__ import annotations

import random

import pytest

from kvserve import LLM, SamplingParams
from tests.conftest import assert_all_blocks_free

# A tight pool and token budget: long prompts are prefilled in chunks, later prompts hit the shared prefix's
# cached blocks, and the pool runs out mid-decode, so requests are preempted and recomputed.
ENGINE = dict(
    dtype="float32",
    max_model_len=256,
    block_size=8,
    num_kv_blocks=16,
    max_num_batched_tokens=24,
    max_num_seqs=4,
)


def workload() -> tuple[list[dict], SamplingParams]:
    rng = random.Random(13)
    prefix = [rng.randrange(3, 49000) for _ in range(24)]
    prompts = [prefix + [rng.randrange(3, 49000) for _ in range(rng.randrange(3, 30))] for _ in range(5)]
    prompts.append([rng.randrange(3, 49000) for _ in range(40)])
    return [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def run(model: str, **options) -> tuple[list[list[int]], dict]:
    llm = LLM(model, **ENGINE, **options)
    try:
        prompts, params = workload()
        out = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.stats()
        assert_all_blocks_free(llm)
        return [o.outputs[0].token_ids for o in out], stats
    finally:
        llm.shutdown()


def check_parity(model: str, **tp_options) -> None:
    ref, ref_stats = run(model)
    got, stats = run(model, tensor_parallel_size=2, **tp_options)
    # The workload exercises what it claims to, at both sizes.
    for s in (ref_stats, stats):
        assert s["num_preemptions"] > 0 and s["prefix_cache"]["num_hit_tokens"] > 0, s
    assert got == ref


@pytest.mark.parametrize(
    "tiny",
    [
        "llama-gqa-untied",  # 2 KV heads, one per rank; untied LM head
        "qwen2-mqa-untied",  # 1 KV head, replicated on both ranks; q/k/v biases
        "qwen3-mqa-tied",  # q/k norms; the tied LM head shares the embedding's vocabulary slice
    ],
)
def test_mp_tp2_matches_tp1(tiny, tiny_model_factory):
    check_parity(tiny_model_factory(tiny), distributed_executor_backend="mp")


def test_mp_tp2_constrained_outputs_match_tp1(tiny_model_factory):
    """The step's grammar bitmask crosses the wire to both ranks; each masks its logits the same way."""
    from kvserve.sampling_params import StructuredOutputsParams

    prompts, _ = workload()
    specs = [
        StructuredOutputsParams(regex=r"[a-f]{3,9}-\d{2}"),
        StructuredOutputsParams(choice=["north", "south", "east west"]),
        StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}),
    ]
    params = [
        SamplingParams(temperature=0, max_tokens=24, structured_outputs=specs[i % 3]) for i in range(len(prompts))
    ]
    outs = {}
    for tp in (1, 2):
        llm = LLM(tiny_model_factory("llama-gqa-untied"), **ENGINE, tensor_parallel_size=tp)
        try:
            got = llm.generate(prompts, params, use_tqdm=False)
            outs[tp] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in got]
            assert_all_blocks_free(llm)
        finally:
            llm.shutdown()
    assert outs[2] == outs[1]
    assert sum(reason == "stop" for _, reason in outs[1]) >= 2


@pytest.mark.slow
def test_mp_tp2_matches_tp1_on_the_embedded_model(smollm2_gguf):
    # 9 query heads and 3 KV heads: the ranks get 1 and 2 GQA groups (kvserve/distributed/sharding.py).
    prompts, params = workload()
    params.max_tokens = 12
    outs = {}
    for tp in (1, 2):
        llm = LLM(smollm2_gguf, dtype="float32", max_model_len=256, num_kv_blocks=64, tensor_parallel_size=tp)
        try:
            outs[tp] = [o.outputs[0].token_ids for o in llm.generate(prompts[:3], params, use_tqdm=False)]
        finally:
            llm.shutdown()
    assert outs[2] == outs[1]


@pytest.fixture(scope="module")
def local_ray_cluster(monkeypatch_module):
    ray = pytest.importorskip("ray")
    # Loopback only: the cluster's node and gloo's connections stay on 127.0.0.1.
    monkeypatch_module.setenv("GLOO_SOCKET_IFNAME", "lo")
    monkeypatch_module.setenv("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_ray_tp2_matches_tp1(local_ray_cluster, tiny_model_factory):
    check_parity(tiny_model_factory("qwen2-mqa-untied"), distributed_executor_backend="ray")

"""EAGLE-2 draft trees through the engine (fp32, tiny random target, an EAGLE head fitted to it here so that trees
are accepted): greedy outputs token-identical to speculation off under batching, prefix hits, chunked prefill and
preemption (recompute and swap), on the torch and C++ backends; every KV block free after each workload."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.config import SpeculativeConfig
from kvserve.core import scheduler as scheduler_module
from kvserve.core.spec_policy import SpecDecodePolicy
from kvserve.spec_decode.eagle_train import (
    embedding_and_lm_head,
    hf_llama_config,
    save_head,
    target_features,
    train_head,
)
from kvserve.structured_output.matcher import StructuredOutputManager
from kvserve.worker import model_runner
from kvserve.worker.tree_step import walk_trees
from tests.conftest import assert_all_blocks_free
from tests.engine.test_spec_decode import assert_same_greedy, copy_prompts, token_ids
from tests.engine.test_structured_output import constrained_only
from tests.kernels.build import require_kernels
from tests.spec_decode.test_model_proposers import small_pool_llm

TREE = {"method": "eagle", "tree_depth": 3, "tree_topk": 2, "tree_num_nodes": 6, "adaptive": False}


def tree_config(head: str, **kw) -> dict:
    return {**TREE, "model": head, **kw}


@pytest.fixture(scope="module")
def plain(target_path) -> LLM:
    return LLM(target_path, dtype="float32", max_model_len=256)


def fit_head(target: str, folder: str) -> str:
    """An EAGLE head fitted with 600 updates to the target's greedy outputs (its short loops): a head that is
    often right, but not always, so trees are both accepted and cut."""
    llm = LLM(target, dtype="float32", max_model_len=256, enable_prefix_caching=False)
    prompts = copy_prompts(24, 77, length=6, repeats=2)
    outs = llm.generate(prompts, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True), use_tqdm=False)
    seqs = [p["prompt_token_ids"] + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs, strict=True)]
    config = llm.engine.engine_core.executor.driver_runner.model_config
    embed, lm_head = embedding_and_lm_head(config)
    hf_config = hf_llama_config(config.arch)
    # A fixed number of updates, not seconds: the same head however loaded the machine is.
    features = target_features(llm, seqs)
    head, result = train_head(hf_config, embed, lm_head, seqs, features, 0.0, train_steps=600)
    save_head(head, hf_config, folder, result)
    return folder


@pytest.fixture(scope="module")
def fitted_head(target_path, tmp_path_factory) -> str:
    return fit_head(target_path, str(tmp_path_factory.mktemp("fitted-eagle-head")))


@pytest.fixture(scope="module")
def hd64_target_and_head(tiny_model_factory, tmp_path_factory) -> tuple[str, str]:
    """llama-loops-hd64 and a head fitted to it, once for the module (a fit is most of a bf16 test's time)."""
    target = tiny_model_factory("llama-loops-hd64")
    return target, fit_head(target, str(tmp_path_factory.mktemp("fitted-eagle-head-hd64")))


@pytest.fixture(scope="module", params=["torch", "cpu"])
def tree_llm(request, target_path, fitted_head) -> LLM:
    if request.param == "cpu":
        require_kernels()
    return LLM(
        target_path,
        dtype="float32",
        max_model_len=256,
        attention_backend=request.param,
        speculative_config=tree_config(fitted_head),
    )


def test_greedy_identical_batched_and_prefix_hits(plain, tree_llm):
    prompts = copy_prompts(5, 11)
    assert_same_greedy(plain, tree_llm, prompts, max_tokens=40)
    stats = tree_llm.stats()["spec_decoding"]
    print(stats)
    # The trees did work: more than a quarter of a draft accepted per verification on average (1.37-1.40 on the
    # Intel AMX machine, above 1.5 on kind A, whose target outputs loop differently), some of them two deep.
    assert stats["mean_acceptance_length"] > 1.25 and stats["num_accepted_tokens_per_pos"][1] > 0
    hits = tree_llm.stats()["prefix_cache"]["num_hit_tokens"]
    shared = [{"prompt_token_ids": p["prompt_token_ids"] + [7, 8, 9]} for p in prompts[:3]]
    assert_same_greedy(plain, tree_llm, prompts[:3] + shared, max_tokens=40)
    assert tree_llm.stats()["prefix_cache"]["num_hit_tokens"] > hits


def test_tree_of_top1_is_the_chain(target_path, fitted_head):
    """A tree of top-1 children (tree_topk 1) is a chain: the same drafts, so the same acceptance counts."""
    prompts = copy_prompts(5, 11)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    chain = {"method": "eagle", "model": fitted_head, "num_speculative_tokens": 3, "adaptive": False}
    stats = []
    for config in (chain, tree_config(fitted_head, tree_depth=3, tree_topk=1, tree_num_nodes=3)):
        llm = LLM(target_path, dtype="float32", max_model_len=256, speculative_config=config)
        token_ids(llm, prompts, params)
        stats.append(llm.stats()["spec_decoding"])
        assert_all_blocks_free(llm)
    assert stats[0] == stats[1] and stats[0]["num_accepted_tokens_per_pos"][2] > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_identical_with_chunked_prefill_and_preemption(mode, target_path, fitted_head, plain):
    kwargs = {"preemption_mode": "swap", "swap_space": 1 << 20} if mode == "swap" else {}
    llm = small_pool_llm(target_path, tree_config(fitted_head), **kwargs)
    assert_same_greedy(plain, llm, copy_prompts(5, 13, length=16), max_tokens=40)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    if mode == "swap":
        assert stats["num_swapped_out"] > 0
    assert stats["spec_decoding"]["num_accepted_tokens"] > 0


def test_seeded_sampling_with_trees_identical(plain, target_path, fitted_head):
    """temperature > 0: each tree position's draw is the plain sampler's keyed draw (worker/tree_step.py), so a
    seeded request's tokens are exactly those without speculation; seeded outputs repeat, and the blocks come back."""
    llm = LLM(target_path, dtype="float32", max_model_len=256, speculative_config=tree_config(fitted_head))
    prompts = copy_prompts(3, 5)
    params = SamplingParams(max_tokens=30, temperature=0.8, top_k=4, seed=1234, ignore_eos=True, n=2)
    first = token_ids(llm, prompts, params)
    assert first == token_ids(plain, prompts, params)
    assert token_ids(llm, prompts, params) == first
    assert llm.stats()["spec_decoding"]["num_accepted_tokens_per_pos"][1] > 0
    assert_all_blocks_free(llm)


def test_sampled_walk_is_accepted_whole(target_path, fitted_head, monkeypatch):
    """The multi-candidate rule: the walk follows any child equal to the target's draw at its parent (not only the
    argmax child), drawing with the keys the rejection sampler then uses, so the sampler accepts every path the
    walk chose: accepted tokens = the walked paths' lengths, unseeded. With the argmax path (or a draw with other
    noise) the sampler rejects part of them."""
    walked = []

    def spy(step, *args):
        out = walk_trees(step, *args)
        walked.append(sum(int(out[2].num_drafts[i]) for i in step.trees))
        return out

    monkeypatch.setattr(model_runner, "walk_trees", spy)
    llm = LLM(target_path, dtype="float32", max_model_len=256, speculative_config=tree_config(fitted_head))
    params = SamplingParams(max_tokens=30, temperature=0.8, top_k=4, ignore_eos=True, n=2)
    token_ids(llm, copy_prompts(4, 9), params)
    stats = llm.stats()["spec_decoding"]
    assert walked and stats["num_accepted_tokens"] == sum(walked) > 0, (stats, walked)
    assert stats["num_accepted_tokens_per_pos"][1] > 0
    assert_all_blocks_free(llm)


def watch_tree_paths(monkeypatch) -> list[tuple[int, int]]:
    """Each verified tree's (nodes, accepted) as the policy observes it, checking the accepted path that the
    scheduler finds in the tree (the policy learns its acceptance per size from it): as long as the accepted
    drafts, within the verified nodes, each node below the one before."""
    seen = []
    observe, find = SpecDecodePolicy.observe_verification, scheduler_module.accepted_nodes

    def found(draft_ids, parents, emitted):
        path = find(draft_ids, parents, emitted)
        for d, (parent, node) in enumerate(zip([-1, *path], path, strict=False)):
            assert node < len(draft_ids) and parents[node] == parent and draft_ids[node] == emitted[d], path
        return path

    def checked(self, state, num_drafts, num_accepted, path=None, depths=None):
        assert path is not None and len(path) == num_accepted, (path, num_accepted)
        assert depths is not None and len(depths) == num_drafts and all(depths[j] == d for d, j in enumerate(path, 1))
        seen.append((num_drafts, num_accepted, max(depths)))
        observe(self, state, num_drafts, num_accepted, path, depths)

    monkeypatch.setattr(scheduler_module, "accepted_nodes", found)
    monkeypatch.setattr(SpecDecodePolicy, "observe_verification", checked)
    return seen


def test_the_scheduler_finds_each_accepted_path(target_path, fitted_head, plain, monkeypatch):
    seen = watch_tree_paths(monkeypatch)
    llm = LLM(target_path, dtype="float32", max_model_len=256, speculative_config=tree_config(fitted_head))
    prompts = copy_prompts(2, 5)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    assert token_ids(llm, prompts, params) == token_ids(plain, prompts, params)
    assert any(a > 1 for _, a, _ in seen), seen


def adaptive_tree_llm(target_path: str, head: str) -> LLM:
    return LLM(target_path, dtype="float32", max_model_len=256, speculative_config=tree_config(head, adaptive=True))


def test_the_policys_depth_reaches_the_proposer(target_path, fitted_head, plain, monkeypatch):
    """The policy grows each tree to the depth it grants (here always 2 of the config's 3 levels, every node it
    may): the trees verified hold no deeper node, each costs the policy one expansion, and the output is
    speculation off's."""
    seen = watch_tree_paths(monkeypatch)
    monkeypatch.setattr(SpecDecodePolicy, "decide_shapes", lambda self, acc, n: ([self.k] * len(acc), [2] * len(acc)))
    expansions = []
    observe_step = SpecDecodePolicy.observe_step

    def watched(self, *args):
        expansions.append(args[-1])
        observe_step(self, *args)

    monkeypatch.setattr(SpecDecodePolicy, "observe_step", watched)
    llm = adaptive_tree_llm(target_path, fitted_head)
    prompts = copy_prompts(2, 5)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    assert token_ids(llm, prompts, params) == token_ids(plain, prompts, params)
    assert seen and all(depth <= 2 for _, _, depth in seen), seen  # every request gets drafts: no probes
    assert any(a > 1 for _, a, _ in seen)
    # One expansion a tree, two requests: what shows the depth (a tree grown 3 deep here seldom keeps a third-level
    # node among its best 6, so the verified depths alone would not).
    assert set(expansions) <= {0, 1, 2}, expansions
    assert_all_blocks_free(llm)


def test_adaptive_policy_runs_with_trees(target_path, fitted_head, plain, monkeypatch):
    """The policy sizes each tree (a prefix of its rank-ordered nodes)."""
    seen = watch_tree_paths(monkeypatch)
    llm = adaptive_tree_llm(target_path, fitted_head)
    prompts = copy_prompts(3, 21)
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    assert token_ids(llm, prompts, params) == token_ids(plain, prompts, params)
    assert seen  # at least its first probe
    assert_all_blocks_free(llm)


@pytest.mark.parametrize(
    "config, match",
    [
        ({"method": "ngram", "num_speculative_tokens": 3, "tree_depth": 3}, "for method 'eagle'"),
        ({"method": "eagle", "num_speculative_tokens": 3, "tree_topk": 0}, "tree_topk must be an integer >= 1"),
        ({"method": "eagle", "num_speculative_tokens": 3, "tree_num_nodes": 5}, "differ"),
        ({"method": "eagle", "tree_depth": 2, "tree_topk": 2, "tree_num_nodes": 7}, "exceeds the 6 nodes"),
        ({"method": "eagle", "num_speculative_tokens": 3, "quantization": "int4"}, "quantization must be 'int8'"),
        ({"method": "ngram", "num_speculative_tokens": 3, "quantization": "int8"}, "for the model proposers"),
    ],
)
def test_config_errors(config, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_dict(config)


def test_config_defaults():
    chain = SpeculativeConfig.from_dict({"method": "eagle", "num_speculative_tokens": 4})
    assert not chain.tree and chain.num_lookahead_slots == 4
    tree = SpeculativeConfig.from_dict({"method": "eagle", "tree_num_nodes": 10})
    assert tree.tree and (tree.tree_depth, tree.tree_topk, tree.num_speculative_tokens) == (4, 4, 10)
    assert tree.num_lookahead_slots == 12  # three expansions of at most 4 nodes per level


@pytest.mark.parametrize("tree", [False, True])
def test_bf16_pair_packed_greedy_identical(hd64_target_and_head, tree):
    """bf16 on the C++ backend with head_dim 64: the pair-packed KV layout where the CPU has AVX512-BF16 (its kernel
    reads the tree mask, and the accepted path's K/V move inside packed blocks; elsewhere the standard kernel), and
    deterministic (batch-invariant) kernels, so that a verified row computes what a decode step of it computes.
    The chain is the control: it needs neither the mask nor the moves."""
    require_kernels()
    target, head = hd64_target_and_head
    common = {"dtype": "bfloat16", "max_model_len": 256, "attention_backend": "cpu", "deterministic": True}
    chain = {"method": "eagle", "model": head, "num_speculative_tokens": 3, "adaptive": False}
    plain_bf16 = LLM(target, **common)
    spec = LLM(target, **common, speculative_config=tree_config(head) if tree else chain)
    assert_same_greedy(plain_bf16, spec, copy_prompts(4, 13), max_tokens=40)
    stats = spec.stats()["spec_decoding"]
    assert stats["num_accepted_tokens_per_pos"][1] > 0  # paths two deep were accepted (and moved, for a tree)


def test_int8_draft_greedy_identical(hd64_target_and_head):
    """`quantization: int8` in the speculative config: the head's linears are int8 (the bf16 target's are not),
    outputs stay speculation off's, and the int8 head's drafts are still accepted two deep."""
    from kvserve.layers.quant.int8_linear import Int8Linear

    target, head = hd64_target_and_head
    common = {"dtype": "bfloat16", "max_model_len": 256, "deterministic": True}
    plain_bf16 = LLM(target, **common)
    spec = LLM(target, **common, speculative_config=tree_config(head, quantization="int8"))
    proposer = spec.engine.engine_core.executor.driver_runner.proposer
    layer = proposer.head.layers[0]
    assert isinstance(proposer.head.fc, Int8Linear) and isinstance(layer.mlp.down_proj, Int8Linear)
    assert not isinstance(proposer.target.model.layers[0].mlp.down_proj, Int8Linear)
    assert_same_greedy(plain_bf16, spec, copy_prompts(4, 13), max_tokens=40)
    assert spec.stats()["spec_decoding"]["num_accepted_tokens_per_pos"][1] > 0


@pytest.mark.slow
def test_constrained_outputs_unchanged_with_trees(target_path, fitted_head, monkeypatch):
    """Structured outputs with trees: the scheduler masks each node's row by the grammar's state after the node's
    path (structured_output/matcher.py; its rows are tested exactly in tests/structured_output), so greedy and
    seeded outputs equal speculation off's; the bitmask saw branching trees, and constrained requests accept tree
    nodes, two deep among them."""
    trees_seen = []
    fill = StructuredOutputManager.fill_bitmask

    def spy(self, grammars, drafts, parents=None):
        trees_seen.extend(p for p in parents or [] if p is not None and len(set(p)) < len(p))
        return fill(self, grammars, drafts, parents)

    monkeypatch.setattr(StructuredOutputManager, "fill_bitmask", spy)
    path, head = target_path, fitted_head
    prompts, params = constrained_only(2, greedy_only=False)
    plain = LLM(path, dtype="float32", max_model_len=128)
    want = [
        (o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in plain.generate(prompts, params, use_tqdm=False)
    ]
    llm = LLM(path, dtype="float32", max_model_len=128, speculative_config=tree_config(head))
    got = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert trees_seen
    stats = llm.stats()["spec_decoding"]
    assert stats["num_accepted_tokens_per_pos"][1] > 0, stats
    assert_all_blocks_free(llm)

"""The tree layers together on the tiny target (fp32): grow a draft tree, verify it in one target forward with tree
attention (depth positions, ancestor mask), walk it greedily, compact the accepted path's K/V; the emitted tokens
must equal greedy decoding with speculation off. The engine's own path: test_tree_engine.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.attention.base import AttentionInputs
from kvserve.attention.cpu_kernels import CpuKernelAttentionBackend
from kvserve.spec_decode.tree import DraftTree, compact_kv, grow_eagle2_tree, walk_tree
from tests.kernels.build import require_kernels

BLOCKS_PER_REQUEST = 8


def forward_argmax(runner, reqs: list[tuple[list[int], np.ndarray, np.ndarray, np.ndarray | None]]) -> list[np.ndarray]:
    """One target forward over several requests, each (ids, positions, slots, query mask or None), request r in
    blocks [r * BLOCKS_PER_REQUEST, ...) with its query tokens the last of its context; the argmax per token."""
    lens = [len(ids) for ids, _, _, _ in reqs]
    table = np.arange(len(reqs) * BLOCKS_PER_REQUEST, dtype=np.int32).reshape(len(reqs), BLOCKS_PER_REQUEST)
    inputs = AttentionInputs(
        num_decodes=0,
        query_start_loc=np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
        # A request's slots run on from the start of its blocks: its last slot's offset + 1 is its context length.
        seq_lens=np.array([int(sl[-1]) % (BLOCKS_PER_REQUEST * runner.block_size) + 1 for _, _, sl, _ in reqs]),
        block_table=table,
        slot_mapping=np.concatenate([sl for _, _, sl, _ in reqs]).astype(np.int64),
        block_size=runner.block_size,
        query_masks={r: m for r, (_, _, _, m) in enumerate(reqs) if m is not None},
    )
    with torch.inference_mode():
        hidden = runner.model(
            torch.tensor([t for ids, _, _, _ in reqs for t in ids], dtype=torch.long),
            torch.as_tensor(np.concatenate([pos for _, pos, _, _ in reqs]), dtype=torch.long),
            runner.kv_caches,
            runner.attn_backend.build_metadata(inputs),
        )
        argmax = runner.model.compute_logits(hidden).argmax(-1).numpy()
    return np.split(argmax, np.cumsum(lens)[:-1])


def path_tokens(pool: DraftTree, j: int) -> list[int]:
    path = []
    while j >= 0:
        path.append(int(pool.tokens[j]))
        j = int(pool.parents[j])
    return path[::-1]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_tree_verification_is_greedy_identical_batched(target_path, backend):
    if backend == "cpu":
        require_kernels()
    llm = LLM(target_path, dtype="float32", max_model_len=256, attention_backend=backend)
    runner = llm.engine.engine_core.executor.driver_runner
    assert isinstance(runner.attn_backend, CpuKernelAttentionBackend) == (backend == "cpu")
    # Three requests verified together, with trees of 8, 5 and 1 nodes.
    prompts = [[11, 12, 13, 14] * 3 + [5, 6, 7], [40, 41, 42, 43, 44] * 2, [7, 8, 9, 7, 8, 9, 7]]
    budgets = [8, 5, 1]
    max_tokens = 30
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    expected = [list(o.outputs[0].token_ids) for o in outs]
    vocab = runner.vocab_size
    assert len(prompts[0]) + max_tokens + 9 <= BLOCKS_PER_REQUEST * runner.block_size

    # The engine is idle: its cache's first blocks serve these requests, request r from slot r * span on.
    span = BLOCKS_PER_REQUEST * runner.block_size
    prefill = [(p, np.arange(len(p)), r * span + np.arange(len(p)), None) for r, p in enumerate(prompts)]
    outs = [[int(a[-1])] for a in forward_argmax(runner, prefill)]
    rng = np.random.default_rng(0)
    steps = accepted_off_first_child = longest = 0
    while min(len(o) for o in outs) < max_tokens:
        reqs, trees = [], []
        for r, (prompt, out, want) in enumerate(zip(prompts, outs, expected, strict=True)):
            done = len(out)

            def draft(path: list[int], done: int = done, want: list[int] = want) -> np.ndarray:
                """Random draft log-probs; on the true path, the true next token is usually among the top two."""
                lp = np.log(rng.dirichlet(np.ones(vocab) * 0.3) + 1e-9)
                if path == want[done : done + len(path)] and done + len(path) < len(want) and rng.random() < 0.8:
                    lp[want[done + len(path)]] = np.sort(lp)[-1 - int(rng.integers(2))] + 1e-6
                return lp

            def expand(pool: DraftTree, frontier: np.ndarray, draft=draft) -> np.ndarray:
                return np.stack([draft(path_tokens(pool, int(f))) for f in frontier])

            tree = grow_eagle2_tree(draft([]), expand, depth=4, top_k=2, total_nodes=budgets[r])
            ctx = len(prompt) + done - 1  # tokens whose K/V are cached; the root (out[-1]) sits at position ctx
            ids = [out[-1], *tree.tokens.tolist()]
            reqs.append((ids, tree.positions(ctx), r * span + np.arange(ctx, ctx + len(ids)), tree.ancestor_mask()))
            trees.append(tree)
        for r, argmax in enumerate(forward_argmax(runner, reqs)):
            path, emitted = walk_tree(trees[r], argmax)
            compact_kv(runner.kv_caches, reqs[r][2], path)
            accepted_off_first_child += any(j + 1 != d for d, j in enumerate(path, 1))
            longest = max(longest, len(path))
            outs[r] += emitted
        steps += 1
    assert [o[:max_tokens] for o in outs] == expected
    # The trees did work: some step accepted 2+ draft tokens, some along a node a chain would not have had.
    assert longest >= 2 and accepted_off_first_child >= 1 and steps < max_tokens - 1

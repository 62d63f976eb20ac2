"""The tree layers together on the tiny target (fp32): grow a draft tree, verify it in one target forward with tree
attention (depth positions, ancestor mask), walk it greedily, compact the accepted path's K/V; the emitted tokens
must equal greedy decoding with speculation off. Not yet the engine's path (the runner does not propose trees)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.attention.base import AttentionInputs
from kvserve.attention.cpu_kernels import CpuKernelAttentionBackend
from kvserve.spec_decode.tree import DraftTree, compact_kv, greedy_walk, grow_eagle2_tree
from tests.kernels.build import require_kernels


def forward_argmax(runner, ids, positions, slots, seq_len, query_mask=None) -> np.ndarray:
    num_blocks = -(-seq_len // runner.block_size)
    inputs = AttentionInputs(
        num_decodes=0,
        query_start_loc=np.array([0, len(ids)], dtype=np.int64),
        seq_lens=np.array([seq_len], dtype=np.int64),
        block_table=np.arange(num_blocks, dtype=np.int32)[None, :],
        slot_mapping=np.asarray(slots, dtype=np.int64),
        block_size=runner.block_size,
        query_masks=None if query_mask is None else {0: query_mask},
    )
    with torch.inference_mode():
        hidden = runner.model(
            torch.tensor(ids, dtype=torch.long),
            torch.as_tensor(positions, dtype=torch.long),
            runner.kv_caches,
            runner.attn_backend.build_metadata(inputs),
        )
        return runner.model.compute_logits(hidden).argmax(-1).numpy()


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_tree_verification_is_greedy_identical(target_path, backend):
    if backend == "cpu":
        require_kernels()
    llm = LLM(target_path, dtype="float32", max_model_len=256, attention_backend=backend)
    runner = llm.engine.engine_core.executor.driver_runner
    assert isinstance(runner.attn_backend, CpuKernelAttentionBackend) == (backend == "cpu")
    prompt = [11, 12, 13, 14] * 3 + [5, 6, 7]
    max_tokens = 30
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    expected = list(llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids)
    vocab = runner.vocab_size

    # The engine is idle: its cache's first blocks serve this one request, at slots 0, 1, 2, ...
    n = len(prompt)
    out = [int(forward_argmax(runner, prompt, range(n), range(n), n)[-1])]
    rng = np.random.default_rng(0)
    steps = accepted_off_first_child = 0
    longest = 0
    while len(out) < max_tokens:
        done = len(out)

        def draft(path: list[int], done: int = done) -> np.ndarray:
            """Random draft log-probs; on the true path, the true next token is usually among the top two."""
            lp = np.log(rng.dirichlet(np.ones(vocab) * 0.3) + 1e-9)
            if path == expected[done : done + len(path)] and done + len(path) < len(expected) and rng.random() < 0.8:
                lp[expected[done + len(path)]] = np.sort(lp)[-1 - int(rng.integers(2))] + 1e-6
            return lp

        def expand(pool: DraftTree, frontier: np.ndarray) -> np.ndarray:
            rows = []
            for f in frontier:
                path, j = [], int(f)
                while j >= 0:
                    path.append(int(pool.tokens[j]))
                    j = int(pool.parents[j])
                rows.append(draft(path[::-1]))
            return np.stack(rows)

        tree = grow_eagle2_tree(draft([]), expand, depth=4, top_k=2, total_nodes=8)
        ctx = n + done - 1  # tokens whose K/V are cached; the root (out[-1]) sits at position ctx
        ids = [out[-1], *tree.tokens.tolist()]
        slots = np.arange(ctx, ctx + len(ids))
        argmax = forward_argmax(runner, ids, tree.positions(ctx), slots, ctx + len(ids), tree.ancestor_mask())
        path, emitted = greedy_walk(tree, argmax)
        compact_kv(runner.kv_caches, slots, path)
        accepted_off_first_child += any(j + 1 != d for d, j in enumerate(path, 1))
        longest = max(longest, len(path))
        out += emitted
        steps += 1
    assert out[:max_tokens] == expected
    # The trees did work: some step accepted 2+ draft tokens, some along a node a chain would not have had.
    assert longest >= 2 and accepted_off_first_child >= 1 and steps < max_tokens - 1

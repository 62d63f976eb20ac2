"""Tensor-parallel layers in one process: each rank's layer built under a pretend TP group, loaded from the full
tensor, and checked against the full layer (column slices concatenate to it, row partial sums add up to it)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from kvserve.distributed import parallel_state
from kvserve.distributed.parallel_state import TPGroup
from kvserve.distributed.sharding import HeadSlice, head_slice
from kvserve.layers.parallel_linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from kvserve.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding


@contextlib.contextmanager
def as_rank(rank: int, world_size: int):
    saved = parallel_state._group
    parallel_state._group = TPGroup(rank, world_size)
    try:
        yield
    finally:
        parallel_state._group = saved


def test_head_slices():
    # Even split, uneven GQA groups (SmolLM2-135M: 9 heads, 3 KV heads), and KV replication.
    assert [head_slice(4, 2, 2, r) for r in range(2)] == [HeadSlice(0, 2, 0, 1), HeadSlice(2, 2, 1, 1)]
    assert [(s.num_heads, s.num_kv_heads) for s in (head_slice(9, 3, 2, r) for r in range(2))] == [(3, 1), (6, 2)]
    assert [(s.first_head, s.num_heads, s.first_kv_head) for s in (head_slice(4, 1, 2, r) for r in range(2))] == [
        (0, 2, 0),
        (2, 2, 0),
    ]
    assert [s.first_kv_head for s in (head_slice(8, 2, 4, r) for r in range(4))] == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="replicate"):
        head_slice(4, 1, 3, 0)


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 1), (6, 3)])
def test_qkv_and_o_proj_shards(heads, kv_heads):
    torch.manual_seed(0)
    hidden, hd, tp = 24, 8, 2
    q, kv = heads * hd, kv_heads * hd
    wq, wk, wv = torch.randn(q, hidden), torch.randn(kv, hidden), torch.randn(kv, hidden)
    bq, bk, bv = torch.randn(q), torch.randn(kv), torch.randn(kv)
    wo = torch.randn(hidden, q)
    x = torch.randn(3, hidden)
    full_q, full_k, full_v = x @ wq.T + bq, x @ wk.T + bk, x @ wv.T + bv
    partial_o = []
    for rank in range(tp):
        with as_rank(rank, tp):
            qkv = QKVParallelLinear(hidden, hd, heads, kv_heads, bias=True)
            o = RowParallelLinear(q, hidden, input_slice=qkv.q_input_slice)
        for shard, (w, b) in enumerate([(wq, bq), (wk, bk), (wv, bv)]):
            qkv.weight.weight_loader(qkv.weight, w, shard)
            qkv.bias.weight_loader(qkv.bias, b, shard)
        o.weight.weight_loader(o.weight, wo)
        s = qkv.heads
        out = qkv(x)
        lq, lkv = s.num_heads * hd, s.num_kv_heads * hd
        torch.testing.assert_close(out[:, :lq], full_q[:, s.first_head * hd : s.first_head * hd + lq])
        kv_cols = slice(s.first_kv_head * hd, s.first_kv_head * hd + lkv)
        torch.testing.assert_close(out[:, lq : lq + lkv], full_k[:, kv_cols])
        torch.testing.assert_close(out[:, lq + lkv :], full_v[:, kv_cols])
        partial_o.append(o.matmul(out[:, :lq], None))
    torch.testing.assert_close(sum(partial_o), full_q @ wo.T, rtol=1e-5, atol=1e-4)


def test_gate_up_and_down_shards():
    torch.manual_seed(1)
    hidden, inter, tp = 16, 32, 2
    wg, wu, wd = torch.randn(inter, hidden), torch.randn(inter, hidden), torch.randn(hidden, inter)
    x = torch.randn(5, hidden)
    parts = []
    for rank in range(tp):
        with as_rank(rank, tp):
            gate_up = MergedColumnParallelLinear(hidden, [inter, inter])
            down = RowParallelLinear(inter, hidden)
        gate_up.weight.weight_loader(gate_up.weight, wg, 0)
        gate_up.weight.weight_loader(gate_up.weight, wu, 1)
        down.weight.weight_loader(down.weight, wd)
        g, u = gate_up(x).chunk(2, dim=-1)
        parts.append(down.matmul(torch.nn.functional.silu(g) * u, None))
    ref = (torch.nn.functional.silu(x @ wg.T) * (x @ wu.T)) @ wd.T
    torch.testing.assert_close(sum(parts), ref, rtol=1e-5, atol=1e-4)


def test_vocab_shards_pad_the_last_rank():
    torch.manual_seed(2)
    vocab, hidden, tp = 11, 4, 2  # 6 rows per rank; the last rank's sixth row is padding
    w = torch.randn(vocab, hidden)
    ids = torch.tensor([0, 5, 6, 10])
    emb_sum = torch.zeros(len(ids), hidden)
    logit_slices = []
    for rank in range(tp):
        with as_rank(rank, tp):
            emb = VocabParallelEmbedding(vocab, hidden)
            head = ParallelLMHead(hidden, vocab)
        emb.weight.weight_loader(emb.weight, w)
        head.weight.weight_loader(head.weight, w)
        assert emb.weight.shape == (6, hidden)
        start = rank * 6
        in_slice = (ids >= start) & (ids < start + 6)
        local = torch.where(in_slice, ids - start, 0)
        emb_sum += torch.nn.functional.embedding(local, emb.weight) * in_slice[:, None]
        logit_slices.append(head(w[:2]))
    assert torch.equal(emb_sum, w[ids])
    assert torch.equal(logit_slices[1][:, -1], torch.zeros(2))  # padding row is zero
    torch.testing.assert_close(torch.cat(logit_slices, -1)[:, :vocab], w[:2] @ w.T)


def test_checkpoint_shape_is_checked():
    with as_rank(0, 2):
        layer = MergedColumnParallelLinear(8, [16, 16])
    with pytest.raises(ValueError, match="checkpoint"):
        layer.weight.weight_loader(layer.weight, torch.zeros(15, 8), 0)

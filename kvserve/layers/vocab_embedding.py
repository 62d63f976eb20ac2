"""Vocabulary-parallel token embedding and LM head: each rank holds a contiguous slice of the vocabulary's rows.

The vocabulary is padded up to a multiple of tp_size (the padding rows are zero and sit at the end of the last
rank's slice). The embedding looks up the ids in its slice, writes zeros for the others and all-reduces, which
adds exact zeros, so the result equals a full lookup. The LM head computes the logits of its slice, and
`gather_logits` concatenates the slices on every rank (an all-gather rather than a gather to the driver: every
rank then samples the same tokens from the same logits and keeps its own batch state in step without another
message; only the driver's output goes back to the engine).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.distributed.parallel_state import TPGroup, get_tp_group
from kvserve.layers.linear import Linear
from kvserve.utils import cdiv


class _VocabSlice:
    """This rank's rows [start, end) of the vocabulary; `rows_per_rank` (padded) rows are held."""

    def __init__(self, vocab_size: int, tp: TPGroup) -> None:
        self.vocab_size = vocab_size
        self.rows_per_rank = cdiv(vocab_size, tp.world_size)
        self.start = min(tp.rank * self.rows_per_rank, vocab_size)
        self.end = min(self.start + self.rows_per_rank, vocab_size)

    def load(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if tuple(loaded.shape) != (self.vocab_size, param.shape[1]):
            raise ValueError(f"checkpoint {tuple(loaded.shape)} vs model {(self.vocab_size, param.shape[1])}")
        n = self.end - self.start
        param.data[:n].copy_(loaded[self.start : self.end])
        param.data[n:].zero_()


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.tp = get_tp_group()
        self.slice = _VocabSlice(vocab_size, self.tp)
        self.weight = nn.Parameter(torch.empty(self.slice.rows_per_rank, hidden_size))  # [rows_per_rank, hidden]
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        self.slice.load(param, loaded)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(input_ids, self.weight)
        in_slice = (input_ids >= self.slice.start) & (input_ids < self.slice.end)
        local_ids = torch.where(in_slice, input_ids - self.slice.start, 0)
        out = F.embedding(local_ids, self.weight).masked_fill_(~in_slice.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)


class ParallelLMHead(Linear):
    """The LM head's rows for this rank's vocabulary slice; its output is [*, rows_per_rank] logits."""

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        tp = get_tp_group()
        self.slice = _VocabSlice(vocab_size, tp)
        super().__init__(hidden_size, self.slice.rows_per_rank, bias=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        self.slice.load(param, loaded)


def gather_logits(logits: torch.Tensor, vocab_size: int, tp: TPGroup) -> torch.Tensor:
    """[N, rows_per_rank] slices of every rank -> [N, vocab_size] on every rank (padding dropped)."""
    if tp.world_size == 1:
        return logits
    return tp.all_gather(logits, dim=-1)[:, :vocab_size]

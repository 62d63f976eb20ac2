"""Tensor-parallel linears: each rank holds a slice of the weight, and each parameter loads its own slice.

- Column-parallel (`ColumnParallelLinear`, and the merged `MergedColumnParallelLinear` for gate/up and
  `QKVParallelLinear` for q/k/v): the output features are split, so a rank's output is its slice of the full one
  and no communication is needed; the next layer consumes the slice.
- Row-parallel (`RowParallelLinear`, after attention and after the MLP): the input features are split, each rank
  computes a partial sum over its slice, and one all-reduce adds them up. The bias is added once, after it.

A parameter's `weight_loader(param, loaded, shard_id)` receives the full checkpoint tensor (an HF tensor, or a
GGUF one dequantized) and copies this rank's rows or columns into it, so a checkpoint loads at any tp_size with no
resharding step. Loading comes before `Linear.pack_for_cpu`, which then packs only the rank's slice.

With a group of one every class is exactly `Linear` (same shapes, same kernels, no collective).
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.distributed.parallel_state import TPGroup, get_tp_group
from kvserve.distributed.sharding import head_slice
from kvserve.layers.linear import Linear


def _check_shape(loaded: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(loaded.shape) != expected:
        raise ValueError(f"checkpoint {tuple(loaded.shape)} vs model {expected}")


def _divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what} ({total}) is not divisible by tensor_parallel_size ({parts})")
    return total // parts


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
    """A replicated parameter: the whole tensor, shapes checked."""
    _check_shape(loaded, tuple(param.shape))
    param.data.copy_(loaded)


class ColumnParallelLinear(Linear):
    """y_r = x W_r^T + b_r, W_r the rank's rows of W [out_features, in_features]. Output: [*, out_features / tp].

    `output_sizes` lists the full size of each merged piece; by default each is split evenly over the ranks."""

    def __init__(
        self, in_features: int, output_sizes: list[int], bias: bool = False, local_sizes: list[int] | None = None
    ) -> None:
        tp = get_tp_group()
        self.tp: TPGroup = tp
        self.output_sizes = list(output_sizes)  # full size of each merged piece
        if local_sizes is None:
            local_sizes = [_divide(n, tp.world_size, "output features") for n in output_sizes]
        self.local_sizes = list(local_sizes)
        super().__init__(in_features, sum(self.local_sizes), bias)
        for p in (self.weight, self.bias):
            if p is not None:
                p.weight_loader = self.weight_loader

    def shard_rows(self, shard_id: int) -> tuple[int, int, int]:
        """(first row in the checkpoint tensor, first row in the parameter, row count) of this rank's slice."""
        local = self.local_sizes[shard_id]
        return self.tp.rank * local, sum(self.local_sizes[:shard_id]), local

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        index = 0 if shard_id is None else shard_id
        if shard_id is None and len(self.output_sizes) != 1:
            raise ValueError("a merged parameter loads shard by shard")
        _check_shape(loaded, (self.output_sizes[index], *param.shape[1:]))
        src, dst, n = self.shard_rows(index)
        param.data.narrow(0, dst, n).copy_(loaded.narrow(0, src, n))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel layers of the same input in one matmul (gate/up): each piece split on its own, so
    a rank's output is [piece 0 slice, piece 1 slice, ...] and elementwise ops between pieces stay local."""


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v in one matmul, split by whole GQA groups (distributed/sharding.py): a rank gets its query heads
    and the KV heads they read; with fewer KV heads than ranks each KV head is replicated."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool) -> None:
        tp = get_tp_group()
        self.heads = head_slice(num_heads, num_kv_heads, tp.world_size, tp.rank)
        self.num_heads, self.num_kv_heads = self.heads.num_heads, self.heads.num_kv_heads
        self.head_dim = head_dim
        q, kv = self.num_heads * head_dim, self.num_kv_heads * head_dim
        full = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        super().__init__(hidden_size, full, bias, local_sizes=[q, kv, kv])

    @property
    def q_input_slice(self) -> tuple[int, int]:
        """(first feature, count) of this rank's attention output in o_proj's input."""
        return self.heads.first_head * self.head_dim, self.num_heads * self.head_dim

    def shard_rows(self, shard_id: int) -> tuple[int, int, int]:
        first_head = self.heads.first_head if shard_id == 0 else self.heads.first_kv_head
        return first_head * self.head_dim, sum(self.local_sizes[:shard_id]), self.local_sizes[shard_id]


class RowParallelLinear(Linear):
    """y = sum over ranks of x_r W_r^T, then + b: W_r the rank's columns of W, x_r its slice of the input (the
    output of a column-parallel layer; `input_slice` = (first feature, count) when it is not an even split).
    Output: the full [*, out_features] on every rank."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, input_slice: tuple[int, int] | None = None
    ) -> None:
        tp = get_tp_group()
        self.tp: TPGroup = tp
        self.full_in_features = in_features
        if input_slice is None:
            n = _divide(in_features, tp.world_size, "input features")
            input_slice = (tp.rank * n, n)
        self.input_start = input_slice[0]
        super().__init__(input_slice[1], out_features, bias)
        self.weight.weight_loader = self.weight_loader
        if self.bias is not None:
            self.bias.weight_loader = default_weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        _check_shape(loaded, (self.out_features, self.full_in_features))
        param.data.copy_(loaded.narrow(1, self.input_start, self.in_features))

    def forward_silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        return super().forward_silu_mul(gate_up) if self.tp.world_size == 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return super().forward(x)
        # NOTE: the partial sums add up in a different order than one full matmul, so fp32 results differ from
        # TP=1 in the last bits; the tests check that greedy tokens do not.
        y = self.tp.all_reduce(self.matmul(x, None))
        return y if self.bias is None else y.add_(self.bias)

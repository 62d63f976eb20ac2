"""Deterministic (batch-invariant) inference: whether every op of a loaded model gives each token a result that
depends on that token's own inputs alone, and what the engine's `deterministic` option resolves to.

A request's tokens and logprobs are then bitwise the same whatever else is in the batch, however its prompt was cut
into chunks, and whichever of its blocks came from the prefix cache, swap or a KV connector (a block's bytes are the
same in every case, and every later computation reads them the same way). What holds it on the CPU with the C++
kernels (tests/engine/test_deterministic.py checks the whole):
- attention: every query token is a row of the paged kernel (attention/cpu_kernels.py), which walks the row's
  context block by block from position 0 in the same steps, whatever the chunk, the batch or the blocks' origin;
- the linears and the LM head: kvserve's panel kernels sum each output over k in order from 0 at every row count
  (kernels/csrc/linear.cpp, linear_bf16.cpp); int8: exact int32 sums, scaled per row;
- RMSNorm, RoPE, SiLU, the residual adds: row by row; the fused C++ decoder layer runs the same kernels in the
  same order as the module path;
- sampling (kvserve/sample/sampler.py): a seeded draw is keyed by (seed, position), greedy is an argmax, and the
  top-k of the logprobs breaks ties by the lower token id.
Not batch-invariant: SDPA (its blocking follows the chunk), the torch reference attention (it pads decodes to the
batch's longest context), oneDNN's and torch's matmuls (a Linear left in its plain or oneDNN form), the tensor-
parallel all-reduce of big tensors (gloo's ring splits a tensor by its size), and on the GPU the Triton attention
kernels and cuBLAS.
"""

from __future__ import annotations

from torch import nn

from kvserve.attention.base import AttentionBackend
from kvserve.layers.linear import Linear
from kvserve.layers.parallel_linear import RowParallelLinear


def non_invariant_parts(model: nn.Module, backend: AttentionBackend, block_size: int) -> list[str]:
    """What in `model` (with `backend`'s attention) is not batch-invariant, by name; [] when nothing is."""
    parts = [] if backend.batch_invariant(block_size) else [f"attention ({backend.describe(block_size)})"]
    for name, module in model.named_modules():
        if isinstance(module, Linear) and not module.batch_invariant:
            parts.append(f"{name} (a {'oneDNN' if module._packed is not None else 'torch'} matmul)")
        if isinstance(module, RowParallelLinear) and module.tp.world_size > 1:
            parts.append(f"{name} (the tensor-parallel all-reduce)")
    return parts


def resolve_deterministic(requested: bool | None, model: nn.Module, backend: AttentionBackend, block_size: int) -> str:
    """The mode's state for the start-up line: "on", or "off (why)".

    `requested` True: every part must be batch-invariant, else ValueError naming the parts that are not. None
    (the default): on where every part is batch-invariant without being asked (the C++ kernels with the pair-packed
    bf16 cache), off (naming the first obstacle) elsewhere. False: off, though the model may be batch-invariant
    anyway (the pair-packed bf16 attention is, in either mode)."""
    if requested is False:
        return "off"
    parts = non_invariant_parts(model, backend, block_size)
    if not parts:
        return "on"
    if requested:
        raise ValueError(f"deterministic inference: not batch-invariant here: {'; '.join(parts)}")
    more = f" and {len(parts) - 1} more" if len(parts) > 1 else ""
    return f"off ({parts[0]}{more} not batch-invariant)"

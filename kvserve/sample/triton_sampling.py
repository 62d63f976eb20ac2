"""The random draw of sample/sampler.py as one GPU pass: temperature, Gumbel noise and argmax over [B, V] logits.

The torch form (`sampler.gumbel_sample`) builds the hashed noise in int64 tensors of the logits' size, about
twenty passes over [B, V]: at B = 256 and a 152k vocabulary each pass moves ~0.6 GB, ~4 ms a step on an H200.
Here a program reads its row's logits once in chunks of BLOCK_V, hashes the noise in 32-bit integer registers,
and keeps a running (max, first index): the same hash and the same fp32 operations in the same order (a division
by the temperature correctly rounded, libdevice's log), so it picks what the torch form picks on the GPU, bar a
last-bit difference of a log.

A row with temperature 0 takes the plain argmax of its logits (greedy rows in a sampled batch); ties go to the
lowest index, as torch.argmax does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _mix32(h):
    h = h ^ (h >> 16)
    h = h * 0x7FEB352D
    h = h ^ (h >> 15)
    h = h * 0x846CA68B
    return h ^ (h >> 16)


@triton.jit(do_not_specialize=["vocab_size"])
def _gumbel_argmax_kernel(
    logits_ptr,  # [B, V] fp32
    temp_ptr,  # [B] fp32: 0 = greedy row; unused without HAS_TEMP
    key_ptr,  # [B] int64 noise keys
    out_ptr,  # [B] int64
    stride_row,
    vocab_size,
    HAS_TEMP: tl.constexpr,
    BLOCK_V: tl.constexpr,
    PRECISE_LOG: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    key = tl.load(key_ptr + row)
    key_lo = (key & 0xFFFFFFFF).to(tl.uint32)
    key_hi = ((key >> 32) & 0xFFFFFFFF).to(tl.uint32)
    greedy = False
    temp = 1.0
    if HAS_TEMP:
        temp = tl.load(temp_ptr + row)
        greedy = temp == 0.0
    offs = tl.arange(0, BLOCK_V)
    best_val = float("-inf")
    best_idx = 0
    row_ptr = logits_ptr + row * stride_row
    for start in range(0, vocab_size, BLOCK_V):
        idx = start + offs
        valid = idx < vocab_size
        x = tl.load(row_ptr + idx, mask=valid, other=float("-inf"))
        if greedy:
            val = x
        else:
            h = _mix32(_mix32(idx.to(tl.uint32) ^ key_lo) ^ key_hi)
            u = ((h >> 9).to(tl.float32) + 0.5) / 8388608.0  # exact: 23 bits, a power of 2
            if PRECISE_LOG:  # libdevice's log (tl.log may lower to an approximation); the interpreter lacks it
                g = -libdevice.log(-libdevice.log(u))
            else:
                g = -tl.log(-tl.log(u))
            if HAS_TEMP:
                x = tl.math.div_rn(x, temp)
            val = tl.where(valid, x + g, float("-inf"))
        chunk_max = tl.max(val, 0)
        chunk_idx = tl.min(tl.where(val == chunk_max, idx, vocab_size), 0)  # first index of the max
        better = chunk_max > best_val  # strictly: an earlier chunk keeps a tie
        best_idx = tl.where(better, chunk_idx, best_idx)
        best_val = tl.where(better, chunk_max, best_val)
    tl.store(out_ptr + row, best_idx.to(tl.int64))


def gumbel_argmax(logits: torch.Tensor, keys: torch.Tensor, temperature: torch.Tensor | None = None) -> torch.Tensor:
    """argmax(logits / temperature + G) per row, G the Gumbel noise hashed from each row's key (sampler.py's
    hash_uniform); rows with temperature 0 take argmax(logits). logits [B, V] fp32 (unit stride along V), keys
    [B] int64 and temperature [B] fp32 on logits' device -> [B] int64."""
    num_rows, vocab_size = logits.shape
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    assert logits.dtype == torch.float32 and logits.stride(1) == 1
    has_temp = temperature is not None
    on_gpu = logits.device.type == "cuda"
    _gumbel_argmax_kernel[(num_rows,)](
        logits,
        temperature if has_temp else logits,
        keys,
        out,
        logits.stride(0),
        vocab_size,
        HAS_TEMP=has_temp,
        BLOCK_V=4096 if on_gpu else 1024,
        PRECISE_LOG=on_gpu,
        **({"num_warps": 8} if on_gpu else {}),
    )
    return out

"""Triton kernels for the layers' CUDA paths: RMSNorm (with the residual add), SiLU-and-mul, rotary embedding.

Each replaces a chain of small torch kernels with one launch. At batch 1 a decode step is a few large GEMVs and
hundreds of tiny element-wise kernels; on an H100 the tiny ones cost ~2.3 ms of a Llama-3-8B step's 7.8 ms (measured
by `benchmarks/gpu_suite.py roofline`, docs/benchmarks.md), almost all of it fixed per-kernel time, not bytes.

They reproduce the torch reference's rounding for half types (bf16, fp16): every op the native path rounds to
the model dtype is rounded here too (the residual sum, the normalized row before the weight, each product of the
rotation), so outputs equal `forward_native`'s up to the last bit of a reduction or a special function. The
layers use them for half types only; fp32 models keep the native path, whose bitwise agreement with HF in fp32
is what the parity checks hold.

On the CPU these run in Triton's interpreter (tests only): the layers never pick them there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    out_ptr,
    w_ptr,
    stride_x,
    stride_r,
    stride_o,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(
            x.dtype, fp_downcast_rounding="rtne"
        )  # rounded as torch's add of two half tensors
        tl.store(res_ptr + row * stride_r + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.math.rsqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    y = (xf * inv_rms).to(x.dtype, fp_downcast_rounding="rtne")  # HF casts back before the weight
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(
        out_ptr + row * stride_o + cols,
        (w.to(tl.float32) * y.to(tl.float32)).to(x.dtype, fp_downcast_rounding="rtne"),
        mask=mask,
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """Without `residual`: norm(x), a new tensor. With it: x + residual goes into `residual` and norm(x + residual)
    into `x`, both in place (the CPU kernel's contract), and (x, residual) is returned.
    x (and residual): [T, N] with unit stride along N."""
    n = x.shape[-1]
    out = torch.empty_like(x) if residual is None else x
    res = x if residual is None else residual
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](
            x,
            res,
            out,
            weight,
            x.stride(0),
            res.stride(0),
            out.stride(0),
            n,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=triton.next_power_of_2(n),
            num_warps=min(max(triton.next_power_of_2(n) // 512, 1), 8),
        )
    return out if residual is None else (out, residual)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, d, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(
        gate.dtype, fp_downcast_rounding="rtne"
    )  # torch's silu rounds to the tensor's dtype
    tl.store(
        out_ptr + row * stride_o + cols,
        (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype, fp_downcast_rounding="rtne"),
        mask=mask,
    )


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2 * d] = [gate | up] -> silu(gate) * up [T, d] (rows of any stride, unit stride within a row)."""
    t, d = x.shape[0], x.shape[1] // 2
    out = torch.empty((t, d), dtype=x.dtype, device=x.device)
    block = 1024
    if t:
        _silu_and_mul_kernel[(t, triton.cdiv(d, block))](x, out, x.stride(0), out.stride(0), d, BLOCK=block)
    return out


@triton.jit
def _rotary_kernel(
    x_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    stride_x,
    stride_c,
    num_heads,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, HALF_PAD)
    d_mask = d < HALF
    mask = (heads < num_heads)[:, None] & d_mask[None, :]
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cos_ptr + pos * stride_c + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + pos * stride_c + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    first = x_ptr + t * stride_x + heads[:, None] * (2 * HALF) + d[None, :]
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + HALF, mask=mask, other=0.0)
    out1, out2 = rotate_half(x1, x2, cos, sin)
    tl.store(first, out1, mask=mask)
    tl.store(first + HALF, out2, mask=mask)


@triton.jit
def rotate_half(x1, x2, cos, sin):
    """(x1 * cos - x2 * sin, x2 * cos + x1 * sin) in x's half type, cos/sin fp32: each product rounded, then the
    sum, as the native path on half tensors does. (Rounding named: the interpreter's default cast to bf16
    truncates, the GPU's rounds to nearest even.) Launch with enable_fp_fusion=False (see rotary_)."""
    dt = x1.dtype
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    x1c = (x1f * cos).to(dt, fp_downcast_rounding="rtne").to(tl.float32)
    x2s = (x2f * sin).to(dt, fp_downcast_rounding="rtne").to(tl.float32)
    x2c = (x2f * cos).to(dt, fp_downcast_rounding="rtne").to(tl.float32)
    x1s = (x1f * sin).to(dt, fp_downcast_rounding="rtne").to(tl.float32)
    return (x1c - x2s).to(dt, fp_downcast_rounding="rtne"), (x2c + x1s).to(dt, fp_downcast_rounding="rtne")


def rotary_(positions: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int) -> None:
    """Rotate in place the first `num_heads` heads (rotate-half layout) of each row of x [T, >= num_heads *
    head_dim]; cos/sin [max_position, head_dim // 2] in x's dtype; rows of any stride, unit stride within."""
    half = cos.shape[1]
    block_h = min(triton.next_power_of_2(num_heads), 16)
    if x.shape[0]:
        _rotary_kernel[(x.shape[0], triton.cdiv(num_heads, block_h))](
            x,
            positions,
            cos,
            sin,
            x.stride(0),
            cos.stride(0),
            num_heads,
            HALF=half,
            HALF_PAD=triton.next_power_of_2(half),
            BLOCK_H=block_h,
            # No fused multiply-adds: once the compiler narrows the products to the half type, it would fuse one
            # into the sum unrounded (seen on an H100 with Triton 3.6, whose default is to fuse).
            enable_fp_fusion=False,
        )


@triton.jit
def _qk_norm_kernel(
    x_ptr,
    q_w_ptr,
    k_w_ptr,
    stride_x,
    eps,
    NUM_Q_HEADS: tl.constexpr,
    NUM_HEADS: tl.constexpr,  # query + key heads
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, DIM_PAD)
    dim_valid = dims < HEAD_DIM
    mask = (heads < NUM_HEADS)[:, None] & dim_valid[None, :]
    ptrs = x_ptr + t * stride_x + heads[:, None] * HEAD_DIM + dims[None, :]
    x = tl.load(ptrs, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    inv_rms = tl.math.rsqrt(tl.sum(xf * xf, 1) / HEAD_DIM + eps)
    y = (xf * inv_rms[:, None]).to(x.dtype, fp_downcast_rounding="rtne")  # HF casts back before the weight
    w_q = tl.load(q_w_ptr + dims, mask=dim_valid, other=0.0).to(tl.float32)
    w_k = tl.load(k_w_ptr + dims, mask=dim_valid, other=0.0).to(tl.float32)
    w = tl.where((heads < NUM_Q_HEADS)[:, None], w_q[None, :], w_k[None, :])
    tl.store(ptrs, (w * y.to(tl.float32)).to(x.dtype, fp_downcast_rounding="rtne"), mask=mask)


def qk_norm_(
    x: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float, num_q_heads: int, num_k_heads: int
) -> None:
    """Qwen3's per-head RMSNorm of q and k, in place, in one launch: x [T, >= (num_q_heads + num_k_heads) *
    head_dim] (a fused qkv row: query heads, then key heads; rows of any stride, unit stride within) gets each of
    its first num_q_heads heads normalised with q_weight and the next num_k_heads with k_weight ([head_dim]).
    Rounds as RMSNorm's native path does (two norms over reshaped copies and two write-backs before)."""
    head_dim = q_weight.shape[0]
    num_heads = num_q_heads + num_k_heads
    if x.shape[0]:
        _qk_norm_kernel[(x.shape[0],)](
            x,
            q_weight,
            k_weight,
            x.stride(0),
            eps,
            NUM_Q_HEADS=num_q_heads,
            NUM_HEADS=num_heads,
            HEADS_PAD=triton.next_power_of_2(num_heads),
            HEAD_DIM=head_dim,
            DIM_PAD=triton.next_power_of_2(head_dim),
        )

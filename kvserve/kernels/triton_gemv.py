"""A Triton GEMV for batch-1 decode on the GPU: y[1, N] = x[1, K] W[N, K]^T (+ b), chosen per weight shape by timing.

At batch 1 every linear is a read of its weight. cuBLAS reaches ~95% of the copy bandwidth on the large ones of a
Llama-3-8B step (gate/up, down) but less on the small ones: o (34 MB) runs as a split-K kernel plus a reduce
kernel, 10.8 + 1.6 us a layer on an H200, where this kernel takes 11.4 us in one launch (docs/benchmarks.md). It
is the plain form of a read-bound GEMV: a program owns BLOCK_N output rows and walks K in BLOCK_K tiles, each row's
tile one contiguous wide load, fp32 products summed per lane and reduced once at the end; no split over K, so no
second kernel and no atomics.

Which is faster depends on the shape and the card, so nothing is assumed: `assign_gemv` times every candidate
config and cuBLAS on each distinct weight shape of a loaded model (CUDA-graph replays over copies of the weight
that do not fit in L2, before the decode graphs are captured) and hands a layer the winner, or None where cuBLAS
wins. Half types only: an fp32 model keeps cuBLAS (and its HF parity); the result's rounding is cuBLAS's (fp32
sums, one rounding at the end), only the order of the sum differs. The GPU path is not batch-invariant anyway
(layers/batch_invariant.py).

An MLP's down projection can take its input as [gate | up] and form silu(gate) * up as it loads x (`silu_mul`):
one launch instead of the SiLU-and-mul kernel and the GEMV, with the same bits (x is rounded to the weight's type
exactly as triton_ops.silu_and_mul rounds its output). It is timed against the two launches it replaces and
chosen only where it wins (`Linear.gemv_silu_config`).

On the CPU the kernel runs in Triton's interpreter (tests only).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    num_warps: int


# Few and different: each is one compile per shape at start-up.
CANDIDATES = (
    GemvConfig(block_n=4, block_k=1024, num_warps=4),
    GemvConfig(block_n=2, block_k=2048, num_warps=4),
    GemvConfig(block_n=8, block_k=1024, num_warps=8),
    GemvConfig(block_n=4, block_k=2048, num_warps=8),
)


@triton.jit
def _gemv_kernel(
    x_ptr,  # [K], or [2 K] = [gate | up] with SILU_MUL
    w_ptr,  # [N, K], rows of stride stride_w
    b_ptr,  # [N] or a dummy
    y_ptr,  # [N]
    n,
    k,
    stride_w,
    HAS_BIAS: tl.constexpr,
    SILU_MUL: tl.constexpr,  # x = silu(gate) * up, rounded as triton_ops._silu_and_mul_kernel rounds it
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n
    row_off = rows.to(tl.int64) * stride_w
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        c = k0 + cols
        c_ok = c < k
        if SILU_MUL:
            gate = tl.load(x_ptr + c, mask=c_ok, other=0.0)
            up = tl.load(x_ptr + k + c, mask=c_ok, other=0.0)
            g = gate.to(tl.float32)
            act = (g / (1.0 + tl.exp(-g))).to(gate.dtype, fp_downcast_rounding="rtne")
            x = (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype, fp_downcast_rounding="rtne").to(tl.float32)
        else:
            x = tl.load(x_ptr + c, mask=c_ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + row_off[:, None] + c[None, :], mask=row_ok[:, None] & c_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, 1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)


def gemv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: GemvConfig, silu_mul: bool = False
) -> torch.Tensor:
    """x [1, K] (unit stride), weight [N, K] (unit stride along K) -> [1, N] in x's dtype. With `silu_mul`, x is
    [1, 2 K] = [gate | up] and the GEMV's input is silu(gate) * up."""
    n, k = weight.shape
    assert x.shape == (1, 2 * k if silu_mul else k) and x.stride(1) == 1 and weight.stride(1) == 1
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    launch = {"num_warps": config.num_warps} if x.device.type == "cuda" else {}
    _gemv_kernel[(triton.cdiv(n, config.block_n),)](
        x,
        weight,
        bias if bias is not None else weight,
        y,
        n,
        k,
        weight.stride(0),
        HAS_BIAS=bias is not None,
        SILU_MUL=silu_mul,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        **launch,
    )
    return y


# Bytes the timed calls rotate over: more than any GPU's L2 (50-60 MB on Hopper), so that each call reads its
# weight from HBM as in a model's step, where every layer's weight is read once. Timed on one copy, a 34 MB weight
# stays in L2 and a GEMV looks twice as fast as it is (H200: 6.2 us against 11.4 us inside the model).
ROTATE_BYTES = 256 << 20


def _time_us(call, weights: list[torch.Tensor], reps: int = 10, inner: int = 24) -> float:
    """Median GPU microseconds of one `call(weight)`: `inner` calls, cycling over `weights`, captured in one CUDA
    graph whose replay is timed with CUDA events. A graph, because a Triton launch from Python costs more host
    time than a batch-1 GEMV takes on the GPU: timed eagerly, the host would be measured."""
    for w in weights[:3]:  # compiles, and settles the allocator outside the capture
        call(w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(inner):
            call(weights[i % len(weights)])
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / inner)
    del graph
    times.sort()
    return times[len(times) // 2]


def _rotated(weight: torch.Tensor) -> list[torch.Tensor]:
    """`weight` and copies of it, ROTATE_BYTES in all: timed calls cycle over them, so each reads from HBM."""
    copies = -(-ROTATE_BYTES // (weight.numel() * weight.element_size()))
    return [weight] + [weight.clone() for _ in range(copies - 1)]


def time_candidates(weight: torch.Tensor, bias: torch.Tensor | None) -> dict[str, float]:
    """GPU microseconds per batch-1 call of cuBLAS ("cublas") and each candidate (by its repr) on this weight's
    shape, read from HBM (copies of it rotated, ROTATE_BYTES in all)."""
    x = torch.randn(1, weight.shape[1], dtype=weight.dtype, device=weight.device)
    weights = _rotated(weight)
    out = {"cublas": _time_us(lambda w: torch.nn.functional.linear(x, w, bias), weights)}
    for config in CANDIDATES:
        out[repr(config)] = _time_us(lambda w, config=config: gemv(x, w, bias, config), weights)
    del weights
    return out


def time_silu_candidates(weight: torch.Tensor, bias: torch.Tensor | None, plain: GemvConfig | None) -> dict[str, float]:
    """GPU microseconds of the two launches a down projection takes at batch 1 ("unfused": SiLU-and-mul, then
    the layer's own GEMV `plain`, or cuBLAS where None) and of each candidate with the product fused
    ("silu " + repr), on this weight's shape read from HBM."""
    from kvserve.kernels.triton_ops import silu_and_mul

    x = torch.randn(1, 2 * weight.shape[1], dtype=weight.dtype, device=weight.device)
    weights = _rotated(weight)
    if plain is None:
        out = {"unfused": _time_us(lambda w: torch.nn.functional.linear(silu_and_mul(x), w, bias), weights)}
    else:
        out = {"unfused": _time_us(lambda w: gemv(silu_and_mul(x), w, bias, plain), weights)}
    for config in CANDIDATES:
        out["silu " + repr(config)] = _time_us(lambda w, config=config: gemv(x, w, bias, config, True), weights)
    del weights
    return out


def pick_silu(times: dict[str, float], margin: float = 0.97) -> GemvConfig | None:
    """The fastest fused candidate of `time_silu_candidates`' figures where it beats the two launches by 3%."""
    best = min(CANDIDATES, key=lambda c: times["silu " + repr(c)])
    return best if times["silu " + repr(best)] < margin * times["unfused"] else None


def pick(times: dict[str, float], margin: float = 0.97) -> GemvConfig | None:
    """The fastest candidate of `time_candidates`' figures where it beats cuBLAS by 3% or more, else None."""
    best = min(CANDIDATES, key=lambda c: times[repr(c)])
    return best if times[repr(best)] < margin * times["cublas"] else None


def assign_gemv(model: torch.nn.Module) -> dict[tuple, dict]:
    """Time cuBLAS and the candidates on each distinct (shape, dtype, bias) of `model`'s half-type CUDA linears
    and give each layer its winner (`Linear.gemv_config`). Returns {(N, K, dtype, bias): {"choice", "us"}} for
    the start-up log and the benchmarks."""
    from kvserve.layers.linear import Linear

    chosen: dict[tuple, dict] = {}
    for module in model.modules():
        w = getattr(module, "weight", None)
        if not isinstance(module, Linear) or w is None or not w.is_cuda or w.dtype == torch.float32:
            continue
        if w.stride(1) != 1:
            continue
        key = (w.shape[0], w.shape[1], str(w.dtype).removeprefix("torch."), module.bias is not None)
        if module.takes_silu_mul:
            key = key + ("silu",)
        if key not in chosen:
            times = time_candidates(w.detach(), module.bias)
            chosen[key] = {"choice": pick(times), "us": {k: round(v, 2) for k, v in times.items()}}
            if module.takes_silu_mul:
                try:  # a fused variant that fails to build leaves the layer as it was, never the model unloaded
                    silu = time_silu_candidates(w.detach(), module.bias, chosen[key]["choice"])
                except Exception as e:  # noqa: BLE001
                    logger.warning("the SiLU-fused GEMV on %s could not be timed (%r): not used", key, e)
                else:
                    chosen[key]["silu_choice"] = pick_silu(silu)
                    chosen[key]["us"].update({k: round(v, 2) for k, v in silu.items()})
        module.gemv_config = chosen[key]["choice"]
        module.gemv_silu_config = chosen[key].get("silu_choice")
    torch.cuda.empty_cache()  # the timing copies go back before the KV cache is sized
    for key, entry in chosen.items():
        logger.info(
            "batch-1 linear %s: %s%s (%s)",
            key,
            entry["choice"] or "cublas",
            f", fused with SiLU-and-mul: {entry['silu_choice'] or 'no'}" if "silu_choice" in entry else "",
            ", ".join(f"{k} {v}us" for k, v in entry["us"].items()),
        )
    return chosen

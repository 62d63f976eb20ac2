"""Linear layers, with the weight in the form the CPU matmuls read fastest.

bf16: oneDNN's matmul repacks a plain [out, in] weight into its blocked layout on every call. Packing once after
loading removes that: on an AVX512-BF16 CPU it makes batch-1 GEMVs 2-3x faster (the LM head 3.8 -> 2.0 ms) and
batch-128 GEMMs 1.3-1.5x faster. The packing's batch-size hint hardly matters, so one packing serves all sizes.

fp32 (the default where the CPU has no native bf16): a batch-1 step is bound by streaming the weights, and the
C++ few-row kernel streams plain row-major weights ~1.4x faster than oneDNN's packed GEMV (docs/benchmarks.md),
while for bigger batches F.linear on the plain weight is on par with the packed GEMM, except for the vocab-wide
LM head. So fp32 keeps plain weights, and the LM head a packed copy too.
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.kernels.cpu import load_cpu_kernels
from kvserve.platform import cpu_info

logger = logging.getLogger(__name__)

# Inputs of at most this many rows go to the few-row kernel: each extra row re-reads the weights from cache.
SMALL_M = 4


def cpu_packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


@functools.cache
def _warn_unpacked(dtype: str, why: str) -> None:
    logger.warning("keeping %s weights unpacked: %s", dtype, why)


class Linear(nn.Module):
    """y = x W^T (+ b), W [out_features, in_features]. Parameters are left uninitialised (checkpoints fill them)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight: nn.Parameter | None = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self._packed: torch.Tensor | None = None  # oneDNN blocked copy of the weight (CPU only)
        self._small_kernels: ModuleType | None = None  # the C++ kernels, when they take few-row inputs

    def pack_for_cpu(self, keep_packed_too: bool = False) -> None:
        """Put the weight in the form the CPU matmuls read fastest, once weights are loaded. Irreversible.

        fp32 with the C++ kernels: the plain weight stays, since the few-row kernel (`linear_small`, batch-1
        decode) streams it faster than oneDNN's packed GEMV; bigger batches go through F.linear on it, on par with the
        packed GEMM for the layers' shapes at decode batch sizes (~15% slower in 256+ row prefill chunks: the price
        of not holding a second copy of every weight). `keep_packed_too` also keeps a packed copy for those (the
        LM head, whose vocab-wide GEMM is much faster packed; tied to the embedding, the plain weight costs
        nothing). Otherwise (bf16) the packed form replaces the plain weight.
        """
        assert self.weight is not None
        w = self.weight.detach()
        if w.device.type != "cpu" or w.dtype not in (torch.bfloat16, torch.float32):
            return
        if w.dtype == torch.float32:
            self._small_kernels = load_cpu_kernels()
        keep_plain = self._small_kernels is not None
        if not cpu_packing_available() or (keep_plain and not keep_packed_too):
            return
        if w.dtype == torch.bfloat16 and not cpu_info().native_bf16:
            return  # oneDNN refuses to prepack bf16 without native bf16 (and F.linear then runs emulated)
        try:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
        except RuntimeError as e:  # a CPU oneDNN has no packed kernel for: the plain weight still works
            _warn_unpacked(str(w.dtype), str(e))
            return
        if not keep_plain:
            self.weight = None  # drop our reference (a tied embedding keeps its own)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._small_kernels is not None and x.shape[0] <= SMALL_M:
            return self._small_kernels.linear_small(x, self.weight, self.bias)
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        packed = ", packed" if self._packed is not None else ""
        packed += ", few-row kernel" if self._small_kernels is not None else ""
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}{packed}"

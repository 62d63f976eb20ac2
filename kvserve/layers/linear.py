"""Linear layers with CPU weight prepacking.

oneDNN's bf16/fp32 matmul repacks a plain [out, in] weight into its blocked layout on every call. Packing once
after loading removes that: on this CPU it makes batch-1 GEMVs 2-3x faster (the LM head 3.8 -> 2.0 ms) and
batch-128 GEMMs 1.3-1.5x faster. The packing's batch-size hint hardly matters, so one packing serves all sizes.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.platform import cpu_info

logger = logging.getLogger(__name__)


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

    def pack_for_cpu(self) -> None:
        """Replace the plain weight by its oneDNN-packed form. Irreversible; call once weights are loaded."""
        assert self.weight is not None
        w = self.weight.detach()
        if w.device.type != "cpu" or w.dtype not in (torch.bfloat16, torch.float32) or not cpu_packing_available():
            return
        if w.dtype == torch.bfloat16 and not cpu_info().native_bf16:
            return  # oneDNN refuses to prepack bf16 without native bf16 (and F.linear then runs emulated)
        try:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
        except RuntimeError as e:  # a CPU oneDNN has no packed kernel for: the plain weight still works
            _warn_unpacked(str(w.dtype), str(e))
            return
        # Drop our reference to the plain weight (a tied embedding keeps its own).
        self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        packed = ", packed" if self._packed is not None else ""
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}{packed}"

"""Linear layers, with the weight held once, in the form the CPU matmuls read fastest.

- Native bf16 (AVX512-BF16) with the C++ kernels: kvserve's bf16 pair panels (kernels/csrc/linear_bf16.cpp),
  read by `vdpbf16ps` at every batch size. Against oneDNN's prepacked weight (the form before): the GEMV 1.6-2.5x
  faster on cached weights, the GEMM level with it, each row's result independent of its batch (oneDNN's is not
  for every shape), and the fused C++ decoder layer can run the model (docs/benchmarks.md).
- Native bf16 without them (or an odd input width): oneDNN's matmul repacks a plain [out, in] weight into its
  blocked layout on every call; packing once after loading makes batch-1 GEMVs 2-3x and batch-128 GEMMs 1.3-1.5x
  faster.
- Otherwise (fp32, the default where the CPU has no native bf16, and bf16 asked for on such a CPU) with the C++
  kernels: kvserve's own panel layout (kernels/csrc/linear.cpp), read by one kernel at every batch size. A
  batch-1 step streams it at the rate of a plain read, where oneDNN's packed GEMV reaches about half; batched
  steps run a register-tiled GEMM that, unlike a BLAS call on the plain weight, does not re-pack the weight on
  every call (docs/benchmarks.md has the per-shape figures).
- Neither (no kernels, other devices): the plain weight and F.linear.
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


def cpu_packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


@functools.cache
def _warn_unpacked(dtype: str, why: str) -> None:
    logger.warning("keeping %s weights unpacked: %s", dtype, why)


def _has_pair_panels(kernels: ModuleType | None) -> bool:
    return kernels is not None and kernels.linear_bf16_pairs_supported()


def runs_on_amx(model: nn.Module) -> bool:
    """Whether the model's linears run on AMX tiles (bf16 pair panels, kernels/csrc/linear_bf16.cpp; int8 panels,
    int8_linear.cpp, batched rows), for the start-up line."""
    from kvserve.layers.quant.int8_linear import Int8Linear

    for m in model.modules():
        if isinstance(m, Linear) and m._panel_kind == "bf16_pairs" and m._kernels is not None:
            return bool(m._kernels.linear_bf16_amx_active())
        if isinstance(m, Int8Linear) and m.kernels is not None:
            return bool(m.kernels.int8_linear_amx_active())
    return False


class Linear(nn.Module):
    """y = x W^T (+ b), W [out_features, in_features]. Parameters are left uninitialised (checkpoints fill them).

    After `pack_for_cpu`, at most one of `weight` (plain), `_packed` (oneDNN) and `_panels` (kvserve's layout) is
    held by this module (a tied embedding keeps its own plain matrix).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight: nn.Parameter | None = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self._packed: torch.Tensor | None = None  # oneDNN blocked copy of the weight
        self._panels: torch.Tensor | None = None  # kvserve's own layout, of kind _panel_kind:
        # "float": [P, in, panel width] fp32/bf16 (kernels/csrc/linear.cpp); "bf16_pairs": [P, in / 2, panel width,
        # 2] bf16 (linear_bf16.cpp, AVX512-BF16)
        self._panel_kind = "float"
        self._kernels: ModuleType | None = None  # the C++ kernels, which read _panels
        # CUDA, half types: the Triton GEMV config that beat cuBLAS at batch 1 on this shape (kernels/triton_gemv.py)
        self.gemv_config = None
        # An MLP's down projection (its input is silu(gate) * up): the GEMV config that forms that product as it
        # loads x and beat SiLU-and-mul + the plain path at batch 1, or None (forward_silu_mul).
        self.takes_silu_mul = False
        self.gemv_silu_config = None

    def pack_for_cpu(self) -> None:
        """Put the weight in the form the CPU matmuls read fastest, once weights are loaded. Irreversible."""
        assert self.weight is not None
        w = self.weight.detach()
        if w.device.type != "cpu" or w.dtype not in (torch.bfloat16, torch.float32):
            return
        kernels = load_cpu_kernels()
        if w.dtype == torch.bfloat16 and cpu_info().native_bf16 and w.shape[1] % 2 == 0 and _has_pair_panels(kernels):
            self._kernels = kernels
            self._panels = kernels.pack_linear_weight_bf16_pairs(w)
            self._panel_kind = "bf16_pairs"
            self.weight = None
            return
        if w.dtype == torch.bfloat16 and cpu_info().native_bf16 and cpu_packing_available():
            try:
                self._packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
            except RuntimeError as e:  # a CPU oneDNN has no packed kernel for: try the panels, else stay plain
                _warn_unpacked(str(w.dtype), str(e))
            else:
                self.weight = None  # drop our reference (a tied embedding keeps its own)
                return
        if kernels is None:
            return
        self._kernels = kernels
        self._panels = kernels.pack_linear_weight(w)
        self._panel_kind = "float"
        self.weight = None

    @property
    def batch_invariant(self) -> bool:
        """Whether each output row depends on its input row alone, whatever the number of rows: true of kvserve's
        panel kernels (every output sums k in order from 0 at every row count), not of oneDNN's or torch's matmuls
        (whose blocking and kernels follow the shape)."""
        return self._panels is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x W^T + bias in whichever weight form this module holds (a row-parallel layer adds its bias later)."""
        if self._panels is not None:
            if self._panel_kind == "bf16_pairs":
                return self._kernels.linear_bf16_pairs(x, self._panels, self.out_features, bias)
            return self._kernels.linear_packed(x, self._panels, self.out_features, bias)
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, bias, "none", [], "")
        if self.gemv_config is not None and x.dim() == 2 and x.shape[0] == 1 and x.stride(1) == 1:
            from kvserve.kernels.triton_gemv import gemv

            return gemv(x, self.weight, bias, self.gemv_config)
        return F.linear(x, self.weight, bias)

    def forward_silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """This layer applied to silu(gate) * up of gate_up = [gate | up] in one launch (the same bits as
        SiluAndMul then forward), or None where that path does not apply: no fused config, not one contiguous
        row, or (RowParallelLinear) ranks to reduce over."""
        if self.gemv_silu_config is None or gate_up.dim() != 2 or gate_up.shape[0] != 1 or gate_up.stride(1) != 1:
            return None
        from kvserve.kernels.triton_gemv import gemv

        return gemv(gate_up, self.weight, self.bias, self.gemv_silu_config, silu_mul=True)

    def extra_repr(self) -> str:
        form = ", oneDNN-packed" if self._packed is not None else ""
        if self._panels is not None:
            form = ", bf16 pair panels" if self._panel_kind == "bf16_pairs" else ", panels"
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}{form}"

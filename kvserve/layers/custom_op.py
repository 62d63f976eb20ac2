"""CustomOp: the one place an op's implementation is chosen per platform (vLLM's habit).

An op subclass writes `forward_native` (plain torch: the reference every other path is tested against),
`forward_cpu` (the C++ kernels of kvserve.kernels.cpu) and, when it has one, `forward_cuda` (defaults to native).
The implementation is picked once, when the op is built, from the device it is built for (by default torch's
default device, which the model loader sets to the model's device while it builds the model) and whether the CPU
kernels loaded; `forward` then calls it directly, with no device test per call. A path may still fall back to
native for an input layout its kernel does not take (e.g. a non-contiguous view).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import nn

from kvserve.kernels.cpu import load_cpu_kernels


class CustomOp(nn.Module):
    """Base of ops with per-platform implementations. Holds no parameters of its own.

    `device`: where the op runs (None: torch's default device, the CPU unless a `with torch.device(...)` block
    is active). `use_kernel=False` forces `forward_native` on cpu (tests,
    comparisons); KVSERVE_CPU_KERNELS=0 or a failed build does the same for every op.
    """

    def __init__(self, device: torch.device | str | None = None, use_kernel: bool = True) -> None:
        super().__init__()
        self.device_type = torch.device(device).type if device is not None else torch.get_default_device().type
        # The CPU kernel module, or None when this op does not use it.
        self.kernels: ModuleType | None = None
        if self.device_type == "cpu" and use_kernel:
            self.kernels = load_cpu_kernels()
        self.impl = self._choose_impl()  # "native" | "cpu" | "cuda": fixed for the op's life
        self._forward_impl: Callable[..., Any] = getattr(self, f"forward_{self.impl}")

    def _choose_impl(self) -> str:
        if self.device_type == "cuda":
            return "cuda"
        if self.kernels is not None:
            return "cpu"
        return "native"

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward_impl(*args, **kwargs)

    def forward_native(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def forward_cpu(self, *args: Any, **kwargs: Any) -> Any:
        """The C++ kernel path; `self.kernels` is set whenever this is the chosen implementation."""
        return self.forward_native(*args, **kwargs)

    def forward_cuda(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)

    def extra_repr(self) -> str:
        return f"impl={self.impl}"

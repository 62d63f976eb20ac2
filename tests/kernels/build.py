"""Loading the C++ kernels in tests: a machine with a compiler must build them (a broken build fails the kernel
tests rather than skipping them); without one, or with KVSERVE_CPU_KERNELS=0, the kernel tests are skipped."""

from __future__ import annotations

import os
import shutil
from types import ModuleType

import pytest

from kvserve.kernels.cpu import load_cpu_kernels


def require_kernels() -> ModuleType:
    if os.environ.get("KVSERVE_CPU_KERNELS", "1") == "0":
        pytest.skip("C++ kernels disabled by KVSERVE_CPU_KERNELS=0", allow_module_level=True)
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler on this machine: the pure-torch paths run instead", allow_module_level=True)
    kernels = load_cpu_kernels()
    assert kernels is not None, "the C++ kernels failed to build on a machine with a compiler (see the log)"
    return kernels

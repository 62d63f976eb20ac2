"""JIT-built C++ kernels for the CPU (torch.utils.cpp_extension; needs a C++ compiler and ninja): paged
attention (standard and pair-packed bf16 KV layouts), categorical sampling and the elementwise ops.

Built once per machine and source version into torch's extension cache (~45 s the first time). If the build
fails, or KVSERVE_CPU_KERNELS=0, callers fall back to the pure-torch implementations.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [
    _CSRC / name
    for name in ("bindings.cpp", "paged_attention.cpp", "paged_attention_packed.cpp", "sampling.cpp", "elementwise.cpp")
]


@functools.cache
def load_cpu_kernels() -> ModuleType | None:
    if os.environ.get("KVSERVE_CPU_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import _get_build_directory, load

        digest = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(_CSRC.iterdir()))).hexdigest()[:12]
        name = f"kvserve_cpu_kernels_{digest}"
        if not (Path(_get_build_directory(name, verbose=False)) / f"{name}.so").exists():
            logger.warning("building the C++ CPU kernels (first run on this machine only, ~1 min)")
        return load(
            name=name,
            sources=[str(p) for p in _SOURCES],
            # Built on the machine that runs it, so -march=native picks up AVX-512 where it exists.
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # no compiler, no ninja, unsupported platform
        logger.warning("CPU kernels unavailable (%s); using the slower pure-torch paths", e)
        return None

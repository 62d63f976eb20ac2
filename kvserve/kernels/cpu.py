"""JIT-built C++ kernels for the CPU (torch.utils.cpp_extension; needs a C++ compiler and ninja): paged
attention (standard and pair-packed bf16 KV layouts), categorical sampling, the elementwise ops, the fp32/bf16,
int8 and int4 linear layers and the fused decoder layer.

Built once per machine, source version and ISA level (kvserve.platform: generic, avx2, avx512, avx512_bf16) into
torch's extension cache (~45 s the first time). The level is in the library's name and picks its compiler flags,
so a cache directory shared with (or moved to) a CPU of another level never loads a library built for an ISA that
CPU lacks. If the build fails, or KVSERVE_CPU_KERNELS=0, callers fall back to the pure-torch implementations.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path
from types import ModuleType

from kvserve.platform import cpu_info, kernel_compile_flags

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [
    _CSRC / name
    for name in (
        "bindings.cpp",
        "paged_attention.cpp",
        "paged_attention_chunk.cpp",
        "paged_attention_packed.cpp",
        "paged_attention_packed_fp8.cpp",
        "paged_attention_amx.cpp",
        "sampling.cpp",
        "elementwise.cpp",
        "linear.cpp",
        "linear_bf16.cpp",
        "quant.cpp",
        "int8_linear.cpp",
        "int4_linear.cpp",
        "decoder_layer.cpp",
        "decoder_layer_row.cpp",
    )
]


def kernel_isa() -> str:
    """The ISA level the kernels are (or would be) built for."""
    return cpu_info().isa


def library_name(isa: str) -> str:
    # The sources' place is part of the name: torch rebuilds a library whose build file names other paths, so two
    # checkouts of the same sources (git worktrees) would otherwise rebuild each other's build on every load.
    sources = b"".join(p.read_bytes() for p in sorted(_CSRC.iterdir()))
    digest = hashlib.sha256(str(_CSRC.resolve()).encode() + b"\0" + sources).hexdigest()[:12]
    return f"kvserve_cpu_kernels_{digest}_{isa}"


@functools.cache
def load_cpu_kernels() -> ModuleType | None:
    if os.environ.get("KVSERVE_CPU_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import _get_build_directory, load

        isa = kernel_isa()
        name = library_name(isa)
        if not (Path(_get_build_directory(name, verbose=False)) / f"{name}.so").exists():
            logger.warning("building the C++ CPU kernels for %s (first run on this machine only, ~1 min)", isa)
        kernels = load(
            name=name,
            sources=[str(p) for p in _SOURCES],
            # The level's own ISA flags (never -march=native: see kernel_compile_flags); tuned for this CPU.
            extra_cflags=["-O3", *kernel_compile_flags(isa), "-mtune=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
        # The bf16 and int8 panels and bf16 attention run on AMX tiles where the CPU has them; for A/B runs
        # KVSERVE_CPU_AMX=0 keeps the vector kernels, KVSERVE_CPU_AMX=linears keeps attention on the vectors.
        amx = os.environ.get("KVSERVE_CPU_AMX", "1")
        if amx == "0":
            kernels.linear_amx_set_enabled(False)
        if amx in ("0", "linears"):
            kernels.attention_amx_set_enabled(False)
        return kernels
    except Exception as e:  # no compiler, no ninja, unsupported platform
        logger.warning("CPU kernels unavailable (%s); using the slower pure-torch paths", e)
        return None

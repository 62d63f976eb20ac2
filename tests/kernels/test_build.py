"""The kernels are built for the ISA level kvserve.platform chose (native, or forced by KVSERVE_CPU_ISA), and the
build cache is keyed on that level."""

from __future__ import annotations

from kvserve.kernels.cpu import kernel_isa, library_name
from kvserve.platform import ISA_LEVELS, cpu_info
from tests.kernels.build import require_kernels

K = require_kernels()


def test_library_is_built_for_the_platform_level():
    isa = cpu_info().isa
    assert kernel_isa() == isa
    assert K.__name__ == library_name(isa) and K.__name__.endswith("_" + isa)
    # The vector helpers compiled in: AVX-512 serves both AVX-512 levels.
    assert K.vector_isa() == {"avx512_bf16": "avx512"}.get(isa, isa)


def test_every_level_has_its_own_library_name():
    names = {library_name(level) for level in ISA_LEVELS}
    assert len(names) == len(ISA_LEVELS)


def test_packed_kernel_only_where_avx512_bf16_is_built():
    assert K.packed_kv_supported(64, 3, 16) == (cpu_info().isa == "avx512_bf16")

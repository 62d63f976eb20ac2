"""kvserve.platform: features and ISA level from /proc/cpuinfo, forced lower levels, and the dtype they imply."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

from kvserve import platform
from kvserve.engine.arg_utils import resolve_dtype

ZEN1_FLAGS = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma avx2 bmi2"  # kind B: AVX2 only
ZEN4_FLAGS = ZEN1_FLAGS + " avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_bf16 avx512vbmi"
GRAVITON3_FEATURES = "fp asimd evtstrm aes crc32 atomics fphp asimdhp asimddp sve i8mm bf16"


@pytest.fixture
def fake_cpu(monkeypatch):
    """Pretend to run on another CPU: fake_cpu(flags, arch='x86_64', isa=None)."""

    def install(flags: str, arch: str = "x86_64", isa: str | None = None) -> platform.CpuInfo:
        monkeypatch.setattr(platform, "_read_cpuinfo", lambda: ("Test CPU", set(flags.split())))
        monkeypatch.setattr(platform._pyplatform, "machine", lambda: arch)
        if isa is None:
            monkeypatch.delenv("KVSERVE_CPU_ISA", raising=False)
        else:
            monkeypatch.setenv("KVSERVE_CPU_ISA", isa)
        platform.cpu_info.cache_clear()
        return platform.cpu_info()

    yield install
    platform.cpu_info.cache_clear()


def test_avx2_only_cpu_gets_float32_and_the_avx2_kernels(fake_cpu):
    info = fake_cpu(ZEN1_FLAGS)
    assert info.isa == "avx2" and not info.forced
    assert info.features == {"avx2", "fma", "f16c"}
    assert not info.native_bf16
    assert platform.default_dtype() == "float32"
    assert resolve_dtype("auto") == "float32"
    flags = platform.kernel_compile_flags("avx2")
    assert "-mavx2" in flags and "-mavx512f" not in flags


def test_avx512_bf16_cpu_gets_bfloat16(fake_cpu):
    info = fake_cpu(ZEN4_FLAGS)
    assert info.isa == "avx512_bf16" and info.native_bf16
    assert resolve_dtype("auto") == "bfloat16"


def test_forced_level_hides_the_features_above_it(fake_cpu):
    info = fake_cpu(ZEN4_FLAGS, isa="avx2")
    assert info.isa == "avx2" and info.native_isa == "avx512_bf16" and info.forced
    assert info.features == {"avx2", "fma", "f16c"} and "avx512_bf16" in info.native_features
    assert resolve_dtype("auto") == "float32"
    assert "forced" in info.describe()
    info = fake_cpu(ZEN4_FLAGS, isa="avx512")
    assert info.isa == "avx512" and not info.native_bf16 and "avx512_vnni" in info.features
    info = fake_cpu(ZEN4_FLAGS, isa="generic")
    assert info.isa == "generic" and info.features == frozenset()
    assert platform.kernel_compile_flags("generic") == []


def test_a_level_above_the_cpu_is_not_taken(fake_cpu, caplog):
    with caplog.at_level(logging.WARNING):
        info = fake_cpu(ZEN1_FLAGS, isa="avx512_bf16")
    assert info.isa == "avx2" and not info.forced
    assert "only has avx2" in caplog.text


def test_unknown_level_is_a_clear_error(fake_cpu):
    with pytest.raises(ValueError, match="KVSERVE_CPU_ISA"):
        fake_cpu(ZEN4_FLAGS, isa="sse9")


def test_arm_cpu_uses_generic_kernels_and_its_bf16_flag(fake_cpu):
    info = fake_cpu(GRAVITON3_FEATURES, arch="aarch64")
    assert info.isa == "generic" and info.native_bf16
    assert info.features == {"asimd", "bf16", "sve", "i8mm"}
    assert platform.kernel_compile_flags("generic") == []
    assert resolve_dtype("auto") == "bfloat16"
    info = fake_cpu("fp asimd", arch="aarch64")
    assert not info.native_bf16 and resolve_dtype("auto") == "float32"


def test_explicit_bfloat16_without_native_bf16_runs_with_a_warning(fake_cpu, caplog):
    from kvserve.layers.linear import Linear

    fake_cpu(ZEN1_FLAGS)
    with caplog.at_level(logging.WARNING):
        assert resolve_dtype("bfloat16") == "bfloat16"
    assert "no native bf16" in caplog.text
    assert resolve_dtype("float16") == "float32"  # fp16 is emulated everywhere here: auto's choice instead
    lin = Linear(8, 4)
    w = torch.randn(4, 8).bfloat16()
    lin.weight.data = w
    lin.pack_for_cpu()  # oneDNN would refuse to prepack bf16 on such a CPU: the kernels' panels, or the plain weight
    assert lin._packed is None and (lin._panels is not None or lin.weight is not None)
    x = torch.randn(3, 8).bfloat16()
    torch.testing.assert_close(lin(x).float(), (x @ w.T).float(), rtol=2e-2, atol=2e-2)


def test_forced_level_caps_torch_kernels_too():
    code = (
        "import os, kvserve, torch;print(os.environ.get('ONEDNN_MAX_CPU_ISA'), torch.backends.cpu.get_cpu_capability())"
    )
    env = {**os.environ, "KVSERVE_CPU_ISA": "generic"}
    env.pop("ONEDNN_MAX_CPU_ISA", None)
    env.pop("ATEN_CPU_CAPABILITY", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    if platform.cpu_info().native_isa == "generic":
        assert out.split()[0] == "None"  # nothing to lower
    else:
        assert out.split() == ["SSE41", "DEFAULT"]


def test_startup_summary_names_isa_threads_dtype_and_kernels():
    line = platform.startup_summary("float32", 2, "C++ avx2")
    info = platform.cpu_info()
    assert f"isa={info.isa}" in line and "threads=2/" in line and "dtype=float32" in line and "C++ avx2" in line
    record = platform.platform_record("float32", 2)
    assert record["isa"] == info.isa and record["dtype"] == "float32" and record["threads"] == 2

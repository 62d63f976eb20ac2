"""What this machine's CPU can do, read once; every other module asks here instead of testing flags itself.

Pure Python (no torch import), so anything may use it, and it can set torch's own ISA caps before torch starts.

Kernel ISA levels, lowest to highest (x86-64): "generic" (plain loops, the portable fallback and the only level on
other architectures), "avx2" (AVX2 + FMA + F16C), "avx512" (F/BW/VL/DQ), "avx512_bf16" (adds AVX512-BF16, which
the pair-packed bf16 attention kernel needs, and AVX512-VNNI, which the int8 linear uses). The C++ kernels are built
once per level.

`KVSERVE_CPU_ISA=<level>` forces a lower level than the CPU's (e.g. the AVX2 or generic path on an AVX-512
machine), for tests and for measuring what a smaller CPU would run. A forced level also hides the features above
it from the rest of kvserve (so `dtype="auto"` picks what that CPU would get) and caps torch's own kernels to it
(oneDNN's ONEDNN_MAX_CPU_ISA, ATen's ATEN_CPU_CAPABILITY, MKL's MKL_ENABLE_INSTRUCTIONS) unless those are set
already.
"""

from __future__ import annotations

import functools
import logging
import os
import platform as _pyplatform
from dataclasses import dataclass

logger = logging.getLogger(__name__)

ISA_LEVELS = ("generic", "avx2", "avx512", "avx512_bf16")

# The ISA features kvserve's choices depend on (/proc/cpuinfo names).
X86_FEATURES = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512dq",
    "avx512_vnni",
    "avx_vnni",
    "avx512_bf16",
    "amx_bf16",
    "amx_int8",
    "amx_tile",
)
ARM_FEATURES = ("asimd", "bf16", "sve", "i8mm")

# What each x86 level needs; a level also allows only these features when it is forced.
_LEVEL_NEEDS = {
    "generic": frozenset(),
    "avx2": frozenset({"avx2", "fma", "f16c"}),
    "avx512": frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"}),
    # VNNI too (the int8 linear's vpdpbusd): every CPU with AVX512-BF16 has it.
    "avx512_bf16": frozenset(
        {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16"}
    ),
}
# Features kept when a level is forced (VNNI rides with AVX-512, as on every CPU that has both).
_LEVEL_KEEPS = {
    "generic": frozenset(),
    "avx2": _LEVEL_NEEDS["avx2"],
    "avx512": _LEVEL_NEEDS["avx512"] | {"avx512_vnni"},
    "avx512_bf16": _LEVEL_NEEDS["avx512_bf16"] | {"avx512_vnni"},
}
# Compiler flags per level: explicit ISA extensions rather than -march=native, so a library built for a level runs
# on every CPU that has that level, and the build cache can be keyed on the level alone.
_LEVEL_CFLAGS = {
    "generic": [],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"],
    "avx512_bf16": [
        "-mavx2",
        "-mfma",
        "-mf16c",
        "-mavx512f",
        "-mavx512bw",
        "-mavx512vl",
        "-mavx512dq",
        "-mavx512vnni",
        "-mavx512bf16",
    ],
}
# torch's own caps for a forced level: oneDNN, ATen's vectorised ops, MKL (fp32 BLAS) and fbgemm (the int8
# linears; it ignores the others' caps, and AVX2 is its lowest level).
_TORCH_CAPS = {
    "generic": {
        "ONEDNN_MAX_CPU_ISA": "SSE41",
        "ATEN_CPU_CAPABILITY": "default",
        "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
        "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2",
    },
    "avx2": {
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "ATEN_CPU_CAPABILITY": "avx2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2",
    },
    "avx512": {
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI",
        "ATEN_CPU_CAPABILITY": "avx512",
        "MKL_ENABLE_INSTRUCTIONS": "AVX512",
    },
    "avx512_bf16": {
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
        "ATEN_CPU_CAPABILITY": "avx512",
        "MKL_ENABLE_INSTRUCTIONS": "AVX512",
    },
}


@dataclass(frozen=True)
class CpuInfo:
    arch: str  # platform.machine(): "x86_64", "aarch64", ...
    model_name: str
    native_features: frozenset[str]  # what the CPU reports (of X86_FEATURES / ARM_FEATURES)
    features: frozenset[str]  # what kvserve may use: native_features less whatever a forced level hides
    isa: str  # kernel level in use (ISA_LEVELS)
    native_isa: str  # the highest level the CPU has
    forced: bool  # isa was lowered by KVSERVE_CPU_ISA
    num_cpus: int  # CPUs this process may run on (its affinity mask)

    def has(self, feature: str) -> bool:
        return feature in self.features

    @property
    def native_bf16(self) -> bool:
        """bf16 arithmetic in hardware (AVX512-BF16, AMX, or ARM's BF16 extension). Without it a bf16 matmul is
        emulated, orders of magnitude slower than fp32 (../shared/MACHINE-FACTS.md)."""
        if self.arch in ("aarch64", "arm64"):
            return "bf16" in self.features
        return bool(self.features & {"avx512_bf16", "amx_bf16"})

    def describe(self) -> str:
        shown = [f for f in (*X86_FEATURES, *ARM_FEATURES) if f in self.features]
        forced = f" (forced by KVSERVE_CPU_ISA; CPU has {self.native_isa})" if self.forced else ""
        return f"{self.arch} isa={self.isa}{forced} features={','.join(shown) or 'none'}"


def _read_cpuinfo() -> tuple[str, set[str]]:
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip().lower()
                if key in ("model name", "cpu model") and not model:
                    model = value.strip()
                elif key in ("flags", "features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return model, flags


def _level_of(features: frozenset[str], arch: str) -> str:
    if arch not in ("x86_64", "amd64"):
        return "generic"
    best = "generic"
    for level in ISA_LEVELS:
        if _LEVEL_NEEDS[level] <= features:
            best = level
    return best


def _num_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@functools.cache
def cpu_info() -> CpuInfo:
    arch = _pyplatform.machine().lower()
    model, flags = _read_cpuinfo()
    known = X86_FEATURES if arch in ("x86_64", "amd64") else ARM_FEATURES
    native = frozenset(f for f in known if f in flags)
    native_isa = _level_of(native, arch)
    isa, features = native_isa, native
    wanted = os.environ.get("KVSERVE_CPU_ISA", "").strip().lower()
    if wanted and wanted != "native":
        if wanted not in ISA_LEVELS:
            raise ValueError(f"KVSERVE_CPU_ISA={wanted!r}: use one of native, {', '.join(ISA_LEVELS)}")
        if ISA_LEVELS.index(wanted) > ISA_LEVELS.index(native_isa):
            logger.warning("KVSERVE_CPU_ISA=%s: this CPU only has %s; using %s", wanted, native_isa, native_isa)
        else:
            isa = wanted
            if arch in ("x86_64", "amd64"):
                features = native & _LEVEL_KEEPS[wanted]
            elif wanted == "generic":
                features = frozenset()
    return CpuInfo(
        arch=arch,
        model_name=model,
        native_features=native,
        features=features,
        isa=isa,
        native_isa=native_isa,
        forced=isa != native_isa,
        num_cpus=_num_cpus(),
    )


def default_dtype(device: str = "cpu") -> str:
    """What `dtype="auto"` means on `device`: on the CPU, bfloat16 only where the CPU computes it natively, float32
    elsewhere; on a GPU, bfloat16 where it has bf16 arithmetic (NVIDIA compute capability 8.0 and up), else
    float16."""
    if device.startswith("cuda"):
        import torch

        return "bfloat16" if torch.cuda.is_bf16_supported(including_emulation=False) else "float16"
    return "bfloat16" if cpu_info().native_bf16 else "float32"


def resolve_device(device: str) -> str:
    """`auto` is the GPU when torch sees one ("cuda"), else "cpu". An explicit "cuda" (or "cuda:N") without a
    GPU is refused. torch is imported here, not at module load (see the module docstring)."""
    name = str(device).lower()
    if name == "cpu":
        return name
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" or name.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: torch sees no CUDA GPU here (torch {torch.__version__})")
        return name
    raise ValueError(f"unsupported device {device!r}; use auto, cpu or cuda")


def device_summary(device: str) -> str:
    """The GPU's name, memory and compute capability, for the start-up line; "" on the CPU."""
    if not device.startswith("cuda"):
        return ""
    import torch

    props = torch.cuda.get_device_properties(torch.device(device))
    return f"{props.name}, {props.total_memory / 2**30:.0f} GiB, sm_{props.major}{props.minor}"


def kernel_compile_flags(isa: str) -> list[str]:
    """Compiler flags for the C++ kernels at `isa` (no -march=native: see _LEVEL_CFLAGS)."""
    return list(_LEVEL_CFLAGS[isa]) if cpu_info().arch in ("x86_64", "amd64") else []


def export_torch_isa_caps() -> None:
    """Cap torch's own kernels (oneDNN, ATen's vectorised ops, MKL) at a forced level, so that a forced run measures
    what a CPU of that level would run throughout. Both are read on first use, so this must run before the first
    matmul; `kvserve/__init__.py` calls it. Variables the user set are left alone."""
    if not os.environ.get("KVSERVE_CPU_ISA"):
        return
    info = cpu_info()
    if not info.forced or info.arch not in ("x86_64", "amd64"):
        return
    for name, value in _TORCH_CAPS[info.isa].items():
        os.environ.setdefault(name, value)


def platform_record(dtype: str, num_threads: int) -> dict:
    """What a benchmark ran on, for its JSON: the CPU, its features, the ISA level, threads and dtype."""
    info = cpu_info()
    return {
        "cpu": info.model_name,
        "arch": info.arch,
        "isa": info.isa,
        "native_isa": info.native_isa,
        "forced": info.forced,
        "features": sorted(info.features),
        "native_features": sorted(info.native_features),
        "num_cpus": info.num_cpus,
        "threads": num_threads,
        "dtype": dtype,
    }


def startup_summary(
    dtype: str, num_threads: int, kernels: str, device: str = "cpu", deterministic: str | None = None
) -> str:
    """The one line kvserve logs when an engine starts: CPU, ISA level, threads (and, once an engine has applied
    its thread plan, where the count comes from, the frontend's reserve, binding and OpenMP wait policy), the GPU
    when the model runs on one, dtype and kernels in use, and whether inference is deterministic (batch-invariant:
    "on", or "off (why)")."""
    from kvserve.threads import applied_plan

    info = cpu_info()
    plan = applied_plan()
    how = f" ({plan.describe()})" if plan is not None else ""
    gpu = f"; device={device} ({device_summary(device)})" if device.startswith("cuda") else ""
    return (
        f"kvserve platform: {info.model_name or 'unknown CPU'}; {info.describe()}; threads={num_threads}/"
        f"{info.num_cpus} cpus{how}{gpu}; dtype={dtype}; kernels={kernels}"
        + (f"; deterministic={deterministic}" if deterministic is not None else "")
    )

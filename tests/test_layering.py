"""The directions of ../shared/STYLE.md, checked: who may import what."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "kvserve"


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            # `from kvserve import engine` imports kvserve.engine.
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def within(name: str, *packages: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def package_imports(subpackage: str) -> dict[str, set[str]]:
    return {str(p.relative_to(PKG)): imports_of(p) for p in (PKG / subpackage).rglob("*.py")}


def test_core_never_imports_torch_at_runtime():
    code = "import sys, kvserve.core.scheduler, kvserve.core.kv_cache_manager; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_core_imports_no_model_side_packages():
    forbidden = ("torch", "kvserve.worker", "kvserve.attention", "kvserve.models", "kvserve.layers")
    for path, names in package_imports("core").items():
        bad = [n for n in names if n.startswith(forbidden)]
        assert not bad, f"core/{path} imports {bad}"


def test_worker_never_touches_scheduler_state():
    forbidden = (
        "kvserve.core.scheduler",
        "kvserve.core.block_pool",
        "kvserve.core.kv_cache_manager",
        "kvserve.request",
    )
    for path, names in package_imports("worker").items():
        bad = [n for n in names if n.startswith(forbidden)]
        assert not bad, f"worker/{path} imports {bad}"


def test_models_use_the_attention_interface_only():
    for sub in ("models", "layers"):
        for path, names in package_imports(sub).items():
            bad = [
                n
                for n in names
                if n.startswith(
                    (
                        "kvserve.attention.cpu_kernels",
                        "kvserve.attention.torch_ref",
                        "kvserve.attention.triton_backend",
                        "kvserve.attention.triton_kernels",
                        "kvserve.attention.selector",
                        "kvserve.engine",
                        "kvserve.worker",
                    )
                )
            ]
            assert not bad, f"{sub}/{path} imports {bad}"


def test_only_entrypoints_import_entrypoints():
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG)
        if rel.parts[0] == "entrypoints":
            continue
        bad = [n for n in imports_of(path) if within(n, "kvserve.entrypoints")]
        assert not bad, f"{rel} imports {bad}"


def test_top_level_modules_do_not_import_the_engine_side():
    # __init__.py is the public facade: it re-exports LLM and EngineArgs, lazily (importing kvserve.core stays
    # torch-free), so it is the one top-level module that names kvserve.engine.
    for path in PKG.glob("*.py"):
        if path.name == "__init__.py":
            continue
        bad = [n for n in imports_of(path) if within(n, "kvserve.engine", "kvserve.worker", "kvserve.entrypoints")]
        assert not bad, f"{path.name} imports {bad}"


def test_only_platform_reads_cpuinfo():
    readers = sorted(str(p.relative_to(PKG)) for p in PKG.rglob("*.py") if "/proc/cpuinfo" in p.read_text())
    assert readers == ["platform.py"], f"CPU facts belong in kvserve/platform.py; also read by {readers}"


def test_platform_never_imports_torch():
    code = "import sys, kvserve.platform as p; p.cpu_info(); p.default_dtype(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_engine_never_reaches_into_a_runner():
    """The engine core builds everything from the executor's KVCacheSpec and plain calls: no file of engine/ reads
    an executor's `driver_runner` or a `.runner` attribute (tools and tests may, through the executor)."""
    for path in (PKG / "engine").rglob("*.py"):
        tree = ast.parse(path.read_text())
        bad = [
            node.attr
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr in ("driver_runner", "runner")
        ]
        assert not bad, f"engine/{path.relative_to(PKG / 'engine')} reads {bad}"


def test_core_and_connector_scheduler_sides_stay_torch_free():
    code = (
        "import sys, kvserve.kv_cache_spec, kvserve.core.kv_events, kvserve.kv_transfer.multi, "
        "kvserve.kv_transfer.aggregate, kvserve.kv_transfer.offload.scheduler, kvserve.engine.combinations; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_router_reaches_instances_over_http_only():
    """kvserve/router/ imports no engine, worker, executor, model or server module: only plain shared pieces (the
    chained block hash, the tokenizer and its chat template, the KV event types, the embedded Valkey server)."""
    forbidden = (
        "kvserve.engine",
        "kvserve.worker",
        "kvserve.executor",
        "kvserve.models",
        "kvserve.layers",
        "kvserve.attention",
        "kvserve.entrypoints",
        "kvserve.kv_transfer",
        "torch",
    )
    for path, names in package_imports("router").items():
        bad = [n for n in names if n.startswith(forbidden)]
        assert not bad, f"router/{path} imports {bad}"

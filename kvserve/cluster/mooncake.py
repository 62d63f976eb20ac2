"""Mooncake Store's processes: the master (object metadata, eviction) and a storage node (`mooncake_client`) that
lends its memory to the pool. Both speak TCP and need no metadata server (P2PHANDSHAKE)."""

from __future__ import annotations

import time

from kvserve.cluster.process import Service, free_port, wait_port
from kvserve.kv_transfer.common import mooncake


class MooncakeMaster(Service):
    def __init__(self, host: str = "127.0.0.1", port: int | None = None, netns: str | None = None) -> None:
        self.host = host
        self.port = port or free_port("127.0.0.1" if netns else host)
        metrics = free_port("127.0.0.1" if netns else host)
        argv = [mooncake.binary("mooncake_master"), f"--rpc_port={self.port}", f"--metrics_port={metrics}"]
        argv += [f"--rpc_address={host}", "--default_kv_lease_ttl=2000", "--eviction_high_watermark_ratio=0.9"]
        super().__init__("mooncake-master", argv, env=mooncake.binary_env(), netns=netns)
        wait_port(host, self.port, 20.0, self.proc, netns)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


class MooncakeStorageNode(Service):
    """A `mooncake_client` lending `segment` of its memory to the pool (the blocks live here)."""

    def __init__(self, master: str, host: str = "127.0.0.1", segment: str = "512 MB", netns: str | None = None) -> None:
        port = free_port("127.0.0.1" if netns else host)
        argv = [mooncake.binary("mooncake_client"), f"--host={host}", f"--port={port}"]
        argv += [f"--global_segment_size={segment}", "--local_buffer_size=16 MB", f"--master_server_address={master}"]
        argv += ["--metadata_server=P2PHANDSHAKE", "--protocol=tcp"]
        super().__init__("mooncake-node", argv, env=mooncake.binary_env(), netns=netns)
        wait_port(host, port, 20.0, self.proc, netns)
        time.sleep(0.3)  # the node mounts its segment with the master right after it listens

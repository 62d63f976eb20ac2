"""The pd connector's options (the `kv_transfer_config` keys besides kv_connector, kv_role and engine_id)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from kvserve.config import KVTransferConfig

TRANSPORTS = ("tcp", "mooncake")

_KEYS = (
    "transport",
    "side_channel_host",
    "side_channel_port",
    "lease_s",
    "recompute_on_failure",
    "timeout_s",
    "lease_wait_s",
    "debug_push_stall_s",
)


@dataclass(frozen=True)
class PDOptions:
    # How the producer pushes a request's blocks to a consumer: "tcp" (the side channel's own socket) or
    # "mooncake" (Mooncake's TransferEngine over TCP, P2P handshake: no metadata server). A producer serves "tcp"
    # always and "mooncake" when it is its own transport; the consumer's option picks.
    transport: str = "tcp"
    # The address this instance's side channels (and Mooncake's engine) bind and advertise. None: this host's
    # address on its default route, else loopback. Set it on hosts with several interfaces.
    host: str | None = None
    # Rank r's side channel listens on port + r (vLLM's convention); 0: any free port, advertised in the params.
    port: int = 0
    # How long a producer holds a finished request's blocks for its consumer.
    lease_s: float = 60.0
    # A consumer whose transfer fails recomputes the prompt (True), or ends the request with an error (False).
    recompute_on_failure: bool = True
    # A transfer that makes no progress this long fails (a silent peer); connecting gets a fifth of it (>= 1 s).
    timeout_s: float = 10.0
    # How long a producer's side channel waits for a request it does not know yet (its finish is still on its way
    # from the scheduler to the workers: the consumer may ask first).
    lease_wait_s: float = 5.0
    # Fault injection for tests: a producer stalls this long in the middle of each push (tcp: after half of the
    # bytes; mooncake: before the write), as a congested or dying peer would. 0: off.
    debug_push_stall_s: float = 0.0

    @classmethod
    def from_config(cls, config: KVTransferConfig) -> PDOptions:
        opts = config.options
        unknown = sorted(set(opts) - set(_KEYS))
        if unknown:
            raise ValueError(f"kv_transfer_config: unknown pd option(s) {', '.join(unknown)}; use {', '.join(_KEYS)}")
        transport = opts.get("transport", "mooncake" if config.kv_connector == "MooncakeConnector" else "tcp")
        if transport not in TRANSPORTS:
            raise ValueError(f"kv_transfer_config: transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
        host = opts.get("side_channel_host") or os.environ.get("KVSERVE_PD_HOST") or None
        try:
            port = int(opts.get("side_channel_port", 0))
            lease_s = float(opts.get("lease_s", 60.0))
            timeout_s = float(opts.get("timeout_s", 10.0))
            lease_wait_s = float(opts.get("lease_wait_s", 5.0))
            stall_s = float(opts.get("debug_push_stall_s", 0.0))
        except (TypeError, ValueError) as e:
            raise ValueError(f"kv_transfer_config: bad pd option ({e})") from None
        if not 0 <= port < 65536:
            raise ValueError(f"kv_transfer_config: side_channel_port must be a port number, got {port}")
        if lease_s <= 0 or timeout_s <= 0 or lease_wait_s < 0:
            raise ValueError("kv_transfer_config: lease_s and timeout_s must be positive, lease_wait_s not negative")
        recompute = opts.get("recompute_on_failure", True)
        if not isinstance(recompute, bool):
            raise ValueError(f"kv_transfer_config: recompute_on_failure must be true or false, got {recompute!r}")
        return cls(transport, host, port, lease_s, recompute, timeout_s, lease_wait_s, stall_s)

    @property
    def connect_timeout_s(self) -> float:
        return max(1.0, self.timeout_s / 5)

    def resolved_host(self) -> str:
        return self.host or default_host()


def default_host() -> str:
    """This host's address on its default route (no packet is sent), else loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.254.254.254", 1))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"

"""`kvserve bench pd-transport`: how fast the pd connector moves one request's KV between two processes, against a
raw TCP socket copy of the same bytes.

Two processes, each with a KV pool shaped like a model's (default: the embedded SmolLM2-135M in bf16: 30 layers, 3
KV heads of 64, blocks of 16 tokens, 360 KiB a block), in two network namespaces joined by a veth pair (made here;
root and `ip netns` needed, else `--loopback`). The producer holds leases on blocks; the consumer pulls N blocks
(contiguous on both sides, as fresh allocations are) through the real side channel: connect, handshake, reply,
bytes into its pool (tcp) or Mooncake's write (mooncake). The baseline sends the same bytes over one kept-open
socket (`sendall` of one buffer, `recv_into` one buffer, a one-byte ack): what a copy with no protocol costs.
Each size is timed `--repeat` times (median and best reported).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import socket
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

NS_A, NS_B = "kvpdbA", "kvpdbB"
IP_A, IP_B = "10.231.0.1", "10.231.0.2"


@dataclass
class PoolShape:
    num_layers: int = 30
    num_kv_heads: int = 3
    head_dim: int = 64
    block_size: int = 16
    dtype: str = "bfloat16"
    num_blocks: int = 256

    @property
    def tensor_block_bytes(self) -> int:
        return self.block_size * self.num_kv_heads * self.head_dim * (2 if self.dtype in ("bfloat16", "float16") else 4)

    @property
    def block_bytes(self) -> int:
        return 2 * self.num_layers * self.tensor_block_bytes


def _pool(shape: PoolShape):
    """Per-layer (K, V) tensors in one mapping, as the engine allocates them, every page touched."""
    import torch

    dtype = getattr(torch, shape.dtype)
    per_tensor = shape.num_blocks * shape.tensor_block_bytes
    buf = mmap.mmap(-1, 2 * shape.num_layers * per_tensor, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    flat = torch.frombuffer(buf, dtype=torch.uint8)
    flat.random_(0, 255)  # touch every page, and give the bytes something to carry
    elems = per_tensor // torch.empty((), dtype=dtype).element_size()
    typed = flat.view(dtype)
    tensors = [
        typed[i * elems : (i + 1) * elems].view(shape.num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
        for i in range(2 * shape.num_layers)
    ]
    return [(tensors[2 * i], tensors[2 * i + 1]) for i in range(shape.num_layers)], flat


def _handshake(shape: PoolShape, regions, rank: int = 0):
    from kvserve.attention.spec import AttentionSpec
    from kvserve.kv_cache_spec import KVCacheSpec
    from kvserve.kv_transfer.pd import wire

    spec = KVCacheSpec(
        shape.block_size,
        tuple(AttentionSpec(shape.dtype) for _ in range(shape.num_layers)),
        (shape.block_bytes,),
        f"bench|{shape.dtype}|{shape.num_kv_heads}x{shape.head_dim}|block={shape.block_size}",
    )
    return wire.Handshake.of("bench", spec, rank, regions.block_bytes)


# ---------------------------------------------------------------------------------------------- the two processes


def run_producer(ns: argparse.Namespace) -> None:
    from kvserve.kv_transfer.pd.leases import LeaseTable
    from kvserve.kv_transfer.pd.producer import SideChannelServer
    from kvserve.kv_transfer.pd.regions import KVRegions
    from kvserve.kv_transfer.pd.transport import MooncakeEngine

    shape = PoolShape(**json.loads(ns.shape))
    pool, flat = _pool(shape)
    regions = KVRegions([pool])
    leases = LeaseTable(lease_s=3600)
    mooncake = None
    if ns.transport == "mooncake":
        mooncake = MooncakeEngine(ns.host)
        mooncake.register(regions.memory_ranges())
    server = SideChannelServer(ns.host, 0, _handshake(shape, regions), regions, leases, mooncake, 30.0, 5.0)
    raw = socket.create_server((ns.host, 0))
    print(json.dumps({"port": server.port, "raw_port": raw.getsockname()[1]}), flush=True)
    view = memoryview(flat.numpy())
    for line in sys.stdin:  # "lease NAME N" | "raw" | "quit"
        cmd = line.split()
        if cmd[0] == "lease":
            leases.add(cmd[1], list(range(int(cmd[2]))))
            print("ok", flush=True)
        elif cmd[0] == "raw":
            conn, _ = raw.accept()
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                while header := conn.recv(8):
                    (n,) = struct.unpack("!Q", header)
                    conn.sendall(view[:n])
                    conn.recv(1)
            print("ok", flush=True)
        elif cmd[0] == "quit":
            break
    server.stop()


def run_consumer(ns: argparse.Namespace) -> None:
    from kvserve.kv_transfer.pd.consumer import Puller, PullTask
    from kvserve.kv_transfer.pd.regions import KVRegions
    from kvserve.kv_transfer.pd.transport import MooncakeEngine

    shape = PoolShape(**json.loads(ns.shape))
    pool, flat = _pool(shape)
    regions = KVRegions([pool])
    mooncake = None
    if ns.transport == "mooncake":
        mooncake = MooncakeEngine(ns.host)
        mooncake.register(regions.memory_ranges())
    puller = Puller(_handshake(shape, regions), regions, ns.transport, mooncake, 30.0, 5.0, max_workers=1)
    sizes = ns.sizes
    results: dict = {"pd": {}, "raw": {}}
    ask = sys.stdin
    for n in sizes:
        times = []
        for r in range(ns.repeat):
            name = f"{n}-{r}"
            print(f"lease {name} {n}", flush=True)
            assert ask.readline().strip() == "ok"
            start = time.perf_counter()
            puller.start(PullTask(name, ns.peer, ns.port, name, 0, list(range(n))))
            while True:
                loaded, failed = puller.take_results()
                if loaded or failed:
                    break
                puller.wait(0.05)
            times.append(time.perf_counter() - start)
            if failed:
                raise SystemExit(f"pull failed: {failed}")
        results["pd"][n] = times
    print("raw", flush=True)
    view = memoryview(flat.numpy())
    with socket.create_connection((ns.peer, ns.raw_port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for n in sizes:
            nbytes = n * shape.block_bytes
            times = []
            for _ in range(ns.repeat):
                start = time.perf_counter()
                sock.sendall(struct.pack("!Q", nbytes))
                got = 0
                while got < nbytes:
                    k = sock.recv_into(view[got:nbytes])
                    if not k:
                        raise SystemExit("raw: connection closed")
                    got += k
                sock.sendall(b"k")
                times.append(time.perf_counter() - start)
            results["raw"][n] = times
    print("RESULT " + json.dumps(results), flush=True)
    puller.shutdown()


# ---------------------------------------------------------------------------------------------- the driver


@contextlib.contextmanager
def veth_namespaces() -> Iterator[None]:
    def ip(*argv: str, check: bool = True) -> None:
        subprocess.run(["ip", *argv], check=check, capture_output=True)

    for name in (NS_A, NS_B):
        ip("netns", "del", name, check=False)
    try:
        ip("netns", "add", NS_A)
        ip("netns", "add", NS_B)
        ip("link", "add", "kvpdbvA", "type", "veth", "peer", "name", "kvpdbvB")
        for name, dev, addr in ((NS_A, "kvpdbvA", IP_A), (NS_B, "kvpdbvB", IP_B)):
            ip("link", "set", dev, "netns", name)
            ip("-n", name, "addr", "add", f"{addr}/24", "dev", dev)
            ip("-n", name, "link", "set", dev, "up")
            ip("-n", name, "link", "set", "lo", "up")
        yield
    finally:
        for name in (NS_A, NS_B):
            ip("netns", "del", name, check=False)


def _spawn(role: str, ns_name: str | None, args: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kvserve.benchmarks.pd_transport", "--role", role, *args]
    if ns_name:
        cmd = ["ip", "netns", "exec", ns_name, *cmd]
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def measure(transport: str, shape: PoolShape, sizes: list[int], repeat: int, loopback: bool) -> dict:
    host_a, host_b = ("127.0.0.1", "127.0.0.1") if loopback else (IP_A, IP_B)
    common = ["--shape", json.dumps(shape.__dict__), "--transport", transport]
    producer = _spawn("producer", None if loopback else NS_A, [*common, "--host", host_a])
    consumer = None
    try:
        ports = json.loads(producer.stdout.readline())
        consumer = _spawn(
            "consumer",
            None if loopback else NS_B,
            [
                *common,
                "--host",
                host_b,
                "--peer",
                host_a,
                "--port",
                str(ports["port"]),
                "--raw-port",
                str(ports["raw_port"]),
                "--sizes",
                ",".join(map(str, sizes)),
                "--repeat",
                str(repeat),
            ],
        )
        # Relay the consumer's requests to the producer (leases, the raw phase) until its result.
        for line in consumer.stdout:
            if line.startswith("RESULT "):
                return json.loads(line[7:])
            producer.stdin.write(line)
            producer.stdin.flush()
            if line.startswith("raw"):
                continue  # the producer accepts the consumer's connection; nothing to relay back
            consumer.stdin.write(producer.stdout.readline())
            consumer.stdin.flush()
        raise RuntimeError("the consumer ended without a result")
    finally:
        for p in (consumer, producer):
            if p is not None:
                with contextlib.suppress(Exception):
                    p.stdin.write("quit\n")
                    p.stdin.close()
                with contextlib.suppress(Exception):
                    p.wait(10)
                if p.poll() is None:
                    p.kill()


def mtu() -> str:
    out = subprocess.run(["ip", "-n", NS_A, "link", "show", "kvpdbvA"], capture_output=True, text=True).stdout
    return out.split("mtu ", 1)[1].split()[0] if "mtu " in out else "?"


def main(ns: argparse.Namespace) -> int:
    if ns.role == "producer":
        run_producer(ns)
        return 0
    if ns.role == "consumer":
        run_consumer(ns)
        return 0
    shape = PoolShape(ns.num_layers, ns.kv_heads, ns.head_dim, ns.block_size, ns.dtype, max(ns.sizes) + 1)
    loopback = ns.loopback or os.geteuid() != 0
    where = "loopback" if loopback else "two network namespaces, veth pair"
    rows = []
    with contextlib.nullcontext() if loopback else veth_namespaces():
        link = "" if loopback else f", MTU {mtu()}"
        print(
            f"pd-transport: {where}{link}; a block is {shape.block_bytes / 1024:.0f} KiB "
            f"({2 * shape.num_layers} tensors of {shape.tensor_block_bytes} B); median (best) of {ns.repeat}"
        )
        for transport in ns.transports:
            res = measure(transport, shape, ns.sizes, ns.repeat, loopback)
            for n in ns.sizes:
                nbytes = n * shape.block_bytes
                pd, raw = res["pd"][str(n)], res["raw"][str(n)]
                row = {
                    "transport": transport,
                    "blocks": n,
                    "bytes": nbytes,
                    "pd_ms": statistics.median(pd) * 1000,
                    "pd_best_ms": min(pd) * 1000,
                    "raw_ms": statistics.median(raw) * 1000,
                    "raw_best_ms": min(raw) * 1000,
                }
                row["pd_gbps"] = nbytes / row["pd_ms"] / 1e6
                row["raw_gbps"] = nbytes / row["raw_ms"] / 1e6
                row["ratio"] = row["raw_ms"] / row["pd_ms"]
                rows.append(row)
                print(
                    f"  {transport:8s} {n:4d} blocks ({nbytes / 2**20:6.1f} MiB): pd {row['pd_ms']:7.2f} ms "
                    f"({row['pd_best_ms']:.2f}) {row['pd_gbps']:5.2f} GB/s | raw TCP {row['raw_ms']:7.2f} ms "
                    f"({row['raw_best_ms']:.2f}) {row['raw_gbps']:5.2f} GB/s | pd/raw {row['ratio']:.0%}"
                )
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("pd-transport", help="the pd connector's KV transfer between two processes vs raw TCP")
    add_arguments(p)
    p.set_defaults(func=main)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 128])
    p.add_argument("--transports", type=lambda s: s.split(","), default=["tcp", "mooncake"])
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--loopback", action="store_true", help="both processes on loopback (no namespaces)")
    p.add_argument("--num-layers", type=int, default=30)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--json", default=None)
    # The two processes' own arguments.
    p.add_argument("--role", default="driver", help=argparse.SUPPRESS)
    p.add_argument("--shape", default="{}", help=argparse.SUPPRESS)
    p.add_argument("--transport", default="tcp", help=argparse.SUPPRESS)
    p.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    p.add_argument("--peer", default="127.0.0.1", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--raw-port", type=int, default=0, help=argparse.SUPPRESS)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))

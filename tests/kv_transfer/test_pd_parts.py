"""The pd connector's parts on their own: contiguous runs, the producer's leases (a fake clock), the params both ways,
the handshake's verdicts, and the vectored block I/O between two pools over a socket pair."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from kvserve.attention.spec import AttentionSpec
from kvserve.config import KVTransferConfig
from kvserve.kv_cache_spec import KVCacheSpec
from kvserve.kv_transfer.pd import wire
from kvserve.kv_transfer.pd.leases import LeaseError, LeaseTable
from kvserve.kv_transfer.pd.options import PDOptions
from kvserve.kv_transfer.pd.params import RemoteSource, producer_params
from kvserve.kv_transfer.pd.regions import KVRegions, recv_all, send_all
from kvserve.kv_transfer.pd.runs import paired_runs, runs


def test_runs_merge_consecutive_ids_in_list_order():
    assert runs([]) == []
    assert runs([5, 6, 7, 12, 13, 2]) == [(5, 3), (12, 2), (2, 1)]
    assert runs([3, 3]) == [(3, 1), (3, 1)]
    # Mooncake's example: src [5,6,7,12,13] -> dst [2,3,4,8,9] is two transfers; a break on either side splits.
    assert paired_runs([5, 6, 7, 12, 13], [2, 3, 4, 8, 9]) == [(5, 2, 3), (12, 8, 2)]
    assert paired_runs([1, 2, 3], [7, 8, 10]) == [(1, 7, 2), (3, 10, 1)]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_leases_end_once_each_way():
    clock = Clock()
    leases = LeaseTable(lease_s=10, clock=clock)
    leases.add("a", [1, 2])
    leases.add("b", [3])
    leases.add("c", [4])
    assert leases.take("a", wait_s=0) == [1, 2]
    with pytest.raises(LeaseError, match="already being sent"):
        leases.take("a", wait_s=0)
    leases.release(["a"])  # being sent: the push finishes first
    assert leases.pop_ended() == set()
    leases.sent("a", ok=True)
    leases.release(["b"])
    assert leases.pop_ended() == {"a", "b"} and leases.num_held == 1
    with pytest.raises(LeaseError, match=r"no longer held \(released\)"):
        leases.take("b", wait_s=0)
    clock.now = 10.0
    assert leases.pop_ended() == {"c"} and leases.num_expired == 1 and leases.num_held == 0
    with pytest.raises(LeaseError, match="lease of 10 s expired"):
        leases.take("c", wait_s=0)
    with pytest.raises(LeaseError, match="not held here"):
        leases.take("zzz", wait_s=0)
    assert leases.num_sent == 1


def test_a_release_or_a_pull_may_come_before_the_lease():
    leases = LeaseTable(lease_s=10)
    leases.release(["early"])
    leases.add("early", [9])  # its consumer gave up before the workers heard of it: ended at once
    assert leases.pop_ended() == {"early"} and leases.num_held == 0
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("ids", leases.take("late", wait_s=5)))
    t.start()
    leases.add("late", [4, 5])
    t.join(5)
    assert got == {"ids": [4, 5]}


def test_params_round_trip_and_vllm_style_ports():
    out = producer_params("engine-p", "req-1", [4, 5, 9], [("10.0.0.1", 5000), ("10.0.0.1", 5007)])
    assert out["remote_host"] == "10.0.0.1" and out["remote_port"] == 5000 and out["remote_tp_size"] == 2
    src = RemoteSource.from_params(out, tp_size=2)
    assert src == RemoteSource("engine-p", "req-1", (("10.0.0.1", 5000), ("10.0.0.1", 5007)), 3)
    # vLLM's proxies give one host and port: rank r at port + r.
    legacy = {k: v for k, v in out.items() if k != "remote_ranks"}
    assert RemoteSource.from_params(legacy, tp_size=2).ranks == (("10.0.0.1", 5000), ("10.0.0.1", 5001))
    with pytest.raises(ValueError, match="remote_request_id"):
        RemoteSource.from_params({**out, "remote_request_id": 7}, tp_size=2)


def test_options_are_checked():
    assert PDOptions.from_config(KVTransferConfig("pd")).transport == "tcp"
    assert PDOptions.from_config(KVTransferConfig("MooncakeConnector")).transport == "mooncake"
    with pytest.raises(ValueError, match="unknown pd option"):
        PDOptions.from_config(KVTransferConfig.from_dict({"kv_connector": "pd", "lease": 3}))
    with pytest.raises(ValueError, match="transport must be one of tcp, mooncake"):
        PDOptions.from_config(KVTransferConfig.from_dict({"kv_connector": "pd", "transport": "rdma"}))


def handshake(**changes) -> wire.Handshake:
    spec = KVCacheSpec(16, (AttentionSpec("bfloat16"),) * 2, (1024,), "smollm2|bfloat16|none|packed|tp=1")
    base = wire.Handshake.of("e1", spec, 0, [256, 256, 256, 256])
    return wire.Handshake(**{**{f: getattr(base, f) for f in base.__struct_fields__}, **changes})


def test_the_handshake_names_the_first_difference():
    mine = handshake()
    assert wire.incompatibility(mine, handshake(engine_id="e2")) is None
    assert wire.incompatibility(mine, handshake(engine_id="e2", tp_size=2)) == (
        "tensor-parallel size differs: engine e1 has 1, engine e2 has 2"
    )
    assert "KV block size differs: engine e1 has 16, engine e2 has 32" in wire.incompatibility(
        mine, handshake(engine_id="e2", block_size=32)
    )
    assert wire.incompatibility(mine, handshake(kv_dtype="float32")).startswith("KV dtype differs")
    other = handshake(engine_id="e2", layout_id="smollm2|bfloat16|none|standard|tp=1")
    assert wire.incompatibility(mine, other) == (
        "KV layout differs (model, dtype, quantization or attention backend): engine e1 has 'packed', "
        "engine e2 has 'standard'"
    )


def pool(num_blocks: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two layers in one buffer, as allocate_kv_cache lays them out, filled with a pattern."""
    g = torch.Generator().manual_seed(seed)
    flat = torch.randn(4 * num_blocks * 4 * 2 * 8, generator=g).to(torch.bfloat16)
    t = flat.view(4, num_blocks, 4, 2, 8)
    return [(t[0], t[1]), (t[2], t[3])]


def test_blocks_move_by_runs_straight_into_the_destination_pool():
    src_pool, dst_pool = pool(16, 1), pool(16, 2)
    before = [t.clone() for kv in dst_pool for t in kv]
    src_ids, dst_ids = [3, 4, 5, 9, 1], [7, 8, 2, 3, 15]
    src, dst = KVRegions([src_pool]), KVRegions([dst_pool])
    assert len(src.memory_ranges()) == 1  # the four tensors are one buffer
    a, b = socket.socketpair()
    with a, b:
        t = threading.Thread(target=lambda: send_all(a, src.send_views(src_ids, dst_ids)))
        t.start()
        assert recv_all(b, dst.recv_views(dst_ids)) == src.nbytes(len(src_ids))
        t.join()
    for (sk, sv), (dk, dv), bk, bv in zip(src_pool, dst_pool, before[::2], before[1::2], strict=True):
        for s, d in zip(src_ids, dst_ids, strict=True):
            assert torch.equal(dk[d], sk[s]) and torch.equal(dv[d], sv[s])
        untouched = [i for i in range(16) if i not in dst_ids]
        assert torch.equal(dk[untouched], bk[untouched]) and torch.equal(dv[untouched], bv[untouched])


def test_a_transfer_cut_short_is_an_error():
    src, dst = KVRegions([pool(8, 1)]), KVRegions([pool(8, 2)])
    a, b = socket.socketpair()
    with b:
        views = src.send_views([0, 1, 2], [0, 1, 2])
        a.sendall(views[0])
        a.close()
        with pytest.raises(ConnectionError, match="mid-transfer"):
            recv_all(b, dst.recv_views([0, 1, 2]))

"""The offload connector's pure parts: the tier index (LRU, pins), the block file format, the options."""

from __future__ import annotations

import pytest

from kvserve.config import KVTransferConfig
from kvserve.kv_transfer.offload import disk_format
from kvserve.kv_transfer.offload.index import TierIndex
from kvserve.kv_transfer.offload.options import OffloadOptions


def test_index_evicts_least_recently_used_unpinned():
    index = TierIndex(3)
    for i, h in enumerate([b"a", b"b", b"c"]):
        assert index.make_room() is None
        index.insert(h, i)
    index.touch(b"a")  # order now b, c, a
    index.pin(b"b")
    assert index.make_room() == (b"c", 2)  # b is pinned: c goes
    index.insert(b"d", 2)
    index.pin(b"a")
    index.pin(b"d")
    assert index.make_room() is False  # everything pinned
    index.unpin(b"b")
    assert index.make_room() == (b"b", 1)
    assert index.hashes() == [b"a", b"d"] and index.num_pinned == 2


def test_block_file_round_trip_and_every_kind_of_damage(tmp_path):
    digest = disk_format.layout_digest("model|layout")
    payload = bytes(range(256)) * 4
    path = str(tmp_path / disk_format.file_name(b"\x01" * 16))
    disk_format.write_block(path, digest, payload)
    assert disk_format.read_block(path, digest, len(payload)) == payload
    assert disk_format.hash_of(disk_format.file_name(b"\x01" * 16)) == b"\x01" * 16

    with pytest.raises(disk_format.BadBlockFile, match="another model"):
        disk_format.read_block(path, disk_format.layout_digest("other"), len(payload))
    data = bytearray(open(path, "rb").read())
    data[-1] ^= 1
    open(path, "wb").write(bytes(data))
    with pytest.raises(disk_format.BadBlockFile, match="checksum"):
        disk_format.read_block(path, digest, len(payload))
    open(path, "wb").write(bytes(data[:100]))
    with pytest.raises(disk_format.BadBlockFile, match="size"):
        disk_format.read_block(path, digest, len(payload))
    with pytest.raises(disk_format.BadBlockFile, match="cannot read"):
        disk_format.read_block(str(tmp_path / "missing.kvb"), digest, len(payload))


def test_options_parse_sizes_and_reject_unknown_keys():
    config = KVTransferConfig.from_dict(
        {"kv_connector": "offload", "kv_connector_extra_config": {"cpu_bytes": "2MiB", "disk_path": "/x"}}
    )
    opts = OffloadOptions.from_config(config)
    assert opts.cpu_bytes == 2 << 20 and opts.disk_path == "/x" and opts.disk_bytes == 10 << 30
    with pytest.raises(ValueError, match="unknown offload option"):
        OffloadOptions.from_config(KVTransferConfig.from_dict({"kv_connector": "offload", "ram": 1}))
    with pytest.raises(ValueError, match="kv_connector"):
        KVTransferConfig.from_dict({"cpu_bytes": 1})

"""Contiguous runs of block ids: one transfer per run instead of one per block (Mooncake's merging)."""

from __future__ import annotations


def runs(block_ids: list[int]) -> list[tuple[int, int]]:
    """(first id, length) of each maximal run of consecutive ascending ids, in list order."""
    out: list[tuple[int, int]] = []
    for b in block_ids:
        if out and out[-1][0] + out[-1][1] == b:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((b, 1))
    return out


def paired_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src first, dst first, length) of each maximal run where both lists ascend by one together, in list order:
    what one memory-to-memory transfer can cover."""
    assert len(src) == len(dst), (len(src), len(dst))
    out: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((s, d, 1))
    return out

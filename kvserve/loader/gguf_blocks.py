"""GGUF block formats decoded into int8 codes with per-group scales (and offsets), without going through floats.

A block format stores, per group of 16 or 32 weights, small integer codes q and the group's scale d (and for the
"_1"/K formats with mins, an offset m): w = d * q (+ m). `decode_blocks` returns exactly those integers and the
group factors as fp32, computed the way the `gguf` package computes them, so that

    codes * scale (+ offset)   (fp32, broadcast per group)

is bitwise what `gguf.quants.dequantize` returns. Codes fit int8 in every supported format (Q8_0: -127..127,
Q4_0: -8..7, Q4_1/Q4_K: 0..15, Q6_K: -32..31). This is the exact int8 form of a GGUF tensor; the engine's int8
linear then takes one scale per output channel (what its kernel takes), so loading re-quantizes these
values per channel, within half a channel step (tests/loader/test_gguf_blocks.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QK = 32  # weights per block in Q8_0 / Q4_0 / Q4_1
QK_K = 256  # weights per super-block in the K formats


@dataclass
class BlockInt8:
    codes: np.ndarray  # [rows, cols] int8
    scale: np.ndarray  # [rows, cols // group] fp32
    offset: np.ndarray | None  # [rows, cols // group] fp32, or None for symmetric formats
    group: int  # weights per scale

    def to_float(self) -> np.ndarray:
        """codes * scale (+ offset) in fp32: equal, bit for bit, to gguf.quants.dequantize of the same data."""
        rows, cols = self.codes.shape
        grouped = self.codes.reshape(rows, cols // self.group, self.group).astype(np.float32)
        w = self.scale[..., None] * grouped
        if self.offset is not None:
            w = w + self.offset[..., None]
        return w.reshape(rows, cols)


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, k] bytes -> [n, 2k] codes: the low nibbles of all bytes, then the high nibbles (ggml's order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q8_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, None, int]:
    return b[:, 2:].view(np.int8), _f16(b[:, :2]), None, QK


def _q4_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, None, int]:
    return _nibbles(b[:, 2:]).astype(np.int8) - np.int8(8), _f16(b[:, :2]), None, QK


def _q4_1(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    return _nibbles(b[:, 4:]).astype(np.int8), _f16(b[:, :2]), _f16(b[:, 2:4]), QK


def _q4_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    packed = b[:, 4:16].reshape(n, 3, 4)  # 8 six-bit scales and 8 six-bit mins, see ggml's get_scale_min_k4
    lo, mid, hi = packed[:, 0], packed[:, 1], packed[:, 2]
    sc = np.concatenate([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)  # [n, 8]
    mn = np.concatenate([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], axis=-1)
    # 4 chunks of 32 bytes; each gives two sub-blocks of 32: its low nibbles, then its high nibbles.
    codes = _nibbles(b[:, 16:].reshape(n, 4, 32)).reshape(n, QK_K).astype(np.int8)
    scale = d[:, None] * sc.astype(np.float32)
    offset = -(dmin[:, None] * mn.astype(np.float32))
    return codes, scale, offset, 32


def _q6_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, None, int]:
    n = b.shape[0]
    ql, qh = b[:, :128].reshape(n, 2, 64), b[:, 128:192].reshape(n, 2, 32)
    sc = b[:, 192:208].view(np.int8).astype(np.float32)  # [n, 16]
    d = _f16(b[:, 208:210])
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=-1).reshape(n, 2, 4, 32)  # per half: 4 rows of 32
    high = np.stack([(qh >> s) & 0x03 for s in (0, 2, 4, 6)], axis=2)  # [n, 2, 4, 32]
    codes = (low | (high << 4)).reshape(n, QK_K).astype(np.int8) - np.int8(32)
    return codes, d[:, None] * sc, None, 16


_DECODERS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k, "Q6_K": _q6_k}
SUPPORTED = tuple(_DECODERS)


def decode_blocks(data: np.ndarray, qtype_name: str, shape: tuple[int, int]) -> BlockInt8:
    """`data`: a tensor's raw blocks as the gguf reader gives them (uint8, any shape); `shape`: (rows, cols) of the
    weight in row-major (PyTorch) order."""
    if qtype_name not in _DECODERS:
        raise ValueError(f"no int8 decoding for GGUF type {qtype_name}; supported: {', '.join(SUPPORTED)}")
    rows, cols = shape
    _, group_bytes = _block_layout(qtype_name)
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1, group_bytes)
    codes, scale, offset, group = _DECODERS[qtype_name](blocks)
    return BlockInt8(
        codes=np.ascontiguousarray(codes).reshape(rows, cols),
        scale=scale.reshape(rows, cols // group),
        offset=None if offset is None else offset.reshape(rows, cols // group),
        group=group,
    )


def _block_layout(qtype_name: str) -> tuple[int, int]:
    import gguf

    qtype = gguf.GGMLQuantizationType[qtype_name]
    return gguf.GGML_QUANT_SIZES[qtype]

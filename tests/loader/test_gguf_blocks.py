"""GGUF block formats decoded into int8 codes and group scales exactly as the gguf package dequantizes them,
and the per-channel int8 the engine loads from them within half a channel step."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from kvserve.layers.quant.int8_linear import quantize_per_channel
from kvserve.loader.gguf_blocks import SUPPORTED, decode_blocks


def random_blocks(qtype_name: str, num_blocks: int, seed: int) -> np.ndarray:
    """Random bytes in every field, with the fp16 factors set to finite values of realistic size."""
    rng = np.random.default_rng(seed)
    qtype = gguf.GGMLQuantizationType[qtype_name]
    _, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, size=(num_blocks, nbytes), dtype=np.uint8)
    f16_fields = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q4_K": [0, 2], "Q6_K": [nbytes - 2]}[qtype_name]
    for off in f16_fields:
        vals = (rng.standard_normal(num_blocks) * 0.01).astype(np.float16)
        b[:, off : off + 2] = vals.view(np.uint8).reshape(num_blocks, 2)
    return b


@pytest.mark.parametrize("qtype_name", SUPPORTED)
def test_decode_is_bitwise_gguf_dequantize(qtype_name):
    qtype = gguf.GGMLQuantizationType[qtype_name]
    block_size, _ = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = 6, 2 * max(block_size, 256)
    raw = random_blocks(qtype_name, rows * cols // block_size, seed=len(qtype_name))
    ref = gguf.quants.dequantize(raw.reshape(rows, -1), qtype).reshape(rows, cols)
    dec = decode_blocks(raw, qtype_name, (rows, cols))
    assert dec.codes.dtype == np.int8 and dec.scale.dtype == np.float32
    lo, hi = {"Q8_0": (-128, 127), "Q4_0": (-8, 7), "Q4_1": (0, 15), "Q4_K": (0, 15), "Q6_K": (-32, 31)}[qtype_name]
    assert dec.codes.min() >= lo and dec.codes.max() <= hi
    assert np.array_equal(dec.to_float().view(np.uint32), ref.astype(np.float32).view(np.uint32))


def test_decode_rejects_other_types():
    with pytest.raises(ValueError, match="no int8 decoding"):
        decode_blocks(np.zeros(4, np.uint8), "Q5_K", (1, 256))


def test_embedded_model_tensors_decode_exactly_and_requantize_within_half_a_step(smollm2_gguf):
    from kvserve.loader.gguf_weights import _read

    picked = {}
    for t in _read(smollm2_gguf).tensors:
        if t.tensor_type.name in SUPPORTED and t.tensor_type.name not in picked and t.name.startswith("blk."):
            picked[t.tensor_type.name] = t
    assert "Q4_1" in picked
    for t in picked.values():
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims fastest first
        dec = decode_blocks(t.data, t.tensor_type.name, shape)
        ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
        assert np.array_equal(dec.to_float(), ref)
        w = torch.from_numpy(dec.to_float())
        codes, scale = quantize_per_channel(w)
        assert ((codes.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-5 * w.abs()).all()


def test_parsed_file_cache_holds_few_collector_objects(smollm2_gguf):
    # The cached parse lives as long as the process: GGUFReader itself (a memmap with a dict per part of every
    # vocabulary entry, ~500k objects) made every full garbage collection of an offline engine walk them.
    import gc

    from kvserve.loader.gguf_weights import _read

    _read.cache_clear()
    gc.collect()
    before = len(gc.get_objects())
    parsed = _read(smollm2_gguf)
    gc.collect()
    assert len(gc.get_objects()) - before < 5_000
    assert parsed.fields["general.architecture"] == "llama" and len(parsed.tensors) > 200

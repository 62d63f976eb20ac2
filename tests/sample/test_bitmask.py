"""apply_grammar_bitmask against a per-token loop."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve.sample.bitmask import apply_grammar_bitmask


@pytest.mark.parametrize("every_row", [False, True])
@pytest.mark.parametrize("vocab, mask_vocab", [(100, 100), (100, 70), (77, 96)])
def test_masks_exactly_the_forbidden_tokens_of_the_chosen_rows(vocab, mask_vocab, every_row):
    rng = np.random.default_rng(0)
    num_words = (mask_vocab + 31) // 32
    words = rng.integers(-(2**31), 2**31, size=(4, num_words), dtype=np.int64).astype(np.int32)
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")
    bits[:, mask_vocab:] = 0  # llguidance leaves the bits past its vocabulary clear
    words = np.packbits(bits, axis=1, bitorder="little").view(np.int32)
    logits = torch.randn(6, vocab)
    rows, used = [5, 0, 3], [2, 0, 3]  # bitmask row 1 belongs to a request that is not sampling here
    if every_row:  # every logits row constrained, in order (masked in place)
        logits = logits[:4].clone()
        rows, used = [0, 1, 2, 3], [1, 0, 3, 2]
    expected = logits.clone()
    for row, k in zip(rows, used, strict=True):
        for t in range(vocab):
            allowed = t < mask_vocab and (int(words[k, t // 32]) >> (t % 32)) & 1
            if not allowed:
                expected[row, t] = float("-inf")
    apply_grammar_bitmask(logits, rows, used, words.tobytes(), num_words)
    assert torch.equal(logits, expected)
    free = sorted(set(range(logits.shape[0])) - set(rows))
    assert torch.isinf(logits[rows]).any() and not torch.isinf(logits[free]).any()


@pytest.mark.parametrize("vocab, num_words", [(100, 4), (100, 2), (64, 2)])
def test_device_unpacking_equals_the_host_one(vocab, num_words):
    """The GPU's unpacking (shifts on the device), run here on the CPU, against numpy's."""
    from kvserve.sample.bitmask import allowed_on_device, allowed_on_host

    words = np.random.default_rng(1).integers(-(2**31), 2**31, size=(3, num_words), dtype=np.int64).astype(np.int32)
    host = allowed_on_host(words, vocab)
    assert host.shape == (3, vocab) and host.any() and not host.all()
    assert torch.equal(allowed_on_device(words, vocab, torch.device("cpu")), host)

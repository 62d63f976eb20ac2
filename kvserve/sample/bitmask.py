"""Structured outputs on the logits: tokens a request's grammar forbids get -inf before sampling (and before
the logprobs, as in vLLM, so a constrained request's logprobs are those of what it could sample)."""

from __future__ import annotations

import numpy as np
import torch

from kvserve.sample.sampler import to_device


def apply_grammar_bitmask(
    logits: torch.Tensor,  # [N, V]
    rows: list[int],  # the logits row of each bitmask row used
    used: list[int],  # which bitmask rows (of the scheduler's order) belong to rows
    bitmask: bytes,  # int32 words, num_words per request: bit t of word t // 32 set = token t allowed
    num_words: int,
) -> None:
    if not rows:
        return
    words = np.frombuffer(bitmask, dtype=np.int32).reshape(-1, num_words)[used]  # a copy: fancy indexing
    vocab = logits.shape[1]
    if logits.device.type == "cpu":
        allowed = allowed_on_host(words, vocab)
    else:
        allowed = allowed_on_device(words, vocab, logits.device)
    # torch.where rather than masked_fill: the faster of the two on the CPU for these shapes.
    if rows == list(range(logits.shape[0])):
        torch.where(allowed, logits, logits.new_full((), float("-inf")), out=logits)
    else:
        index = to_device(torch.tensor(rows, dtype=torch.int64), logits.device)
        logits[index] = torch.where(allowed, logits[index], float("-inf"))


def allowed_on_host(words: np.ndarray, vocab: int) -> torch.Tensor:
    """[S, vocab] bool from [S, W] int32 words: numpy's unpacking, one C pass. Tokens past the words' bits come
    out False (never allowed)."""
    bits = np.unpackbits(words.view(np.uint8), axis=1, count=vocab, bitorder="little")
    return torch.from_numpy(bits).view(torch.bool)


def allowed_on_device(words: np.ndarray, vocab: int, device: torch.device) -> torch.Tensor:
    """The same, unpacked on `device`: only the words travel, not a byte per token."""
    words_t = to_device(torch.from_numpy(words), device)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    allowed = ((words_t.unsqueeze(-1) >> shifts) & 1).view(words.shape[0], -1).bool()  # [S, 32 * W]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    return allowed[:, :vocab]

"""ALiBi slopes (Press et al., "Train Short, Test Long"): one fixed slope per attention head.

Head h's score of a key at position k for a query at position p gets slope[h] * (k - p) added after the scale
(kvserve/attention/base.py), a linear penalty on distance in place of position embeddings. The attention backends
take the slopes of a layer's heads as a tensor; models compute them once (`alibi_slopes`) and slice their rank's
heads.
"""

from __future__ import annotations

import math

import torch


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """[num_heads] fp32, computed as HF transformers' BLOOM does (bit for bit): for n a power of two, the
    geometric sequence 2^(-8/n), 2^(-16/n), ..., 2^(-8); otherwise those of the largest power of two n' < n,
    followed by every other slope of the sequence for 2n' (its odd terms), as many as the remaining heads."""
    if num_heads < 1:
        raise ValueError(f"ALiBi needs at least one head, got {num_heads}")
    closest = 2 ** math.floor(math.log2(num_heads))
    # NOTE: fp32 bases and integer powers, as HF takes them, so that the slopes round exactly as HF's do.
    base = torch.tensor(2 ** (-(2 ** -(math.log2(closest) - 3))), dtype=torch.float32)
    slopes = torch.pow(base, torch.arange(1, 1 + closest, dtype=torch.int32))
    if closest != num_heads:
        extra_base = torch.tensor(2 ** (-(2 ** -(math.log2(2 * closest) - 3))), dtype=torch.float32)
        remaining = min(closest, num_heads - closest)
        extra = torch.pow(extra_base, torch.arange(1, 1 + 2 * remaining, 2, dtype=torch.int32))
        slopes = torch.cat([slopes, extra])
    return slopes

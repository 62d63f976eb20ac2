"""A frequency-ranked draft vocabulary (FR-Spec, EAGLE-3's draft vocabulary): the draft's LM head computes the
logits of the N most frequent tokens only, and its picks map back to full vocabulary ids.

Why: a draft step of a small model spends much of its time in the LM head (SmolLM2-135M: 49,152 x 576, 21% of the
weights, read once per draft token). Frequent tokens carry most of the text, so a head over the 16k most frequent
keeps most of the draft's agreement with the target at a third of the head's cost.

Correctness does not depend on the subset: the target verifies every draft. Greedy output is the target's argmax
whatever the draft proposes; a sampled draft's q is zero outside the subset, and the rejection sampler
(kvserve.sample.rejection_sampler) is exact for any q the draft token was drawn from: it accepts x with
min(1, p(x) / q(x)), where q(x) > 0 since x was drawn from q, and on rejection draws from max(0, p - q), which is
p itself outside the subset.

Frequencies: token counts over the full vocabulary ([vocab] int64, `token_counts.npy`) in the folder of the head
or draft model they serve, written by scripts/draft_vocab_counts.py or scripts/train_eagle_head.py from local text
(the Python standard library's docstrings and sources, which ship with every Python). Any N can then be chosen at
load time (`speculative_config={"draft_vocab_size": N}`).
"""

from __future__ import annotations

import os

import numpy as np
import torch
from torch import nn

from kvserve.layers.linear import Linear
from kvserve.layers.quant.int8_linear import Int8Linear

COUNTS_FILE = "token_counts.npy"


def counts_folder(source: str) -> str:
    """Where the counts of a head or draft model live: its folder (a GGUF file's own folder)."""
    return os.path.dirname(source) if os.path.isfile(source) else source


def counts_path(source: str) -> str:
    return os.path.join(counts_folder(source), COUNTS_FILE)


def count_tokens(token_id_lists: list[list[int]], vocab_size: int) -> np.ndarray:
    """[vocab_size] int64: how often each id occurs in the lists."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for ids in token_id_lists:
        counts += np.bincount(np.asarray(ids, dtype=np.int64), minlength=vocab_size)[:vocab_size]
    return counts


def mix_counts(*sources: np.ndarray) -> np.ndarray:
    """Counts of several texts weighted equally whatever their sizes: each one's shares, summed, as int64 (scaled
    so that distinct shares stay distinct)."""
    scale = float(1 << 40)
    mixed = sum(c * (scale / max(int(c.sum()), 1)) for c in sources)
    return np.asarray(mixed).astype(np.int64)


def save_counts(folder: str, counts: np.ndarray) -> str:
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, COUNTS_FILE)
    np.save(path, counts.astype(np.int64))
    return path


def load_counts(source: str, vocab_size: int) -> np.ndarray:
    path = counts_path(source)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"draft_vocab_size needs token counts at {path}: run scripts/draft_vocab_counts.py --out "
            f"{counts_folder(source)}"
        )
    counts = np.load(path)
    if counts.shape != (vocab_size,):
        raise ValueError(f"{path} holds counts of shape {counts.shape}, expected ({vocab_size},)")
    return counts


def draft_vocab_ids(counts: np.ndarray, size: int) -> np.ndarray:
    """[size] int64, ascending: the ids of the `size` largest counts (ties: the lower id first)."""
    if not 0 < size <= len(counts):
        raise ValueError(f"draft_vocab_size must be in 1..{len(counts)}, got {size}")
    ranked = np.argsort(-counts, kind="stable")[:size]
    return np.sort(ranked).astype(np.int64)


def lm_head_rows(target: nn.Module) -> torch.Tensor:
    """[vocab, hidden] the matrix the model's LM head multiplies by, whatever form it holds it in: a plain weight,
    the tied embedding, int8 codes (dequantized), or packed panels (read back by multiplying the identity)."""
    head = target.lm_head
    tp = getattr(head, "slice", None)
    if tp is not None and tp.rows_per_rank != tp.vocab_size:
        raise ValueError("draft_vocab_size needs the whole LM head on one rank (tensor_parallel_size 1)")
    if isinstance(head, Int8Linear):
        return head.dequantize()
    if head.weight is not None:
        return head.weight.detach()
    if target.config.tie_word_embeddings:
        return target.model.embed_tokens.weight.detach()
    # NOTE: x W^T with x = I gives W^T exactly: each output sums one product (the packed kernels keep no form
    # of W besides their panels).
    eye = torch.eye(head.in_features, dtype=torch.get_default_dtype())
    return head(eye.to(next(target.parameters()).dtype)).t().contiguous()


def reduced_lm_head(
    target: nn.Module, ids: np.ndarray, dtype: torch.dtype, device: torch.device, quantization: str | None = None
) -> nn.Module:
    """An LM head over the rows `ids` of the target's, in the target's head's form (int8 if it is int8 or
    `quantization` is "int8", else a Linear in `dtype`, packed for the CPU): its logit j is the target head's
    logit ids[j]."""
    rows = lm_head_rows(target)[torch.from_numpy(ids).to(device=device)]
    head = target.lm_head
    if isinstance(head, Int8Linear) or quantization == "int8":
        rotate = head.rotated if isinstance(head, Int8Linear) else True
        return Int8Linear.from_float(rows.float(), None, rotate=rotate, out_dtype=torch.float32)
    linear = Linear(rows.shape[1], rows.shape[0])
    linear.weight = nn.Parameter(rows.to(dtype=dtype, device=device).contiguous(), requires_grad=False)
    linear.pack_for_cpu()
    return linear


class DraftVocab:
    """The draft's LM head over a subset of the vocabulary, and the map from its columns to full ids."""

    def __init__(
        self,
        target: nn.Module,
        source: str,
        size: int,
        dtype: torch.dtype,
        device: torch.device,
        quantization: str | None = None,
    ) -> None:
        vocab_size = target.config.vocab_size
        ids = draft_vocab_ids(load_counts(source, vocab_size), size)
        self.size = size
        self.token_ids = torch.from_numpy(ids).to(device)  # [size] full id of each logit column
        self.head = reduced_lm_head(target, ids, dtype, device, quantization)

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """normed [A, hidden] (after the final norm) -> [A, size] fp32 logits over the draft vocabulary."""
        return self.head(normed).float()

"""scripts/train_eagle_head.py's held-out score: the head's top-1 agreement with the target over every position,
and over the reply's tokens alone (what speculation drafts), against a per-position count written out here."""

from __future__ import annotations

import torch
from torch import nn

from kvserve.spec_decode.eagle_train import EagleReference, top1_agreement
from tests.spec_decode.test_eagle_head import hf_config


def _per_row_agreement(head, embed, lm_head, seq: list[int], feats: torch.Tensor) -> torch.Tensor:
    """[len(seq) - 1] bool: row i (embedding of token i + 1, feature i) predicts the target's argmax at i + 1."""
    with torch.no_grad():
        pred = head(embed(torch.tensor(seq[1:]))[None].float(), feats[:-1][None])[0]
        return lm_head(pred).argmax(-1) == lm_head(feats[1:]).argmax(-1)


def test_reply_only_score_counts_the_rows_that_predict_reply_tokens():
    torch.manual_seed(0)
    cfg = hf_config()
    head = EagleReference(cfg).eval()
    embed = nn.Embedding.from_pretrained(torch.randn(cfg.vocab_size, cfg.hidden_size))
    lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
    # A small vocabulary of few classes makes agreement common enough that a shifted window changes the count.
    lm_head.weight.data = torch.randn(cfg.vocab_size, cfg.hidden_size)
    lm_head.weight.data[4:] -= 50.0
    seqs = [torch.randint(0, cfg.vocab_size, (n,)).tolist() for n in (17, 23, 9)]
    feats = [torch.randn(len(s), cfg.hidden_size) for s in seqs]
    starts = [5, 11, 2]  # prompt lengths: the reply's first token is at index `start`

    rows = [_per_row_agreement(head, embed, lm_head, s, f) for s, f in zip(seqs, feats, strict=True)]
    # The reply's tokens after its first (index start + 1 on) are predicted by rows start - 1 on.
    want_reply = sum(int(r[s - 1 :].sum()) for r, s in zip(rows, starts, strict=True))
    total_reply = sum(len(s) - st for s, st in zip(seqs, starts, strict=True))
    want_all = sum(int(r.sum()) for r in rows)
    total_all = sum(len(s) - 1 for s in seqs)
    assert 0 < want_reply < total_reply and want_reply != want_all

    assert top1_agreement(head, embed, lm_head, seqs, feats, {})["full"] == want_all / total_all
    assert top1_agreement(head, embed, lm_head, seqs, feats, {}, starts)["full"] == want_reply / total_reply

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


def test_target_distributions_kept_between_updates_fit_the_same_head(monkeypatch):
    """train_head computes each sequence's target distributions once where they fit in memory: the head it fits is
    bit for bit the one computed afresh at every update, with one computation per sequence instead of per update."""
    from kvserve.spec_decode import eagle_train

    cfg = hf_config()
    g = torch.Generator().manual_seed(1)
    embed, lm_head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g), torch.randn(cfg.vocab_size, 64)
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (12, 17, 9, 14, 11)]
    feats = [torch.randn(len(s), cfg.hidden_size, generator=g) for s in seqs]
    calls = []
    probs = eagle_train._target_probs
    monkeypatch.setattr(eagle_train, "_target_probs", lambda *a: calls.append(1) or probs(*a))
    heads = {}
    for budget in (0, 1 << 30):
        monkeypatch.setattr(eagle_train, "_P_TARGET_CACHE_BYTES", budget)
        calls.clear()
        head, _ = eagle_train.train_head(cfg, embed, lm_head, seqs, feats, 0.0, train_steps=12, unroll=True)
        heads[budget] = (head.state_dict(), len(calls))
    (fresh, fresh_calls), (kept, kept_calls) = heads[0], heads[1 << 30]
    assert (fresh_calls, kept_calls) == (12, 4)  # 4 training sequences (one of 5 held out)
    assert all(torch.equal(fresh[k], kept[k]) for k in fresh)


def test_unrolled_passes_predict_the_features_further_ahead():
    """`unroll=2`: pass d (fed pass d - 1's predictions as features, the tokens d positions further on) is scored
    against the target's features d + 1 positions past its inputs' last true one, as the engine's draft d + 1 is.
    Written out here pass by pass; a pass scored one position off changes the loss."""
    from kvserve.spec_decode import eagle_train

    cfg = hf_config()
    torch.manual_seed(2)
    head = EagleReference(cfg)
    embed = nn.Embedding.from_pretrained(torch.randn(cfg.vocab_size, cfg.hidden_size))
    lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
    seq = torch.randint(0, cfg.vocab_size, (13,)).tolist()
    feats = torch.randn(len(seq), cfg.hidden_size)
    probs = eagle_train._target_probs(lm_head, feats)
    with torch.no_grad():
        got = eagle_train._loss(head, embed, lm_head, seq, feats, 0.0, 1.5, 0.5, unroll=2)
        pred = head(embed(torch.tensor(seq[1:]))[None], feats[:-1][None])  # row i: feature i + 1
        want = eagle_train._step_loss(lm_head, pred, feats[None, 1:], probs, 1.5, 0.5)
        shifted = want.clone()
        for depth in (1, 2):  # row i: feature i + 1 + depth
            pred = head(embed(torch.tensor(seq[1 + depth :]))[None], pred[:, :-1])
            want += eagle_train._step_loss(lm_head, pred, feats[None, 1 + depth :], probs[:, depth:], 1.5, 0.5)
            shifted += eagle_train._step_loss(lm_head, pred, feats[None, depth:-1], probs[:, depth - 1 : -1], 1.5, 0.5)
    assert torch.allclose(got, want) and not torch.allclose(got, shifted)
    # bf16 autocast trains the same way (a few updates, a finite loss).
    _, result = eagle_train.train_head(
        cfg,
        embed.weight,
        lm_head.weight.detach(),
        [seq] * 4,
        [feats] * 4,
        0.0,
        train_steps=3,
        unroll=2,
        autocast_bf16=True,
    )
    assert torch.isfinite(torch.tensor(result.final_loss))


def test_a_draft_vocabulary_trains_on_its_tokens_distributions_only():
    """`train_vocab`: the loss sees the head's and the target's distributions over those tokens only (the target's
    renormalised over them, as a softmax over their logits is): the same head as training against an LM head that
    has only those rows, and not the head the whole vocabulary trains."""
    from kvserve.spec_decode import eagle_train

    cfg = hf_config()
    g = torch.Generator().manual_seed(3)
    embed, lm_head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g), torch.randn(cfg.vocab_size, 64)
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (12, 17, 9, 14, 11)]
    feats = [torch.randn(len(s), cfg.hidden_size, generator=g) for s in seqs]
    ids = torch.arange(0, cfg.vocab_size, 3)

    def fit(lm, **kw):
        head, _ = eagle_train.train_head(cfg, embed, lm, seqs, feats, 0.0, train_steps=6, unroll=1, **kw)
        return head.state_dict()

    sub = fit(lm_head, train_vocab=ids)
    rows_only = fit(lm_head[ids])  # scores are then meaningless, the update is the same
    full = fit(lm_head)
    assert all(torch.equal(sub[k], rows_only[k]) for k in sub)
    assert not all(torch.equal(sub[k], full[k]) for k in sub)

"""Rejection sampler: the emitted tokens follow the target distribution (after top-k / top-p) whatever the
drafts, checked with >= 20,000 draws per tested position (KL and a chi-square test that rejects a wrong
sampler); greedy acceptance; seeded reproducibility; one-hot drafts give the plain sampler's tokens."""

from __future__ import annotations

import pytest
import torch

from kvserve.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID, DraftInputs, RejectionSampler
from kvserve.sample.sampler import Sampler, SamplingMetadata, apply_top_k_top_p
from tests.sample.test_sampler import md

VOCAB = 6
# Target distribution per draft position (and the bonus position last); differ per position so that a sampler
# mixing positions up fails.
P = torch.tensor(
    [
        [0.55, 0.2, 0.1, 0.08, 0.05, 0.02],
        [0.1, 0.6, 0.15, 0.05, 0.05, 0.05],
        [0.05, 0.1, 0.65, 0.1, 0.05, 0.05],
        [0.3, 0.05, 0.05, 0.5, 0.05, 0.05],
        [0.05, 0.05, 0.05, 0.05, 0.2, 0.6],
    ]
)
# Draft distributions: close enough to P for deep positions to be reached often, far enough to need rejections.
Q = torch.tensor(
    [
        [0.4, 0.3, 0.1, 0.1, 0.05, 0.05],
        [0.2, 0.4, 0.2, 0.1, 0.05, 0.05],
        [0.1, 0.1, 0.5, 0.2, 0.05, 0.05],
        [0.2, 0.1, 0.1, 0.4, 0.1, 0.1],
    ]
)
# One-hot drafts (an n-gram's guesses) are drawn mostly from the target's mode, the way a useful proposer is.
ONE_HOT_DRAFTS = 0.75 * torch.nn.functional.one_hot(P[:4].argmax(dim=-1), 6) + 0.25 * Q
MIN_DRAWS = 20_000


def metadata(num_rows: int, seed: int, **kw) -> SamplingMetadata:
    return md(num_rows, generator=torch.Generator().manual_seed(seed), **kw)


def run(k: int, batch: int, full_q: bool, seed: int, truncate: dict | None = None, q: torch.Tensor = Q):
    """`batch` requests with k drafts each drawn from `q` (Q by default); returns (output ids [B, k + 1], counts
    [B])."""
    g = torch.Generator().manual_seed(seed)
    source = q if full_q else ONE_HOT_DRAFTS
    drafts = torch.stack([torch.multinomial(source[j], batch, replacement=True, generator=g) for j in range(k)], 1)
    positions = list(range(k)) + [len(P) - 1]  # drafts' positions, then the bonus position
    logits = P[positions].log().repeat(batch, 1)  # [B * (k + 1), V], request-major
    n = batch * (k + 1)
    kw = {}
    if truncate:
        kw = {
            name: torch.full((n,), v, dtype=torch.int64 if name == "top_k" else torch.float32)
            for name, v in truncate.items()
        }
    md = metadata(n, seed, **kw)
    inputs = DraftInputs(
        draft_token_ids=drafts,
        num_draft_tokens=torch.full((batch,), k, dtype=torch.int64),
        draft_probs=q[:k].expand(batch, k, VOCAB).contiguous() if full_q else None,
    )
    out = RejectionSampler(Sampler())(logits, md, inputs)
    return out.output_token_ids, out.num_output_tokens


def expected(position: int, truncate: dict | None) -> torch.Tensor:
    logits = P[position].log()[None]
    if truncate:
        top_k = torch.tensor([truncate["top_k"]]) if "top_k" in truncate else None
        top_p = torch.tensor([truncate["top_p"]]) if "top_p" in truncate else None
        logits = apply_top_k_top_p(logits, top_k, top_p)
    return torch.softmax(logits, dim=-1)[0]


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test over the target's support; mass outside the support fails outright."""
    support = probs > 0
    if int(counts[~support].sum()) > 0:
        return 0.0
    n = counts.sum()
    exp = n * probs[support]
    stat = ((counts[support] - exp) ** 2 / exp).sum()
    df = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat.double() / 2))


def kl(counts: torch.Tensor, probs: torch.Tensor) -> float:
    emp = counts / counts.sum()
    nz = emp > 0
    return float((emp[nz] * (emp[nz] / probs[nz]).log()).sum())


def check_position(tokens: torch.Tensor, probs: torch.Tensor) -> None:
    assert len(tokens) >= MIN_DRAWS, f"only {len(tokens)} draws"
    counts = torch.bincount(tokens, minlength=VOCAB).double()
    assert kl(counts, probs.double()) < 0.01
    assert chi_square_pvalue(counts, probs.double()) > 1e-3


@pytest.mark.parametrize("full_q", [False, True], ids=["one-hot", "full-q"])
@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("truncate", [None, {"top_k": 3}, {"top_p": 0.7}], ids=["plain", "top-k", "top-p"])
def test_output_distribution_matches_target(k, full_q, truncate):
    # One-hot drafts are accepted less often, so they need more requests to reach the deepest position.
    batch = {(1, False): 50_000, (1, True): 40_000, (4, False): 340_000, (4, True): 150_000}[(k, full_q)]
    out, num_out = run(k, batch, full_q, seed=k * 10 + full_q, truncate=truncate)
    positions = list(range(k)) + [len(P) - 1]
    for j, position in enumerate(positions):
        reached = num_out > j
        check_position(out[reached, j], expected(position, truncate))


# A draft over part of the vocabulary (kvserve.spec_decode.draft_vocab): q is zero outside it, at position 3
# at the target's favourite token (3).
Q_SUBSET = torch.tensor(
    [
        [0.6, 0.25, 0.15, 0.0, 0.0, 0.0],
        [0.1, 0.7, 0.2, 0.0, 0.0, 0.0],
        [0.0, 0.15, 0.75, 0.1, 0.0, 0.0],
        [0.6, 0.0, 0.0, 0.0, 0.2, 0.2],
    ]
)


@pytest.mark.parametrize("k", [1, 4])
def test_output_distribution_matches_target_with_draft_over_a_subset(k):
    """q = 0 outside the draft's subset: the tokens outside come from the residual max(0, p - q) = p alone."""
    out, num_out = run(k, {1: 40_000, 4: 100_000}[k], full_q=True, seed=70 + k, q=Q_SUBSET)
    positions = list(range(k)) + [len(P) - 1]
    for j, position in enumerate(positions):
        check_position(out[num_out > j, j], expected(position, None))


def test_chi_square_rejects_a_wrong_sampler():
    """The check fails for a sampler that keeps every draft (its output is Q, not P)."""
    g = torch.Generator().manual_seed(0)
    drafts = torch.multinomial(Q[0], MIN_DRAWS, replacement=True, generator=g)
    counts = torch.bincount(drafts, minlength=VOCAB).double()
    assert chi_square_pvalue(counts, P[0].double()) < 1e-6
    assert kl(counts, P[0].double()) > 0.01


def test_structure_of_outputs():
    out, num_out = run(4, 2000, full_q=True, seed=3)
    pos = torch.arange(5)[None, :]
    assert bool(((out == PLACEHOLDER_TOKEN_ID) == (pos >= num_out[:, None])).all())
    assert int(num_out.min()) >= 1 and int(num_out.max()) == 5


def test_greedy_accepts_while_draft_is_argmax():
    vocab = 8
    logits = torch.randn(4 + 1 + 4, vocab, generator=torch.Generator().manual_seed(1))
    am = logits.argmax(dim=-1)
    # Request 0: 3 drafts (rows 0-3), the second wrong. Request 1: none (row 4). Request 2: 3 right (rows 5-8).
    wrong = (am[1] + 1) % vocab
    drafts = torch.tensor([[am[0], wrong, am[2]], [0, 0, 0], [am[5], am[6], am[7]]])
    md = metadata(9, 0, all_greedy=True, temperature=None)
    for probs in (None, torch.full((3, 3, vocab), 1 / vocab)):
        out = RejectionSampler(Sampler())(logits, md, DraftInputs(drafts, torch.tensor([3, 0, 3]), probs))
        assert out.num_output_tokens.tolist() == [2, 1, 4]
        assert out.output_token_ids[0].tolist() == [am[0], am[1], -1, -1]
        assert out.output_token_ids[1].tolist() == [am[4], -1, -1, -1]
        assert out.output_token_ids[2].tolist() == am[5:9].tolist()


@pytest.mark.parametrize("full_q", [False, True])
def test_seeded_rows_are_reproducible(full_q):
    batch, k = 64, 3
    logits = torch.randn(batch * (k + 1), 50, generator=torch.Generator().manual_seed(2))
    drafts = torch.randint(0, 50, (batch, k), generator=torch.Generator().manual_seed(3))
    probs = torch.softmax(torch.randn(batch, k, 50), dim=-1) if full_q else None
    inputs = DraftInputs(drafts, torch.full((batch,), k), probs)
    seeds = {r: (7, 100 + r) for r in range(batch * (k + 1))}
    a = RejectionSampler(Sampler())(logits, metadata(len(logits), 0, seeds=seeds), inputs)
    b = RejectionSampler(Sampler())(logits, metadata(len(logits), 99, seeds=seeds), inputs)
    assert torch.equal(a.output_token_ids, b.output_token_ids)


def test_one_hot_drafts_emit_the_plain_samplers_tokens():
    """With one-hot drafts, every emitted token is the plain sampler's draw at that position (same keys)."""
    batch, k, vocab = 32, 4, 100
    logits = torch.randn(batch * (k + 1), vocab, generator=torch.Generator().manual_seed(4))
    seeds = {r: (11, r) for r in range(len(logits))}
    plain = Sampler()(logits, metadata(len(logits), 0, seeds=seeds)).sampled_token_ids.view(batch, k + 1)
    # Drafts equal to the plain draws for the first half of the positions, then something else.
    drafts = plain[:, :k].clone()
    drafts[:, 2] = (drafts[:, 2] + 1) % vocab
    out = RejectionSampler(Sampler())(
        logits, metadata(len(logits), 5, seeds=seeds), DraftInputs(drafts, torch.full((batch,), k))
    )
    assert out.num_output_tokens.tolist() == [3] * batch
    assert torch.equal(out.output_token_ids[:, :3], plain[:, :3])

"""Sampler: exact supports of top-k/top-p/min-p on known distributions, statistical checks of the draw,
seeded reproducibility independent of the batch, penalties, banned tokens and logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from kvserve.sample.sampler import (
    Argmax,
    Sampler,
    SamplingMetadata,
    TopK,
    TopLogProbs,
    apply_min_p,
    apply_top_k_top_p,
    gumbel_sample,
)

PROBS = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
LOGITS = PROBS.log()


def md(b: int, **kw) -> SamplingMetadata:
    base = dict(
        all_greedy=False,
        temperature=torch.ones(b),
        top_k=None,
        top_p=None,
        min_p=None,
        seeds={},
        generator=torch.Generator().manual_seed(0),
        presence_penalty=None,
        frequency_penalty=None,
        repetition_penalty=None,
        output_token_ids=None,
        prompt_token_ids=None,
        banned_tokens=[],
        max_num_logprobs=None,
    )
    base.update(kw)
    return SamplingMetadata(**base)


def support(logits: torch.Tensor) -> set[int]:
    return set(torch.isfinite(logits).nonzero().flatten().tolist())


@pytest.mark.parametrize("top_k,expected", [(1, {0}), (2, {0, 1}), (4, {0, 1, 2, 3}), (5, {0, 1, 2, 3, 4})])
def test_top_k_support(top_k, expected):
    out = apply_top_k_top_p(LOGITS[None], torch.tensor([top_k]), None)
    assert support(out[0]) == expected


@pytest.mark.parametrize(
    "top_p,expected",
    [(0.3, {0}), (0.6, {0, 1}), (0.8, {0, 1, 2}), (0.95, {0, 1, 2, 3}), (1.0, {0, 1, 2, 3, 4})],
)
def test_top_p_support_is_smallest_set_reaching_p(top_p, expected):
    out = apply_top_k_top_p(LOGITS[None], None, torch.tensor([top_p]))
    assert support(out[0]) == expected
    # Surviving logits are unchanged (no renormalisation in logit space beyond masking).
    kept = sorted(expected)
    torch.testing.assert_close(out[0, kept], LOGITS[kept])


@pytest.mark.parametrize("min_p,expected", [(0.0, {0, 1, 2, 3, 4}), (0.2, {0, 1, 2}), (0.4, {0, 1}), (1.0, {0})])
def test_min_p_support(min_p, expected):
    assert support(apply_min_p(LOGITS[None], torch.tensor([min_p]))[0]) == expected


def test_top_k_and_top_p_together_per_row():
    logits = LOGITS.repeat(3, 1)
    out = apply_top_k_top_p(logits, torch.tensor([3, 5, 1]), torch.tensor([0.6, 0.95, 1.0]))
    assert [support(r) for r in out] == [{0, 1}, {0, 1, 2, 3}, {0}]


def test_top_k_keeps_ties_with_kth():
    logits = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.0]])
    assert support(apply_top_k_top_p(logits, torch.tensor([2]), None)[0]) == {1, 2, 3}


@pytest.fixture(params=[True, False], ids=["cpp-kernel", "torch"])
def sampler(request) -> Sampler:
    s = Sampler(use_kernel=request.param)
    assert (s.gumbel.impl == "cpu") == request.param, "the C++ kernels failed to build"
    return s


def frequencies(sampler: Sampler, logits: torch.Tensor, n: int, **kw) -> torch.Tensor:
    rows = logits.repeat(n, 1)
    out = sampler(rows, md(n, **kw)).sampled_token_ids
    return torch.bincount(out, minlength=logits.shape[-1]).float() / n


def assert_close_to(freq: torch.Tensor, probs: torch.Tensor, n: int) -> None:
    # 5 sigma per category: a correct sampler fails this about once in millions of runs.
    sigma = (probs * (1 - probs) / n).sqrt()
    assert ((freq - probs).abs() <= 5 * sigma + 1e-9).all(), (freq, probs)


def test_random_draw_matches_distribution(sampler):
    n = 40_000
    assert_close_to(frequencies(sampler, LOGITS, n), PROBS, n)


def test_draw_over_a_large_vocabulary(sampler):
    """49k-entry rows like the real model's, with a known distribution over a few hundred tokens."""
    n, vocab = (4_000 if sampler.gumbel.impl == "cpu" else 500), 49_152  # the torch fallback is slow at 49k
    torch.manual_seed(0)
    support = torch.randperm(vocab)[:300]
    logits = torch.full((vocab,), float("-inf"))
    logits[support] = torch.randn(300)
    out = sampler(logits.repeat(n, 1), md(n)).sampled_token_ids
    assert set(out.tolist()) <= set(support.tolist())
    probs = torch.softmax(logits, -1)
    top = support[probs[support].argmax()].item()
    assert abs((out == top).float().mean().item() - probs[top].item()) < 5 * (probs[top] / n) ** 0.5 + 1e-3


def test_temperature_sharpens_distribution(sampler):
    n = 40_000
    freq = frequencies(sampler, LOGITS, n, temperature=torch.full((n,), 0.5))
    expected = PROBS**2 / (PROBS**2).sum()
    assert_close_to(freq, expected, n)


def test_top_p_draw_renormalises_over_support(sampler):
    n = 40_000
    freq = frequencies(sampler, LOGITS, n, top_p=torch.full((n,), 0.8))
    expected = torch.tensor([0.5, 0.25, 0.15, 0.0, 0.0]) / 0.9
    assert_close_to(freq, expected, n)
    assert freq[3] == 0 and freq[4] == 0


def test_greedy_rows_take_argmax_in_mixed_batch():
    logits = torch.randn(6, 50)
    temps = torch.tensor([0.0, 1.0, 0.0, 2.0, 0.0, 1.0])
    out = Sampler()(logits, md(6, temperature=temps)).sampled_token_ids
    greedy = logits.argmax(-1)
    assert out[[0, 2, 4]].tolist() == greedy[[0, 2, 4]].tolist()


def test_seeded_rows_are_independent_of_batch_and_shared_generator():
    torch.manual_seed(1)
    target = torch.randn(1, 1000)
    others = torch.randn(5, 1000)
    alone = Sampler()(target, md(1, seeds={0: (1234, 17)})).sampled_token_ids.item()
    batch = torch.cat([others[:2], target, others[2:]])
    in_batch = (
        Sampler()(batch, md(6, seeds={2: (1234, 17)}, generator=torch.Generator().manual_seed(99)))
        .sampled_token_ids[2]
        .item()
    )
    assert alone == in_batch
    # Another position or seed draws differently (with overwhelming probability over a flat-ish row).
    draws = {Sampler()(target, md(1, seeds={0: (1234, pos)})).sampled_token_ids.item() for pos in range(20)}
    assert len(draws) > 5


def test_seeded_draw_still_follows_distribution(sampler):
    n = 20_000
    rows = LOGITS.repeat(n, 1)
    seeds = {i: (7, i) for i in range(n)}  # one request, many positions
    out = sampler(rows, md(n, seeds=seeds)).sampled_token_ids
    assert_close_to(torch.bincount(out, minlength=5).float() / n, PROBS, n)


def test_penalties_follow_vllm_semantics():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, 3.0]])
    out = Sampler()(
        logits.clone(),
        md(
            1,
            all_greedy=True,
            temperature=None,
            repetition_penalty=torch.tensor([2.0]),
            frequency_penalty=torch.tensor([0.5]),
            presence_penalty=torch.tensor([0.25]),
            output_token_ids=[[0, 0, 1]],
            prompt_token_ids=[[3]],
            max_num_logprobs=None,
        ),
    )
    # token 0: 2/2 - 0.5*2 - 0.25 = -0.25; token 1: -2*2 - 0.5 - 0.25 = -4.75; token 3 (prompt): 0.5/2 = 0.25
    # token 2 unchanged 1.0; token 4 unchanged 3.0 -> still the argmax.
    assert out.sampled_token_ids.item() == 4
    from kvserve.sample.sampler import apply_penalties

    got = apply_penalties(
        logits,
        md(
            1,
            repetition_penalty=torch.tensor([2.0]),
            frequency_penalty=torch.tensor([0.5]),
            presence_penalty=torch.tensor([0.25]),
            output_token_ids=[[0, 0, 1]],
            prompt_token_ids=[[3]],
        ),
    )
    torch.testing.assert_close(got, torch.tensor([[-0.25, -4.75, 1.0, 0.25, 3.0]]))


@pytest.mark.parametrize("penalty", ["frequency_penalty", "presence_penalty", "repetition_penalty"])
def test_each_penalty_applies_on_its_own(penalty):
    """The metadata leaves the neutral penalties None: any one of them alone must still apply."""
    logits = torch.tensor([[3.0, 2.0, 0.0]])
    value = torch.tensor([2.0])
    extra = {"prompt_token_ids": [[]]} if penalty == "repetition_penalty" else {}
    out = Sampler()(
        logits, md(1, all_greedy=True, temperature=None, output_token_ids=[[0]], **{penalty: value}, **extra)
    )
    assert out.sampled_token_ids.item() == 1  # token 0 was generated: penalized below token 1


def test_banned_tokens_are_never_drawn(sampler):
    logits = torch.tensor([[5.0, 0.0, 0.0]]).repeat(2000, 1)
    out = sampler(logits, md(2000, banned_tokens=[(i, [0]) for i in range(2000)])).sampled_token_ids
    assert (out != 0).all()
    greedy = Sampler()(logits[:1], md(1, all_greedy=True, temperature=None, banned_tokens=[(0, [0])]))
    assert greedy.sampled_token_ids.item() != 0


def test_logprobs_are_raw_model_logprobs_with_ranks():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    out = Sampler()(logits, md(1, all_greedy=False, temperature=torch.tensor([0.0]), max_num_logprobs=2))
    lp = torch.log_softmax(logits, -1)[0]
    assert out.sampled_token_ids.item() == 1
    assert out.logprob_token_ids[0].tolist() == [1, 1, 2]  # sampled first, then the top-2
    torch.testing.assert_close(out.logprobs[0], lp[[1, 1, 2]])
    assert out.sampled_ranks.item() == 1
    # A sampled token that is not the best gets its true rank.
    forced = Sampler()(logits, md(1, banned_tokens=[(0, [1, 2])], temperature=torch.tensor([0.0]), max_num_logprobs=0))
    assert forced.logprob_token_ids[0].tolist() == [0]
    assert forced.sampled_ranks.item() == 3
    assert math.isclose(forced.logprobs[0, 0].item(), lp[0].item(), rel_tol=1e-6)


def reference_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Largest first, ties to the lower index (NaN above every number): a stable sort of the whole row."""
    key = torch.where(torch.isnan(x), torch.inf, x)
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices[:, :k]
    return x.gather(1, order), order


@pytest.mark.parametrize("k", [1, 3, 20, 64])
def test_cpu_topk_breaks_ties_by_the_lower_index(k):
    topk = TopK()
    assert topk.impl == "cpu", "the C++ kernels failed to build"
    g = torch.Generator().manual_seed(k)
    # bf16-rounded values: many exact ties, as among a bf16 model's logprobs; a row of one value; -inf and NaN.
    x = torch.randn(6, 64, generator=g).to(torch.bfloat16).float()
    x[1] = 0.5
    x[2, ::3] = -torch.inf
    x[3, [5, 40, 41]] = torch.nan
    values, ids = topk(x, k)
    ref_values, ref_ids = reference_topk(x, k)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(values, ref_values, equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize("vocab,k", [(1, 1), (7, 3), (64, 4), (1000, 8), (16384, 4)])
def test_top_log_probs_are_the_top_of_log_softmax(vocab, k):
    """The draft tree's top-k log-probs: the kernel (one pass, no log_softmax row) against log_softmax then the
    stable top-k; the native path against the same values (its order among ties is torch.topk's)."""
    top = TopLogProbs()
    assert top.impl == "cpu", "the C++ kernels failed to build"
    g = torch.Generator().manual_seed(vocab)
    x = (torch.randn(5, vocab, generator=g) * 4).to(torch.bfloat16).float()  # ties, as among bf16 logits
    x[1] = 0.5
    x[2, 1::3] = -torch.inf  # masked entries (each row keeps a finite one)
    x[3, -1] = x[3].max() + 30  # one dominant token: the others' log-probs far below
    want_values, want_ids = reference_topk(torch.log_softmax(x, dim=-1), k)
    values, ids = top(x, k)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(values, want_values, rtol=1e-5, atol=1e-5)
    native_values, _ = top.forward_native(x, k)
    torch.testing.assert_close(native_values, want_values, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("vocab", [1, 7, 64, 1000, 49152])
def test_cpu_argmax_is_torchs(vocab):
    """The greedy pick's kernel against torch.argmax: the first maximum (bf16-rounded rows: many exact ties, also
    across vector lanes), rows of -inf, a NaN anywhere (the first NaN wins), +inf beside -inf, a single value."""
    argmax = Argmax()
    assert argmax.impl == "cpu", "the C++ kernels failed to build"
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(10, vocab, generator=g).to(torch.bfloat16).float()
    x[1] = 0.5
    x[2] = -torch.inf
    x[3, vocab // 2 :] = torch.nan
    x[4, -1] = torch.nan
    x[5, vocab // 3] = torch.inf
    x[5, 0] = -torch.inf
    x[6, :: max(1, vocab // 5)] = x[6].max() + 1  # several equal maxima in different lanes
    x[7, -1] = x[7].max() + 1  # the maximum in the scalar tail
    assert torch.equal(argmax(x), x.argmax(dim=-1))
    assert torch.equal(argmax(x[:0]), x[:0].argmax(dim=-1))


def test_logprobs_of_a_row_do_not_depend_on_the_batchs_largest_k():
    """The sampler's top-k is taken with the batch's largest `logprobs`: a row's first entries must not move with
    it (torch.topk's order among equal values does)."""
    g = torch.Generator().manual_seed(0)
    row = torch.randn(1, 49152, generator=g).to(torch.bfloat16).float()
    batch = torch.cat([torch.randn(3, 49152, generator=g), row])
    greedy = dict(all_greedy=True, temperature=torch.zeros(1))
    alone = Sampler()(row, md(1, max_num_logprobs=2, **greedy))
    for k in (2, 5, 20):
        out = Sampler()(batch, md(4, max_num_logprobs=k, all_greedy=True, temperature=torch.zeros(4)))
        assert torch.equal(out.logprob_token_ids[3, :3], alone.logprob_token_ids[0])
        assert torch.equal(out.logprobs[3, :3], alone.logprobs[0])


def test_gumbel_noise_is_finite_for_every_hash_value():
    """The largest and smallest hash values must still give finite noise (u strictly inside (0, 1))."""
    h = torch.tensor([0, 1, 0xFFFFFFFF, 0xFFFFFE00], dtype=torch.int64)
    u = ((h >> 9).to(torch.float32) + 0.5) / 8388608.0
    assert ((u > 0) & (u < 1)).all()
    assert torch.isfinite(-torch.log(-torch.log(u))).all()


def test_gumbel_draw_never_picks_masked_tokens_and_depends_only_on_key():
    logits = torch.tensor([[float("-inf"), 0.3, float("-inf"), 0.7, float("-inf")]]).log_softmax(-1).repeat(64, 1)
    keys = torch.arange(64, dtype=torch.int64) * 7919
    torch_draws = gumbel_sample(logits, keys)
    kernel = Sampler(use_kernel=True).gumbel.kernels
    assert kernel is not None
    kernel_draws = kernel.sample_gumbel(logits.contiguous(), keys)
    for draws in (torch_draws, kernel_draws):
        assert set(draws.tolist()) <= {1, 3} and len(set(draws.tolist())) == 2
    # Same hash: the kernel and the torch version agree except where two values tie within rounding.
    assert (torch_draws == kernel_draws).float().mean() > 0.95
    # A row's draw depends on its key and logits only.
    again = kernel.sample_gumbel(logits[:5].contiguous(), keys[:5])
    assert again.tolist() == kernel_draws[:5].tolist()


def test_extreme_logits_never_yield_out_of_range_tokens(sampler):
    """Infinite or NaN logits (a broken model) must still give a valid token id for every row."""
    logits = torch.randn(5, 50)
    logits[0, 3] = float("inf")
    logits[1] = float("-inf")  # nothing left to draw from
    logits[2, :10] = float("nan")
    logits[3] = float("inf")
    out = sampler(logits, md(5)).sampled_token_ids
    assert ((out >= 0) & (out < 50)).all()


@pytest.mark.parametrize("temps", [[0.0, 0.7, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.5, 0.5, 2.0, 1.0]])
def test_host_flags_give_the_same_draws_as_reading_the_tensors(temps):
    """The runner's metadata carries any_greedy / any_temperature / max_top_k from the host (no device reads);
    the draws must equal those decided from the tensors."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    top_k = torch.tensor([5, 50, 3, 50])

    def draw(**flags):
        meta = md(4, temperature=torch.tensor(temps), top_k=top_k, generator=torch.Generator().manual_seed(2), **flags)
        return Sampler(use_kernel=False)(logits, meta).sampled_token_ids

    flags = dict(
        any_greedy=any(t == 0 for t in temps),
        any_temperature=any(t not in (0.0, 1.0) for t in temps),
        max_top_k=50,
    )
    assert torch.equal(draw(**flags), draw())
    # The flags are what decide: claiming no greedy rows turns the greedy rows' argmax off.
    if flags["any_greedy"]:
        assert not torch.equal(draw(**{**flags, "any_greedy": False}), draw())

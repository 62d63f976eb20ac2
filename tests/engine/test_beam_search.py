"""LLM.beam_search against HF generate(num_beams=B, do_sample=False) on tiny random fp32 models: the same B
hypotheses in the same order with the same scores, EOS handling and HF's early stopping included; beams share
their prefix's blocks through the prefix cache, and no block is held afterwards."""

from __future__ import annotations

import random

import pytest
import torch

from kvserve import LLM
from kvserve.beam_search import BeamSearchInstance, BeamSearchParams
from kvserve.outputs import Logprob
from tests.conftest import assert_all_blocks_free, load_hf_model

MODELS = ["llama-gqa-untied", "qwen2-bias-tied"]
PAD = 2  # the tiny models' pad (and default EOS) id


def rand_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49000) for _ in range(n)]


@pytest.fixture(scope="module", params=MODELS)
def setup(request, tiny_model_factory):
    path = tiny_model_factory(request.param)
    llm = LLM(path, dtype="float32", max_model_len=256, block_size=8)
    return llm, load_hf_model(path)


@torch.no_grad()
def hf_beams(hf, prompt_ids, width, max_tokens, length_penalty, eos, early_stopping=False):
    """HF's B hypotheses as (generated tokens, score), best first."""
    out = hf.generate(
        torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        num_beams=width,
        num_return_sequences=width,
        do_sample=False,
        max_new_tokens=max_tokens,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        eos_token_id=eos,
        pad_token_id=PAD,
        return_dict_in_generate=True,
        output_scores=True,
    )
    beams = []
    for seq, score in zip(out.sequences.tolist(), out.sequences_scores.tolist(), strict=True):
        gen = seq[len(prompt_ids) :]
        if eos in gen:
            gen = gen[: gen.index(eos) + 1]
        else:
            while gen and gen[-1] == PAD:
                gen.pop()
        beams.append((gen, score))
    return beams


def ours(out, prompt_ids):
    beams = []
    for seq in out.sequences:
        assert seq.tokens[: len(prompt_ids)] == prompt_ids
        beams.append((seq.tokens[len(prompt_ids) :], seq.score))
    return beams


def assert_same_beams(got, want):
    assert [g for g, _ in got] == [w for w, _ in want]
    for (_, s_got), (_, s_want) in zip(got, want, strict=True):
        assert s_got == pytest.approx(s_want, abs=1e-4)


@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 2.0])
def test_matches_hf_without_eos(setup, width, length_penalty):
    llm, hf = setup
    prompts = [rand_ids(13, 1), rand_ids(21, 2)]
    params = BeamSearchParams(beam_width=width, max_tokens=12, length_penalty=length_penalty)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outs, strict=True):
        want = hf_beams(hf, prompt, width, 12, length_penalty, eos=PAD)
        assert all(PAD not in g for g, _ in want)  # the default EOS never comes up: no EOS case here
        got = ours(out, prompt)
        assert_same_beams(got, want)
        assert len({tuple(g) for g, _ in got}) == width
        for seq in out.sequences:
            assert seq.finish_reason == "length" and len(seq.logprobs) == 12
            assert seq.cum_logprob == pytest.approx(
                sum(e[t].logprob for e, t in zip(seq.logprobs, seq.tokens[-12:], strict=True))
            )
            assert seq.text == llm.get_tokenizer().decode(seq.tokens)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("early_stopping", [False, True, "never"])
@pytest.mark.parametrize("length_penalty", [1.0, -0.5, 2.0])
def test_matches_hf_with_eos(setup, width, early_stopping, length_penalty):
    """An EOS id chosen among the tokens the beams actually meet, so hypotheses finish at different lengths and
    HF's rules (only the top B of the 2B may finish, the early-stopping bound) decide the result."""
    llm, hf = setup
    prompt = rand_ids(17, 3)
    free = hf_beams(hf, prompt, width, 16, length_penalty, eos=PAD)
    # Tokens that are on the board: the beams' tokens, early and late (a length penalty of 2 favours long
    # hypotheses). The first that leaves an EOS-terminated hypothesis among HF's results is this case's EOS id.
    candidates = dict.fromkeys(g[j] for j in (3, 15, 1, 14) for g, _ in free)
    for eos in candidates:
        want = hf_beams(hf, prompt, width, 16, length_penalty, eos=eos, early_stopping=early_stopping)
        if any(g[-1] == eos for g, _ in want):
            break
    else:
        pytest.fail("no candidate EOS id ends a hypothesis")
    proc = llm.engine.processor
    saved = proc.eos_token_ids
    proc.eos_token_ids = frozenset({eos})
    try:
        params = BeamSearchParams(
            beam_width=width, max_tokens=16, length_penalty=length_penalty, early_stopping=early_stopping
        )
        out = llm.beam_search({"prompt_token_ids": prompt}, params)[0]
        assert_same_beams(ours(out, prompt), want)
        for seq in out.sequences:
            ended = seq.tokens[-1] == eos
            assert (seq.finish_reason, seq.stop_reason) == (("stop", eos) if ended else ("length", None))
        # ignore_eos: the EOS id is an ordinary token again, as in the search without it.
        ignored = llm.beam_search(
            {"prompt_token_ids": prompt}, BeamSearchParams(width, 16, ignore_eos=True, length_penalty=length_penalty)
        )
        assert_same_beams(ours(ignored[0], prompt), free)
    finally:
        proc.eos_token_ids = saved
    assert_all_blocks_free(llm)


def test_beams_share_prefix_blocks(setup):
    """Each step's requests hit the blocks the previous step filled: with a 40-token prompt (5 blocks of 8) every
    beam of every later step hits at least those 5 blocks."""
    llm, _ = setup
    llm.reset_prefix_cache()
    before = llm.stats()["prefix_cache"]["num_hit_tokens"]
    width, steps = 4, 10
    llm.beam_search({"prompt_token_ids": rand_ids(40, 4)}, BeamSearchParams(width, steps))
    hits = llm.stats()["prefix_cache"]["num_hit_tokens"] - before
    assert hits >= 40 * (width * (steps - 1))
    assert_all_blocks_free(llm)


def test_validation(setup):
    llm, _ = setup
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="at most 20"):
        llm.beam_search("hi", BeamSearchParams(beam_width=11, max_tokens=4))
    with pytest.raises(ValueError, match="context length"):
        llm.beam_search({"prompt_token_ids": rand_ids(250, 5)}, BeamSearchParams(beam_width=2, max_tokens=8))
    assert_all_blocks_free(llm)


def test_instance_rules_exactly():
    """HF's rules on hand-made log-probabilities: an EOS continuation outside the top B of the 2B is dropped, one
    inside finishes with score cum / len ** lp, and the early-stopping bound ends the search."""
    lp = lambda **kw: {int(k[1:]): Logprob(v) for k, v in kw.items()}  # noqa: E731
    inst = BeamSearchInstance([5], BeamSearchParams(beam_width=2, max_tokens=10), eos_token_ids=frozenset({9}))
    assert inst.num_candidates == 4
    inst.advance([lp(t10=-1.0, t11=-1.5, t12=-2.0, t9=-2.5)])  # EOS ranks 4th of 4: dropped
    assert [b.tokens for b in inst.running] == [[5, 10], [5, 11]] and inst.finished == []
    inst.advance([lp(t9=-0.1, t20=-3.0, t21=-4.0, t22=-5.0), lp(t30=-0.5, t9=-9.0, t31=-9.5, t32=-9.6)])
    # Candidates by cum: [10,9] -1.1 (EOS, rank 0: finishes, score -1.1/2), [11,30] -2.0, [10,20] -4.0, ...
    assert [(f.tokens, f.score) for f in inst.finished] == [([5, 10, 9], pytest.approx(-0.55))]
    assert [b.tokens for b in inst.running] == [[5, 11, 30], [5, 10, 20]]
    assert not inst.done
    inst.advance([lp(t9=-0.2, t40=-0.3, t41=-5.0, t42=-6.0), lp(t9=-0.1, t43=-9.0, t44=-9.5, t45=-9.6)])
    # [11,30,9] -2.2 finishes (score -2.2/3); running [11,30,40] -2.3; the bound -2.3/3 < -2.2/3: done.
    assert [f.tokens for f in inst.finished] == [[5, 10, 9], [5, 11, 30, 9]]
    assert inst.done


def test_hf_early_stopping_heuristic_decides(setup):
    """A case (found by search) where HF's default early stop (early_stopping=False: stop once B hypotheses are
    finished and the best running beam's cum_logprob / generated_len ** lp cannot beat the worst of them) changes
    the result: searching on to max_tokens would return other beams."""
    llm, hf = setup
    if "llama-gqa-untied" not in llm.engine.config.model.model:
        pytest.skip("the case was found on llama-gqa-untied")
    prompt, eos = rand_ids(19, 108), 46678
    want = hf_beams(hf, prompt, 2, 10, 1.0, eos=eos)
    proc = llm.engine.processor
    saved = proc.eos_token_ids
    proc.eos_token_ids = frozenset({eos})
    try:
        out = llm.beam_search({"prompt_token_ids": prompt}, BeamSearchParams(beam_width=2, max_tokens=10))[0]
    finally:
        proc.eos_token_ids = saved
    assert_same_beams(ours(out, prompt), want)
    assert all(seq.finish_reason == "stop" for seq in out.sequences)
    assert_all_blocks_free(llm)

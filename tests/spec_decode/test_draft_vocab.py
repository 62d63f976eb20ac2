"""A frequency-ranked draft vocabulary (kvserve.spec_decode.draft_vocab): the ids the counts select, the reduced
LM head against the target's own logits (plain, tied, int8), and end to end on the tiny models (fp32): greedy
outputs token-identical to speculation off, drafts mapped to the right full ids (a draft that is the target
accepts everything when the subset holds the target's picks and nothing when it holds none of them), and sampled
outputs distributed as without speculation although q is zero outside the subset."""

from __future__ import annotations

import shutil
from collections import Counter

import numpy as np
import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.spec_decode.draft_vocab import DraftVocab, draft_vocab_ids, mix_counts, save_counts
from tests.conftest import assert_all_blocks_free
from tests.engine.test_spec_decode import assert_same_greedy, copy_prompts, token_ids

VOCAB = 49152  # the tiny models use SmolLM2's tokenizer
K = 3


def spec_config(method: str, model: str, size: int) -> dict:
    return {"method": method, "model": model, "num_speculative_tokens": K, "adaptive": False, "draft_vocab_size": size}


def with_counts(src: str, dst: str, counts: np.ndarray) -> str:
    """A copy of the head or model folder `src` with `counts` beside it."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
    save_counts(dst, counts)
    return dst


def random_counts(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).permutation(VOCAB).astype(np.int64)


def test_draft_vocab_ids_are_the_most_frequent_ascending():
    counts = np.array([5, 0, 9, 5, 1, 9, 0, 2])
    assert draft_vocab_ids(counts, 3).tolist() == [0, 2, 5]  # 9, 9, then the lower id of the two 5s
    assert draft_vocab_ids(counts, 4).tolist() == [0, 2, 3, 5]
    assert draft_vocab_ids(counts, 8).tolist() == list(range(8))
    with pytest.raises(ValueError, match="draft_vocab_size"):
        draft_vocab_ids(counts, 9)


def test_mixed_counts_weigh_each_text_equally():
    """A small text's frequent tokens make the subset beside a text 1,000 times larger (the model's chat replies
    beside the library): summed raw counts would rank the large text's rarest token above them."""
    library = np.array([0, 50_000, 40_000, 30_000, 20, 0])
    replies = np.array([0, 0, 0, 0, 10, 90])
    assert draft_vocab_ids(library + replies, 3).tolist() == [1, 2, 3]
    mixed = mix_counts(library, replies)
    assert draft_vocab_ids(mixed, 3).tolist() == [1, 2, 5]  # shares 0.42, 0.33, 0.9: token 5 ranks first
    assert mixed.dtype == np.int64 and mixed[5] > mixed[1] > mixed[2] > mixed[3] > mixed[4] > mixed[0] == 0


@pytest.mark.parametrize(
    "model,quantization",
    [("llama-loops", None), ("llama-mqa-tied", None), ("llama-loops", "int8")],
    ids=["untied-packed", "tied", "int8"],
)
def test_reduced_head_gives_the_targets_logits_of_its_columns(tiny_model_factory, tmp_path, model, quantization):
    path = tiny_model_factory(model)
    llm = LLM(path, dtype="float32", max_model_len=64, quantization=quantization)
    target = llm.engine.engine_core.executor.driver_runner.model
    save_counts(str(tmp_path), random_counts(1))
    vocab = DraftVocab(target, str(tmp_path), 1000, torch.float32, torch.device("cpu"))
    assert vocab.token_ids.tolist() == draft_vocab_ids(random_counts(1), 1000).tolist()
    hidden = torch.randn(5, target.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        full = target.compute_logits(hidden)
        got = vocab.logits(target.model.norm(hidden))
    want = full[:, vocab.token_ids]
    if quantization is None:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # the subset's rows are quantized again from the dequantized rows: the same codes, up to rounding
        torch.testing.assert_close(got, want, rtol=0.02, atol=0.02)


@pytest.fixture(scope="module")
def plain(target_path) -> LLM:
    return LLM(target_path, dtype="float32", max_model_len=256)


@pytest.mark.parametrize("method", ["eagle", "draft_model"])
def test_greedy_identical_with_reduced_vocab(method, target_path, eagle_head_path, plain, tmp_path):
    src = eagle_head_path if method == "eagle" else target_path
    folder = with_counts(src, str(tmp_path / "draft"), random_counts(2))
    llm = LLM(target_path, dtype="float32", max_model_len=256, speculative_config=spec_config(method, folder, 8192))
    assert llm.engine.engine_core.executor.driver_runner.proposer.draft_vocab.size == 8192
    assert_same_greedy(plain, llm, copy_prompts(5, 21), max_tokens=40)


def test_drafts_map_to_full_ids(target_path, plain, tmp_path):
    """The target drafting for itself over a subset: all accepted when the subset holds every token the target
    emits (a wrong column -> id map would reject them), none when it holds none of them."""
    prompts = copy_prompts(3, 22)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    ref = token_ids(plain, prompts, params)
    emitted = sorted({t for r in ref for t in r})
    size = 4096
    for holds, want in ((True, lambda rate: rate > 0.95), (False, lambda rate: rate == 0.0)):
        counts = np.zeros(VOCAB, dtype=np.int64)
        if holds:
            counts[emitted] = 1
        else:  # the most frequent: the `size` highest ids never emitted
            counts[np.setdiff1d(np.arange(VOCAB), emitted)[-size:]] = 1
        folder = with_counts(target_path, str(tmp_path / f"draft-{holds}"), counts)
        config = spec_config("draft_model", folder, size)
        llm = LLM(target_path, dtype="float32", max_model_len=256, speculative_config=config)
        subset = set(llm.engine.engine_core.executor.driver_runner.proposer.draft_vocab.token_ids.tolist())
        assert subset >= set(emitted) if holds else not subset & set(emitted)
        assert token_ids(llm, prompts, params) == ref
        stats = llm.stats()["spec_decoding"]
        assert stats["num_draft_tokens"] > 0 and want(stats["acceptance_rate"]), stats
        assert_all_blocks_free(llm)


def test_sampled_distribution_matches_with_reduced_vocab(target_path, noisy_draft_path, plain, tmp_path):
    """A noisy draft over half the vocabulary (a random half, so some of the target's likely tokens have q = 0):
    the tokens at output positions 1-3 are distributed as without speculation (two-sample chi-square)."""
    folder = with_counts(noisy_draft_path, str(tmp_path / "noisy"), random_counts(3))
    llm = LLM(
        target_path,
        dtype="float32",
        max_model_len=256,
        speculative_config=spec_config("draft_model", folder, VOCAB // 2),
    )
    prompt = {"prompt_token_ids": [11, 12, 13, 14] * 4}
    params = SamplingParams(max_tokens=4, temperature=1.5, top_k=6, ignore_eos=True, n=600)
    a = token_ids(llm, prompt, params)
    b = token_ids(plain, prompt, params)
    stats = llm.stats()["spec_decoding"]
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"], stats
    subset = set(llm.engine.engine_core.executor.driver_runner.proposer.draft_vocab.token_ids.tolist())
    emitted = {t for seq in b for t in seq[1:]}
    assert emitted - subset, "the target emits tokens outside the subset (q = 0 there)"
    for pos in (1, 2, 3):
        ca, cb = Counter(t[pos] for t in a), Counter(t[pos] for t in b)
        keys = sorted(set(ca) | set(cb))
        table = torch.tensor([[ca[k] for k in keys], [cb[k] for k in keys]], dtype=torch.float64)
        expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
        stat = ((table - expected) ** 2 / expected).sum()
        pvalue = float(torch.special.gammaincc(torch.tensor((len(keys) - 1) / 2, dtype=torch.float64), stat / 2))
        assert pvalue > 1e-3, (pos, ca, cb)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize(
    "config,match",
    [
        ({"method": "ngram", "num_speculative_tokens": 2, "draft_vocab_size": 100}, "model proposers"),
        ({"method": "eagle", "num_speculative_tokens": 2, "draft_vocab_size": -1}, "integer >= 0"),
    ],
)
def test_config_errors(target_path, config, match):
    with pytest.raises(ValueError, match=match):
        LLM(target_path, dtype="float32", max_model_len=64, speculative_config=config)


def test_missing_counts_is_a_clear_error(target_path, eagle_head_path):
    config = {"method": "eagle", "model": eagle_head_path, "num_speculative_tokens": 2, "draft_vocab_size": 100}
    with pytest.raises(ValueError, match="token counts"):
        LLM(target_path, dtype="float32", max_model_len=64, speculative_config=config)


def test_a_head_trained_for_a_draft_vocabulary_drafts_over_it_by_default(target_path, eagle_head_path, tmp_path):
    """A head whose config.json names the draft vocabulary it was trained for (train_eagle_head.py --train-vocab;
    EAGLE-3's key) drafts over it unless speculative_config sets draft_vocab_size, 0 included."""
    import json

    folder = with_counts(eagle_head_path, str(tmp_path / "head"), random_counts(4))
    config_path = tmp_path / "head" / "config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    config_path.write_text(json.dumps({**config, "draft_vocab_size": 4096}))

    def draft_vocab(**extra):
        config = {"method": "eagle", "model": folder, "num_speculative_tokens": 2, **extra}
        llm = LLM(target_path, dtype="float32", max_model_len=64, speculative_config=config)
        vocab = llm.engine.engine_core.executor.driver_runner.proposer.draft_vocab
        return None if vocab is None else vocab.size

    assert draft_vocab() == 4096
    assert draft_vocab(draft_vocab_size=0) is None
    assert draft_vocab(draft_vocab_size=8192) == 8192

"""Offline LLM behaviour on a tiny random model: stops, n > 1, logprobs, seeds, validation, abort, streaming."""

from __future__ import annotations

import random

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.engine.output_processor import OutputKind
from tests.conftest import assert_all_blocks_free, load_hf_model

MODEL = "llama-gqa-untied"


@pytest.fixture(scope="module")
def model_path(tiny_model_factory) -> str:
    return tiny_model_factory(MODEL)


@pytest.fixture(scope="module")
def llm(model_path) -> LLM:
    return LLM(model_path, dtype="float32", max_model_len=256)


def rand_prompt(n: int, seed: int) -> dict:
    rng = random.Random(seed)
    return {"prompt_token_ids": [rng.randrange(3, 49000) for _ in range(n)]}


GREEDY = dict(temperature=0.0, ignore_eos=True)


def greedy_once(llm: LLM, prompt, n: int = 40) -> tuple[str, list[int]]:
    out = llm.generate(prompt, SamplingParams(max_tokens=n, **GREEDY), use_tqdm=False)[0].outputs[0]
    return out.text, out.token_ids


# ---------------------------------------------------------------------------- output shape


def test_request_output_shape_and_metrics(llm):
    outs = llm.generate(["Hello there", "General Kenobi"], SamplingParams(max_tokens=5, **GREEDY), use_tqdm=False)
    assert [o.prompt for o in outs] == ["Hello there", "General Kenobi"]
    tok = llm.get_tokenizer()
    assert outs[0].prompt_token_ids == tok("Hello there").input_ids
    for o in outs:
        assert o.finished and len(o.outputs) == 1
        c = o.outputs[0]
        assert c.index == 0 and len(c.token_ids) == 5 and c.finish_reason == "length"
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
        m = o.metrics
        assert m.arrival_time <= m.first_token_time <= m.last_token_time <= m.finished_time
    assert_all_blocks_free(llm)


def test_one_sampling_params_per_prompt(llm):
    outs = llm.generate(
        [rand_prompt(5, 1), rand_prompt(5, 2)],
        [SamplingParams(max_tokens=3, **GREEDY), SamplingParams(max_tokens=7, **GREEDY)],
        use_tqdm=False,
    )
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 7]
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate([rand_prompt(5, 1)] * 2, [SamplingParams()] * 3, use_tqdm=False)


def test_max_tokens_none_fills_the_context(model_path):
    small = LLM(model_path, dtype="float32", max_model_len=48)
    out = small.generate(rand_prompt(10, 3), SamplingParams(max_tokens=None, **GREEDY), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 38 and out.outputs[0].finish_reason == "length"


# ---------------------------------------------------------------------------- stops


def test_stop_strings_cut_text(llm):
    prompt = rand_prompt(12, 4)
    full_text, _ = greedy_once(llm, prompt)
    assert len(full_text) > 40
    # A stop string that starts mid-text (likely spanning a token boundary).
    stop = full_text[20:26]
    first = full_text.index(stop)
    out = llm.generate(prompt, SamplingParams(max_tokens=40, stop=[stop], **GREEDY), use_tqdm=False)[0].outputs[0]
    assert out.text == full_text[:first]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    kept = llm.generate(
        prompt,
        SamplingParams(max_tokens=40, stop=stop, include_stop_str_in_output=True, **GREEDY),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == full_text[: first + len(stop)]
    # The earliest of several stop strings wins.
    later = full_text[30:34]
    both = llm.generate(prompt, SamplingParams(max_tokens=40, stop=[later, stop], **GREEDY), use_tqdm=False)
    assert both[0].outputs[0].stop_reason == (stop if first <= full_text.index(later) else later)
    assert_all_blocks_free(llm)


def test_stop_token_ids_and_min_tokens(llm):
    prompt = rand_prompt(9, 5)
    _, ids = greedy_once(llm, prompt)
    stop_id = ids[4]
    first = ids.index(stop_id)
    out = llm.generate(prompt, SamplingParams(max_tokens=40, stop_token_ids=[stop_id], **GREEDY), use_tqdm=False)
    c = out[0].outputs[0]
    assert c.token_ids == ids[: first + 1] and (c.finish_reason, c.stop_reason) == ("stop", stop_id)
    # min_tokens forbids the stop token until 10 tokens exist.
    c2 = llm.generate(
        prompt,
        SamplingParams(max_tokens=40, stop_token_ids=[stop_id], min_tokens=10, **GREEDY),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(c2.token_ids) >= 10 and stop_id not in c2.token_ids[:9]


def test_eos_stops_unless_ignored(llm):
    prompt = rand_prompt(9, 6)
    _, ids = greedy_once(llm, prompt)
    # Make the model's 4th greedy token the EOS: an engine whose EOS set contains it must stop there.
    eos = ids[3]
    first = ids.index(eos)
    proc = llm.engine.processor
    saved = proc.eos_token_ids
    proc.eos_token_ids = frozenset({eos})
    try:
        c = llm.generate(prompt, SamplingParams(max_tokens=40, temperature=0), use_tqdm=False)[0].outputs[0]
        assert c.token_ids == ids[: first + 1] and c.finish_reason == "stop" and c.stop_reason is None
        c2 = llm.generate(prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), use_tqdm=False)
        assert c2[0].outputs[0].token_ids == ids
    finally:
        proc.eos_token_ids = saved


# ---------------------------------------------------------------------------- n > 1, logprobs, seeds


def test_n_greater_than_one_shares_prompt_blocks(llm):
    before = llm.stats()["prefix_cache"]["num_hit_tokens"]
    prompt = rand_prompt(50, 7)  # 3 full blocks of 16
    out = llm.generate(prompt, SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=3), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # different seeds per sample
    # Samples 1 and 2 hit the 3 blocks of sample 0's prompt (cached in the same step).
    assert llm.stats()["prefix_cache"]["num_hit_tokens"] - before >= 2 * 48
    greedy = llm.generate(prompt, SamplingParams(n=2, max_tokens=8, **GREEDY), use_tqdm=False)[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids
    assert_all_blocks_free(llm)


def test_logprobs_match_hf(llm, model_path):
    prompt = rand_prompt(11, 8)
    out = llm.generate(prompt, SamplingParams(max_tokens=6, logprobs=3, **GREEDY), use_tqdm=False)[0].outputs[0]
    hf = load_hf_model(model_path)
    ids = torch.tensor([prompt["prompt_token_ids"] + out.token_ids])
    with torch.no_grad():
        ref = torch.log_softmax(hf(ids).logits[0].float(), -1)
    n_prompt = len(prompt["prompt_token_ids"])
    assert len(out.logprobs) == 6
    total = 0.0
    for i, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        row = ref[n_prompt - 1 + i]
        assert entry[tok].rank == 1  # greedy
        assert set(entry) == set(row.topk(3).indices.tolist())
        for tid, lp in entry.items():
            assert abs(lp.logprob - row[tid].item()) < 1e-4
        assert entry[tok].decoded_token == llm.get_tokenizer().decode([tok])
        total += entry[tok].logprob
    assert abs(out.cumulative_logprob - total) < 1e-4


def test_seeded_sampling_independent_of_batch_and_preemption(model_path, llm):
    prompt = rand_prompt(30, 9)
    params = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=42, ignore_eos=True)
    alone = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    others = [rand_prompt(20 + i, 100 + i) for i in range(5)]
    unseeded = SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True)
    batch = llm.generate(others[:2] + [prompt] + others[2:], [unseeded] * 2 + [params] + [unseeded] * 3, use_tqdm=False)
    assert batch[2].outputs[0].token_ids == alone
    tiny_pool = LLM(
        model_path,
        dtype="float32",
        max_model_len=256,
        block_size=8,
        num_kv_blocks=12,
        max_num_batched_tokens=16,
    )
    squeezed = tiny_pool.generate(others + [prompt], [unseeded] * 5 + [params], use_tqdm=False)
    assert tiny_pool.stats()["num_preemptions"] > 0
    assert squeezed[-1].outputs[0].token_ids == alone
    other_seed = llm.generate(
        prompt,
        SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=43, ignore_eos=True),
        use_tqdm=False,
    )
    assert other_seed[0].outputs[0].token_ids != alone
    assert_all_blocks_free(tiny_pool)


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-3), "top_k"),
        (dict(min_p=2.0), "min_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-1), "max_tokens"),
        (dict(n=0), "n"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
        (dict(logprobs=100), "logprobs"),
        (dict(stop=[""]), "stop"),
        (dict(stop=[3]), "stop"),
        (dict(stop_token_ids=["a"]), "stop_token_ids"),
        (dict(presence_penalty=5.0), "presence_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(repetition_penalty=5e-324), "repetition_penalty"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=float("inf")), "top_p"),
        (dict(seed="x"), "seed"),
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}\b"):
        SamplingParams(**kwargs)


def test_bad_prompts_are_rejected_and_engine_keeps_working(llm):
    good = SamplingParams(max_tokens=4, **GREEDY)
    with pytest.raises(ValueError, match="empty"):
        llm.generate("", good, use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, good, use_tqdm=False)
    with pytest.raises(ValueError, match="maximum context length is 256"):
        llm.generate(rand_prompt(250, 1), SamplingParams(max_tokens=10), use_tqdm=False)
    with pytest.raises(ValueError, match="out of vocabulary"):
        llm.generate({"prompt_token_ids": [1, 2, 10**7]}, good, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt must be"):
        llm.generate([{"nonsense": 1}], good, use_tqdm=False)
    # One bad prompt in a batch: nothing runs, nothing stays queued.
    with pytest.raises(ValueError):
        llm.generate([rand_prompt(5, 1), {"prompt_token_ids": []}], good, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.generate(rand_prompt(5, 1), good, use_tqdm=False)[0].outputs[0].token_ids) == 4
    assert_all_blocks_free(llm)


def test_request_larger_than_kv_pool_is_rejected(model_path):
    small = LLM(model_path, dtype="float32", max_model_len=256, block_size=8, num_kv_blocks=4)
    with pytest.raises(ValueError, match="KV cache capacity is 32"):
        small.generate(rand_prompt(20, 1), SamplingParams(max_tokens=20), use_tqdm=False)
    assert len(small.generate(rand_prompt(20, 1), SamplingParams(max_tokens=10), use_tqdm=False)) == 1


def test_llm_takes_every_engine_option_and_rejects_unknown_ones(model_path):
    with pytest.raises(TypeError, match="unexpected keyword argument.*max_num_seq\\b.*engine options"):
        LLM(model_path, max_num_seq=4)
    llm = LLM(model_path, dtype="float32", max_model_len=128, num_kv_blocks=16, kv_prefault="sync")
    assert llm.engine.engine_core.config.cache.kv_prefault == "sync"
    assert len(llm.generate(rand_prompt(5, 1), SamplingParams(max_tokens=2), use_tqdm=False)) == 1


# ---------------------------------------------------------------------------- abort, streaming, chat


def test_abort_frees_blocks_at_once(llm):
    engine = llm.engine
    for i in range(4):
        engine.add_request(f"abort-{i}", rand_prompt(40, i), SamplingParams(max_tokens=100, **GREEDY))
    for _ in range(3):
        engine.step()
    assert llm.stats()["num_free_blocks"] < llm.stats()["num_blocks"]
    engine.abort_request([f"abort-{i}" for i in range(4)])
    assert_all_blocks_free(llm)
    assert not engine.has_unfinished_requests()
    engine.step()  # the runner forgets them; nothing breaks


def test_streaming_deltas_add_up_to_final_text(llm):
    prompt = rand_prompt(12, 4)
    full_text, full_ids = greedy_once(llm, prompt, n=30)
    stop = full_text[25:29]
    engine = llm.engine
    engine.add_request(
        "stream", prompt, SamplingParams(max_tokens=30, stop=[stop], **GREEDY), output_kind=OutputKind.DELTA
    )
    text, ids, finished = "", [], False
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert not finished
            c = out.outputs[0]
            text += c.text
            ids += c.token_ids
            finished = out.finished
            # Text that could begin the stop string is never streamed early.
            assert stop not in text
    assert finished and text == full_text[: full_text.index(stop)]
    assert ids == full_ids[: len(ids)]


def test_chat_applies_template(llm):
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=3, **GREEDY), use_tqdm=False)
    assert out[0].prompt.startswith("<|im_start|>system") and out[0].prompt.endswith("<|im_start|>assistant\n")
    assert out[0].prompt_token_ids[0] == 1  # exactly one BOS-like <|im_start|>, from the template
    batch = llm.chat(
        [[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]],
        SamplingParams(max_tokens=2, **GREEDY),
        use_tqdm=False,
    )
    assert len(batch) == 2


def test_progress_bar_runs(llm, capsys):
    llm.generate([rand_prompt(5, i) for i in range(3)], SamplingParams(max_tokens=2, **GREEDY), use_tqdm=True)
    assert "Processed prompts" in capsys.readouterr().err


def test_bad_request_does_not_disturb_running_ones(llm):
    engine = llm.engine
    good = SamplingParams(max_tokens=12, **GREEDY)
    expected = greedy_once(llm, rand_prompt(30, 21), n=12)[1]
    engine.add_request("ok", rand_prompt(30, 21), good)
    engine.step()
    for bad_prompt, bad_params in [
        ({"prompt_token_ids": []}, good),
        (rand_prompt(300, 1), good),
        (rand_prompt(5, 1), SamplingParams(max_tokens=300)),
    ]:
        with pytest.raises(ValueError):
            engine.add_request("bad", bad_prompt, bad_params)
    with pytest.raises(ValueError, match="duplicate"):
        engine.add_request("ok", rand_prompt(5, 1), good)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["ok"]
    assert finished[0].outputs[0].token_ids == expected
    assert_all_blocks_free(llm)

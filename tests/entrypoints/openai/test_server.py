"""The real server on a loopback port, driven with the official `openai` client."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from kvserve import LLM, SamplingParams
from kvserve.beam_search import BeamSearchParams
from tests.entrypoints.openai.server_utils import Server, all_gone

MODEL = "llama-gqa-untied"
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def model_path(tiny_model_factory) -> str:
    return tiny_model_factory(MODEL)


@pytest.fixture(scope="module")
def server(model_path):
    srv = Server(model_path, "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN))
    yield srv
    engine_pids = srv.engine_pids
    assert srv.stop() == 0, srv.log()
    assert all_gone(engine_pids), "engine core outlived the server"


@pytest.fixture(scope="module")
def client(server):
    return server.client()


# ------------------------------------------------------------------ basics


def test_models_health_version_tokenize(server, client, model_path):
    assert httpx.get(f"{server.url}/health").status_code == 200
    models = client.models.list()
    assert [m.id for m in models.data] == [model_path]
    assert httpx.get(f"{server.url}/version").json()["version"]
    tok = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello world"}).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == MAX_MODEL_LEN
    detok = httpx.post(f"{server.url}/detokenize", json={"tokens": tok["tokens"]}).json()
    assert detok["prompt"] == "Hello world"
    chat_tok = httpx.post(f"{server.url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat_tok["tokens"][0] == 1  # the template's <|im_start|>


def test_completion_and_chat(client, model_path):
    c = client.completions.create(model=model_path, prompt="Hello", max_tokens=7, temperature=0)
    assert c.object == "text_completion" and c.id and c.created and c.model == model_path
    assert c.choices[0].finish_reason == "length" and c.choices[0].text
    assert (c.usage.completion_tokens, c.usage.total_tokens) == (7, c.usage.prompt_tokens + 7)
    chat = client.chat.completions.create(
        model=model_path, messages=[{"role": "user", "content": "Hi there"}], max_completion_tokens=6, temperature=0
    )
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content and chat.usage.completion_tokens == 6


def test_streaming_with_usage(client, model_path):
    chunks = list(
        client.completions.create(
            model=model_path,
            prompt="Hello",
            max_tokens=9,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 9 and not chunks[-1].choices
    full = client.completions.create(model=model_path, prompt="Hello", max_tokens=9, temperature=0)
    assert text == full.choices[0].text
    chat_chunks = list(
        client.chat.completions.create(
            model=model_path,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chat_chunks[0].choices[0].delta.role == "assistant"
    assert chat_chunks[-1].usage.completion_tokens == 5
    finish = [ch.choices[0].finish_reason for ch in chat_chunks if ch.choices and ch.choices[0].finish_reason]
    assert finish == ["length"]


def test_n_logprobs_stop_echo(client, model_path):
    c = client.completions.create(model=model_path, prompt="Hello", max_tokens=5, n=2, temperature=1.0, seed=7)
    assert sorted(ch.index for ch in c.choices) == [0, 1] and c.usage.completion_tokens == 10
    lp = client.completions.create(model=model_path, prompt="Hello", max_tokens=4, temperature=0, logprobs=3)
    lps = lp.choices[0].logprobs
    assert len(lps.tokens) == len(lps.token_logprobs) == len(lps.top_logprobs) == 4
    assert all(len(top) >= 3 for top in lps.top_logprobs) and "".join(lps.tokens) == lp.choices[0].text
    assert all(t <= 0 for t in lps.token_logprobs) and lps.text_offset[0] == 0
    chat = client.chat.completions.create(
        model=model_path,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)
    assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[1].logprob
    full = client.completions.create(model=model_path, prompt="Hello", max_tokens=30, temperature=0).choices[0].text
    stop = full[10:14]
    cut = client.completions.create(model=model_path, prompt="Hello", max_tokens=30, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[: full.index(stop)] and cut.choices[0].finish_reason == "stop"
    echo = client.completions.create(model=model_path, prompt="Hello", max_tokens=3, temperature=0, echo=True)
    assert (
        echo.choices[0].text.startswith("Hello")
        and echo.choices[0].text == "Hello" + full[: len(echo.choices[0].text) - 5]
    )
    ids = client.completions.create(model=model_path, prompt=[[1, 2, 3], [4, 5]], max_tokens=2, temperature=0)
    assert sorted(ch.index for ch in ids.choices) == [0, 1]


def test_seed_reproducibility(client, model_path):
    def sample(seed: int) -> str:
        return (
            client.completions.create(model=model_path, prompt="Once", max_tokens=16, temperature=1.0, seed=seed)
            .choices[0]
            .text
        )

    assert sample(11) == sample(11)
    assert sample(11) != sample(12)


def test_vllm_extra_body_fields(client, model_path):
    full = client.completions.create(model=model_path, prompt="Hi", max_tokens=20, temperature=0)
    tok = httpx.post(f"{client.base_url}".replace("/v1/", "/tokenize"), json={"prompt": full.choices[0].text}).json()
    stop_id = tok["tokens"][2]
    c = client.completions.create(
        model=model_path,
        prompt="Hi",
        max_tokens=20,
        temperature=0,
        extra_body={"stop_token_ids": [stop_id], "min_tokens": 0, "ignore_eos": True, "skip_special_tokens": True},
    )
    assert c.choices[0].finish_reason == "stop" and c.choices[0].stop_reason == stop_id


def test_greedy_server_output_equals_offline_llm(client, model_path):
    prompts = ["Hello there", "The quick brown fox", "1 2 3 4"]
    llm = LLM(model_path, dtype="float32", max_model_len=MAX_MODEL_LEN)
    offline = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    for prompt, ref in zip(prompts, offline, strict=True):
        got = client.completions.create(
            model=model_path, prompt=prompt, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
        )
        assert got.choices[0].text == ref.outputs[0].text
    messages = [{"role": "user", "content": "Tell me a story"}]
    ref_chat = llm.chat(messages, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    got_chat = client.chat.completions.create(
        model=model_path, messages=messages, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
    )
    assert got_chat.choices[0].message.content == ref_chat[0].outputs[0].text


def test_beam_search_equals_offline_and_frees_everything(server, model_path):
    """use_beam_search on /v1/completions: n beams per prompt, best first, as LLM.beam_search (which
    tests/engine/test_beam_search.py holds to HF) finds them; no request or block is left afterwards."""
    prompts = ["Hello there", "The quick brown fox"]
    llm = LLM(model_path, dtype="float32", max_model_len=MAX_MODEL_LEN)
    offline = llm.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=10, length_penalty=0.5))
    body = dict(prompt=prompts, n=3, max_tokens=10, use_beam_search=True, length_penalty=0.5, return_token_ids=True)
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == list(range(6))
    tok = llm.get_tokenizer()
    for p_idx, (prompt, out) in enumerate(zip(prompts, offline, strict=True)):
        n_prompt = len(tok(prompt).input_ids)
        for i, seq in enumerate(out.sequences):
            choice = choices[p_idx * 3 + i]
            assert choice["token_ids"] == seq.tokens[n_prompt:]
            assert choice["text"] == tok.decode(seq.tokens[n_prompt:])
            assert choice["finish_reason"] == seq.finish_reason == "length"
    assert r.json()["usage"]["completion_tokens"] == 6 * 10
    deadline = time.time() + 1.0
    while time.time() < deadline and server.metric("kvserve:kv_cache_usage_perc") != 0:
        time.sleep(0.05)
    assert server.metric("kvserve:num_requests_running") == 0
    assert server.metric("kvserve:kv_cache_usage_perc") == 0


# ------------------------------------------------------------------ concurrency and metrics


def test_64_concurrent_streams_then_metrics_idle(server, model_path):
    async def one(aclient, i: int) -> tuple[int, int]:
        n = 8 + i % 24
        stream = await aclient.completions.create(
            model=model_path,
            prompt=f"Request number {i}",
            max_tokens=n,
            temperature=0.5,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        usage = None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
        return n, usage

    async def main():
        aclient = server.async_client(timeout=300)
        return await asyncio.gather(*(one(aclient, i) for i in range(64)))

    results = asyncio.run(main())
    assert all(expected == got for expected, got in results), results
    assert server.metric("kvserve:num_requests_running") == 0
    assert server.metric("kvserve:num_requests_waiting") == 0
    assert server.metric("kvserve:kv_cache_usage_perc") == 0
    assert server.metric("kvserve:generation_tokens_total") >= sum(n for n, _ in results)
    assert server.metric("kvserve:time_to_first_token_seconds_count") >= 64
    for name in (
        "inter_token_latency_seconds_count",
        "e2e_request_latency_seconds_count",
        "request_queue_time_seconds_count",
        "prompt_tokens_total",
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
        "num_preemptions_total",
    ):
        server.metric(f"kvserve:{name}")
    assert server.metric("kvserve:request_success_total", finished_reason="length") >= 64


# ------------------------------------------------------------------ bad input


BAD_REQUESTS = [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -5}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -0.1}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "model": "no-such-model"}, "model"),
    ("/v1/completions", {"prompt": "hi " * 300, "max_tokens": 10}, None),
    ("/v1/completions", {"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, None),
    ("/v1/completions", {"prompt": ""}, None),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "hi", "n": 100000}, "n"),
    ("/v1/completions", {"prompt": "hi", "stop": 5}, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": [1, 2]}, "stop"),
    ("/v1/completions", {"prompt": [10**9]}, None),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [10**9]}, "stop_token_ids"),
    ("/v1/completions", {"max_tokens": 3}, "prompt"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, None),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ("/v1/completions", {"prompt": "hi", "use_beam_search": True, "stream": True}, "stream"),
    ("/v1/completions", {"prompt": "hi", "use_beam_search": True, "n": 11}, None),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_schema"}}, None),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "yaml"}}, "response_format"),
    ("/v1/completions", {"prompt": "hi", "guided_regex": "[a-"}, None),
    ("/v1/completions", {"prompt": "hi", "guided_json": "{broken"}, None),
    ("/v1/completions", {"prompt": "hi", "guided_choice": []}, "guided_choice"),
    ("/v1/completions", {"prompt": "hi", "guided_regex": "a", "guided_choice": ["a"]}, "guided"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
        },
        None,
    ),
]


@pytest.mark.parametrize("path,body,param", BAD_REQUESTS)
def test_bad_input_gets_400_with_openai_error_body(server, path, body, param):
    r = httpx.post(f"{server.url}{path}", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["code"] == 400
    if param is not None:
        assert err["param"] is not None and param in err["param"]
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_malformed_json_gets_400(server):
    r = httpx.post(
        f"{server.url}/v1/completions", content=b'{"prompt": "hi",', headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    r = httpx.post(
        f"{server.url}/v1/chat/completions", content=b"not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400


def test_openai_client_sees_bad_request_error(client, model_path):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_path, prompt="hi", max_tokens=10**6)
    assert "maximum context length" in str(e.value)


# ------------------------------------------------------------------ structured outputs


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "adult": {"type": "boolean"}},
    "required": ["name", "adult"],
    "additionalProperties": False,
}


def test_structured_outputs_in_every_accepted_form(client, model_path):
    """OpenAI's response_format, vLLM's structured_outputs and guided_* fields, on both endpoints; greedy, so the
    server's text equals the offline engine's under the same constraint."""
    from kvserve.sampling_params import StructuredOutputsParams

    llm = LLM(model_path, dtype="float32", max_model_len=MAX_MODEL_LEN)
    messages = [{"role": "user", "content": "Describe a person"}]
    forms = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}}, "json"),
        ({"response_format": {"type": "json_object"}}, "json_object"),
        ({"structured_outputs": {"choice": ["red", "green", "blue"]}}, "choice"),
        ({"guided_json": PERSON}, "json"),
        ({"guided_regex": "[0-9]{2}:[0-9]{2}"}, "regex"),
        ({"guided_choice": ["yes", "no"]}, "choice"),
        ({"guided_grammar": 'root ::= "A" | "B" "C"'}, "grammar"),
    ]
    for body, kind in forms:
        field, value = next(iter(body.items()))
        if field == "response_format":
            spec = (
                StructuredOutputsParams(json_object=True)
                if value["type"] == "json_object"
                else StructuredOutputsParams(json=value["json_schema"]["schema"])
            )
        else:
            value = value if field != "structured_outputs" else value["choice"]
            key = {"guided_json": "json", "guided_regex": "regex", "guided_grammar": "grammar"}.get(field, "choice")
            spec = StructuredOutputsParams(**{key: value})
        params = SamplingParams(temperature=0, max_tokens=48, structured_outputs=spec)
        (want,) = llm.chat(messages, params, use_tqdm=False)
        got = client.chat.completions.create(
            model=model_path, messages=messages, max_tokens=48, temperature=0, extra_body=body
        )
        text, reason = got.choices[0].message.content, got.choices[0].finish_reason
        assert (text, reason) == (want.outputs[0].text, want.outputs[0].finish_reason), body
        if reason == "stop" and kind == "json":
            person = json.loads(text)
            assert set(person) == {"name", "adult"} and isinstance(person["adult"], bool)
        elif reason == "stop" and kind == "choice":
            assert text in value
        (want_c,) = llm.generate(["Describe a person"], params, use_tqdm=False)
        got_c = client.completions.create(
            model=model_path, prompt="Describe a person", max_tokens=48, temperature=0, extra_body=body
        )
        assert got_c.choices[0].text == want_c.outputs[0].text, body


def test_constrained_logprobs_are_json_numbers(client, model_path):
    """A grammar that allows one token leaves -inf in the top logprobs: sent as -9999 (vLLM's clamp), never as a
    JSON error, streamed or not, on both endpoints."""
    body = {"guided_choice": ["x"]}
    chat = client.chat.completions.create(
        model=model_path,
        messages=[{"role": "user", "content": "x?"}],
        max_tokens=4,
        logprobs=True,
        top_logprobs=5,
        extra_body=body,
    )
    tops = [t.logprob for t in chat.choices[0].logprobs.content[0].top_logprobs]
    assert chat.choices[0].message.content == "x" and min(tops) == -9999.0 and max(tops) > -9999.0
    comp = client.completions.create(model=model_path, prompt="x?", max_tokens=4, logprobs=5, extra_body=body)
    assert -9999.0 in comp.choices[0].logprobs.top_logprobs[0].values()
    stream = client.completions.create(
        model=model_path, prompt="x?", max_tokens=4, logprobs=5, stream=True, extra_body=body
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == "x"


# ------------------------------------------------------------------ disconnects


def test_client_disconnect_aborts_within_a_second(server, model_path):
    aborted_before = server.metric("kvserve:request_success_total", finished_reason="abort")
    body = {
        "model": model_path,
        "prompt": "Long story",
        "max_tokens": 200,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0,
    }
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data:") and json.loads(line[5:])["choices"][0]["text"]:
                break  # one token received: hang up mid-generation
    deadline = time.time() + 1.0
    while time.time() < deadline:
        if server.metric("kvserve:num_requests_running") == 0:
            break
        time.sleep(0.05)
    assert server.metric("kvserve:num_requests_running") == 0
    assert server.metric("kvserve:kv_cache_usage_perc") == 0
    assert server.metric("kvserve:request_success_total", finished_reason="abort") == aborted_before + 1


def test_speculative_server_matches_and_reports_metrics(tiny_model_factory):
    """`--speculative-config` on a model whose greedy outputs loop (so drafts are accepted): the same text as the
    plain server, and the speculation counters in /metrics."""
    loops = tiny_model_factory("llama-loops")
    spec_config = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "adaptive": false}'
    plain = Server(loops, "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN))
    try:
        ref = plain.client().completions.create(model=loops, prompt="Hello there", max_tokens=40, temperature=0)
    finally:
        assert plain.stop() == 0
    spec = Server(
        loops, "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--speculative-config", spec_config
    )
    try:
        out = spec.client().completions.create(model=loops, prompt="Hello there", max_tokens=40, temperature=0)
        assert out.choices[0].text == ref.choices[0].text
        assert spec.metric("kvserve:spec_decode_num_draft_tokens_total") > 0
        accepted = spec.metric("kvserve:spec_decode_num_accepted_tokens_total")
        assert accepted == spec.metric("kvserve:spec_decode_num_accepted_tokens_per_pos_total")
        assert spec.metric("kvserve:spec_decode_mean_acceptance_length") >= 1.0
    finally:
        assert spec.stop() == 0


def test_int8_server_matches_offline_int8(model_path):
    """`--quantization int8` through the server (engine core in its own process): the same greedy text as the
    offline LLM with int8 (per-token activation quantization keeps each request independent of its batch-mates)."""
    prompts = ["Hello there", "The quick brown fox"]
    llm = LLM(model_path, dtype="float32", max_model_len=MAX_MODEL_LEN, quantization="int8")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    offline = llm.generate(prompts, params, use_tqdm=False)
    # the test can tell: on this model int8's greedy text differs from fp32's
    fp32 = LLM(model_path, dtype="float32", max_model_len=MAX_MODEL_LEN).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].text for o in offline] != [o.outputs[0].text for o in fp32]
    srv = Server(model_path, "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--quantization", "int8")
    try:
        for prompt, ref in zip(prompts, offline, strict=True):
            got = srv.client().completions.create(
                model=model_path, prompt=prompt, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
            )
            assert got.choices[0].text == ref.outputs[0].text
    finally:
        assert srv.stop() == 0, srv.log()


def test_async_scheduling_server_matches_offline_and_frees_everything(model_path):
    """`--async-scheduling` through the server: concurrent requests get the synchronous engine's greedy text, a
    client that hangs up mid-stream is aborted with a step in flight, and the engine ends idle."""
    prompts = [f"Story number {i}:" for i in range(8)]
    lengths = [5 + 3 * i for i in range(8)]
    llm = LLM(model_path, dtype="float32", max_model_len=MAX_MODEL_LEN)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    offline = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    srv = Server(model_path, "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--async-scheduling")
    try:

        async def one(client, prompt, n):
            out = await client.completions.create(
                model=model_path, prompt=prompt, max_tokens=n, temperature=0, extra_body={"ignore_eos": True}
            )
            return out.choices[0].text

        async def all_of_them():
            client = srv.async_client()
            return await asyncio.gather(*(one(client, p, n) for p, n in zip(prompts, lengths, strict=True)))

        assert asyncio.run(all_of_them()) == offline
        body = {"model": model_path, "prompt": "Long story", "max_tokens": 200, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data:") and json.loads(line[5:])["choices"][0]["text"]:
                    break
        deadline = time.time() + 5.0
        while time.time() < deadline and srv.metric("kvserve:num_requests_running") != 0:
            time.sleep(0.05)
        assert srv.metric("kvserve:num_requests_running") == 0
        assert srv.metric("kvserve:kv_cache_usage_perc") == 0
    finally:
        assert srv.stop() == 0, srv.log()

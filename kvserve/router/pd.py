"""The router's prefill/decode mode: `kvserve router --prefill URL ... --decode URL ...`.

Each request goes through two instances (vLLM's disaggregated proxy, with kvserve's failure rules):
1. a prefill instance computes the prompt: the client's body with max_tokens=1, n=1, stream=false, the
   output-shaping fields dropped (stop strings, logprobs, constraints: the one token it samples is discarded) and
   kv_transfer_params {"do_remote_decode": true}; its answer's kv_transfer_params say where the KV is;
2. a decode instance gets the client's own body plus those params, fetches the KV from the prefill instance (the
   pd connector), and its answer (streamed or not, n samples, stop strings...) goes back to the client as it is.
Prompts below `direct_below_tokens` (counted with the model's tokenizer), and completions with several prompts, go
straight to a decode instance, which computes them itself.

Failures, each ending with output or a clear error (and the instances free every block on their own: a lease
that nobody reads expires):
- no prefill instance reachable (or one that dies before answering, or answers 5xx, or without params): the
  decode instance computes the prompt itself;
- the prefill instance refuses the request (4xx): its error goes back to the client;
- no decode instance in rotation: the prefill instance runs the whole request;
- a decode instance unreachable, refusing (e.g. 400: the request does not fit its KV pool; 503) or failing before
  its answer begins (a non-streaming request whose instance dies): the next one, then the prefill instance runs
  the whole request (its prompt is in its prefix cache; the lease nobody reads expires);
- a decode instance failing after its answer began (a stream): an error event, not retried (proxy.py's rules);
- the client going away: the request in flight (prefill or decode) is closed, which the instance takes as an abort.

Instances must agree on the model, dtype, KV block size and tensor-parallel size (their /server_info) and run
the pd connector in a fitting role; one that does not is kept out of rotation with the reason logged and shown
in /router/instances. The transfer's own handshake checks the full KV layout again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import Response

from kvserve.router.instances import Instance, InstanceSet
from kvserve.router.policies import PolicyConfig, RouteInput, make_policy
from kvserve.router.prefix import PromptHasher
from kvserve.router.proxy import Proxy, Unreachable, Upstream, error_response, json_body

logger = logging.getLogger(__name__)

PD_CONNECTORS = ("pd", "PDConnector", "MooncakeConnector")
_PRODUCER_ROLES = ("kv_producer", "kv_both")
_CONSUMER_ROLES = ("kv_consumer", "kv_both")
# Fields that shape the output only: the prefill instance's one token is discarded, so it need not apply them.
_PREFILL_DROP = (
    "stream_options",
    "stop",
    "stop_token_ids",
    "include_stop_str_in_output",
    "min_tokens",
    "max_completion_tokens",
    "n",
    "best_of",
    "logprobs",
    "top_logprobs",
    "echo",
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)
# Fields two instances must agree on for one's KV to serve the other (/server_info).
# The served name, not the path: hosts may keep the same model in different folders.
_MUST_AGREE = ("model", "dtype", "block_size", "tensor_parallel_size")


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in body.items() if k not in _PREFILL_DROP}
    out.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    return out


def decode_body(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    return {**body, "kv_transfer_params": params}


def several_prompts(path: str, body: dict[str, Any]) -> bool:
    """A completions batch (a list of strings or of token lists): the prefill answer would name one KV only."""
    prompt = body.get("prompt")
    return path == "/v1/completions" and isinstance(prompt, list) and len(prompt) > 1 and not isinstance(prompt[0], int)


@dataclass
class PDConfig:
    prefill: list[str]
    decode: list[str]
    direct_below_tokens: int = 0  # prompts with fewer tokens go straight to a decode instance (0: none)


class _BothSets:
    """Both instance sets as one, for the app's /health and /v1/models (decode instances first)."""

    def __init__(self, decode: InstanceSet, prefill: InstanceSet) -> None:
        self.sets = (decode, prefill)

    @property
    def healthy(self) -> list[Instance]:
        return [i for s in self.sets for i in s.healthy]

    @property
    def instances(self) -> list[Instance]:
        return [i for s in self.sets for i in s.instances]


class PDRouter:
    """The PD mode's request path; the app (router/app.py) serves it like its Router."""

    def __init__(self, config, client: httpx.AsyncClient, metrics) -> None:
        pd: PDConfig = config.pd
        self.config = config
        self.pd = pd
        self.client = client
        self.metrics = metrics
        self.prefill = InstanceSet(pd.prefill, client, config.health_interval_s)
        self.decode = InstanceSet(pd.decode, client, config.health_interval_s)
        self.instances = _BothSets(self.decode, self.prefill)
        policy_config: PolicyConfig = config.policy_config
        self.prefill_policy = make_policy(config.policy, policy_config)
        self.decode_policy = make_policy("least_loaded", policy_config)
        needs_tokens = config.policy == "cache_aware" or pd.direct_below_tokens > 0
        self.hasher = PromptHasher(config.tokenizer, config.block_size) if needs_tokens else None
        if pd.direct_below_tokens > 0 and not config.tokenizer:
            raise ValueError("--pd-direct-below needs the model's tokenizer (--model or --tokenizer)")
        self.proxy_prefill = Proxy(client, self.prefill, config.request_timeout_s)
        self.proxy_decode = Proxy(client, self.decode, config.request_timeout_s)
        self._refused: dict[str, str] = {}  # instance url -> why it is kept out of rotation
        for s in (self.prefill, self.decode):
            s.on_change(lambda inst: self.metrics.healthy.labels(inst.name).set(int(inst.healthy)))

    async def start(self) -> None:
        await asyncio.gather(self.decode.start(self.config.startup_wait_s), self.prefill.start(0.0))

    async def stop(self) -> None:
        await asyncio.gather(self.prefill.stop(), self.decode.stop())

    # ------------------------------------------------------------------ which instances may serve

    def _problem(self, inst: Instance, roles: tuple[str, ...], role: str) -> str | None:
        info = inst.info
        if not info or info.get("unknown"):
            return None  # not read yet (an old server): the transfer's handshake still checks
        if info.get("kv_connector") not in PD_CONNECTORS or info.get("kv_role") not in roles:
            return (
                f"not a {role} instance: kv_connector {info.get('kv_connector')!r}, kv_role {info.get('kv_role')!r} "
                f'(start it with --kv-transfer-config \'{{"kv_connector": "pd", "kv_role": "{roles[0]}"}}\')'
            )
        known = [i.info for i in self.prefill.instances + self.decode.instances if i.info and not i.info.get("unknown")]
        reference = known[0] if known else info
        for key in _MUST_AGREE:
            if key in info and key in reference and info[key] != reference[key]:
                return f"{key} {info[key]!r} differs from the other instances' {reference[key]!r}"
        return None

    def _usable(self, instances: InstanceSet, roles: tuple[str, ...], role: str) -> list[Instance]:
        out = []
        for inst in instances.healthy:
            problem = self._problem(inst, roles, role)
            if problem is None:
                self._refused.pop(inst.url, None)
                out.append(inst)
            elif self._refused.get(inst.url) != problem:
                self._refused[inst.url] = problem
                logger.error("%s instance %s kept out of rotation: %s", role, inst.name, problem)
        return out

    # ------------------------------------------------------------------ one request

    async def generate(self, path: str, request: Request) -> Response:
        raw = await request.body()
        body = json_body(raw)
        if not isinstance(body, dict):
            return body
        route = self._route_input(path, body)
        if several_prompts(path, body):
            work = self._direct(path, body, route, "several_prompts")
        elif route.num_prompt_tokens and route.num_prompt_tokens < self.pd.direct_below_tokens:
            work = self._direct(path, body, route, "short_prompt")
        else:
            work = self._disaggregated(path, body, route)
        return await _unless_disconnected(request, work)

    def _route_input(self, path: str, body: dict) -> RouteInput:
        if self.hasher is None:
            return RouteInput(0, block_size=self.config.block_size)
        token_ids = self.hasher.token_ids(path, body) or []
        return RouteInput(len(token_ids), self.hasher.block_hashes(token_ids), self.config.block_size)

    async def _disaggregated(self, path: str, body: dict, route: RouteInput) -> Response:
        if not self._usable(self.decode, _CONSUMER_ROLES, "decode"):
            # Nobody to hand the KV to: the prefill instance runs the whole request (no lease to wait out).
            return await self._plain(
                self.prefill, self.proxy_prefill, self.prefill_policy, path, body, route, "no_decode"
            )
        params = await self._prefill(path, body, route)
        if isinstance(params, Response):
            return params
        if params is None:
            return await self._direct(path, body, route, "no_prefill")
        up = await self._open_decode(path, decode_body(body, params))
        if isinstance(up, Response):
            return up
        if up is None:
            # No decode instance took it: the prefill instance runs the whole request (its prompt is cached there).
            self.metrics.errors.labels("no_decode").inc()
            return await self._plain(
                self.prefill, self.proxy_prefill, self.prefill_policy, path, body, route, "decode_refused"
            )
        return await self.proxy_decode.respond(up, bool(body.get("stream")))

    async def _prefill(self, path: str, body: dict, route: RouteInput) -> dict | Response | None:
        """The prefill instance's kv_transfer_params; a Response to return as it is (the request is refused);
        None when no prefill instance computed it."""
        payload = json.dumps(prefill_body(body)).encode()
        tried: set[str] = set()
        while True:
            candidates = [i for i in self._usable(self.prefill, _PRODUCER_ROLES, "prefill") if i.name not in tried]
            if not candidates:
                return None
            decision = self.prefill_policy.choose(candidates, route)
            inst = decision.instance
            tried.add(inst.name)
            try:
                up = await self.proxy_prefill.open(inst, path, payload, route.num_prompt_tokens)
                status, content, _ = await self.proxy_prefill.read_all(up)
            except (Unreachable, RuntimeError, httpx.HTTPError) as e:
                self.metrics.errors.labels("prefill_failed").inc()
                logger.warning("prefill instance %s failed: %s", inst.name, e)
                continue
            self.metrics.requests.labels(inst.name, "prefill").inc()
            if 400 <= status < 500:
                return Response(content, status_code=status, media_type="application/json")
            params = None
            if status == 200:
                with contextlib.suppress(ValueError, AttributeError):
                    params = json.loads(content).get("kv_transfer_params")
            if status == 200 and isinstance(params, dict) and params.get("do_remote_prefill"):
                return params
            logger.warning("prefill instance %s answered %d without kv_transfer_params", inst.name, status)
            self.metrics.errors.labels("prefill_failed").inc()

    async def _open_decode(self, path: str, body: dict) -> Upstream | Response | None:
        """The decode instance's response, opened (status 200); None when every decode instance refused or was
        unreachable."""
        payload = json.dumps(body).encode()
        tried: set[str] = set()
        while True:
            candidates = [i for i in self._usable(self.decode, _CONSUMER_ROLES, "decode") if i.name not in tried]
            if not candidates:
                return None
            inst = self.decode_policy.choose(candidates, RouteInput(0)).instance
            tried.add(inst.name)
            try:
                up = await self.proxy_decode.open(inst, path, payload, 0)
            except (Unreachable, httpx.HTTPError) as e:
                logger.warning("decode instance %s unreachable: %s", inst.name, e)
                continue
            if up.response.status_code == 200:
                self.metrics.requests.labels(inst.name, "decode").inc()
                return up
            with contextlib.suppress(RuntimeError):
                status, content, _ = await self.proxy_decode.read_all(up)
                logger.warning("decode instance %s refused (%d): %s", inst.name, status, content[:200])
            self.metrics.errors.labels("decode_refused").inc()

    async def _direct(self, path: str, body: dict, route: RouteInput, reason: str) -> Response:
        """The whole request on a decode instance (it computes the prompt itself), or on a prefill instance when no
        decode instance takes it."""
        response = await self._plain(self.decode, self.proxy_decode, self.decode_policy, path, body, route, reason)
        if response.status_code == 503 and not self._usable(self.decode, _CONSUMER_ROLES, "decode"):
            return await self._plain(self.prefill, self.proxy_prefill, self.prefill_policy, path, body, route, reason)
        return response

    async def _plain(
        self, instances: InstanceSet, proxy: Proxy, policy, path: str, body: dict, route: RouteInput, reason: str
    ) -> Response:
        """The client's own request on one of `instances` (the router's ordinary path)."""
        role = "decode" if instances is self.decode else "prefill"
        roles = _CONSUMER_ROLES if role == "decode" else _PRODUCER_ROLES
        payload = json.dumps(body).encode()
        tried: set[str] = set()
        while True:
            candidates = [i for i in self._usable(instances, roles, role) if i.name not in tried]
            if not candidates:
                self.metrics.errors.labels("no_instance").inc()
                reasons = "; ".join(f"{url}: {why}" for url, why in self._refused.items())
                return error_response(f"no {role} instance is available" + (f" ({reasons})" if reasons else ""), 503)
            inst = policy.choose(candidates, route).instance
            tried.add(inst.name)
            try:
                up = await proxy.open(inst, path, payload, route.num_prompt_tokens)
            except Unreachable:
                continue
            except httpx.HTTPError as e:
                return error_response(f"instance {inst.name} failed: {e}", 502)
            self.metrics.requests.labels(inst.name, reason).inc()
            return await proxy.respond(up, bool(body.get("stream")))

    def describe(self) -> list[dict]:
        w = self.config.policy_config.decode_weight
        return [
            {
                "url": i.url,
                "role": role,
                "healthy": i.healthy,
                "refused": self._refused.get(i.url),
                "in_flight": i.num_in_flight,
                "load_tokens": i.load_tokens(w),
                "info": i.info,
            }
            for role, s in (("prefill", self.prefill), ("decode", self.decode))
            for i in s.instances
        ]


async def _unless_disconnected(request: Request, work: Awaitable[Response]) -> Response:
    """`work`'s response, unless the client goes away first: then the work is cancelled, which closes the request
    in flight to an instance (the instance aborts it). A streaming response is returned as soon as it opens;
    from then on the app's streaming notices a disconnect (proxy.py)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watch.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    return Response(status_code=499)


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return

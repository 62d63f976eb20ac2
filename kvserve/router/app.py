"""`kvserve router`: an OpenAI-compatible front over several `kvserve serve` instances.

    kvserve router --instance http://10.0.0.1:8000 --instance http://10.0.0.2:8000 --policy cache_aware

It reaches the instances only over HTTP (tests/test_layering.py): it tokenizes and hashes prompts itself
(router/prefix.py) to ask the global prefix index (router/index.py) which instance holds what, picks an instance
with a policy (router/policies.py), and forwards the request (router/proxy.py). /health answers 200 while any
instance is in rotation; /metrics has the router's counters; /router/instances shows each instance's state.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from kvserve.router.instances import Instance, InstanceSet
from kvserve.router.pd import PDConfig, PDRouter
from kvserve.router.policies import PolicyConfig, RouteInput, make_policy
from kvserve.router.prefix import PromptHasher
from kvserve.router.proxy import Proxy, Unreachable, error_response, json_body

logger = logging.getLogger(__name__)

GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")


@dataclass
class RouterConfig:
    instances: list[str]
    policy: str = "round_robin"
    tokenizer: str | None = None  # the model's tokenizer (folder, .gguf or embedded name): for cache_aware
    block_size: int = 16  # the instances' KV block size (checked against their /server_info)
    index_url: str | None = None  # redis://... of the global prefix index (cache_aware)
    kv_events: list[str] = field(default_factory=list)  # the instances' KV event endpoints, for the indexer
    health_interval_s: float = 1.0
    request_timeout_s: float = 600.0
    startup_wait_s: float = 0.0  # how long start-up waits for a first instance to answer
    policy_config: PolicyConfig = field(default_factory=PolicyConfig)
    # Prefill/decode mode (router/pd.py): set instead of `instances`.
    pd: PDConfig | None = None


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvserve_router_requests", "Requests routed", ["instance", "reason"], registry=r)
        self.errors = Counter("kvserve_router_errors", "Requests ended by an error", ["kind"], registry=r)
        self.healthy = Gauge("kvserve_router_instance_healthy", "1 while in rotation", ["instance"], registry=r)
        self.prompt_blocks = Counter("kvserve_router_prompt_blocks", "Full prompt blocks routed", registry=r)
        self.cached_blocks = Counter(
            "kvserve_router_cached_blocks", "Prompt blocks the chosen instance held (index estimate)", registry=r
        )


class Router:
    def __init__(self, config: RouterConfig, client: httpx.AsyncClient) -> None:
        self.config = config
        self.client = client
        self.instances = InstanceSet(config.instances, client, config.health_interval_s)
        self.policy = make_policy(config.policy, config.policy_config)
        self.hasher = PromptHasher(config.tokenizer, config.block_size) if config.policy == "cache_aware" else None
        self.proxy = Proxy(client, self.instances, config.request_timeout_s)
        self.metrics = RouterMetrics()
        self.index = None  # router/index.py's reader, with cache_aware
        self.indexer = None  # router/indexer.py, with cache_aware
        self._valkey = None  # the embedded index server, when no index URL was given
        self.instances.on_change(self._instance_changed)

    def _instance_changed(self, inst: Instance) -> None:
        self.metrics.healthy.labels(inst.name).set(int(inst.healthy))
        if self.indexer is None:
            return
        endpoint = inst.info.get("kv_events_endpoint")
        if inst.healthy and endpoint:
            replay = inst.info.get("kv_events_replay_endpoint")
            self.indexer.watch(inst.name, reachable(endpoint, inst.url), replay and reachable(replay, inst.url))
        else:
            self.indexer.forget(inst.name)

    async def start(self) -> None:
        if self.config.policy == "cache_aware":
            from kvserve.router.index import IndexReader, IndexWriter
            from kvserve.router.indexer import Indexer

            url = self.config.index_url
            if url is None:
                from kvserve.cluster.valkey import ValkeyService

                self._valkey = ValkeyService()
                url = self._valkey.url
                logger.info("prefix index: an embedded Valkey server at %s", url)
            self.index = IndexReader(url)
            self.indexer = Indexer(IndexWriter(url))
        await self.instances.start(self.config.startup_wait_s)

    async def stop(self) -> None:
        await self.instances.stop()
        if self.indexer is not None:
            self.indexer.close()
        if self.index is not None:
            await self.index.close()
        if self._valkey is not None:
            self._valkey.stop()

    async def route_input(self, path: str, body: dict) -> RouteInput:
        if self.hasher is None:
            return RouteInput(0, block_size=self.config.block_size)
        token_ids = self.hasher.token_ids(path, body) or []
        route = RouteInput(len(token_ids), self.hasher.block_hashes(token_ids), self.config.block_size)
        if self.index is not None and route.block_hashes:
            route.local_hits, route.pool_hits = await self.index.lookup(route.block_hashes)
        return route

    async def generate(self, path: str, request: Request) -> Response:
        raw = await request.body()
        body = json_body(raw)
        if not isinstance(body, dict):
            return body
        route = await self.route_input(path, body)
        tried: set[str] = set()
        while True:
            candidates = [i for i in self.instances.healthy if i.name not in tried]
            if not candidates:
                self.metrics.errors.labels("no_instance").inc()
                return error_response("no instance is available", 503)
            decision = self.policy.choose(candidates, route)
            inst = decision.instance
            tried.add(inst.name)
            try:
                upstream = await self.proxy.open(inst, path, raw, route.num_prompt_tokens)
            except Unreachable:
                self.metrics.errors.labels("unreachable").inc()
                continue
            except httpx.HTTPError as e:
                self.metrics.errors.labels("upstream").inc()
                return error_response(f"instance {inst.name} failed: {e}", 502)
            break
        self.metrics.requests.labels(inst.name, decision.reason).inc()
        self.metrics.prompt_blocks.inc(len(route.block_hashes))
        self.metrics.cached_blocks.inc(decision.cached_blocks)
        return await self.proxy.respond(upstream, bool(body.get("stream")))

    def describe(self) -> list[dict]:
        w = self.config.policy_config.decode_weight
        return [
            {
                "url": i.url,
                "healthy": i.healthy,
                "in_flight": i.num_in_flight,
                "load_tokens": i.load_tokens(w),
                "info": i.info,
            }
            for i in self.instances.instances
        ]


def reachable(endpoint: str, instance_url: str) -> str:
    """An instance's ZMQ endpoint as the router can reach it: a wildcard or loopback host becomes the instance's
    own host (when that is not loopback)."""
    scheme, _, rest = endpoint.partition("://")
    host, _, port = rest.rpartition(":")
    url_host = instance_url.split("://", 1)[-1].rsplit(":", 1)[0]
    loopback = ("127.0.0.1", "localhost")
    if host in ("*", "0.0.0.0", *loopback) and url_host not in loopback:
        host = url_host
    return f"{scheme}://{host}:{port}"


def build_router_app(config: RouterConfig) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        async with httpx.AsyncClient(limits=limits) as client:
            router = PDRouter(config, client, RouterMetrics()) if config.pd is not None else Router(config, client)
            app.state.router = router
            await router.start()
            try:
                yield
            finally:
                await router.stop()

    app = FastAPI(title="kvserve router", lifespan=lifespan)

    def router_of(request: Request) -> Router | PDRouter:
        return request.app.state.router

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await router_of(request).generate("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await router_of(request).generate("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        router = router_of(request)
        for inst in router.instances.healthy:
            with contextlib.suppress(httpx.HTTPError):
                r = await router.client.get(f"{inst.url}/v1/models", timeout=5.0)
                return Response(r.content, status_code=r.status_code, media_type="application/json")
        return error_response("no instance is available", 503)

    @app.get("/health")
    async def health(request: Request) -> Response:
        if not router_of(request).instances.healthy:
            return error_response("no instance is available", 503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(generate_latest(router_of(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/router/instances")
    async def instances(request: Request) -> JSONResponse:
        return JSONResponse(router_of(request).describe())

    @app.get("/router/indexer")
    async def indexer(request: Request) -> JSONResponse:
        router = router_of(request)
        if getattr(router, "indexer", None) is None:  # PD mode keeps no index
            return JSONResponse({})
        from dataclasses import asdict

        return JSONResponse(asdict(router.indexer.stats))

    return app


def run_router(config: RouterConfig, host: str = "127.0.0.1", port: int = 8080, log_level: str = "info") -> None:
    """Serve until SIGINT/SIGTERM (exit status 0 after uvicorn's graceful shutdown, as `kvserve serve`)."""
    import signal
    import sys

    import uvicorn

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    uvicorn.run(build_router_app(config), host=host, port=port, log_level=log_level, access_log=False)

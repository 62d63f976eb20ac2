"""`kvserve` command line: `kvserve generate "prompt"`."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from kvserve.engine.arg_utils import EngineArgs, add_cli_args


def cmd_generate(ns: argparse.Namespace) -> int:
    from kvserve.engine.llm import LLM
    from kvserve.sampling_params import SamplingParams

    params = SamplingParams(
        temperature=ns.temperature,
        top_p=ns.top_p,
        top_k=ns.top_k,
        max_tokens=ns.max_tokens,
        seed=ns.sampling_seed,
    )
    start = time.perf_counter()
    llm = LLM.from_engine_args(EngineArgs.from_cli_args(ns))
    loaded = time.perf_counter()
    tokenizer = llm.get_tokenizer()
    use_chat = ns.chat if ns.chat is not None else bool(getattr(tokenizer, "chat_template", None))
    if use_chat:
        out = llm.chat([{"role": "user", "content": ns.prompt}], params, use_tqdm=False)
    else:
        out = llm.generate(ns.prompt, params, use_tqdm=False)
    done = time.perf_counter()
    completion = out[0].outputs[0]
    print(completion.text.strip() if use_chat else ns.prompt + completion.text)
    n = len(completion.token_ids)
    print(
        f"[{n} tokens in {done - loaded:.2f}s ({n / max(done - loaded, 1e-9):.1f} tok/s), "
        f"model loaded in {loaded - start:.1f}s, finish_reason={completion.finish_reason}]",
        file=sys.stderr,
    )
    return 0


def cmd_serve(ns: argparse.Namespace) -> int:
    from kvserve.entrypoints.openai.api_server import run_server

    args = EngineArgs.from_cli_args(ns)
    if ns.kv_prefault is None:  # a server is idle at start-up: fault the KV pool in then, not in the first steps
        args.kv_prefault = "background"
    run_server(
        args,
        host=ns.host,
        port=ns.port,
        served_model_name=ns.served_model_name,
        graceful_shutdown_s=ns.graceful_shutdown,
        log_level="debug" if ns.verbose else "info",
    )
    return 0


def cmd_router(ns: argparse.Namespace) -> int:
    from kvserve.loader.default_model import resolve_model_path
    from kvserve.router.app import RouterConfig, run_router
    from kvserve.router.pd import PDConfig
    from kvserve.router.policies import PolicyConfig

    pd = None
    if ns.prefill or ns.decode:
        if not (ns.prefill and ns.decode) or ns.instance:
            raise SystemExit("kvserve router: give --prefill and --decode instances (PD mode), or --instance ones")
        pd = PDConfig(ns.prefill, ns.decode, ns.pd_direct_below)
    elif not ns.instance:
        raise SystemExit("kvserve router: give at least one --instance (or --prefill and --decode instances)")
    tokenizer = None
    if ns.policy == "cache_aware" or (pd is not None and pd.direct_below_tokens > 0):
        tokenizer = ns.tokenizer or resolve_model_path(ns.model)
    config = RouterConfig(
        instances=ns.instance or [],
        pd=pd,
        policy=ns.policy,
        tokenizer=tokenizer,
        block_size=ns.block_size,
        index_url=ns.index_url,
        health_interval_s=ns.health_interval,
        request_timeout_s=ns.request_timeout,
        startup_wait_s=ns.startup_wait,
        policy_config=PolicyConfig(decode_weight=ns.decode_weight),
    )
    run_router(config, host=ns.host, port=ns.port, log_level="debug" if ns.verbose else "info")
    return 0


def add_router_parser(sub) -> None:
    from kvserve.router.policies import POLICIES

    router = sub.add_parser(
        "router",
        help="route OpenAI requests over several kvserve instances",
        description="An OpenAI-compatible front over `kvserve serve` instances: /v1/completions and "
        "/v1/chat/completions (streaming passed through), /v1/models, /health, /metrics, /router/instances.",
    )
    router.add_argument("--instance", action="append", default=[], help="an instance's URL (repeat the flag)")
    router.add_argument(
        "--prefill",
        action="append",
        default=[],
        help="PD mode: a prefill instance's URL (repeat; its --kv-transfer-config has kv_role kv_producer)",
    )
    router.add_argument(
        "--decode",
        action="append",
        default=[],
        help="PD mode: a decode instance's URL (repeat; its --kv-transfer-config has kv_role kv_consumer)",
    )
    router.add_argument(
        "--pd-direct-below",
        type=int,
        default=0,
        help="PD mode: prompts with fewer tokens go straight to a decode instance (needs the tokenizer: --model)",
    )
    router.add_argument("--policy", choices=POLICIES, default="round_robin")
    router.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    router.add_argument("--port", type=int, default=8080)
    router.add_argument("--model", default=None, help="the instances' model (its tokenizer, for cache_aware)")
    router.add_argument("--tokenizer", default=None, help="tokenizer folder or .gguf (default: the model's)")
    router.add_argument("--block-size", type=int, default=16, help="the instances' KV block size")
    router.add_argument("--index-url", default=None, help="the global prefix index, redis://host:port (cache_aware)")
    router.add_argument("--health-interval", type=float, default=1.0, help="seconds between health checks")
    router.add_argument("--request-timeout", type=float, default=600.0, help="most seconds a request may take")
    router.add_argument("--startup-wait", type=float, default=30.0, help="seconds to wait for a first instance")
    router.add_argument(
        "--decode-weight", type=float, default=4.0, help="load of a decoding request, in prompt tokens to prefill"
    )
    router.set_defaults(func=cmd_router)


def cmd_cluster(ns: argparse.Namespace) -> int:
    from kvserve.cluster.launch import ClusterConfig, run_cluster

    config = ClusterConfig(
        num_instances=ns.instances,
        model=ns.model,
        pool=ns.pool,
        pool_bytes=ns.pool_bytes,
        policy=ns.policy,
        host=ns.host,
        router_port=ns.port,
        pin=ns.pin,
        serve_args=ns.serve_args or [],
    )
    return run_cluster(config)


def add_cluster_parser(sub) -> None:
    from kvserve.router.policies import POLICIES

    cluster = sub.add_parser(
        "cluster",
        help="start a local cluster: index, shared KV pool, N instances and the router",
        description="Everything a multi-instance deployment has, on this machine, in one command: a Valkey "
        "server (the global prefix index), a shared KV pool (Mooncake master + storage node, or Valkey), N "
        "`kvserve serve` instances publishing KV events and chained to the pool, and `kvserve router`.",
    )
    cluster.add_argument("--instances", type=int, default=2)
    cluster.add_argument("--model", default=None, help="every instance's model (default: the embedded one)")
    cluster.add_argument("--pool", choices=["mooncake", "valkey", "none"], default="mooncake")
    cluster.add_argument("--pool-bytes", default="1 GB", help="the pool's memory")
    cluster.add_argument("--policy", choices=POLICIES, default="cache_aware")
    cluster.add_argument("--host", default="127.0.0.1")
    cluster.add_argument("--port", type=int, default=8080, help="the router's port")
    cluster.add_argument(
        "--pin", action=argparse.BooleanOptionalAction, default=True, help="each instance on its own CPUs"
    )
    cluster.add_argument("--serve-args", nargs=argparse.REMAINDER, help="more `kvserve serve` flags, last")
    cluster.set_defaults(func=cmd_cluster)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description="kvserve: LLM inference engine")
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine progress")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt and print the result")
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sampling-seed", type=int, default=None, help="seed of this request's sampling")
    gen.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="wrap the prompt in the model's chat template (default: when the model has one)",
    )
    add_cli_args(gen)
    gen.set_defaults(func=cmd_generate)

    serve = sub.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /tokenize, /detokenize, /health, "
        "/metrics and /version. The engine core runs in its own process.",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--served-model-name", default=None, help="name clients use in the `model` field (default: the --model value)"
    )
    serve.add_argument(
        "--graceful-shutdown",
        type=float,
        default=5.0,
        help="seconds in-flight requests get to finish after SIGTERM before they are aborted",
    )
    add_cli_args(serve)
    serve.set_defaults(func=cmd_serve)
    add_router_parser(sub)
    add_cluster_parser(sub)

    from kvserve.benchmarks import latency, offload, pd_serve, pd_transport, perplexity, roofline, sharing, throughput
    from kvserve.benchmarks import serve as serve_bench

    bench = sub.add_parser("bench", help="benchmarks: offline throughput, serving load, rooflines")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    throughput.add_parser(bench_sub)
    serve_bench.add_parser(bench_sub)
    roofline.add_parser(bench_sub)
    latency.add_parser(bench_sub)
    perplexity.add_parser(bench_sub)
    offload.add_parser(bench_sub)
    sharing.add_parsers(bench_sub)
    pd_transport.add_parser(bench_sub)
    pd_serve.add_parser(bench_sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if ns.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("kvserve.startup").setLevel(logging.INFO)  # the one-line platform summary
    try:
        return ns.func(ns)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

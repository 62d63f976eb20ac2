"""EngineArgs: user-facing knobs -> validated, frozen EngineConfig (all derived values computed here, once)."""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass, fields, replace

from kvserve.config import (
    EXECUTOR_BACKENDS,
    CacheConfig,
    EngineConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from kvserve.distributed.sharding import check_head_split
from kvserve.engine.combinations import check_engine_config, refusals
from kvserve.loader.arch_config import arch_config_from_hf, read_hf_folder_config
from kvserve.loader.default_model import find_gguf, resolve_model_path
from kvserve.loader.fingerprint import weights_fingerprint
from kvserve.loader.gguf_weights import gguf_arch_config, gguf_linears_quantized
from kvserve.platform import cpu_info, default_dtype, resolve_device
from kvserve.threads import plan_threads
from kvserve.utils import json_object, parse_bytes

logger = logging.getLogger(__name__)

DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
# A server on a GPU prefills in chunks of at most this many tokens per step (with the running decodes), so that a
# step with a prefill chunk stays within a few decode steps and the streams do not stall (measured on an H200:
# docs/benchmarks.md, issue 35).
DEFAULT_SERVING_GPU_MAX_NUM_BATCHED_TOKENS = 384

_DTYPES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
}
_FP16 = ("float16", "fp16", "half")
ATTENTION_BACKENDS = ("auto", "triton", "cpu", "torch")
# vLLM's kv_cache_dtype values kvserve takes ("fp8" is e4m3, as in vLLM).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
LOAD_FORMATS = ("auto", "dummy")


def resolve_dtype(dtype: str, device: str = "cpu") -> str:
    """`auto` is bfloat16 where the CPU computes it natively and float32 elsewhere (kvserve.platform); on a GPU,
    bfloat16 (float16 on GPUs without bf16). An explicit bfloat16 is honoured everywhere, with a warning where it
    is emulated: the weights then stay unpacked (oneDNN refuses to prepack bf16 there) and matmuls are far slower
    than in float32. float16 is for GPUs only."""
    name = str(dtype).lower().removeprefix("torch.")
    if name == "auto":
        return default_dtype(device)
    on_gpu = device.startswith("cuda")
    if on_gpu:
        if name in _FP16:
            return "float16"
        if name not in _DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}; use one of auto, bfloat16, float16, float32")
        return _DTYPES[name]
    if name in _FP16:
        # fp16 matmuls are emulated on CPUs without avx512_fp16/AMX-FP16 (orders of magnitude slower than bf16
        # or fp32; ../shared/MACHINE-FACTS.md): use what "auto" would.
        chosen = default_dtype()
        logger.warning("dtype %s is unusably slow on this CPU; using %s instead", dtype, chosen)
        return chosen
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of auto, bfloat16, float32")
    if _DTYPES[name] == "bfloat16" and not cpu_info().native_bf16:
        logger.warning(
            "dtype bfloat16: this CPU has no native bf16 (%s), so bf16 matmuls are emulated and very slow; "
            "dtype auto picks float32 here",
            cpu_info().describe(),
        )
    return _DTYPES[name]


def resolve_kv_cache_dtype(kv_cache_dtype: str) -> str:
    """vLLM's kv_cache_dtype -> CacheConfig.cache_dtype: "auto", "fp8_e4m3" or "fp8_e5m2" ("fp8" is e4m3)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return "fp8_e4m3" if kv_cache_dtype == "fp8" else kv_cache_dtype


def resolve_quantization(quantization: str | None, gguf_path: str | None) -> str | None:
    """`auto`: int8 for a GGUF whose layer matrices are quantized (a 4-bit file should give a small, fast engine,
    not a 4x larger float one); None (weights in `dtype`) for float GGUFs and HF folders. `none`/None: off.
    `int4`: 4-bit blocks; a GGUF's Q4_0 / Q4_1 tensors as stored, others quantized (kvserve/layers/quant/apply.py)."""
    name = "none" if quantization is None else str(quantization).lower()
    if name == "auto":
        return "int8" if gguf_path is not None and gguf_linears_quantized(gguf_path) else None
    if name == "none":
        return None
    if name not in ("int8", "int4"):
        raise ValueError(f"unsupported quantization {quantization!r}; use one of auto, int8, int4, none")
    return name


@dataclass
class EngineArgs:
    """The engine's options: `LLM(model, **options)` takes them as keywords, and each has a CLI flag of the same
    name (`max_num_seqs` -> `--max-num-seqs`, see add_cli_args for the help texts).

    model: HF model folder, .gguf file or embedded model name (None: the embedded default model).
    tokenizer: tokenizer folder or .gguf (None: the model's). dtype: see resolve_dtype. seed: for requests
    without their own. max_model_len: context limit (None: the model's). max_num_seqs: most requests running at
    once. max_num_batched_tokens: token budget per step (None: 2048, or max_model_len without chunked prefill; a
    server on a GPU: 384, so that steps with a prefill chunk do not stall the streams).
    enable_chunked_prefill / enable_prefix_caching. block_size: tokens per KV block. kv_cache_memory: KV budget in
    bytes (None: 40% of free RAM, at most 4 GiB, or KVSERVE_CPU_KVCACHE_SPACE GiB where set). kv_cache_dtype: what
    K/V are stored as, vLLM's values: "auto" (the model's dtype), "fp8_e4m3" (alias "fp8") or "fp8_e5m2", one byte
    per element, so twice the tokens of a bf16 cache in the same kv_cache_memory (README, "fp8 KV cache").
    num_kv_blocks: exact KV block count (overrides the memory).
    kv_prefault: fault the KV pool in at start-up: "off", "sync" or "background".
    num_threads / cpu_bind: compute threads (None: KVSERVE_NUM_THREADS, else the CPUs free to this process) and an
    optional CPU list to pin them to, e.g. "0-3" (kvserve/threads.py).
    speculative_config: a dict (or its JSON) with vLLM's keys, e.g. {"method": "ngram", "num_speculative_tokens":
    4} (config.SpeculativeConfig).
    quantization: "int8", "int4", "none" or "auto" (int8 for a quantized GGUF), see resolve_quantization.
    preemption_mode: "recompute" (default) or "swap" (a preempted request's KV goes to `swap_space` bytes of CPU
    memory and comes back; recompute when that is full). swap_space: bytes or "4GiB" (default 1 GiB with swap).
    kv_transfer_config: a KV connector, a dict (or its JSON) such as {"kv_connector": "offload", "cpu_bytes":
    "2GiB", "disk_path": "/tmp/kv", "disk_bytes": "20GiB"} (kvserve/kv_transfer), with vLLM's `kv_role`.
    kv_events_config: publish KV cache events, a dict (or its JSON) with vLLM's keys, e.g.
    {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:5557"} (config.KVEventsConfig).
    async_scheduling: schedule the next step while the current one runs, so that the host's work (scheduling,
    inputs, launches) overlaps the device's; outputs come one step later. None (default): on for a GPU where nothing
    excludes it (engine/combinations.py), off on the CPU (its forward pass is synchronous: async only reorders the
    work); True where something excludes it is refused with the reason. Structured outputs run synchronous steps
    while they are there.
    tensor_parallel_size: ranks the model is split over (heads, MLP columns, vocabulary).
    distributed_executor_backend: where the ranks run: "uniproc" (in the engine process; TP=1 only), "mp" (worker
    processes on this machine) or "ray" (Ray actors; a Ray cluster's machines); None: uniproc for TP=1, else mp.
    worker_timeout_s: a step or worker call that takes longer fails the engine (a hung worker); None: 300 s.
    device: "auto" (the GPU when torch sees one, else the CPU), "cpu" or "cuda". gpu_memory_utilization (GPU): the
    share of the GPU's memory for weights, activations and KV cache; the KV pool is what a profiling run leaves.
    enforce_eager (GPU): no CUDA graphs. load_format: "auto" (the checkpoint) or "dummy" (random weights, for
    benchmarks). attention_backend: "auto", "triton" (GPU, or the CPU under TRITON_INTERPRET=1), "cpu" (C++
    kernels) or "torch" (the reference).
    deterministic: batch-invariant inference, a request's tokens and logprobs independent of the batch, of its
    prompt's chunking and of where its KV came from (README, "Deterministic inference"). True: required (refused
    where it cannot hold: the GPU, the pure-torch paths, TP > 1); False: off; None (default): on where it costs
    nothing (bf16 with the C++ kernels on CPUs with AVX512-BF16), off elsewhere (in fp32, long prompts go faster
    through SDPA: docs/benchmarks.md, "Deterministic inference"). VLLM_BATCH_INVARIANT=1 in the environment
    means True when this is None.
    """

    model: str | None = None  # None: the embedded default model
    tokenizer: str | None = None
    dtype: str = "auto"
    # "auto" | "int8" | "none"/None. Off by default: a quantized GGUF then runs its own weights, decoded exactly, at
    # the full precision of `dtype`, and its greedy outputs match HF transformers' token for token; int8 (+0.5%
    # perplexity, docs/benchmarks.md) is opted into with "auto" or "int8".
    quantization: str | None = "none"
    seed: int = 0
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes
    kv_cache_dtype: str = "auto"  # "auto" | "fp8" (= "fp8_e4m3") | "fp8_e4m3" | "fp8_e5m2"
    num_kv_blocks: int | None = None
    kv_prefault: str = "off"  # "off" | "sync" | "background"; `kvserve serve` defaults to background
    num_threads: int | None = None
    cpu_bind: str | None = None  # e.g. "0-3" or "0,2"
    speculative_config: dict | str | None = None
    preemption_mode: str = "recompute"
    swap_space: int | str | None = None
    kv_transfer_config: dict | str | None = None
    kv_events_config: dict | str | None = None
    async_scheduling: bool | None = None
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    worker_timeout_s: float | None = None
    device: str = "auto"  # "auto" (CUDA when torch sees a GPU) | "cpu" | "cuda"
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    load_format: str = "auto"  # "auto" | "dummy" (random weights)
    attention_backend: str = "auto"  # "auto" | "triton" | "cpu" | "torch"
    deterministic: bool | None = None  # None: on where it costs nothing (VLLM_BATCH_INVARIANT=1: True)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineArgs:
        """Every field from the flag of the same name (add_cli_args); a flag left at None keeps the field default."""
        values = {f.name: getattr(ns, f.name) for f in fields(cls)}
        return cls(**{name: v for name, v in values.items() if v is not None})

    def create_engine_config(self, serving: bool = False) -> EngineConfig:
        """`serving`: the engine runs beside an API server, which may get a CPU of its own (kvserve/threads.py)."""
        threads = plan_threads(self.num_threads, self.cpu_bind, serving)  # first: bad counts fail before loading
        device = resolve_device(self.device)
        path = resolve_model_path(self.model)
        gguf_path = find_gguf(path)
        if gguf_path is not None:
            arch = gguf_arch_config(gguf_path)
            fmt, model_path = "gguf", gguf_path
        else:
            hf_config, generation_config = read_hf_folder_config(path)
            arch = arch_config_from_hf(hf_config, generation_config)
            fmt, model_path = "hf", path

        max_model_len = self.max_model_len or arch.max_position_embeddings
        if max_model_len > arch.max_position_embeddings:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
                f"{arch.max_position_embeddings}"
            )
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.kv_prefault not in ("off", "sync", "background"):
            raise ValueError(f"kv_prefault must be off, sync or background, got {self.kv_prefault!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = DEFAULT_MAX_NUM_BATCHED_TOKENS
            if serving and device.startswith("cuda"):
                budget = DEFAULT_SERVING_GPU_MAX_NUM_BATCHED_TOKENS
            if not self.enable_chunked_prefill:
                budget = max(budget, max_model_len)
        if budget < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {budget}")
        if not self.enable_chunked_prefill and budget < max_model_len:
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens ({budget}) must be >= max_model_len "
                f"({max_model_len}), or long prompts could never be scheduled"
            )

        model = ModelConfig(
            model=self.model or "smollm2-135m-instruct",
            path=model_path,
            format=fmt,
            tokenizer=self.tokenizer or model_path,
            dtype=resolve_dtype(self.dtype, device),
            max_model_len=max_model_len,
            arch=arch,
            seed=self.seed,
            quantization=resolve_quantization(self.quantization, gguf_path),
            device=device,
            load_format=self.load_format,
            attention_backend=self.attention_backend,
            enforce_eager=bool(self.enforce_eager),
            fingerprint=weights_fingerprint(model_path, self.load_format, self.seed),
            deterministic=self._deterministic(),
        )
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be recompute or swap, got {self.preemption_mode!r}")
        swap_space = parse_bytes(self.swap_space) if self.swap_space is not None else 1 << 30
        if swap_space < 0:
            raise ValueError(f"swap_space must be >= 0, got {self.swap_space}")
        cache = CacheConfig(
            block_size=self.block_size,
            kv_cache_memory=self.kv_cache_memory,
            cache_dtype=resolve_kv_cache_dtype(self.kv_cache_dtype),
            num_kv_blocks=self.num_kv_blocks,
            enable_prefix_caching=self.enable_prefix_caching,
            kv_prefault=self.kv_prefault,
            swap_space=swap_space if self.preemption_mode == "swap" else 0,
            gpu_memory_utilization=self.gpu_memory_utilization,
        )
        scheduler = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
            preemption_mode=self.preemption_mode,
            async_scheduling=bool(self.async_scheduling),
        )
        spec = json_object(self.speculative_config, "speculative_config")
        speculative = SpeculativeConfig.from_dict(spec) if spec else None
        kv_transfer = _kv_transfer_config(self.kv_transfer_config)
        if speculative is not None and speculative.method != "ngram":
            speculative = replace(speculative, draft=draft_model_config(speculative, model))
            if speculative.method == "eagle" and "draft_vocab_size" not in spec:
                speculative = replace(speculative, draft_vocab_size=_head_draft_vocab_size(speculative.draft.path))
            _check_draft_vocab(speculative)
        self._check_device_options(model)
        config = EngineConfig(
            model=model,
            cache=cache,
            scheduler=scheduler,
            threads=threads,
            speculative=speculative,
            kv_transfer=kv_transfer,
            parallel=self._parallel_config(arch),
            kv_events=_kv_events_config(self.kv_events_config),
        )
        if self.async_scheduling is None and device.startswith("cuda"):
            # Default on a GPU (it measured faster there: docs/gpu.md), unless something excludes it.
            trial = replace(config, scheduler=replace(scheduler, async_scheduling=True))
            if not any(r.startswith("async_scheduling") for r in refusals(trial)):
                config = trial
        check_engine_config(config)
        return config

    def _deterministic(self) -> bool | None:
        """The deterministic option, or vLLM's VLLM_BATCH_INVARIANT=1 when it is left unset."""
        if self.deterministic is None and os.environ.get("VLLM_BATCH_INVARIANT", "").strip() == "1":
            return True
        if self.deterministic is not None and not isinstance(self.deterministic, bool):
            raise ValueError(f"deterministic must be True, False or None, got {self.deterministic!r}")
        return self.deterministic

    def _check_device_options(self, model: ModelConfig) -> None:
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}"
            )
        util = self.gpu_memory_utilization
        if isinstance(util, bool) or not isinstance(util, (int, float)) or not 0 < util <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {util!r}")

    def _backend(self) -> str:
        return self.distributed_executor_backend or ("uniproc" if self.tensor_parallel_size == 1 else "mp")

    def _parallel_config(self, arch) -> ParallelConfig:
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
        backend = self._backend()
        if backend not in EXECUTOR_BACKENDS:
            raise ValueError(
                f"distributed_executor_backend must be one of {', '.join(EXECUTOR_BACKENDS)}, got {backend!r}"
            )
        if backend == "uniproc" and tp > 1:
            raise ValueError("distributed_executor_backend uniproc runs one rank; use mp or ray for TP > 1")
        if tp > 1:
            check_head_split(arch.num_attention_heads, arch.num_key_value_heads, tp)
            if arch.intermediate_size % tp:
                raise ValueError(
                    f"intermediate_size ({arch.intermediate_size}) is not divisible by tensor_parallel_size ({tp})"
                )
        timeout = self.worker_timeout_s
        if timeout is None:
            return ParallelConfig(tensor_parallel_size=tp, distributed_executor_backend=backend)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"worker_timeout_s must be a number > 0, got {timeout!r}")
        return ParallelConfig(tensor_parallel_size=tp, distributed_executor_backend=backend, worker_timeout_s=timeout)


def _kv_events_config(value: dict | str | None) -> KVEventsConfig | None:
    value = json_object(value, "kv_events_config")
    return KVEventsConfig.from_dict(value) if value is not None else None


def _kv_transfer_config(value: dict | str | None) -> KVTransferConfig | None:
    from kvserve.kv_transfer.factory import validate

    value = json_object(value, "kv_transfer_config")
    if value is None:
        return None
    config = KVTransferConfig.from_dict(value)
    validate(config)
    return config


def _head_draft_vocab_size(folder: str) -> int:
    """The draft vocabulary an EAGLE head was trained for (`draft_vocab_size` in its config.json, as EAGLE-3's heads
    write it; scripts/train_eagle_head.py --train-vocab), 0 if none: the head's logits outside it were never
    trained, so it drafts over it unless the user says otherwise."""
    from kvserve.spec_decode.draft_vocab import counts_path

    if not os.path.exists(os.path.join(folder, "config.json")) or not os.path.exists(counts_path(folder)):
        return 0  # our vocabularies come from the counts
    return int(read_hf_folder_config(folder)[0].get("draft_vocab_size") or 0)


def _check_draft_vocab(spec: SpeculativeConfig) -> None:
    """A draft vocabulary needs the token counts beside the head or draft model, and at most the whole vocabulary."""
    if not spec.draft_vocab_size:
        return
    from kvserve.spec_decode.draft_vocab import counts_folder, counts_path

    assert spec.draft is not None
    vocab = spec.draft.arch.vocab_size
    if spec.draft_vocab_size > vocab:
        raise ValueError(
            f"speculative_config: draft_vocab_size {spec.draft_vocab_size} exceeds the vocabulary ({vocab})"
        )
    if not os.path.exists(counts_path(spec.draft.path)):
        raise ValueError(
            f"speculative_config: draft_vocab_size needs token counts at {counts_path(spec.draft.path)} "
            f"(run scripts/draft_vocab_counts.py --out {counts_folder(spec.draft.path)})"
        )


def draft_model_config(spec: SpeculativeConfig, target: ModelConfig) -> ModelConfig:
    """The draft model's (draft_model) or EAGLE head's (eagle) ModelConfig: dtype, seed and max_model_len are the
    target's; the vocabulary must be the target's too."""
    if spec.method == "eagle":
        from kvserve.spec_decode.eagle import default_head_dir

        path = spec.model or default_head_dir(target.model)
        if not os.path.isdir(path):
            hint = "run scripts/train_eagle_head.py to fit one" if spec.model is None else "check the path"
            raise ValueError(f"speculative_config: no EAGLE head at {path} ({hint}, or pass 'model')")
        # The head is one decoder layer of the target's shape (kvserve.spec_decode.eagle).
        return replace(target, model=path, path=path, format="hf", arch=replace(target.arch, num_hidden_layers=1))
    assert spec.model is not None
    path = resolve_model_path(spec.model)
    gguf_path = find_gguf(path)
    arch = gguf_arch_config(gguf_path) if gguf_path is not None else arch_config_from_hf(*read_hf_folder_config(path))
    if arch.vocab_size != target.arch.vocab_size:
        raise ValueError(
            f"speculative_config: the draft model's vocabulary ({arch.vocab_size}) differs from the target's "
            f"({target.arch.vocab_size})"
        )
    if arch.max_position_embeddings < target.max_model_len:
        raise ValueError(
            f"speculative_config: the draft model's max_position_embeddings ({arch.max_position_embeddings}) is "
            f"below max_model_len ({target.max_model_len})"
        )
    return replace(
        target,
        model=spec.model,
        path=gguf_path or path,
        format="gguf" if gguf_path is not None else "hf",
        tokenizer=gguf_path or path,
        arch=arch,
        quantization=spec.quantization or target.quantization,
    )


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags shared by every subcommand that builds an engine."""
    d = EngineArgs()
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=None,
        help="HF model folder, .gguf file, or embedded model name (default: smollm2-135m-instruct)",
    )
    g.add_argument("--tokenizer", default=None, help="tokenizer folder or .gguf (default: the model's)")
    g.add_argument(
        "--dtype",
        default=d.dtype,
        help="auto (GPU: bfloat16; CPU: bfloat16 where it has native bf16, else float32), bfloat16, float32, "
        "float16 (GPU)",
    )
    g.add_argument("--device", default=d.device, help="auto (the GPU when torch sees one, else the CPU), cpu, cuda")
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=d.gpu_memory_utilization,
        help="GPU: share of its memory for weights, activations and the KV cache (the KV pool is what a profiling "
        "run leaves; --kv-cache-memory or --num-kv-blocks override)",
    )
    g.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="GPU: run every step eagerly (no CUDA graphs for decode batches)",
    )
    g.add_argument(
        "--load-format",
        choices=LOAD_FORMATS,
        default=d.load_format,
        help="auto: the checkpoint's weights; dummy: random weights of the model's shapes (benchmarks)",
    )
    g.add_argument(
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        default=d.attention_backend,
        help="auto (GPU: triton; CPU: the C++ kernels, else torch), triton, cpu, torch",
    )
    g.add_argument(
        "--deterministic",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="batch-invariant inference: a request's tokens and logprobs do not depend on the batch, the prompt's "
        "chunking or the prefix cache (default: on where it costs nothing, bf16 on CPUs with AVX512-BF16; off in "
        "fp32, where it slows long prompts; VLLM_BATCH_INVARIANT=1 turns it on)",
    )
    g.add_argument(
        "--quantization",
        choices=["auto", "int8", "int4", "none"],
        default=d.quantization,
        help="int8: int8 linear layers and LM head; int4: 4-bit blocks (a GGUF's Q4_0/Q4_1 tensors as stored); "
        "auto: int8 for a quantized GGUF, else none; none (default)",
    )
    g.add_argument("--seed", type=int, default=d.seed, help="seed for requests without their own")
    g.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="most requests running at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget per step (default: 2048)")
    g.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block")
    g.add_argument(
        "--kv-cache-memory",
        type=_bytes,
        default=None,
        help="KV cache budget, e.g. 2GiB or 512MiB (default: 40%% of free RAM, at most 4 GiB; "
        "KVSERVE_CPU_KVCACHE_SPACE=<GiB> sets it)",
    )
    g.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default=d.kv_cache_dtype,
        help="what K/V are stored as: auto (the model's dtype), fp8_e4m3 (fp8) or fp8_e5m2, one byte per element "
        "(twice the tokens in the same --kv-cache-memory; e4m3 with scale 1.0, as vLLM without calibration)",
    )
    g.add_argument("--num-kv-blocks", type=int, default=None, help="exact number of KV blocks (overrides memory)")
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse KV blocks of shared prompt prefixes",
    )
    g.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="split long prompts across steps, next to running decodes",
    )
    g.add_argument(
        "--kv-prefault",
        choices=["off", "sync", "background"],
        default=None,
        help="fault the KV pool's memory in at start-up: before the engine is ready (sync), from a background "
        "thread, or on first use (off); default: background for serve, off otherwise",
    )
    g.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="compute threads (default: KVSERVE_NUM_THREADS, else the CPUs this process may use, by affinity and "
        "cgroup quota, less one for the frontend when serving on 4+ CPUs)",
    )
    g.add_argument("--cpu-bind", default=None, help="pin the compute threads to these CPUs, e.g. 0-3 (default: off)")

    g.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=d.tensor_parallel_size,
        help="split the model over this many ranks (each with its share of the CPUs)",
    )
    g.add_argument(
        "--distributed-executor-backend",
        choices=["uniproc", "mp", "ray"],
        default=None,
        help="where the ranks run: in the engine process (uniproc, TP=1), worker processes (mp), or Ray actors "
        "(ray; joins RAY_ADDRESS's cluster if set); default: uniproc for TP=1, else mp",
    )
    g.add_argument(
        "--worker-timeout-s",
        type=float,
        default=None,
        help="seconds a step or worker call may take before the engine fails as hung (default 300)",
    )
    g.add_argument(
        "--speculative-config",
        default=None,
        help='speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'; EAGLE-2 '
        'draft trees: \'{"method": "eagle", "tree_depth": 4, "tree_topk": 4, "tree_num_nodes": 16}\'',
    )
    g.add_argument(
        "--preemption-mode",
        choices=["recompute", "swap"],
        default=None,
        help="what a preempted request loses: recompute (default) or swap (its KV goes to --swap-space and back)",
    )
    g.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="schedule the next step while the current one runs (the host's work overlaps the GPU's; outputs come "
        "one step later); not with speculative decoding, a KV connector or TP > 1",
    )
    g.add_argument("--swap-space", default=None, help="CPU memory for swap preemption, e.g. 4GiB (default 1GiB)")
    g.add_argument(
        "--kv-transfer-config",
        default=None,
        help='KV connector as JSON, e.g. \'{"kv_connector": "offload", "cpu_bytes": "2GiB", "disk_path": '
        '"/tmp/kvserve-kv", "disk_bytes": "20GiB"}\' (RAM and disk tiers beyond the KV pool)',
    )
    g.add_argument(
        "--kv-events-config",
        default=None,
        help='publish KV cache events as JSON, e.g. \'{"enable_kv_cache_events": true, "endpoint": '
        '"tcp://127.0.0.1:5557"}\' (for a global KV index or a cache-aware router)',
    )


def _bytes(text: str) -> int:
    return parse_bytes(text)

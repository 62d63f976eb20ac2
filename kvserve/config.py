"""Frozen configuration dataclasses. Each component receives only the sub-config it needs.

Derived values are computed once by `kvserve.engine.arg_utils.EngineArgs`; nothing here is mutated after
start-up. Pure Python (no torch), so core/ may import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.threads import ThreadPlan


@dataclass(frozen=True)
class ArchConfig:
    """Architecture hyper-parameters of a decoder-only model (HF config.json names)."""

    architecture: str  # HF class name, e.g. "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float  # the norms' epsilon (BLOOM's LayerNorms: layer_norm_epsilon)
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: dict | None = field(default=None, hash=False)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: q/k/v projections carry a bias
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k before RoPE
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Per layer: the keys a query sees, itself included (HF's `sliding_window`), or None for full attention.
    # Empty: every layer attends over the whole context.
    sliding_windows: tuple[int | None, ...] = ()

    # ALiBi position biases (kvserve/layers/alibi.py) instead of RoPE: BLOOM.
    alibi: bool = False
    # BLOOM's apply_residual_connection_post_layernorm: each residual branch starts from the normed input.
    residual_post_layernorm: bool = False

    def sliding_window(self, layer: int) -> int | None:
        return self.sliding_windows[layer] if self.sliding_windows else None

    @property
    def has_sliding_window(self) -> bool:
        return any(w is not None for w in self.sliding_windows)


@dataclass(frozen=True)
class ModelConfig:
    model: str  # what the user asked for (path or embedded model name)
    path: str  # resolved: a folder (HF) or a .gguf file
    format: str  # "hf" | "gguf"
    tokenizer: str  # folder or .gguf file the tokenizer is read from
    dtype: str  # "float32" | "bfloat16" | "float16" (GPUs only)
    max_model_len: int
    arch: ArchConfig
    seed: int = 0
    # resolved: "int8" (int8 linears and LM head), "int4" (4-bit block linears) or None (weights in dtype)
    quantization: str | None = None
    device: str = "cpu"  # resolved: "cpu" or "cuda[:N]"
    # "auto": the checkpoint's weights; "dummy": random weights of the right shapes, no checkpoint read (vLLM's
    # name; for benchmarks of model shapes whose weights are not at hand).
    load_format: str = "auto"
    # Attention backend: "auto" (the device's best), "triton", "cpu" (the C++ kernels) or "torch" (the reference).
    attention_backend: str = "auto"
    # GPU only: run every step eagerly, without captured CUDA graphs for decode batches.
    enforce_eager: bool = False
    # The weights' identity (loader/fingerprint.py): part of the KV layout id, so KV shared between instances is
    # keyed by what computed it, not by where the model lies.
    fingerprint: str = ""
    # Deterministic (batch-invariant) inference: a request's tokens and logprobs do not depend on the batch, the
    # chunking of its prompt or where its KV came from (kvserve/layers/batch_invariant.py). True: required (the
    # engine refuses to start where it cannot hold); False: off (the fastest paths); None: on where it costs
    # nothing measurable (the C++ kernels with the pair-packed bf16 cache: bf16 on CPUs with AVX512-BF16), off
    # elsewhere.
    deterministic: bool | None = None


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # Bytes for K and V of all layers; None means a default derived from available memory.
    kv_cache_memory: int | None = None
    # What a K/V element is stored as (vLLM's cache_dtype, resolved): "auto" (the model's dtype), "fp8_e4m3" or
    # "fp8_e5m2" (one byte; kvserve/attention/kv_dtype.py). Fixed for the pool's whole life.
    cache_dtype: str = "auto"
    # Exact number of blocks (overrides kv_cache_memory), like vLLM's num_gpu_blocks_override.
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    # Fault the KV pool's pages in at start-up: "off" (on first use), "sync" (before the engine is ready) or
    # "background" (a daemon thread; what `kvserve serve` does).
    kv_prefault: str = "off"
    # Bytes of CPU memory for swap preemption (vLLM V0's swap_space); used only with preemption_mode "swap".
    swap_space: int = 0
    # GPU only, when neither kv_cache_memory nor num_kv_blocks is given: the share of the GPU's memory the engine
    # may use in all (weights, activations and KV cache); the KV cache gets what profiling leaves of it.
    gpu_memory_utilization: float = 0.9


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    # What a preempted request loses: "recompute" (its blocks are freed, its prefill redone) or "swap" (its
    # blocks are copied to the swap space and back; recompute when the swap space is full).
    preemption_mode: str = "recompute"
    # Schedule step N+1 while step N runs (vLLM's async scheduling): each request in flight counts one
    # placeholder token for the output it is producing, and the runner feeds that token from the device.
    async_scheduling: bool = False


KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass(frozen=True)
class KVTransferConfig:
    """A KV connector chosen by name (kvserve.kv_transfer.factory) and its own options, e.g.
    {"kv_connector": "offload", "cpu_bytes": "2GiB", "disk_path": "/var/cache/kvserve", "disk_bytes": "20GiB"}."""

    kv_connector: str
    # The connector's options (every key but the named fields below), as sorted (key, value) pairs so the config
    # stays immutable; `options` gives them back as a dict.
    extra: tuple[tuple[str, object], ...] = ()
    # vLLM's roles: what this instance does with KV between instances (prefill/decode disaggregation): produce it
    # (a prefill instance), consume it (a decode instance), or both. Connectors that only move KV within an
    # instance (the offload tiers) ignore it.
    kv_role: str = "kv_both"
    # This instance's name among instances that exchange KV (None: a random one at start-up).
    engine_id: str | None = None
    # vLLM's `kv_connector_module_path`: a module that registers the connector (kv_transfer/factory.py) when
    # imported, in every process that builds a side of it.
    module_path: str | None = None

    @classmethod
    def from_dict(cls, d: dict) -> KVTransferConfig:
        d = dict(d)
        name = d.pop("kv_connector", None)
        if not isinstance(name, str) or not name:
            raise ValueError(f"kv_transfer_config: kv_connector must name a connector, got {name!r}")
        nested = d.pop("kv_connector_extra_config", None) or {}  # vLLM's spelling of the options
        if not isinstance(nested, dict):
            raise ValueError("kv_transfer_config: kv_connector_extra_config must be an object")
        d.update(nested)
        role = d.pop("kv_role", None) or "kv_both"
        if role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config: kv_role must be one of {', '.join(KV_ROLES)}, got {role!r}")
        engine_id = d.pop("engine_id", None)
        if engine_id is not None and (not isinstance(engine_id, str) or not engine_id):
            raise ValueError(f"kv_transfer_config: engine_id must be a non-empty string, got {engine_id!r}")
        module_path = d.pop("kv_connector_module_path", None)
        if module_path is not None and (not isinstance(module_path, str) or not module_path):
            raise ValueError(f"kv_transfer_config: kv_connector_module_path must name a module, got {module_path!r}")
        return cls(name, tuple(sorted(d.items())), role, engine_id, module_path)

    @property
    def options(self) -> dict:
        return dict(self.extra)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config` keys). Built by `SpeculativeConfig.from_dict`."""

    method: str  # "ngram" | "draft_model" | "eagle"
    num_speculative_tokens: int  # K: most draft tokens per request and step
    # draft_model: the draft model (folder, .gguf or embedded name); eagle: the EAGLE head's folder (None: the head
    # that scripts/train_eagle_head.py fits for the embedded default model). vLLM's key name.
    model: str | None = None
    prompt_lookup_min: int = 2  # n-gram: shortest suffix to match
    prompt_lookup_max: int = 4  # n-gram: longest suffix to match (tried first)
    # Speculate only while at most this many requests run (vLLM's name); None: no limit.
    disable_by_batch_size: int | None = None
    # The cost-aware policy of kvserve.core.spec_policy: per step and request, only the drafts that measured
    # acceptance and costs say will pay (none where they do not). False: every request gets K every step.
    adaptive: bool = True
    # draft_model / eagle: the draft's LM head computes the logits of this many most frequent tokens only, from
    # the counts beside the head or draft model (kvserve.spec_decode.draft_vocab); 0: the full vocabulary.
    draft_vocab_size: int = 0
    # draft_model / eagle: "int8" quantizes the draft's weights at load (the EAGLE head's layer and fc, its draft LM
    # head; a draft model's linears) whatever the target's; None: a draft model as the target, an EAGLE head in the
    # model dtype with its LM head in the target's form. vLLM's key name (there it names the checkpoint's method).
    quantization: str | None = None
    # eagle only: EAGLE-2 draft trees (kvserve.spec_decode.tree) instead of a chain. Any of the three turns them on;
    # the others default. `tree_depth`: most levels below the last verified token; `tree_topk`: children per
    # expanded node (and nodes expanded per level); `tree_num_nodes`: draft tokens verified per step, which is
    # num_speculative_tokens (either key sets the other; both must then agree). None everywhere: the chain.
    tree_depth: int | None = None
    tree_topk: int | None = None
    tree_num_nodes: int | None = None
    # Resolved by EngineArgs from `model`: the draft model's (or the EAGLE head's) config.
    draft: ModelConfig | None = field(default=None, hash=False)

    _METHODS = ("ngram", "draft_model", "eagle")
    _TREE_KEYS = ("tree_depth", "tree_topk", "tree_num_nodes")
    DEFAULT_TREE_DEPTH = 4
    DEFAULT_TREE_TOPK = 4

    @property
    def tree(self) -> bool:
        """Draft trees (EAGLE-2) rather than a chain; then tree_depth and tree_topk are set and
        num_speculative_tokens is the tree's node count."""
        return self.tree_depth is not None

    @property
    def num_lookahead_slots(self) -> int:
        """KV slots a model proposer writes past a request's step tokens: the chain's K draft steps; a tree's
        expansions, each over the expanded nodes and their ancestors (at most tree_topk per level), if more."""
        if not self.tree:
            return self.num_speculative_tokens
        assert self.tree_depth is not None and self.tree_topk is not None
        return max(self.num_speculative_tokens, (self.tree_depth - 1) * self.tree_topk)

    @classmethod
    def from_dict(cls, d: dict) -> SpeculativeConfig:
        d = dict(d)
        unknown = sorted(set(d) - {f for f in cls.__dataclass_fields__ if not f.startswith("_")} - {"draft"})
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}")
        method = d.get("method") or ("ngram" if "prompt_lookup_max" in d or "prompt_lookup_min" in d else None)
        if method not in cls._METHODS:
            raise ValueError(f"speculative_config: method must be one of {', '.join(cls._METHODS)}, got {method!r}")
        if method == "draft_model" and not d.get("model"):
            raise ValueError("speculative_config: method 'draft_model' needs 'model' (the draft model's path or name)")
        if method == "ngram":
            d.pop("model", None)
        d["method"] = method
        if any(d.get(key) is not None for key in cls._TREE_KEYS):
            _resolve_tree_options(d)
        k = d.get("num_speculative_tokens")
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"speculative_config: num_speculative_tokens must be an integer >= 1, got {k!r}")
        # As in vLLM, one of the two lookup bounds alone sets both.
        if "prompt_lookup_min" in d and "prompt_lookup_max" not in d:
            d["prompt_lookup_max"] = d["prompt_lookup_min"]
        elif "prompt_lookup_max" in d and "prompt_lookup_min" not in d:
            d["prompt_lookup_min"] = min(cls.prompt_lookup_min, d["prompt_lookup_max"])
        config = cls(**d)
        if not isinstance(config.draft_vocab_size, int) or config.draft_vocab_size < 0:
            raise ValueError(
                f"speculative_config: draft_vocab_size must be an integer >= 0, got {config.draft_vocab_size!r}"
            )
        if config.quantization in ("none", ""):
            config.quantization = None
        if config.quantization not in (None, "int8"):
            raise ValueError(f"speculative_config: quantization must be 'int8' or none, got {config.quantization!r}")
        if config.quantization and method == "ngram":
            raise ValueError("speculative_config: quantization is for the model proposers (draft_model, eagle)")
        if config.draft_vocab_size and method == "ngram":
            raise ValueError("speculative_config: draft_vocab_size is for the model proposers (draft_model, eagle)")
        if not 1 <= config.prompt_lookup_min <= config.prompt_lookup_max:
            raise ValueError(
                "speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{config.prompt_lookup_min} and {config.prompt_lookup_max}"
            )
        return config


def _resolve_tree_options(d: dict) -> None:
    """Fill in and check the draft-tree keys of a speculative_config dict in place (ValueError naming the key)."""
    if d["method"] != "eagle":
        raise ValueError(
            f"speculative_config: tree_depth, tree_topk and tree_num_nodes are for method 'eagle' (got {d['method']!r})"
        )
    if d.get("tree_depth") is None:
        d["tree_depth"] = SpeculativeConfig.DEFAULT_TREE_DEPTH
    if d.get("tree_topk") is None:
        d["tree_topk"] = SpeculativeConfig.DEFAULT_TREE_TOPK
    k, nodes = d.get("num_speculative_tokens"), d.get("tree_num_nodes")
    if nodes is None:
        nodes = d["tree_num_nodes"] = k
    elif k is None:
        k = d["num_speculative_tokens"] = nodes
    elif k != nodes:
        raise ValueError(
            f"speculative_config: with a draft tree num_speculative_tokens is its node count: tree_num_nodes {nodes!r} "
            f"and num_speculative_tokens {k!r} differ (give one of them)"
        )
    for key in ("tree_depth", "tree_topk", "tree_num_nodes"):
        value = d[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"speculative_config: {key} must be an integer >= 1, got {value!r}")
    depth, topk = d["tree_depth"], d["tree_topk"]
    most = topk + (depth - 1) * topk * topk  # depth 1: top-k; each deeper level: top-k children of top-k nodes
    if nodes > most:
        raise ValueError(
            f"speculative_config: tree_num_nodes {nodes} exceeds the {most} nodes a tree of tree_depth {depth} and "
            f"tree_topk {topk} can grow"
        )


@dataclass(frozen=True)
class KVEventsConfig:
    """KV cache events (vLLM's `kv_events_config`): which blocks each tier gains and loses, published by the
    engine-core process for a global index or a cache-aware router (kvserve/core/kv_events.py)."""

    # "zmq": msgpack batches on a ZMQ PUB socket at `endpoint` (a replay socket at `replay_endpoint`, if set,
    # answers requests for recent batches by sequence number); "null": collected and dropped (tests, overhead).
    publisher: str = "zmq"
    endpoint: str = "tcp://127.0.0.1:5557"
    replay_endpoint: str | None = None
    topic: str = "kv-events"
    buffer_steps: int = 10_000  # batches kept for replay

    _PUBLISHERS = ("zmq", "null")

    @classmethod
    def from_dict(cls, d: dict) -> KVEventsConfig | None:
        """vLLM's keys; `enable_kv_cache_events` false (the default there) gives None."""
        d = dict(d)
        if not d.pop("enable_kv_cache_events", True):
            return None
        unknown = sorted(set(d) - {f for f in cls.__dataclass_fields__ if not f.startswith("_")})
        if unknown:
            raise ValueError(f"kv_events_config: unknown key(s) {', '.join(unknown)}")
        config = cls(**d)
        if config.publisher not in cls._PUBLISHERS:
            raise ValueError(f"kv_events_config: publisher must be one of {', '.join(cls._PUBLISHERS)}")
        if not isinstance(config.buffer_steps, int) or config.buffer_steps < 0:
            raise ValueError("kv_events_config: buffer_steps must be an integer >= 0")
        return config


EXECUTOR_BACKENDS = ("uniproc", "mp", "ray")


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split and where its workers run (vLLM's names)."""

    tensor_parallel_size: int = 1
    # "uniproc": one worker inside the engine-core process (TP=1 only); "mp": one process per rank on this
    # machine; "ray": one Ray actor per rank, on this machine or across a Ray cluster.
    distributed_executor_backend: str = "uniproc"
    # A step (or an RPC) that takes longer fails the engine: a hung worker must not hang the server. Also the
    # torch.distributed collective timeout.
    worker_timeout_s: float = 300.0


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    threads: ThreadPlan | None = None  # None: the automatic plan, decided when the engine starts
    speculative: SpeculativeConfig | None = None
    kv_transfer: KVTransferConfig | None = None
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    kv_events: KVEventsConfig | None = None

"""Which features combine: the one place that refuses a combination, before anything loads, and says why.

Each rule is (what, whether it applies to a config, why it is refused). `check_engine_config` raises one
ValueError naming every refused combination of a config; `check_request` does the same for what a single request
asks of a running engine. Options that are merely invalid on their own (a bad dtype, a negative size) are
checked where they are parsed (engine/arg_utils.py), not here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvserve.config import EngineConfig
from kvserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class Rule:
    what: str
    applies: Callable[[EngineConfig], bool]
    why: str


def _gpu(c: EngineConfig) -> bool:
    return c.model.device.startswith("cuda")


def _tp(c: EngineConfig) -> bool:
    return c.parallel.tensor_parallel_size > 1


def _model_proposer(c: EngineConfig) -> bool:
    return c.speculative is not None and c.speculative.method != "ngram"


_ASYNC = "async_scheduling"
_WINDOW = "a sliding-window model"


def _window(c: EngineConfig) -> bool:
    return c.model.arch.has_sliding_window


_ALIBI = "an ALiBi model"


def _alibi(c: EngineConfig) -> bool:
    return c.model.arch.alibi


# Refused before anything loads.
RULES: tuple[Rule, ...] = (
    Rule(
        f"{_ASYNC} with speculative decoding",
        lambda c: c.scheduler.async_scheduling and c.speculative is not None,
        "the next step's drafts come from this step's tokens, which async scheduling does not wait for",
    ),
    Rule(
        f"{_ASYNC} with a KV connector (kv_transfer_config)",
        lambda c: c.scheduler.async_scheduling and c.kv_transfer is not None,
        "a connector's loads and saves are reported per step, in the step that ran them",
    ),
    Rule(
        f"{_ASYNC} with tensor_parallel_size > 1 or a non-uniproc executor",
        lambda c: c.scheduler.async_scheduling and c.parallel.distributed_executor_backend != "uniproc",
        "async scheduling overlaps the host's work with one GPU's; the GPU path has no tensor parallelism yet",
    ),
    Rule(
        "quantization with tensor_parallel_size > 1",
        lambda c: _tp(c) and c.model.quantization is not None,
        "the int8 and int4 panels are packed for a whole weight, not for a rank's slice, yet",
    ),
    Rule(
        "draft-model or EAGLE speculation with tensor_parallel_size > 1",
        lambda c: _tp(c) and _model_proposer(c),
        "the draft's own KV pool and forward passes are not sharded over ranks yet (n-gram works)",
    ),
    Rule(
        "tensor_parallel_size > 1 on the GPU",
        lambda c: _gpu(c) and _tp(c),
        "not supported on the GPU yet: tensor_parallel_size > 1 (no NCCL communicator yet)",
    ),
    Rule(
        "quantization on the GPU",
        lambda c: _gpu(c) and c.model.quantization is not None,
        "not supported on the GPU yet: quantization {quantization} (CPU int8 / int4 kernels)",
    ),
    Rule(
        "a CPU attention backend on the GPU",
        lambda c: _gpu(c) and c.model.attention_backend in ("cpu", "torch"),
        "not supported on the GPU yet: attention_backend {attention_backend} (CPU backends)",
    ),
    Rule(
        f"{_WINDOW} on the GPU",
        lambda c: _window(c) and _gpu(c),
        "not supported on the GPU yet: the Triton kernels read only the window (checked in Triton's interpreter "
        "on the CPU) but have not run compiled on a GPU, and the captured decode graphs size their work buffers "
        "by the pool, which the requests of a windowed model may outgrow together",
    ),
    Rule(
        f"{_WINDOW} with speculative decoding",
        lambda c: _window(c) and c.speculative is not None,
        "blocks behind the window are released as a request advances, and rejected drafts would move it back",
    ),
    Rule(
        f"{_WINDOW} with a KV connector (kv_transfer_config)",
        lambda c: _window(c) and c.kv_transfer is not None,
        "a connector moves whole block tables, whose blocks behind the window are released",
    ),
    Rule(
        f"{_WINDOW} with preemption_mode swap",
        lambda c: _window(c) and c.scheduler.preemption_mode == "swap",
        "swap copies whole block tables, whose blocks behind the window are released (use recompute)",
    ),
    Rule(
        f"{_ALIBI} on the GPU",
        lambda c: _alibi(c) and _gpu(c),
        "not supported on the GPU yet: the Triton kernels take the ALiBi slopes (checked in Triton's interpreter on "
        "the CPU) but have not run compiled on a GPU, nor in the captured decode graphs",
    ),
    Rule(
        f"{_ALIBI} with EAGLE speculation",
        lambda c: _alibi(c) and c.speculative is not None and c.speculative.method == "eagle",
        "the EAGLE head reads the target's Llama embedding and final RMSNorm, which BLOOM does not have",
    ),
    Rule(
        "EAGLE draft trees (tree_depth, tree_topk, tree_num_nodes) on the GPU",
        lambda c: _gpu(c) and c.speculative is not None and c.speculative.tree,
        "not supported on the GPU yet: the Triton prefill kernel takes the tree mask (tested in the interpreter), "
        "but trees have not run on a GPU, in the captured decode graphs or with async scheduling",
    ),
    Rule(
        "kv_cache_dtype fp8 with draft-model or EAGLE speculation",
        lambda c: c.cache.cache_dtype != "auto" and _model_proposer(c),
        "the draft's own KV pool is allocated in the model's dtype and is not sized or converted for fp8 yet "
        "(n-gram speculation works)",
    ),
    Rule(
        "kv_cache_dtype fp8 on the GPU",
        lambda c: c.cache.cache_dtype != "auto" and _gpu(c),
        "not supported on the GPU yet: the Triton kernels' fp8 paths are checked in Triton's interpreter on the "
        "CPU but have not run compiled on a GPU",
    ),
    Rule(
        "kv_cache_dtype fp8 with dtype float16",
        lambda c: c.cache.cache_dtype != "auto" and c.model.dtype == "float16",
        "the fp8 KV paths are built and tested for bfloat16 and float32 models",
    ),
    # deterministic=None means "where it holds" and is never refused; only an explicit True is.
    Rule(
        "deterministic with attention_backend torch",
        lambda c: c.model.deterministic is True and c.model.attention_backend == "torch",
        "deterministic inference needs the C++ CPU attention kernels: the torch reference attention is not "
        "batch-invariant (use attention_backend auto or cpu, or deterministic=False)",
    ),
    Rule(
        "deterministic with tensor_parallel_size > 1",
        lambda c: c.model.deterministic is True and _tp(c),
        "the all-reduce of big tensors sums in an order that follows their size",
    ),
    Rule(
        "deterministic on the GPU",
        lambda c: c.model.deterministic is True and _gpu(c),
        "not supported on the GPU yet: the Triton attention and cuBLAS GEMMs are not batch-invariant yet",
    ),
)


def refusals(config: EngineConfig) -> list[str]:
    """Every refused combination of `config`, as "what: why"."""
    fill = {"quantization": config.model.quantization, "attention_backend": config.model.attention_backend}
    return [f"{rule.what}: {rule.why.format(**fill)}" for rule in RULES if rule.applies(config)]


def check_engine_config(config: EngineConfig) -> None:
    found = refusals(config)
    if found:
        device = config.model.device
        raise ValueError(f"these options do not combine (device {device}): " + "; ".join(found))


def check_request(config: EngineConfig, params: SamplingParams) -> None:
    """What one request asks of an engine built from `config` (ValueError: the request is refused, the engine
    goes on). Nothing is refused today: structured outputs under async scheduling run synchronous steps while
    they are there (engine/core.py), which is where such a rule would go."""

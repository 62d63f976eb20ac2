"""kvserve: a small, readable LLM inference engine (paged KV cache, prefix caching, continuous batching).

`from kvserve import LLM, SamplingParams` works as in vLLM. The names are resolved lazily, so importing a
torch-free part of the package (kvserve.core) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvserve.platform import export_torch_isa_caps
from kvserve.threads import export_wait_policy

# Before anything imports torch: a forced KVSERVE_CPU_ISA caps torch's kernels too (kvserve/platform.py), and
# idle OpenMP threads wait without spinning (kvserve/threads.py).
export_torch_isa_caps()
export_wait_policy()

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "kvserve.engine.llm",
    "EngineArgs": "kvserve.engine.arg_utils",
    "SamplingParams": "kvserve.sampling_params",
    "BeamSearchParams": "kvserve.beam_search",
    "StructuredOutputsParams": "kvserve.sampling_params",
    "RequestOutput": "kvserve.outputs",
    "CompletionOutput": "kvserve.outputs",
    "Logprob": "kvserve.outputs",
}

__all__ = [
    "LLM",
    "EngineArgs",
    "SamplingParams",
    "BeamSearchParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "__version__",
]

if TYPE_CHECKING:
    from kvserve.beam_search import BeamSearchParams
    from kvserve.engine.arg_utils import EngineArgs
    from kvserve.engine.llm import LLM
    from kvserve.outputs import CompletionOutput, Logprob, RequestOutput
    from kvserve.sampling_params import SamplingParams, StructuredOutputsParams


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

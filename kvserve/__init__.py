"""kvserve: a small, readable LLM inference engine (paged KV cache, prefix caching, continuous batching)."""

from kvserve.engine.arg_utils import EngineArgs
from kvserve.engine.llm import LLM
from kvserve.outputs import CompletionOutput, Logprob, RequestOutput
from kvserve.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "EngineArgs",
    "__version__",
]

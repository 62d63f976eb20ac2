"""Build a model for a ModelConfig and fill it from its checkpoint (HF safetensors folder or GGUF file)."""

from __future__ import annotations

import contextlib

import torch

from kvserve.attention.base import AttentionBackend
from kvserve.config import ModelConfig
from kvserve.layers.quant.apply import quantize_linears
from kvserve.loader.gguf_weights import iterate_gguf, iterate_gguf_q4_blocks
from kvserve.loader.safetensors_weights import iterate_safetensors
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.registry import get_model_class


@contextlib.contextmanager
def _uninitialized(dtype: torch.dtype):
    """Create parameters in `dtype` and skip their random init (the checkpoint overwrites every one, and
    load_weights checks that), which saves ~2 s for a 135M model on this CPU."""
    old_dtype = torch.get_default_dtype()
    saved = [(cls, cls.reset_parameters) for cls in (torch.nn.Embedding,)]
    torch.set_default_dtype(dtype)
    for cls, _ in saved:
        cls.reset_parameters = lambda self: None
    try:
        yield
    finally:
        torch.set_default_dtype(old_dtype)
        for cls, fn in saved:
            cls.reset_parameters = fn


def load_model(model_config: ModelConfig, backend: AttentionBackend) -> LlamaForCausalLM:
    """Build the model on its device (parameters, buffers and each op's implementation follow torch's default
    device, set here for the build) and fill it from the checkpoint, or with random weights (load_format dummy)."""
    dtype = getattr(torch, model_config.dtype)
    cls = get_model_class(model_config.arch.architecture)
    with _uninitialized(dtype), torch.device(model_config.device):
        model = cls(model_config.arch, backend, dtype)
    if model_config.load_format == "dummy":
        _fill_random(model, model_config.seed)
    else:
        if model_config.format == "gguf":
            weights = iterate_gguf(model_config.path, model_config.arch)
        else:
            weights = iterate_safetensors(model_config.path)
        model.load_weights(weights)
    if model_config.quantization is not None:
        q4_blocks = None
        stored = model_config.format == "gguf" and model_config.load_format != "dummy"
        if model_config.quantization == "int4" and stored:  # keep the file's own 4-bit blocks
            q4_blocks = dict(iterate_gguf_q4_blocks(model_config.path, model_config.arch))
        quantize_linears(model, model_config.quantization, q4_blocks)
    model.prepare_for_inference()
    model.eval()
    model.requires_grad_(False)
    return model


@torch.no_grad()
def _fill_random(model: torch.nn.Module, seed: int) -> None:
    """Random weights of the right shapes (vLLM's dummy format): matrices and biases uniform in +-1e-3 (small
    enough that activations stay finite in bf16), norm weights 1. Generated on the parameters' device."""
    gen = None
    for name, param in model.named_parameters():
        if gen is None:
            gen = torch.Generator(device=param.device).manual_seed(seed)
        if "norm" in name:
            param.fill_(1.0)
        else:
            param.uniform_(-1e-3, 1e-3, generator=gen)

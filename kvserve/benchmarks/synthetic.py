"""Models that need no download: a word-level tokenizer of any vocabulary size, and HF model folders of known
shapes (config.json and that tokenizer, no weights) for load_format="dummy" (random weights).

Used where nothing can be fetched (the GPU machine: benchmarks/gpu_suite.py) and by the tests when
KVSERVE_TEST_TOKENIZER=synthetic stands in for SmolLM2's tokenizer.
"""

from __future__ import annotations

import os

# Tiny stand-ins (benchmarks/gpu_suite.py --smoke checks the suite on the CPU with them).
_TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=512,
    max_position_embeddings=2048,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)

# HF config fields of the model shapes the GPU benchmarks use (their published configs' shapes), and tiny ones.
SHAPES: dict[str, dict] = {
    "tiny-llama": dict(_TINY, model_type="llama", architectures=["LlamaForCausalLM"]),
    "tiny-qwen3": dict(_TINY, model_type="qwen3", architectures=["Qwen3ForCausalLM"]),
    "llama3-8b": dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "qwen3-0.6b": dict(
        model_type="qwen3",
        architectures=["Qwen3ForCausalLM"],
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    ),
}


def synthetic_tokenizer(vocab_size: int):
    """A fast tokenizer whose token i is the word "t<i>" (whitespace-separated); ids 0/1/2 are unk/bos/eos."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2", pad_token="t2")


def hf_config(shape: str | dict):
    """A transformers config for a named shape (SHAPES) or a dict of config fields with "model_type"."""
    from transformers import AutoConfig

    fields = dict(SHAPES[shape] if isinstance(shape, str) else shape)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def write_model_folder(folder: str, shape: str | dict) -> str:
    """config.json and the synthetic tokenizer, no weights: a model folder for load_format="dummy"."""
    os.makedirs(folder, exist_ok=True)
    config = hf_config(shape)
    config.save_pretrained(folder)
    synthetic_tokenizer(config.vocab_size).save_pretrained(folder)
    return folder

"""Shared fixtures: the embedded SmolLM2 GGUF, tiny random HF models built locally, an HF greedy reference."""

from __future__ import annotations

import os
import warnings
import zlib

import pytest
import torch

# Tests never reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Without a GPU, the Triton kernels run in Triton's interpreter; it is chosen when a kernel is defined, so this
# must happen before anything imports kvserve.attention.triton_kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
warnings.filterwarnings("ignore", message=".*non-writable.*")
# A default KV pool of 0.5 GiB, not kvserve's min(40% of free memory, 4 GiB): a tiny model's 4 GiB is half a million
# blocks, ~1 s of start-up per engine, and the suite builds hundreds. Child processes (servers, instances) inherit it.
os.environ.setdefault("KVSERVE_CPU_KVCACHE_SPACE", "0.5")

# The Triton interpreter runs the same whatever the CPU's vector ISA: its tests run in the full pass only, not again
# in the Makefile's forced-ISA passes.
triton_once = pytest.mark.skipif(
    bool(os.environ.get("KVSERVE_CPU_ISA")), reason="forced ISA level: Triton tests run once"
)

# name -> (HF config class name, config overrides). Tiny models reuse SmolLM2's tokenizer (vocab 49152), so
# the text, chat and stop-string paths run on them too.
TINY_MODELS = {
    "llama-gqa-untied": (
        "LlamaConfig",
        dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    ),
    "llama-mqa-tied": (
        "LlamaConfig",
        dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True),
    ),
    "llama3-rope-scaling": (
        "LlamaConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    # HF's small default init: the residual stream is dominated by the current token's embedding, so greedy
    # outputs fall into short loops, which n-gram speculation predicts (tests/engine/test_spec_decode.py).
    "llama-loops": (
        "LlamaConfig",
        dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, initializer_range=0.05),
    ),
    # llama-loops with head_dim 64, so that bf16 runs take the pair-packed KV layout
    # (tests/spec_decode/test_tree_engine.py).
    "llama-loops-hd64": (
        "LlamaConfig",
        dict(
            hidden_size=256,
            intermediate_size=512,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            initializer_range=0.05,
        ),
    ),
    # head_dim 64 (a shape the kernels' fast paths and the pair-packed bf16 cache take) and a long context: a
    # prompt of over 1024 tokens is a big prefill chunk (tests/engine/test_deterministic.py).
    "llama-hd64-long": (
        "LlamaConfig",
        dict(
            hidden_size=256,
            intermediate_size=512,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
        ),
    ),
    "mistral-gqa": ("MistralConfig", dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=None)),
    # Sliding-window attention on every layer, a window far shorter than the prompts and the generations
    # (tests/models/test_sliding_window.py).
    "mistral-window12": ("MistralConfig", dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=12)),
    # Alternating local/global layers (Gemma-2/3 style), as Qwen2 names them in `layer_types`.
    "qwen2-local-global": (
        "Qwen2Config",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            use_sliding_window=True,
            sliding_window=10,
            max_window_layers=0,
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),
    # ALiBi (tests/models/test_alibi.py): 6 heads, which takes HF's slope rule for head counts that are not a power
    # of two; head_dim 16. BLOOM's MLP is 4 x hidden (no intermediate_size). Untied: with the tiny model's biases, a
    # tied LM head (the 0.02 embedding) gives greedy outputs of a few distinct tokens; the untied head ~25 in 32.
    "bloom-alibi": ("BloomConfig", dict(hidden_size=96, n_head=6, layer_norm_epsilon=1e-5, tie_word_embeddings=False)),
    # BLOOM's own habits: the LM head tied to the embedding, and apply_residual_connection_post_layernorm.
    "bloom-tied-post-ln": (
        "BloomConfig",
        dict(
            hidden_size=96,
            n_head=6,
            layer_norm_epsilon=1e-5,
            initializer_range=0.3,
            apply_residual_connection_post_layernorm=True,
        ),
    ),
    "qwen2-bias-tied": (
        "Qwen2Config",
        dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    ),
    "qwen2-mqa-untied": (
        "Qwen2Config",
        dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False),
    ),
    "qwen3-qknorm": (
        "Qwen3Config",
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False),
    ),
    "qwen3-mqa-tied": (
        "Qwen3Config",
        dict(num_attention_heads=4, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True),
    ),
}


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    from kvserve.loader.default_model import DEFAULT_MODEL, resolve_model_path

    return resolve_model_path(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def smollm2_tokenizer(request):
    """SmolLM2's tokenizer (from the embedded GGUF, fetched once). KVSERVE_TEST_TOKENIZER=synthetic: a word-level
    tokenizer of the same vocabulary size instead, for machines that can fetch nothing (the tiny models and
    tests that use token ids only run the same)."""
    if os.environ.get("KVSERVE_TEST_TOKENIZER") == "synthetic":
        from kvserve.benchmarks.synthetic import synthetic_tokenizer

        return synthetic_tokenizer(49152)
    from kvserve.loader.tokenizer import load_tokenizer

    return load_tokenizer(request.getfixturevalue("smollm2_gguf"))


def build_tiny_model(name: str, folder: str, tokenizer) -> str:
    import transformers

    cls_name, overrides = TINY_MODELS[name]
    config_cls = getattr(transformers, cls_name)
    kwargs = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        # Larger than HF's 0.02 (embeddings stay at 0.02, below): the residual stream is then not dominated by
        # the current token's embedding, and greedy outputs are diverse (~30 distinct tokens in 32) instead of
        # echoing one token, so later positions really test attention over the context.
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    kwargs.update(overrides)
    config = config_cls(**kwargs)
    torch.manual_seed(zlib.crc32(name.encode()))  # stable across runs, unlike hash()
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            # HF initialises biases to 0 and norms to 1, which would let a missing bias or norm go unnoticed.
            if pname.endswith(".bias"):
                p.normal_(0.0, 0.2)
            elif "norm" in pname:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "embed_tokens" in pname or "word_embeddings" in pname:
                p.normal_(0.0, 0.02)
        if config.tie_word_embeddings:
            # Tied logits use the small embedding matrix; scale them up to the untied models' range so that the
            # top-2 logit gaps stay far above fp32 rounding.
            final_norm = model.transformer.ln_f if hasattr(model, "transformer") else model.model.norm
            final_norm.weight.mul_(10.0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory, smollm2_tokenizer):
    built: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in built:
            folder = str(tmp_path_factory.mktemp(f"tiny-{name}"))
            built[name] = build_tiny_model(name, folder, smollm2_tokenizer)
        return built[name]

    return get


@torch.no_grad()
def hf_greedy(model, prompt_ids: list[int], num_tokens: int) -> list[int]:
    """Reference greedy decoding with HF's own KV cache, one token at a time (no generate() heuristics)."""
    out = model(torch.tensor([prompt_ids]), use_cache=True)
    past = out.past_key_values
    tokens: list[int] = []
    nxt = out.logits[0, -1].argmax()
    for i in range(num_tokens):
        tokens.append(int(nxt))
        if i == num_tokens - 1:
            break
        out = model(nxt.view(1, 1), past_key_values=past, use_cache=True)
        past = out.past_key_values
        nxt = out.logits[0, -1].argmax()
    return tokens


def load_hf_model(path: str, gguf_file: str | None = None):
    import transformers

    kwargs = dict(dtype=torch.float32, attn_implementation="eager")
    if gguf_file is not None:
        # A plain dense fp32 model from HF's own GGUF reader (independent of kvserve's loader).
        kwargs["gguf_file"] = gguf_file
        kwargs["quantization_config"] = transformers.GgufConfig(dequantize=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs)
    return model.eval()


def assert_all_blocks_free(llm) -> None:
    stats = llm.stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_blocks"], stats
    pool = llm.engine.engine_core.scheduler.kv.pool
    assert all(b.ref_cnt == 0 for b in pool.blocks)

"""Loading: config parsing (both rope formats, BLOOM's config names), GGUF name mapping and RoPE un-permutation,
GGUF files written from HF models (llama, qwen2, qwen3), sharded safetensors, argument validation, the embedded
default."""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.engine.arg_utils import EngineArgs, resolve_dtype
from kvserve.loader.arch_config import arch_config_from_hf, layer_windows
from kvserve.loader.default_model import resolve_model_path
from kvserve.loader.gguf_weights import gguf_arch_config, hf_name, undo_rope_permutation
from kvserve.platform import cpu_info
from tests.conftest import hf_greedy, load_hf_model

BASE = dict(
    architectures=["LlamaForCausalLM"],
    vocab_size=100,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    eos_token_id=2,
)
LLAMA3_SCALING = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)


def test_legacy_and_v5_rope_formats_parse_the_same():
    legacy = arch_config_from_hf({**BASE, "rope_theta": 500000.0, "rope_scaling": {"type": "llama3", **LLAMA3_SCALING}})
    v5 = arch_config_from_hf(
        {**BASE, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3_SCALING}}
    )
    assert legacy == v5
    assert legacy.rope_theta == 500000.0 and legacy.rope_scaling["rope_type"] == "llama3"
    plain = arch_config_from_hf({**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    assert plain.rope_scaling is None and plain.head_dim == 16


def test_eos_ids_merge_generation_config_and_arch_flags():
    cfg = arch_config_from_hf({**BASE, "eos_token_id": 2}, {"eos_token_id": [7, 2]})
    assert cfg.eos_token_ids == (2, 7)
    qwen2 = arch_config_from_hf(
        {
            **BASE,
            "architectures": ["Qwen2ForCausalLM"],
            "sliding_window": 4096,
            "use_sliding_window": False,
            "model_type": "qwen2",
        }
    )
    assert qwen2.attention_bias and not qwen2.qk_norm and qwen2.sliding_windows == ()
    qwen3 = arch_config_from_hf({**BASE, "architectures": ["Qwen3ForCausalLM"], "head_dim": 32})
    assert qwen3.qk_norm and qwen3.head_dim == 32


@pytest.mark.parametrize(
    "config,windows",
    [
        # Mistral: every layer (HF's Mistral ignores layer_types).
        ({"model_type": "mistral", "sliding_window": 8}, (8, 8, 8)),
        ({"model_type": "mistral", "sliding_window": 8, "layer_types": ["full_attention"] * 3}, (8, 8, 8)),
        ({"model_type": "mistral", "sliding_window": None}, ()),
        # Qwen2/3: only with use_sliding_window; layer_types if given, else the layers from max_window_layers on.
        ({"model_type": "qwen2", "sliding_window": 8, "use_sliding_window": False}, ()),
        (
            {"model_type": "qwen2", "sliding_window": 8, "use_sliding_window": True, "max_window_layers": 1},
            (None, 8, 8),
        ),
        (
            {
                "model_type": "qwen3",
                "sliding_window": 8,
                "use_sliding_window": True,
                "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            },
            (8, None, 8),
        ),
        ({"model_type": "qwen2", "sliding_window": 8, "use_sliding_window": True, "max_window_layers": 3}, ()),
        # Llama: HF applies no window.
        ({"model_type": "llama", "sliding_window": 8}, ()),
    ],
)
def test_layer_windows_follow_hf(config, windows):
    assert layer_windows({"num_hidden_layers": 3, **config}) == windows


def test_bloom_configs_old_and_new_names():
    """bigscience/bloom-560m's config.json (n_embed, n_layer, n_head, no seq_length) and transformers 5's names
    give the same ArchConfig: ALiBi, every head its own KV head, a 4x MLP, tied by default."""
    common = dict(architectures=["BloomForCausalLM"], model_type="bloom", vocab_size=100, layer_norm_epsilon=1e-5)
    old = arch_config_from_hf({**common, "n_embed": 64, "n_layer": 2, "num_attention_heads": 8})
    new = arch_config_from_hf({**common, "hidden_size": 64, "n_layer": 2, "n_head": 8, "seq_length": 2048})
    assert old == new
    assert new.alibi and new.num_key_value_heads == 8 and new.head_dim == 8 and new.intermediate_size == 256
    assert new.tie_word_embeddings and new.attention_bias and not new.residual_post_layernorm
    assert new.max_position_embeddings == 2048 and new.rms_norm_eps == 1e-5
    assert not arch_config_from_hf(BASE).alibi


def test_unknown_layer_type_refused():
    config = {"num_hidden_layers": 2, "model_type": "qwen2", "sliding_window": 8, "use_sliding_window": True}
    with pytest.raises(ValueError, match="layer_types"):
        layer_windows({**config, "layer_types": ["sliding_attention", "chunked_attention"]})


@pytest.mark.parametrize(
    "override,match",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "unsupported model architecture"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope scaling type 'yarn'"),
    ],
)
def test_unsupported_configs_fail_clearly(override, match):
    with pytest.raises(ValueError, match=match):
        arch_config_from_hf({**BASE, **override})


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The reordering llama.cpp's convert_hf_to_gguf applies to q/k rows of llama models."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("n_head", [1, 3, 9])
def test_undo_rope_permutation_inverts_llama_cpp(n_head):
    w = np.random.default_rng(0).standard_normal((n_head * 8, 5)).astype(np.float32)
    assert not np.array_equal(llama_cpp_permute(w, n_head), w)
    np.testing.assert_array_equal(undo_rope_permutation(llama_cpp_permute(w, n_head), n_head), w)


def test_gguf_names_map_to_hf():
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("blk.12.attn_k.bias") == "model.layers.12.self_attn.k_proj.bias"
    assert hf_name("blk.0.attn_q_norm.weight") == "model.layers.0.self_attn.q_norm.weight"
    assert hf_name("blk.3.ffn_down.weight") == "model.layers.3.mlp.down_proj.weight"
    with pytest.raises(ValueError, match="unknown GGUF tensor"):
        hf_name("blk.0.attn_qkv.weight")


@pytest.mark.slow
def test_embedded_smollm2_metadata(smollm2_gguf):
    cfg = gguf_arch_config(smollm2_gguf)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        30,
        576,
        9,
        3,
    )
    assert (cfg.head_dim, cfg.intermediate_size, cfg.vocab_size) == (64, 1536, 49152)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0 and cfg.eos_token_ids == (2,)


def write_gguf(hf_folder: str, path: str, gguf_arch: str) -> None:
    """Write an F32 GGUF of an HF folder the way llama.cpp's converter lays it out (no tokenizer data)."""
    import gguf
    from safetensors.torch import load_file

    from kvserve.loader.arch_config import arch_config_from_hf, read_hf_folder_config

    hf_cfg, _ = read_hf_folder_config(hf_folder)
    cfg = arch_config_from_hf(hf_cfg)
    inverse = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    w = gguf.GGUFWriter(path, gguf_arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_vocab_size(cfg.vocab_size)
    w.add_eos_token_id(2)
    tensors = load_file(f"{hf_folder}/model.safetensors")
    for name, t in tensors.items():
        arr = t.float().numpy()
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            parts = name.split(".")
            layer, rest, suffix = parts[2], ".".join(parts[3:-1]), parts[-1]
            gname = f"blk.{layer}.{inverse[rest]}.{suffix}"
            if gguf_arch == "llama" and rest == "self_attn.q_proj":
                arr = llama_cpp_permute(arr, cfg.num_attention_heads)
            elif gguf_arch == "llama" and rest == "self_attn.k_proj":
                arr = llama_cpp_permute(arr, cfg.num_key_value_heads)
        w.add_tensor(gname, np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize(
    "tiny,gguf_arch", [("llama-gqa-untied", "llama"), ("qwen2-bias-tied", "qwen2"), ("qwen3-qknorm", "qwen3")]
)
def test_gguf_written_from_hf_model_matches_hf(tiny, gguf_arch, tiny_model_factory, tmp_path):
    folder = tiny_model_factory(tiny)
    path = str(tmp_path / f"{tiny}.gguf")
    write_gguf(folder, path, gguf_arch)
    rng = random.Random(0)
    prompt = [rng.randrange(3, 49000) for _ in range(20)]
    ref = hf_greedy(load_hf_model(folder), prompt, 32)
    llm = LLM(path, tokenizer=folder, dtype="float32", max_model_len=256)
    out = llm.generate(
        {"prompt_token_ids": prompt},
        SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
        use_tqdm=False,
    )
    assert out[0].outputs[0].token_ids == ref


def test_sharded_safetensors_load(tiny_model_factory, tmp_path):
    import transformers

    folder = tiny_model_factory("qwen3-qknorm")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="1MB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    rng = random.Random(1)
    prompt = [rng.randrange(3, 49000) for _ in range(15)]
    llm = LLM(str(sharded), tokenizer=folder, dtype="float32", max_model_len=256)
    out = llm.generate(
        {"prompt_token_ids": prompt},
        SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
        use_tqdm=False,
    )
    assert out[0].outputs[0].token_ids == hf_greedy(load_hf_model(folder), prompt, 32)


def test_missing_weight_is_reported(tiny_model_factory, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tiny_model_factory("llama-gqa-untied")
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["model.layers.1.self_attn.v_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match=r"qkv_proj.weight\[2\]"):
        LLM(str(broken), dtype="float32")


def test_dtype_rules(caplog):
    # auto is bf16 only where the CPU computes it natively (an AVX2-only CPU gets float32; kvserve.platform).
    auto = "bfloat16" if cpu_info().native_bf16 else "float32"
    assert resolve_dtype("auto") == auto
    assert resolve_dtype("float32") == resolve_dtype("torch.float32") == "float32"
    with caplog.at_level(logging.WARNING):
        assert resolve_dtype("float16") == auto
    assert "slow" in caplog.text
    with pytest.raises(ValueError, match="unsupported dtype"):
        resolve_dtype("int8")


def test_engine_arg_validation(tiny_model_factory):
    folder = tiny_model_factory("llama-gqa-untied")
    with pytest.raises(ValueError, match="max_position_embeddings"):
        EngineArgs(model=folder, max_model_len=100_000).create_engine_config()
    with pytest.raises(ValueError, match="without chunked prefill"):
        EngineArgs(model=folder, enable_chunked_prefill=False, max_num_batched_tokens=64).create_engine_config()
    cfg = EngineArgs(model=folder, enable_chunked_prefill=False).create_engine_config()
    assert cfg.scheduler.max_num_batched_tokens >= cfg.model.max_model_len
    with pytest.raises(ValueError, match="block_size"):
        EngineArgs(model=folder, block_size=0).create_engine_config()


def test_unknown_model_name_explains_no_hub():
    with pytest.raises(ValueError, match="model hub"):
        resolve_model_path("meta-llama/Llama-3-8B")

"""The EAGLE head: kvserve's paged implementation of the published layout against a plain dense reference (HF's
Llama decoder layer), for a prefill and then single-token steps fed with the head's own features."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import save_file

from kvserve.attention.base import AttentionInputs
from kvserve.attention.selector import get_attn_backend
from kvserve.loader.arch_config import arch_config_from_hf
from kvserve.spec_decode.eagle import load_eagle_head
from kvserve.spec_decode.eagle_train import EagleReference
from kvserve.worker.kv_cache import allocate_kv_cache
from tests.kernels.build import require_kernels


def hf_config() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        architectures=["LlamaForCausalLM"],
    )


@pytest.mark.parametrize("fc_bias", [True, False])
def test_paged_head_matches_dense_reference(tmp_path, fc_bias):
    cfg = hf_config()
    torch.manual_seed(0)
    ref = EagleReference(cfg, fc_bias=fc_bias)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "norm" in name else 0.0))
    tensors = ref.checkpoint()
    tensors["layers.0.input_layernorm.weight"] = torch.full((64,), 3.0)  # present in some checkpoints: ignored
    save_file(tensors, str(tmp_path / "model.safetensors"))

    arch = arch_config_from_hf(cfg.to_dict(), {})
    backend = get_attn_backend(4, 2, 16, torch.float32)
    head = load_eagle_head(str(tmp_path), arch, backend, torch.float32)
    block_size, seq_len, num_steps = 4, 10, 3
    kv = allocate_kv_cache(backend, 8, block_size, 1, torch.float32, "cpu")
    block_table = np.array([[5, 2, 7, 1]], dtype=np.int32)  # deliberately not in order

    def inputs(start: int, n: int) -> AttentionInputs:
        pos = np.arange(start, start + n)
        slots = block_table[0, pos // block_size].astype(np.int64) * block_size + pos % block_size
        return AttentionInputs(
            num_decodes=1 if n == 1 else 0,
            query_start_loc=np.array([0, n]),
            seq_lens=np.array([start + n]),
            block_table=block_table,
            slot_mapping=slots,
            block_size=block_size,
        )

    embeds = torch.randn(seq_len + num_steps, 64)
    feats = torch.randn(seq_len, 64)
    with torch.inference_mode():
        out = head(embeds[:seq_len], feats, torch.arange(seq_len), kv[0], backend.build_metadata(inputs(0, seq_len)))
        outs, f = [out], out[-1:]
        for s in range(num_steps):
            pos = seq_len + s
            f = head(embeds[pos : pos + 1], f, torch.tensor([pos]), kv[0], backend.build_metadata(inputs(pos, 1)))
            outs.append(f)
        got = torch.cat(outs)

        # Dense reference: feed the whole sequence, the later steps' features being the head's own outputs.
        all_feats = feats
        for s in range(num_steps):
            want = ref(embeds[None, : seq_len + s], all_feats[None])[0]
            all_feats = torch.cat([all_feats, want[-1:]])
        want = ref(embeds[None], all_feats[None])[0]
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)


def test_missing_tensor_is_a_clear_error(tmp_path):
    cfg = hf_config()
    tensors = EagleReference(cfg).checkpoint()
    del tensors["layers.0.mlp.down_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    backend = get_attn_backend(4, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="down_proj"):
        load_eagle_head(str(tmp_path), arch_config_from_hf(cfg.to_dict(), {}), backend, torch.float32)


@pytest.mark.parametrize(
    "dtype,quantization", [(torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, "int8")]
)
def test_fused_head_layer_is_the_module_path(tmp_path, dtype, quantization):
    """With the C++ kernels the head's layer runs as one call without an input norm (kernels/csrc/decoder_layer.cpp):
    bitwise what its modules compute, for one row (the C++ layer's row path is for layers with an input norm) and
    for several under a tree mask."""
    require_kernels()
    cfg = hf_config()
    cfg.head_dim = 64  # the pair-packed bf16 layout's head size, so that bf16 runs on it where the CPU has it
    cfg.hidden_size = 128
    cfg.num_attention_heads = 2
    cfg.num_key_value_heads = 1
    torch.manual_seed(1)
    tensors = {
        k: torch.randn_like(v) * 0.2 + (1.0 if "norm" in k else 0.0)
        for k, v in EagleReference(cfg).checkpoint().items()
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    arch = arch_config_from_hf(cfg.to_dict(), {})
    backend = get_attn_backend(2, 1, 64, dtype, name="cpu", deterministic=True)
    head = load_eagle_head(str(tmp_path), arch, backend, dtype, quantization=quantization)
    layer = head.layers[0]
    assert layer._fused is not None and layer._fused[1][0].numel() == 0
    block_size = 16
    block_table = np.array([[3, 1, 2, 0]], dtype=np.int32)
    mask = np.tril(np.ones((5, 5), dtype=bool))
    mask[3, 1:3] = False  # query token 3 sees token 0 only before itself: a tree of two branches
    outs = {}
    for fused in (True, False):
        layer.use_fused = fused
        kv = allocate_kv_cache(backend, 4, block_size, 1, dtype, "cpu")
        got = []
        for start, n, masks in ((0, 20, None), (20, 1, None), (21, 5, {0: mask})):
            pos = np.arange(start, start + n)
            inputs = AttentionInputs(
                num_decodes=1 if n == 1 else 0,
                query_start_loc=np.array([0, n]),
                seq_lens=np.array([start + n]),
                block_table=block_table,
                slot_mapping=block_table[0, pos // block_size].astype(np.int64) * block_size + pos % block_size,
                block_size=block_size,
                query_masks=masks,
            )
            g = torch.Generator().manual_seed(start)
            embeds = torch.randn(n, 128, generator=g).to(dtype)
            feats = torch.randn(n, 128, generator=g).to(dtype)
            with torch.inference_mode():
                got.append(head(embeds, feats, torch.from_numpy(pos), kv[0], backend.build_metadata(inputs)))
        outs[fused] = torch.cat(got)
    assert torch.equal(outs[True], outs[False])

"""Fixtures for the model proposers: the tiny target, a random EAGLE head in the published layout."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

TARGET = "llama-loops"


def random_eagle_head(folder: str, hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int) -> str:
    """A head in EAGLE-1's checkpoint layout with random weights (including an input norm, which must be ignored)."""
    g = torch.Generator().manual_seed(7)

    def w(*shape: int, scale: float = 0.2) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    p = "layers.0."
    tensors = {
        "fc.weight": w(hidden, 2 * hidden),
        "fc.bias": w(hidden),
        p + "self_attn.q_proj.weight": w(heads * head_dim, hidden),
        p + "self_attn.k_proj.weight": w(kv_heads * head_dim, hidden),
        p + "self_attn.v_proj.weight": w(kv_heads * head_dim, hidden),
        p + "self_attn.o_proj.weight": w(hidden, heads * head_dim),
        p + "mlp.gate_proj.weight": w(inter, hidden),
        p + "mlp.up_proj.weight": w(inter, hidden),
        p + "mlp.down_proj.weight": w(hidden, inter),
        p + "post_attention_layernorm.weight": 1.0 + w(hidden),
        p + "input_layernorm.weight": 1.0 + w(hidden),
    }
    save_file(tensors, f"{folder}/model.safetensors")
    return folder


@pytest.fixture(scope="session")
def target_path(tiny_model_factory) -> str:
    return tiny_model_factory(TARGET)


@pytest.fixture(scope="session")
def eagle_head_path(tmp_path_factory) -> str:
    # llama-loops: hidden 64, 4 heads of 16, 2 KV heads, intermediate 128 (tests/conftest.py).
    return random_eagle_head(str(tmp_path_factory.mktemp("eagle-head")), 64, 4, 2, 16, 128)


@pytest.fixture(scope="session")
def noisy_draft_path(target_path, tmp_path_factory) -> str:
    """The target with noise on its LM head: a draft whose distributions q are close to p but not equal, so
    the rejection sampler both accepts and rejects."""
    folder = tmp_path_factory.mktemp("noisy-draft")
    shutil.copytree(target_path, folder, dirs_exist_ok=True)
    weights = load_file(f"{folder}/model.safetensors")
    g = torch.Generator().manual_seed(3)
    head = weights["lm_head.weight"]
    weights["lm_head.weight"] = head + 0.5 * head.std() * torch.randn(head.shape, generator=g)
    save_file(weights, f"{folder}/model.safetensors")
    return str(folder)

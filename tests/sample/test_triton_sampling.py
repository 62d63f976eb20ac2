"""The fused draw (sample/triton_sampling.py) against the torch form of the same draw (sampler.gumbel_sample):
same hash, same fp32 operations, so the same tokens; greedy rows take the argmax; ties go to the lowest index.

On a machine with CUDA it runs compiled on the GPU; elsewhere in Triton's interpreter (tests/conftest.py)."""

from __future__ import annotations

import os

import pytest
import torch

from kvserve.sample.sampler import Sampler, SamplingMetadata, gumbel_sample

pytest.importorskip("triton")

from kvserve.sample.triton_sampling import gumbel_argmax  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and bool(os.environ.get("KVSERVE_CPU_ISA")), reason="forced ISA level: Triton tests run once"
)


def reference(logits: torch.Tensor, keys: torch.Tensor, temperature: torch.Tensor | None) -> torch.Tensor:
    """sampler.py's general path: divide by the temperature (1 for greedy rows), Gumbel argmax, greedy argmax."""
    if temperature is None:
        return gumbel_sample(logits, keys)
    temp = torch.where(temperature == 0, 1.0, temperature)
    sampled = gumbel_sample(logits / temp[:, None], keys)
    return torch.where(temperature == 0, logits.argmax(dim=-1), sampled)


@pytest.mark.parametrize("vocab", [1000, 3001])  # one chunk of the interpreter's 1024 and several, ragged
def test_matches_the_torch_draw(vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(7, vocab, generator=gen) * 3).to(DEVICE)
    keys = torch.randint(0, 1 << 62, (7,), generator=gen).to(DEVICE)
    assert torch.equal(gumbel_argmax(logits, keys), reference(logits, keys, None))
    temperature = torch.tensor([0.6, 0.0, 1.0, 2.5, 0.05, 0.0, 0.6], device=DEVICE)
    assert torch.equal(gumbel_argmax(logits, keys, temperature), reference(logits, keys, temperature))


def test_noise_alone_picks_what_the_torch_hash_picks():
    """Flat logits: the pick is the argmax of the noise, so every bit of the hash and both logs matter."""
    keys = torch.randint(0, 1 << 62, (16,), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    logits = torch.zeros(16, 2048, device=DEVICE)
    assert torch.equal(gumbel_argmax(logits, keys), gumbel_sample(logits, keys))


def test_greedy_ties_and_masked_tokens():
    logits = torch.full((3, 2500), float("-inf"), device=DEVICE)
    logits[0, [7, 1500, 2400]] = 5.0  # a three-way tie across chunks: the lowest index
    logits[1, 2499] = 1.0  # the last token, the only one allowed
    logits[2, [3, 4]] = 0.0
    temperature = torch.tensor([0.0, 0.7, 1.0], device=DEVICE)
    keys = torch.tensor([1, 2, 3], device=DEVICE)
    got = gumbel_argmax(logits, keys, temperature).tolist()
    assert got[0] == 7 and got[1] == 2499 and got[2] in (3, 4)


def test_sampler_fused_path_equals_general_path():
    """The Sampler's fused branch (taken on a GPU when no row has top-k/top-p/min-p) draws what its general branch
    draws, seeded rows and greedy rows included."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 1500, generator=gen).to(DEVICE)

    def md() -> SamplingMetadata:
        return SamplingMetadata(
            all_greedy=False,
            temperature=torch.tensor([0.6, 0.0, 1.0, 0.6, 1.3, 0.0], device=DEVICE),
            top_k=None,
            top_p=None,
            min_p=None,
            seeds={0: (11, 40), 3: (12, 7)},
            generator=torch.Generator().manual_seed(0),
        )

    fused, general = Sampler(DEVICE), Sampler(DEVICE)
    fused.fused_draw, general.fused_draw = True, False
    general.gumbel._forward_impl = general.gumbel.forward_native
    assert torch.equal(fused(logits, md()).sampled_token_ids, general(logits, md()).sampled_token_ids)

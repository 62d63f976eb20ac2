"""End to end with quantization="int8" on the embedded GGUF: a right answer, and the same greedy tokens under
batching and prefix caching (per-token activation quantization keeps every row independent of its batch).

Chunked prefill and other block sizes change the attention sums in their last bits; int8 rounding can turn that
into a different quantization step, so under those conditions the outputs must agree on their first tokens on the
chat prompt's answer (before the ignore_eos tail). That holds in fp32 activations, where "The" leads "L" by ~0.3
in logit; in bf16 activations chunking alone moves these logits by ~0.1 (without int8 too), so there the test asks
only for the right answer."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.layers.quant.int8_linear import Int8Linear
from tests.conftest import assert_all_blocks_free
from tests.models.test_hf_parity import SMOL_CONDITIONS, run_condition

MIN_AGREEMENT = 8


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer):
    tok = smollm2_tokenizer
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True
    )
    texts = [chat, "The quick brown fox", "def fibonacci(n):\n", "Water boils at a temperature of"]
    return [tok(p, add_special_tokens=False).input_ids for p in texts]


@pytest.mark.slow
def test_int8_generation_is_right_and_independent_of_scheduling(smollm2_gguf, smollm2_tokenizer, prompts):
    reference = None
    for cond, kwargs in SMOL_CONDITIONS.items():
        if "preempt" in cond:
            kwargs = {**kwargs, "num_kv_blocks": 16}  # these prompts are shorter than the parity test's
        llm = LLM(smollm2_gguf, dtype="float32", quantization="int8", max_model_len=256, **kwargs)
        model = llm.engine.engine_core.executor.driver_runner.model
        assert isinstance(model.lm_head, Int8Linear) and isinstance(model.model.layers[0].mlp.down_proj, Int8Linear)
        for round_idx, got in enumerate(run_condition(llm, prompts)):
            if reference is None:
                reference = got
                assert "Paris" in smollm2_tokenizer.decode(got[0])
            if cond == "batched-block16":
                assert got == reference, f"{cond} / round {round_idx}"
            # The chat answer is confident; the plain-text prompts meet near ties within a few tokens.
            assert got[0][:MIN_AGREEMENT] == reference[0][:MIN_AGREEMENT], f"{cond} / round {round_idx}"
            assert all(len(g) == len(r) for g, r in zip(got, reference, strict=True))
        if "preempt" in cond:
            assert llm.stats()["num_preemptions"] > 0
        assert_all_blocks_free(llm)


def test_int8_with_bf16_activations_answers_right(smollm2_gguf):
    llm = LLM(smollm2_gguf, dtype="bfloat16", quantization="int8", max_model_len=256)
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=24),
        use_tqdm=False,
    )
    assert "Paris" in out[0].outputs[0].text
    assert_all_blocks_free(llm)


@pytest.mark.slow
def test_auto_quantizes_a_quantized_gguf_and_reports_smaller_weights(smollm2_gguf):
    out = SamplingParams(temperature=0.0, max_tokens=4)
    sizes = {}
    for quant in ("auto", "none"):
        llm = LLM(smollm2_gguf, dtype="float32", quantization=quant, max_model_len=128)
        assert llm.engine.config.model.quantization == ("int8" if quant == "auto" else None)
        assert len(llm.generate("Hello", out, use_tqdm=False)[0].outputs[0].token_ids) == 4
        sizes[quant] = llm.engine.engine_core.executor.driver_runner.weight_bytes
    assert sizes["auto"] < 0.5 * sizes["none"]

"""Write a draft model for speculative decoding: the embedded default model cut to its first N decoder layers.

    PYTHONPATH=. python scripts/make_truncated_draft.py [--num-layers 6] [--out DIR]

The draft keeps the target's embedding, final norm and LM head (so the vocabulary is the target's) and only its
first N of 30 layers, so one draft step costs about N/30 of a target step. No training: an early exit of the
target, the cheapest draft there is when no smaller model of the same vocabulary is at hand. The folder (an HF
safetensors checkpoint, fp32) is what `{"method": "draft_model", "model": DIR}` loads. Default DIR:
KVSERVE_CACHE_DIR (or ~/.cache/kvserve)/drafts/smollm2-135m-instruct-Nl.
"""

from __future__ import annotations

import argparse
import os

import torch

from kvserve.loader.default_model import DEFAULT_MODEL, cache_dir, resolve_model_path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-layers", type=int, default=6)
    ap.add_argument("--out", default=None)
    ns = ap.parse_args()
    import transformers

    gguf = resolve_model_path(DEFAULT_MODEL)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf),
        gguf_file=os.path.basename(gguf),
        dtype=torch.float32,
        quantization_config=transformers.GgufConfig(dequantize=True),
    )
    model.model.layers = model.model.layers[: ns.num_layers]
    model.config.num_hidden_layers = ns.num_layers
    out = ns.out or os.path.join(cache_dir(), "drafts", f"{DEFAULT_MODEL}-{ns.num_layers}l")
    model.save_pretrained(out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    tokenizer.save_pretrained(out)
    print(out)


if __name__ == "__main__":
    main()

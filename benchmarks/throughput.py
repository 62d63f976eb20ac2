"""Offline throughput of kvserve vs HF transformers `generate`: a shortcut for `kvserve bench throughput`.

    python benchmarks/throughput.py                                  # 128 random requests, HF at batch 32
    python benchmarks/throughput.py --hf-batch-sizes 8 16 32 64 --json out.json

Any `kvserve bench throughput` flag works; see `kvserve bench throughput --help`.
"""

import sys

from kvserve.entrypoints.cli import main

if __name__ == "__main__":
    args = sys.argv[1:]
    if "--hf-batch-sizes" not in args:
        args += ["--hf-batch-sizes", "32"]
    sys.exit(main(["bench", "throughput", *args]))

"""How fast this machine reads a paged KV cache's bytes in the orders a decode-attention kernel could read them,
with no arithmetic beyond a sum: the ceiling `decode_attention.py`'s kernel is measured against. Same pool as there
(64 sequences of 128-192 tokens, 12 KiB fp32 blocks scattered over 30 layers' caches).

    PYTHONPATH=. .venv/bin/python benchmarks/kv_read_rate.py [--threads 2] [--rounds 2]

Orders (one C++ loop each, built here with -O3 -march=native -fopenmp; 64-byte loads, a sum per 64 bytes):
  seq            each sequence's K blocks, then its V blocks
  seq+prefetch   the same, the next block's line prefetched beside each load (as the kernel does)
  contiguous     the same with every sequence's blocks adjacent and in order in the pool
  k|v            K block i and V block i of a sequence, load by load, both next blocks prefetched
  two seqs       two sequences' blocks load by load (K, then V), next blocks prefetched
  k+1|v          K block i+1 with V block i, load by load (what a kernel pipelining q.k and p.v could read)
"""

import argparse
import time

import numpy as np
import torch
from torch.utils.cpp_extension import load_inline

S, HKV, D, B, L = 64, 3, 64, 16, 30

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <vector>

typedef float v16 __attribute__((vector_size(64), aligned(4)));

static inline v16 ld(const float* p) { v16 v; __builtin_memcpy(&v, p, 64); return v; }

// Sums the blocks of sequences [b, e) in `mode`'s order; returns the sum so that nothing is optimised away.
static float read_range(const float* k, const float* v, const int32_t* tb, int64_t W, const int64_t* nbk, int64_t b,
                        int64_t e, int64_t bs, int mode) {
  v16 a = {}, c = {};
  const auto blk = [&](const float* base, int64_t s, int64_t i) { return base + (int64_t)tb[s * W + i] * bs; };
  if (mode <= 1) {
    for (int64_t s = b; s < e; ++s)
      for (const float* base : {k, v})
        for (int64_t i = 0; i < nbk[s]; ++i) {
          const float* p = blk(base, s, i);
          const float* n = mode >= 1 && i + 1 < nbk[s] ? blk(base, s, i + 1) : nullptr;
          for (int64_t o = 0; o < bs; o += 16) {
            if (n) __builtin_prefetch(n + o, 0, 1);
            a += ld(p + o);
          }
        }
  } else if (mode == 3 || mode == 5) {
    const int64_t lag = mode == 5 ? 1 : 0;  // K block i + lag with V block i
    for (int64_t s = b; s < e; ++s)
      for (int64_t i = -lag; i < nbk[s]; ++i) {
        const float* p = i + lag < nbk[s] ? blk(k, s, i + lag) : nullptr;
        const float* q = i >= 0 ? blk(v, s, i) : nullptr;
        const float* nk = i + lag + 1 < nbk[s] ? blk(k, s, i + lag + 1) : nullptr;
        const float* nv = i + 1 < nbk[s] ? blk(v, s, i + 1) : nullptr;
        for (int64_t o = 0; o < bs; o += 16) {
          if (nk) __builtin_prefetch(nk + o, 0, 1);
          if (nv) __builtin_prefetch(nv + o, 0, 1);
          if (p) a += ld(p + o);
          if (q) c += ld(q + o);
        }
      }
  } else {
    for (int64_t s = b; s < e; s += 2) {
      const int64_t t = std::min(s + 1, e - 1), n = std::max(nbk[s], nbk[t]);
      for (const float* base : {k, v})
        for (int64_t i = 0; i < n; ++i) {
          const float* p = i < nbk[s] ? blk(base, s, i) : nullptr;
          const float* q = t != s && i < nbk[t] ? blk(base, t, i) : nullptr;
          const float* np = i + 1 < nbk[s] ? blk(base, s, i + 1) : nullptr;
          const float* nq = q && i + 1 < nbk[t] ? blk(base, t, i + 1) : nullptr;
          for (int64_t o = 0; o < bs; o += 16) {
            if (np) __builtin_prefetch(np + o, 0, 1);
            if (nq) __builtin_prefetch(nq + o, 0, 1);
            if (p) a += ld(p + o);
            if (q) c += ld(q + o);
          }
        }
    }
  }
  a += c;
  float r = 0;
  for (int j = 0; j < 16; ++j) r += a[j];
  return r;
}

double read_kv(torch::Tensor kc, torch::Tensor vc, torch::Tensor table, torch::Tensor nblocks, int64_t mode) {
  const int64_t S = nblocks.size(0), W = table.size(1), bs = kc.size(1) * kc.size(2) * kc.size(3);
  std::vector<double> out(S, 0.0);
  at::parallel_for(0, S, 2, [&](int64_t b, int64_t e) {
    out[b] = read_range(kc.data_ptr<float>(), vc.data_ptr<float>(), table.data_ptr<int32_t>(), W,
                        nblocks.data_ptr<int64_t>(), b, e, bs, static_cast<int>(mode));
  });
  double t = 0;
  for (double x : out) t += x;
  return t;
}
"""

MODES = {"seq": 0, "seq+prefetch": 1, "k|v": 3, "two seqs": 4, "k+1|v": 5}


def pool(contiguous: bool) -> tuple[list, torch.Tensor, torch.Tensor, int]:
    rng = np.random.default_rng(0)
    nb = (rng.integers(128, 193, S) + B - 1) // B
    size = int(nb.sum() * 1.3)
    perm = np.arange(nb.sum()) if contiguous else rng.permutation(size)[: nb.sum()]
    table = np.zeros((S, nb.max()), np.int32)
    for i, blocks in enumerate(np.split(perm.astype(np.int32), np.cumsum(nb)[:-1])):
        table[i, : nb[i]] = blocks
    caches = [(torch.randn(size, B, HKV, D), torch.randn(size, B, HKV, D)) for _ in range(L)]
    return caches, torch.from_numpy(table), torch.from_numpy(nb.astype(np.int64)), int(nb.sum()) * B * HKV * D * 8 * L


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    # -fopenmp: at::parallel_for is a header template, serial where the extension is built without OpenMP.
    module = load_inline(
        "kv_read_rate",
        SOURCE,
        functions=["read_kv"],
        extra_cflags=["-O3", "-march=native", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
    )
    torch.set_num_threads(args.threads)
    scattered, contiguous = pool(False), pool(True)
    runs = [(name, scattered, mode) for name, mode in MODES.items()] + [("contiguous", contiguous, 1)]
    for _ in range(args.rounds):
        for name, (caches, table, nblocks, nbytes), mode in runs:
            start = time.perf_counter()
            for kc, vc in caches:
                module.read_kv(kc, vc, table, nblocks, mode)
            seconds = time.perf_counter() - start
            print(f"{name:<14}{seconds * 1e3:6.1f} ms  {nbytes / seconds / 1e9:5.1f} GB/s", flush=True)


if __name__ == "__main__":
    main()

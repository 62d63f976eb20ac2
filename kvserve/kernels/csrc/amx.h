// What the AMX tile paths share (linear_bf16.cpp: bf16 pairs with tdpbf16ps; int8_linear.cpp: int8 quads with
// tdpbusd; paged_attention_amx.cpp: the pair-packed KV cache): whether the CPU and Linux allow them, the on/off
// switches, and the linears' tile configurations. kvserve's panel layouts already are AMX's B-tile format (a 64-byte
// tile row = 16 output channels x one k pair or quad), so the linears load tiles straight from the panels; see
// those files.
#pragma once

#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <atomic>
#include <cstdint>

namespace kvserve::amx {

constexpr int kTileRows = 16;  // rows of an A or C tile
constexpr int kTileK = 64;     // bytes of k in one A-tile row: 16 bf16 pairs or 16 int8 quads
// Input bytes per GEMM row block on tiles. Every AMX CPU has >= 2 MiB of L2 a core, and the tiles read the rows
// from L2 at no loss, so blocks are 4x the vector kernels': an LM head at 256 rows streams its 57 MB once, not
// twice (row_block_rows).
constexpr int64_t kRowBlockBytes = 1 << 20;

// Tests and benchmarks turn the tile paths off to compare (KVSERVE_CPU_AMX=0 does it at load).
inline std::atomic<bool>& wanted() {
  static std::atomic<bool> on{true};
  return on;
}

// CPUID leaf 7 EDX bits: AMX-BF16 22, AMX-TILE 24, AMX-INT8 25.
constexpr int kBf16 = 22, kInt8 = 25;

// The CPU has AMX-TILE and the given AMX feature, and Linux lets this process use the tile registers (a process
// asks once; the permission covers all its threads).
inline bool usable(int feature_bit) {
#if defined(__x86_64__)
  static const unsigned edx = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 24) & 1)) return 0u;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0 ? d : 0u;
  }();
  return (edx >> feature_bit) & 1;
#else
  (void)feature_bit;
  return false;
#endif
}

inline bool active(int feature_bit) { return wanted().load(std::memory_order_relaxed) && usable(feature_bit); }

// Attention on tiles (paged_attention_amx.cpp) has its own switch, for A/B runs of attention alone; a process sets
// it before its first attention call and keeps it (the tiles' bits are not the vectors').
inline std::atomic<bool>& attention_wanted() {
  static std::atomic<bool> on{true};
  return on;
}

inline bool attention_active() {
  return wanted().load(std::memory_order_relaxed) && attention_wanted().load(std::memory_order_relaxed) &&
         usable(kBf16);
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles: 0, 1 the int32/fp32 sums of `rows` input rows x a panel's two 16-channel halves; 2 those rows' k step
// (64 bytes); 3, 4 the weight halves (16 rows of 64 bytes); 5-7 the same three for a last k step of `tail` rows
// of 4 bytes (pairs or quads), when K is not a multiple of the full step.
inline TileConfig tile_config(int rows, int tail) {
  TileConfig cfg;
  for (int t = 0; t < 5; ++t) cfg.rows[t] = static_cast<uint8_t>(t < 3 ? rows : kTileK / 4), cfg.colsb[t] = 64;
  if (tail) {
    cfg.rows[5] = static_cast<uint8_t>(rows), cfg.colsb[5] = static_cast<uint16_t>(tail * 4);
    cfg.rows[6] = cfg.rows[7] = static_cast<uint8_t>(tail), cfg.colsb[6] = cfg.colsb[7] = 64;
  }
  return cfg;
}

// Two row groups of 16 x a panel's two halves (no k tail): tiles 0-3 the sums (group g, half h at 2g + h), 4, 5
// the groups' k step, 6, 7 the weight halves. Each weight tile then feeds two products, where tile_config's
// layout loads one weight tile per product (and is bound by tile loads, not products).
inline TileConfig tile_config_2x2() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = static_cast<uint8_t>(t < 6 ? kTileRows : kTileK / 4), cfg.colsb[t] = 64;
  return cfg;
}

}  // namespace kvserve::amx

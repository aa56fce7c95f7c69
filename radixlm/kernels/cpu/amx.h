// What the AMX kernels (bf16_gemm_amx.h, extend_attention.cpp) share: whether this process may
// and should use the tiles, and the one tile configuration they all use.
//
// Linux grants the tile state only to a process that asks for it (arch_prctl); a kernel whose
// request fails, or that is told RADIXLM_BF16_AMX=0, takes its AVX-512 path instead.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define RADIXLM_BF16_AMX 1
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace radixlm {
namespace amx {

// Whether this process may use the tiles; asked once.
inline bool permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// Whether this process's bf16 kernels (the GEMM, prefill attention) take the tiles: decided
// once (RADIXLM_BF16_AMX=0 keeps AVX-512), since the two paths round differently and one
// process must not mix them.
inline bool enabled() {
  static const bool on = [] {
    const char* e = getenv("RADIXLM_BF16_AMX");
    return !(e && strcmp(e, "0") == 0) && permitted();
  }();
  return on;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile 16 rows of 64 bytes: a C tile 16 x 16 float32, an A tile 16 rows x 32 bf16, a B
// tile 16 k pairs x 16 columns. Tile state is per thread: each thread configures its own.
inline void configure() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = 16;
  }
  // ldtilecfg as asm with the config as a memory input: gcc 12's _tile_loadconfig does not
  // tell the compiler it reads the struct, and the stores above were seen dropped.
  asm volatile("ldtilecfg %0" : : "m"(c));
}

}  // namespace amx
}  // namespace radixlm
#endif  // AMX

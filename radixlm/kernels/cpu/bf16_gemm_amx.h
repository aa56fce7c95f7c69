// The bfloat16 GEMM on AMX tiles (Intel Sapphire Rapids and later), for bf16_gemm.cpp: the
// same packed weight, the same inputs and outputs, the same epilogues.
//
// Why: TDPBF16PS multiplies a 16 x 32 bf16 tile by a 32 x 16 one in 16 cycles, 512 products a
// cycle against vdpbf16ps's 64. Measured on a 2-core AMX host (SmolLM2 shapes), oneDNN's AMX
// linear ran 5-12x faster than the AVX512-BF16 kernel at 32 and 1,024 rows; a prefill's GEMMs
// were held by the dot products there.
//
// The packed panels ([panel][k / 2][64][2]) already are AMX's B layout: 16 consecutive k pairs
// of 16 columns are one B tile, read 256 bytes a row apart. A micro-tile is up to 32 rows
// (two A tiles) times one 64-column panel: at most 16 rows in one pass over its four C tiles,
// more as two 32-column halves (2 x 2 C tiles each). The result goes to a float32 block that
// the AVX-512 epilogue of bf16_gemm.cpp finishes (bias, rounding, SiLU * up), so the fused
// epilogue stays bit for bit the unfused pair.
//
// Every row goes through the same tile instructions whatever the rows beside it: rows past M
// and k past K are zeros in per-thread copies (a partial A tile, the last k step when K is not
// a multiple of 32), never values of other rows. The AMX path serves every M, decode's single
// rows too, so an extend of K tokens still reproduces K decode steps bit for bit; the AVX-512
// path's numbers differ from it in the summation order, so one process uses one of them.
//
// Where the process may not use the tiles (amx.h) the AVX-512 kernel serves.
#pragma once

#include "amx.h"

#ifdef RADIXLM_BF16_AMX
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include <omp.h>

namespace radixlm {
namespace amx {

constexpr int kPanel = 64;       // columns per packed panel (bf16_gemm.cpp kNR)
constexpr int kRows = 32;        // rows per micro-tile: two A tiles
constexpr int kStep = 32;        // k per tile step (16 pairs)
constexpr int64_t kRowBlock = 256;  // rows whose A stays in L2 while the panels stream
// k steps per chunk: a chunk of the panel and of a micro-tile's A are reused from L1/L2 while
// the chunk runs over the row block's micro-tiles. (1,024 rows, SmolLM2's linears: 9 steps
// 3-10% faster than 3, 6 or the whole K at once; C resumes from float32 between chunks.)
#ifndef RADIXLM_AMX_CHUNK
#define RADIXLM_AMX_CHUNK 9
#endif
constexpr int kChunkSteps = RADIXLM_AMX_CHUNK;

constexpr int kPairRow = 2 * kPanel;  // bf16 per packed k pair (256 bytes)

// acc[16][64] float32 = 16 A rows (bf16, a_bytes apart) times one panel over `steps` k steps,
// the last step's B from btail when given (zero-padded k): the panel's four C tiles in one
// pass, so four accumulation chains overlap and each B row is read once (a decode batch).
inline void panel_tile(const uint16_t* a, int64_t a_bytes, int steps, const uint16_t* panel,
                       const uint16_t* btail, float* acc) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int s = 0; s < steps; ++s) {
    const uint16_t* b = btail && s == steps - 1 ? btail : panel + (int64_t)s * 16 * kPairRow;
    _tile_loadd(4, a + s * kStep, a_bytes);
    _tile_loadd(5, b, kPairRow * 2);
    _tile_loadd(6, b + 32, kPairRow * 2);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(7, b + 64, kPairRow * 2);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(5, b + 96, kPairRow * 2);
    _tile_dpbf16ps(2, 4, 7);
    _tile_dpbf16ps(3, 4, 5);
  }
  _tile_stored(0, acc, kPanel * 4);
  _tile_stored(1, acc + 16, kPanel * 4);
  _tile_stored(2, acc + 32, kPanel * 4);
  _tile_stored(3, acc + 48, kPanel * 4);
}

// Columns [32 h, 32 h + 32) of acc[16 RT][64] for RT A tiles of 16 rows, k steps [s0, s1): a
// 2 x 2 (RT 2) or 1 x 2 block of C tiles, the two B tiles of each k step shared by the A tiles.
// From s0 > 0 the C tiles resume from acc (float32 stored and loaded exactly, so the sum is
// the same as in one pass).
// Fetch: a cursor over the panel this thread multiplies next, 4 lines a k step into L2.
struct Fetch {
  const char* p = nullptr;
  const char* end = nullptr;
  inline void step() {
    if (p < end) {
      _mm_prefetch(p, _MM_HINT_T1);
      _mm_prefetch(p + 64, _MM_HINT_T1);
      _mm_prefetch(p + 128, _MM_HINT_T1);
      _mm_prefetch(p + 192, _MM_HINT_T1);
      p += 256;
    }
  }
};

template <int RT>
inline void half_tile(const uint16_t* a, int64_t a_bytes, int s0, int s1, int steps, const uint16_t* panel,
                      const uint16_t* btail, int h, float* acc, Fetch& fetch) {
  const uint16_t* a1 = a + 16 * (a_bytes / 2);
  float* c0 = acc + 32 * h;
  float* c1 = acc + 16 * kPanel + 32 * h;
  if (s0 == 0) {
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (RT == 2) {
      _tile_zero(2);
      _tile_zero(3);
    }
  } else {
    _tile_loadd(0, c0, kPanel * 4);
    _tile_loadd(1, c0 + 16, kPanel * 4);
    if constexpr (RT == 2) {
      _tile_loadd(2, c1, kPanel * 4);
      _tile_loadd(3, c1 + 16, kPanel * 4);
    }
  }
  for (int s = s0; s < s1; ++s) {
    fetch.step();
    const uint16_t* b = (btail && s == steps - 1 ? btail : panel + (int64_t)s * 16 * kPairRow) + h * 64;
    _tile_loadd(6, b, kPairRow * 2);
    _tile_loadd(4, a + s * kStep, a_bytes);
    _tile_loadd(7, b + 32, kPairRow * 2);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (RT == 2) _tile_loadd(5, a1 + s * kStep, a_bytes);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (RT == 2) {
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c0, kPanel * 4);
  _tile_stored(1, c0 + 16, kPanel * 4);
  if constexpr (RT == 2) {
    _tile_stored(2, c1, kPanel * 4);
    _tile_stored(3, c1 + 16, kPanel * 4);
  }
}

// Per-thread copies: A rows zero-padded to whole tiles and k steps, the last k step of a panel
// zero-padded, and the float32 block of a row block the epilogue reads.
struct Scratch {
  std::vector<uint16_t> a, btail;
  alignas(64) float acc[kRowBlock * kPanel];
};

// finish(m0, rows, panel, acc): the epilogue of up to 32 rows (acc [rows][64]).
//
// A task is (row block, panel), each thread a contiguous share of them. A block of at most 16
// rows (a decode batch) takes the panel in one pass (panel_tile). Larger blocks go in chunks of
// kChunkSteps k steps: each chunk over every micro-tile of the block (both halves), so the
// chunk of the panel is reused from L1/L2 rather than streamed again per micro-tile; C resumes
// from float32 between chunks. Meanwhile the thread's next panel is fetched into L2 (Fetch).
template <typename Finish>
void linear(const uint16_t* x, int64_t xs, int64_t M, int K, const uint16_t* packed, int N, int nthreads,
            Finish&& finish) {
  if (M <= 0) return;
  const int panels = (N + kPanel - 1) / kPanel, K2 = K / 2;
  const int steps = (K + kStep - 1) / kStep, kpad = steps * kStep;
  const bool ragged_k = kpad != K;
  const int64_t blocks = (M + kRowBlock - 1) / kRowBlock, tasks = blocks * panels;
  // A single row costs the tiles as much as 16: the threads pay off from smaller weights than
  // on AVX-512 (gemm_tasks.h).
  const bool parallel = (int64_t)std::max<int64_t>(M, 16) * N * K >= (int64_t)1 << 22;
#pragma omp parallel num_threads(nthreads) if (parallel)
  {
    static thread_local Scratch sc;
    configure();
    const int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
    const int64_t t0 = tasks * id / nt, t1 = tasks * (id + 1) / nt;
    int64_t copied = -1;  // the m0 whose padded copy sc.a holds (this call)
    // Micro-tile m0's A rows and their byte stride: in place, or a copy padded with zeros
    // (a partial tile, ragged k) that never holds another row's values.
    auto rows_of = [&](int64_t m0, int rows, int64_t& a_bytes) -> const uint16_t* {
      const int rt = rows > 16 ? 2 : 1;
      a_bytes = xs * 2;
      if (!ragged_k && rows % 16 == 0) return x + m0 * xs;
      a_bytes = kpad * 2;
      if (copied != m0) {
        sc.a.assign((size_t)16 * rt * kpad, 0);
        for (int r = 0; r < rows; ++r) memcpy(sc.a.data() + (int64_t)r * kpad, x + (m0 + r) * xs, (size_t)K * 2);
        copied = m0;
      }
      return sc.a.data();
    };
    for (int64_t t = t0; t < t1; ++t) {
      const int p = (int)(t % panels);
      const uint16_t* panel = packed + (int64_t)p * K * kPanel;
      const uint16_t* btail = nullptr;
      if (ragged_k) {
        sc.btail.assign(16 * kPairRow, 0);
        const int s0 = (steps - 1) * 16;
        memcpy(sc.btail.data(), panel + (int64_t)s0 * kPairRow, (size_t)(K2 - s0) * kPairRow * 2);
        btail = sc.btail.data();
      }
      const int64_t r0 = t / panels * kRowBlock, r1 = std::min(M, r0 + kRowBlock);
      int64_t a_bytes;
      Fetch fetch;
      if (t + 1 < t1) {
        fetch.p = (const char*)(packed + (int64_t)((t + 1) % panels) * K * kPanel);
        fetch.end = fetch.p + (int64_t)K * kPanel * 2;
      }
      if (r1 - r0 <= 16) {
        const uint16_t* a = rows_of(r0, (int)(r1 - r0), a_bytes);  // sets a_bytes first
        panel_tile(a, a_bytes, steps, panel, btail, sc.acc);
      } else {
        for (int s0 = 0; s0 < steps; s0 += kChunkSteps) {
          const int s1 = std::min(steps, s0 + kChunkSteps);
          for (int64_t m0 = r0; m0 < r1; m0 += kRows) {
            const int rows = (int)std::min<int64_t>(kRows, r1 - m0);
            const uint16_t* a = rows_of(m0, rows, a_bytes);
            float* acc = sc.acc + (m0 - r0) * kPanel;
            for (int h = 0; h < 2; ++h) {
              if (rows > 16)
                half_tile<2>(a, a_bytes, s0, s1, steps, panel, btail, h, acc, fetch);
              else
                half_tile<1>(a, a_bytes, s0, s1, steps, panel, btail, h, acc, fetch);
            }
          }
        }
      }
      for (int64_t m0 = r0; m0 < r1; m0 += kRows)
        finish(m0, (int)std::min<int64_t>(kRows, r1 - m0), p, sc.acc + (m0 - r0) * kPanel);
    }
    _tile_release();
  }
}

}  // namespace amx
}  // namespace radixlm
#endif  // AMX

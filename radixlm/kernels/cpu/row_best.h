// Each row's best column, for the GEMMs that answer argmax over their output instead of
// writing it (quant_ops.cpp int8_linear_argmax, bf16_gemm.cpp bf16_linear_argmax): greedy
// sampling off an LM head, whose 32 x 49,152 float32 logits were 6.3 MB written and read again
// per batch-32 decode step.
//
// A thread keeps, per output row, the best value and column seen so far in each of 16 lanes
// (lane j sees the columns 16 b + j), so a block of 16 columns costs a compare and two masked
// stores, not a horizontal reduction; lanes and threads are reduced once at the end. Columns
// reach a lane in increasing order, so a strict > keeps the first of equal values, and the
// reduction takes the smallest column among equal values: torch.argmax's first maximum. NaN
// never compares greater; `nan` is the row's first NaN column, torch.argmax's answer for a row
// that has one. (The library is built with -ffast-math: NaN and infinities are found on the
// bits, and -inf is written as bits.)
#pragma once

#include <limits.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace radixlm {

struct alignas(64) RowBest {
  float v[16];
  int32_t i[16];  // -1: nothing above -inf seen in this lane
  int32_t nan;    // INT32_MAX: no NaN seen
};

inline void init_row_best(RowBest* best, int64_t n) {
  const uint32_t neg_inf = 0xff800000u;
  for (int64_t r = 0; r < n; ++r) {
    for (int j = 0; j < 16; ++j) {
      memcpy(&best[r].v[j], &neg_inf, 4);
      best[r].i[j] = -1;
    }
    best[r].nan = INT32_MAX;
  }
}

#if defined(__AVX512F__)
// Columns col .. col + 15 of one row (the lanes in mask) with values v.
inline void take16(RowBest& rb, __m512 v, __mmask16 mask, int col) {
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __mmask16 gt = _mm512_mask_cmp_ps_mask(mask, v, _mm512_load_ps(rb.v), _CMP_GT_OQ);
  _mm512_mask_store_ps(rb.v, gt, v);
  _mm512_mask_store_epi32(rb.i, gt, _mm512_add_epi32(iota, _mm512_set1_epi32(col)));
  const __mmask16 nan = _mm512_mask_cmpgt_epi32_mask(
      mask, _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  if (nan) rb.nan = std::min(rb.nan, col + __builtin_ctz(nan));
}
#endif

#if defined(__AVX2__)
// Columns col .. col + 7 of one row, the first `valid` of them, into lanes lane0 .. lane0 + 7
// (0 or 8: the 16 lanes as two halves).
inline void take8(RowBest& rb, __m256 v, int valid, int lane0, int col) {
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 ok = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(valid), iota));
  const __m256 bv = _mm256_load_ps(rb.v + lane0);
  const __m256 gt = _mm256_and_ps(_mm256_cmp_ps(v, bv, _CMP_GT_OQ), ok);
  _mm256_store_ps(rb.v + lane0, _mm256_blendv_ps(bv, v, gt));
  const __m256 bi = _mm256_castsi256_ps(_mm256_load_si256((const __m256i*)(rb.i + lane0)));
  const __m256 ci = _mm256_castsi256_ps(_mm256_add_epi32(iota, _mm256_set1_epi32(col)));
  _mm256_store_si256((__m256i*)(rb.i + lane0), _mm256_castps_si256(_mm256_blendv_ps(bi, ci, gt)));
  const __m256i mag = _mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32(0x7fffffff));
  const int nan = _mm256_movemask_ps(
      _mm256_and_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(mag, _mm256_set1_epi32(0x7f800000))), ok));
  if (nan) rb.nan = std::min(rb.nan, col + __builtin_ctz(nan));
}
#endif

// ids[m] from the threads' states best[t * M + m], t < nt: the first NaN column, else the
// first column of the largest value, else (every value -inf) column 0, as torch.argmax.
inline void finish_row_best(const RowBest* best, int nt, int64_t M, int64_t* ids) {
  for (int64_t m = 0; m < M; ++m) {
    int32_t nan = INT32_MAX, bi = -1;
    float bv = 0.f;
    for (int t = 0; t < nt; ++t) {
      const RowBest& rb = best[(int64_t)t * M + m];
      nan = std::min(nan, rb.nan);
      for (int j = 0; j < 16; ++j) {
        const int32_t i = rb.i[j];
        if (i >= 0 && (bi < 0 || rb.v[j] > bv || (rb.v[j] == bv && i < bi))) {
          bv = rb.v[j];
          bi = i;
        }
      }
    }
    ids[m] = nan != INT32_MAX ? nan : bi >= 0 ? bi : 0;
  }
}

// ids [M] from gemm(best, nt): a GEMM whose threads (at most nt) update best [nt][M] (thread
// t its rows t * M ..) instead of writing an output. The one driver of the argmax entry points.
template <typename Gemm>
void argmax_by_rows(int64_t M, int nthreads, int64_t* ids, Gemm&& gemm) {
  const int nt = std::max(1, nthreads);
  std::vector<RowBest> best((size_t)nt * M);
  init_row_best(best.data(), (int64_t)best.size());
  gemm(best.data(), nt);
  finish_row_best(best.data(), nt, M, ids);
}

}  // namespace radixlm

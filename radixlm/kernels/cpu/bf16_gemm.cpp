// bfloat16 linear on AVX512-BF16 dot products (Zen 4, Sapphire Rapids and later), see
// radixlm/srt/layers/bf16_gemm.py: out[M, N] = x[M, K] @ w[N, K]^T (+ bias), x and w bf16,
// float32 accumulation, one rounding to the output dtype. On CPUs with AMX the same weight is
// multiplied on tiles instead (bf16_gemm_amx.h), with this file's epilogue.
//
// Why: torch's bf16 linear (oneDNN, even with the weight prepacked) reaches ~35-60% of the
// vdpbf16ps peak at decode batch sizes on 2 cores (benchmark/micro/roofline.py, step_components.py),
// and its time is the largest part of a bf16 decode step. Here the weight is packed once into
// panels of 64 output columns whose consecutive k are interleaved in pairs
// (packed[panel][k / 2][64][2]), so one zmm load holds 16 columns' (w[k], w[k+1]) and one
// vdpbf16ps against the broadcast pair (x[k], x[k+1]) adds both products for 16 outputs. A
// micro-tile of 6 rows x 64 columns keeps 24 accumulators in registers, fed per k pair by 4
// weight loads and 6 broadcasts.
//
// Every row is computed the same way whatever the number of rows beside it (the same k order,
// the same instruction sequence per row), so an extend of K tokens reproduces K decode steps
// bit for bit (speculative verification relies on it).
//
// Tasks: gemm_tasks.h.
//
// bf16_linear_silu: a gate_up weight packed with 32 gate rows and the 32 matching up rows per
// panel (bf16_gemm.py: silu_gated), whose epilogue is silu(gate) * up: out [M, N / 2], bit for
// bit the plain GEMM followed by silu_mul (rowwise_avx512.h's store_silu_mul16).

#include <stdint.h>
#include <string.h>
#include <algorithm>
#include <type_traits>

#include "bf16_gemm_amx.h"
#include "gemm_tasks.h"
#include "row_best.h"
#include "rowwise_avx512.h"

#ifdef RADIXLM_ROWWISE_AVX512  // AVX512-BF16 (with F, BW and VL, as every CPU that has it)
#include <immintrin.h>
#define RADIXLM_BF16_GEMM 1
#endif

namespace {

#ifdef RADIXLM_BF16_GEMM
constexpr int kNR = 64;   // columns per panel (4 zmm of float32 outputs)
constexpr int kMR = 6;    // rows per micro-tile
constexpr int64_t kRowBlock = 96;  // activation rows kept in L2 while the panels stream

inline void store16(float* o, __m512 v, __mmask16 mask) { _mm512_mask_storeu_ps(o, mask, v); }
inline void store16(uint16_t* o, __m512 v, __mmask16 mask) {
  _mm256_mask_storeu_epi16(o, mask, (__m256i)_mm512_cvtneps_pbh(v));
}

// Bias columns 16 j .. 16 j + 15 (those in mask) widened to float32; zeros without a bias.
inline __m512 bias16(const uint16_t* bias, int j, __mmask16 mask = 0xFFFF) {
  return bias ? radixlm::rowwise::load16(bias + 16 * j, mask) : _mm512_setzero_ps();
}

// The epilogue of a micro-tile: out rows = acc rows (+ bias), rounded once to TO; kSilu:
// silu(gate) * up of a silu-gated panel (vectors 0-1 the gate's 32 columns, 2-3 the up's).
// acc(m, j): row m's accumulators of columns 16 j .. 16 j + 15.
template <typename TO, bool kSilu, typename Acc>
inline void finish_rows(Acc&& acc, int rows, const uint16_t* bias, TO* out, int64_t os, int ncols) {
  if constexpr (kSilu) {  // whole panels only
    __m512 b[4];
    for (int j = 0; j < 4; ++j) b[j] = bias16(bias, j);
    for (int m = 0; m < rows; ++m)
      for (int j = 0; j < 2; ++j)
        radixlm::rowwise::store_silu_mul16(out + m * os + 16 * j, _mm512_add_ps(acc(m, j), b[j]),
                                           _mm512_add_ps(acc(m, j + 2), b[j + 2]));
    return;
  }
  if constexpr (std::is_same_v<TO, uint16_t>) {
    // A whole panel: each row's 64 columns as two 64-byte stores, not four masked 32-byte ones
    // (on the AMX host the masked stores held the epilogue: 1,024 x 3,072 outputs cost a
    // quarter of the GEMM; after, the plain linears 2-8% faster).
    if (ncols == 64) {
      __m512 b[4];
      for (int j = 0; j < 4; ++j) b[j] = bias16(bias, j);
      for (int m = 0; m < rows; ++m)
        for (int j = 0; j < 4; j += 2)
          _mm512_storeu_si512(out + m * os + 16 * j,
                              (__m512i)_mm512_cvtne2ps_pbh(_mm512_add_ps(acc(m, j + 1), b[j + 1]),
                                                           _mm512_add_ps(acc(m, j), b[j])));
      return;
    }
  }
  for (int j = 0; j < 4; ++j) {
    const int left = ncols - 16 * j;
    if (left <= 0) break;
    const __mmask16 mask = radixlm::rowwise::tail_mask(left);
    const __m512 b = bias16(bias, j, mask);
    for (int m = 0; m < rows; ++m) store16(out + m * os + 16 * j, _mm512_add_ps(acc(m, j), b), mask);
  }
}

// bf16_linear_argmax's epilogue: each row's columns c0 .. c0 + ncols - 1 as a bfloat16 output
// holds them (finish_rows' sum and rounding), into the row's RowBest (row_best.h).
template <typename Acc>
inline void best_rows(Acc&& acc, int rows, const uint16_t* bias, radixlm::RowBest* best, int c0, int ncols) {
  for (int j = 0; j < 4; ++j) {
    const int left = ncols - 16 * j;
    if (left <= 0) break;
    const __mmask16 mask = radixlm::rowwise::tail_mask(left);
    const __m512 b = bias16(bias, j, mask);
    for (int m = 0; m < rows; ++m) {
      const __m256i h = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc(m, j), b));
      const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
      radixlm::take16(best[m], v, mask, c0 + 16 * j);
    }
  }
}

// out[MR rows][ncols <= 64] = x rows (bf16, xs apart) times one panel (K2 pairs of k).
// A micro-tile's pass over the whole panel. (Passes over 128- or 256-k slices that stay in L1,
// partial sums kept between them, measured 5-15% slower at batch 1 and 32 with the weights
// streaming from DRAM, as in a decode step.)
//
// The tile also fetches k pairs [pf0, pf1) of the panel its thread multiplies next (pf) into
// L2, spread evenly over its own k loop, so that panel's first micro-tile does not wait for
// DRAM (each k pair of a panel is 4 cache lines).
// kArgmax: best_rows into best (rows m0 ..) instead of out.
template <int MR, bool Fetch, typename TO, bool kSilu, bool kArgmax = false>
void micro_tile(const uint16_t* x, int64_t xs, int K2, const uint16_t* panel, const uint16_t* bias, TO* out,
                int64_t os, int ncols, const uint16_t* pf, int pf0, int pf1, radixlm::RowBest* best = nullptr,
                int c0 = 0) {
  __m512 acc[MR][4];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_ps();
  const int pf_n = pf1 - pf0;
  int pf_next = pf0, pf_debt = 0;  // Bresenham: pf_n fetches over K2 iterations
#pragma GCC unroll 2
  for (int kp = 0; kp < K2; ++kp) {
    pf_debt += pf_n;
    while (Fetch && pf_debt >= K2) {
      pf_debt -= K2;
      const char* line = (const char*)(pf + (int64_t)pf_next++ * 2 * kNR);
      for (int c = 0; c < 4; ++c) _mm_prefetch(line + 64 * c, _MM_HINT_T1);
    }
    const uint16_t* w = panel + (int64_t)kp * 2 * kNR;
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w), w1 = (__m512bh)_mm512_loadu_si512(w + 32);
    const __m512bh w2 = (__m512bh)_mm512_loadu_si512(w + 64), w3 = (__m512bh)_mm512_loadu_si512(w + 96);
    for (int m = 0; m < MR; ++m) {
      int32_t pair;
      memcpy(&pair, x + m * xs + 2 * kp, 4);
      const __m512bh b = (__m512bh)_mm512_set1_epi32(pair);
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], w0, b);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], w1, b);
      acc[m][2] = _mm512_dpbf16_ps(acc[m][2], w2, b);
      acc[m][3] = _mm512_dpbf16_ps(acc[m][3], w3, b);
    }
  }
  if constexpr (kArgmax)
    best_rows([&](int m, int j) { return acc[m][j]; }, MR, bias, best, c0, ncols);
  else
    finish_rows<TO, kSilu>([&](int m, int j) { return acc[m][j]; }, MR, bias, out, os, ncols);
}

#ifdef RADIXLM_BF16_AMX
template <typename TO, bool kSilu>
void bf16_linear_amx(const uint16_t* x, int64_t xs, int64_t M, int K, const uint16_t* packed, int N,
                     const uint16_t* bias, TO* out, int64_t os, int nthreads) {
  radixlm::amx::linear(x, xs, M, K, packed, N, nthreads, [&](int64_t m0, int rows, int p, const float* acc) {
    const int c0 = p * kNR;
    finish_rows<TO, kSilu>([&](int m, int j) { return _mm512_load_ps(acc + m * kNR + 16 * j); }, rows,
                           bias ? bias + c0 : nullptr, out + m0 * os + (kSilu ? c0 / 2 : c0), os,
                           std::min(kNR, N - c0));
  });
}
#endif

// kSilu: the silu-gated panel layout, out has N / 2 columns. kArgmax: best [nthreads][M]
// instead of out (bf16_linear_argmax; not on AMX tiles, which its caller checks).
template <typename TO, bool kSilu = false, bool kArgmax = false>
void bf16_linear(const uint16_t* x, int64_t xs, int64_t M, int K, const uint16_t* packed, int N, const uint16_t* bias,
                 TO* out, int64_t os, int nthreads, radixlm::RowBest* best = nullptr) {
#ifdef RADIXLM_BF16_AMX
  if constexpr (!kArgmax)
    if (radixlm::amx::enabled()) return bf16_linear_amx<TO, kSilu>(x, xs, M, K, packed, N, bias, out, os, nthreads);
#endif
  const int K2 = K / 2;
  radixlm::run_gemm_tasks<kMR>(M, N, K, kNR, kRowBlock, nthreads, [&](int64_t m0, int rows, int p,
                                                                       radixlm::NextPanel next) {
    const uint16_t* panel = packed + (int64_t)p * K * kNR;
    const uint16_t* pf = next.panel < 0 ? nullptr : packed + (int64_t)next.panel * K * kNR;
    const int pf0 = next.begin(K2), pf1 = next.end(K2);
    const int c0 = p * kNR, ncols = std::min(kNR, N - c0);
    const uint16_t* b = bias ? bias + c0 : nullptr;
    const uint16_t* xr = x + m0 * xs;
    TO* o = kArgmax ? nullptr : out + m0 * os + (kSilu ? c0 / 2 : c0);
    radixlm::RowBest* rb = kArgmax ? best + (int64_t)omp_get_thread_num() * M + m0 : nullptr;
    const bool fetch = pf1 > pf0;
    switch (rows) {
#define RADIXLM_TILE(R)                                                                                   \
  case R:                                                                                                 \
    if (fetch)                                                                                            \
      micro_tile<R, true, TO, kSilu, kArgmax>(xr, xs, K2, panel, b, o, os, ncols, pf, pf0, pf1, rb, c0);  \
    else                                                                                                  \
      micro_tile<R, false, TO, kSilu, kArgmax>(xr, xs, K2, panel, b, o, os, ncols, pf, pf0, pf1, rb, c0); \
    break;
      RADIXLM_TILE(1) RADIXLM_TILE(2) RADIXLM_TILE(3) RADIXLM_TILE(4) RADIXLM_TILE(5) RADIXLM_TILE(6)
#undef RADIXLM_TILE
    }
  });
}
#endif  // RADIXLM_BF16_GEMM

template <bool kSilu>
int bf16_linear_call(const void* x, int64_t x_stride, int64_t M, int K, const void* packed, int N, const void* bias,
                     int out_dtype, void* out, int64_t out_stride, int nthreads) {
#ifdef RADIXLM_BF16_GEMM
  if (K % 2 != 0) return -2;
  if (out_dtype == 0)
    bf16_linear<float, kSilu>((const uint16_t*)x, x_stride, M, K, (const uint16_t*)packed, N,
                              (const uint16_t*)bias, (float*)out, out_stride, nthreads);
  else
    bf16_linear<uint16_t, kSilu>((const uint16_t*)x, x_stride, M, K, (const uint16_t*)packed, N,
                                 (const uint16_t*)bias, (uint16_t*)out, out_stride, nthreads);
  return 0;
#else
  (void)x; (void)x_stride; (void)M; (void)K; (void)packed; (void)N; (void)bias; (void)out_dtype; (void)out;
  (void)out_stride; (void)nthreads;
  return -1;
#endif
}

}  // namespace

extern "C" {

int radixlm_bf16_gemm_available() {
#ifdef RADIXLM_BF16_GEMM
  return 1;
#else
  return 0;
#endif
}

// 1 when this process's bf16 GEMMs run on AMX tiles (bf16_gemm_amx.h), else 0.
int radixlm_bf16_gemm_amx() {
#ifdef RADIXLM_BF16_AMX
  return radixlm::amx::enabled() ? 1 : 0;
#else
  return 0;
#endif
}

// x [M, K] bf16 (rows x_stride apart, K even), packed [ceil(N / 64)][K / 2][64][2] bf16, bias
// bf16 [N] or null, out [M, N] (rows out_stride apart) in out_dtype (0 = float32,
// 1 = bfloat16). Returns -1 when built without AVX512-BF16, -2 for an odd K.
int radixlm_bf16_linear(const void* x, int64_t x_stride, int64_t M, int K, const void* packed, int N,
                        const void* bias, int out_dtype, void* out, int64_t out_stride, int nthreads) {
  return bf16_linear_call<false>(x, x_stride, M, K, packed, N, bias, out_dtype, out, out_stride, nthreads);
}

// The first column of each row's largest value among columns 0 .. N - 1 of
// radixlm_bf16_linear's bfloat16 output (no bias), NaN first, as torch.argmax over it; the
// output itself is never written (row_best.h). ids: int64 [M]. -1: built without AVX512-BF16,
// or the GEMMs run on AMX tiles here (the caller computes the output instead); -2: odd K.
int radixlm_bf16_linear_argmax(const void* x, int64_t x_stride, int64_t M, int K, const void* packed, int N,
                               int64_t* ids, int nthreads) {
#ifdef RADIXLM_BF16_GEMM
#ifdef RADIXLM_BF16_AMX
  if (radixlm::amx::enabled()) return -1;
#endif
  if (K % 2 != 0 || N <= 0) return -2;
  if (M <= 0) return 0;
  radixlm::argmax_by_rows(M, nthreads, ids, [&](radixlm::RowBest* best, int nt) {
    bf16_linear<uint16_t, false, true>((const uint16_t*)x, x_stride, M, K, (const uint16_t*)packed, N, nullptr,
                                       nullptr, 0, nt, best);
  });
  return 0;
#else
  (void)x; (void)x_stride; (void)M; (void)K; (void)packed; (void)N; (void)ids; (void)nthreads;
  return -1;
#endif
}

// The gate_up weight in bf16_linear_silu's panel order (N = 2I, whole 64-column panels), bias
// (if any) in that order too; out [M, N / 2]. -2 also for N not whole panels.
int radixlm_bf16_linear_silu(const void* x, int64_t x_stride, int64_t M, int K, const void* packed, int N,
                             const void* bias, int out_dtype, void* out, int64_t out_stride, int nthreads) {
  if (N % 64 != 0) return -2;
  return bf16_linear_call<true>(x, x_stride, M, K, packed, N, bias, out_dtype, out, out_stride, nthreads);
}

}  // extern "C"

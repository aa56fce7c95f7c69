// AVX-512 row kernels of the elementwise ops (SiLU*mul, residual-add + RMSNorm), 16 lanes at
// a time with masked tails, for float32 and bfloat16 rows.
//
// Why not leave them to the compiler: gcc vectorises the scalar loops in cpu_ops.cpp, but
// SiLU's exp becomes a call into glibc's vector expf and the norm's sum of squares runs 16
// lanes in one chain through a float buffer; a decode batch's SiLU*mul (32 x 1,536) took 33 us
// and its add + RMSNorm (32 x 576) 14 us, ~2 ms of a w8a8 step over the 30 layers. Here the
// exponential is inline (decode_tasks.h's exp512, which decode attention's softmax uses too)
// and the rows are read twice from L1 instead of through a buffer.
//
// Rounding: one rounding to T per output, as the scalar kernels; bfloat16 narrows with
// vcvtneps2bf16 (nearest even; NaN stays NaN), which the int8 GEMM's epilogue uses too.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define RADIXLM_ROWWISE_AVX512 1
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "decode_tasks.h"

namespace radixlm {
namespace rowwise {

inline __mmask16 tail_mask(int left) { return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1); }

// bfloat16 bits -> float32: a 16-bit shift.
inline __m512 widen(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const uint16_t* p, __mmask16 m) { return widen(_mm256_maskz_loadu_epi16(m, p)); }
inline void store16(float* p, __mmask16 m, __m512 v) { _mm512_mask_storeu_ps(p, m, v); }
inline void store16(uint16_t* p, __mmask16 m, __m512 v) {
  _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
}

// The value a store to T keeps (float: itself; bfloat16: rounded to nearest even).
inline __m512 round_to(float*, __m512 v) { return v; }
inline __m512 round_to(uint16_t*, __m512 v) { return widen((__m256i)_mm512_cvtneps_pbh(v)); }

// o[i] = silu(g[i]) * u[i] = g / (1 + e^-g) * u, e^-g capped at e^80: built with -ffast-math, gcc
// turns the division into a reciprocal estimate and a Newton step, which gives 0 * inf = NaN
// where e^-g overflows (g below -88) instead of -0.
// 16 lanes of it, unrounded: also the int8 GEMM's fused epilogue (quant_ops.cpp), which must
// give the same bits.
inline __m512 silu_mul16(__m512 gv, __m512 uv) {
  const __m512 e = exp512(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), gv), _mm512_set1_ps(80.f)));
  return _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), e)), uv);
}

// 16 lanes of a fused GEMM epilogue: g and u rounded to T as their stores would round them,
// then silu(g) * u stored: bit for bit a store of both followed by silu_mul_row.
template <typename T>
inline void store_silu_mul16(T* o, __m512 g, __m512 u) {
  store16(o, 0xFFFF, silu_mul16(round_to(o, g), round_to(o, u)));
}

template <typename T>
inline void silu_mul_row(const T* g, const T* u, T* o, int I) {
  for (int i = 0; i < I; i += 16) {
    const __mmask16 m = tail_mask(I - i);
    store16(o + i, m, silu_mul16(load16(g + i, m), load16(u + i, m)));
  }
}

// residual (if given) += x, rounded to T; out = x_or_residual * rsqrt(mean square + eps) * w.
// Two accumulators halve the sum's dependency chain.
template <typename T>
inline void add_rmsnorm_row(const T* x, T* residual, const T* w, T* out, int H, float eps) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  const T* src = residual ? residual : x;
  for (int i = 0; i < H; i += 16) {
    const __mmask16 m = tail_mask(H - i);
    __m512 v = load16(x + i, m);
    if (residual) {
      v = round_to(residual, _mm512_add_ps(v, load16(residual + i, m)));
      store16(residual + i, m, v);
    }
    if ((i >> 4) & 1)
      acc1 = _mm512_fmadd_ps(v, v, acc1);
    else
      acc0 = _mm512_fmadd_ps(v, v, acc0);
  }
  const float ss = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
  const __m512 r = _mm512_set1_ps(1.f / sqrtf(ss / H + eps));
  for (int i = 0; i < H; i += 16) {
    const __mmask16 m = tail_mask(H - i);
    store16(out + i, m, _mm512_mul_ps(_mm512_mul_ps(load16(src + i, m), r), load16(w + i, m)));
  }
}

}  // namespace rowwise
}  // namespace radixlm
#endif

// Row functions shared by the elementwise kernels (cpu_ops.cpp: silu_mul, add_rmsnorm) and the
// int8 GEMM, which runs them on its own rows (quant_ops.cpp: RMSNorm before quantizing its input,
// SiLU * mul as the gate_up epilogue): one definition each, so the fused and the separate
// kernels give the same bits.
//
// SiLU is explicit vector code (AVX-512, else AVX2 with a padded tail): left to the compiler,
// a scalar loop mixes glibc's vector expf (the vectorised body) and its scalar expf (peeled or
// tail elements, which depend on the row's alignment and length), and the two differ in the
// last bit, so a 16-column epilogue and a whole row would not agree. Out of line, one
// instantiation each (a template's copies are merged at link time). The AVX-512 SiLU epilogue
// calls rowwise::silu_mul16 inline instead, the same instructions as silu_mul_row.
#pragma once

#include <math.h>
#include <stdint.h>

#include <algorithm>

#include "avx2.h"
#include "bf16.h"
#include "rowwise_avx512.h"

namespace radixlm {

// The longest row add_rmsnorm_span takes (its portable path's buffer).
constexpr int kMaxNormRow = 8192;

#if !defined(RADIXLM_ROWWISE_AVX512) && defined(RADIXLM_AVX2_HELPERS)
// 8 lanes: g / (1 + e^min(-g, 80)) * u (e^-g capped: gcc under -ffast-math assumes no
// infinities, and an infinite e^-g gave NaN instead of -0).
inline __m256 silu_mul8(__m256 g, __m256 u) {
  const __m256 e = exp256(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), g), _mm256_set1_ps(80.f)));
  return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e)), u);
}
#endif

// o[i] = silu(g[i]) * u[i], rounded once to T.
template <typename T>
__attribute__((noinline)) void silu_mul_span(const T* g, const T* u, T* o, int n) {
#ifdef RADIXLM_ROWWISE_AVX512
  rowwise::silu_mul_row(g, u, o, n);
#elif defined(RADIXLM_AVX2_HELPERS)
  int i = 0;
  for (; i + 8 <= n; i += 8) store8(o + i, silu_mul8(load8(g + i), load8(u + i)));
  const int left = std::min(n - i, 7);
  if (left > 0) {  // the tail through the same 8-lane code
    T gt[8] = {}, ut[8] = {}, ot[8];
    for (int j = 0; j < left; ++j) gt[j] = g[i + j], ut[j] = u[i + j];
    store8(ot, silu_mul8(load8(gt), load8(ut)));
    for (int j = 0; j < left; ++j) o[i + j] = ot[j];
  }
#else
  for (int i = 0; i < n; ++i) {
    // e^-g capped at e^80: built with -ffast-math, gcc assumes no infinities, and a gate
    // below -88 (e^-g = inf) came out NaN instead of -0.
    const float gv = to_f(g[i]);
    o[i] = from_f<T>(gv / (1.f + expf(std::min(-gv, 80.f))) * to_f(u[i]));
  }
#endif
}

// One row of H <= kMaxNormRow values: residual (if given) += x, rounded to T; out = rmsnorm(residual
// or x) * w, one rounding.
template <typename T>
__attribute__((noinline)) void add_rmsnorm_span(const T* x, T* residual, const T* w, T* out, int H, float eps) {
#ifdef RADIXLM_ROWWISE_AVX512
  rowwise::add_rmsnorm_row(x, residual, w, out, H, eps);
#else
  float buf[kMaxNormRow];
  float ss = 0.f;
  if (residual) {
    for (int i = 0; i < H; ++i) {
      const T v = from_f<T>(to_f(x[i]) + to_f(residual[i]));
      residual[i] = v;
      buf[i] = to_f(v);
    }
  } else {
    for (int i = 0; i < H; ++i) buf[i] = to_f(x[i]);
  }
  for (int i = 0; i < H; ++i) ss += buf[i] * buf[i];
  const float r = 1.f / sqrtf(ss / H + eps);
  for (int i = 0; i < H; ++i) out[i] = from_f<T>(buf[i] * r * to_f(w[i]));
#endif
}

}  // namespace radixlm

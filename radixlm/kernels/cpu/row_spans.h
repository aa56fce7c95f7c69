// Row functions shared by the elementwise kernels (cpu_ops.cpp: silu_mul, add_rmsnorm) and the
// int8 GEMM, which runs them on its own rows (quant_ops.cpp: RMSNorm before quantizing its input,
// SiLU * mul as the gate_up epilogue): one definition each, so the fused and the separate
// kernels give the same bits.
//
// Out of line on purpose: inlined into two contexts, gcc may vectorise a scalar loop in one
// (glibc's vector expf under -ffast-math) and not in the other, and the two expfs differ in the
// last bit. One instantiation (a template's copies are merged at link time) keeps one set of
// numbers. The AVX-512 SiLU epilogue calls rowwise::silu_mul16 inline instead, the same
// instructions as silu_mul_row.
#pragma once

#include <math.h>
#include <stdint.h>

#include <algorithm>

#include "bf16.h"
#include "rowwise_avx512.h"

namespace radixlm {

// o[i] = silu(g[i]) * u[i], rounded once to T.
template <typename T>
__attribute__((noinline)) void silu_mul_span(const T* g, const T* u, T* o, int n) {
#ifdef RADIXLM_ROWWISE_AVX512
  rowwise::silu_mul_row(g, u, o, n);
#else
  for (int i = 0; i < n; ++i) {
    // e^-g capped at e^80: built with -ffast-math, gcc assumes no infinities, and a gate
    // below -88 (e^-g = inf) came out NaN instead of -0.
    const float gv = to_f(g[i]);
    o[i] = from_f<T>(gv / (1.f + expf(std::min(-gv, 80.f))) * to_f(u[i]));
  }
#endif
}

// One row of H <= 8192 values: residual (if given) += x, rounded to T; out = rmsnorm(residual
// or x) * w, one rounding.
template <typename T>
__attribute__((noinline)) void add_rmsnorm_span(const T* x, T* residual, const T* w, T* out, int H, float eps) {
#ifdef RADIXLM_ROWWISE_AVX512
  rowwise::add_rmsnorm_row(x, residual, w, out, H, eps);
#else
  float buf[8192];
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

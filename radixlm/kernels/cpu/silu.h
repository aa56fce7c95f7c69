// silu(gate) * up over a span of values, rounded once to T: the one definition that
// cpu_ops.cpp's silu_mul and the int8 GEMM's fused epilogue (quant_ops.cpp) both call, so a
// fused gate_up + SiLU gives the bits of the two separate kernels.
//
// Out of line on purpose: inlined into two contexts, gcc may vectorise the scalar loop in
// one (glibc's vector expf under -ffast-math) and not in the other, and the two expfs differ
// in the last bit. One instantiation (a template's copies are merged at link time) keeps one
// set of numbers. The AVX-512 epilogue calls rowwise::silu_mul16 inline instead, the same
// instructions as silu_mul_row.
#pragma once

#include <math.h>

#include <algorithm>

#include "bf16.h"
#include "rowwise_avx512.h"

namespace radixlm {

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

}  // namespace radixlm

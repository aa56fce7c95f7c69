// Float linear for CPUs without bf16 dot products (AVX2 + FMA, e.g. AMD Zen 3), see
// radixlm/srt/layers/float_gemm.py: out[M, N] = x[M, K] @ w[N, K]^T (+ bias), float32
// accumulation, one rounding to the output dtype.
//
// Why: on such CPUs torch's bf16 matmul is emulated (4-8x slower than its fp32 one, measured
// by benchmark/micro/roofline.py), and its fp32 one reaches ~40% of the FMA peak at decode
// batch sizes. Here the weight is packed once into panels of 16 output columns
// (packed[panel][k][16], float32 or bfloat16 bits, zero-padded), so a micro-tile of 6 rows x 16
// columns is 12 ymm accumulators fed by 2 weight loads and 6 broadcasts per k, all in
// registers. bfloat16 weights are widened in registers (a 16-bit shift): half the bytes
// streamed from DRAM, for 4 more instructions per 12 FMAs.
//
// Tasks: gemm_tasks.h.

#include <omp.h>
#include <stdint.h>
#include <string.h>
#include <algorithm>
#include <type_traits>
#include <vector>

#include "bf16.h"
#include "gemm_tasks.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define RADIXLM_FLOAT_GEMM 1
#endif

namespace {

using radixlm::from_f;
using radixlm::to_f;

#ifdef RADIXLM_FLOAT_GEMM
constexpr int kNR = 16;   // columns per panel
constexpr int kMR = 6;    // rows per micro-tile
constexpr int64_t kRowBlock = 192;  // activation rows kept in L2 while the panels stream

inline __m256 wload(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 wload(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

inline void store8(float* o, __m256 v) { _mm256_storeu_ps(o, v); }
inline void store8(uint16_t* o, __m256 v) {
  alignas(32) float t[8];
  _mm256_store_ps(t, v);
  for (int i = 0; i < 8; ++i) o[i] = from_f<uint16_t>(t[i]);
}

// out[MR rows][ncols <= 16] = x rows (float32, K apart) times one panel.
template <int MR, typename TW, typename TO>
void micro_tile(const float* x, int64_t xs, int K, const TW* panel, const TO* bias, TO* out, int64_t os, int ncols) {
  const __m256 z = _mm256_setzero_ps();
  __m256 a00 = z, a01 = z, a10 = z, a11 = z, a20 = z, a21 = z, a30 = z, a31 = z, a40 = z, a41 = z, a50 = z, a51 = z;
#pragma GCC unroll 4
  for (int k = 0; k < K; ++k) {
    const __m256 w0 = wload(panel + (int64_t)k * kNR), w1 = wload(panel + (int64_t)k * kNR + 8);
#define RADIXLM_ROW(m)                                     \
  if constexpr (MR > m) {                                  \
    const __m256 b = _mm256_broadcast_ss(x + m * xs + k);  \
    a##m##0 = _mm256_fmadd_ps(b, w0, a##m##0);             \
    a##m##1 = _mm256_fmadd_ps(b, w1, a##m##1);             \
  }
    RADIXLM_ROW(0) RADIXLM_ROW(1) RADIXLM_ROW(2) RADIXLM_ROW(3) RADIXLM_ROW(4) RADIXLM_ROW(5)
#undef RADIXLM_ROW
  }
  alignas(32) float bb[kNR] = {0};
  if (bias)
    for (int i = 0; i < ncols; ++i) bb[i] = to_f(bias[i]);
  const __m256 b0 = _mm256_load_ps(bb), b1 = _mm256_load_ps(bb + 8);
#define RADIXLM_OUT(m)                                                         \
  if constexpr (MR > m) {                                                      \
    const __m256 r0 = _mm256_add_ps(a##m##0, b0), r1 = _mm256_add_ps(a##m##1, b1); \
    TO* o = out + m * os;                                                      \
    if (ncols == kNR) {                                                        \
      store8(o, r0);                                                           \
      store8(o + 8, r1);                                                       \
    } else {                                                                   \
      alignas(32) float t[kNR];                                                \
      _mm256_store_ps(t, r0);                                                  \
      _mm256_store_ps(t + 8, r1);                                              \
      for (int i = 0; i < ncols; ++i) o[i] = from_f<TO>(t[i]);                 \
    }                                                                          \
  }
  RADIXLM_OUT(0) RADIXLM_OUT(1) RADIXLM_OUT(2) RADIXLM_OUT(3) RADIXLM_OUT(4) RADIXLM_OUT(5)
#undef RADIXLM_OUT
}

template <typename TI, typename TW, typename TO>
void float_linear(const TI* x, int64_t x_stride, int64_t M, int K, const TW* packed, int N, const TO* bias, TO* out,
                  int64_t out_stride, int nthreads) {
  if (M <= 0) return;
  // Activations as float32 rows (a bf16 input is widened once; a float32 one is read in place).
  std::vector<float> xf;
  const float* xp;
  int64_t xs;
  if constexpr (std::is_same<TI, float>::value) {
    xp = x;
    xs = x_stride;
  } else {
    xf.resize((size_t)M * K);
    // A prefill's activations are MBs: widened in parallel (a decode batch's on one thread).
#pragma omp parallel for num_threads(nthreads) if (M * K >= (int64_t)1 << 17)
    for (int64_t m = 0; m < M; ++m)
      for (int k = 0; k < K; ++k) xf[m * K + k] = to_f(x[m * x_stride + k]);
    xp = xf.data();
    xs = K;
  }
  radixlm::run_gemm_tasks<kMR>(M, N, K, kNR, kRowBlock, nthreads, [&](int64_t m0, int rows, int p, radixlm::NextPanel) {
    const TW* panel = packed + (int64_t)p * K * kNR;
    const int c0 = p * kNR, ncols = std::min(kNR, N - c0);
    const TO* b = bias ? bias + c0 : nullptr;
    const float* xr = xp + m0 * xs;
    TO* o = out + m0 * out_stride + c0;
    switch (rows) {
#define RADIXLM_TILE(R) \
  case R: micro_tile<R, TW, TO>(xr, xs, K, panel, b, o, out_stride, ncols); break;
      RADIXLM_TILE(1) RADIXLM_TILE(2) RADIXLM_TILE(3) RADIXLM_TILE(4) RADIXLM_TILE(5) RADIXLM_TILE(6)
#undef RADIXLM_TILE
    }
  });
}
#endif  // RADIXLM_FLOAT_GEMM

}  // namespace

extern "C" {

int radixlm_float_gemm_available() {
#ifdef RADIXLM_FLOAT_GEMM
  return 1;
#else
  return 0;
#endif
}

// dtypes 0 = float32, 1 = bfloat16: x_dtype of x, w_dtype of the packed panels, out_dtype of
// out and bias. packed: [ceil(N / 16)][K][16]. Returns -1 when built without AVX2 + FMA.
int radixlm_float_linear(int x_dtype, const void* x, int64_t x_stride, int64_t M, int K, int w_dtype,
                         const void* packed, int N, int out_dtype, const void* bias, void* out, int64_t out_stride,
                         int nthreads) {
#ifdef RADIXLM_FLOAT_GEMM
#define RADIXLM_CALL(TI, TW, TO)                                                                          \
  float_linear<TI, TW, TO>((const TI*)x, x_stride, M, K, (const TW*)packed, N, (const TO*)bias, (TO*)out, \
                           out_stride, nthreads)
#define RADIXLM_W(TI, TO)                             \
  if (w_dtype == 0) RADIXLM_CALL(TI, float, TO);      \
  else RADIXLM_CALL(TI, uint16_t, TO);
  if (x_dtype == 0 && out_dtype == 0) { RADIXLM_W(float, float) }
  else if (x_dtype == 0) { RADIXLM_W(float, uint16_t) }
  else if (out_dtype == 0) { RADIXLM_W(uint16_t, float) }
  else { RADIXLM_W(uint16_t, uint16_t) }
#undef RADIXLM_W
#undef RADIXLM_CALL
  return 0;
#else
  return -1;
#endif
}

}  // extern "C"

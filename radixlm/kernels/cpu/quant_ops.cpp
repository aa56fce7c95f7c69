// W8A8 int8 linear, see radixlm/srt/layers/int8_linear.py for the scheme: int8 weights with
// one float32 scale per output channel; activations quantized on the fly in groups of
// kGroup consecutive input features, one scale per (token, group), as llama.cpp's Q8_0.
// (One scale per token is the cheaper textbook W8A8, but measured on SmolLM2-135M it moved
// the logits ten times further from float32 than groups of 32 do.)
//   quantize_groups: x [M, K] (float32/bf16) -> q [M, Kp] uint8 = round(x * 127 / amax) + 128
//                    per group, zero-padded to Kp (a multiple of kGroup); scales [M, Kp/kGroup]
//   int8_linear:     quantize + GEMM over a prepacked weight + epilogue in one call:
//                    out[m][n] = w_scale[n] * sum_g x_scale[m][g] * dot_g(q[m], w[n]) (+ bias[n])
// The dot products use vpdpbusd (AVX512-VNNI, unsigned x signed bytes, hence the +128 and a
// per-group correction comp[g][n] = 128 * sum over the group of w[n]). The weight is read in
// the layout vpdpbusd consumes, packed once; nothing is re-blocked per call (oneDNN's
// _int_mm re-orders its B operand on every call, which with weights coming from DRAM, the
// decode case, cost it most of its speed-up over bf16).
// Rounding is nearbyintf (round half to even, the default mode), as torch.round does.
//   int8_linear_silu: the same GEMM over a gate_up weight whose tiles each hold 16 gate columns
//                    then the 16 matching up columns (int8_linear.py: silu_gated), with
//                    silu(gate) * up (row_spans.h) as its epilogue: out [M, N / 2]. Gate and up
//                    are rounded to the output type first, as the unfused pair stores them, so
//                    the result is bit for bit int8_linear followed by silu_mul; the [M, N]
//                    intermediate and the separate pass over it (single-threaded at a decode
//                    batch's size) are gone.
//   int8_linear_norm: either of them with the residual add + RMSNorm of its input done by the
//                    thread that quantizes each row (row_spans.h, bit for bit add_rmsnorm): a
//                    decode step's norms no longer run as their own single-threaded passes.

//
// Without AVX-512 (AVX2 + FMA, e.g. AMD Zen 3) the same packed weight is multiplied with
// vpmaddubsw: it takes unsigned x signed bytes and sums pairs into saturating int16, so the
// activations are kept signed (no +128 here) and the sign trick makes the product exact:
// |w| (unsigned) times sign(x, w) (x with w's sign), pairs <= 2 * 127 * 127 < 32767, then
// vpmaddwd against ones widens to int32. The integer dot per group is the same exact number
// as VNNI's (dot - comp), folded into float the same way, so the two paths agree bit for bit.

#include <omp.h>
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define RADIXLM_VNNI 1
#define RADIXLM_INT8_GEMM 1
#elif defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define RADIXLM_INT8_AVX2 1
#define RADIXLM_INT8_GEMM 1
#endif
#include <stdint.h>
#include <math.h>
#include <string.h>
#include <algorithm>
#include <vector>

#include "avx2.h"
#include "bf16.h"
#include "row_best.h"
#include "row_spans.h"

namespace {

using radixlm::from_f;
using radixlm::to_f;
using radixlm::add_rmsnorm_span;
using radixlm::silu_mul_span;
using radixlm::RowBest;

constexpr int kGroup = 32;  // input features per activation scale (int8_linear.py: GROUP)
// Same reasoning as cpu_ops.cpp: a decode batch's pass is a few microseconds of work.
constexpr int64_t kParallelMin = 1 << 17;

#if defined(__AVX512F__) && defined(__AVX512BW__)
inline __m512 widen_bf16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) { return widen_bf16(_mm256_loadu_si256((const __m256i*)p)); }
// 16 values times inv, rounded to nearest even (the MXCSR default, as nearbyintf), clamped,
// + 128, stored as bytes.
inline void store_q16(uint8_t* q, __m512 v, __m512 inv) {
  __m512i i = _mm512_cvtps_epi32(_mm512_mul_ps(v, inv));
  i = _mm512_min_epi32(_mm512_max_epi32(i, _mm512_set1_epi32(-127)), _mm512_set1_epi32(127));
  _mm_storeu_si128((__m128i*)q, _mm512_cvtepi32_epi8(_mm512_add_epi32(i, _mm512_set1_epi32(128))));
}
#elif defined(RADIXLM_INT8_AVX2)
using radixlm::load8;
using radixlm::hmax8;
// A whole group of 32 values times inv, rounded to nearest even (MXCSR default, as
// nearbyintf), clamped to +-127, as bytes in order; offset: + 128 (xor of the sign bit).
template <bool kOffset>
inline void store_q32(uint8_t* q, const __m256* v, __m256 inv) {
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  __m256i i[4];
  for (int c = 0; c < 4; ++c)
    i[c] = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[c], inv)), lo), hi);
  // packs work per 128-bit lane: dwords come out as [0lo 1lo 2lo 3lo 0hi 1hi 2hi 3hi]
  __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
  b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  if (kOffset) b = _mm256_xor_si256(b, _mm256_set1_epi8((char)0x80));
  _mm256_storeu_si256((__m256i*)q, b);
}
#endif

// One row: qr is Kp = ng * kGroup bytes, scale ng floats. kOffset: q = int8 + 128 (uint8,
// what vpdpbusd and the Python API take); else q holds the int8 values themselves.
template <typename T, bool kOffset = true>
void quantize_row(const T* xr, int K, int ng, uint8_t* qr, float* scale) {
  for (int g = 0; g < ng; ++g) {
    const int k0 = g * kGroup, k1 = std::min(K, k0 + kGroup);
#if defined(__AVX512F__) && defined(__AVX512BW__)
    static_assert(kGroup == 32, "the vector path quantizes a group as two 16-lane halves");
    if (k1 - k0 == kGroup) {  // a whole group: two vectors (the scalar loop ran at ~1.4 cycles/value)
      const __m512 a = load16(xr + k0), b = load16(xr + k0 + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
      const __m512 inv = _mm512_set1_ps(amax > 0.f ? (float)(127.0 / (double)amax) : 0.f);
      store_q16(qr + k0, a, inv);
      store_q16(qr + k0 + 16, b, inv);
      scale[g] = (float)((double)amax / 127.0);
      continue;
    }
#elif defined(RADIXLM_INT8_AVX2)
    if (k1 - k0 == kGroup) {  // a whole group: four vectors
      __m256 v[4];
      const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
      __m256 mx = _mm256_setzero_ps();
      for (int c = 0; c < 4; ++c) {
        v[c] = load8(xr + k0 + 8 * c);
        mx = _mm256_max_ps(mx, _mm256_and_ps(v[c], absmask));
      }
      const float amax = hmax8(mx);
      store_q32<kOffset>(qr + k0, v, _mm256_set1_ps(amax > 0.f ? (float)(127.0 / (double)amax) : 0.f));
      scale[g] = (float)((double)amax / 127.0);
      continue;
    }
#endif
    float amax = 0.f;
    for (int k = k0; k < k1; ++k) amax = fmaxf(amax, fabsf(to_f(xr[k])));
    // In double, rounded once: -ffast-math may turn a float division into a reciprocal
    // estimate, and these two numbers must equal the correctly rounded float32 ones.
    const float inv = amax > 0.f ? (float)(127.0 / (double)amax) : 0.f;
    for (int k = k0; k < k1; ++k) {
      const float v = fminf(127.f, fmaxf(-127.f, nearbyintf(to_f(xr[k]) * inv)));
      qr[k] = (uint8_t)((int)v + (kOffset ? 128 : 0));
    }
    for (int k = std::max(k0, k1); k < k0 + kGroup; ++k) qr[k] = kOffset ? 128 : 0;
    scale[g] = (float)((double)amax / 127.0);
  }
}

// Row m of q is Kp = ng * kGroup bytes, scale row m is ng floats (quantize_row).
template <typename T, bool kOffset = true>
void quantize_groups(const T* x, int64_t x_stride, int64_t M, int K, int ng, uint8_t* q, float* scale,
                     int nthreads) {
  const int64_t Kp = (int64_t)ng * kGroup;
#pragma omp parallel for num_threads(nthreads) if (M * K >= kParallelMin)
  for (int64_t m = 0; m < M; ++m) quantize_row<T, kOffset>(x + m * x_stride, K, ng, q + m * Kp, scale + m * ng);
}

#ifdef RADIXLM_INT8_GEMM
// Packed weight (int8_linear.py's pack_int8_weight): tiles of 32 output columns, K padded to
// Kp; packed[tile][kq][c][j] = w[32 * tile + c][4 * kq + j], so one k-quad of a tile is 128
// contiguous bytes = 2 zmm operands of vpdpbusd, and a tile is one contiguous stream.
// comp[tile][g][c] = 128 * sum of the group's weights; w_scale is padded to 32 * tiles.
constexpr int kTileCols = 32;
constexpr int kQuadsPerGroup = kGroup / 4;

// The next tile's weights, prefetched a few lines per group while this tile computes:
// in one burst per micro-tile the prefetches filled the miss buffers and stalled the loads
// of the computation.
struct TilePrefetch {
  const char* p = nullptr;
  int64_t lines = 0;
  int per_group = 0;
  inline void some() {
    for (int i = 0; i < per_group && lines > 0; ++i, --lines, p += 64) _mm_prefetch(p, _MM_HINT_T0);
  }
};

#endif

#ifdef RADIXLM_VNNI
constexpr int kMR = 6;  // rows per micro-tile (see micro_tile)
constexpr int kPassesPerTile = 1;  // micro_tile covers the tile's 32 columns at once
constexpr bool kOffsetActivations = true;  // vpdpbusd: unsigned activations (+128), comp corrects

inline __m512 load_bias(const float* b, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, b); }
inline __m512 load_bias(const uint16_t* b, __mmask16 mask) { return widen_bf16(_mm256_maskz_loadu_epi16(mask, b)); }
inline void store_row(float* o, __mmask16 mask, __m512 f) { _mm512_mask_storeu_ps(o, mask, f); }
inline void store_row(uint16_t* o, __mmask16 mask, __m512 f) {
#if defined(__AVX512BF16__)
  _mm256_mask_storeu_epi16(o, mask, (__m256i)_mm512_cvtneps_pbh(f));
#else
  alignas(64) float tmp[16];
  _mm512_store_ps(tmp, f);
  for (int i = 0; i < 16; ++i)
    if (mask >> i & 1) o[i] = from_f<uint16_t>(tmp[i]);
#endif
}

// out[MR rows][ncols] of one 32-column tile. Two 16-column blocks per row keep 6 rows x 2 blocks of int
// and float accumulators + 2 weights + 1 broadcast = 27 zmm in registers, so each weight
// load feeds 6 rows. The accumulators are named variables, not arrays: GCC spills arrays
// of __m512i to the stack inside the k loop (measured 30% slower).
// silu(g) * u of one row's 16 columns into o, g and u first rounded to TO (see int8_linear_silu).
template <typename TO>
inline void store_silu_mul(TO* o, __m512 g, __m512 u) {
#ifdef RADIXLM_ROWWISE_AVX512
  radixlm::rowwise::store_silu_mul16(o, g, u);
#else
  alignas(64) TO gb[16], ub[16];
  store_row(gb, 0xffff, g);
  store_row(ub, 0xffff, u);
  silu_mul_span(gb, ub, o, 16);
#endif
}

// kArgmax: no output; each row's values (as a float32 output would hold them) update the
// row's RowBest in best[m] instead, for columns c0 + 0 .. ncols - 1.
template <int MR, typename TO, bool kSilu, bool kArgmax = false>
void micro_tile(const uint8_t* xq, int64_t xs, const float* xscale, int ng, const int8_t* wt,
                const int32_t* comp, const float* ws, const TO* bias, TO* out, int64_t os, int ncols,
                TilePrefetch& pf, RowBest* best = nullptr, int c0 = 0) {
  static_assert(MR >= 1 && MR <= 6, "micro_tile handles 1-6 rows");
  const __m512 zf = _mm512_setzero_ps();
#define RADIXLM_FACC(m) __m512 f##m##0 = zf, f##m##1 = zf;
  RADIXLM_FACC(0) RADIXLM_FACC(1) RADIXLM_FACC(2) RADIXLM_FACC(3) RADIXLM_FACC(4) RADIXLM_FACC(5)
#undef RADIXLM_FACC
  for (int g = 0; g < ng; ++g) {
    pf.some();
    // The sums start at -comp, so they end as dot - comp without a subtraction per group.
    const int32_t* cg = comp + g * kTileCols;
    const __m512i z = _mm512_setzero_si512();
    const __m512i k0 = _mm512_sub_epi32(z, _mm512_loadu_si512(cg)), k1 = _mm512_sub_epi32(z, _mm512_loadu_si512(cg + 16));
    __m512i c00 = k0, c01 = k1, c10 = k0, c11 = k1, c20 = k0, c21 = k1, c30 = k0, c31 = k1, c40 = k0, c41 = k1;
    __m512i c50 = k0, c51 = k1;
    const int8_t* wg = wt + (int64_t)g * kQuadsPerGroup * 128;
    const uint8_t* xg = xq + g * kGroup;
#pragma GCC unroll 8
    for (int kq = 0; kq < kQuadsPerGroup; ++kq) {
      const int8_t* wk = wg + kq * 128;
      const __m512i w0 = _mm512_loadu_si512(wk), w1 = _mm512_loadu_si512(wk + 64);
#define RADIXLM_ROW(m)                                           \
  if constexpr (MR > m) {                                        \
    int32_t four;                                                \
    memcpy(&four, xg + m * xs + 4 * kq, 4);                      \
    const __m512i a = _mm512_set1_epi32(four);                   \
    c##m##0 = _mm512_dpbusd_epi32(c##m##0, a, w0);               \
    c##m##1 = _mm512_dpbusd_epi32(c##m##1, a, w1);               \
  }
      RADIXLM_ROW(0) RADIXLM_ROW(1) RADIXLM_ROW(2) RADIXLM_ROW(3) RADIXLM_ROW(4) RADIXLM_ROW(5)
#undef RADIXLM_ROW
    }
    // f += x_scale[m][g] * (dot - comp[g])
#define RADIXLM_FOLD(m)                                                 \
  if constexpr (MR > m) {                                               \
    const __m512 s = _mm512_set1_ps(xscale[m * ng + g]);                \
    f##m##0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c##m##0), s, f##m##0); \
    f##m##1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c##m##1), s, f##m##1); \
  }
    RADIXLM_FOLD(0) RADIXLM_FOLD(1) RADIXLM_FOLD(2) RADIXLM_FOLD(3) RADIXLM_FOLD(4) RADIXLM_FOLD(5)
#undef RADIXLM_FOLD
  }
  const bool has_bias = bias != nullptr;
  if constexpr (kSilu) {  // block 0: the gate's 16 columns, block 1: the up's (whole tiles only)
    const __m512 ws0 = _mm512_loadu_ps(ws), ws1 = _mm512_loadu_ps(ws + 16);
    const __m512 b0 = has_bias ? load_bias(bias, 0xffff) : zf, b1 = has_bias ? load_bias(bias + 16, 0xffff) : zf;
#define RADIXLM_SILU(m)                                                                              \
  if constexpr (MR > m)                                                                              \
    store_silu_mul(out + m * os, has_bias ? _mm512_fmadd_ps(f##m##0, ws0, b0) : _mm512_mul_ps(f##m##0, ws0), \
                   has_bias ? _mm512_fmadd_ps(f##m##1, ws1, b1) : _mm512_mul_ps(f##m##1, ws1));
    RADIXLM_SILU(0) RADIXLM_SILU(1) RADIXLM_SILU(2) RADIXLM_SILU(3) RADIXLM_SILU(4) RADIXLM_SILU(5)
#undef RADIXLM_SILU
    return;
  }
#define RADIXLM_OUT(m, b)                                                                    \
  if constexpr (MR > m) {                                                                    \
    const __m512 v = has_bias ? _mm512_fmadd_ps(f##m##b, wsv, bv) : _mm512_mul_ps(f##m##b, wsv); \
    if constexpr (kArgmax)                                                                   \
      radixlm::take16(best[m], v, mask, c0 + b * 16);                                        \
    else                                                                                     \
      store_row(out + m * os + b * 16, mask, v);                                             \
  }
#define RADIXLM_BLOCK(b)                                                                   \
  if (b * 16 < ncols) {                                                                    \
    const int left = ncols - b * 16;                                                       \
    const __mmask16 mask = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1); \
    const __m512 wsv = _mm512_loadu_ps(ws + b * 16);                                       \
    const __m512 bv = has_bias ? load_bias(bias + b * 16, mask) : zf;                      \
    RADIXLM_OUT(0, b) RADIXLM_OUT(1, b) RADIXLM_OUT(2, b) RADIXLM_OUT(3, b) RADIXLM_OUT(4, b) RADIXLM_OUT(5, b) \
  }
  RADIXLM_BLOCK(0) RADIXLM_BLOCK(1)
#undef RADIXLM_BLOCK
#undef RADIXLM_OUT
}

#elif defined(RADIXLM_INT8_AVX2)
constexpr int kMR = 4;  // rows per micro-tile (see micro_tile)
constexpr int kPassesPerTile = 2;  // micro_tile covers the tile as two 16-column halves
constexpr bool kOffsetActivations = false;  // the sign trick needs the signed values

// out[MR rows][ncols] of one 32-column tile in two 16-column halves. Per half, MR rows x 2
// vectors of 8 int32 dots + 2 weights, their absolute values, a broadcast and ones fill the
// 16 ymm registers; the float sums across groups live in memory (one load/store per group,
// against 8 k-quads of 4 ops each). Named accumulators for the reason given in the VNNI
// micro_tile. comp is unused: the activations are signed.
template <int MR, typename TO, bool kSilu, bool kArgmax = false>
void micro_tile(const uint8_t* xq, int64_t xs, const float* xscale, int ng, const int8_t* wt,
                const int32_t* /*comp*/, const float* ws, const TO* bias, TO* out, int64_t os, int ncols,
                TilePrefetch& pf, RowBest* best = nullptr, int c0 = 0) {
  static_assert(MR >= 1 && MR <= 4, "micro_tile handles 1-4 rows");
  const __m256i ones = _mm256_set1_epi16(1);
  // kSilu: half 0 is the gate's 16 columns, kept (rounded to TO, as stored) until half 1, the
  // up's, gives the row's silu(gate) * up (row_spans.h).
  alignas(32) TO gate[kSilu ? MR : 1][16];
  alignas(32) TO up[16];
  for (int half = 0; half < 2 && half * 16 < ncols; ++half) {
    alignas(32) float facc[MR][16];
    for (int m = 0; m < MR; ++m)
      for (int i = 0; i < 16; ++i) facc[m][i] = 0.f;
    for (int g = 0; g < ng; ++g) {
      pf.some();
      const __m256i z = _mm256_setzero_si256();
      __m256i c00 = z, c01 = z, c10 = z, c11 = z, c20 = z, c21 = z, c30 = z, c31 = z;
      const int8_t* wg = wt + (int64_t)g * kQuadsPerGroup * 128 + half * 64;
      const uint8_t* xg = xq + g * kGroup;
#pragma GCC unroll 8
      for (int kq = 0; kq < kQuadsPerGroup; ++kq) {
        const __m256i w0 = _mm256_loadu_si256((const __m256i*)(wg + kq * 128));
        const __m256i w1 = _mm256_loadu_si256((const __m256i*)(wg + kq * 128 + 32));
        const __m256i u0 = _mm256_abs_epi8(w0), u1 = _mm256_abs_epi8(w1);
#define RADIXLM_ROW(m)                                                                                      \
  if constexpr (MR > m) {                                                                                   \
    int32_t four;                                                                                           \
    memcpy(&four, xg + m * xs + 4 * kq, 4);                                                                 \
    const __m256i a = _mm256_set1_epi32(four);                                                              \
    c##m##0 = _mm256_add_epi32(c##m##0, _mm256_madd_epi16(_mm256_maddubs_epi16(u0, _mm256_sign_epi8(a, w0)), ones)); \
    c##m##1 = _mm256_add_epi32(c##m##1, _mm256_madd_epi16(_mm256_maddubs_epi16(u1, _mm256_sign_epi8(a, w1)), ones)); \
    asm("" : "+x"(c##m##0), "+x"(c##m##1)); /* keeps GCC from reassociating the sums through the stack */ \
  }
        RADIXLM_ROW(0) RADIXLM_ROW(1) RADIXLM_ROW(2) RADIXLM_ROW(3)
#undef RADIXLM_ROW
      }
      // facc += x_scale[m][g] * dot (the fold of the VNNI micro_tile, same float operations)
#define RADIXLM_FOLD(m)                                                                                 \
  if constexpr (MR > m) {                                                                               \
    const __m256 s = _mm256_set1_ps(xscale[m * ng + g]);                                                \
    _mm256_store_ps(facc[m], _mm256_fmadd_ps(_mm256_cvtepi32_ps(c##m##0), s, _mm256_load_ps(facc[m])));         \
    _mm256_store_ps(facc[m] + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(c##m##1), s, _mm256_load_ps(facc[m] + 8))); \
  }
      RADIXLM_FOLD(0) RADIXLM_FOLD(1) RADIXLM_FOLD(2) RADIXLM_FOLD(3)
#undef RADIXLM_FOLD
    }
    const int cols = std::min(16, ncols - half * 16);
    const float* wsh = ws + half * 16;
    for (int m = 0; m < MR; ++m) {
      TO* o = kArgmax ? nullptr : !kSilu ? out + m * os + half * 16 : half == 0 ? gate[m] : up;
      alignas(32) float r[16];
      for (int b = 0; b < 2; ++b) {
        const __m256 f = _mm256_load_ps(facc[m] + 8 * b), wsv = _mm256_loadu_ps(wsh + 8 * b);
        __m256 v;
        if (bias != nullptr) {
          alignas(32) float bb[8];
          for (int i = 0; i < 8; ++i) bb[i] = 8 * b + i < cols ? to_f(bias[half * 16 + 8 * b + i]) : 0.f;
          v = _mm256_fmadd_ps(f, wsv, _mm256_load_ps(bb));
        } else {
          v = _mm256_mul_ps(f, wsv);
        }
        if constexpr (kArgmax) {  // lanes 8 b .. of the row's 16
          if (8 * b >= cols) break;
          radixlm::take8(best[m], v, cols - 8 * b, 8 * b, c0 + half * 16 + 8 * b);
          continue;
        }
        if (cols == 16) radixlm::store8(o + 8 * b, v);
        else _mm256_store_ps(r + 8 * b, v);
      }
      if constexpr (kArgmax) continue;
      if (cols < 16)
        for (int i = 0; i < cols; ++i) o[i] = from_f<TO>(r[i]);
      if (kSilu && half == 1) silu_mul_span(gate[m], up, out + m * os, 16);
    }
  }
}
#endif

#ifdef RADIXLM_INT8_GEMM
// The GEMM's input as add_rmsnorm's output: row m of the input is written to normed + m * K
// (rmsnorm(residual[m] += h[m]) * w, or of h[m] alone without a residual), then quantized.
template <typename T>
struct NormIn {
  const T* h;
  int64_t h_stride;
  T* residual;  // [M, K] contiguous, or null
  const T* w;
  float eps;
  T* normed;  // [M, K] contiguous
};

// kSilu: the gate_up tile layout of int8_linear_silu; out has N / 2 columns. norm: x is
// norm->normed, computed here (NormIn).
// kArgmax: best [nthreads][M] instead of out (see RowBest; TO = float, what is compared).
template <typename TI, typename TO, bool kSilu = false, bool kArgmax = false>
void int8_linear(const TI* x, int64_t x_stride, int64_t M, int K, const int8_t* packed, const int32_t* comp,
                 const float* w_scale, int N, const TO* bias, TO* out, int64_t out_stride, int nthreads,
                 const NormIn<TI>* norm = nullptr, RowBest* best = nullptr) {
  if (M <= 0) return;
  const int ng = (K + kGroup - 1) / kGroup;
  const int64_t Kp = (int64_t)ng * kGroup;
  const int tiles = (N + kTileCols - 1) / kTileCols;
  // The quantized activations live in per-thread scratch that only grows: a std::vector per
  // call zero-filled them first, and past glibc's mmap threshold (a prefill chunk's 1,024 x
  // 1,536) every call mapped fresh pages and faulted each one in.
  static thread_local std::vector<uint8_t> xq_scratch;
  static thread_local std::vector<float> xs_scratch;
  if (xq_scratch.size() < (size_t)M * Kp) xq_scratch.resize((size_t)M * Kp);
  if (xs_scratch.size() < (size_t)M * ng) xs_scratch.resize((size_t)M * ng);
  uint8_t* const xq = xq_scratch.data();
  float* const xs = xs_scratch.data();
  // Rows are split too when there are few column tiles, so both threads get equal work;
  // tasks are tile-major, so each thread streams its own share of the weight.
  int64_t chunks = 1;
  const int target = 8 * nthreads;
  if (tiles < target)
    chunks = std::max<int64_t>(1, std::min<int64_t>((M + kMR - 1) / kMR, (target + tiles - 1) / tiles));
  const int64_t rows_per = ((M + chunks - 1) / chunks + kMR - 1) / kMR * kMR;
  chunks = (M + rows_per - 1) / rows_per;
  const int64_t tasks = (int64_t)tiles * chunks;
  const bool parallel = (int64_t)N * K >= kParallelMin || M * (int64_t)N * K >= (int64_t)1 << 22;
  // The activations are quantized inside the GEMM's region, each thread its rows: before it,
  // on one thread, they were a serial 7.7 us (32 x 576) to 16 us (32 x 1,536) of each call.
#pragma omp parallel num_threads(nthreads) if (parallel)
  {
#pragma omp for schedule(static)
  for (int64_t m = 0; m < M; ++m) {
    if (norm != nullptr)
      add_rmsnorm_span(norm->h + m * norm->h_stride, norm->residual ? norm->residual + m * K : nullptr, norm->w,
                       norm->normed + m * K, K, norm->eps);
    quantize_row<TI, kOffsetActivations>(x + m * x_stride, K, ng, xq + m * Kp, xs + m * ng);
  }
#pragma omp for schedule(static)
  for (int64_t t = 0; t < tasks; ++t) {
    const int tile = (int)(t / chunks);
    const int64_t r0 = (t % chunks) * rows_per, r1 = std::min(M, r0 + rows_per);
    const int8_t* wt = packed + (int64_t)tile * Kp * kTileCols;
    const int32_t* ct = comp + (int64_t)tile * ng * kTileCols;
    const int c0 = tile * kTileCols, ncols = std::min(kTileCols, N - c0);
    const TO* b = bias ? bias + c0 : nullptr;
    // The first micro-tile of a tile waits on DRAM for its weights and the rest hit the
    // cache; prefetching the next tile across this task's micro-tiles overlaps the two
    // (tasks of one thread are consecutive, so the next tile is usually its own). Measured
    // on 30 layers' weights streamed from DRAM at batch 32: 17.5 -> 15.9 ms per pass, warm
    // caches 14.5 ms; T0 beat T1, and spreading twice as densely was slower.
    const bool last_chunk = t % chunks == chunks - 1 && tile + 1 < tiles;
    const int8_t* next = wt + Kp * kTileCols;
    const int64_t next_bytes = last_chunk ? Kp * kTileCols : 0;
    // Rows go to micro-tiles as evenly as possible (32 rows: 6,6,5,5,5,5 rather than
    // 6,6,6,6,6,2: a 2-row micro-tile loads the weights as often for a third of the work).
    const int64_t steps = (r1 - r0 + kMR - 1) / kMR;
    const int64_t base = (r1 - r0) / steps, extra = (r1 - r0) % steps;
    TilePrefetch pf;
    pf.p = (const char*)next;
    pf.lines = next_bytes / 64;
    pf.per_group = (int)((pf.lines + steps * ng * kPassesPerTile - 1) / (steps * ng * kPassesPerTile));
    int64_t m0 = r0;
    for (int64_t step = 0; step < steps; ++step) {
      const int64_t rows = base + (step < extra ? 1 : 0);
      const uint8_t* xr = xq + m0 * Kp;
      const float* sr = xs + m0 * ng;
      TO* o = kArgmax ? nullptr : out + m0 * out_stride + (kSilu ? c0 / 2 : c0);
      RowBest* rb = kArgmax ? best + (int64_t)omp_get_thread_num() * M + m0 : nullptr;
      switch (rows) {
#define RADIXLM_TILE(R)                                                                                      \
  case R:                                                                                                    \
    micro_tile<R, TO, kSilu, kArgmax>(xr, Kp, sr, ng, wt, ct, w_scale + c0, b, o, out_stride, ncols, pf, rb, c0); \
    break;
        RADIXLM_TILE(1) RADIXLM_TILE(2) RADIXLM_TILE(3) RADIXLM_TILE(4)
#if defined(RADIXLM_VNNI)
        RADIXLM_TILE(5) RADIXLM_TILE(6)
#endif
#undef RADIXLM_TILE
      }
      m0 += rows;
    }
  }
  }  // omp parallel
}
#endif  // RADIXLM_INT8_GEMM

}  // namespace

// ---- C ABI: dtype 0 = float32, 1 = bfloat16. ----
extern "C" {

int radixlm_int8_group_size() { return kGroup; }

// q [M, ng * group] uint8, scale [M, ng] float32.
int radixlm_quantize_groups(int dtype, const void* x, int64_t x_stride, int64_t M, int K, int ng, uint8_t* q,
                            float* scale, int nthreads) {
  if ((int64_t)ng * kGroup < K) return -2;
  if (dtype == 0)
    quantize_groups<float>((const float*)x, x_stride, M, K, ng, q, scale, nthreads);
  else
    quantize_groups<uint16_t>((const uint16_t*)x, x_stride, M, K, ng, q, scale, nthreads);
  return 0;
}

int radixlm_int8_linear_available() {
#ifdef RADIXLM_INT8_GEMM
  return 1;
#else
  return 0;
#endif
}

}  // extern "C"

namespace {
// x dtype and out dtype (bias too) each 0 = float32, 1 = bfloat16. -1: built without VNNI.
// norm: a NormIn of x's type (x = its normed rows), or null.
template <bool kSilu>
int int8_linear_call(int x_dtype, const void* x, int64_t x_stride, int64_t M, int K, const int8_t* packed,
                     const int32_t* comp, const float* w_scale, int N, int out_dtype, const void* bias, void* out,
                     int64_t out_stride, int nthreads, const void* norm = nullptr) {
#ifdef RADIXLM_INT8_GEMM
#define RADIXLM_CALL(TI, TO)                                                                                \
  int8_linear<TI, TO, kSilu>((const TI*)x, x_stride, M, K, packed, comp, w_scale, N, (const TO*)bias, (TO*)out, \
                             out_stride, nthreads, (const NormIn<TI>*)norm)
  if (x_dtype == 0 && out_dtype == 0) RADIXLM_CALL(float, float);
  else if (x_dtype == 0) RADIXLM_CALL(float, uint16_t);
  else if (out_dtype == 0) RADIXLM_CALL(uint16_t, float);
  else RADIXLM_CALL(uint16_t, uint16_t);
#undef RADIXLM_CALL
  return 0;
#else
  return -1;
#endif
}
}  // namespace

extern "C" {

int radixlm_int8_linear(int x_dtype, const void* x, int64_t x_stride, int64_t M, int K, const int8_t* packed,
                        const int32_t* comp, const float* w_scale, int N, int out_dtype, const void* bias,
                        void* out, int64_t out_stride, int nthreads) {
  return int8_linear_call<false>(x_dtype, x, x_stride, M, K, packed, comp, w_scale, N, out_dtype, bias, out,
                                 out_stride, nthreads);
}

// The first column of each row's largest value (torch.argmax over the float32 output of
// int8_linear, NaN first) of columns 0 .. N - 1, without the [M, N] output: for greedy
// sampling off an LM head (32 x 49,152 float32 logits are 6.3 MB written and read again).
// No bias. ids: int64 [M]. -1: built without the int8 GEMM.
int radixlm_int8_linear_argmax(int x_dtype, const void* x, int64_t x_stride, int64_t M, int K, const int8_t* packed,
                               const int32_t* comp, const float* w_scale, int N, int64_t* ids, int nthreads) {
#ifdef RADIXLM_INT8_GEMM
  if (M <= 0) return 0;
  if (N <= 0) return -2;
  radixlm::argmax_by_rows(M, nthreads, ids, [&](RowBest* best, int nt) {
    if (x_dtype == 0)
      int8_linear<float, float, false, true>((const float*)x, x_stride, M, K, packed, comp, w_scale, N, nullptr,
                                             nullptr, 0, nt, nullptr, best);
    else
      int8_linear<uint16_t, float, false, true>((const uint16_t*)x, x_stride, M, K, packed, comp, w_scale, N,
                                                nullptr, nullptr, 0, nt, nullptr, best);
  });
  return 0;
#else
  (void)x_dtype; (void)x; (void)x_stride; (void)M; (void)K; (void)packed; (void)comp; (void)w_scale; (void)N;
  (void)ids; (void)nthreads;
  return -1;
#endif
}

// The gate_up weight in int8_linear_silu's layout (N = 2I, whole 32-column tiles), bias (if
// any) and w_scale in that order too; out [M, N / 2] of out_dtype. -2: N not whole tiles.
int radixlm_int8_linear_silu(int x_dtype, const void* x, int64_t x_stride, int64_t M, int K, const int8_t* packed,
                             const int32_t* comp, const float* w_scale, int N, int out_dtype, const void* bias,
                             void* out, int64_t out_stride, int nthreads) {
  if (N % 32 != 0) return -2;
  return int8_linear_call<true>(x_dtype, x, x_stride, M, K, packed, comp, w_scale, N, out_dtype, bias, out,
                                out_stride, nthreads);
}

// int8_linear (silu = 0) or int8_linear_silu (silu = 1) of the rows of normed [M, K] (dtype
// x_dtype, as h, residual and w), which it first fills with add_rmsnorm(h, residual, w, eps):
// residual [M, K] (contiguous) += h, or null for h alone. K <= kMaxNormRow.
int radixlm_int8_linear_norm(int x_dtype, const void* h, int64_t h_stride, void* residual, const void* w, float eps,
                             void* normed, int64_t M, int K, const int8_t* packed, const int32_t* comp,
                             const float* w_scale, int N, int out_dtype, const void* bias, void* out,
                             int64_t out_stride, int silu, int nthreads) {
  if (K > radixlm::kMaxNormRow || (silu && N % 32 != 0)) return -2;
#ifdef RADIXLM_INT8_GEMM
  NormIn<float> nf{(const float*)h, h_stride, (float*)residual, (const float*)w, eps, (float*)normed};
  NormIn<uint16_t> nb{(const uint16_t*)h, h_stride, (uint16_t*)residual, (const uint16_t*)w, eps, (uint16_t*)normed};
  const void* norm = x_dtype == 0 ? (const void*)&nf : (const void*)&nb;
  return silu ? int8_linear_call<true>(x_dtype, normed, K, M, K, packed, comp, w_scale, N, out_dtype, bias, out,
                                       out_stride, nthreads, norm)
              : int8_linear_call<false>(x_dtype, normed, K, M, K, packed, comp, w_scale, N, out_dtype, bias, out,
                                        out_stride, nthreads, norm);
#else
  return -1;
#endif
}

}  // extern "C"

// The int8 KV cache (--kv-cache-dtype int8, radixlm/srt/model_runner/kv_pool.py): K and V
// stored as int8 with one float32 scale per (slot, KV head), symmetric over head_dim.
//   store_kv_int8:         quantizes new tokens' K/V rows into the pool, bit-identical to
//                          kv_pool.quantize_kv (same rounding: x * (127 / amax) in float32,
//                          round half to even; both constants rounded once from double).
//   decode_attention_int8: decode-style attention (one query row per request) over them.
//   gather_dequant:        rows back in float32/bf16 for the torch paths, as kv_pool.dequantize_kv.
// Why: decode attention streams every cached key and value once per step; int8 halves the
// bytes (and twice the tokens fit in the same memory).
//
// Scores: the query is quantized per head to int8 as well (llama.cpp does the same for its
// q8_0 K cache), so q . k over 64 dims is 16 vpdpbusd lanes: the key bytes flipped to
// unsigned (k + 128, an XOR of the sign bit) times the signed query, minus 128 * sum(q) of
// the head, then times q_scale * k_scale * softmax scale. A 16-key block's rows are
// transposed once per KV head (a vector per 4 dimensions, a lane per key) and shared by its
// query heads. P @ V in float32: each value row is widened to float once for up to four
// query heads at a time, with the value scales folded into the probabilities.
// (Tried: the probabilities as int16 against the chunk's largest and two keys per vpdpwssd,
// 1.04-1.09x on the kernel, but ~1e-4 relative error per call on the default model's inputs
// moved the teacher-forced logits by a KL of up to 0.02 against the float kernel.)
//
// On AVX2 + FMA without AVX-512 (RADIXLM_KV_INT8_AVX2) the same scheme in 8-lane vectors:
// q . k by the sign trick of quant_ops.cpp (vpmaddubsw of |q| and k with q's sign, then
// vpmaddwd against ones: exact, no +128 correction needed), 8 keys' sums reduced at once,
// P @ V in float over 16 dims at a time for up to 4 query heads (decode_tasks.h's AVX2
// helpers, shared with the float/bf16 kernel).

#include <omp.h>
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define RADIXLM_KV_INT8 1
#endif
#include "avx2.h"
#if defined(RADIXLM_AVX2)
#define RADIXLM_KV_INT8_AVX2 1
#endif
#include <stdint.h>
#include <math.h>
#include <string.h>
#include <algorithm>

#include "bf16.h"
#include "decode_tasks.h"

namespace {

using radixlm::kMaxGroup;
using radixlm::kNoMax;
using radixlm::to_f;

// Same reasoning as cpu_ops.cpp: a decode batch's store is microseconds of work.
constexpr int64_t kParallelMin = 1 << 17;

// One row of D values -> int8 q and its scale (amax / 127); an all-zero row gives 0s.
template <typename T>
float quantize_row(const T* x, int D, int8_t* q) {
  float amax = 0.f;
  for (int d = 0; d < D; ++d) amax = fmaxf(amax, fabsf(to_f(x[d])));
  // In double, rounded once: -ffast-math may turn a float division into a reciprocal
  // estimate, and these two numbers must equal the correctly rounded float32 ones.
  const float inv = amax > 0.f ? (float)(127.0 / (double)amax) : 0.f;
  for (int d = 0; d < D; ++d) q[d] = (int8_t)fminf(127.f, fmaxf(-127.f, nearbyintf(to_f(x[d]) * inv)));
  return (float)((double)amax / 127.0);
}

// rows of k/v [n, Hkv, D] (token row strides given) -> kq/vq [slots, Hkv, D] int8 and
// ks/vs [slots, Hkv] float32 at slots loc.
template <typename T>
void store_kv_int8(const T* k, int64_t k_stride, const T* v, int64_t v_stride, int8_t* kq, int8_t* vq, float* ks,
                   float* vs, const int64_t* loc, int64_t n, int Hkv, int D, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (n * Hkv * D >= kParallelMin)
  for (int64_t i = 0; i < n * Hkv; ++i) {
    const int64_t t = i / Hkv;
    const int h = (int)(i % Hkv);
    const int64_t dst = loc[t] * Hkv + h;
    ks[dst] = quantize_row(k + t * k_stride + (int64_t)h * D, D, kq + dst * D);
    vs[dst] = quantize_row(v + t * v_stride + (int64_t)h * D, D, vq + dst * D);
  }
}

// out[i] = q[idx[i]] * scale[idx[i]] (per head), rounded once to T: kv_pool.dequantize_kv of
// the gathered rows. For the torch paths (a shared prefix's GEMM, long extends).
template <typename T>
void gather_dequant(const int8_t* q, const float* scale, const int64_t* idx, int64_t n, int Hkv, int D, T* out,
                    int nthreads) {
  using radixlm::from_f;
#pragma omp parallel for num_threads(nthreads) if (n * Hkv * D >= kParallelMin)
  for (int64_t i = 0; i < n * Hkv; ++i) {
    const int64_t t = i / Hkv;
    const int h = (int)(i % Hkv);
    const int64_t src = idx[t] * Hkv + h;
    const float s = scale[src];
    const int8_t* qr = q + src * D;
    T* o = out + i * D;
    for (int d = 0; d < D; ++d) o[d] = from_f<T>((float)qr[d] * s);
  }
}

#ifdef RADIXLM_KV_INT8
// r[j] (16 dwords each) -> r[i] lane j = the old r[j] lane i: a 16 x 16 transpose of dwords
// in four rounds of two-input shuffles (pairs of dwords, of quadwords, then 128-bit lanes).
inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // u[4i + k], 128-bit lane L: rows 4i..4i+3, each its dword 4L + k
  __m512i u[16];
  for (int i = 0; i < 4; ++i) {
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int k = 0; k < 4; ++k) {
    const __m512i v01 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x44), w01 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x44);
    const __m512i v23 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xEE), w23 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xEE);
    r[k] = _mm512_shuffle_i32x4(v01, w01, 0x88);
    r[4 + k] = _mm512_shuffle_i32x4(v01, w01, 0xDD);
    r[8 + k] = _mm512_shuffle_i32x4(v23, w23, 0x88);
    r[12 + k] = _mm512_shuffle_i32x4(v23, w23, 0xDD);
  }
}

// Keys per softmax step: scores of a whole chunk are computed first, then one max / exp /
// sum pass and one rescale of the accumulators per chunk. Per 16-key block (the bf16
// kernel's structure) the serial max -> exp -> sum chain of every query head dominated.
constexpr int kChunk = 128;

// Query heads whose P @ V accumulators stay in registers together: GN * 4 * NC zmm
// accumulators + 4 * NC widened values + a broadcast fit the 32 registers.
template <int NC>
constexpr int pv_tile() { return NC == 1 ? 4 : NC == 2 ? 2 : 1; }

// acc[GN][D] += sum over the chunk's keys j < nc of w[g][j] * value row j (int8, widened
// to float once per key for all GN heads); vbuf points at the KV head in slot 0.
template <int NC, int GN>
inline void pv_heads(const int8_t* vbuf, int64_t row, const int64_t* slot, int nc, const float (*w)[kChunk],
                     float* acc) {
  constexpr int V = 4 * NC;  // 16-float vectors per head_dim
  __m512 o[GN][V];
  for (int g = 0; g < GN; ++g)
    for (int c = 0; c < V; ++c) o[g][c] = _mm512_loadu_ps(acc + g * 64 * NC + 16 * c);
  for (int j = 0; j < nc; ++j) {
    const int8_t* vr = vbuf + slot[j] * row;
    __m512 x[V];
    for (int c = 0; c < V; ++c)
      x[c] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(vr + 16 * c))));
    for (int g = 0; g < GN; ++g) {
      const __m512 p = _mm512_set1_ps(w[g][j]);
      for (int c = 0; c < V; ++c) o[g][c] = _mm512_fmadd_ps(p, x[c], o[g][c]);
    }
  }
  for (int g = 0; g < GN; ++g)
    for (int c = 0; c < V; ++c) _mm512_storeu_ps(acc + g * 64 * NC + 16 * c, o[g][c]);
}

// H consecutive KV heads (G query heads each, H * G <= kMaxGroup) of one request over its
// keys [k0, k1): kbuf/vbuf/ksc/vsc point at the first of the H heads of slot 0; a slot's
// row is Hkv * D bytes (Hkv scales). Leaves acc [H*G][D] unnormalised, m and l.
template <typename T, int NC>  // D = 64 * NC
void attend_range_int8(const T* q, float scale, int G, int H, int Hkv, const int8_t* kbuf, const int8_t* vbuf,
                       const float* ksc, const float* vsc, const int64_t* idx, int64_t k0, int64_t k1,
                       float* acc, float* m, float* l) {
  constexpr int D = 64 * NC;
  const int HG = H * G;
  const int64_t row = (int64_t)Hkv * D;
  alignas(64) int8_t q8[kMaxGroup][D];
  float qscale[kMaxGroup];
  int32_t qcorr[kMaxGroup];
  for (int g = 0; g < HG; ++g) {
    qscale[g] = quantize_row(q + (int64_t)g * D, D, q8[g]) * scale;
    int32_t sum = 0;
    for (int d = 0; d < D; ++d) sum += q8[g][d];
    qcorr[g] = 128 * sum;
    m[g] = kNoMax;
    l[g] = 0.f;
    for (int d = 0; d < D; ++d) acc[g * D + d] = 0.f;
  }
  const __m512i flip = _mm512_set1_epi8((char)0x80);
  int64_t slot[kChunk];
  alignas(64) float sk[kMaxGroup][kChunk], sv[kMaxGroup][kChunk];
  alignas(64) float sc[kMaxGroup][kChunk];  // scores, then probabilities times the value scale
  for (int64_t j = k0; j < std::min<int64_t>(k1, k0 + 32); ++j) radixlm::prefetch_bytes(kbuf + idx[j] * row, (int64_t)H * D);
  for (int64_t c0 = k0; c0 < k1; c0 += kChunk) {
    const int nc = (int)std::min<int64_t>(kChunk, k1 - c0);
    const int nb = (nc + 15) / 16;  // 16-key blocks; keys nc.. of the last are padding
    for (int j = 0; j < nb * 16; ++j) {
      slot[j] = idx[c0 + (j < nc ? j : 0)];
      for (int h = 0; h < H; ++h) {
        sk[h][j] = ksc[slot[j] * Hkv + h];
        sv[h][j] = j < nc ? vsc[slot[j] * Hkv + h] : 0.f;  // padding keys add nothing
      }
    }
    // Scores: per 16-key block and KV head, the 16 key rows are loaded once, transposed
    // (a vector per 4 dimensions, a lane per key) and shared by the head's G query heads,
    // each a vpdpbusd per 4 dimensions against its query's 4 bytes broadcast, with no
    // horizontal sums. Integer sums, so the scores equal the per-row dot products exactly.
    __m512 mxv[kMaxGroup];
    for (int g = 0; g < HG; ++g) mxv[g] = _mm512_set1_ps(kNoMax);
    for (int blk = 0; blk < nb; ++blk) {
      const __mmask16 valid = radixlm::valid16(nc, blk);
      for (int h = 0; h < H; ++h) {
        // Scattered rows (see attend_range_bf16 in cpu_ops.cpp): keys 32 ahead, and this
        // block's values, used after the chunk's scores; the block's fetches are split over
        // its KV heads' passes so they do not fill the miss buffers in one burst ahead of
        // the scores' loads.
        const int64_t jb = c0 + 16 * blk, n = std::min<int64_t>(k1, jb + 16) - jb;
        for (int64_t j = jb + n * h / H, j1 = jb + n * (h + 1) / H; j < j1; ++j) {
          if (j + 32 < k1) radixlm::prefetch_bytes(kbuf + idx[j + 32] * row, (int64_t)H * D);
          radixlm::prefetch_bytes(vbuf + idx[j] * row, (int64_t)H * D);
        }
        __m512i dot[kMaxGroup];
        for (int gi = 0; gi < G; ++gi) dot[gi] = _mm512_setzero_si512();
        for (int c = 0; c < NC; ++c) {
          __m512i t[16];
          for (int j = 0; j < 16; ++j)
            t[j] = _mm512_xor_si512(_mm512_loadu_si512(kbuf + slot[16 * blk + j] * row + (int64_t)h * D + 64 * c), flip);
          transpose16(t);
          for (int gi = 0; gi < G; ++gi) {
            int32_t qd[16];
            memcpy(qd, q8[h * G + gi] + 64 * c, 64);
            __m512i a0 = dot[gi], a1 = _mm512_setzero_si512(), a2 = a1, a3 = a1;  // four chains
            for (int i = 0; i < 16; i += 4) {
              a0 = _mm512_dpbusd_epi32(a0, t[i], _mm512_set1_epi32(qd[i]));
              a1 = _mm512_dpbusd_epi32(a1, t[i + 1], _mm512_set1_epi32(qd[i + 1]));
              a2 = _mm512_dpbusd_epi32(a2, t[i + 2], _mm512_set1_epi32(qd[i + 2]));
              a3 = _mm512_dpbusd_epi32(a3, t[i + 3], _mm512_set1_epi32(qd[i + 3]));
            }
            dot[gi] = _mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3));
          }
        }
        const __m512 skv = _mm512_load_ps(sk[h] + 16 * blk);
        for (int gi = 0; gi < G; ++gi) {
          const int g = h * G + gi;
          const __m512 s = _mm512_mul_ps(
              _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(dot[gi], _mm512_set1_epi32(qcorr[g]))),
                            _mm512_set1_ps(qscale[g])),
              skv);
          const __m512 sm = _mm512_mask_mov_ps(_mm512_set1_ps(kNoMax), valid, s);
          _mm512_store_ps(sc[g] + 16 * blk, sm);
          mxv[g] = _mm512_max_ps(mxv[g], sm);
        }
      }
    }
    for (int g = 0; g < HG; ++g) {
      const int h = g / G;
      const __m512 mx = mxv[g];
      const float bm = std::max(m[g], _mm512_reduce_max_ps(mx));
      const float corr = expf(m[g] - bm);  // 0 on the first chunk
      const __m512 vbm = _mm512_set1_ps(bm);
      __m512 sum = _mm512_setzero_ps();
      for (int blk = 0; blk < nb; ++blk) {
        const __m512 p = radixlm::exp512(_mm512_sub_ps(_mm512_load_ps(sc[g] + 16 * blk), vbm));
        const __m512 pv = _mm512_mul_ps(p, _mm512_load_ps(sv[h] + 16 * blk));  // 0 for padding
        sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(radixlm::valid16(nc, blk), p));
        _mm512_store_ps(sc[g] + 16 * blk, pv);
      }
      l[g] = l[g] * corr + _mm512_reduce_add_ps(sum);
      m[g] = bm;
      if (corr != 1.f) {
        const __m512 vc = _mm512_set1_ps(corr);
        for (int c = 0; c < D / 16; ++c)
          _mm512_storeu_ps(acc + g * D + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(acc + g * D + 16 * c), vc));
      }
    }
    for (int h = 0; h < H; ++h)
      for (int g0 = h * G; g0 < (h + 1) * G; g0 += pv_tile<NC>())
        switch (std::min(pv_tile<NC>(), (h + 1) * G - g0)) {
          case 1: pv_heads<NC, 1>(vbuf + (int64_t)h * D, row, slot, nc, sc + g0, acc + (int64_t)g0 * D); break;
          case 2: pv_heads<NC, 2>(vbuf + (int64_t)h * D, row, slot, nc, sc + g0, acc + (int64_t)g0 * D); break;
          case 3: pv_heads<NC, 3>(vbuf + (int64_t)h * D, row, slot, nc, sc + g0, acc + (int64_t)g0 * D); break;
          default: pv_heads<NC, 4>(vbuf + (int64_t)h * D, row, slot, nc, sc + g0, acc + (int64_t)g0 * D); break;
        }
  }
}

#endif  // RADIXLM_KV_INT8

#ifdef RADIXLM_KV_INT8_AVX2
using radixlm::kChunkAvx2;

// attend_range_int8 of the AVX-512 kernel, same contract and arithmetic, in 8-key blocks.
template <typename T, int NC>  // D = 64 * NC
void attend_range_int8(const T* q, float scale, int G, int H, int Hkv, const int8_t* kbuf, const int8_t* vbuf,
                       const float* ksc, const float* vsc, const int64_t* idx, int64_t k0, int64_t k1,
                       float* acc, float* m, float* l) {
  constexpr int D = 64 * NC, V = D / 32;  // V: 32-byte vectors per head row
  const int HG = H * G;
  const int64_t row = (int64_t)Hkv * D;
  __m256i qs8[kMaxGroup][V], qabs[kMaxGroup][V];
  float qscale[kMaxGroup];
  for (int g = 0; g < HG; ++g) {
    alignas(32) int8_t q8[D];
    qscale[g] = quantize_row(q + (int64_t)g * D, D, q8) * scale;
    for (int c = 0; c < V; ++c) {
      qs8[g][c] = _mm256_load_si256((const __m256i*)(q8 + 32 * c));
      qabs[g][c] = _mm256_abs_epi8(qs8[g][c]);
    }
    m[g] = kNoMax;
    l[g] = 0.f;
    for (int d = 0; d < D; ++d) acc[g * D + d] = 0.f;
  }
  const __m256i ones = _mm256_set1_epi16(1);
  int64_t slot[kChunkAvx2];
  alignas(32) float sk[kMaxGroup][kChunkAvx2], sv[kMaxGroup][kChunkAvx2];
  alignas(32) float sc[kMaxGroup][kChunkAvx2];  // scores, then probabilities times the value scale
  for (int64_t j = k0; j < std::min<int64_t>(k1, k0 + 32); ++j) radixlm::prefetch_bytes(kbuf + idx[j] * row, (int64_t)H * D);
  for (int64_t c0 = k0; c0 < k1; c0 += kChunkAvx2) {
    const int nc = (int)std::min<int64_t>(kChunkAvx2, k1 - c0);
    const int nb = (nc + 7) / 8;  // 8-key blocks; keys nc.. of the last are padding
    for (int j = 0; j < nb * 8; ++j) {
      slot[j] = idx[c0 + (j < nc ? j : 0)];
      for (int h = 0; h < H; ++h) {
        sk[h][j] = ksc[slot[j] * Hkv + h];
        sv[h][j] = j < nc ? vsc[slot[j] * Hkv + h] : 0.f;  // padding keys add nothing
      }
    }
    for (int g = 0; g < HG; ++g) {
      const int h = g / G;
      const __m256 qsv = _mm256_set1_ps(qscale[g]);
      for (int blk = 0; blk < nb; ++blk) {
        if (g == 0) {
          for (int64_t j = c0 + 8 * blk, j1 = std::min<int64_t>(k1, j + 8); j < j1; ++j) {
            if (j + 32 < k1) radixlm::prefetch_bytes(kbuf + idx[j + 32] * row, (int64_t)H * D);
            radixlm::prefetch_bytes(vbuf + idx[j] * row, (int64_t)H * D);
          }
        }
        __m256i a[8];
        for (int j = 0; j < 8; ++j) {
          const int8_t* kr = kbuf + slot[8 * blk + j] * row + (int64_t)h * D;
          a[j] = _mm256_setzero_si256();
          for (int c = 0; c < V; ++c) {
            const __m256i k8 = _mm256_loadu_si256((const __m256i*)(kr + 32 * c));
            a[j] = _mm256_add_epi32(a[j], _mm256_madd_epi16(
                _mm256_maddubs_epi16(qabs[g][c], _mm256_sign_epi8(k8, qs8[g][c])), ones));
          }
        }
        const __m256 s = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(radixlm::hsum8x8i(a)), qsv),
                                       _mm256_load_ps(sk[h] + 8 * blk));
        _mm256_store_ps(sc[g] + 8 * blk, _mm256_blendv_ps(_mm256_set1_ps(kNoMax), s, radixlm::valid8(nc, blk)));
      }
      radixlm::softmax_chunk(sc[g], sv[h], nc, D, m[g], l[g], acc + g * D);
    }
    radixlm::pv_chunk<int8_t, D>(vbuf, row, slot, nc, sc, G, H, acc);
  }
}
#endif  // RADIXLM_KV_INT8_AVX2

#if defined(RADIXLM_KV_INT8) || defined(RADIXLM_KV_INT8_AVX2)
template <typename T, int NC>
void decode_attention_int8(const T* q, int64_t q_stride, const int8_t* kbuf, const int8_t* vbuf, const float* ksc,
                           const float* vsc, const int64_t* indptr, const int64_t* indices, T* out,
                           int64_t out_stride, float* lse, int B, int Hq, int Hkv, float scale, int nthreads) {
  constexpr int D = 64 * NC;
  const int G = Hq / Hkv;
  const int H = radixlm::heads_per_task(Hkv, G);
  radixlm::run_decode_tasks<T, D>(indptr, out, out_stride, lse, B, Hq, Hkv, H, nthreads,
                                  [&](int b, int kvh0, int64_t k0, int64_t k1, float* acc, float* m, float* l) {
    attend_range_int8<T, NC>(q + b * q_stride + (int64_t)kvh0 * G * D, scale, G, H, Hkv, kbuf + (int64_t)kvh0 * D,
                             vbuf + (int64_t)kvh0 * D, ksc + kvh0, vsc + kvh0, indices + indptr[b], k0, k1, acc,
                             m, l);
  });
}

template <typename T>
int decode_int8_dispatch(const void* q, int64_t q_stride, const int8_t* k, const int8_t* v, const float* ks,
                         const float* vs, const int64_t* indptr, const int64_t* indices, void* out,
                         int64_t out_stride, float* lse, int B, int Hq, int Hkv, int D, float scale, int nthreads) {
  if (Hkv <= 0 || Hq % Hkv || Hq / Hkv > kMaxGroup) return -1;
#define RADIXLM_DECODE_I8(NC)                                                                                \
  case 64 * NC:                                                                                              \
    decode_attention_int8<T, NC>((const T*)q, q_stride, k, v, ks, vs, indptr, indices, (T*)out, out_stride, \
                                 lse, B, Hq, Hkv, scale, nthreads);                                          \
    return 0;
  switch (D) {
    RADIXLM_DECODE_I8(1)
    RADIXLM_DECODE_I8(2)
    RADIXLM_DECODE_I8(4)
    default:
      return -2;
  }
#undef RADIXLM_DECODE_I8
}
#endif  // RADIXLM_KV_INT8 || RADIXLM_KV_INT8_AVX2

}  // namespace

// ---- C ABI: dtype 0 = float32, 1 = bfloat16 (of q/out, of k/v for the store). ----
extern "C" {

int radixlm_store_kv_int8(int dtype, const void* k, int64_t k_stride, const void* v, int64_t v_stride, int8_t* kq,
                          int8_t* vq, float* ks, float* vs, const int64_t* loc, int64_t n, int Hkv, int D,
                          int nthreads) {
  if (dtype == 0)
    store_kv_int8<float>((const float*)k, k_stride, (const float*)v, v_stride, kq, vq, ks, vs, loc, n, Hkv, D,
                         nthreads);
  else
    store_kv_int8<uint16_t>((const uint16_t*)k, k_stride, (const uint16_t*)v, v_stride, kq, vq, ks, vs, loc, n,
                            Hkv, D, nthreads);
  return 0;
}

int radixlm_gather_dequant_int8(int dtype, const int8_t* q, const float* scale, const int64_t* idx, int64_t n,
                                int Hkv, int D, void* out, int nthreads) {
  if (dtype == 0)
    gather_dequant<float>(q, scale, idx, n, Hkv, D, (float*)out, nthreads);
  else
    gather_dequant<uint16_t>(q, scale, idx, n, Hkv, D, (uint16_t*)out, nthreads);
  return 0;
}

// Head dims the int8 decode kernel is instantiated for (0 when built without AVX512-VNNI or AVX2).
int radixlm_decode_int8_supports(int D) {
#if defined(RADIXLM_KV_INT8) || defined(RADIXLM_KV_INT8_AVX2)
  return D == 64 || D == 128 || D == 256;
#else
  (void)D;
  return 0;
#endif
}

// Nonzero return: unsupported (shape, or a build without AVX512-VNNI).
int radixlm_decode_attention_int8(int dtype, const void* q, int64_t q_stride, const int8_t* k, const int8_t* v,
                                  const float* ks, const float* vs, const int64_t* indptr, const int64_t* indices,
                                  void* out, int64_t out_stride, float* lse, int B, int Hq, int Hkv, int D,
                                  float scale, int nthreads) {
#if defined(RADIXLM_KV_INT8) || defined(RADIXLM_KV_INT8_AVX2)
  if (dtype == 0)
    return decode_int8_dispatch<float>(q, q_stride, k, v, ks, vs, indptr, indices, out, out_stride, lse, B, Hq,
                                       Hkv, D, scale, nthreads);
  return decode_int8_dispatch<uint16_t>(q, q_stride, k, v, ks, vs, indptr, indices, out, out_stride, lse, B, Hq,
                                        Hkv, D, scale, nthreads);
#else
  (void)dtype; (void)q; (void)q_stride; (void)k; (void)v; (void)ks; (void)vs; (void)indptr; (void)indices;
  (void)out; (void)out_stride; (void)lse; (void)B; (void)Hq; (void)Hkv; (void)D; (void)scale; (void)nthreads;
  return -1;
#endif
}

}  // extern "C"

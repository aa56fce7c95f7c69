// Fused CPU kernels for the decode hot path: decode attention over the token-granular
// KV pool, RoPE, residual-add + RMSNorm, SiLU*mul and the KV store.
//
// Why native code: at batch 1-32 on a small model every torch op costs 5-100 us of
// dispatch, allocation and oneDNN set-up, and decode attention as batched GEMMs either
// gathers K/V into a padded block or wastes FLOPs on a block-diagonal query. Here each op
// is one pass over its data, parallel with the OpenMP runtime torch already loaded
// (same libgomp soname, so the same thread pool), vectorised by the compiler
// (-O3 -march=native -ffast-math), accumulating in float32.
//
// Element types: T = float (float32) or uint16_t (bfloat16 bits), converted by bf16.h.
// Built and loaded by radixlm/kernels/cpu/build.py; called through ctypes (ops.py).

#include <omp.h>
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#endif
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <algorithm>
#include <type_traits>
#include <vector>

#include "avx2.h"
#include "bf16.h"
#include "decode_tasks.h"
#include "rowwise_avx512.h"
#include "row_spans.h"

namespace {

using radixlm::from_f;
using radixlm::to_f;

using radixlm::kMaxGroup;
using radixlm::kMaxDim;
using radixlm::kNoMax;
constexpr int kBlock = 32;      // keys scored per online-softmax step
// Elementwise ops on fewer elements than this run on one thread: a decode batch's norm or
// SiLU is ~10 us of work, less than waking a second thread, and a fork/join waits for the
// slowest thread, which costs milliseconds when another process holds that core.
constexpr int64_t kParallelMin = 1 << 17;

// One (request, KV head, key range) task of decode attention: G query rows (q, D apart)
// against keys [k0, k1) of the request, online softmax. Leaves unnormalised acc [G][D],
// running max m and running sum l (so split ranges can be merged exactly).
template <typename T, int D>
void attend_range(const T* q, float scale, int G, const T* kbuf, const T* vbuf, const int64_t* idx,
                  int64_t k0, int64_t k1, int64_t row_stride, float* acc, float* m, float* l) {
  float qf[kMaxGroup * D];
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < D; ++d) qf[g * D + d] = to_f(q[g * D + d]) * scale;
  float s[kMaxGroup][kBlock];
  for (int g = 0; g < G; ++g) {
    m[g] = kNoMax;
    l[g] = 0.f;
    for (int d = 0; d < D; ++d) acc[g * D + d] = 0.f;
  }
  for (int64_t b0 = k0; b0 < k1; b0 += kBlock) {
    const int n = (int)std::min<int64_t>(kBlock, k1 - b0);
    for (int j = 0; j < n; ++j) {
      const T* kp = kbuf + idx[b0 + j] * row_stride;
      for (int g = 0; g < G; ++g) {
        const float* qg = qf + g * D;
        float dot = 0.f;
        for (int d = 0; d < D; ++d) dot += qg[d] * to_f(kp[d]);
        s[g][j] = dot;
      }
    }
    for (int g = 0; g < G; ++g) {
      float bm = m[g];
      for (int j = 0; j < n; ++j) bm = std::max(bm, s[g][j]);
      const float corr = expf(m[g] - bm);  // underflows to 0 on the first block
      float sum = 0.f;
      for (int j = 0; j < n; ++j) {
        const float p = expf(s[g][j] - bm);
        s[g][j] = p;
        sum += p;
      }
      l[g] = l[g] * corr + sum;
      m[g] = bm;
      float* ag = acc + g * D;
      for (int d = 0; d < D; ++d) ag[d] *= corr;
    }
    for (int j = 0; j < n; ++j) {
      const T* vp = vbuf + idx[b0 + j] * row_stride;
      for (int g = 0; g < G; ++g) {
        const float p = s[g][j];
        float* ag = acc + g * D;
        for (int d = 0; d < D; ++d) ag[d] += p * to_f(vp[d]);
      }
    }
  }
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
using radixlm::exp512;
using radixlm::hsum16;

// bf16 decode attention on AVX512-BF16 dot products (Zen 4, Sapper Rapids and later).
// Scores: per key, D/32 vdpbf16ps against the (unscaled, exact) bf16 query, then 16 keys'
// lane vectors are summed horizontally at once by a transpose-add tree (hsum16), so no
// per-key horizontal reduction. P @ V: consecutive keys' V rows are interleaved in
// 16-bit pairs so one vdpbf16ps adds p_j * v_j + p_j+1 * v_j+1 for 16 dims; P is rounded
// to bf16 for this (as GPU flash attention does), accumulation stays float32.

// Query heads whose P @ V accumulators stay in registers together (GN * 2 * NC zmm, plus
// 2 * NC interleaved values and a broadcast, within the 32 registers); with the
// accumulators in memory, every vdpbf16ps was a load and a store too.
template <int NC>
constexpr int pv_tile_bf16() { return NC <= 2 ? 4 : NC == 4 ? 2 : 1; }

// Keys per softmax step: a chunk's scores first, then one max / exp / sum pass and one rescale
// of the accumulators per query head, then P @ V of the chunk (kv_int8_ops.cpp's structure).
// Per 16-key block each query head ran its serial reduce-max -> exp -> reduce-sum chain once
// per block. Batch 32, 30 layers: 1,024 keys 53 -> 51 ms interleaved, 60 -> 53 contiguous;
// 200 keys 12.0 ms either way interleaved, 14.0 -> 12.7 contiguous.
constexpr int kChunkBf16 = 128;
constexpr int kAheadBf16 = 32;  // keys between the block being scored and the block being fetched

// acc[GN][2 * NC] += P @ V over a chunk's n keys (rows idx[0..n) of vbuf, which points at
// the KV head in slot 0), weights p[g][j] in bf16 (p[g][n] is 0 when n is odd); consecutive
// keys' value rows are interleaved in 16-bit pairs so one vdpbf16ps adds p_j * v_j + p_j+1 * v_j+1.

template <int NC, int GN>
inline void pv_bf16(const uint16_t* vbuf, int64_t row_stride, const int64_t* idx, int n,
                    const uint16_t (*p)[kChunkBf16], __m512* acc) {
  __m512 o[GN][2 * NC];
  for (int g = 0; g < GN; ++g)
    for (int c = 0; c < 2 * NC; ++c) o[g][c] = acc[g * 2 * NC + c];
  for (int j = 0; j < n; j += 2) {
    const uint16_t* v0 = vbuf + idx[j] * row_stride;
    const uint16_t* v1 = j + 1 < n ? vbuf + idx[j + 1] * row_stride : v0;  // its p is 0
    __m512i lo[NC], hi[NC];
    for (int c = 0; c < NC; ++c) {
      const __m512i x = _mm512_loadu_si512(v0 + c * 32), y = _mm512_loadu_si512(v1 + c * 32);
      lo[c] = _mm512_unpacklo_epi16(x, y);
      hi[c] = _mm512_unpackhi_epi16(x, y);
    }
    for (int g = 0; g < GN; ++g) {
      uint32_t pair;
      memcpy(&pair, &p[g][j], 4);  // (p_j, p_j+1) as a bf16 pair
      const __m512bh pp = (__m512bh)_mm512_set1_epi32((int)pair);
      for (int c = 0; c < NC; ++c) {
        o[g][2 * c] = _mm512_dpbf16_ps(o[g][2 * c], (__m512bh)lo[c], pp);
        o[g][2 * c + 1] = _mm512_dpbf16_ps(o[g][2 * c + 1], (__m512bh)hi[c], pp);
      }
    }
  }
  for (int g = 0; g < GN; ++g)
    for (int c = 0; c < 2 * NC; ++c) acc[g * 2 * NC + c] = o[g][c];
}

// H consecutive KV heads (G query heads each, H * G <= kMaxGroup) in one task: each key's
// row of the pool is then read whole and in order (H * D * 2 contiguous bytes), instead of
// one head's slice per task at the pool's row stride, which measured ~3x below DRAM speed.
template <int NC>  // D = 32 * NC
void attend_range_bf16(const uint16_t* q, float scale, int G, int H, const uint16_t* kbuf,
                       const uint16_t* vbuf, const int64_t* idx, int64_t k0, int64_t k1, int64_t row_stride,
                       float* out_acc, float* m, float* l) {
  constexpr int D = 32 * NC;
  const int HG = H * G;
  __m512bh qv[kMaxGroup][NC];
  __m512 acc[kMaxGroup][2 * NC];
  alignas(64) float sc[kMaxGroup][kChunkBf16];  // a chunk's scaled scores
  alignas(64) uint16_t pbh[kMaxGroup][kChunkBf16];  // its probabilities in bf16
  for (int g = 0; g < HG; ++g) {
    for (int c = 0; c < NC; ++c) qv[g][c] = (__m512bh)_mm512_loadu_si512(q + g * D + c * 32);
    for (int c = 0; c < 2 * NC; ++c) acc[g][c] = _mm512_setzero_ps();
    m[g] = kNoMax;
    l[g] = 0.f;
  }
  const __m512 vscale = _mm512_set1_ps(scale);
  // Decode tokens of concurrent requests interleave in the pool (one slot each per step),
  // so a long request's rows are batch rows apart: the hardware prefetchers lose them.
  // Fetching the rows two blocks ahead by index: batch 32, 1000 keys each, interleaved,
  // 78 -> 51 ms of attention per step (one block ahead: 72; contiguous rows: 43).
  // Each block's share (K rows, then V rows, of the block kAheadBf16 keys on) is issued a
  // part per query head while the block's scores are computed: issued at once, the 192
  // lines of a 16-key block filled the miss buffers and the scores' own loads waited behind
  // them, so loads and arithmetic did not overlap. Batch 32 x 200 keys, 30 layers, builds
  // alternated in one process: contiguous rows 9.5 -> 6.5 ms, interleaved 10.4 -> 9.1 (48 or
  // 64 keys ahead: slower).
  const int64_t row_bytes = (int64_t)H * D * sizeof(uint16_t);
  const bool aligned = row_bytes % 64 == 0 && row_stride * 2 % 64 == 0 && ((uintptr_t)kbuf | (uintptr_t)vbuf) % 64 == 0;
  const int lpr = (int)(aligned ? row_bytes / 64 : (row_bytes + 62) / 64 + 1);  // cache lines a row can span
  for (int64_t j = k0, j1 = std::min<int64_t>(k1, k0 + kAheadBf16); j < j1; ++j) {
    radixlm::prefetch_bytes(kbuf + idx[j] * row_stride, row_bytes);
    radixlm::prefetch_bytes(vbuf + idx[j] * row_stride, row_bytes);
  }
  for (int64_t c0 = k0; c0 < k1; c0 += kChunkBf16) {
    const int nc = (int)std::min<int64_t>(kChunkBf16, k1 - c0);
    const int nb = (nc + 15) / 16;  // 16-key blocks; keys nc.. of the last are padding
    for (int blk = 0; blk < nb; ++blk) {
      const int64_t b0 = c0 + 16 * blk;
      const int n = std::min(16, nc - 16 * blk);
      const int64_t a0 = b0 + kAheadBf16, an = std::max<int64_t>(0, std::min<int64_t>(16, k1 - a0));
      const int pf_total = (int)(2 * an * lpr);
      const __mmask16 valid = radixlm::valid16(nc, blk);
      const uint16_t* kr[16];
      for (int j = 0; j < 16; ++j) kr[j] = kbuf + idx[b0 + (j < n ? j : 0)] * row_stride;
      for (int g = 0; g < HG; ++g) {
        for (int li = pf_total * g / HG, le = pf_total * (g + 1) / HG; li < le; ++li) {
          const int r = li / lpr;
          const uint16_t* row = r < an ? kbuf + idx[a0 + r] * row_stride : vbuf + idx[a0 + r - an] * row_stride;
          __builtin_prefetch((const char*)((uintptr_t)row & ~(uintptr_t)63) + 64 * (li % lpr), 0,
                             RADIXLM_KV_PREFETCH_LOCALITY);
        }
        const int64_t hoff = (int64_t)(g / G) * D;
        __m512 a[16];
        for (int j = 0; j < 16; ++j) {
          a[j] = _mm512_setzero_ps();
          for (int c = 0; c < NC; ++c)
            a[j] = _mm512_dpbf16_ps(a[j], (__m512bh)_mm512_loadu_si512(kr[j] + hoff + c * 32), qv[g][c]);
        }
        _mm512_store_ps(sc[g] + 16 * blk,
                        _mm512_mask_mov_ps(_mm512_set1_ps(kNoMax), valid, _mm512_mul_ps(hsum16(a), vscale)));
      }
    }
    for (int g = 0; g < HG; ++g) {
      __m512 mx = _mm512_load_ps(sc[g]);
      for (int blk = 1; blk < nb; ++blk) mx = _mm512_max_ps(mx, _mm512_load_ps(sc[g] + 16 * blk));
      const float bm = std::max(m[g], _mm512_reduce_max_ps(mx));
      const float corr = expf(m[g] - bm);  // 0 on the first chunk
      const __m512 vbm = _mm512_set1_ps(bm);
      __m512 sum = _mm512_setzero_ps();
      for (int blk = 0; blk < nb; ++blk) {
        const __m512 p = _mm512_maskz_mov_ps(radixlm::valid16(nc, blk),
                                             exp512(_mm512_sub_ps(_mm512_load_ps(sc[g] + 16 * blk), vbm)));
        sum = _mm512_add_ps(sum, p);
        _mm256_store_si256((__m256i*)(pbh[g] + 16 * blk), (__m256i)_mm512_cvtneps_pbh(p));
      }
      l[g] = l[g] * corr + _mm512_reduce_add_ps(sum);
      m[g] = bm;
      if (corr != 1.f) {
        const __m512 vc = _mm512_set1_ps(corr);
        for (int c = 0; c < 2 * NC; ++c) acc[g][c] = _mm512_mul_ps(acc[g][c], vc);
      }
    }
    for (int h = 0; h < H; ++h)
      for (int g0 = h * G; g0 < (h + 1) * G; g0 += pv_tile_bf16<NC>())
        switch (std::min(pv_tile_bf16<NC>(), (h + 1) * G - g0)) {
          case 1: pv_bf16<NC, 1>(vbuf + h * D, row_stride, idx + c0, nc, pbh + g0, acc[g0]); break;
          case 2: pv_bf16<NC, 2>(vbuf + h * D, row_stride, idx + c0, nc, pbh + g0, acc[g0]); break;
          case 3: pv_bf16<NC, 3>(vbuf + h * D, row_stride, idx + c0, nc, pbh + g0, acc[g0]); break;
          default: pv_bf16<NC, 4>(vbuf + h * D, row_stride, idx + c0, nc, pbh + g0, acc[g0]); break;
        }
  }
  // Undo the interleave order: lane 4k+i of lo[c] is dim c*32 + 8k + i, of hi[c] dim c*32 + 8k + 4 + i.
  for (int g = 0; g < HG; ++g) {
    for (int c = 0; c < NC; ++c) {
      alignas(64) float tl[16], th[16];
      _mm512_store_ps(tl, acc[g][2 * c]);
      _mm512_store_ps(th, acc[g][2 * c + 1]);
      float* o = out_acc + g * D + c * 32;
      for (int k = 0; k < 4; ++k)
        for (int i = 0; i < 4; ++i) {
          o[8 * k + i] = tl[4 * k + i];
          o[8 * k + 4 + i] = th[4 * k + i];
        }
    }
  }
}
#endif

#if defined(RADIXLM_AVX2)
// Decode attention on AVX2 + FMA (no AVX-512: e.g. AMD Zen 3), float32 or bf16 pools. The
// structure of kv_int8_ops.cpp's kernel: scores of a 128-key chunk first (8 keys at a time,
// their lane sums reduced together by hsum8x8), one max / exp / sum pass per chunk, then
// P @ V 16 dims at a time. Each key row is widened once for up to 4 query heads of its KV
// head (bf16: a 16-bit shift per 8 values), and H KV heads share a task so that a pool row
// is read whole and in order; rows are prefetched by slot index (see attend_range_bf16).
using radixlm::kChunkAvx2;

// Scores of GN query heads (qf: scaled float queries, D apart) against 8 keys (rows kr[j])
// -> s[g][0..7].
template <typename T, int D, int GN>
inline void scores8_avx2(const float* qf, const T* const* kr, __m256* s) {
  alignas(32) float part[GN][8][8];
  for (int j = 0; j < 8; ++j) {
    __m256 a[GN];
    for (int g = 0; g < GN; ++g) a[g] = _mm256_setzero_ps();
    for (int c = 0; c < D / 8; ++c) {
      const __m256 x = radixlm::load8(kr[j] + 8 * c);
      for (int g = 0; g < GN; ++g) a[g] = _mm256_fmadd_ps(x, _mm256_load_ps(qf + g * D + 8 * c), a[g]);
    }
    for (int g = 0; g < GN; ++g) _mm256_store_ps(part[g][j], a[g]);
  }
  for (int g = 0; g < GN; ++g) {
    __m256 v[8];
    for (int j = 0; j < 8; ++j) v[j] = _mm256_load_ps(part[g][j]);
    s[g] = radixlm::hsum8x8(v);
  }
}

template <typename T, int D>
void attend_range_avx2(const T* q, float scale, int G, int H, const T* kbuf, const T* vbuf, const int64_t* idx,
                       int64_t k0, int64_t k1, int64_t row_stride, float* acc, float* m, float* l) {
  static_assert(D % 16 == 0, "head_dim in 16s");
  const int HG = H * G;
  alignas(32) float qf[kMaxGroup * D];
  for (int g = 0; g < HG; ++g) {
    for (int d = 0; d < D; ++d) qf[g * D + d] = to_f(q[g * D + d]) * scale;
    m[g] = kNoMax;
    l[g] = 0.f;
    for (int d = 0; d < D; ++d) acc[g * D + d] = 0.f;
  }
  const int64_t row_bytes = (int64_t)H * D * sizeof(T);
  int64_t slot[kChunkAvx2];
  alignas(32) float sc[kMaxGroup][kChunkAvx2];  // scores, then probabilities
  for (int64_t j = k0; j < std::min<int64_t>(k1, k0 + 32); ++j) radixlm::prefetch_bytes(kbuf + idx[j] * row_stride, row_bytes);
  for (int64_t c0 = k0; c0 < k1; c0 += kChunkAvx2) {
    const int nc = (int)std::min<int64_t>(kChunkAvx2, k1 - c0);
    const int nb = (nc + 7) / 8;
    for (int j = 0; j < nb * 8; ++j) slot[j] = idx[c0 + (j < nc ? j : 0)];
    for (int blk = 0; blk < nb; ++blk) {
      for (int64_t j = c0 + 8 * blk, j1 = std::min<int64_t>(k1, j + 8); j < j1; ++j) {
        if (j + 32 < k1) radixlm::prefetch_bytes(kbuf + idx[j + 32] * row_stride, row_bytes);
        radixlm::prefetch_bytes(vbuf + idx[j] * row_stride, row_bytes);
      }
      const __m256 valid = radixlm::valid8(nc, blk);
      for (int h = 0; h < H; ++h) {
        const T* kr[8];
        for (int j = 0; j < 8; ++j) kr[j] = kbuf + slot[8 * blk + j] * row_stride + (int64_t)h * D;
        for (int g0 = h * G; g0 < (h + 1) * G; g0 += 4) {
          __m256 s[4];
          const int gn = std::min(4, (h + 1) * G - g0);
          switch (gn) {
            case 1: scores8_avx2<T, D, 1>(qf + g0 * D, kr, s); break;
            case 2: scores8_avx2<T, D, 2>(qf + g0 * D, kr, s); break;
            case 3: scores8_avx2<T, D, 3>(qf + g0 * D, kr, s); break;
            default: scores8_avx2<T, D, 4>(qf + g0 * D, kr, s); break;
          }
          for (int i = 0; i < gn; ++i)
            _mm256_store_ps(sc[g0 + i] + 8 * blk, _mm256_blendv_ps(_mm256_set1_ps(kNoMax), s[i], valid));
        }
      }
    }
    for (int g = 0; g < HG; ++g) radixlm::softmax_chunk(sc[g], nullptr, nc, D, m[g], l[g], acc + g * D);
    radixlm::pv_chunk<T, D>(vbuf, row_stride, slot, nc, sc, G, H, acc);
  }
}
#endif  // RADIXLM_AVX2

// Whether attend() runs H > 1 KV heads in one pass (else it loops over them).
template <typename T, int D>
constexpr bool multi_head_pass() {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  return std::is_same<T, uint16_t>::value && D % 32 == 0;
#elif defined(RADIXLM_AVX2)
  return D % 16 == 0;
#else
  return false;
#endif
}

// H consecutive KV heads from the first one at q / kbuf / vbuf; state per query head h * G + g.
template <typename T, int D>
inline void attend(const T* q, float scale, int G, int H, const T* kbuf, const T* vbuf, const int64_t* idx,
                   int64_t k0, int64_t k1, int64_t row_stride, float* acc, float* m, float* l) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  if constexpr (multi_head_pass<T, D>()) {
    attend_range_bf16<D / 32>(q, scale, G, H, kbuf, vbuf, idx, k0, k1, row_stride, acc, m, l);
    return;
  }
#elif defined(RADIXLM_AVX2)
  if constexpr (multi_head_pass<T, D>()) {
    attend_range_avx2<T, D>(q, scale, G, H, kbuf, vbuf, idx, k0, k1, row_stride, acc, m, l);
    return;
  }
#endif
  for (int h = 0; h < H; ++h)
    attend_range<T, D>(q + (int64_t)h * G * D, scale, G, kbuf + h * D, vbuf + h * D, idx, k0, k1, row_stride,
                       acc + h * G * D, m + h * G, l + h * G);
}

template <typename T, int D>
void decode_attention(const T* q, int64_t q_stride, const T* kbuf, const T* vbuf,
                      const int64_t* indptr, const int64_t* indices, T* out, int64_t out_stride,
                      float* lse, int B, int Hq, int Hkv, float scale, int nthreads) {
  const int G = Hq / Hkv;
  const int64_t row_stride = (int64_t)Hkv * D;
  const int H = multi_head_pass<T, D>() ? radixlm::heads_per_task(Hkv, G) : 1;
  radixlm::run_decode_tasks<T, D>(indptr, out, out_stride, lse, B, Hq, Hkv, H, nthreads,
                                  [&](int b, int kvh0, int64_t k0, int64_t k1, float* acc, float* m, float* l) {
    attend<T, D>(q + b * q_stride + (int64_t)kvh0 * G * D, scale, G, H, kbuf + kvh0 * D, vbuf + kvh0 * D,
                 indices + indptr[b], k0, k1, row_stride, acc, m, l);
  });
}

// Neox-style rotary (rotate-half) applied in place to heads [0, nheads) of each token row.
// cos/sin: float32 [max_pos, D/2].
template <typename T>
void rope_inplace(T* x, int64_t T_, int64_t x_stride, int nheads, int D, const int64_t* pos,
                  const float* cos_t, const float* sin_t, int nthreads) {
  const int half = D / 2;
#pragma omp parallel for num_threads(nthreads) if (T_ * nheads * D >= kParallelMin)
  for (int64_t i = 0; i < T_ * nheads; ++i) {
    const int64_t t = i / nheads;
    const int h = (int)(i % nheads);
    T* row = x + t * x_stride + (int64_t)h * D;
    const float* c = cos_t + pos[t] * half;
    const float* s = sin_t + pos[t] * half;
    for (int d = 0; d < half; ++d) {
      const float x1 = to_f(row[d]), x2 = to_f(row[d + half]);
      row[d] = from_f<T>(x1 * c[d] - x2 * s[d]);
      row[d + half] = from_f<T>(x2 * c[d] + x1 * s[d]);
    }
  }
}

// residual (if given) += x, rounded to T; out = rmsnorm(residual or x) * w, one rounding (row_spans.h).
template <typename T>
void add_rmsnorm(const T* x, int64_t x_stride, T* residual, const T* w, T* out, int64_t n, int H,
                 float eps, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (n * H >= kParallelMin)
  for (int64_t t = 0; t < n; ++t)
    radixlm::add_rmsnorm_span(x + t * x_stride, residual ? residual + t * (int64_t)H : nullptr, w,
                              out + t * (int64_t)H, H, eps);
}

// gate_up [n, 2I] (gate then up) -> out [n, I] = silu(gate) * up, one rounding (row_spans.h).
template <typename T>
void silu_mul(const T* gu, T* out, int64_t n, int I, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (n * I >= kParallelMin)
  for (int64_t t = 0; t < n; ++t) {
    const T* g = gu + t * 2 * (int64_t)I;
    radixlm::silu_mul_span(g, g + I, out + t * (int64_t)I, I);
  }
}

// KV store: rows of k/v [n, Hkv*D] (row strides given) into kbuf/vbuf at slots loc.
template <typename T>
void store_kv(const T* k, int64_t k_stride, const T* v, int64_t v_stride, T* kbuf, T* vbuf,
              const int64_t* loc, int64_t n, int64_t row) {
  for (int64_t t = 0; t < n; ++t) {
    memcpy(kbuf + loc[t] * row, k + t * k_stride, sizeof(T) * row);
    memcpy(vbuf + loc[t] * row, v + t * v_stride, sizeof(T) * row);
  }
}

template <typename T>
int decode_dispatch(const void* q, int64_t q_stride, const void* k, const void* v, const int64_t* indptr,
                    const int64_t* indices, void* out, int64_t out_stride, float* lse, int B, int Hq,
                    int Hkv, int D, float scale, int nthreads) {
  if (Hkv <= 0 || Hq % Hkv || Hq / Hkv > kMaxGroup) return -1;
#define RADIXLM_DECODE(DIM)                                                                      \
  case DIM:                                                                                      \
    decode_attention<T, DIM>((const T*)q, q_stride, (const T*)k, (const T*)v, indptr, indices,  \
                             (T*)out, out_stride, lse, B, Hq, Hkv, scale, nthreads);             \
    return 0;
  switch (D) {
    RADIXLM_DECODE(16)
    RADIXLM_DECODE(32)
    RADIXLM_DECODE(64)
    RADIXLM_DECODE(80)
    RADIXLM_DECODE(96)
    RADIXLM_DECODE(128)
    RADIXLM_DECODE(256)
    default:
      return -2;
  }
#undef RADIXLM_DECODE
}

}  // namespace

// ---- C ABI: dtype 0 = float32, 1 = bfloat16. Nonzero return = unsupported shape. ----
extern "C" {

int radixlm_decode_attention(int dtype, const void* q, int64_t q_stride, const void* k, const void* v,
                             const int64_t* indptr, const int64_t* indices, void* out, int64_t out_stride,
                             float* lse, int B, int Hq, int Hkv, int D, float scale, int nthreads) {
  if (dtype == 0)
    return decode_dispatch<float>(q, q_stride, k, v, indptr, indices, out, out_stride, lse, B, Hq, Hkv, D,
                                  scale, nthreads);
  return decode_dispatch<uint16_t>(q, q_stride, k, v, indptr, indices, out, out_stride, lse, B, Hq, Hkv,
                                   D, scale, nthreads);
}

int radixlm_rope_inplace(int dtype, void* x, int64_t n, int64_t x_stride, int nheads, int D,
                         const int64_t* pos, const float* cos_t, const float* sin_t, int nthreads) {
  if (D % 2 || D > kMaxDim) return -2;
  if (dtype == 0)
    rope_inplace<float>((float*)x, n, x_stride, nheads, D, pos, cos_t, sin_t, nthreads);
  else
    rope_inplace<uint16_t>((uint16_t*)x, n, x_stride, nheads, D, pos, cos_t, sin_t, nthreads);
  return 0;
}

int radixlm_add_rmsnorm(int dtype, const void* x, int64_t x_stride, void* residual, const void* w, void* out,
                        int64_t n, int H, float eps, int nthreads) {
  if (H > radixlm::kMaxNormRow) return -2;
  if (dtype == 0)
    add_rmsnorm<float>((const float*)x, x_stride, (float*)residual, (const float*)w, (float*)out, n, H, eps,
                       nthreads);
  else
    add_rmsnorm<uint16_t>((const uint16_t*)x, x_stride, (uint16_t*)residual, (const uint16_t*)w,
                          (uint16_t*)out, n, H, eps, nthreads);
  return 0;
}

int radixlm_silu_mul(int dtype, const void* gu, void* out, int64_t n, int I, int nthreads) {
  if (dtype == 0)
    silu_mul<float>((const float*)gu, (float*)out, n, I, nthreads);
  else
    silu_mul<uint16_t>((const uint16_t*)gu, (uint16_t*)out, n, I, nthreads);
  return 0;
}

int radixlm_store_kv(int dtype, const void* k, int64_t k_stride, const void* v, int64_t v_stride, void* kbuf,
                     void* vbuf, const int64_t* loc, int64_t n, int64_t row) {
  if (dtype == 0)
    store_kv<float>((const float*)k, k_stride, (const float*)v, v_stride, (float*)kbuf, (float*)vbuf, loc, n,
                    row);
  else
    store_kv<uint16_t>((const uint16_t*)k, k_stride, (const uint16_t*)v, v_stride, (uint16_t*)kbuf,
                       (uint16_t*)vbuf, loc, n, row);
  return 0;
}

}  // extern "C"

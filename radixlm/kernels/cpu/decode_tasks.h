// Shared by the decode attention kernels (cpu_ops.cpp over bf16/float32 pools,
// kv_int8_ops.cpp over int8 pools): the task split of a decode batch and the exact merge
// of split key ranges, plus AVX-512 exp and horizontal-sum helpers.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <algorithm>
#include <vector>

#include "avx2.h"
#include "bf16.h"

namespace radixlm {

constexpr int kMaxGroup = 16;   // query rows (heads) handled by one task
constexpr int kMaxDim = 256;    // head_dim
// "No key seen yet" as a finite number: -ffast-math lets the compiler assume no infinities.
constexpr float kNoMax = -1e30f;

#ifndef RADIXLM_KV_PREFETCH_LOCALITY
#define RADIXLM_KV_PREFETCH_LOCALITY 1
#endif
// Prefetch the cache lines of [p, p + bytes) (a KV row). As prefetcht2 (locality 1), not
// prefetcht0: the scattered rows of a decode batch then arrive in L2 with more of them in
// flight, and the demand load takes them from there. int8 pool, batch 32 x 1,024 keys
// interleaved, 30 layers: 48 -> 38 ms (AVX2 build 64 -> 48); contiguous rows 29 -> 33 ms, but
// decode's rows are interleaved. bf16 pools: unchanged.
inline void prefetch_bytes(const void* p, int64_t bytes) {
  const uintptr_t a = (uintptr_t)p, end = a + (uintptr_t)bytes;
  for (uintptr_t line = a & ~(uintptr_t)63; line < end; line += 64)
    __builtin_prefetch((const void*)line, 0, RADIXLM_KV_PREFETCH_LOCALITY);
}

// KV heads per task: the most (dividing Hkv) whose G query heads each fit in one task, so
// each key's pool row is read whole and in order.
inline int heads_per_task(int Hkv, int G) {
  for (int h = Hkv; h >= 1; --h)
    if (Hkv % h == 0 && h * G <= kMaxGroup) return h;
  return 1;
}

// Decode attention over B requests as tasks of (request, H consecutive KV heads, key range):
// attend(b, kvh0, k0, k1, acc, m, l) fills, for the H * G query heads from kvh0 * G on, the
// unnormalised output acc [H*G][D], running max m and running sum l over keys [k0, k1) of
// request b (keys indptr[b] + k0 ...). Writes out [B, Hq, D] (row stride out_stride) and,
// if given, lse [B, Hq] (log-sum-exp of the scaled scores).
template <typename T, int D, typename Attend>
void run_decode_tasks(const int64_t* indptr, T* out, int64_t out_stride, float* lse, int B, int Hq, int Hkv,
                      int H, int nthreads, Attend&& attend) {
  const int G = Hq / Hkv;
  const int HG = H * G;
  const int groups = Hkv / H;
  // Split long requests so that there are enough tasks for every thread (batch 1 has only
  // `groups` tasks otherwise); splits are merged exactly through their (m, l) pairs.
  int64_t longest = 0;
  for (int b = 0; b < B; ++b) longest = std::max(longest, indptr[b + 1] - indptr[b]);
  int splits = 1;
  const int want = 4 * nthreads;
  if ((int64_t)B * groups < want && longest >= 256) {
    splits = (int)std::min<int64_t>((want + B * groups - 1) / (B * groups), longest / 128);
    splits = std::max(splits, 1);
  }
  const int64_t tasks = (int64_t)B * groups * splits;
  std::vector<float> part_acc(splits > 1 ? tasks * HG * D : 0);
  std::vector<float> part_ml(splits > 1 ? tasks * HG * 2 : 0);
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
  for (int64_t t = 0; t < tasks; ++t) {
    const int split = (int)(t % splits);
    const int kvh0 = (int)((t / splits) % groups) * H;
    const int b = (int)(t / ((int64_t)splits * groups));
    const int64_t len = indptr[b + 1] - indptr[b];
    const int64_t chunk = (len + splits - 1) / splits;
    const int64_t k0 = std::min<int64_t>(len, split * chunk), k1 = std::min<int64_t>(len, k0 + chunk);
    float acc[kMaxGroup * D], m[kMaxGroup], l[kMaxGroup];
    attend(b, kvh0, k0, k1, acc, m, l);
    if (splits == 1) {
      for (int g = 0; g < HG; ++g) {
        const int h = kvh0 * G + g;
        const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
        T* op = out + b * out_stride + (int64_t)h * D;
        for (int d = 0; d < D; ++d) op[d] = from_f<T>(acc[g * D + d] * inv);
        if (lse) lse[(int64_t)b * Hq + h] = l[g] > 0.f ? m[g] + logf(l[g]) : kNoMax;
      }
    } else {
      memcpy(&part_acc[t * HG * D], acc, sizeof(float) * HG * D);
      for (int g = 0; g < HG; ++g) {
        part_ml[(t * HG + g) * 2] = m[g];
        part_ml[(t * HG + g) * 2 + 1] = l[g];
      }
    }
  }
  if (splits == 1) return;
#pragma omp parallel for num_threads(nthreads)
  for (int64_t bh = 0; bh < (int64_t)B * Hq; ++bh) {
    const int b = (int)(bh / Hq), h = (int)(bh % Hq), grp = h / HG, g = h % HG;
    const int64_t t0 = ((int64_t)b * groups + grp) * splits;
    float mx = kNoMax;
    for (int s = 0; s < splits; ++s) mx = std::max(mx, part_ml[((t0 + s) * HG + g) * 2]);
    float o[D];
    for (int d = 0; d < D; ++d) o[d] = 0.f;
    float lsum = 0.f;
    for (int s = 0; s < splits; ++s) {
      const float ms = part_ml[((t0 + s) * HG + g) * 2], ls = part_ml[((t0 + s) * HG + g) * 2 + 1];
      if (ls == 0.f) continue;  // an empty split
      const float w = expf(ms - mx);
      lsum += ls * w;
      const float* a = &part_acc[((t0 + s) * HG + g) * D];
      for (int d = 0; d < D; ++d) o[d] += a[d] * w;
    }
    const float inv = lsum > 0.f ? 1.f / lsum : 0.f;
    T* op = out + b * out_stride + (int64_t)h * D;
    for (int d = 0; d < D; ++d) op[d] = from_f<T>(o[d] * inv);
    if (lse) lse[bh] = lsum > 0.f ? mx + logf(lsum) : kNoMax;
  }
}

#if defined(__AVX512F__)
inline __m512 exp512(__m512 x) {
  // exp(x) = 2^n * exp(r), n = round(x / ln2), |r| <= ln2 / 2; Cephes' expf polynomial.
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// Lanes of 16-key block blk that hold one of a chunk's nc keys (valid8 of the AVX2 kernels).
inline __mmask16 valid16(int nc, int blk) {
  const int left = nc - 16 * blk;
  return (__mmask16)(left >= 16 ? 0xFFFFu : ((1u << left) - 1u));
}

// a[0..15] -> one vector whose lane j is the sum of a[j]'s 16 lanes.
inline __m512 hsum16(const __m512* a) {
  __m512 x[8], z[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit block: [a0+a2, b0+b2, a1+a3, b1+b3]
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per block: keys 4i..4i+3, each the sum of that block
    const __m512d u = _mm512_castps_pd(x[2 * i]), v = _mm512_castps_pd(x[2 * i + 1]);
    z[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(u, v)), _mm512_castpd_ps(_mm512_unpackhi_pd(u, v)));
  }
  const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], 0x88), _mm512_shuffle_f32x4(z[0], z[1], 0xDD));
  const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(z[2], z[3], 0x88), _mm512_shuffle_f32x4(z[2], z[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));
}
#endif

#if defined(RADIXLM_AVX2)
// The AVX2 decode attentions (cpu_ops.cpp over float/bf16 pools, kv_int8_ops.cpp over int8
// ones) work in chunks of kChunkAvx2 keys: scores of the chunk first, then softmax_chunk,
// then pv_dims16 over 16 dims at a time.
constexpr int kChunkAvx2 = 128;

inline void widen16(const float* p, __m256& x0, __m256& x1) { x0 = load8(p); x1 = load8(p + 8); }
inline void widen16(const uint16_t* p, __m256& x0, __m256& x1) { x0 = load8(p); x1 = load8(p + 8); }
inline void widen16(const int8_t* p, __m256& x0, __m256& x1) {
  const __m128i b = _mm_loadu_si128((const __m128i*)p);
  x0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  x1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(b, b)));
}

// acc[GN][16 dims] (rows acc_stride apart) += sum over keys j < nc of w[g][j] * value row j
// (vbuf at the first of the 16 dims in slot 0; each row widened once for the GN heads).
template <typename T, int GN>
inline void pv_dims16(const T* vbuf, int64_t row, const int64_t* slot, int nc, const float (*w)[kChunkAvx2],
                      float* acc, int64_t acc_stride) {
  __m256 o[GN][2];
  for (int g = 0; g < GN; ++g) {
    o[g][0] = _mm256_loadu_ps(acc + g * acc_stride);
    o[g][1] = _mm256_loadu_ps(acc + g * acc_stride + 8);
  }
  for (int j = 0; j < nc; ++j) {
    __m256 x0, x1;
    widen16(vbuf + slot[j] * row, x0, x1);
    for (int g = 0; g < GN; ++g) {
      const __m256 p = _mm256_broadcast_ss(&w[g][j]);
      o[g][0] = _mm256_fmadd_ps(p, x0, o[g][0]);
      o[g][1] = _mm256_fmadd_ps(p, x1, o[g][1]);
    }
  }
  for (int g = 0; g < GN; ++g) {
    _mm256_storeu_ps(acc + g * acc_stride, o[g][0]);
    _mm256_storeu_ps(acc + g * acc_stride + 8, o[g][1]);
  }
}

// acc[h*G ..][D] += P @ V of one chunk for H KV heads of G query heads each: w[g] holds query
// head g's weights of the chunk's nc keys (rows slot[j] of vbuf, which points at the first KV
// head in slot 0).
template <typename T, int D>
inline void pv_chunk(const T* vbuf, int64_t row, const int64_t* slot, int nc, const float (*w)[kChunkAvx2], int G,
                     int H, float* acc) {
  for (int h = 0; h < H; ++h)
    for (int g0 = h * G; g0 < (h + 1) * G; g0 += 4)
      for (int d0 = 0; d0 < D; d0 += 16) {
        const T* vh = vbuf + (int64_t)h * D + d0;
        float* a0 = acc + (int64_t)g0 * D + d0;
        switch (std::min(4, (h + 1) * G - g0)) {
          case 1: pv_dims16<T, 1>(vh, row, slot, nc, w + g0, a0, D); break;
          case 2: pv_dims16<T, 2>(vh, row, slot, nc, w + g0, a0, D); break;
          case 3: pv_dims16<T, 3>(vh, row, slot, nc, w + g0, a0, D); break;
          default: pv_dims16<T, 4>(vh, row, slot, nc, w + g0, a0, D); break;
        }
      }
}

// Lanes of 8-key block blk that hold one of the chunk's nc keys.
inline __m256 valid8(int nc, int blk) {
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(nc - 8 * blk), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}

// Online softmax over one chunk for one query head: sc[0 .. 8 nb) holds the scores (padding
// lanes kNoMax) and becomes exp(score - new max), times vscale[j] when given (the int8 values'
// scales folded into the weights); m, l and the head's accumulator acc[D] are rescaled.
inline void softmax_chunk(float* sc, const float* vscale, int nc, int D, float& m, float& l, float* acc) {
  const int nb = (nc + 7) / 8;
  __m256 mx = _mm256_set1_ps(kNoMax);
  for (int blk = 0; blk < nb; ++blk) mx = _mm256_max_ps(mx, _mm256_load_ps(sc + 8 * blk));
  const float bm = std::max(m, hmax8(mx));
  const float corr = expf(m - bm);  // 0 on the first chunk
  const __m256 vbm = _mm256_set1_ps(bm);
  __m256 sum = _mm256_setzero_ps();
  for (int blk = 0; blk < nb; ++blk) {
    const __m256 p = _mm256_and_ps(exp256(_mm256_sub_ps(_mm256_load_ps(sc + 8 * blk), vbm)), valid8(nc, blk));
    sum = _mm256_add_ps(sum, p);
    _mm256_store_ps(sc + 8 * blk, vscale ? _mm256_mul_ps(p, _mm256_load_ps(vscale + 8 * blk)) : p);
  }
  l = l * corr + hsum8(sum);
  m = bm;
  if (corr != 1.f) {
    const __m256 vc = _mm256_set1_ps(corr);
    for (int c = 0; c < D / 8; ++c) _mm256_storeu_ps(acc + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(acc + 8 * c), vc));
  }
}
#endif  // RADIXLM_AVX2

}  // namespace radixlm

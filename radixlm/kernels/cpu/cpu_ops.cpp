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

#include "bf16.h"

namespace {

using radixlm::from_f;
using radixlm::to_f;

constexpr int kMaxGroup = 16;   // query heads per KV head handled by one task
constexpr int kMaxDim = 256;    // head_dim
constexpr int kBlock = 32;      // keys scored per online-softmax step
// Elementwise ops on fewer elements than this run on one thread: a decode batch's norm or
// SiLU is ~10 us of work, less than waking a second thread, and a fork/join waits for the
// slowest thread, which costs milliseconds when another process holds that core.
constexpr int64_t kParallelMin = 1 << 17;
// "No key seen yet" as a finite number: -ffast-math lets the compiler assume no infinities.
constexpr float kNoMax = -1e30f;

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
// bf16 decode attention on AVX512-BF16 dot products (Zen 4, Sapper Rapids and later).
// Scores: per key, D/32 vdpbf16ps against the (unscaled, exact) bf16 query, then 16 keys'
// lane vectors are summed horizontally at once by a transpose-add tree (hsum16), so no
// per-key horizontal reduction. P @ V: consecutive keys' V rows are interleaved in
// 16-bit pairs so one vdpbf16ps adds p_j * v_j + p_j+1 * v_j+1 for 16 dims; P is rounded
// to bf16 for this (as GPU flash attention does), accumulation stays float32.

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
  alignas(64) uint16_t pbh[kMaxGroup][16];
  for (int g = 0; g < HG; ++g) {
    for (int c = 0; c < NC; ++c) qv[g][c] = (__m512bh)_mm512_loadu_si512(q + g * D + c * 32);
    for (int c = 0; c < 2 * NC; ++c) acc[g][c] = _mm512_setzero_ps();
    m[g] = kNoMax;
    l[g] = 0.f;
  }
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t b0 = k0; b0 < k1; b0 += 16) {
    const int n = (int)std::min<int64_t>(16, k1 - b0);
    const __mmask16 valid = (__mmask16)(n == 16 ? 0xFFFFu : ((1u << n) - 1u));
    const uint16_t* kr[16];
    for (int j = 0; j < 16; ++j) kr[j] = kbuf + idx[b0 + (j < n ? j : 0)] * row_stride;
    for (int g = 0; g < HG; ++g) {
      const int64_t hoff = (int64_t)(g / G) * D;
      __m512 a[16];
      for (int j = 0; j < 16; ++j) {
        a[j] = _mm512_setzero_ps();
        for (int c = 0; c < NC; ++c)
          a[j] = _mm512_dpbf16_ps(a[j], (__m512bh)_mm512_loadu_si512(kr[j] + hoff + c * 32), qv[g][c]);
      }
      const __m512 s = _mm512_mask_mov_ps(_mm512_set1_ps(kNoMax), valid, _mm512_mul_ps(hsum16(a), vscale));
      const float bm = std::max(m[g], _mm512_reduce_max_ps(s));
      const float corr = expf(m[g] - bm);
      const __m512 p = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(s, _mm512_set1_ps(bm))));
      l[g] = l[g] * corr + _mm512_reduce_add_ps(p);
      m[g] = bm;
      const __m512 vc = _mm512_set1_ps(corr);
      for (int c = 0; c < 2 * NC; ++c) acc[g][c] = _mm512_mul_ps(acc[g][c], vc);
      _mm256_store_si256((__m256i*)pbh[g], (__m256i)_mm512_cvtneps_pbh(p));
    }
    for (int j = 0; j < n; j += 2) {
      const uint16_t* v0 = vbuf + idx[b0 + j] * row_stride;
      const uint16_t* v1 = j + 1 < n ? vbuf + idx[b0 + j + 1] * row_stride : v0;  // its p is 0
      for (int h = 0; h < H; ++h) {
        __m512i lo[NC], hi[NC];
        for (int c = 0; c < NC; ++c) {
          const __m512i x = _mm512_loadu_si512(v0 + h * D + c * 32), y = _mm512_loadu_si512(v1 + h * D + c * 32);
          lo[c] = _mm512_unpacklo_epi16(x, y);
          hi[c] = _mm512_unpackhi_epi16(x, y);
        }
        for (int g = h * G; g < (h + 1) * G; ++g) {
          uint32_t pair;
          memcpy(&pair, &pbh[g][j], 4);  // (p_j, p_j+1) as a bf16 pair
          const __m512bh pp = (__m512bh)_mm512_set1_epi32((int)pair);
          for (int c = 0; c < NC; ++c) {
            acc[g][2 * c] = _mm512_dpbf16_ps(acc[g][2 * c], (__m512bh)lo[c], pp);
            acc[g][2 * c + 1] = _mm512_dpbf16_ps(acc[g][2 * c + 1], (__m512bh)hi[c], pp);
          }
        }
      }
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

// Whether attend() runs H > 1 KV heads in one pass (else it loops over them).
template <typename T, int D>
constexpr bool multi_head_pass() {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  return std::is_same<T, uint16_t>::value && D % 32 == 0;
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
  // KV heads per task: as many as fit (H * G <= kMaxGroup, H divides Hkv) where one pass
  // handles several, else 1.
  int H = 1;
  if (multi_head_pass<T, D>())
    for (int h = Hkv; h >= 1; --h)
      if (Hkv % h == 0 && h * G <= kMaxGroup) {
        H = h;
        break;
      }
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
    const int64_t start = indptr[b], len = indptr[b + 1] - start;
    const int64_t chunk = (len + splits - 1) / splits;
    const int64_t k0 = std::min<int64_t>(len, split * chunk), k1 = std::min<int64_t>(len, k0 + chunk);
    float acc[kMaxGroup * D], m[kMaxGroup], l[kMaxGroup];
    attend<T, D>(q + b * q_stride + (int64_t)kvh0 * G * D, scale, G, H, kbuf + kvh0 * D, vbuf + kvh0 * D,
                 indices + start, k0, k1, row_stride, acc, m, l);
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

// residual (if given) += x, rounded to T; out = rmsnorm(residual or x) * w, one rounding.
template <typename T>
void add_rmsnorm(const T* x, int64_t x_stride, T* residual, const T* w, T* out, int64_t n, int H,
                 float eps, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (n * H >= kParallelMin)
  for (int64_t t = 0; t < n; ++t) {
    const T* xr = x + t * x_stride;
    float buf[8192];
    float ss = 0.f;
    if (residual) {
      T* rr = residual + t * (int64_t)H;
      for (int i = 0; i < H; ++i) {
        const T v = from_f<T>(to_f(xr[i]) + to_f(rr[i]));
        rr[i] = v;
        buf[i] = to_f(v);
      }
    } else {
      for (int i = 0; i < H; ++i) buf[i] = to_f(xr[i]);
    }
    for (int i = 0; i < H; ++i) ss += buf[i] * buf[i];
    const float r = 1.f / sqrtf(ss / H + eps);
    T* orow = out + t * (int64_t)H;
    for (int i = 0; i < H; ++i) orow[i] = from_f<T>(buf[i] * r * to_f(w[i]));
  }
}

// gate_up [n, 2I] (gate then up) -> out [n, I] = silu(gate) * up, one rounding.
template <typename T>
void silu_mul(const T* gu, T* out, int64_t n, int I, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (n * I >= kParallelMin)
  for (int64_t t = 0; t < n; ++t) {
    const T* g = gu + t * 2 * (int64_t)I;
    const T* u = g + I;
    T* o = out + t * (int64_t)I;
    for (int i = 0; i < I; ++i) {
      const float gv = to_f(g[i]);
      o[i] = from_f<T>(gv / (1.f + expf(-gv)) * to_f(u[i]));
    }
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
  if (H > 8192) return -2;
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

// AVX2 + FMA helpers for the CPU kernels on processors without AVX-512 (e.g. AMD Zen 3):
// 8-lane float32 loads/stores of float32 or bfloat16 rows (bfloat16 rounded to nearest even
// as torch does, NaN kept a quiet NaN: the same numbers as bf16.h's scalar from_f), an exp,
// and horizontal reductions. RADIXLM_AVX2 (the kernels' AVX2 code paths) only where the AVX-512
// paths are not; the helpers themselves wherever AVX2 + FMA are (row_spans.h uses them on
// AVX-512 machines without AVX512-BF16 too).
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#if !defined(__AVX512F__)
#define RADIXLM_AVX2 1
#endif
#define RADIXLM_AVX2_HELPERS 1
#include <immintrin.h>
#include <stdint.h>

namespace radixlm {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

// 8 float32 -> 8 bfloat16 bits, round to nearest even, NaN -> quiet NaN (bf16.h from_f).
inline __m128i to_bf16x8(__m256 f) {
  const __m256i u = _mm256_castps_si256(f);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i mag = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
  const __m256i nan = _mm256_cmpgt_epi32(mag, _mm256_set1_epi32(0x7f800000));
  const __m256i qnan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  r = _mm256_blendv_epi8(r, qnan, nan);
  // 8 dwords (values < 65536) -> 8 words in order
  const __m256i packed = _mm256_packus_epi32(r, r);  // per lane: [r0..r3 r0..r3], [r4..r7 r4..r7]
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));  // qwords 0, 2
}

inline void store8(float* p, __m256 f) { _mm256_storeu_ps(p, f); }
inline void store8(uint16_t* p, __m256 f) { _mm_storeu_si128((__m128i*)p, to_bf16x8(f)); }

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// a[0..7] -> one vector whose lane j is the sum of a[j]'s 8 lanes.
inline __m256 hsum8x8(const __m256* a) {
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  // lanes: s0123 = [0 1 2 3 | 0 1 2 3] halves, s4567 likewise
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// The same in int32.
inline __m256i hsum8x8i(const __m256i* a) {
  const __m256i s01 = _mm256_hadd_epi32(a[0], a[1]), s23 = _mm256_hadd_epi32(a[2], a[3]);
  const __m256i s45 = _mm256_hadd_epi32(a[4], a[5]), s67 = _mm256_hadd_epi32(a[6], a[7]);
  const __m256i s0123 = _mm256_hadd_epi32(s01, s23), s4567 = _mm256_hadd_epi32(s45, s67);
  return _mm256_add_epi32(_mm256_permute2x128_si256(s0123, s4567, 0x20),
                          _mm256_permute2x128_si256(s0123, s4567, 0x31));
}

// exp(x) for x <= 88 (softmax numerators, SiLU's e^-g capped at e^80): 2^n * exp(r),
// n = round(x / ln2), Cephes' expf polynomial (decode_tasks.h exp512 in 8 lanes); below -87 it
// returns ~0.
inline __m256 exp256(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  // * 2^n: n in [-126, 127] here, added to the exponent field
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

}  // namespace radixlm

#endif

// Prefill (extend) attention over a bf16 or int8 KV pool on AVX512-BF16 (Zen 4, Sapphire Rapids and
// later): each request's new tokens attend causally to its cached prefix and to themselves. On
// CPUs with AMX, head dims 32 and 64 run on tiles instead (attend_rows_amx).
//
// Why native: torch's CPU flash attention runs this model's chunk shapes (9 query heads, 3 KV
// heads, D 64) at a tenth of the bf16 dot-product peak, and a cached prefix costs it a boolean
// mask over every key (docs/performance.md, Prefill).
//
// Layout. Per call, each request's keys of one KV head are packed once, so that no inner loop
// needs a horizontal sum:
//   K: 16-key tiles, D in bf16 pairs, [tile][D/2][16 keys][2]. A query row's 16 scores are D/2
//      vdpbf16ps of one packed vector against the row's (d, d+1) pair broadcast.
//   V: key pairs with D interleaved, [pair][D][2]. One vdpbf16ps adds p_j v_j + p_j+1 v_j+1 to
//      16 output dims, with the row's (p_j, p_j+1) pair broadcast.
// kRows (12) query rows (token, query head of the KV head) share each loaded K and V vector. Scores
// and P are float32 per 32-key block; P is rounded to bf16 for P @ V (as GPU flash attention
// does), accumulation is float32, and the online softmax runs once per block and row, its
// weights computed between the next block's dot products (attend_rows' pipeline). Blocks
// past a row block's causal end are never visited, the prefix needs no mask, and only blocks
// that cross some row's causal end are masked. An int8 pool (the int8 KV cache) is dequantized
// to bf16 while packing, once per key and call, so the rest is the same.

#include <omp.h>
#include <stdint.h>
#include <string.h>
#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

#include "amx.h"
#include "decode_tasks.h"

namespace {

using radixlm::kNoMax;

// Query rows per register tile: 24 score accumulators (two 16-key tiles each) plus the two K
// vectors and a broadcast. 12 rows measured 14% faster than 8 at D 64 (each V vector serves 6
// rows in P @ V instead of 4); 12 is also 4 tokens of a 3-query-head group.
constexpr int kRows = 12;
// Keys per online-softmax block, in 16-key tiles. (6 rows x 64 keys measured the same as
// 12 x 32 at D 64.)
constexpr int kKeys = 32;
constexpr int kTiles = kKeys / 16;
static_assert(kKeys % 32 == 0, "P is rounded to bf16 two tiles at a time");
// A row tile's keys up to its last 32-key block go in wide blocks of kWideTiles 16-key tiles:
// each 32 keys' scores are computed in registers as above and kept in L1 until the block's
// online softmax, which then runs (with its fixed latency, and the P @ V accumulators' loads and
// stores) once per 128 keys, not per 32. The rest are 32-key blocks, so the causal tail visits
// no more keys than before. (On a 2k prompt's chunks 2-7% faster; 64 keys gained half of that,
// 256 no more.)
constexpr int kWideTiles = 8;
constexpr int kQTile = 64;   // query tokens per task

// Rows of P @ V sharing each loaded V vector: their D/16 accumulators each, plus D/16 V
// vectors, within the 32 registers.
template <int D>
constexpr int pv_rows() { return D <= 64 ? 6 : D <= 96 ? 3 : D <= 128 ? 2 : 1; }

// 2^x for the softmax weights: a degree-3 minimax polynomial of the fraction (relative error
// < 7.5e-5, far below the bf16 rounding P gets before P @ V) and an exponent scale. Each FMA
// here takes a slot from the vdpbf16ps on the same pipes. Very negative x (masked keys, the
// first block's correction) gives 0.
inline __m512 exp2_512(__m512 x) {
  // f = x - floor(x) in one instruction; vscalefps scales by 2^floor(x) itself.
  const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);  // [0, 1)
  __m512 p = _mm512_set1_ps(7.802436e-2f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.2606718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9583364e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.999252e-1f));
  return _mm512_scalef_ps(p, x);
}

// 2^x for the softmax weights that attend_rows computes between the scores' dot products.
// There the polynomial above would cost its four FMAs as dot-product slots, while adds,
// permutes and vscalefps run on the other pipes beside them (Zen 4): x = k / 16 + r with
// k = round(16 x) (adding 1.5 * 2^19 leaves k in the low mantissa bits) and r in [-1/32, 1/32];
// 2^(k mod 16 / 16) times the minimax line of 2^r (relative error < 1.2e-4, far below P's bf16
// rounding) is one FMA of two 16-entry tables, and vscalefps scales it by 2^floor(k / 16).
// Very negative x (masked keys) gives 0.
struct Exp2Table {
  alignas(64) float a[16], b[16];  // 2^(j / 16) times the line's constant and slope
  Exp2Table() {
    for (int j = 0; j < 16; ++j) {
      const double t = std::exp2(j / 16.0);
      a[j] = (float)(1.00011875 * t);
      b[j] = (float)(0.6932125963297612 * t);
    }
  }
};
const Exp2Table kExp2Table;

inline __m512 exp2_512_table(__m512 x) {
  // Explicit rounding keeps -ffast-math from folding (x + magic) - magic into x.
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512 magic = _mm512_set1_ps(786432.f);  // 1.5 * 2^19, whose ulp is 1/16
  const __m512 y = _mm512_add_round_ps(x, magic, kRound);
  const __m512 t = _mm512_sub_round_ps(y, magic, kRound);  // k / 16, exactly
  const __m512 r = _mm512_sub_round_ps(x, t, kRound);
  const __m512i k = _mm512_castps_si512(y);  // vpermps reads its low 4 bits
  const __m512 a = _mm512_permutexvar_ps(k, _mm512_load_ps(kExp2Table.a));
  const __m512 b = _mm512_permutexvar_ps(k, _mm512_load_ps(kExp2Table.b));
  return _mm512_scalef_ps(_mm512_fmadd_ps(r, b, a), t);
}

static_assert(kRows <= 16, "the rows' maxima and corrections are one 16-lane vector");

int64_t padded(int64_t n) { return (n + kKeys - 1) / kKeys * kKeys; }

// 32-bit words of one request's packed K (or V) for one KV head: its keys padded to a block.
template <int D>
int64_t packed_words(int64_t len) { return padded(len) * D / 2; }

// The KV pool: bf16 rows, or int8 rows with one float32 scale per (slot, KV head) (the int8
// KV cache), [slots][Hkv][D] either way.
struct Pool {
  const void* k;
  const void* v;
  const float* k_scale;  // null for a bf16 pool
  const float* v_scale;
  int Hkv;
};

// Pack keys [k0, k0 + kKeys) of one request and KV head from their bf16 rows (null: a key past
// the request's end, packed as zeros) into K tiles and V pairs.
template <int D>
void pack_rows(const uint16_t* const* kr, const uint16_t* const* vr, uint32_t* kp, uint32_t* vp) {
  constexpr int DP = D / 2;
  for (int t = 0; t < kTiles; ++t)  // K: [tile][DP][16]
    for (int dp = 0; dp < DP; ++dp)
      for (int j = 0; j < 16; ++j) {
        const uint32_t* r = (const uint32_t*)kr[16 * t + j];
        kp[(t * DP + dp) * 16 + j] = r ? r[dp] : 0u;
      }
  for (int p = 0; p < kKeys / 2; ++p) {  // V: [pair][D] of (v_2p, v_2p+1)
    const uint16_t *a = vr[2 * p], *b = vr[2 * p + 1];
    for (int d = 0; d < D; ++d)
      vp[p * D + d] = (uint32_t)(a ? a[d] : 0) | (uint32_t)(b ? b[d] : 0) << 16;
  }
}

// An int8 row times its scale in float32, rounded once to bf16: what kv_pool.dequantize_kv
// gives the torch path.
template <int D>
inline void dequant_row(const int8_t* row, float scale, uint16_t* out) {
  const __m512 s = _mm512_set1_ps(scale);
  for (int d = 0; d < D; d += 16) {
    const __m512 x = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(row + d))));
    _mm256_storeu_si256((__m256i*)(out + d), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(x, s)));
  }
}

// Pack keys [k0, k0 + kKeys) of one request (slots idx, len keys in all) and KV head h; an
// int8 pool's rows are dequantized to bf16 first. Keys before kfirst (outside every new token's
// sliding window) are packed as zeros, like those past the end: masked, never a stale value.
template <int D>
void pack_block(const Pool& pool, int h, const int64_t* idx, int64_t len, int64_t k0, uint32_t* kp, uint32_t* vp,
                int64_t kfirst = 0) {
  const int64_t row_stride = (int64_t)pool.Hkv * D;
  const uint16_t* kr[kKeys];
  const uint16_t* vr[kKeys];
  alignas(64) uint16_t kd[kKeys][D], vd[kKeys][D];
  for (int j = 0; j < kKeys; ++j) {
    if (k0 + j >= len || k0 + j < kfirst) {
      kr[j] = vr[j] = nullptr;
      continue;
    }
    const int64_t slot = idx[k0 + j], off = slot * row_stride + (int64_t)h * D;
    if (pool.k_scale) {
      dequant_row<D>((const int8_t*)pool.k + off, pool.k_scale[slot * pool.Hkv + h], kd[j]);
      dequant_row<D>((const int8_t*)pool.v + off, pool.v_scale[slot * pool.Hkv + h], vd[j]);
      kr[j] = kd[j];
      vr[j] = vd[j];
    } else {
      kr[j] = (const uint16_t*)pool.k + off;
      vr[j] = (const uint16_t*)pool.v + off;
    }
  }
  pack_rows<D>(kr, vr, kp, vp);
}

// acc rows [RG][D/16] (times corr[r] first) += P @ V over one 32-key block.
// NP: key pairs in the block (kKeys / 2, or a wide block's).
template <int D, int RG, int NP = kKeys / 2, int PS = NP>  // PS: pb's row length
inline void pv_block(const uint32_t* vp, const uint32_t (*pb)[PS], const float* corr, bool rescale,
                     float (*acc)[D]) {
  constexpr int NC = D / 16;
  __m512 o[RG][NC];
  for (int r = 0; r < RG; ++r) {
    const __m512 c = _mm512_set1_ps(corr[r]);
    for (int c16 = 0; c16 < NC; ++c16)
      o[r][c16] = rescale ? _mm512_mul_ps(_mm512_load_ps(acc[r] + 16 * c16), c) : _mm512_load_ps(acc[r] + 16 * c16);
  }
  for (int jp = 0; jp < NP; ++jp) {
    __m512i v[NC];
    for (int c16 = 0; c16 < NC; ++c16) v[c16] = _mm512_load_si512(vp + jp * D + 32 * c16 / 2);
    for (int r = 0; r < RG; ++r) {
      const __m512bh p = (__m512bh)_mm512_set1_epi32((int)pb[r][jp]);
      for (int c16 = 0; c16 < NC; ++c16) o[r][c16] = _mm512_dpbf16_ps(o[r][c16], (__m512bh)v[c16], p);
    }
  }
  for (int r = 0; r < RG; ++r)
    for (int c16 = 0; c16 < NC; ++c16) _mm512_store_ps(acc[r] + 16 * c16, o[r][c16]);
}

template <int R>
struct RowsOf {  // one tile of query rows
  const uint16_t* q[R];
  uint16_t* out[R];
  int64_t kend[R];  // keys [kbeg, kend) are visible to the row
  int64_t kbeg[R];  // 0 but for a sliding window, and then < 32: the first block has a visible key
  int n;            // real rows (the rest repeat the last one and are not stored)
};
using Rows = RowsOf<kRows>;

// The online softmax's first half for one block of NT 16-key tiles (a kKeys block, or a wide
// one) and R rows: s, the block's scores, is set to kNoMax in place past each row's kend when the
// block crosses one (masked); m: the rows' running maxima (16 lanes, those past R 0), moved
// where the block passes them; corr: where a row's maximum moved, its correction (the factor
// for its earlier weights, output and sum). Returns the rows whose maximum moved.
//
// Lazy rescaling: a row's running maximum m moves only when a block's maximum passes it by more
// than 8 (in units of log2): P then stays below 2^8 (exact enough in float32 and bf16 alike), and
// most blocks need no correction of the output and l at all.
template <int R, int NT, int S = NT>  // S: s's row length in tiles
__attribute__((always_inline)) inline __mmask16 move_maxima(__m512 (*s)[S], const int64_t* kend, const int64_t* kbeg,
                                                            int64_t k0, bool masked, float c, float* m, float* corr) {
  constexpr int kKeys = 16 * NT;  // this block's
  alignas(64) float bm[16] = {};
  __mmask16 up = 0;
  for (int r = 0; r < R; ++r) {
    if (masked) {
      const int64_t n = std::max<int64_t>(0, std::min<int64_t>(kKeys, kend[r] - k0));
      const int64_t lo = std::max<int64_t>(0, std::min<int64_t>(kKeys, kbeg[r] - k0));  // window: keys before
      for (int t = 0; t < NT; ++t) {
        const int64_t nt = n - 16 * t, lt = lo - 16 * t;
        __mmask16 mk = (__mmask16)(nt >= 16 ? 0xFFFFu : nt > 0 ? (1u << nt) - 1u : 0u);
        if (lt > 0) mk &= (__mmask16)(lt >= 16 ? 0u : ~((1u << lt) - 1u));
        s[r][t] = _mm512_mask_mov_ps(_mm512_set1_ps(kNoMax), mk, s[r][t]);
      }
    }
    __m512 mx = s[r][0];
    for (int t = 1; t < NT; ++t) mx = _mm512_max_ps(mx, s[r][t]);
    // The row's horizontal maximum only where some score passes m + 8 / c (rare after the
    // first block): a compare instead of a reduction.
    if (_mm512_cmp_ps_mask(mx, _mm512_set1_ps(m[r] + 8.f / c), _CMP_GT_OQ)) {
      bm[r] = _mm512_reduce_max_ps(mx);
      up |= (__mmask16)(1u << r);
    }
  }
  if (up) {
    const __m512 mold = _mm512_load_ps(m);
    const __m512 mnew = _mm512_mask_mov_ps(mold, up, _mm512_load_ps(bm));
    _mm512_store_ps(m, mnew);
    _mm512_store_ps(corr, exp2_512(_mm512_mul_ps(_mm512_sub_ps(mold, mnew), _mm512_set1_ps(c))));
  }
  return up;
}

// The whole online softmax of one block, for attend_rows_amx (attend_rows pipelines the same
// two halves): move_maxima, then the weights. l: the rows' sums of weights; pb[r]: row r's
// weights rounded to bf16, keys in order (NT * 32 bytes). Returns the rows whose maximum moved.
template <int R, int NT = kTiles>
__attribute__((always_inline)) inline __mmask16 softmax_block(__m512 (&s)[R][NT], const int64_t* kend,
                                                              const int64_t* kbeg, int64_t k0, bool masked, float c,
                                                              float* m, float* corr, __m512* l,
                                                              uint32_t (*pb)[NT * 8]) {
  const __mmask16 up = move_maxima<R, NT>(s, kend, kbeg, k0, masked, c, m, corr);
  const __m512 vc = _mm512_set1_ps(c);
  for (int r = 0; r < R; ++r) {
    const __m512 mc = _mm512_set1_ps(m[r] * c);
    __m512 p[NT];
    for (int t = 0; t < NT; ++t) p[t] = exp2_512(_mm512_fmsub_ps(s[r][t], vc, mc));  // masked keys: 0
    __m512 sum = p[0];
    for (int t = 1; t < NT; ++t) sum = _mm512_add_ps(sum, p[t]);
    l[r] = (up >> r & 1) ? _mm512_fmadd_ps(l[r], _mm512_set1_ps(corr[r]), sum) : _mm512_add_ps(l[r], sum);
    for (int t = 0; t < NT; t += 2)  // keys 16t.. in the low half, 16(t+1).. in the high
      _mm512_store_si512(pb[r] + 8 * t, (__m512i)_mm512_cvtne2ps_pbh(p[t + 1], p[t]));
  }
  return up;
}

// Attention of one tile of rows over the packed keys of their request and KV head.
template <int D>
void attend_rows(const Rows& rows, const uint32_t* kp, const uint32_t* vp, float scale) {
  constexpr int DP = D / 2;
  alignas(64) uint32_t qb[kRows][DP];
  alignas(64) float acc[kRows][D];
  alignas(64) float m[16];
  __m512 l[kRows];
  for (int r = 0; r < kRows; ++r) {
    memcpy(qb[r], rows.q[r], D * sizeof(uint16_t));
    memset(acc[r], 0, sizeof(acc[r]));
    m[r] = kNoMax;
    l[r] = _mm512_setzero_ps();
  }
  for (int r = kRows; r < 16; ++r) m[r] = 0.f;
  int64_t kmin = rows.kend[0], kmax = rows.kend[0], kbmax = rows.kbeg[0];
  for (int r = 1; r < kRows; ++r) {
    kmin = std::min(kmin, rows.kend[r]);
    kmax = std::max(kmax, rows.kend[r]);
    kbmax = std::max(kbmax, rows.kbeg[r]);
  }
  const float c = scale * 1.44269504088896341f;  // log2(e)
  constexpr int RG = pv_rows<D>();
  static_assert(kRows % RG == 0, "P @ V takes the rows in groups of RG");
  const __m512 vc = _mm512_set1_ps(c);
  // Keys k0 .. k0 + 31 into s; step(i) runs after the dot products of the i-th pair of D.
  auto scores = [&](int64_t k0, __m512 (&s)[kRows][kTiles], auto&& step) __attribute__((always_inline)) {
    const uint32_t* kt = kp + k0 * D / 2;  // kKeys keys of D bf16 (D / 2 words each)
    for (int r = 0; r < kRows; ++r)
      for (int t = 0; t < kTiles; ++t) s[r][t] = _mm512_setzero_ps();
    for (int dp = 0; dp < DP; ++dp) {
      __m512bh kk[kTiles];
      for (int t = 0; t < kTiles; ++t) kk[t] = (__m512bh)_mm512_load_si512(kt + (t * DP + dp) * 16);
      for (int r = 0; r < kRows; ++r) {
        const __m512bh qq = (__m512bh)_mm512_set1_epi32((int)qb[r][dp]);
        for (int t = 0; t < kTiles; ++t) s[r][t] = _mm512_dpbf16_ps(s[r][t], kk[t], qq);
      }
      step(dp);
    }
  };
  // The keys in blocks: wide ones (kWideTiles tiles) up to the row tile's last one, then
  // kKeys ones to kmax; software-pipelined. While the dot products of block i's scores run,
  // the weights of block i - 1 (whose maxima have moved already) are computed between them, one
  // pair of 16-key tiles of one row at a time, by the table exponential, whose adds, permutes
  // and scalings take the pipes the dot products leave free. Then block i - 1's P @ V runs, and
  // block i's maxima move. (The polynomial's FMAs after the scores loop cost ~20% of its time,
  // the table's units between its dot products ~5%.)
  constexpr int64_t kWide = 16 * kWideTiles;
  const int64_t kpad = padded(kmax);  // the packed keys end there (zeros past the request's end)
  const int64_t nwide = kpad / kWide, nblocks = nwide + (kmax - nwide * kWide + kKeys - 1) / kKeys;
  auto block_start = [&](int64_t i) { return i < nwide ? i * kWide : nwide * kWide + (i - nwide) * kKeys; };
  alignas(64) __m512 sw[2][kRows][kWideTiles];  // block i's scores, and block i - 1's
  alignas(64) uint32_t pbw[kRows][kWide / 2];   // block i - 1's weights
  alignas(64) float corr_e[16];                 // block i - 1's corrections
  __mmask16 up_e = 0;
  __m512 rsum = _mm512_setzero_ps();
  // Step i with NT tiles in block i (0: past the last) and NTE in block i - 1 (0: none).
  auto step = [&](int64_t i, auto nt_, auto nte_) __attribute__((always_inline)) {
    constexpr int NT = decltype(nt_)::value, NTE = decltype(nte_)::value;
    constexpr int kUnits = kRows * NTE / 2, kSteps = NT / 2 * DP;
    __m512 (*se)[kWideTiles] = sw[(i + 1) & 1];
    auto unit = [&](int u) __attribute__((always_inline)) {  // row u / (NTE / 2), tiles 2 (u % (NTE / 2)), + 1
      const int r = u / (NTE / 2), t = 2 * (u % (NTE / 2));
      const __m512 vmc = _mm512_set1_ps(m[r] * c);  // block i - 1's (block i's move after)
      const __m512 p0 = exp2_512_table(_mm512_fmsub_ps(se[r][t], vc, vmc));  // masked keys: 0
      const __m512 p1 = exp2_512_table(_mm512_fmsub_ps(se[r][t + 1], vc, vmc));
      _mm512_store_si512(pbw[r] + 8 * t, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
      rsum = t == 0 ? _mm512_add_ps(p0, p1) : _mm512_add_ps(rsum, _mm512_add_ps(p0, p1));
      if (t == NTE - 2)
        l[r] = (up_e >> r & 1) ? _mm512_fmadd_ps(l[r], _mm512_set1_ps(corr_e[r]), rsum) : _mm512_add_ps(l[r], rsum);
    };
    const int64_t kb = block_start(i);
    if constexpr (NT > 0) {
      for (int b = 0; b < NT / 2; ++b) {
        __m512 s[kRows][kTiles];
        scores(kb + b * kKeys, s, [&](int dp) __attribute__((always_inline)) {
          if constexpr (NTE > 0) {  // units j * kUnits / kSteps .. (j + 1) * kUnits / kSteps after step j
            const int j = b * DP + dp;
            for (int u = j * kUnits / kSteps; u < (j + 1) * kUnits / kSteps; ++u) unit(u);
          }
        });
        for (int r = 0; r < kRows; ++r)
          for (int t = 0; t < kTiles; ++t) sw[i & 1][r][b * kTiles + t] = s[r][t];
      }
    } else {
      for (int u = 0; u < kUnits; ++u) unit(u);  // the last block's weights
    }
    if constexpr (NTE > 0) {
      const uint32_t* vt = vp + block_start(i - 1) * D / 2;
      for (int r = 0; r < kRows; r += RG)
        pv_block<D, RG, NTE * 8, kWide / 2>(vt, pbw + r, corr_e + r, (up_e >> r & ((1u << RG) - 1)) != 0, acc + r);
    }
    if constexpr (NT > 0) {
      up_e = move_maxima<kRows, NT, kWideTiles>(sw[i & 1], rows.kend, rows.kbeg, kb, kb + 16 * NT > kmin || kb < kbmax,
                                                c, m, corr_e);
    }
  };
  using Wide = std::integral_constant<int, kWideTiles>;
  using Narrow = std::integral_constant<int, kTiles>;
  using None = std::integral_constant<int, 0>;
  for (int64_t i = 0; i < nblocks; ++i) {
    if (i < nwide) {
      if (i == 0)
        step(i, Wide(), None());
      else
        step(i, Wide(), Wide());
    } else if (i == 0) {
      step(i, Narrow(), None());
    } else if (i == nwide) {
      step(i, Narrow(), Wide());
    } else {
      step(i, Narrow(), Narrow());
    }
  }
  if (nblocks == nwide)
    step(nblocks, None(), Wide());
  else
    step(nblocks, None(), Narrow());
  for (int r = 0; r < rows.n; ++r) {
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(l[r]));
    for (int c = 0; c < D; c += 16)
      _mm256_storeu_si256((__m256i*)(rows.out[r] + c),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(acc[r] + c), inv)));
  }
}

#ifdef RADIXLM_BF16_AMX
// The same attention on AMX tiles, for D 32 and 64: 16 query rows per tile; per 32-key block
// S = Q K^T is D / 16 tile products into two C tiles (tiles 4-5), stored for the AVX-512 online
// softmax above (softmax_block: the same masks and lazy rescaling, the polynomial exponential)
// while the tiles go on to the next block's S, and P @ V adds D / 16 tile products into O, which
// stays in C tiles 0 .. D/16 - 1 across the blocks: it leaves them only when a row's maximum
// moves (rescaled in memory) and at the end. Tile 6 holds A (Q, then P), tile 7 B (K, then V). The packed K
// tiles ([tile][D/2][16]) and V pairs ([pair][D]) are AMX's B layout as they are, 64 and 4 D
// bytes a row apart. (Computed transposed, S^T = K Q^T with a vertical softmax, it measured
// slower on an AMX host.)
constexpr int kAmxRows = 16;
using AmxRows = RowsOf<kAmxRows>;

template <int D>
constexpr bool amx_attends() { return D == 32 || D == 64; }

// O tiles <-> rows of float32 (D floats a row); tile numbers are immediates.
template <int D>
inline void o_tiles(float (*o)[D], bool store) {
#define RADIXLM_O_TILE(T)                                                  \
  if (store)                                                               \
    _tile_stored(T, o[0] + 16 * T, D * 4);                                 \
  else                                                                     \
    _tile_loadd(T, o[0] + 16 * T, D * 4);
  RADIXLM_O_TILE(0)
  RADIXLM_O_TILE(1)
  if constexpr (D == 64) {
    RADIXLM_O_TILE(2)
    RADIXLM_O_TILE(3)
  }
#undef RADIXLM_O_TILE
}

template <int D>
void attend_rows_amx(const AmxRows& rows, const uint32_t* kp, const uint32_t* vp, float scale) {
  constexpr int DP = D / 2, R = kAmxRows;
  alignas(64) uint16_t qb[R][D];
  alignas(64) float sb[R][kKeys];
  alignas(64) uint32_t pb[R][kKeys / 2];
  alignas(64) float ob[R][D];
  alignas(64) float m[16], corr[16];
  __m512 l[R];
  for (int r = 0; r < R; ++r) {
    memcpy(qb[r], rows.q[r], D * sizeof(uint16_t));
    m[r] = kNoMax;
    l[r] = _mm512_setzero_ps();
  }
  int64_t kmin = rows.kend[0], kmax = rows.kend[0], kbmax = rows.kbeg[0];
  for (int r = 1; r < R; ++r) {
    kmin = std::min(kmin, rows.kend[r]);
    kmax = std::max(kmax, rows.kend[r]);
    kbmax = std::max(kbmax, rows.kbeg[r]);
  }
  const float c = scale * 1.44269504088896341f;  // log2(e)
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (D == 64) {
    _tile_zero(2);
    _tile_zero(3);
  }
  auto scores = [&](int64_t k0) {  // S of the block from k0 into tiles 4-5
    const uint32_t* kt = kp + k0 * D / 2;
    _tile_zero(4);
    _tile_zero(5);
    for (int d0 = 0; d0 < D; d0 += 32) {  // 16 pairs of D a step
      _tile_loadd(6, qb[0] + d0, D * 2);
      _tile_loadd(7, kt + d0 / 2 * 16, 64);
      _tile_dpbf16ps(4, 6, 7);
      _tile_loadd(7, kt + (DP + d0 / 2) * 16, 64);
      _tile_dpbf16ps(5, 6, 7);
    }
  };
  scores(0);
  for (int64_t k0 = 0; k0 < kmax; k0 += kKeys) {
    _tile_stored(4, sb[0], kKeys * 4);
    _tile_stored(5, sb[0] + 16, kKeys * 4);
    // The next block's scores run on the tiles while this block's softmax runs on the vectors.
    if (k0 + kKeys < kmax) scores(k0 + kKeys);
    __m512 sv[R][kTiles];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < kTiles; ++t) sv[r][t] = _mm512_load_ps(sb[r] + 16 * t);
    const __mmask16 up = softmax_block<R>(sv, rows.kend, rows.kbeg, k0, k0 + kKeys > kmin || k0 < kbmax, c, m, corr,
                                          l, pb);
    if (up && k0 > 0) {  // O holds earlier blocks: each moved row times its correction
      o_tiles<D>(ob, true);
      for (int r = 0; r < R; ++r)
        if (up >> r & 1)
          for (int d = 0; d < D; d += 16)
            _mm512_store_ps(ob[r] + d, _mm512_mul_ps(_mm512_load_ps(ob[r] + d), _mm512_set1_ps(corr[r])));
      o_tiles<D>(ob, false);
    }
    const uint32_t* vt = vp + k0 * D / 2;  // kKeys / 2 pairs of D words
    _tile_loadd(6, pb[0], kKeys * 2);
    _tile_loadd(7, vt, D * 4);
    _tile_dpbf16ps(0, 6, 7);
    _tile_loadd(7, vt + 16, D * 4);
    _tile_dpbf16ps(1, 6, 7);
    if constexpr (D == 64) {
      _tile_loadd(7, vt + 32, D * 4);
      _tile_dpbf16ps(2, 6, 7);
      _tile_loadd(7, vt + 48, D * 4);
      _tile_dpbf16ps(3, 6, 7);
    }
  }
  o_tiles<D>(ob, true);
  for (int r = 0; r < rows.n; ++r) {
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(l[r]));
    for (int d = 0; d < D; d += 16)
      _mm256_storeu_si256((__m256i*)(rows.out[r] + d),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(ob[r] + d), inv)));
  }
}
#endif  // RADIXLM_BF16_AMX

// 64-byte aligned scratch kept by the calling thread between calls (the scheduler calls once
// per layer with similar sizes: no page faults after the first).
uint32_t* workspace(int64_t words) {
  thread_local std::vector<uint32_t> buf;
  if ((int64_t)buf.size() < words + 16) buf.resize(words + 16);
  return (uint32_t*)(((uintptr_t)buf.data() + 63) & ~(uintptr_t)63);
}

struct Task {
  int b, h;
  int64_t t0, t1;  // the request's query tokens [t0, t1)
  int64_t cost;
};

template <int D>
void extend_group(const uint16_t* q, int64_t q_stride, const Pool& pool, const int64_t* q_indptr,
                  const int64_t* kv_indptr, const int64_t* kv_indices, uint16_t* out, int64_t out_stride, int b0,
                  int b1, int Hq, float scale, int64_t window, int nthreads) {
  const int Hkv = pool.Hkv, G = Hq / Hkv;
  // A sliding window (window > 0): a row tile's keys are read from a 16-key tile boundary at or
  // below its rows' first visible key, up to 16 keys past the request's padded end: packed zeros.
  const int64_t extra = window > 0 ? 16 : 0;
  // Per request: K of each head, then V of each head, packed_words each.
  auto words = [&](int b) { return packed_words<D>(kv_indptr[b + 1] - kv_indptr[b] + extra); };
  // The first key any new token of request b sees (0 without a window); keys before its block
  // are never read, so never packed.
  auto first_key = [&](int b) -> int64_t {
    const int64_t len = kv_indptr[b + 1] - kv_indptr[b], ext = q_indptr[b + 1] - q_indptr[b];
    return window > 0 ? std::max<int64_t>(0, len - ext + 1 - window) : 0;
  };
  std::vector<int64_t> base(b1 - b0 + 1, 0);
  for (int b = b0; b < b1; ++b) base[b - b0 + 1] = base[b - b0] + 2 * Hkv * words(b);
  uint32_t* ws = workspace(base.back());
  auto kpack = [&](int b, int h) { return ws + base[b - b0] + h * words(b); };
  auto vpack = [&](int b, int h) { return kpack(b, h) + Hkv * words(b); };

  std::vector<Task> pack, work;
  for (int b = b0; b < b1; ++b) {
    const int64_t len = kv_indptr[b + 1] - kv_indptr[b], ext = q_indptr[b + 1] - q_indptr[b];
    if (ext == 0) continue;
    for (int h = 0; h < Hkv; ++h) {
      for (int64_t k0 = first_key(b) / kKeys * kKeys; k0 < len + extra; k0 += kKeys) pack.push_back({b, h, k0, 0, 0});
      for (int64_t t0 = 0; t0 < ext; t0 += kQTile) {
        const int64_t t1 = std::min(ext, t0 + kQTile), keys = len - ext + (t0 + t1) / 2;
        work.push_back({b, h, t0, t1, (t1 - t0) * (window > 0 ? std::min(window, keys) : keys)});
      }
    }
  }
  // Longest tasks first, so that the dynamic schedule ends with short ones.
  std::sort(work.begin(), work.end(), [](const Task& x, const Task& y) { return x.cost > y.cost; });
  const int64_t npack = (int64_t)pack.size(), nwork = (int64_t)work.size();
#pragma omp parallel num_threads(nthreads)
  {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < npack; ++i) {
      const Task& t = pack[i];
      const int64_t off = kv_indptr[t.b], len = kv_indptr[t.b + 1] - off;
      pack_block<D>(pool, t.h, kv_indices + off, len, t.t0, kpack(t.b, t.h) + t.t0 * D / 2,
                    vpack(t.b, t.h) + t.t0 * D / 2, first_key(t.b));
    }
    // Rows (token, group head) of task t, token-major, from r0 on: R of them, the tail
    // repeating the last real one. Returns the key the rows' packed K/V are read from (0 without
    // a window; with one, the 16-key tile holding the rows' first visible key: the rows span at
    // most 16 tokens, so each row's first visible key lies in the first 32 keys read, the
    // invariant the online softmax's first block needs), kend and kbeg relative to it.
    auto fill = [&](const Task& t, int64_t r0, int64_t nrows, auto& rows) -> int64_t {
      constexpr int R = (int)(sizeof(rows.kend) / sizeof(rows.kend[0]));
      static_assert(R <= 16, "a row tile spans at most 16 tokens");
      const int64_t len = kv_indptr[t.b + 1] - kv_indptr[t.b], ext = q_indptr[t.b + 1] - q_indptr[t.b];
      rows.n = (int)std::min<int64_t>(R, nrows - r0);
      const int64_t tok0 = t.t0 + r0 / G;  // the tile's first (and earliest) token
      const int64_t kbase = window > 0 ? std::max<int64_t>(0, len - ext + tok0 + 1 - window) / 16 * 16 : 0;
      for (int r = 0; r < R; ++r) {
        const int64_t row = r0 + std::min(r, rows.n - 1);
        const int64_t tok = t.t0 + row / G, head = (int64_t)t.h * G + row % G;
        rows.q[r] = q + (q_indptr[t.b] + tok) * q_stride + head * D;
        rows.out[r] = out + (q_indptr[t.b] + tok) * out_stride + head * D;
        rows.kend[r] = len - ext + tok + 1 - kbase;
        rows.kbeg[r] = window > 0 ? std::max<int64_t>(0, len - ext + tok + 1 - window) - kbase : 0;
      }
      return kbase;
    };
#ifdef RADIXLM_BF16_AMX
    const bool tiles = amx_attends<D>() && radixlm::amx::enabled();
    if (tiles) radixlm::amx::configure();
#else
    constexpr bool tiles = false;
    (void)tiles;
#endif
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < nwork; ++i) {
      const Task& t = work[i];
      const int64_t nrows = (t.t1 - t.t0) * G;
#ifdef RADIXLM_BF16_AMX
      if constexpr (amx_attends<D>()) {
        if (tiles) {
          for (int64_t r0 = 0; r0 < nrows; r0 += kAmxRows) {
            AmxRows rows;
            const int64_t kbase = fill(t, r0, nrows, rows);
            attend_rows_amx<D>(rows, kpack(t.b, t.h) + kbase * D / 2, vpack(t.b, t.h) + kbase * D / 2, scale);
          }
          continue;
        }
      }
#endif
      for (int64_t r0 = 0; r0 < nrows; r0 += kRows) {
        Rows rows;
        const int64_t kbase = fill(t, r0, nrows, rows);
        attend_rows<D>(rows, kpack(t.b, t.h) + kbase * D / 2, vpack(t.b, t.h) + kbase * D / 2, scale);
      }
    }
#ifdef RADIXLM_BF16_AMX
    if (tiles) _tile_release();
#endif
  }
}

template <int D>
void extend_attention(const uint16_t* q, int64_t q_stride, const Pool& pool, const int64_t* q_indptr,
                      const int64_t* kv_indptr, const int64_t* kv_indices, uint16_t* out, int64_t out_stride, int B,
                      int Hq, float scale, int64_t pack_budget, int64_t window, int nthreads) {
  // Packed K and V of request b, in bytes (as extend_group lays them out).
  const int64_t extra = window > 0 ? 16 : 0;
  auto bytes_of = [&](int b) { return 2 * pool.Hkv * packed_words<D>(kv_indptr[b + 1] - kv_indptr[b] + extra) * 4; };
  for (int b0 = 0; b0 < B;) {
    int b1 = b0 + 1;
    int64_t bytes = bytes_of(b0);
    while (b1 < B) {
      const int64_t more = bytes_of(b1);
      if (bytes + more > pack_budget) break;
      bytes += more;
      ++b1;
    }
    extend_group<D>(q, q_stride, pool, q_indptr, kv_indptr, kv_indices, out, out_stride, b0, b1, Hq, scale, window,
                    nthreads);
    b0 = b1;
  }
}

}  // namespace
#endif

extern "C" {

int radixlm_extend_attention_available() {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  return 1;
#else
  return 0;
#endif
}

// Request b: query rows q_indptr[b] .. q_indptr[b+1] (its new tokens, in order, the last of
// them the request's last key), keys kv_indices[kv_indptr[b] .. kv_indptr[b+1]] (pool slots,
// prefix then new tokens; the new tokens' K/V already stored). q/out rows [Hq][D] at their row
// strides, kbuf/vbuf [slots][Hkv][D]: bf16, or int8 when k_scale/v_scale ([slots][Hkv] float32,
// the int8 KV cache's scales) are given. Requests are packed and attended in groups whose packed
// K + V fit pack_budget bytes (at least one request per group), so the workspace stays bounded
// whatever the contexts' lengths. window > 0: a sliding-window layer, the new token at key
// position p sees keys p - window < j <= p only (those before are neither packed nor read).
// Nonzero return = unsupported (nothing written).
int radixlm_extend_attention_window_bf16(const void* q, int64_t q_stride, const void* kbuf, const void* vbuf,
                                         const float* k_scale, const float* v_scale, const int64_t* q_indptr,
                                         const int64_t* kv_indptr, const int64_t* kv_indices, void* out,
                                         int64_t out_stride, int B, int Hq, int Hkv, int D, float scale,
                                         int64_t pack_budget, int64_t window, int nthreads) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  if (Hkv <= 0 || Hq % Hkv || !k_scale != !v_scale || window < 0) return -1;
  const Pool pool{kbuf, vbuf, k_scale, v_scale, Hkv};
  for (int b = 0; b < B; ++b)
    if (q_indptr[b + 1] - q_indptr[b] > kv_indptr[b + 1] - kv_indptr[b]) return -1;
#define RADIXLM_EXTEND(DIM)                                                                                  \
  case DIM:                                                                                                  \
    extend_attention<DIM>((const uint16_t*)q, q_stride, pool, q_indptr, kv_indptr, kv_indices, (uint16_t*)out, \
                          out_stride, B, Hq, scale, pack_budget, window, nthreads);                            \
    return 0;
  switch (D) {
    RADIXLM_EXTEND(32)
    RADIXLM_EXTEND(64)
    RADIXLM_EXTEND(96)
    RADIXLM_EXTEND(128)
    RADIXLM_EXTEND(256)
    default:
      return -2;
  }
#undef RADIXLM_EXTEND
#else
  (void)q, (void)q_stride, (void)kbuf, (void)vbuf, (void)k_scale, (void)v_scale, (void)q_indptr;
  (void)kv_indptr, (void)kv_indices, (void)out, (void)out_stride, (void)B, (void)Hq, (void)Hkv, (void)D;
  (void)scale, (void)pack_budget, (void)window, (void)nthreads;
  return -1;
#endif
}

// The same without a window (every key up to each token's own).
int radixlm_extend_attention_bf16(const void* q, int64_t q_stride, const void* kbuf, const void* vbuf,
                                  const float* k_scale, const float* v_scale, const int64_t* q_indptr,
                                  const int64_t* kv_indptr, const int64_t* kv_indices, void* out,
                                  int64_t out_stride, int B, int Hq, int Hkv, int D, float scale, int64_t pack_budget,
                                  int nthreads) {
  return radixlm_extend_attention_window_bf16(q, q_stride, kbuf, vbuf, k_scale, v_scale, q_indptr, kv_indptr,
                                              kv_indices, out, out_stride, B, Hq, Hkv, D, scale, pack_budget, 0,
                                              nthreads);
}

}  // extern "C"

// The machine's limits for docs/performance.md, measured by benchmark/micro/roofline.py:
// per-core peak multiply-accumulates in each instruction form the kernels use, the clock,
// and DRAM read bandwidth. Each peak loop runs independent accumulator chains (more than
// latency x pipes), so it measures throughput, not latency. Built with -O3 -march=native.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "amx.h"  // the kernels' own tile permission and configuration (radixlm/kernels/cpu)

extern "C" {

// Dependent 64-bit multiplies, 3 cycles each on the x86 cores of this project's hosts (Zen 3-4,
// Sapphire Rapids): cycles per iteration x iterations / seconds is the core clock. (A chain of
// `add $1` read 6.1 GHz on a Xeon AMX host, which runs such adds faster than one a cycle.)
int64_t rl_clock(int64_t iters) {
  int64_t x = 1;
  const int64_t one = 1;
  for (int64_t i = 0; i < iters; ++i) asm volatile("imul %1, %0" : "+r"(x) : "r"(one));
  return x;
}
int64_t rl_clock_cycles_per_iter() { return 3; }

// The peak loops are inline assembly: with C intrinsics and arrays of accumulators the
// compiler kept them on the stack, which measures the store-to-load path instead.
#define RL_REP12(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)

// For the loops shaped like a kernel: operands read from L1, 24 accumulators zeroed, the
// registers they clobber.
[[maybe_unused]] alignas(64) static uint8_t rl_l1[4096];
#define RL_ZERO24 "vpxord %%zmm0, %%zmm0, %%zmm0\n" RL_REP12(RL_Z) RL_Z(12) RL_Z(13) RL_Z(14) RL_Z(15) \
  RL_Z(16) RL_Z(17) RL_Z(18) RL_Z(19) RL_Z(20) RL_Z(21) RL_Z(22) RL_Z(23)
#define RL_Z(i) "vmovaps %%zmm0, %%zmm" #i "\n"
#define RL_CLOBBER24                                                                                        \
  "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", \
      "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18", "xmm19", "xmm20", "xmm21", "xmm22", "xmm23",     \
      "xmm24", "xmm25", "xmm26", "xmm27", "xmm28", "memory", "cc"

#if defined(__FMA__)
// fp32 FMA on 256-bit vectors: 12 independent vfmadd231ps chains (latency 4 x 2 pipes).
double rl_fma256(int64_t iters) {
  asm volatile(
      "vxorps %%ymm0, %%ymm0, %%ymm0\n"
#define X(i) "vmovaps %%ymm0, %%ymm" #i "\n"
      RL_REP12(X)
#undef X
      "vmovaps %%ymm0, %%ymm12\n vmovaps %%ymm0, %%ymm13\n"
      "1:\n"
#define X(i) "vfmadd231ps %%ymm12, %%ymm13, %%ymm" #i "\n"
      RL_REP12(X)
#undef X
      "dec %0\n jnz 1b\n"
      : "+r"(iters)
      :
      : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11",
        "xmm12", "xmm13", "cc");
  return 0;
}
int64_t rl_fma256_macs_per_iter() { return 12 * 8; }
#endif

#if defined(__AVX2__)
// int8 dot on AVX2 as the int8 GEMM does it (quant_ops.cpp): vpsignb, vpmaddubsw, vpmaddwd
// with ones, vpaddd = 32 MACs per 4 instructions; 6 independent chains.
double rl_int8_avx2(int64_t iters) {
  asm volatile(
      "vpxor %%ymm0, %%ymm0, %%ymm0\n vmovdqa %%ymm0, %%ymm1\n vmovdqa %%ymm0, %%ymm2\n"
      "vmovdqa %%ymm0, %%ymm3\n vmovdqa %%ymm0, %%ymm4\n vmovdqa %%ymm0, %%ymm5\n"
      "vpcmpeqw %%ymm15, %%ymm15, %%ymm15\n vpabsw %%ymm15, %%ymm15\n"  // ones (int16)
      "vpcmpeqb %%ymm14, %%ymm14, %%ymm14\n vpabsb %%ymm14, %%ymm13\n"  // w = -1, |w| = 1
      "1:\n"
      "vpsignb %%ymm14, %%ymm13, %%ymm6\n vpsignb %%ymm14, %%ymm13, %%ymm7\n vpsignb %%ymm14, %%ymm13, %%ymm8\n"
      "vpsignb %%ymm14, %%ymm13, %%ymm9\n vpsignb %%ymm14, %%ymm13, %%ymm10\n vpsignb %%ymm14, %%ymm13, %%ymm11\n"
      "vpmaddubsw %%ymm6, %%ymm13, %%ymm6\n vpmaddubsw %%ymm7, %%ymm13, %%ymm7\n vpmaddubsw %%ymm8, %%ymm13, %%ymm8\n"
      "vpmaddubsw %%ymm9, %%ymm13, %%ymm9\n vpmaddubsw %%ymm10, %%ymm13, %%ymm10\n vpmaddubsw %%ymm11, %%ymm13, %%ymm11\n"
      "vpmaddwd %%ymm15, %%ymm6, %%ymm6\n vpmaddwd %%ymm15, %%ymm7, %%ymm7\n vpmaddwd %%ymm15, %%ymm8, %%ymm8\n"
      "vpmaddwd %%ymm15, %%ymm9, %%ymm9\n vpmaddwd %%ymm15, %%ymm10, %%ymm10\n vpmaddwd %%ymm15, %%ymm11, %%ymm11\n"
      "vpaddd %%ymm6, %%ymm0, %%ymm0\n vpaddd %%ymm7, %%ymm1, %%ymm1\n vpaddd %%ymm8, %%ymm2, %%ymm2\n"
      "vpaddd %%ymm9, %%ymm3, %%ymm3\n vpaddd %%ymm10, %%ymm4, %%ymm4\n vpaddd %%ymm11, %%ymm5, %%ymm5\n"
      "dec %0\n jnz 1b\n"
      : "+r"(iters)
      :
      : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11",
        "xmm12", "xmm13", "xmm14", "xmm15", "cc");
  return 0;
}
int64_t rl_int8_avx2_macs_per_iter() { return 6 * 32; }
#endif

#if defined(__AVX512F__)
double rl_fma512(int64_t iters) {
  asm volatile(
      "vxorps %%zmm0, %%zmm0, %%zmm0\n"
#define X(i) "vmovaps %%zmm0, %%zmm" #i "\n"
      RL_REP12(X)
#undef X
      "vmovaps %%zmm0, %%zmm12\n vmovaps %%zmm0, %%zmm13\n"
      "1:\n"
#define X(i) "vfmadd231ps %%zmm12, %%zmm13, %%zmm" #i "\n"
      RL_REP12(X)
#undef X
      "dec %0\n jnz 1b\n"
      : "+r"(iters)
      :
      : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11",
        "xmm12", "xmm13", "cc");
  return 0;
}
int64_t rl_fma512_macs_per_iter() { return 12 * 16; }
#endif

#if defined(__AVX512VNNI__)
double rl_vnni512(int64_t iters) {
  asm volatile(
      "vpxord %%zmm0, %%zmm0, %%zmm0\n"
#define X(i) "vmovdqa64 %%zmm0, %%zmm" #i "\n"
      RL_REP12(X)
#undef X
      "vmovdqa64 %%zmm0, %%zmm12\n vmovdqa64 %%zmm0, %%zmm13\n"
      "1:\n"
#define X(i) "vpdpbusd %%zmm12, %%zmm13, %%zmm" #i "\n"
      RL_REP12(X)
#undef X
      "dec %0\n jnz 1b\n"
      : "+r"(iters)
      :
      : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11",
        "xmm12", "xmm13", "cc");
  return 0;
}
int64_t rl_vnni512_macs_per_iter() { return 12 * 64; }

// The w8a8 GEMM's micro-kernel for one group of 32 k (quant_ops.cpp): 12 int32 accumulators
// started from the group's correction, 8 k-quads of 2 weight loads, 6 broadcasts and 12
// vpdpbusd, then the fold of each accumulator into its float sum (vcvtdq2ps + vfmadd231ps by
// the row's group scale). Against vnni512 it shows what the per-group scales cost.
#define RL_KQ(o)                                                                                     \
  "vmovdqa64 " #o "(%1), %%zmm28\n vmovdqa64 " #o "+64(%1), %%zmm29\n"                             \
  "vpbroadcastd 1024(%1), %%zmm24\n vpdpbusd %%zmm28, %%zmm24, %%zmm0\n vpdpbusd %%zmm29, %%zmm24, %%zmm1\n"  \
  "vpbroadcastd 1028(%1), %%zmm25\n vpdpbusd %%zmm28, %%zmm25, %%zmm2\n vpdpbusd %%zmm29, %%zmm25, %%zmm3\n"  \
  "vpbroadcastd 1032(%1), %%zmm26\n vpdpbusd %%zmm28, %%zmm26, %%zmm4\n vpdpbusd %%zmm29, %%zmm26, %%zmm5\n"  \
  "vpbroadcastd 1036(%1), %%zmm27\n vpdpbusd %%zmm28, %%zmm27, %%zmm6\n vpdpbusd %%zmm29, %%zmm27, %%zmm7\n"  \
  "vpbroadcastd 1040(%1), %%zmm24\n vpdpbusd %%zmm28, %%zmm24, %%zmm8\n vpdpbusd %%zmm29, %%zmm24, %%zmm9\n"  \
  "vpbroadcastd 1044(%1), %%zmm25\n vpdpbusd %%zmm28, %%zmm25, %%zmm10\n vpdpbusd %%zmm29, %%zmm25, %%zmm11\n"
#define RL_F(i, f, sc) "vcvtdq2ps %%zmm" #i ", %%zmm" #i "\n vfmadd231ps %%zmm" #sc ", %%zmm" #i ", %%zmm" #f "\n"
#define RL_FOLD2(off, r, i0, i1, f0, f1) "vbroadcastss " #off "(%1), %%zmm" #r "\n" RL_F(i0, f0, r) RL_F(i1, f1, r)
#define RL_START(i, k) "vmovdqa64 %%zmm" #k ", %%zmm" #i "\n"
double rl_vnni512_group(int64_t iters) {
  asm volatile(
      RL_ZERO24
      "vmovdqa64 2048(%1), %%zmm30\n vmovdqa64 2112(%1), %%zmm31\n"
      "1:\n"
      RL_START(0, 30) RL_START(1, 31) RL_START(2, 30) RL_START(3, 31) RL_START(4, 30) RL_START(5, 31)
      RL_START(6, 30) RL_START(7, 31) RL_START(8, 30) RL_START(9, 31) RL_START(10, 30) RL_START(11, 31)
      RL_KQ(0) RL_KQ(128) RL_KQ(256) RL_KQ(384) RL_KQ(512) RL_KQ(640) RL_KQ(768) RL_KQ(896)
      RL_FOLD2(1536, 24, 0, 1, 12, 13) RL_FOLD2(1540, 25, 2, 3, 14, 15) RL_FOLD2(1544, 26, 4, 5, 16, 17)
      RL_FOLD2(1548, 27, 6, 7, 18, 19) RL_FOLD2(1552, 24, 8, 9, 20, 21) RL_FOLD2(1556, 25, 10, 11, 22, 23)
      "dec %0\n jnz 1b\n"
      : "+r"(iters)
      : "r"(rl_l1)
      : RL_CLOBBER24, "xmm29", "xmm30", "xmm31");
  return 0;
}
int64_t rl_vnni512_group_macs_per_iter() { return 96 * 64; }
#endif

#if defined(__AVX512BF16__)
double rl_bf16dp512(int64_t iters) {
  asm volatile(
      "vpxord %%zmm0, %%zmm0, %%zmm0\n"
#define X(i) "vmovaps %%zmm0, %%zmm" #i "\n"
      RL_REP12(X)
#undef X
      "vmovaps %%zmm0, %%zmm12\n vmovaps %%zmm0, %%zmm13\n"
      "1:\n"
#define X(i) "vdpbf16ps %%zmm12, %%zmm13, %%zmm" #i "\n"
      RL_REP12(X)
#undef X
      "dec %0\n jnz 1b\n"
      : "+r"(iters)
      :
      : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11",
        "xmm12", "xmm13", "cc");
  return 0;
}
int64_t rl_bf16dp512_macs_per_iter() { return 12 * 32; }

// The bf16 GEMM's micro-kernel as it runs (bf16_gemm.cpp): per k pair 4 weight vectors loaded
// and 6 rows' (x[k], x[k+1]) broadcast from L1 by vpbroadcastd, 24 vdpbf16ps. Against
// bf16dp512 it shows what the loads and broadcasts cost the dot products.
#define RL_ROW(off, a0, a1, a2, a3)                                                               \
  "vpbroadcastd " #off "(%1), %%zmm28\n"                                                        \
  "vdpbf16ps %%zmm24, %%zmm28, %%zmm" #a0 "\n vdpbf16ps %%zmm25, %%zmm28, %%zmm" #a1 "\n"       \
  "vdpbf16ps %%zmm26, %%zmm28, %%zmm" #a2 "\n vdpbf16ps %%zmm27, %%zmm28, %%zmm" #a3 "\n"
double rl_bf16dp512_tile(int64_t iters) {
  asm volatile(
      RL_ZERO24
      "1:\n"
      "vmovdqa64 (%1), %%zmm24\n vmovdqa64 64(%1), %%zmm25\n vmovdqa64 128(%1), %%zmm26\n vmovdqa64 192(%1), %%zmm27\n"
      RL_ROW(256, 0, 1, 2, 3) RL_ROW(320, 4, 5, 6, 7) RL_ROW(384, 8, 9, 10, 11)
      RL_ROW(448, 12, 13, 14, 15) RL_ROW(512, 16, 17, 18, 19) RL_ROW(576, 20, 21, 22, 23)
      "dec %0\n jnz 1b\n"
      : "+r"(iters)
      : "r"(rl_l1)
      : RL_CLOBBER24);
  return 0;
}
int64_t rl_bf16dp512_tile_macs_per_iter() { return 24 * 32; }
#endif

#ifdef RADIXLM_BF16_AMX
// bf16 tile products: four independent TDPBF16PS chains (C tiles 0-3 from A tiles 4-5 and B
// tiles 6-7), each 16 x 16 x 32 = 8,192 multiply-accumulates.
double rl_amx_bf16(int64_t iters) {
  if (!radixlm::amx::permitted()) return -1;
  radixlm::amx::configure();
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
  for (int64_t i = 0; i < iters; ++i) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_release();
  return 0;
}
int64_t rl_amx_bf16_macs_per_iter() { return 4 * 16 * 16 * 32; }
#endif

// Sum of a buffer's 64-bit words read with 256-bit loads by nthreads threads (each its own
// contiguous share): read bandwidth when the buffer is far larger than the caches.
int64_t rl_read(const int64_t* p, int64_t n, int nthreads) {
  int64_t total = 0;
#pragma omp parallel num_threads(nthreads) reduction(+ : total)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t per = (n / nt) & ~(int64_t)15, b = t * per, e = t == nt - 1 ? n & ~(int64_t)15 : b + per;
#if defined(__AVX2__)
    __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
    for (int64_t i = b; i < e; i += 16) {
      s0 = _mm256_add_epi64(s0, _mm256_loadu_si256((const __m256i*)(p + i)));
      s1 = _mm256_add_epi64(s1, _mm256_loadu_si256((const __m256i*)(p + i + 4)));
      s2 = _mm256_add_epi64(s2, _mm256_loadu_si256((const __m256i*)(p + i + 8)));
      s3 = _mm256_add_epi64(s3, _mm256_loadu_si256((const __m256i*)(p + i + 12)));
    }
    int64_t o[4];
    _mm256_storeu_si256((__m256i*)o, _mm256_add_epi64(_mm256_add_epi64(s0, s1), _mm256_add_epi64(s2, s3)));
    total += o[0] + o[1] + o[2] + o[3];
#else
    for (int64_t i = b; i < e; ++i) total += p[i];
#endif
  }
  return total;
}

// Decode's read pattern: `reqs` requests whose rows (row_bytes each, a multiple of 32) are
// interleaved in the pool the way one slot per request per decode step leaves them (row j of
// request r at slot (j / run * reqs + r) * run + j % run), read request by request by
// nthreads threads. run = 1 is a pool filled by decode steps alone; larger runs are what a
// paged allocator would give. Returns a checksum; the caller times it.
int64_t rl_read_rows(const int64_t* p, int64_t row_bytes, int64_t rows_per_req, int64_t reqs, int64_t run,
                     int nthreads) {
  int64_t total = 0;
  const int64_t words = row_bytes / 8;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) reduction(+ : total)
  for (int64_t r = 0; r < reqs; ++r) {
#if defined(__AVX2__)
    __m256i s = _mm256_setzero_si256();
    for (int64_t j = 0; j < rows_per_req; ++j) {
      const int64_t* row = p + ((j / run * reqs + r) * run + j % run) * words;
      for (int64_t w = 0; w < words; w += 4) s = _mm256_add_epi64(s, _mm256_loadu_si256((const __m256i*)(row + w)));
    }
    int64_t o[4];
    _mm256_storeu_si256((__m256i*)o, s);
    total += o[0] + o[1] + o[2] + o[3];
#else
    for (int64_t j = 0; j < rows_per_req; ++j) {
      const int64_t* row = p + ((j / run * reqs + r) * run + j % run) * words;
      for (int64_t w = 0; w < words; ++w) total += row[w];
    }
#endif
  }
  return total;
}

}  // extern "C"

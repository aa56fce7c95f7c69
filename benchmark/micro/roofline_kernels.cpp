// The machine's limits for docs/roofline.md, measured by benchmark/micro/roofline.py:
// per-core peak multiply-accumulates in each instruction form the kernels use, the clock,
// and DRAM read bandwidth. Each peak loop runs independent accumulator chains (more than
// latency x pipes), so it measures throughput, not latency. Built with -O3 -march=native.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

extern "C" {

// Dependent 64-bit adds: one per cycle, so iterations / seconds is the core clock.
int64_t rl_clock(int64_t iters) {
  int64_t x = 0;
  for (int64_t i = 0; i < iters; ++i) asm volatile("add $1, %0" : "+r"(x));
  return x;
}

// The peak loops are inline assembly: with C intrinsics and arrays of accumulators the
// compiler kept them on the stack, which measures the store-to-load path instead.
#define RL_REP12(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)

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
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// bf16 tile products: four independent TDPBF16PS chains (C tiles 0-3 from A tiles 4-5 and B
// tiles 6-7), each 16 x 16 x 32 = 8,192 multiply-accumulates.
struct alignas(64) RlTileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
double rl_amx_bf16(int64_t iters) {
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0) return -1;
  RlTileConfig c;
  memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = 16;
  }
  asm volatile("ldtilecfg %0" : : "m"(c));  // _tile_loadconfig: gcc drops the stores to c
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

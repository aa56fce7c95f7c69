// The task split shared by the panel GEMMs (float_gemm.cpp, bf16_gemm.cpp): tasks of
// (row block, panel), row-block-major, so each thread keeps one block of activation rows in L2
// while it streams its share of the panels (a decode batch is one row block); within a task the
// block's rows are spread evenly over micro-tiles of at most MR rows (32 rows, MR 6:
// 6,6,5,5,5,5), as the int8 GEMM does.
#pragma once

#include <stdint.h>
#include <algorithm>

namespace radixlm {

// tile(m0, rows, p): rows (1..MR) activation rows from m0 on, times panel p.
template <int MR, typename Tile>
void run_gemm_tasks(int64_t M, int N, int K, int NR, int64_t row_block, int nthreads, Tile&& tile) {
  if (M <= 0) return;
  const int panels = (N + NR - 1) / NR;
  const int64_t tasks = (M + row_block - 1) / row_block * panels;
  const bool parallel = (int64_t)M * N * K >= (int64_t)1 << 20;
#pragma omp parallel for num_threads(nthreads) if (parallel) schedule(static)
  for (int64_t t = 0; t < tasks; ++t) {
    const int p = (int)(t % panels);
    const int64_t r0 = t / panels * row_block, r1 = std::min(M, r0 + row_block);
    const int64_t steps = (r1 - r0 + MR - 1) / MR;
    const int64_t base = (r1 - r0) / steps, extra = (r1 - r0) % steps;
    int64_t m0 = r0;
    for (int64_t s = 0; s < steps; ++s) {
      const int rows = (int)(base + (s < extra ? 1 : 0));
      tile(m0, rows, p);
      m0 += rows;
    }
  }
}

}  // namespace radixlm

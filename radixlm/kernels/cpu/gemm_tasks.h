// The task split shared by the panel GEMMs (float_gemm.cpp, bf16_gemm.cpp): tasks of
// (row block, panel), row-block-major, so each thread keeps one block of activation rows in L2
// while it streams its share of the panels (a decode batch is one row block); within a task the
// block's rows are spread evenly over micro-tiles of at most MR rows (32 rows, MR 6:
// 6,6,5,5,5,5), as the int8 GEMM does.
//
// Each thread takes one contiguous range of micro-tiles in that order (or, past one row block,
// claims them a task at a time from one end of its range: run_two_ended), so it knows which
// panel it multiplies next: a tile is told that panel and its own share of it (micro-tile s of
// steps), to fetch into L2 while it computes (NextPanel). Which thread computes an output does
// not change its value.
#pragma once

#include <stdint.h>
#include <algorithm>
#include <atomic>
#include <vector>

#include <omp.h>

namespace radixlm {

// The panel this thread multiplies after the current task (-1: none), and which of the
// current task's micro-tiles this is. The first micro-tile streams the current panel from
// DRAM and fetches nothing more; tiles 1 .. steps-1 share the next panel between them, when
// there are at least kMinPrefetchSteps tiles: with fewer the GEMM is held by DRAM, not by the
// dot products, and the fetches only added to the loop (the 30 layers' linears at batch 1:
// 10.3 ms instead of 9.3 with every tile fetching; batch 8, two tiles: 14.9 instead of 14.3).
constexpr int kMinPrefetchSteps = 3;
struct NextPanel {
  int panel;
  int s, steps;
  bool fetches() const { return panel >= 0 && s > 0 && steps >= kMinPrefetchSteps; }
  // [begin, end) of n units (k pairs, k rows) that this tile fetches.
  int begin(int n) const { return fetches() ? (int)((int64_t)n * (s - 1) / (steps - 1)) : 0; }
  int end(int n) const { return fetches() ? (int)((int64_t)n * s / (steps - 1)) : 0; }
};

// M activation rows in blocks of row_block; a block's rows spread evenly over its micro-tiles
// of at most MR rows (the first rows % steps of them one row longer).
template <int MR>
struct RowBlocks {
  int64_t M, row_block;
  int64_t count() const { return (M + row_block - 1) / row_block; }
  int64_t rows(int64_t b) const { return std::min(M, (b + 1) * row_block) - b * row_block; }
  static int64_t steps(int64_t rows) { return (rows + MR - 1) / MR; }
  // Micro-tile s of a block of `rows` rows: its first row in the block, and its rows.
  static int64_t tile_start(int64_t rows, int64_t s) {
    return s * (rows / steps(rows)) + std::min(s, rows % steps(rows));
  }
  static int tile_rows(int64_t rows, int64_t s) { return (int)(rows / steps(rows) + (s < rows % steps(rows) ? 1 : 0)); }
};

// Thread id's share: the micro-tiles, in (row block, panel) order, whose middle row falls in the
// id-th of nt equal shares of the M x panels rows to multiply. A task may be split between two
// threads (both read its panel): a decode batch (one row block) is split by micro-tiles, not
// panels, so a panel count that does not divide by the threads (9 panels of 64 for hidden 576,
// 15 for its qkv) does not leave one thread a panel more to do while the other waits; several
// row blocks are shared by rows, not by whole tasks (those gave one thread every full 96-row
// block and the other the short last one: at 100 rows one thread did all the work, and 100 to
// 700 rows took 1.1-1.9x as long).
template <int MR, typename Tile>
void run_row_share(int64_t M, int panels, int64_t row_block, int64_t nt, int64_t id, Tile&& tile) {
  using RB = RowBlocks<MR>;
  const RB rb{M, row_block};
  const int64_t blocks = rb.count(), per_full_block = row_block * panels;
  const int64_t lo = M * panels * id / nt, hi = M * panels * (id + 1) / nt;
  // Task (b, p) covers rows [b * per_full_block + p * rb.rows(b), + rb.rows(b)) of the order.
  int64_t b = std::min(blocks - 1, lo / per_full_block);
  int p = (int)((lo - b * per_full_block) / rb.rows(b));
  for (; b < blocks; ++b, p = 0) {
    const int64_t rows_b = rb.rows(b), steps = RB::steps(rows_b);
    for (; p < panels; ++p) {
      const int64_t first = b * per_full_block + p * rows_b;
      if (first >= hi) return;
      // The next task's panel is fetched while this one computes when this thread also
      // takes that task's first micro-tile.
      const bool last_panel = p + 1 == panels;
      const int64_t next_rows = last_panel ? (b + 1 < blocks ? rb.rows(b + 1) : 0) : rows_b;
      const int64_t next_first = first + rows_b;
      const int64_t next_tile_rows = next_rows ? RB::tile_rows(next_rows, 0) : 0;
      const int next = next_rows && 2 * next_first + next_tile_rows < 2 * hi ? (last_panel ? 0 : p + 1) : -1;
      for (int64_t s = 0; s < steps; ++s) {
        const int64_t m0 = RB::tile_start(rows_b, s);
        const int rows = RB::tile_rows(rows_b, s);
        const int64_t mid2 = 2 * (first + m0) + rows;  // twice the tile's middle row in the order
        if (mid2 >= 2 * lo && mid2 < 2 * hi) tile(b * row_block + m0, rows, p, NextPanel{next, (int)s, (int)steps});
      }
    }
  }
}

// Past one row block the split is dynamic, in units of at most kUnitTiles micro-tiles of one
// task (a whole task of a 96-row block): the static shares above, equal in rows, still ended
// ~80 us apart on average (2% of a 1,024-row GEMM; at random, not one thread always last), and
// the thread done first spun at the barrier. The threads go in pairs, each pair over one
// contiguous segment of the units, one from its front and one from its back, claiming a unit at
// a time from a shared count until they meet: each still runs a contiguous range in order and
// can fetch its next panel, and they end within a unit (~30 us at K 576) of each other.
constexpr int kUnitTiles = 16;

struct alignas(64) Claimed {  // a segment's count of claimed units, on its own cache line
  std::atomic<int64_t> n;
};

template <int MR, typename Tile>
void run_two_ended(int64_t M, int panels, int64_t row_block, int64_t nt, int64_t id, Claimed* claimed, Tile&& tile) {
  using RB = RowBlocks<MR>;
  const RB rb{M, row_block};
  const int64_t blocks = rb.count();
  const auto parts_of = [&](int64_t b) { return (RB::steps(rb.rows(b)) + kUnitTiles - 1) / kUnitTiles; };
  const int64_t per_block = panels * parts_of(0);  // units of a full block (all but maybe the last)
  const int64_t units = (blocks - 1) * per_block + panels * parts_of(blocks - 1);
  struct Unit {
    int64_t b;
    int p, part;
  };
  const auto unit_at = [&](int64_t u) {
    const int64_t b = std::min(blocks - 1, u / per_block), r = u - b * per_block, parts = parts_of(b);
    return Unit{b, (int)(r / parts), (int)(r % parts)};
  };
  // This thread's segment [lo, hi) of the units (a pair's: two shares; an odd count's last
  // thread has one alone), and its direction in it.
  const int64_t seg = id / 2, first = 2 * seg, last = std::min(nt, first + 2);
  const int64_t lo = units * first / nt, hi = units * last / nt;
  const bool back = id % 2 == 1;
  for (int64_t i = 0;; ++i) {
    if (claimed[seg].n.fetch_add(1, std::memory_order_relaxed) >= hi - lo) return;
    const int64_t u = back ? hi - 1 - i : lo + i, nu = back ? u - 1 : u + 1;
    const Unit t = unit_at(u);
    const int next_p = nu >= lo && nu < hi ? unit_at(nu).p : -1;
    const int next = next_p != t.p ? next_p : -1;  // the same panel needs no fetch
    const int64_t rows_b = rb.rows(t.b), steps = RB::steps(rows_b);
    const int64_t s0 = (int64_t)t.part * kUnitTiles, s1 = std::min(steps, s0 + kUnitTiles);
    for (int64_t s = s0; s < s1; ++s)
      tile(t.b * row_block + RB::tile_start(rows_b, s), RB::tile_rows(rows_b, s), t.p,
           NextPanel{next, (int)(s - s0), (int)(s1 - s0)});
  }
}

// tile(m0, rows, p, next): rows (1..MR) activation rows from m0 on, times panel p; each thread
// its run_row_share (one row block) or run_two_ended (more).
template <int MR, typename Tile>
void run_gemm_tasks(int64_t M, int N, int K, int NR, int64_t row_block, int nthreads, Tile&& tile) {
  if (M <= 0) return;
  const int panels = (N + NR - 1) / NR;
  const bool parallel = (int64_t)M * N * K >= (int64_t)1 << 20;
  if (!parallel || nthreads < 2 || M <= row_block) {
#pragma omp parallel num_threads(nthreads) if (parallel)
    run_row_share<MR>(M, panels, row_block, omp_get_num_threads(), omp_get_thread_num(), tile);
    return;
  }
  std::vector<Claimed> claimed(nthreads / 2 + 1);
  for (auto& c : claimed) c.n.store(0, std::memory_order_relaxed);
#pragma omp parallel num_threads(nthreads)
  run_two_ended<MR>(M, panels, row_block, omp_get_num_threads(), omp_get_thread_num(), claimed.data(), tile);
}

}  // namespace radixlm

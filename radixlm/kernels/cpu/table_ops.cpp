// The request-to-token table's rows as a decode step's attention reads them (kernels/indices.py
// is the torch formulation, for every device):
//   decode_rows:   CSR rows: indptr [B + 1] and indices = the concatenation over b of
//                  table[rows[b], 0:lens[b]], build_kv_indices + build_indptr of indices.py.
//   common_prefix: how many leading slots (<= limit) rows[0..B) of the table share.
// Why native: in torch a batch-32 step spent ~90 us gathering and compacting the rows and
// ~40 us comparing them, a few microseconds of copying; every decode step does both.

#include <stdint.h>
#include <string.h>

extern "C" {

// table [nrows, width]; indices has room for `room` entries. Errors: -2 a row or length
// outside the table, or more keys than room (nothing is read or written past the checks).
int radixlm_decode_rows(const int64_t* table, int64_t nrows, int64_t width, const int64_t* rows, const int64_t* lens,
                        int64_t B, int64_t* indptr, int64_t* indices, int64_t room) {
  indptr[0] = 0;
  for (int64_t b = 0; b < B; ++b) {
    if (rows[b] < 0 || rows[b] >= nrows || lens[b] < 0 || lens[b] > width || lens[b] > room - indptr[b]) return -2;
    memcpy(indices + indptr[b], table + rows[b] * width, sizeof(int64_t) * (size_t)lens[b]);
    indptr[b + 1] = indptr[b] + lens[b];
  }
  return 0;
}

// table [nrows, width], 0 <= limit <= width (so the answer fits an int). -2: a row outside
// the table.
int radixlm_common_prefix(const int64_t* table, int64_t nrows, int64_t width, const int64_t* rows, int64_t B,
                          int64_t limit) {
  if (limit < 0 || limit > width) return -2;
  for (int64_t b = 0; b < B; ++b)
    if (rows[b] < 0 || rows[b] >= nrows) return -2;
  const int64_t* first = table + rows[0] * width;
  int64_t n = limit;
  for (int64_t b = 1; b < B && n > 0; ++b) {
    const int64_t* r = table + rows[b] * width;
    int64_t i = 0;
    while (i < n && r[i] == first[i]) ++i;
    n = i;
  }
  return (int)n;
}

}  // extern "C"

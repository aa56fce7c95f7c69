// The decoder layers of a forward (Llama-shaped: pre-norm attention and gated MLP with the
// residual add fused into the next norm) as one call from Python: a decode step or short extends
// (one decode-kernel attention row per token), or long extends on the prefill kernel
// (extend_attention.cpp, Step.q_indptr set), whose last layer may run only for the rows that
// become logits (Step.rows).
//
// Why: the model's Python code calls ~12 native ops per layer, and each call costs 5-11 us of
// Python (argument checks, torch.empty for the output, ctypes' conversion of 10-18 arguments)
// while the second core waits. At the default model's 30 layers that was ~4 ms of a 9 ms
// batch-1 step and ~3 ms of a 24 ms batch-32 step (w8a8, measured with a same-depth model of
// hidden size 64, whose kernels take next to nothing), and ~3-6% of a 2k prompt's prefill. Here
// the same kernels run in the same order with the same arguments, so the result is bit for bit
// the Python path's (radixlm/srt/models/llama.py, LlamaDecoderLayer.forward, and the attention
// backend's forward / forward_rows): only the calls between them are gone.
// Two are merged: an int8 linear after a norm does the norm's rows in its own parallel region
// (int8_linear_norm), with the same row function as add_rmsnorm, so the bits stay the same.
//
// Contract (radixlm/kernels/cpu/decode_layers.py builds the tables):
//   residual [B, H] (model dtype) holds the embeddings on entry and the residual stream on exit
//   (up to the last layer's attention when Step.rows is set);
//   out [B, H] (or [num_rows, H] with Step.rows) receives norm(last layer's output + residual)
//   with final_norm's weight.
// Intermediate activations live in per-thread scratch that only grows.

#include <stdint.h>
#include <string.h>
#include <vector>

#include "row_spans.h"

extern "C" {
int radixlm_add_rmsnorm(int dtype, const void* x, int64_t x_stride, void* residual, const void* w, void* out,
                        int64_t n, int H, float eps, int nthreads);
int radixlm_rope_inplace(int dtype, void* x, int64_t n, int64_t x_stride, int nheads, int D, const int64_t* pos,
                         const float* cos_t, const float* sin_t, int nthreads);
int radixlm_silu_mul(int dtype, const void* gu, void* out, int64_t n, int I, int nthreads);
int radixlm_store_kv(int dtype, const void* k, int64_t k_stride, const void* v, int64_t v_stride, void* kbuf,
                     void* vbuf, const int64_t* loc, int64_t n, int64_t row);
int radixlm_decode_attention(int dtype, const void* q, int64_t q_stride, const void* k, const void* v,
                             const int64_t* indptr, const int64_t* indices, void* out, int64_t out_stride,
                             float* lse, int B, int Hq, int Hkv, int D, float scale, int nthreads);
int radixlm_store_kv_int8(int dtype, const void* k, int64_t k_stride, const void* v, int64_t v_stride, int8_t* kq,
                          int8_t* vq, float* ks, float* vs, const int64_t* loc, int64_t n, int Hkv, int D,
                          int nthreads);
int radixlm_decode_attention_int8(int dtype, const void* q, int64_t q_stride, const int8_t* k, const int8_t* v,
                                  const float* ks, const float* vs, const int64_t* indptr, const int64_t* indices,
                                  void* out, int64_t out_stride, float* lse, int B, int Hq, int Hkv, int D,
                                  float scale, int nthreads);
int radixlm_extend_attention_bf16(const void* q, int64_t q_stride, const void* kbuf, const void* vbuf,
                                  const float* k_scale, const float* v_scale, const int64_t* q_indptr,
                                  const int64_t* kv_indptr, const int64_t* kv_indices, void* out,
                                  int64_t out_stride, int B, int Hq, int Hkv, int D, float scale, int64_t pack_budget,
                                  int nthreads);
int radixlm_int8_linear(int x_dtype, const void* x, int64_t x_stride, int64_t M, int K, const int8_t* packed,
                        const int32_t* comp, const float* w_scale, int N, int out_dtype, const void* bias,
                        void* out, int64_t out_stride, int nthreads);
int radixlm_int8_linear_silu(int x_dtype, const void* x, int64_t x_stride, int64_t M, int K, const int8_t* packed,
                             const int32_t* comp, const float* w_scale, int N, int out_dtype, const void* bias,
                             void* out, int64_t out_stride, int nthreads);
int radixlm_int8_linear_norm(int x_dtype, const void* h, int64_t h_stride, void* residual, const void* w, float eps,
                             void* normed, int64_t M, int K, const int8_t* packed, const int32_t* comp,
                             const float* w_scale, int N, int out_dtype, const void* bias, void* out,
                             int64_t out_stride, int silu, int nthreads);
int radixlm_bf16_linear(const void* x, int64_t x_stride, int64_t M, int K, const void* packed, int N,
                        const void* bias, int out_dtype, void* out, int64_t out_stride, int nthreads);
int radixlm_bf16_linear_silu(const void* x, int64_t x_stride, int64_t M, int K, const void* packed, int N,
                             const void* bias, int out_dtype, void* out, int64_t out_stride, int nthreads);
int radixlm_float_linear(int x_dtype, const void* x, int64_t x_stride, int64_t M, int K, int w_dtype,
                         const void* packed, int N, int out_dtype, const void* bias, void* out, int64_t out_stride,
                         int nthreads);
}

namespace {

// Every field is 8 bytes wide, so the ctypes mirror (decode_layers.py) has no padding to match.
// kInt8Silu, kBf16PanelsSilu: gate_up only, packed silu-gated (gate_up_order.py): the GEMM
// gives silu(gate) * up, N / 2 columns.
enum LinearKind : int64_t { kInt8 = 1, kBf16Panels = 2, kFloatPanels = 3, kInt8Silu = 4, kBf16PanelsSilu = 5 };

struct Linear {
  int64_t kind, n, k, w_dtype;  // w_dtype: the float panels' dtype code (kFloatPanels only)
  const void* w;                // int8: packed tiles; otherwise the panels
  const void* comp;             // int8 only
  const void* scale;            // int8 only
  const void* bias;             // in the model dtype, or null
};

inline bool gives_silu(const Linear& L) { return L.kind == kInt8Silu || L.kind == kBf16PanelsSilu; }

struct Layer {
  const void* in_norm;
  const void* post_norm;
  Linear qkv, o, gate_up, down;
  void* k_buf;
  void* v_buf;
  float* k_scale;  // null: a float32/bf16 pool of the model dtype; else an int8 pool's scales
  float* v_scale;
};

struct Step {
  int64_t dtype, batch, hidden, heads, kv_heads, head_dim, intermediate, nthreads;
  double eps, scale;
  const int64_t* positions;
  const float* cos;
  const float* sin;
  const int64_t* out_loc;
  const int64_t* kv_indptr;   // decode-style: one CSR row of keys per token; extend: per request
  const int64_t* kv_indices;
  // Long extends on the prefill kernel (null: decode-style rows): request b's new tokens are
  // rows q_indptr[b] .. q_indptr[b + 1], of num_reqs requests; pack_budget as the kernel takes it.
  const int64_t* q_indptr;
  int64_t num_reqs, pack_budget;
  // With q_indptr and rows_indptr: the last layer attends, projects and runs its MLP only for
  // these num_rows token rows (possibly none), each request's last rows_indptr[b + 1] -
  // rows_indptr[b] tokens in order (what the attention backend's forward_rows takes);
  // rows_indptr null: every row.
  const int64_t* rows;
  int64_t num_rows;
  const int64_t* rows_indptr;
};

int run_linear(const Linear& L, int dtype, const void* x, int64_t M, void* out, int nt) {
  switch (L.kind) {
    case kInt8:
      return radixlm_int8_linear(dtype, x, L.k, M, (int)L.k, (const int8_t*)L.w, (const int32_t*)L.comp,
                                 (const float*)L.scale, (int)L.n, dtype, L.bias, out, L.n, nt);
    case kInt8Silu:
      return radixlm_int8_linear_silu(dtype, x, L.k, M, (int)L.k, (const int8_t*)L.w, (const int32_t*)L.comp,
                                      (const float*)L.scale, (int)L.n, dtype, L.bias, out, L.n / 2, nt);
    case kBf16Panels:
      return radixlm_bf16_linear(x, L.k, M, (int)L.k, L.w, (int)L.n, L.bias, dtype, out, L.n, nt);
    case kBf16PanelsSilu:
      return radixlm_bf16_linear_silu(x, L.k, M, (int)L.k, L.w, (int)L.n, L.bias, dtype, out, L.n / 2, nt);
    case kFloatPanels:
      return radixlm_float_linear(dtype, x, L.k, M, (int)L.k, (int)L.w_dtype, L.w, (int)L.n, dtype, L.bias, out,
                                  L.n, nt);
    default:
      return -100;
  }
}

// out = L(add_rmsnorm(h, residual, norm_w)), the normed rows also left in xn (an int8 L does the
// norm row by row in its own parallel region, the others after a separate add_rmsnorm); a
// silu-gated L gives silu(gate) * up.
int norm_then_linear(const Linear& L, int c, const void* h, void* residual, const void* norm_w, float eps, void* xn,
                     int64_t B, int64_t H, void* out, int nt) {
  if ((L.kind == kInt8 || L.kind == kInt8Silu) && H <= radixlm::kMaxNormRow)
    return radixlm_int8_linear_norm(c, h, H, residual, norm_w, eps, xn, B, (int)H, (const int8_t*)L.w,
                                    (const int32_t*)L.comp, (const float*)L.scale, (int)L.n, c, L.bias, out,
                                    gives_silu(L) ? L.n / 2 : L.n, gives_silu(L), nt);
  if (radixlm_add_rmsnorm(c, h, H, residual, norm_w, xn, B, (int)H, eps, nt)) return -1;
  return run_linear(L, c, xn, B, out, nt);
}

// Error codes: 1000 * (layer + 1) + the op that failed (its own code is lost: they are all
// "unsupported shape or build", which decode_layers.py checks before calling).
inline int fail(int64_t layer, int op) { return (int)(1000 * (layer + 1) + op); }

}  // namespace

extern "C" {

int radixlm_decode_layers(const Step* s, const Layer* layers, int64_t num_layers, void* residual,
                          const void* final_norm, void* out) {
  const int c = (int)s->dtype, nt = (int)s->nthreads;
  const int64_t B = s->batch, H = s->hidden, Hq = s->heads, Hkv = s->kv_heads, D = s->head_dim;
  const int64_t I = s->intermediate, nqkv = (Hq + 2 * Hkv) * D;
  const float eps = (float)s->eps, scale = (float)s->scale;
  const int64_t es = c == 0 ? 4 : 2;
  const bool extend = s->q_indptr != nullptr, some_rows = extend && s->rows_indptr != nullptr;
  const int64_t R = some_rows ? s->num_rows : B;  // rows the last layer continues with
  if (B <= 0) return 0;
  static thread_local std::vector<char> scratch;
  // normed input, qkv, attention output, a layer half's output (o or down), gate_up, SiLU*mul;
  // with rows, the last layer's selected queries and residual rows
  const int64_t sizes[8] = {B * H, B * nqkv, B * Hq * D, B * H, B * 2 * I, B * I, some_rows ? R * Hq * D : 0,
                            some_rows ? R * H : 0};
  int64_t total = 0;
  for (int64_t n : sizes) total += (n * es + 63) / 64 * 64;
  if ((int64_t)scratch.size() < total + 64) scratch.resize(total + 64);
  char* p = (char*)(((uintptr_t)scratch.data() + 63) & ~(uintptr_t)63);
  char* buf[8];
  for (int i = 0; i < 8; ++i) {
    buf[i] = p;
    p += (sizes[i] * es + 63) / 64 * 64;
  }
  char *xn = buf[0], *qkv = buf[1], *attn = buf[2], *half = buf[3], *gu = buf[4], *act = buf[5];
  char *q_rows = buf[6], *res_rows = buf[7];
  char* const k = qkv + Hq * D * es;
  char* const v = qkv + (Hq + Hkv) * D * es;
  char* res = (char*)residual;  // the residual stream of the rows still computed
  int64_t n = B;
  for (int64_t l = 0; l < num_layers; ++l) {
    const Layer& L = layers[l];
    // Layer 0 normalises the embeddings, which stay as the residual stream; later layers add
    // the previous layer's MLP output into it first.
    if (l == 0 ? norm_then_linear(L.qkv, c, residual, nullptr, L.in_norm, eps, xn, B, H, qkv, nt)
               : norm_then_linear(L.qkv, c, half, residual, L.in_norm, eps, xn, B, H, qkv, nt))
      return fail(l, 2);
    if (radixlm_rope_inplace(c, qkv, B, nqkv, (int)(Hq + Hkv), (int)D, s->positions, s->cos, s->sin, nt))
      return fail(l, 3);
    if (L.k_scale != nullptr)
      radixlm_store_kv_int8(c, k, nqkv, v, nqkv, (int8_t*)L.k_buf, (int8_t*)L.v_buf, L.k_scale, L.v_scale,
                            s->out_loc, B, (int)Hkv, (int)D, nt);
    else
      radixlm_store_kv(c, k, nqkv, v, nqkv, L.k_buf, L.v_buf, s->out_loc, B, Hkv * D);
    if (extend) {
      const void* q = qkv;
      int64_t q_stride = nqkv;
      const int64_t* q_indptr = s->q_indptr;
      if (some_rows && l == num_layers - 1) {  // every token's K/V is stored: the rest only for rows
        if (R == 0) return 0;
        for (int64_t i = 0; i < R; ++i) {
          memcpy(q_rows + i * Hq * D * es, qkv + s->rows[i] * nqkv * es, (size_t)(Hq * D * es));
          memcpy(res_rows + i * H * es, res + s->rows[i] * H * es, (size_t)(H * es));
        }
        q = q_rows, q_stride = Hq * D, q_indptr = s->rows_indptr, res = res_rows, n = R;
      }
      if (radixlm_extend_attention_bf16(q, q_stride, L.k_buf, L.v_buf, L.k_scale, L.v_scale, q_indptr,
                                        s->kv_indptr, s->kv_indices, attn, Hq * D, (int)s->num_reqs, (int)Hq,
                                        (int)Hkv, (int)D, scale, s->pack_budget, nt))
        return fail(l, 4);
    } else if (L.k_scale != nullptr) {
      if (radixlm_decode_attention_int8(c, qkv, nqkv, (const int8_t*)L.k_buf, (const int8_t*)L.v_buf, L.k_scale,
                                        L.v_scale, s->kv_indptr, s->kv_indices, attn, Hq * D, nullptr, (int)B,
                                        (int)Hq, (int)Hkv, (int)D, scale, nt))
        return fail(l, 4);
    } else if (radixlm_decode_attention(c, qkv, nqkv, L.k_buf, L.v_buf, s->kv_indptr, s->kv_indices, attn, Hq * D,
                                        nullptr, (int)B, (int)Hq, (int)Hkv, (int)D, scale, nt)) {
      return fail(l, 4);
    }
    if (run_linear(L.o, c, attn, n, half, nt)) return fail(l, 5);
    // A silu-gated gate_up writes silu(gate) * up straight into act.
    const bool fused_silu = gives_silu(L.gate_up);
    if (norm_then_linear(L.gate_up, c, half, res, L.post_norm, eps, xn, n, H, fused_silu ? act : gu, nt))
      return fail(l, 7);
    if (!fused_silu) radixlm_silu_mul(c, gu, act, n, (int)I, nt);
    if (run_linear(L.down, c, act, n, half, nt)) return fail(l, 8);
  }
  if (num_layers == 0) return radixlm_add_rmsnorm(c, residual, H, nullptr, final_norm, out, B, (int)H, eps, nt);
  return radixlm_add_rmsnorm(c, half, H, res, final_norm, out, n, (int)H, eps, nt) ? fail(num_layers, 9) : 0;
}

}  // extern "C"

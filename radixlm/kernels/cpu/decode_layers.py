"""The decoder layers of a forward (a decode step, short extends, or long extends on the prefill kernel) as one native call (decode_layers.cpp).

The caller (radixlm/srt/models/fused_decode.py) describes each layer once, by the tensors its
kernels read, as a `LayerSpec`; `DecodeLayers` keeps those tensors alive, holds the table of
their pointers, and runs a step with `run`. The kernels and their arguments are the ones the
Python layers call, so the output is bit for bit theirs.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from radixlm.kernels.cpu.build import load
from radixlm.kernels.cpu.ops import _DTYPE_CODE

INT8, BF16_PANELS, FLOAT_PANELS, INT8_SILU, BF16_PANELS_SILU = 1, 2, 3, 4, 5  # decode_layers.cpp LinearKind


class _Linear(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int64), ("n", ctypes.c_int64), ("k", ctypes.c_int64), ("w_dtype", ctypes.c_int64),
                ("w", ctypes.c_void_p), ("comp", ctypes.c_void_p), ("scale", ctypes.c_void_p),
                ("bias", ctypes.c_void_p)]


class _Layer(ctypes.Structure):
    _fields_ = [("in_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("qkv", _Linear), ("o", _Linear),
                ("gate_up", _Linear), ("down", _Linear), ("k_buf", ctypes.c_void_p), ("v_buf", ctypes.c_void_p),
                ("k_scale", ctypes.c_void_p), ("v_scale", ctypes.c_void_p)]


class _Step(ctypes.Structure):
    _fields_ = [("dtype", ctypes.c_int64), ("batch", ctypes.c_int64), ("hidden", ctypes.c_int64),
                ("heads", ctypes.c_int64), ("kv_heads", ctypes.c_int64), ("head_dim", ctypes.c_int64),
                ("intermediate", ctypes.c_int64), ("nthreads", ctypes.c_int64), ("eps", ctypes.c_double),
                ("scale", ctypes.c_double), ("positions", ctypes.c_void_p), ("cos", ctypes.c_void_p),
                ("sin", ctypes.c_void_p), ("out_loc", ctypes.c_void_p), ("kv_indptr", ctypes.c_void_p),
                ("kv_indices", ctypes.c_void_p), ("q_indptr", ctypes.c_void_p), ("num_reqs", ctypes.c_int64),
                ("pack_budget", ctypes.c_int64), ("rows", ctypes.c_void_p), ("num_rows", ctypes.c_int64),
                ("rows_indptr", ctypes.c_void_p)]


@dataclass
class LinearSpec:
    """One linear as its kernel takes it: kind INT8 (w = packed tiles, comp, scale: an
    int8_linear.Int8Weight), BF16_PANELS or FLOAT_PANELS (w = the panels); INT8_SILU and
    BF16_PANELS_SILU: a silu-gated gate_up (gate_up_order.py), whose GEMM gives silu(gate) * up,
    its bias in that order; bias in the model dtype or None."""
    kind: int
    n: int
    k: int
    w: torch.Tensor
    comp: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    bias: torch.Tensor | None = None


@dataclass
class LayerSpec:
    in_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: LinearSpec
    o: LinearSpec
    gate_up: LinearSpec
    down: LinearSpec
    k_buf: torch.Tensor
    v_buf: torch.Tensor
    k_scale: torch.Tensor | None = None  # an int8 pool's scales; None for a pool of the model dtype
    v_scale: torch.Tensor | None = None


@dataclass
class ExtendRows:
    """Long extends on the prefill kernel: q_indptr (int64 [requests + 1]) over the new tokens,
    the kernel's pack budget; rows (int64, each request's last rows_indptr[b + 1] -
    rows_indptr[b] tokens, in order), when the last layer runs only for them, else None."""
    q_indptr: torch.Tensor
    pack_budget: int
    rows: torch.Tensor | None = None
    rows_indptr: torch.Tensor | None = None


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _linear(spec: LinearSpec) -> _Linear:
    w_dtype = _DTYPE_CODE.get(spec.w.dtype, -1)
    return _Linear(spec.kind, spec.n, spec.k, w_dtype, _ptr(spec.w), _ptr(spec.comp), _ptr(spec.scale),
                   _ptr(spec.bias))


class DecodeLayers:
    """The pointer table of a model's layers, for as long as this object lives (it holds the
    tensors). Shapes: hidden H, heads Hq / Hkv of head_dim D, MLP width `intermediate`."""

    def __init__(self, layers: list[LayerSpec], final_norm: torch.Tensor, hidden: int, heads: int,
                 kv_heads: int, head_dim: int, intermediate: int, eps: float, scale: float) -> None:
        lib = load()
        if lib is None:
            raise RuntimeError("the native CPU kernels are not available")
        self._fn = lib.radixlm_decode_layers
        self._keep = (layers, final_norm)
        self._table = (_Layer * len(layers))(*[
            _Layer(_ptr(s.in_norm), _ptr(s.post_norm), _linear(s.qkv), _linear(s.o), _linear(s.gate_up),
                   _linear(s.down), _ptr(s.k_buf), _ptr(s.v_buf), _ptr(s.k_scale), _ptr(s.v_scale))
            for s in layers])
        self._final_norm = final_norm.data_ptr()
        self._step = _Step()
        st = self._step
        st.hidden, st.heads, st.kv_heads, st.head_dim, st.intermediate = hidden, heads, kv_heads, head_dim, intermediate
        st.eps, st.scale = eps, scale
        self.num_layers = len(layers)

    def run(self, residual: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            out_loc: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
            extend: ExtendRows | None = None) -> torch.Tensor:
        """residual [B, H] (contiguous, the model dtype): the embeddings in, the residual
        stream out; returns the final norm's output [B, H], or with `extend.rows` [len(rows), H].
        Decode-style attention (one CSR row of keys per token) without `extend`; the prefill
        kernel over each request's keys with it. The index tensors are int64 and contiguous,
        cos/sin float32 [positions, D/2] (the caller checks)."""
        b = residual.shape[0]
        st = self._step
        st.dtype, st.batch, st.nthreads = _DTYPE_CODE[residual.dtype], b, torch.get_num_threads()
        st.positions, st.cos, st.sin = positions.data_ptr(), cos.data_ptr(), sin.data_ptr()
        st.out_loc, st.kv_indptr, st.kv_indices = out_loc.data_ptr(), kv_indptr.data_ptr(), kv_indices.data_ptr()
        st.q_indptr, st.num_reqs, st.pack_budget = None, 0, 0
        st.rows, st.num_rows, st.rows_indptr = None, 0, None
        out_rows = b
        rows = extend.rows if extend is not None else None
        if extend is not None:
            st.q_indptr, st.num_reqs, st.pack_budget = (extend.q_indptr.data_ptr(), extend.q_indptr.numel() - 1,
                                                        extend.pack_budget)
            if rows is not None and self.num_layers > 0:  # without layers the native call norms every row
                st.rows, st.num_rows, st.rows_indptr = (rows.data_ptr(), rows.numel(),
                                                        extend.rows_indptr.data_ptr())
                out_rows = rows.numel()
        out = torch.empty((out_rows, residual.shape[1]), dtype=residual.dtype)
        rc = self._fn(ctypes.addressof(st), ctypes.addressof(self._table), self.num_layers, residual.data_ptr(),
                      self._final_norm, out.data_ptr())
        if rc != 0:
            raise RuntimeError(f"native decode layers failed at layer {rc // 1000 - 1}, op {rc % 1000}")
        return out if rows is None or self.num_layers > 0 else out.index_select(0, rows)

"""The KV cache tensors: one K and one V buffer per layer, indexed by KV slot.

Slot ids come from TokenToKVPoolAllocator (1..size); row 0 exists so that padded
batches can write their dummy tokens somewhere harmless.

kv_cache_dtype "int8" (--kv-cache-dtype int8): K and V are stored as int8 with one float32
scale per (slot, KV head), symmetric over the head's head_dim values: x ~= q * scale,
scale = amax / 127. Half the bytes of bf16 (plus 4 bytes per head), so twice the tokens fit
and decode attention, which streams every key and value once per step, reads half as much.
`quantize_kv` / `dequantize_kv` below are the reference the native kernels (kernels/cpu)
must match: the stored bytes and scales are bit-identical whichever path wrote them.
"""
from __future__ import annotations

import torch
from radixlm.kernels.cpu import ops as cpu_ops
from radixlm.kernels.cpu.hugepages import empty_hugepage
from radixlm.srt.layers.int8_linear import quantize_last_dim

KV_CACHE_DTYPES = ("auto", "int8")


def check_kv_cache_backend(kv_cache_dtype: str, backend: str) -> None:
    """ValueError for an attention backend that cannot read a quantized pool (the GPU kernels
    read float KV only)."""
    if kv_cache_dtype != "auto" and backend in ("triton", "flashinfer"):
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype} is implemented for the cpu and torch_native attention "
                         f"backends, not {backend}; use --kv-cache-dtype auto or another --attention-backend")


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, H, D] (any float dtype) -> (q int8 [n, H, D], scale float32 [n, H]): per row of D,
    scale = amax / 127 and q = round-half-even(x * (127 / amax)) in float32, both constants
    rounded once from float64 (as the int8 GEMM's activation quantizer); an all-zero row has
    scale 0 and q 0."""
    return quantize_last_dim(x.float())


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q int8 [n, H, D], scale float32 [n, H] -> [n, H, D] in dtype (q * scale in float32)."""
    return (q.float() * scale[..., None]).to(dtype)


class MHATokenToKVPool:
    def __init__(self, size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str | torch.device = "cpu", kv_cache_dtype: str = "auto") -> None:
        if size < 1:
            raise ValueError("KV pool size must be >= 1")
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
        self.size = size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.kv_cache_dtype = kv_cache_dtype
        self.quantized = kv_cache_dtype == "int8"
        # dtype: what the buffers hold; compute_dtype: what attention reads them as.
        self.compute_dtype = dtype
        self.dtype = torch.int8 if self.quantized else dtype
        self.device = torch.device(device)
        # _empty writes CPU buffers whole, others only their row 0. Only row 0 must hold
        # finite values, because attention backends point masked padding columns at it
        # (masked weights are 0, and 0 * NaN would still poison P @ V); other slots are read
        # only after being written.
        self.k_buffer: list[torch.Tensor] = []
        self.v_buffer: list[torch.Tensor] = []
        self.k_scale: list[torch.Tensor] = []  # int8 pools: float32 [size + 1, num_kv_heads]
        self.v_scale: list[torch.Tensor] = []
        self.allocate()

    def allocate(self) -> None:
        shape = (self.size + 1, self.num_kv_heads, self.head_dim)
        self.k_buffer[:] = [self._empty(shape, self.dtype) for _ in range(self.num_layers)]
        self.v_buffer[:] = [self._empty(shape, self.dtype) for _ in range(self.num_layers)]
        if self.quantized:
            scale_shape = (self.size + 1, self.num_kv_heads)
            self.k_scale[:] = [self._empty(scale_shape, torch.float32) for _ in range(self.num_layers)]
            self.v_scale[:] = [self._empty(scale_shape, torch.float32) for _ in range(self.num_layers)]

    def _empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if torch.device(self.device).type == "cpu":  # decode streams these: huge pages
            buf = empty_hugepage(shape, dtype)
            # Faulted in now, not by the decode step that first writes a page: slots are handed
            # out in order through the whole pool, so every 2 MiB of rows a step wrote a fresh
            # page in each of the 2 * layers buffers at once (60 pages, ~300 ms on a 2-core VM
            # whose host backs guest memory on first touch), stalling every running request
            # and every abort's KV release. The same cost at start-up: 0.06-2.2 s/GB here.
            buf.zero_()
            return buf
        buf = torch.empty(shape, dtype=dtype, device=self.device)  # (device memory is eager)
        buf[0].zero_()
        return buf

    def release(self) -> None:
        """Give the memory back (RL trainers reuse it); `allocate()` brings it back empty."""
        empty = torch.empty((0, self.num_kv_heads, self.head_dim), dtype=self.dtype, device=self.device)
        self.k_buffer[:] = [empty] * self.num_layers
        self.v_buffer[:] = [empty] * self.num_layers
        if self.quantized:
            empty_scale = torch.empty((0, self.num_kv_heads), dtype=torch.float32, device=self.device)
            self.k_scale[:] = [empty_scale] * self.num_layers
            self.v_scale[:] = [empty_scale] * self.num_layers

    def slot_buffers(self) -> list[torch.Tensor]:
        """Every tensor indexed by KV slot (K, V, and the scales of an int8 pool): what a copy
        of a slot's KV (HiCache host tier) must move."""
        return [*self.k_buffer, *self.v_buffer, *self.k_scale, *self.v_scale]

    @property
    def allocated_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.slot_buffers())

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                        kv_cache_dtype: str = "auto") -> int:
        """Bytes one token's K and V take over all layers (for sizing the pool)."""
        if kv_cache_dtype == "int8":
            return 2 * num_layers * num_kv_heads * (head_dim + 4)  # int8 values + a float32 scale per head
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads * head_dim * itemsize

    def total_bytes(self) -> int:
        return (self.size + 1) * self.bytes_per_token(self.num_layers, self.num_kv_heads,
                                                      self.head_dim, self.compute_dtype, self.kv_cache_dtype)

    def set_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [n, num_kv_heads, head_dim] stored at slots loc [n]."""
        # index_copy_ is cheaper than advanced-index assignment. Real slots never repeat
        # within one forward (allocator invariant); only padding slot 0 may, harmlessly.
        if self.quantized:
            kq, ks = quantize_kv(k)
            vq, vs = quantize_kv(v)
            self.k_buffer[layer].index_copy_(0, loc, kq)
            self.v_buffer[layer].index_copy_(0, loc, vq)
            self.k_scale[layer].index_copy_(0, loc, ks)
            self.v_scale[layer].index_copy_(0, loc, vs)
            return
        if k.dtype != self.dtype:
            k, v = k.to(self.dtype), v.to(self.dtype)
        self.k_buffer[layer].index_copy_(0, loc, k)
        self.v_buffer[layer].index_copy_(0, loc, v)

    def gather_kv(self, layer: int, index: torch.Tensor, which: int,
                  out: torch.Tensor | None = None) -> torch.Tensor:
        """K (which=0) or V (which=1) of slots `index` as [n, num_kv_heads, head_dim] in
        compute_dtype (dequantized for an int8 pool); written into `out` when given (a float
        pool's index_select target)."""
        buf = (self.k_buffer if which == 0 else self.v_buffer)[layer]
        if not self.quantized:
            return torch.index_select(buf, 0, index, out=out) if out is not None else buf.index_select(0, index)
        scale = (self.k_scale if which == 0 else self.v_scale)[layer]
        if buf.device.type == "cpu":  # one native pass instead of five torch ops (same numbers)
            out = cpu_ops.gather_dequant_int8(buf, scale, index, self.compute_dtype)
            if out is not None:
                return out
        return dequantize_kv(buf.index_select(0, index), scale.index_select(0, index), self.compute_dtype)

    def get_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffer[layer], self.v_buffer[layer]

    def get_key_buffer(self, layer: int) -> torch.Tensor:
        return self.k_buffer[layer]

    def get_value_buffer(self, layer: int) -> torch.Tensor:
        return self.v_buffer[layer]

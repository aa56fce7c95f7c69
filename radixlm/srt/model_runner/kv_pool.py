"""The KV cache tensors: one K and one V buffer per layer, indexed by KV slot.

Slot ids come from TokenToKVPoolAllocator (1..size); row 0 exists so that padded
batches can write their dummy tokens somewhere harmless.
"""
from __future__ import annotations

import torch
from radixlm.kernels.cpu.hugepages import empty_hugepage


class MHATokenToKVPool:
    def __init__(self, size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str | torch.device = "cpu") -> None:
        if size < 1:
            raise ValueError("KV pool size must be >= 1")
        self.size = size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        # torch.empty: zero-filling a multi-GB pool costs ~0.3 s/GB at startup on a small
        # VM. Only row 0 must be finite, because attention backends point masked padding
        # columns at it (masked weights are 0, and 0 * NaN would still poison P @ V).
        # Other slots are read only after being written.
        self.k_buffer: list[torch.Tensor] = []
        self.v_buffer: list[torch.Tensor] = []
        self.allocate()

    def allocate(self) -> None:
        shape = (self.size + 1, self.num_kv_heads, self.head_dim)
        self.k_buffer[:] = [self._empty(shape) for _ in range(self.num_layers)]
        self.v_buffer[:] = [self._empty(shape) for _ in range(self.num_layers)]
        for buf in (*self.k_buffer, *self.v_buffer):
            buf[0].zero_()

    def _empty(self, shape: tuple[int, ...]) -> torch.Tensor:
        if torch.device(self.device).type == "cpu":  # decode streams these: huge pages
            return empty_hugepage(shape, self.dtype)
        return torch.empty(shape, dtype=self.dtype, device=self.device)

    def release(self) -> None:
        """Give the memory back (RL trainers reuse it); `allocate()` brings it back empty."""
        empty = torch.empty((0, self.num_kv_heads, self.head_dim), dtype=self.dtype, device=self.device)
        self.k_buffer[:] = [empty] * self.num_layers
        self.v_buffer[:] = [empty] * self.num_layers

    @property
    def allocated_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in (*self.k_buffer, *self.v_buffer))

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes one token's K and V take over all layers (for sizing the pool)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads * head_dim * itemsize

    def total_bytes(self) -> int:
        return (self.size + 1) * self.bytes_per_token(self.num_layers, self.num_kv_heads,
                                                      self.head_dim, self.dtype)

    def set_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [n, num_kv_heads, head_dim] stored at slots loc [n]."""
        if k.dtype != self.dtype:
            k, v = k.to(self.dtype), v.to(self.dtype)
        # index_copy_ is cheaper than advanced-index assignment. Real slots never repeat
        # within one forward (allocator invariant); only padding slot 0 may, harmlessly.
        self.k_buffer[layer].index_copy_(0, loc, k)
        self.v_buffer[layer].index_copy_(0, loc, v)

    def get_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffer[layer], self.v_buffer[layer]

    def get_key_buffer(self, layer: int) -> torch.Tensor:
        return self.k_buffer[layer]

    def get_value_buffer(self, layer: int) -> torch.Tensor:
        return self.v_buffer[layer]

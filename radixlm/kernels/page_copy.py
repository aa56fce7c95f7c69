"""Page copies between the device KV pool and a host (CPU) KV pool, for HiCache.

A transfer moves the KV rows of a set of token slots for every layer at once:
  device -> host: gather the rows on the device into one contiguous staging block
                  [2 * num_layers, n, Hkv, D] (one Triton launch on CUDA), copy it to
                  the host in one transfer, scatter it into the host buffers (torch);
  host -> device: the mirror image.
One bulk copy instead of 2 * num_layers * n small ones is what makes this fast: PCIe
transfers of a few hundred bytes are latency-bound.

Importing this module does not import triton; the device side uses the Triton kernels
only when the device buffers are on CUDA (or when asked to, e.g. under the interpreter),
else torch's index ops (the reference twins), so it also works on CPU-only machines.
Copies are synchronous; overlapping them with compute is the caller's business.
"""
from __future__ import annotations

import torch

from radixlm.kernels.reference import gather_rows_ref, scatter_rows_ref


class PageCopier:
    """Moves rows between `device_bufs[j]` and `host_bufs[j]` (same row shape and dtype).

    Typical lists: [k_layer0, ..., k_layerL-1, v_layer0, ..., v_layerL-1] of each pool.
    """

    def __init__(self, device_bufs: list[torch.Tensor], host_bufs: list[torch.Tensor],
                 use_triton: bool | None = None) -> None:
        if len(device_bufs) != len(host_bufs) or not device_bufs:
            raise ValueError("device and host buffer lists must be non-empty and equally long")
        for d, h in zip(device_bufs, host_bufs):
            if d.shape[1:] != h.shape[1:] or d.dtype != h.dtype:
                raise ValueError("device and host buffers must share row shape and dtype")
        self.device_bufs = list(device_bufs)
        self.host_bufs = list(host_bufs)
        self.device = device_bufs[0].device
        if use_triton is None:
            use_triton = self.device.type == "cuda"
        self._table = None
        if use_triton:
            from radixlm.kernels.kv_ops import BufferTable  # imports triton

            self._table = BufferTable(self.device_bufs)

    def _device_slots(self, slots: torch.Tensor) -> torch.Tensor:
        return slots.to(device=self.device, dtype=torch.int64)

    def device_to_host(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> None:
        """host_bufs[j][host_slots[i]] = device_bufs[j][device_slots[i]] for every j."""
        if device_slots.numel() != host_slots.numel():
            raise ValueError("slot lists differ in length")
        if device_slots.numel() == 0:
            return
        if self._table is not None:
            from radixlm.kernels.kv_ops import gather_rows

            staging = gather_rows(self._table, self._device_slots(device_slots))
        else:
            staging = gather_rows_ref(self.device_bufs, device_slots)
        scatter_rows_ref(self.host_bufs, host_slots.cpu(), staging.cpu())

    def host_to_device(self, host_slots: torch.Tensor, device_slots: torch.Tensor) -> None:
        """device_bufs[j][device_slots[i]] = host_bufs[j][host_slots[i]] for every j."""
        if device_slots.numel() != host_slots.numel():
            raise ValueError("slot lists differ in length")
        if device_slots.numel() == 0:
            return
        staging = gather_rows_ref(self.host_bufs, host_slots.cpu()).to(self.device)
        if self._table is not None:
            from radixlm.kernels.kv_ops import scatter_rows

            scatter_rows(self._table, self._device_slots(device_slots), staging)
        else:
            scatter_rows_ref(self.device_bufs, device_slots, staging)

"""What `--disaggregation-mode prefill|decode` builds in the scheduler process."""
from __future__ import annotations

from radixlm.disaggregation.common import TransferConfig
from radixlm.disaggregation.decode_side import DecodeTransfer
from radixlm.disaggregation.kv_pages import KVBuffers
from radixlm.disaggregation.prefill_side import PrefillTransfer
from radixlm.scheduler.scheduler import Scheduler

__all__ = ["MODES", "TRANSFER_BACKENDS", "attach_transfer"]

MODES = ("null", "prefill", "decode")
TRANSFER_BACKENDS = ("tcp",)  # RDMA engines (mooncake, nixl) would be added here: docs/disaggregation.md


def attach_transfer(scheduler: Scheduler, mode: str, *, host: str, bootstrap_port: int, backend: str,
                    timeout_s: float, kv_buffers: KVBuffers) -> PrefillTransfer | DecodeTransfer | None:
    """Gives `scheduler` its disaggregation side (None for mode "null")."""
    if mode == "null":
        return None
    if backend not in TRANSFER_BACKENDS:
        raise ValueError(f"unknown disaggregation transfer backend {backend!r}; have {TRANSFER_BACKENDS}")
    import zmq

    from radixlm.disaggregation.links import BootstrapServer, DecodeLinks

    ctx = zmq.Context()
    config = TransferConfig(timeout_s=timeout_s)
    side: PrefillTransfer | DecodeTransfer
    if mode == "prefill":
        side = PrefillTransfer(scheduler, BootstrapServer(ctx, host, bootstrap_port), kv_buffers, config)
    elif mode == "decode":
        side = DecodeTransfer(scheduler, DecodeLinks(ctx), kv_buffers, config)
    else:
        raise ValueError(f"disaggregation mode must be one of {MODES}, got {mode!r}")
    scheduler.transfer = side
    return side

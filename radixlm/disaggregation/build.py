"""What `--disaggregation-mode prefill|decode` builds in the scheduler process, before the
scheduler: the side it hands to the scheduler's constructor (`transfer=`)."""
from __future__ import annotations

from radixlm.disaggregation.common import TransferConfig
from radixlm.disaggregation.decode_side import DecodeTransfer
from radixlm.disaggregation.kv_pages import KVBuffers
from radixlm.disaggregation.prefill_side import PrefillTransfer
from radixlm.feature_rules import DISAGGREGATION_MODES, TRANSFER_BACKENDS, check_transfer

__all__ = ["MODES", "TRANSFER_BACKENDS", "build_transfer"]

MODES = DISAGGREGATION_MODES


def build_transfer(mode: str, *, host: str, bootstrap_port: int, backend: str, timeout_s: float,
                   kv_buffers: KVBuffers) -> PrefillTransfer | DecodeTransfer | None:
    """The disaggregation side of `mode` (None for "null"); refusals are feature_rules.py's."""
    check_transfer(mode, backend)
    if mode == "null":
        return None
    import zmq

    from radixlm.disaggregation.links import BootstrapServer, DecodeLinks

    ctx = zmq.Context()
    config = TransferConfig(timeout_s=timeout_s)
    if mode == "prefill":
        return PrefillTransfer(BootstrapServer(ctx, host, bootstrap_port), kv_buffers, config)
    return DecodeTransfer(DecodeLinks(ctx), kv_buffers, config)

"""The tensor-parallel group of a rank process: torch.distributed over a file store in the
runtime's private IPC directory (no port to pick, nothing listening beyond loopback).

Backends: gloo on the CPU, NCCL on CUDA (one GPU per rank: rank r uses cuda:r). The control
channel is a gloo group of its own either way (comm.py). Collectives time out after
`dist_timeout` seconds, and a peer that dies closes its sockets, so its partners fail at once
with "Connection closed by peer" instead of waiting: the rank process then exits and the
launcher brings the runtime down (launch.py).
"""
from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass
from typing import Iterator

from radixlm.srt.distributed.comm import ControlChannel, SingleRank, TorchComm, TPComm

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass
class TPGroup:
    rank: int
    size: int
    comm: TPComm
    control: ControlChannel
    backend: str = "none"

    @staticmethod
    def single() -> "TPGroup":
        return TPGroup(0, 1, SingleRank(), ControlChannel())


@contextlib.contextmanager
def gloo_interface_for(address: str) -> Iterator[None]:
    """Gloo binds the interface of GLOO_SOCKET_IFNAME, else the host name's address; for a
    group on this machine bind loopback (unless the user chose an interface)."""
    if address not in LOOPBACK or "GLOO_SOCKET_IFNAME" in os.environ:
        yield
        return
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    try:
        yield
    finally:
        os.environ.pop("GLOO_SOCKET_IFNAME", None)


def init_tp_group(rank: int, size: int, init_method: str, device: str, timeout_s: float) -> TPGroup:
    import torch
    import torch.distributed as dist

    backend = "gloo"
    if device == "cuda":
        # RADIXLM_TP_BACKEND=gloo runs the ranks' collectives through host memory, which lets
        # ranks share one GPU (NCCL refuses two ranks on one device): for testing on one GPU.
        backend = os.environ.get("RADIXLM_TP_BACKEND", "nccl")
        count = torch.cuda.device_count()
        if backend == "nccl" and count < size:
            raise ValueError(f"tp_size {size} needs {size} GPUs (one per rank); {count} visible")
        torch.cuda.set_device(rank % count)
    timeout = datetime.timedelta(seconds=timeout_s)
    with gloo_interface_for("127.0.0.1"):
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=timeout)
        control = dist.new_group(backend="gloo", timeout=timeout)
        # the batch check runs on the forward thread: its own group, never the control one
        checks = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
    return TPGroup(rank, size, TorchComm(dist.group.WORLD, rank, size, checks), ControlChannel(control, rank, size),
                   backend)


def threads_per_rank(tp_size: int, requested: int | None, available: int) -> int:
    """Each rank's share of the machine's threads: RADIXLM_NUM_THREADS when set (per rank),
    else the cores torch would use, divided between the ranks."""
    if requested is not None:
        return max(1, requested)
    return max(1, available // tp_size)

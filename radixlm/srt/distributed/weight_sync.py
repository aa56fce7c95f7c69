"""Distributed weight sync: a trainer broadcasts new weights to every inference rank over a
torch.distributed group of their own (SGLang's `init_weights_update_group` +
`update_weights_from_distributed`).

The group has `world_size` members: the trainer is rank 0 (the broadcast source) and
inference TP rank r is `rank_offset + r`. It is created the way RL frameworks create theirs
(SGLang's and OpenRLHF's `init_custom_process_group`): a rendezvous at
tcp://master_address:master_port, a store prefixed by the group name, and a process group
built outside the default one, so a process may belong to it and to its own default group
(the TP group, or the trainer's training group). `init_custom_process_group` below is what a
trainer calls on its side; any implementation of the same protocol interoperates.

Each tensor arrives whole on every rank (shape and dtype as the request names them) and
the rank keeps its shard; every tensor is received even after a bad one, so the trainer is
never left waiting in a broadcast, and the update is then applied all or nothing.
"""
from __future__ import annotations

import datetime
import logging
from typing import Any, Iterable, Iterator

import torch

from radixlm.srt.distributed.process_group import gloo_interface_for

logger = logging.getLogger(__name__)

DEFAULT_GROUP_NAME = "weight_update_group"
_DTYPES = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16, "half": torch.float16,
           "bfloat16": torch.bfloat16, "float64": torch.float64}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """'bfloat16', 'torch.bfloat16' or a torch.dtype -> torch.dtype (floating point only)."""
    if isinstance(name, torch.dtype):
        return name
    key = str(name).removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unsupported weight dtype {name!r}; use one of {', '.join(sorted(_DTYPES))}")
    return _DTYPES[key]


def check_update_request(names: list, dtypes: list, shapes: list) -> None:
    """ValueError for a request whose parts do not line up (checked before anything is received)."""
    if not names:
        raise ValueError("names is empty: nothing to update")
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(f"names, dtypes and shapes must have the same length "
                         f"({len(names)}, {len(dtypes)}, {len(shapes)})")
    for name, dtype, shape in zip(names, dtypes, shapes):
        parse_dtype(dtype)
        if not isinstance(shape, (list, tuple)) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ValueError(f"shape of {name!r} must be a list of non-negative integers, got {shape!r}")


def init_custom_process_group(backend: str, init_method: str, world_size: int, rank: int, group_name: str,
                              timeout: datetime.timedelta | None = None) -> Any:
    """A process group outside the default one (both sides of the weight sync call this)."""
    from urllib.parse import urlparse

    from torch.distributed import distributed_c10d as c10d

    timeout = timeout or datetime.timedelta(minutes=30)
    with gloo_interface_for(urlparse(init_method).hostname or ""):
        store, rank, world_size = next(c10d.rendezvous(init_method, rank, world_size, timeout=timeout))
        store.set_timeout(timeout)
        store = c10d.PrefixStore(group_name, store)
        group, _ = c10d._new_process_group_helper(world_size, rank, [], c10d.Backend(backend), store,
                                                  group_name=group_name, timeout=timeout)  # type: ignore[arg-type]
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}  # group rank == global rank
    return group


def broadcast_weights(group: Any, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """The trainer's side of one update: broadcast each tensor, in the order the engine's
    update_weights_from_distributed request lists them (names, dtypes, shapes)."""
    import torch.distributed as dist

    for _, tensor in named_tensors:
        dist.broadcast(tensor.contiguous(), src=0, group=group)


class WeightSyncGroups:
    """The weight-update groups one inference rank has joined, by name."""

    def __init__(self, tp_rank: int, device: str, timeout_s: float) -> None:
        self.tp_rank = tp_rank
        self.device = device
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.groups: dict[str, Any] = {}

    def init(self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str,
             backend: str) -> str:
        if group_name in self.groups:
            raise ValueError(f"weight update group {group_name!r} already exists; destroy it first")
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"backend must be nccl or gloo, got {backend!r}")
        if backend == "nccl" and self.device != "cuda":
            raise ValueError("backend 'nccl' needs CUDA; this engine runs on the CPU (use backend='gloo')")
        rank = rank_offset + self.tp_rank
        if not 0 < rank < world_size:
            raise ValueError(f"rank_offset {rank_offset} + TP rank {self.tp_rank} = {rank} is not a rank in "
                             f"[1, {world_size}) (rank 0 is the trainer)")
        self.groups[group_name] = init_custom_process_group(
            backend, f"tcp://{master_address}:{master_port}", world_size, rank, group_name, self.timeout)
        logger.info("joined weight update group %s as rank %d of %d", group_name, rank, world_size)
        return f"joined weight update group {group_name!r} as rank {rank} of {world_size}"

    def receive(self, names: list[str], dtypes: list, shapes: list[list[int]], group_name: str
                ) -> Iterator[tuple[str, torch.Tensor]]:
        """Each tensor, whole, as the trainer broadcasts it (in the request's order)."""
        import torch.distributed as dist

        group = self.groups.get(group_name)
        if group is None:
            raise ValueError(f"no weight update group {group_name!r}; call init_weights_update_group first")
        device = torch.device("cuda", torch.cuda.current_device()) if self.device == "cuda" else torch.device("cpu")
        for name, dtype, shape in zip(names, dtypes, shapes):
            tensor = torch.empty(tuple(shape), dtype=parse_dtype(dtype), device=device)
            dist.broadcast(tensor, src=0, group=group)
            yield name, tensor

    def destroy(self, group_name: str) -> str:
        import torch.distributed as dist

        group = self.groups.pop(group_name, None)
        if group is None:
            raise ValueError(f"no weight update group {group_name!r}")
        dist.destroy_process_group(group)
        return f"destroyed weight update group {group_name!r}"

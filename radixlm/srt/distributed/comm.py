"""The two channels between tensor-parallel ranks.

- `TPComm`: the model's collectives (all-reduce after a row-parallel layer, gathers of the
  vocabulary shards), on the model group: NCCL on CUDA, gloo on the CPU. On the overlap
  scheduler they run on the forward thread.
- `ControlChannel`: Python objects between the ranks' schedulers (the messages rank 0
  received, agreements on thread-timed events, RPC errors), always on a gloo group of its
  own, used by the scheduler thread only. Two groups, because torch.distributed orders
  collectives per group: a scheduler-thread broadcast and a forward-thread all-reduce on one
  group could be issued in different orders on different ranks.

Every collective returns bitwise-identical values on every rank (gloo's and NCCL's
all-reduce compute each element once and distribute it), so the ranks sample the same
tokens from the same logits.
"""
from __future__ import annotations

import pickle
from typing import Any, Protocol

import torch

# Bytes of the control broadcast's first message; larger payloads follow in a second one.
# A step with no new message pickles to ~60 bytes, so it costs one small broadcast.
CONTROL_HEADER_BYTES = 4096


class TPComm(Protocol):
    rank: int
    size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place; returns x."""
        ...

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's x (same shape on every rank), in rank order."""
        ...

    def check_same(self, values: list[int], what: str) -> None:
        """RuntimeError unless every rank passed the same values."""
        ...


class SingleRank:
    """The communicator of an unsplit model: every collective is the identity."""
    rank = 0
    size = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [x]

    def check_same(self, values: list[int], what: str) -> None:
        return None


class TorchComm:
    """TPComm over a torch.distributed process group. `cpu_group` (gloo; the model group itself
    when that is gloo) carries check_same, so the check never makes the host wait for a device."""

    def __init__(self, group: Any, rank: int, size: int, cpu_group: Any = None) -> None:
        self.group = group
        self.cpu_group = cpu_group if cpu_group is not None else group
        self.rank = rank
        self.size = size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        import torch.distributed as dist
        x = x.contiguous()
        out = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(out, x, group=self.group)
        return out

    def check_same(self, values: list[int], what: str) -> None:
        import torch.distributed as dist
        both = torch.tensor(values + [-v for v in values], dtype=torch.int64)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.cpu_group)
        n = len(values)
        hi, lo = both[:n], -both[n:]
        if not torch.equal(hi, lo):
            raise RuntimeError(f"tensor-parallel ranks diverged: {what} differ between ranks "
                               f"(rank {self.rank} has {values}; across ranks min {lo.tolist()} max {hi.tolist()})")


class ControlChannel:
    """Objects between the ranks' scheduler threads, over a gloo group (size 1: no group)."""

    def __init__(self, group: Any = None, rank: int = 0, size: int = 1) -> None:
        self.group = group
        self.rank = rank
        self.size = size

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0's obj on every rank (the others' argument is ignored)."""
        if self.size == 1:
            return obj
        import torch.distributed as dist
        head = torch.zeros(CONTROL_HEADER_BYTES, dtype=torch.uint8)
        data = b""
        if self.rank == 0:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            n = len(data)
            head[:8] = torch.frombuffer(bytearray(n.to_bytes(8, "little")), dtype=torch.uint8)
            first = min(n, CONTROL_HEADER_BYTES - 8)
            if first:
                head[8:8 + first] = torch.frombuffer(bytearray(data[:first]), dtype=torch.uint8)
        dist.broadcast(head, src=self._src(), group=self.group)
        n = int.from_bytes(bytes(head[:8].tolist()), "little")
        first = min(n, CONTROL_HEADER_BYTES - 8)
        rest = n - first
        tail = torch.empty(rest, dtype=torch.uint8)
        if rest:
            if self.rank == 0:
                tail.copy_(torch.frombuffer(bytearray(data[first:]), dtype=torch.uint8))
            dist.broadcast(tail, src=self._src(), group=self.group)
        if self.rank == 0:
            return obj
        return pickle.loads(head[8:8 + first].numpy().tobytes() + tail.numpy().tobytes())

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's obj, in rank order."""
        if self.size == 1:
            return [obj]
        import torch.distributed as dist
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def min_ints(self, values: list[int]) -> list[int]:
        """Element-wise minimum over ranks (e.g. how many copies are done on EVERY rank)."""
        if self.size == 1 or not values:
            return list(values)
        import torch.distributed as dist
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return t.tolist()

    def agreed(self, fn: Any) -> Any:
        """Run fn() on every rank; if it raised on any rank, raise the lowest such rank's error
        on every rank (ValueError stays ValueError, anything else becomes RuntimeError), so all
        ranks take the same branch and none is left waiting in a collective."""
        result, error = None, None
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - re-raised below, on every rank
            error = (isinstance(e, ValueError), str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}")
        errors = [e for e in self.all_gather(error) if e is not None]
        if errors:
            is_value, message = errors[0]
            raise (ValueError if is_value else RuntimeError)(message)
        return result

    def _src(self) -> int:
        import torch.distributed as dist
        return dist.get_global_rank(self.group, 0) if self.group is not None else 0

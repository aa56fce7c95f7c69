"""CacheController: moves KV between the device pool and the host pool, off the scheduler thread.

Two directions, each with its own worker thread (and, on a GPU, its own side CUDA stream):
- **write** (device → host, backing a tree node up): `write()` only queues; `start_writing()`
  merges everything queued since the last call into one copy (one gather/scatter per buffer
  instead of one per node) and hands it to the write thread. The tree calls it once per
  scheduler iteration, so the inserts of one iteration's results travel together.
- **load** (host → device, bringing a node back): `load()` starts the copy at once, because a
  batch about to be launched needs it. `fence_loads()`, called on the forward thread right
  before a forward (see `LoadFencedRunner`), waits for every load started so far, so a forward
  never reads a slot whose KV is still arriving.

Every `write()`/`load()` returns an op id. Acks come back **in submission order**
(`poll_writes()`/`poll_loads()` return the ids of the longest completed prefix): the tree
unlocks nodes only in that order, so its state never depends on thread timing beyond "a prefix
of the ops is done".

Only index tensors and the pools' buffers are touched here; the tree is the scheduler
thread's alone.
"""
from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import torch

from radixlm.hicache.host_pool import HostKVPool
from radixlm.rank_sync import LOCAL_RANK, RankSync

__all__ = ["CacheController", "CopyBatch", "LoadFencedRunner"]

_EMPTY = torch.empty((0,), dtype=torch.int64)


@dataclass(eq=False)
class CopyBatch:
    """One copy handed to a worker thread: src slots → dst slots in every buffer."""
    kind: str  # "write" (device -> host) or "load" (host -> device)
    src: torch.Tensor
    dst: torch.Tensor
    future: Future | None = None
    seconds: float = 0.0  # time the copy itself took on the worker

    @property
    def num_tokens(self) -> int:
        return int(self.src.numel())

    def done(self) -> bool:
        return self.future is not None and self.future.done()

    def wait(self) -> None:
        assert self.future is not None, "waiting for a copy that was never started"
        self.future.result()  # re-raises a copy failure on the caller's thread


@dataclass
class _Ack:
    op_id: int
    batch: CopyBatch | None  # None while a write is queued but not started
    src: torch.Tensor = field(default_factory=lambda: _EMPTY)
    dst: torch.Tensor = field(default_factory=lambda: _EMPTY)


class CacheController:
    def __init__(self, device_buffers: list[torch.Tensor] | Callable[[], list[torch.Tensor]],
                 host_pool: HostKVPool, *, copy_hook: Callable[[str], None] | None = None) -> None:
        # A callable is looked up at every copy: the device pool may swap its tensors (memory
        # release/resume for RL), and a copy must use the live ones.
        self._device_buffers = device_buffers if callable(device_buffers) else (lambda: device_buffers)
        device_buffers = self._device_buffers()
        if len(device_buffers) != len(host_pool.buffers):
            raise ValueError("host pool does not mirror the device buffers")
        for d, h in zip(device_buffers, host_pool.buffers):
            if d.shape[1:] != h.shape[1:] or d.dtype != h.dtype:
                raise ValueError(f"host buffer {tuple(h.shape)} {h.dtype} does not mirror device "
                                 f"buffer {tuple(d.shape)} {d.dtype}")
        self.host_buffers = host_pool.buffers
        self.device = device_buffers[0].device
        self.cuda = self.device.type == "cuda"
        # Tests use the hook to slow a copy down or hold it (called on the worker thread).
        self.copy_hook = copy_hook
        # Tensor-parallel ranks ack a copy only once it is done on every rank (rank_sync.py).
        self.ranks: RankSync = LOCAL_RANK
        self._streams = {k: torch.cuda.Stream(self.device) for k in ("write", "load")} if self.cuda else {}
        self._workers = {k: ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"radixlm-hicache-{k}")
                         for k in ("write", "load")}
        self._op_ids = itertools.count(1)
        self._write_acks: deque[_Ack] = deque()
        self._load_acks: deque[_Ack] = deque()
        self._fence_lock = threading.Lock()
        self._unfenced: list[CopyBatch] = []
        self.stats = {"write_ops": 0, "written_tokens": 0, "write_seconds": 0.0,
                      "load_ops": 0, "loaded_tokens": 0, "load_seconds": 0.0, "fence_wait_seconds": 0.0}

    # ------------------------------------------------------------------ writes (device -> host)
    def write(self, device_indices: torch.Tensor, host_indices: torch.Tensor) -> int:
        """Queue a backup; it starts at the next `start_writing()`. Returns its op id."""
        assert device_indices.numel() == host_indices.numel()
        op = _Ack(next(self._op_ids), None, device_indices.to(torch.int64).cpu(), host_indices.to(torch.int64).cpu())
        self._write_acks.append(op)
        return op.op_id

    def start_writing(self) -> None:
        """Merge every queued write into one copy and start it."""
        queued = [a for a in self._write_acks if a.batch is None]
        if not queued:
            return
        batch = CopyBatch("write", torch.cat([a.src for a in queued]), torch.cat([a.dst for a in queued]))
        for a in queued:
            a.batch = batch
            a.src = a.dst = _EMPTY
        self._submit(batch)

    def write_now(self, device_indices: torch.Tensor, host_indices: torch.Tensor) -> None:
        """Copy synchronously (write_back eviction must have the host copy before it frees the
        device slots); not part of the ack queue."""
        batch = CopyBatch("write", device_indices.to(torch.int64).cpu(), host_indices.to(torch.int64).cpu())
        self._submit(batch)
        batch.wait()

    def poll_writes(self) -> list[int]:
        return self._poll(self._write_acks, self.ranks)

    def wait_writes(self) -> list[int]:
        """Start and finish every write; returns all their op ids (in order)."""
        self.start_writing()
        for a in self._write_acks:
            a.batch.wait()  # type: ignore[union-attr]
        return self._poll(self._write_acks, self.ranks)

    # ------------------------------------------------------------------ loads (host -> device)
    def load(self, host_indices: torch.Tensor, device_indices: torch.Tensor) -> int:
        """Start a load now; a forward reading these device slots must run after `fence_loads()`."""
        assert device_indices.numel() == host_indices.numel()
        batch = CopyBatch("load", host_indices.to(torch.int64).cpu(), device_indices.to(torch.int64).cpu())
        op = _Ack(next(self._op_ids), batch)
        self._load_acks.append(op)
        self._submit(batch)  # before it becomes visible to the forward thread's fence
        with self._fence_lock:
            self._unfenced.append(batch)
        return op.op_id

    def fence_loads(self) -> None:
        """Block until every load started so far has landed (forward thread, before a forward)."""
        with self._fence_lock:
            pending, self._unfenced = self._unfenced, []
        if not pending:
            return
        t0 = time.perf_counter()
        for b in pending:
            b.wait()
        self.stats["fence_wait_seconds"] += time.perf_counter() - t0

    def poll_loads(self) -> list[int]:
        return self._poll(self._load_acks, self.ranks)

    def wait_loads(self) -> list[int]:
        for a in self._load_acks:
            a.batch.wait()  # type: ignore[union-attr]
        return self._poll(self._load_acks, self.ranks)

    # ------------------------------------------------------------------ common
    def num_pending(self) -> tuple[int, int]:
        """(unacknowledged writes, unacknowledged loads)."""
        return len(self._write_acks), len(self._load_acks)

    @staticmethod
    def _poll(acks: deque[_Ack], ranks: RankSync) -> list[int]:
        if not acks:  # the same on every rank: the ops are issued by the same decisions
            return []
        n = 0
        while n < len(acks) and acks[n].batch is not None and acks[n].batch.done():  # type: ignore[union-attr]
            n += 1
        n = ranks.agree_done([n])[0]
        done = []
        for _ in range(n):
            a = acks.popleft()
            a.batch.wait()  # type: ignore[union-attr]  # surfaces a failed copy
            done.append(a.op_id)
        return done

    def _submit(self, batch: CopyBatch) -> None:
        n = batch.num_tokens
        self.stats[f"{batch.kind}_ops"] += 1
        self.stats["written_tokens" if batch.kind == "write" else "loaded_tokens"] += n
        batch.future = self._workers[batch.kind].submit(self._run, batch)

    def _run(self, batch: CopyBatch) -> None:
        if self.copy_hook is not None:
            self.copy_hook(batch.kind)
        t0 = time.perf_counter()
        if batch.kind == "write":
            src_bufs, dst_bufs = self._device_buffers(), self.host_buffers
        else:
            src_bufs, dst_bufs = self.host_buffers, self._device_buffers()
        stream = self._streams.get(batch.kind)
        if stream is None:
            self._copy(src_bufs, dst_bufs, batch.src, batch.dst)
        else:
            with torch.cuda.stream(stream):
                self._copy(src_bufs, dst_bufs, batch.src, batch.dst)
            # The worker (not the scheduler) waits: its completion is what acks and fences see.
            stream.synchronize()
        batch.seconds = time.perf_counter() - t0
        self.stats[f"{batch.kind}_seconds"] += batch.seconds

    @staticmethod
    def _copy(src_bufs: list[torch.Tensor], dst_bufs: list[torch.Tensor], src: torch.Tensor,
              dst: torch.Tensor) -> None:
        src_i = src.to(src_bufs[0].device, non_blocking=True)
        dst_i = dst.to(dst_bufs[0].device, non_blocking=True)
        for s, d in zip(src_bufs, dst_bufs):
            vals = s.index_select(0, src_i)
            if vals.device != d.device:
                # Device->host is a blocking copy (the host scatter below reads it at once);
                # host->device may be asynchronous on the side stream, synchronized by `_run`.
                vals = vals.to(d.device, non_blocking=d.device.type == "cuda")
            d.index_copy_(0, dst_i, vals)

    def close(self) -> None:
        for w in self._workers.values():
            w.shutdown(wait=True)


class LoadFencedRunner:
    """Wraps a model runner so each forward first waits for the host→device loads started so
    far (the loads of the batch it runs were started during that batch's admission). Every
    other attribute is the wrapped runner's."""

    def __init__(self, runner, controller: CacheController) -> None:
        self._runner = runner
        self._controller = controller

    def forward(self, batch):
        return self.launch(batch).result()

    def launch(self, batch, prev=None):
        self._controller.fence_loads()
        return self._runner.launch(batch, prev)

    def __getattr__(self, name: str):
        return getattr(self._runner, name)

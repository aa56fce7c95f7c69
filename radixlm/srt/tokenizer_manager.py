"""The TokenizerManager: the asyncio front of the runtime (HTTP server and Engine share it).

It tokenizes and validates requests, keeps them in its request table (`request_table.py`),
sends work to the scheduler, receives detokenized outputs, and answers every caller exactly
once, an aborted one at the moment its abort is accepted (docs/cancel_chain.md).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Any, AsyncIterator

import zmq
import zmq.asyncio

from radixlm.config import ServerArgs
from radixlm.ipc import AsyncReceiver, AsyncSender, PortArgs
from radixlm.messages import (AbortReq, BatchTextOut, CheckIntegrityReq, CloseSessionReq, ContinueReq,
                              DestroyWeightsUpdateGroupReq, OpenSessionReq,
                              FlushCacheReq, GetInfoReq, GetWeightsByNameReq, InitWeightsUpdateGroupReq, PauseReq,
                              RejectRoomsReq,
                              ReleaseMemoryReq, ReqTextOutput, ResumeMemoryReq, RpcReply, RpcReq,
                              UpdateWeightsFromDiskReq, UpdateWeightsFromDistributedReq, UpdateWeightsFromTensorReq)
from radixlm.srt.detokenizer import released_text
from radixlm.srt.generate_request import GenerateItem, normalize_generate
from radixlm.srt.metrics import RuntimeMetrics
from radixlm.srt.request_table import (PAUSED, SENT, USER_ABORT, WEIGHT_LOCK, Call, ReqState, RequestTable,
                                       abort_reason, terminal_output)
from radixlm.srt.results import absorb, early_abort_results, result
from radixlm.srt.rwlock import RWLock
from radixlm.srt.text_bound import max_chars_per_token
from radixlm.srt.weights.generation_config import model_sampling_defaults, with_sampling_defaults

logger = logging.getLogger(__name__)

# Prompts longer than this are tokenized in a worker thread.
TOKENIZE_INLINE_MAX_CHARS = 20_000
MEMORY_RELEASED = ("generation is unavailable: memory was released with release_memory_occupation(); "
                   "call resume_memory_occupation() first")


def _assign_rids(kw: dict) -> tuple[list[str], bool]:
    """Give every prompt of the call its rid now, so an abort can name it while tokenizing.
    Returns the rids and whether the call is a batch."""
    import uuid
    prompt, input_ids = kw.get("prompt"), kw.get("input_ids")
    id_batch = isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list)
    is_batch = isinstance(prompt, list) or id_batch
    n = len(prompt) if isinstance(prompt, list) else (len(input_ids) if id_batch else 1)
    if kw.get("rid") is None:
        rids = [uuid.uuid4().hex for _ in range(n)]
        kw["rid"] = rids if is_batch else rids[0]
    rid = kw["rid"]
    return ([r for r in rid if isinstance(r, str)] if isinstance(rid, list) else [rid]), is_batch


def _n_hints(sampling_params, k: int) -> list[int]:
    """Each prompt's expected family size (n), read before validation (abort counts only)."""
    sps = sampling_params if isinstance(sampling_params, list) else [sampling_params] * k
    out = []
    for sp in (list(sps) + [None] * k)[:k]:
        n = sp.get("n", 1) if isinstance(sp, dict) else getattr(sp, "n", 1)
        out.append(n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1)
    return out


def _expand(items: list[GenerateItem]) -> tuple[list, list[str | None]]:
    reqs, parents = [], []
    for item in items:
        kids = item.expand()
        reqs += kids
        parents += [item.rid if item.sampling_params.n > 1 else None] * len(kids)
    return reqs, parents


class TokenizerManager:
    def __init__(self, args: ServerArgs, ports: PortArgs, scheduler_info: dict) -> None:
        from radixlm.srt.weights.loader import load_tokenizer

        self.args = args
        self.scheduler_info = scheduler_info
        self.model_path: str = scheduler_info["model_path"]
        self.vocab_size: int = scheduler_info["vocab_size"]
        self.context_len: int = scheduler_info["max_context_len"]
        # the tokenizer stays the one loaded at start, whatever weights are loaded later
        self.tokenizer_path: str = args.tokenizer_path or self.model_path
        # --skip-tokenizer-init: ids in, ids out; results carry no "text" (as SGLang answers)
        self.tokenizer = None if args.skip_tokenizer_init else load_tokenizer(self.tokenizer_path)
        max_chars_per_token(self.tokenizer)  # read from the vocabulary once, now, not in a request
        # what a request leaves unset comes from the model's generation_config.json
        self.sampling_defaults = model_sampling_defaults(self.model_path)
        if self.sampling_defaults:
            logger.info("sampling defaults from the model's generation config: %s", self.sampling_defaults)
        self.limits = args.request_limits()
        self._actx = zmq.asyncio.Context()
        self._sctx = zmq.Context()
        self.receiver = AsyncReceiver(self._actx, ports.tokenizer_input)
        self.to_scheduler = AsyncSender(self._sctx, ports.scheduler_input)
        self.table = RequestTable()
        self._submissions = itertools.count()
        self.paused = False
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self.model_update_lock = RWLock()
        self.weight_version = "0"
        # Updates applied so far: the default version label, and the cache namespace of the
        # weights now loaded (never reused, unlike a user-chosen label), so KV of other weights
        # is never matched.
        self._weights_generation = 0
        self.memory_released = False
        self.dead: str | None = None  # set when a runtime process died
        self.closing: str | None = None  # set when shutdown began
        self._rpc: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count(1)
        self._loop_task: asyncio.Task | None = None
        self.metrics = RuntimeMetrics()
        self.last_receive_time = time.time()
        self.tokens_generated = 0  # every output token received (progress bars read it)

    @property
    def states(self) -> dict[str, ReqState]:
        return self.table.states

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the receive loop on the running event loop."""
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._handle_loop())

    async def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except (asyncio.CancelledError, Exception):
                pass
        self.receiver.sock.close(0)
        self.to_scheduler.sock.close(0)
        self._actx.term()
        self._sctx.term()

    async def _handle_loop(self) -> None:
        while True:
            msg = await self.receiver.recv()
            self.last_receive_time = time.time()
            if isinstance(msg, BatchTextOut):
                for o in msg.outputs:
                    self._on_output(o)
            elif isinstance(msg, RpcReply):
                fut = self._rpc.pop(msg.call_id, None)
                if fut is not None and not fut.done():
                    if msg.error:
                        fut.set_exception(RuntimeError(msg.error))
                    else:
                        fut.set_result(msg.result)

    def _on_output(self, o: ReqTextOutput) -> None:
        st = self.table.by_sched.get(o.out.rid)
        if st is None:
            self.table.drop(o.out)  # answered already (aborted): nothing more is delivered
            return
        if o.out.detok is not None:
            st.detok = o.out.detok
        if o.failed:  # ended by the detokenizer: stop its generation too (once: st is done now)
            self.to_scheduler.send(AbortReq(rids=[st.sched_rid], sent_time=time.time()))
        now = time.perf_counter()
        self.tokens_generated += len(o.out.new_token_ids)
        if o.out.new_token_ids:
            if st.first_token_time is None:
                st.first_token_time = now
                self.metrics.observe_ttft(now - st.start)
            elif st.last_token_time is not None:
                n = len(o.out.new_token_ids)
                self.metrics.observe_itl((now - st.last_token_time) / n, n)
            st.last_token_time = now
        st.pending.append(o)
        if o.out.finish_reason is not None:
            st.done = True
            del self.table.by_sched[o.out.rid]
        st.call.wake.set()

    def _answer(self, st: ReqState, reason: dict) -> None:
        """Answer `st`'s caller now (what it received so far, then `reason`)."""
        if st.done:
            return
        st.done = True
        self.table.detach(st)
        out = terminal_output(st, reason)
        out.new_text = self._answer_text(st)
        st.pending.append(out)
        st.call.wake.set()

    def _answer_text(self, st: ReqState) -> str:
        """Text for the ids `st` received that its outputs did not carry: a non-streamed
        request's text is decoded only at its end (DetokParams.text_at_end; st is not done, so
        no output of it carried text yet), so when the front end answers first it decodes them
        here, holding back what a streaming detokenizer would hold back."""
        if self.tokenizer is None or st.detok is None or not st.detok.text_at_end:
            return ""
        ids = st.output_ids + [t for p in st.pending for t in p.out.new_token_ids]
        return released_text(self.tokenizer, st.detok, ids) if ids else ""

    def _abort_everything(self, reason: dict, tell_scheduler: bool) -> int:
        return self.abort_request(abort_all=True, reason=reason, tell_scheduler=tell_scheduler)

    def fail_all(self, message: str) -> None:
        """A runtime process died: answer every live request with a 500 abort (nothing else
        ever would) and refuse new ones, instead of leaving callers hanging."""
        self.dead = message
        self._abort_everything(abort_reason(message, 500), tell_scheduler=False)
        self.table.draining.clear()  # nothing will ever report their end
        self._fail_rpcs(message)

    def shut_down(self, message: str) -> int:
        """Shutdown begins: every caller, wherever its request is, gets an abort (503) now;
        new requests are refused. Returns how many requests were answered."""
        self.closing = message
        n = self._abort_everything(abort_reason(message, 503), tell_scheduler=self.dead is None)
        self._fail_rpcs(message)
        return n

    def _fail_rpcs(self, message: str) -> None:
        for fut in self._rpc.values():
            if not fut.done():
                fut.set_exception(RuntimeError(message))

    # ------------------------------------------------------------------ rpc
    async def rpc(self, req: RpcReq, timeout: float = 60.0) -> Any:
        if self.dead:
            raise RuntimeError(f"the runtime is down: {self.dead}")
        if self.closing:
            raise RuntimeError(self.closing)
        req.call_id = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self._rpc[req.call_id] = fut
        self.to_scheduler.send(req)
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._rpc.pop(req.call_id, None)

    async def get_server_info(self) -> dict:
        info = await self.rpc(GetInfoReq())
        places = self.table.places()
        # num_tokenizing_reqs: requests not yet sent to the scheduler (tokenizing, held while
        # paused, or waiting for the weight lock); tests use it to know a request is held.
        info.update(weight_version=self.weight_version, memory_released=self.memory_released,
                    tokenizer_paused=self.paused,
                    num_tokenizing_reqs=places["tokenizing"] + places[PAUSED] + places[WEIGHT_LOCK],
                    front_end={**places, "writers_waiting": self.model_update_lock.writers_waiting,
                               "recent_aborts": [list(a) for a in self.table.recent_aborts]})
        return info

    async def check_integrity(self) -> None:
        await self.rpc(CheckIntegrityReq())

    async def open_session(self, capacity: int, session_id: str | None = None,
                           timeout: float | None = None) -> str:
        """A session (semantics §15); ValueError when the scheduler refuses it."""
        reply = await self.rpc(OpenSessionReq(capacity=capacity, session_id=session_id, timeout=timeout))
        if not reply["success"]:
            raise ValueError(reply["message"])
        return reply["session_id"]

    async def close_session(self, session_id: str) -> None:
        reply = await self.rpc(CloseSessionReq(session_id=session_id))
        if not reply["success"]:
            raise ValueError(reply["message"])

    async def flush_cache(self, timeout: float = 30.0) -> bool:
        """Succeeds once the scheduler is idle: requests that were just aborted may need a
        step to drain, so retry until the deadline instead of failing at once."""
        deadline = time.monotonic() + timeout
        while True:
            if await self.rpc(FlushCacheReq()):
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.02)

    # ------------------------------------------------------------------ abort
    def abort_request(self, rid: str = "", abort_all: bool = False, prefix: bool = False, *,
                      reason: dict | None = None, sent_time: float | None = None,
                      tell_scheduler: bool = True) -> int:
        """Abort `rid` and its own n > 1 children (never a look-alike rid), every rid starting
        with `rid` (prefix=True), or everything. Each caller hit is answered now; returns how
        many requests were hit. A rid that is not here (and was not just answered) leaves a
        tombstone: the request is aborted when it arrives (TOMBSTONE_TTL_S)."""
        if not rid and not abort_all:
            logger.warning("abort_request with an empty rid and abort_all=False is ignored")
            return 0
        reason = reason or USER_ABORT
        sent_time = time.time() if sent_time is None else sent_time
        early, reqs = self.table.find(rid, abort_all, prefix)
        for call, name in early:  # still tokenizing: never sent
            call.aborted[name] = reason
            call.wake.set()
        sched_rids = [st.sched_rid for st in reqs if st.sent]
        self._answer_all(reqs, reason)
        if tell_scheduler and abort_all:
            self.to_scheduler.send(AbortReq(abort_all=True, sent_time=sent_time))
        elif tell_scheduler and sched_rids:
            self.to_scheduler.send(AbortReq(rids=sched_rids, sent_time=sent_time))
        count = sum(call.n_hints[name] for call, name in early) + len(reqs)
        if count == 0 and not abort_all and not prefix and self.table.tombstone(rid):
            logger.debug("abort of %r: not here yet, kept as a tombstone", rid)
        return count

    def _answer_all(self, reqs: list[ReqState], reason: dict) -> None:
        now = time.time()
        for st in reqs:
            self._answer(st, reason)
            self.table.recent_aborts.append((st.rid, now))

    def _abort_own(self, call: Call) -> None:
        """The caller went away (closed the stream, disconnected, was cancelled): abort what
        this call still has in the scheduler, by identity."""
        live = [st for st in call.states if not st.done]
        sched_rids = [st.sched_rid for st in live if st.sent]
        self._answer_all(live, USER_ABORT)
        if sched_rids and not self.dead:
            self.to_scheduler.send(AbortReq(rids=sched_rids, sent_time=time.time()))

    # ------------------------------------------------------------------ pause
    async def pause_generation(self, mode: str = "abort") -> None:
        """Stop generating; new requests wait here until continue_generation. While paused,
        a weight update does not wait for the paused requests (docs/cancel_chain.md)."""
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause mode must be abort, retract or in_place, got {mode!r}")
        self.paused = True
        self._unpaused.clear()
        if mode == "abort":
            self.abort_request(abort_all=True)
        await self.rpc(PauseReq(mode=mode))
        if self.paused:  # (unless continue_generation came meanwhile)
            self.model_update_lock.freeze_readers(True)

    async def continue_generation(self) -> None:
        self.model_update_lock.freeze_readers(False)
        await self.rpc(ContinueReq())
        self.paused = False
        self._unpaused.set()

    # ------------------------------------------------------------------ RL: weights and memory
    async def update_weights_from_tensor(self, named_tensors, flush_cache: bool = True,
                                         weight_version: str | None = None) -> dict:
        if isinstance(named_tensors, dict):
            named_tensors = list(named_tensors.items())
        return await self._update_weights(UpdateWeightsFromTensorReq(
            named_tensors=[(n, t.detach().cpu()) for n, t in named_tensors], flush_cache=flush_cache),
            weight_version)

    async def update_weights_from_disk(self, model_path: str, flush_cache: bool = True,
                                       weight_version: str | None = None) -> dict:
        res = await self._update_weights(UpdateWeightsFromDiskReq(model_path=model_path, flush_cache=flush_cache),
                                         weight_version)
        self.model_path = model_path  # what /get_model_info reports from now on (as SGLang does)
        return res

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str = "weight_update_group",
                                        backend: str = "nccl") -> dict:
        """Every scheduler rank joins the trainer's group (blocks until all members have)."""
        req = InitWeightsUpdateGroupReq(master_address=master_address, master_port=int(master_port),
                                        rank_offset=int(rank_offset), world_size=int(world_size),
                                        group_name=group_name, backend=backend)
        return await self._rpc_value_error(req, timeout=self.args.dist_timeout + 60)

    async def update_weights_from_distributed(self, names: list[str], dtypes: list, shapes: list[list[int]],
                                              group_name: str = "weight_update_group", flush_cache: bool = True,
                                              weight_version: str | None = None,
                                              abort_all_requests: bool = False) -> dict:
        """Receive the tensors the trainer broadcasts on `group_name` (it broadcasts them in this
        order, whole; every rank keeps its shard). Waits for running requests like every update."""
        from radixlm.srt.distributed.weight_sync import check_update_request
        check_update_request(names, dtypes, shapes)
        if abort_all_requests:
            self.abort_request(abort_all=True)
        req = UpdateWeightsFromDistributedReq(names=list(names), dtypes=[str(d) for d in dtypes],
                                              shapes=[list(map(int, s)) for s in shapes], group_name=group_name,
                                              flush_cache=flush_cache)
        return await self._update_weights(req, weight_version, timeout=self.args.dist_timeout + 600)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        return await self._rpc_value_error(DestroyWeightsUpdateGroupReq(group_name=group_name))

    async def _rpc_value_error(self, req: RpcReq, timeout: float = 60.0) -> Any:
        try:
            return await self.rpc(req, timeout=timeout)
        except RuntimeError as e:
            raise ValueError(str(e).split(": ", 1)[-1]) from None

    async def _update_weights(self, req, weight_version: str | None, timeout: float = 600) -> dict:
        # Running requests finish first, unless paused (then they continue afterwards).
        async with self.model_update_lock.write():
            req.cache_namespace = f"weights:{self._weights_generation + 1}"
            result = await self._rpc_value_error(req, timeout=timeout)
            self._weights_generation += 1
            self.weight_version = str(weight_version) if weight_version is not None \
                else str(self._weights_generation)
            for sched_rid, n_out in result.pop("live_output_lens", {}).items():
                st = self.table.by_sched.get(sched_rid)
                if st is not None and st.weight_versions:  # paused in the scheduler: a new segment
                    if st.weight_versions[-1][1] == n_out:
                        st.weight_versions[-1][0] = self.weight_version
                    else:
                        st.weight_versions.append([self.weight_version, n_out])
            return {**result, "weight_version": self.weight_version}

    def update_weight_version(self, weight_version: str) -> None:
        self.weight_version = str(weight_version)

    async def get_weights_by_name(self, name: str, truncate_size: int = 100, max_elements: int | None = None) -> list:
        return await self._rpc_value_error(GetWeightsByNameReq(name=name, truncate_size=truncate_size,
                                                               max_elements=max_elements))

    async def release_memory_occupation(self) -> None:
        async with self.model_update_lock.write():
            await self.rpc(ReleaseMemoryReq())
            self.memory_released = True

    async def resume_memory_occupation(self) -> None:
        async with self.model_update_lock.write():
            await self.rpc(ResumeMemoryReq())
            self.memory_released = False

    # ------------------------------------------------------------------ generate
    def normalize(self, **kw) -> tuple[list[GenerateItem], bool]:
        kw["sampling_params"] = with_sampling_defaults(kw.get("sampling_params"), self.sampling_defaults)
        return normalize_generate(self.tokenizer, vocab_size=self.vocab_size, context_len=self.context_len,
                                  limits=self.limits, **kw)

    def _check_serving(self) -> None:
        if self.dead:
            raise RuntimeError(f"the runtime is down: {self.dead}")
        if self.closing:
            raise RuntimeError(self.closing)
        if self.memory_released:
            raise ValueError(MEMORY_RELEASED)

    async def generate_request(self, *, return_text_in_logprobs: bool = False, **kw) -> AsyncIterator:
        """Yields incremental chunks when streaming, else one final result (a dict, or a list
        for a batch or n > 1). Closing the iterator early aborts what is still running."""
        self._check_serving()
        rids, is_batch = _assign_rids(kw)
        call = self.table.arrive(rids, _n_hints(kw.get("sampling_params"), len(rids)), is_batch)
        admission: asyncio.Future | None = None
        try:
            try:
                items = await self._tokenize(call, kw)
            except ValueError as e:
                if kw.get("bootstrap_room") is not None:  # disaggregation: the peer learns it now
                    self._reject_rooms(kw, [call.n_hints[r] for r in rids], str(e))
                raise
            if items is None:  # every prompt was aborted while it was being tokenized
                results = early_abort_results(rids, call.n_hints, call.aborted, self.weight_version)
                yield results if (is_batch or len(results) > 1) else results[0]
                return
            reqs, parents = _expand(items)
            self.table.register(call, reqs, parents)  # no await since arrive(): one step
            if not call.all_answered:
                admission = asyncio.ensure_future(self._admit(call, {r.rid: r for r in reqs}))
            if kw.get("stream"):
                async for chunk in self._stream(call, return_text_in_logprobs):
                    yield chunk
            else:
                results = [await self._wait_final(call, st, return_text_in_logprobs) for st in call.states]
                yield results if (is_batch or len(results) > 1) else results[0]
        finally:
            if admission is not None and not admission.done():
                admission.cancel()  # cancellation-safe: a lock granted meanwhile is given back
            self._abort_own(call)
            if call.holds_read:
                call.holds_read = False
                self.model_update_lock.release_read()
            self.table.end(call)

    def _reject_rooms(self, kw: dict, n_hints: list[int], message: str) -> None:
        if self.args.disaggregation_mode == "null":
            return
        k = len(n_hints)
        fields = [kw.get(f"bootstrap_{f}") for f in ("host", "port", "room")]
        per = [v if isinstance(v, list) else [v] * k for v in fields]
        rooms = [(h, p, r, i) for (h, p, r), n in zip(zip(*per), n_hints)
                 if isinstance(h, str) and isinstance(p, int) and isinstance(r, int) for i in range(n)]
        if rooms:
            self.to_scheduler.send(RejectRoomsReq(rooms=rooms, message=message, status_code=400))

    async def _tokenize(self, call: Call, kw: dict) -> list[GenerateItem] | None:
        """Long texts are tokenized off the event loop so other requests keep flowing; an abort
        of every prompt meanwhile answers the caller at once (None)."""
        prompt = kw.get("prompt")
        texts = prompt if isinstance(prompt, list) else [prompt]
        size = sum(len(t) for t in texts if isinstance(t, str))
        kwargs = {k: v for k, v in kw.items() if k != "return_text_in_logprobs"}
        if size < TOKENIZE_INLINE_MAX_CHARS:
            return self.normalize(**kwargs)[0]
        work = asyncio.get_running_loop().run_in_executor(None, lambda: self.normalize(**kwargs))
        while not call.all_answered:
            waker = asyncio.ensure_future(call.wake.wait())
            try:
                await asyncio.wait((work, waker), return_when=asyncio.FIRST_COMPLETED)
            finally:
                waker.cancel()
            if work.done():
                return work.result()[0]
            call.wake.clear()
        work.add_done_callback(lambda f: f.exception())  # nobody reads it: no "never retrieved"
        return None

    async def _admit(self, call: Call, reqs: dict) -> None:
        """Held while paused, then the read side of the weight lock, then the scheduler."""
        lock = self.model_update_lock
        while True:
            if self.paused:
                call.place = PAUSED
                await self._unpaused.wait()
            call.place = WEIGHT_LOCK
            await lock.acquire_read()
            if not self.paused:
                break
            lock.release_read()  # paused again while it waited for the lock
        call.place = SENT
        if self.memory_released:
            lock.release_read()
            call.fail(ValueError(MEMORY_RELEASED))
            return
        live = [st for st in call.states if not st.done]
        if not live:
            lock.release_read()
            return
        call.holds_read = True  # until the call ends: a request runs on one weight version,
        version = self.weight_version  # unless a paused update moves it (weight_versions)
        for st in live:
            r = reqs[st.rid]
            self.table.send(st, f"{st.rid}#{next(self._submissions)}")
            st.weight_versions = [[version, 0]]
            self.metrics.on_request(len(r.input_ids))
            r.rid = st.sched_rid
            # KV of other weights is never shared; the caller's own namespace goes under it
            namespace = f"weights:{self._weights_generation}"
            r.extra_key = namespace if r.extra_key is None else f"{namespace}|{r.extra_key}"
            self.to_scheduler.send(r)

    async def _wait_final(self, call: Call, st: ReqState, with_text: bool) -> dict:
        while True:
            if call.error is not None:
                raise call.error
            call.wake.clear()
            absorb(st, self.metrics)
            if st.finished:
                return result(st, self.tokenizer, with_text, full=True, weight_version=self.weight_version)
            await call.wake.wait()

    async def _stream(self, call: Call, with_text: bool) -> AsyncIterator[dict]:
        states = call.states
        live = set(range(len(states)))
        while live:
            if call.error is not None:
                raise call.error
            call.wake.clear()
            for i in sorted(live):
                st = states[i]
                if not st.pending:
                    continue
                chunk = absorb(st, self.metrics)
                if not (chunk["output_ids"] or chunk["text"] or st.finished):
                    continue  # news without tokens (a retraction): nothing to stream
                out = result(st, self.tokenizer, with_text, full=False, delta=chunk,
                             weight_version=self.weight_version)
                if len(states) > 1:
                    out["index"] = i
                yield out
                if st.finished:
                    live.discard(i)
            if live and not any(states[i].pending for i in live):
                await call.wake.wait()

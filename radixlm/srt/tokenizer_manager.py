"""The TokenizerManager: the asyncio front of the runtime (HTTP server and Engine share it).

It tokenizes and validates requests, keeps `rid → state`, sends work to the scheduler,
receives detokenized outputs, and aborts requests whose caller went away.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import zmq
import zmq.asyncio

from radixlm.config import ServerArgs
from radixlm.ipc import AsyncReceiver, AsyncSender, PortArgs
from radixlm.messages import (AbortReq, BatchTextOut, CheckIntegrityReq, ContinueReq, FlushCacheReq, GetInfoReq,
                              GetWeightsByNameReq, PauseReq, ReleaseMemoryReq, ReqOutput, ReqTextOutput, ResumeMemoryReq,
                              RpcReply, RpcReq, UpdateWeightsFromDiskReq, UpdateWeightsFromTensorReq)
from radixlm.scheduler.abort import abort_matches
from radixlm.srt.generate_request import GenerateItem, normalize_generate
from radixlm.srt.metrics import RuntimeMetrics
from radixlm.srt.rwlock import RWLock
from radixlm.validation import RequestLimits

logger = logging.getLogger(__name__)

# Prompts longer than this are tokenized in a worker thread.
TOKENIZE_INLINE_MAX_CHARS = 20_000


class _Tokenizing:
    """Requests between arrival and submission (tokenizing, or held while paused); an abort
    marks them so they are never sent."""

    def __init__(self, rids: list[str]) -> None:
        self.rids = rids
        self.aborted = False
        self.wake = asyncio.Event()  # set by an abort or by continue_generation


def _assign_rids(kw: dict) -> list[str]:
    """Give every prompt of the call its rid now, so an abort can name it while tokenizing."""
    import uuid
    prompt, input_ids = kw.get("prompt"), kw.get("input_ids")
    id_batch = isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list)
    n = len(prompt) if isinstance(prompt, list) else (len(input_ids) if id_batch else 1)
    if kw.get("rid") is None:
        rids = [uuid.uuid4().hex for _ in range(n)]
        kw["rid"] = rids if (isinstance(prompt, list) or id_batch) else rids[0]
    rid = kw["rid"]
    return [r for r in rid if isinstance(r, str)] if isinstance(rid, list) else [rid]


def _aborted_result(rid: str, prompt_tokens: int, weight_version: str) -> dict:
    return {"text": "", "output_ids": [],
            "meta_info": {"id": rid, "finish_reason": {"type": "abort", "message": "Aborted by the client",
                                                       "status_code": 200},
                          "prompt_tokens": prompt_tokens, "completion_tokens": 0, "cached_tokens": 0,
                          "num_retractions": 0, "e2e_latency": 0.0, "weight_version": weight_version}}


@dataclass
class ReqState:
    rid: str  # the caller's id (meta_info["id"])
    prompt_tokens: int
    stream: bool
    # The scheduler's id: unique per submission, so a late output of an aborted request can
    # never be mistaken for a new request that reuses its rid.
    sched_rid: str = ""
    abort_sent: bool = False
    weight_version: str = "0"
    start: float = field(default_factory=time.perf_counter)
    pending: list[ReqTextOutput] = field(default_factory=list)
    event: asyncio.Event = field(default_factory=asyncio.Event)
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    finish_reason: dict | None = None
    cached_tokens: int = 0
    num_retractions: int = 0
    output_token_logprobs: list = field(default_factory=list)
    output_top_logprobs: list = field(default_factory=list)
    input_token_logprobs: list | None = None
    input_top_logprobs: list | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


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
        self.limits = RequestLimits.from_args(args)
        self._actx = zmq.asyncio.Context()
        self._sctx = zmq.Context()
        self.receiver = AsyncReceiver(self._actx, ports.tokenizer_input)
        self.to_scheduler = AsyncSender(self._sctx, ports.scheduler_input)
        self.states: dict[str, ReqState] = {}
        self._by_sched_rid: dict[str, ReqState] = {}
        self.tokenizing: list[_Tokenizing] = []
        self._submissions = itertools.count()
        self.paused = False
        self.model_update_lock = RWLock()
        self.weight_version = "0"
        self._num_weight_updates = 0
        self.memory_released = False
        self.dead: str | None = None  # set when a runtime process died
        self._rpc: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count(1)
        self._loop_task: asyncio.Task | None = None
        self.metrics = RuntimeMetrics()
        self.last_receive_time = time.time()

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
        st = self._by_sched_rid.get(o.out.rid)
        if st is None:
            return  # the caller is gone (aborted); its terminal output needs no reader
        if o.failed and not st.abort_sent:  # ended by the detokenizer: stop its generation too
            st.abort_sent = True
            self.to_scheduler.send(AbortReq(rids=[st.sched_rid], sent_time=time.time()))
        now = time.perf_counter()
        if o.out.new_token_ids:
            if st.first_token_time is None:
                st.first_token_time = now
                self.metrics.observe_ttft(now - st.start)
            elif st.last_token_time is not None:
                n = len(o.out.new_token_ids)
                self.metrics.observe_itl((now - st.last_token_time) / n, n)
            st.last_token_time = now
        st.pending.append(o)
        st.event.set()

    def fail_all(self, message: str) -> None:
        """A runtime process died: answer every live request with a 500 abort (nothing else
        ever would) and refuse new ones, instead of leaving callers hanging."""
        self.dead = message
        reason = {"type": "abort", "message": message, "status_code": 500}
        for st in list(self.states.values()):
            if not st.finished:
                self._on_output(ReqTextOutput(ReqOutput(
                    rid=st.sched_rid, new_token_ids=[], finish_reason=reason, prompt_tokens=st.prompt_tokens,
                    completion_tokens=len(st.output_ids), cached_tokens=st.cached_tokens), ""))
        for fut in self._rpc.values():
            if not fut.done():
                fut.set_exception(RuntimeError(message))

    # ------------------------------------------------------------------ rpc
    async def rpc(self, req: RpcReq, timeout: float = 60.0) -> Any:
        if self.dead:
            raise RuntimeError(f"the runtime is down: {self.dead}")
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
        # num_tokenizing_reqs: requests not yet sent to the scheduler (tokenizing, or held
        # while paused); tests use it to know a request is held before they abort it.
        info.update(weight_version=self.weight_version, memory_released=self.memory_released,
                    tokenizer_paused=self.paused, num_tokenizing_reqs=len(self.tokenizing))
        return info

    async def check_integrity(self) -> None:
        await self.rpc(CheckIntegrityReq())

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
    def abort_request(self, rid: str = "", abort_all: bool = False, prefix: bool = False) -> int:
        """Abort by rid (plus its n > 1 children), by rid prefix, or everything; returns how many
        requests were newly aborted. Each request is sent to the scheduler at most once; an
        unknown or finished rid is a no-op."""
        if not rid and not abort_all:
            logger.warning("abort_request with an empty rid and abort_all=False is ignored")
            return 0
        msg = AbortReq(rid=rid, abort_all=abort_all, prefix=prefix)
        now = time.time()
        # requests still being tokenized are stopped before they are ever sent
        hit_tokenizing = [t for t in self.tokenizing
                          if not t.aborted and any(abort_matches(msg, r) for r in t.rids)]
        for t in hit_tokenizing:
            t.aborted = True
            t.wake.set()
        targets = [st for st in self.states.values()
                   if not st.abort_sent and not st.finished and abort_matches(msg, st.rid)]
        for st in targets:
            st.abort_sent = True
        if abort_all:
            self.to_scheduler.send(AbortReq(abort_all=True, sent_time=now))
        elif targets:
            self.to_scheduler.send(AbortReq(rids=[st.sched_rid for st in targets], sent_time=now))
        return len(targets) + len(hit_tokenizing)

    # ------------------------------------------------------------------ pause
    async def pause_generation(self, mode: str = "abort") -> None:
        """Stop generating; new requests wait here until continue_generation."""
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause mode must be abort, retract or in_place, got {mode!r}")
        self.paused = True
        if mode == "abort":
            self.abort_request(abort_all=True)
        await self.rpc(PauseReq(mode=mode))

    async def continue_generation(self) -> None:
        await self.rpc(ContinueReq())
        self.paused = False
        for t in self.tokenizing:
            t.wake.set()

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

    async def _update_weights(self, req, weight_version: str | None) -> dict:
        async with self.model_update_lock.write():  # running requests finish first
            try:
                result = await self.rpc(req, timeout=600)
            except RuntimeError as e:
                raise ValueError(str(e).split(": ", 1)[-1]) from None
            self._num_weight_updates += 1
            self.weight_version = str(weight_version) if weight_version is not None \
                else str(self._num_weight_updates)
            return {**result, "weight_version": self.weight_version}

    def update_weight_version(self, weight_version: str) -> None:
        self.weight_version = str(weight_version)

    async def get_weights_by_name(self, name: str, truncate_size: int = 100, max_elements: int | None = None) -> list:
        try:
            return await self.rpc(GetWeightsByNameReq(name=name, truncate_size=truncate_size,
                                                      max_elements=max_elements))
        except RuntimeError as e:
            raise ValueError(str(e).split(": ", 1)[-1]) from None

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
        return normalize_generate(self.tokenizer, vocab_size=self.vocab_size, context_len=self.context_len,
                                  limits=self.limits, **kw)

    async def generate_request(self, *, return_text_in_logprobs: bool = False, **kw) -> AsyncIterator:
        """Yields incremental chunks when streaming, else one final result (a dict, or a list
        for a batch or n > 1). Closing the iterator early aborts what is still running."""
        if self.dead:
            raise RuntimeError(f"the runtime is down: {self.dead}")
        rids = _assign_rids(kw)
        pending = _Tokenizing(rids)
        self.tokenizing.append(pending)
        try:
            items, is_batch = await self._normalize_async(kw)
            while self.paused and not pending.aborted:  # held here until continue_generation
                pending.wake.clear()
                await pending.wake.wait()
        finally:
            self.tokenizing.remove(pending)
        stream = bool(kw.get("stream"))
        reqs = [r for item in items for r in item.expand()]
        for r in reqs:
            if r.rid in self.states:
                raise ValueError(f"duplicate request id {r.rid!r}: a request with this id is running")
        if pending.aborted:  # aborted while tokenizing: never admitted
            results = [_aborted_result(r.rid, len(r.input_ids), self.weight_version) for r in reqs]
            yield results if (is_batch or len(results) > 1) else results[0]
            return
        # The read side is held for the request's whole life: a weight update waits for it,
        # so every request runs on one weight version from its first token to its last.
        async with self.model_update_lock.read():
            if self.memory_released:
                raise ValueError("generation is unavailable: memory was released with "
                                 "release_memory_occupation(); call resume_memory_occupation() first")
            version = self.weight_version
            for r in reqs:
                st = ReqState(r.rid, len(r.input_ids), stream, sched_rid=f"{r.rid}#{next(self._submissions)}",
                              weight_version=version)
                self.states[r.rid] = st
                self._by_sched_rid[st.sched_rid] = st
            for r in reqs:
                self.metrics.on_request(len(r.input_ids))
                r.rid = self.states[r.rid].sched_rid
                r.extra_key = f"weights:{version}"  # KV of other weight versions is never shared
                self.to_scheduler.send(r)
            user_rids = [r.rid.rsplit("#", 1)[0] for r in reqs]
            try:
                if stream:
                    async for chunk in self._stream(user_rids, return_text_in_logprobs):
                        yield chunk
                else:
                    results = [await self._wait_final(r, return_text_in_logprobs) for r in user_rids]
                    yield results if (is_batch or len(results) > 1) else results[0]
            finally:
                unfinished = [r for r in user_rids if r in self.states and not self.states[r].finished]
                for r in unfinished:
                    self.abort_request(r)
                for r in user_rids:
                    st = self.states.pop(r, None)
                    if st is not None:
                        self._by_sched_rid.pop(st.sched_rid, None)

    async def _normalize_async(self, kw: dict):
        # Long texts are tokenized off the event loop so other requests keep flowing.
        prompt = kw.get("prompt")
        texts = prompt if isinstance(prompt, list) else [prompt]
        size = sum(len(t) for t in texts if isinstance(t, str))
        if size < TOKENIZE_INLINE_MAX_CHARS:
            return self.normalize(**kw)
        return await asyncio.get_running_loop().run_in_executor(None, lambda: self.normalize(**kw))

    async def _wait_final(self, rid: str, with_text: bool) -> dict:
        st = self.states[rid]
        while True:
            self._absorb(st)
            if st.finished:
                return self._result(st, with_text, full=True)
            st.event.clear()
            await st.event.wait()

    async def _stream(self, rids: list[str], with_text: bool) -> AsyncIterator[dict]:
        index = {r: i for i, r in enumerate(rids)}
        live = set(rids)
        waiter = asyncio.Event()
        for r in rids:
            self.states[r].event = waiter
        while live:
            waiter.clear()
            for r in list(live):
                st = self.states[r]
                if not st.pending:
                    continue
                chunk = self._absorb(st)
                result = self._result(st, with_text, full=False, delta=chunk)
                if len(rids) > 1:
                    result["index"] = index[r]
                yield result
                if st.finished:
                    live.discard(r)
            if live and not any(self.states[r].pending for r in live):
                await waiter.wait()

    def _absorb(self, st: ReqState) -> dict:
        """Fold pending outputs into the state; return the delta they carried."""
        text, ids, lps, tops = "", [], [], []
        for o in st.pending:
            out = o.out
            text += o.new_text
            ids.extend(out.new_token_ids)
            lps.extend(out.output_token_logprobs)
            tops.extend(out.output_top_logprobs)
            st.cached_tokens = out.cached_tokens
            st.num_retractions = out.num_retractions
            if out.input_token_logprobs is not None and st.input_token_logprobs is None:
                st.input_token_logprobs = out.input_token_logprobs
                st.input_top_logprobs = out.input_top_logprobs
            if out.finish_reason is not None:
                st.finish_reason = out.finish_reason
                self.metrics.on_finish(st, out)
        st.pending.clear()
        st.text += text
        st.output_ids.extend(ids)
        st.output_token_logprobs.extend(lps)
        st.output_top_logprobs.extend(tops)
        return {"text": text, "output_ids": ids, "lps": lps, "tops": tops}

    def _with_text(self, pairs, with_text: bool):
        if pairs is None:
            return None
        with_text = with_text and self.tokenizer is not None
        return [(lp, tok, self.tokenizer.decode([tok]) if with_text else None) for lp, tok in pairs]

    def _result(self, st: ReqState, with_text: bool, full: bool, delta: dict | None = None) -> dict:
        meta = {"id": st.rid, "finish_reason": st.finish_reason, "prompt_tokens": st.prompt_tokens,
                "completion_tokens": len(st.output_ids), "cached_tokens": st.cached_tokens,
                "num_retractions": st.num_retractions, "weight_version": st.weight_version,
                "e2e_latency": time.perf_counter() - st.start}
        lps = st.output_token_logprobs if full else delta["lps"]
        tops = st.output_top_logprobs if full else delta["tops"]
        if st.output_token_logprobs or st.input_token_logprobs is not None:
            meta["output_token_logprobs"] = self._with_text(lps, with_text)
            meta["output_top_logprobs"] = [self._with_text(t, with_text) for t in tops]
            meta["input_token_logprobs"] = self._with_text(st.input_token_logprobs or [], with_text)
            meta["input_top_logprobs"] = [self._with_text(t, with_text) for t in (st.input_top_logprobs or [])]
        out = {"text": st.text if full else delta["text"],
               "output_ids": list(st.output_ids) if full else delta["output_ids"], "meta_info": meta}
        if self.tokenizer is None:
            del out["text"]
        return out

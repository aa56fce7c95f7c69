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
from radixlm.messages import (AbortReq, BatchTextOut, CheckIntegrityReq, FlushCacheReq, GetInfoReq,
                              ReqTextOutput, RpcReply, RpcReq)
from radixlm.srt.generate_request import GenerateItem, normalize_generate
from radixlm.srt.metrics import RuntimeMetrics

logger = logging.getLogger(__name__)


@dataclass
class ReqState:
    rid: str
    prompt_tokens: int
    stream: bool
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
        self.tokenizer = load_tokenizer(args.tokenizer_path or self.model_path)
        self._actx = zmq.asyncio.Context()
        self._sctx = zmq.Context()
        self.receiver = AsyncReceiver(self._actx, ports.tokenizer_input)
        self.to_scheduler = AsyncSender(self._sctx, ports.scheduler_input)
        self.states: dict[str, ReqState] = {}
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
        st = self.states.get(o.out.rid)
        if st is None:
            return  # the caller is gone (aborted); its terminal output needs no reader
        now = time.perf_counter()
        if o.out.new_token_ids:
            if st.first_token_time is None:
                st.first_token_time = now
                self.metrics.observe_ttft(now - st.start)
            elif st.last_token_time is not None:
                self.metrics.observe_itl((now - st.last_token_time) / len(o.out.new_token_ids))
            st.last_token_time = now
        st.pending.append(o)
        st.event.set()

    # ------------------------------------------------------------------ rpc
    async def rpc(self, req: RpcReq, timeout: float = 60.0) -> Any:
        req.call_id = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self._rpc[req.call_id] = fut
        self.to_scheduler.send(req)
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._rpc.pop(req.call_id, None)

    async def get_server_info(self) -> dict:
        return await self.rpc(GetInfoReq())

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
    def abort_request(self, rid: str = "", abort_all: bool = False, prefix: bool = False) -> None:
        if not rid and not abort_all:
            logger.warning("abort_request with an empty rid and abort_all=False is ignored")
            return
        self.to_scheduler.send(AbortReq(rid=rid, abort_all=abort_all, prefix=prefix))

    # ------------------------------------------------------------------ generate
    def normalize(self, **kw) -> tuple[list[GenerateItem], bool]:
        return normalize_generate(self.tokenizer, vocab_size=self.vocab_size, context_len=self.context_len, **kw)

    async def generate_request(self, *, return_text_in_logprobs: bool = False, **kw) -> AsyncIterator:
        """Yields incremental chunks when streaming, else one final result (a dict, or a list
        for a batch or n > 1). Closing the iterator early aborts what is still running."""
        items, is_batch = self.normalize(**kw)
        stream = bool(kw.get("stream"))
        reqs = [r for item in items for r in item.expand()]
        for r in reqs:
            if r.rid in self.states:
                raise ValueError(f"duplicate request id {r.rid!r}: a request with this id is running")
        for r in reqs:
            self.states[r.rid] = ReqState(r.rid, len(r.input_ids), stream)
        for r in reqs:
            self.metrics.on_request(len(r.input_ids))
            self.to_scheduler.send(r)
        rids = [r.rid for r in reqs]
        try:
            if stream:
                async for chunk in self._stream(rids, return_text_in_logprobs):
                    yield chunk
            else:
                results = [await self._wait_final(r, return_text_in_logprobs) for r in rids]
                yield results if (is_batch or len(results) > 1) else results[0]
        finally:
            unfinished = [r for r in rids if r in self.states and not self.states[r].finished]
            for r in unfinished:
                self.abort_request(r)
            for r in rids:
                self.states.pop(r, None)

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
        return [(lp, tok, self.tokenizer.decode([tok]) if with_text else None) for lp, tok in pairs]

    def _result(self, st: ReqState, with_text: bool, full: bool, delta: dict | None = None) -> dict:
        meta = {"id": st.rid, "finish_reason": st.finish_reason, "prompt_tokens": st.prompt_tokens,
                "completion_tokens": len(st.output_ids), "cached_tokens": st.cached_tokens,
                "num_retractions": st.num_retractions, "e2e_latency": time.perf_counter() - st.start}
        lps = st.output_token_logprobs if full else delta["lps"]
        tops = st.output_top_logprobs if full else delta["tops"]
        if st.output_token_logprobs or st.input_token_logprobs is not None:
            meta["output_token_logprobs"] = self._with_text(lps, with_text)
            meta["output_top_logprobs"] = [self._with_text(t, with_text) for t in tops]
            meta["input_token_logprobs"] = self._with_text(st.input_token_logprobs or [], with_text)
            meta["input_top_logprobs"] = [self._with_text(t, with_text) for t in (st.input_top_logprobs or [])]
        if full:
            return {"text": st.text, "output_ids": list(st.output_ids), "meta_info": meta}
        return {"text": delta["text"], "output_ids": delta["output_ids"], "meta_info": meta}

"""The offline Engine: the runtime's processes plus a TokenizerManager, with a sync API.

The TokenizerManager lives on an event loop in a background thread; `generate` blocks on it,
`async_generate` bridges the caller's loop to it, so one Engine serves both kinds of caller.
"""
from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import threading
import time
from typing import Any, AsyncIterator, Iterator

from radixlm.config import ServerArgs

logger = logging.getLogger(__name__)

# Batches at least this long show a progress bar.
PROGRESS_BAR_MIN_PROMPTS = 16
SHUTDOWN_MESSAGE = "the engine is shutting down"
# How long shutdown waits for answered callers to receive their answers.
SHUTDOWN_GRACE_S = 5.0
# How long an interrupted call waits for its request's clean-up (the abort) to run.
CANCEL_CLEANUP_WAIT_S = 5.0



class _CallGate:
    """Whether a call submitted to the engine's loop started, decided once under a lock
    against the caller giving up on it: checking "started" and then cancelling raced with the
    loop starting it (the caller went on to close a generator whose step was still running)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._started = False
        self._given_up = False
        self.ended = threading.Event()

    def enter(self) -> bool:
        """On the loop, before the call runs: False when the caller already gave up."""
        with self._lock:
            self._started = not self._given_up
            return self._started

    def give_up(self) -> bool:
        """From the caller: True when the call had started (its end must be awaited)."""
        with self._lock:
            self._given_up = True
            return self._started

class EngineShutDown(RuntimeError):
    """The engine is shut down (or was, while the call waited)."""


async def _run(fn, *args, **kwargs):
    return fn(*args, **kwargs)


# generate() arguments that may be a list with one entry per prompt (besides the ones above)
PER_PROMPT_FIELDS = ("extra_key", "cache_salt", "bootstrap_host", "bootstrap_port", "bootstrap_room")


def _generate_kwargs(call_locals: dict) -> dict:
    """The generate() arguments as TokenizerManager.generate_request keywords."""
    kw = {k: v for k, v in call_locals.items() if k not in ("self", "sglang_fields")}
    return {**kw, **call_locals.get("sglang_fields", {})}


def _final(chunk) -> bool:
    return chunk is not None and chunk["meta_info"].get("finish_reason") is not None


def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()


class Engine:
    def __init__(self, model_path: str | None = None, **kwargs: Any) -> None:
        from radixlm.srt.launch import launch_subprocesses
        from radixlm.srt.tokenizer_manager import TokenizerManager

        from radixlm.srt.weights.loader import check_model

        self.server_args = ServerArgs.from_kwargs(model_path=model_path, **kwargs)
        check_model(self.server_args.model_path)  # a model radixlm cannot build fails here, in one line
        logging.basicConfig(level=self.server_args.log_level.upper())
        self._closed = False
        self._calls: set[concurrent.futures.Future] = set()  # calls in progress on the loop
        self._calls_lock = threading.Lock()
        self.procs = launch_subprocesses(self.server_args)
        self._loop = new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="radixlm-engine-loop", daemon=True)
        self._thread.start()

        async def make() -> TokenizerManager:
            tm = TokenizerManager(self.server_args, self.procs.ports, self.procs.scheduler_info)
            tm.start()
            return tm
        try:
            self.tokenizer_manager = self._call(make())
        except BaseException:
            self.shutdown()
            raise
        self.tokenizer = self.tokenizer_manager.tokenizer
        atexit.register(self.shutdown)
        for name, proc in self.procs.procs.items():
            threading.Thread(target=self._watch_child, args=(name, proc), daemon=True,
                             name=f"radixlm-watch-{name}").start()

    def _run_loop(self) -> None:
        from radixlm.srt.cpu_priority import front_end_thread
        front_end_thread(self.server_args.scheduler_policy)
        self._loop.run_forever()

    def _watch_child(self, name: str, proc) -> None:
        from radixlm.srt.launch import describe
        code = proc.wait()
        if self._closed:
            return
        # The other ranks would only wait for it in their next collective: stop them; their
        # exits are consequences, not news.
        if not self.procs.stop_tp_ranks(name):
            return
        logger.error("the %s exited unexpectedly (code %s)", describe(name), code)
        try:
            self._loop.call_soon_threadsafe(self.tokenizer_manager.fail_all,
                                            f"the {describe(name)} exited unexpectedly (code {code})")
        except RuntimeError:  # the loop is already closed
            pass

    # ------------------------------------------------------------------ plumbing
    def _submit(self, coro) -> tuple[concurrent.futures.Future, _CallGate]:
        """Run `coro` on the engine's loop. The gate says whether it started and when it ran to
        its end (its clean-up included), so a cancelled caller can wait for the abort it causes."""
        gate = _CallGate()

        async def guarded():
            if not gate.enter():
                coro.close()  # the caller gave up before it started: nothing ran, nothing to undo
                raise asyncio.CancelledError
            try:
                return await coro
            finally:
                gate.ended.set()
        fut = asyncio.run_coroutine_threadsafe(guarded(), self._loop)
        with self._calls_lock:
            self._calls.add(fut)
        fut.add_done_callback(self._forget)
        return fut, gate

    def _forget(self, fut) -> None:
        with self._calls_lock:
            self._calls.discard(fut)

    def _call(self, coro, timeout: float | None = None):
        """Block on `coro`. If the wait is interrupted (KeyboardInterrupt, a timeout, any
        exception raised in this thread), the coroutine is cancelled, which aborts the
        request it was waiting on, and its clean-up is awaited before the exception goes on."""
        if self._closed:
            coro.close()
            raise EngineShutDown("the engine is shut down")
        fut, gate = self._submit(coro)
        try:
            return fut.result(timeout)
        except concurrent.futures.CancelledError:
            raise EngineShutDown("the engine was shut down while this call was waiting") from None
        except BaseException:
            # Cancelled while it runs: wait for its clean-up (a generator's step must be over
            # before the caller may close that generator); one that had not started never will.
            if fut.cancel() and gate.give_up():
                gate.ended.wait(CANCEL_CLEANUP_WAIT_S)
            raise

    def _call_soon(self, fn, *args, **kwargs):
        """Run a plain function on the loop and return its result."""
        return self._call(_run(fn, *args, **kwargs))

    async def _bridge(self, coro):
        if self._closed:
            coro.close()
            raise EngineShutDown("the engine is shut down")
        fut, _ = self._submit(coro)
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            if fut.cancelled() and self._closed:
                raise EngineShutDown("the engine was shut down while this call was waiting") from None
            fut.cancel()  # the caller's own task was cancelled: so is the request
            raise

    # ------------------------------------------------------------------ lifecycle
    def shutdown(self) -> None:
        """Stop the engine. Every caller still waiting (generate, a stream, async or not, a
        request held by a pause or the weight lock) first gets a terminal answer: an abort
        "the engine is shutting down" (status 503), or EngineShutDown if it cannot."""
        if self._closed:
            return
        tm = getattr(self, "tokenizer_manager", None)
        alive = hasattr(self, "_thread") and self._thread.is_alive()
        if tm is not None and alive:
            try:
                asyncio.run_coroutine_threadsafe(_run(tm.shut_down, SHUTDOWN_MESSAGE), self._loop).result(5)
            except Exception:
                logger.exception("answering the callers at shutdown failed")
            # Their answers reach them; a stream's caller may need a few more calls to read its
            # last chunks, so wait until no call is in progress (new requests are refused).
            deadline = time.monotonic() + SHUTDOWN_GRACE_S
            while time.monotonic() < deadline:
                with self._calls_lock:
                    waiting = list(self._calls)
                if not waiting:
                    break
                concurrent.futures.wait(waiting, timeout=max(0.0, deadline - time.monotonic()))
        self._closed = True
        with self._calls_lock:
            left = list(self._calls)
        for fut in left:  # nothing answered these: their callers get EngineShutDown
            fut.cancel()
        if tm is not None and alive:
            try:
                asyncio.run_coroutine_threadsafe(tm.close(), self._loop).result(5)
            except Exception:
                pass
        if hasattr(self, "_loop"):
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
        self.procs.shutdown()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ generate
    def generate(self, prompt=None, sampling_params=None, input_ids=None, return_logprob=False,
                 logprob_start_len=None, top_logprobs_num=None, stream: bool = False, rid=None,
                 return_text_in_logprobs: bool = False, timeout: float | None = None,
                 priority: int | list[int] | None = None, session_params: dict | None = None, **sglang_fields):
        """`sglang_fields`: SGLang's other GenerateReqInput fields (extra_key, cache_salt,
        stream_options, bootstrap_*, and the unsupported ones at their neutral values)."""
        kw = _generate_kwargs(locals())
        tm = self.tokenizer_manager
        if stream:
            agen = tm.generate_request(**kw)
            first = self._call(self._prime(agen))  # raise ValueError now, not at the first next()
            return self._sync_iter(agen, first)
        n_prompts = len(prompt if isinstance(prompt, list) else
                        input_ids if input_ids and isinstance(input_ids[0], list) else [0])
        if n_prompts >= PROGRESS_BAR_MIN_PROMPTS:
            return self._call(self._collect_with_progress(kw, n_prompts))
        return self._call(self._collect(tm.generate_request(**kw)))

    async def async_generate(self, prompt=None, sampling_params=None, input_ids=None, return_logprob=False,
                             logprob_start_len=None, top_logprobs_num=None, stream: bool = False, rid=None,
                             return_text_in_logprobs: bool = False, timeout: float | None = None,
                             priority: int | list[int] | None = None, session_params: dict | None = None,
                             **sglang_fields):
        kw = _generate_kwargs(locals())
        agen = self.tokenizer_manager.generate_request(**kw)
        if stream:
            first = await self._bridge(self._prime(agen))
            return self._async_iter(agen, first)
        return await self._bridge(self._collect(agen))

    @staticmethod
    async def _collect(agen):
        try:
            async for out in agen:
                return out
            raise RuntimeError("no result")
        finally:
            await agen.aclose()  # the request's clean-up runs now, not when it is collected

    async def _collect_with_progress(self, kw: dict, n: int):
        from radixlm.srt.progress import TokenProgress

        tm = self.tokenizer_manager
        items, _ = tm.normalize(**{k: v for k, v in kw.items() if k != "return_text_in_logprobs"})
        bar = TokenProgress([it.sampling_params.max_new_tokens * it.sampling_params.n for it in items],
                            lambda: tm.tokens_generated).start()

        async def one(i: int):
            sub = dict(kw)
            sub["rid"] = items[i].rid
            sub.pop("prompt")
            sub["input_ids"] = items[i].input_ids
            sub["sampling_params"] = items[i].sampling_params
            sub["return_logprob"] = items[i].return_logprob
            sub["logprob_start_len"] = items[i].logprob_start_len if items[i].return_logprob else None
            sub["top_logprobs_num"] = items[i].top_logprobs_num
            sub["token_ids_logprob"] = list(items[i].token_ids_logprob) or None
            for name in PER_PROMPT_FIELDS:  # a list has one entry per prompt: this prompt's
                if isinstance(sub.get(name), list):
                    sub[name] = sub[name][i]
            out = await self._collect(tm.generate_request(**sub))
            outs = out if isinstance(out, list) else [out]
            bar.finish(i, sum(o["meta_info"]["completion_tokens"] for o in outs))
            return outs
        try:
            groups = await asyncio.gather(*(one(i) for i in range(len(items))))
        finally:
            bar.close()
        return [o for g in groups for o in g]

    # Streaming: the first chunk is fetched eagerly so validation errors surface at the call.
    @staticmethod
    async def _prime(agen):
        try:
            return await agen.__anext__()
        except StopAsyncIteration:
            return None

    def _sync_iter(self, agen, first) -> Iterator[dict]:
        last = first
        try:
            if first is not None:
                yield first
            while True:
                try:
                    last = self._call(agen.__anext__())
                except StopAsyncIteration:
                    return
                except EngineShutDown:
                    if _final(last):
                        return  # the shutdown's abort was this stream's last chunk
                    raise
                yield last
        finally:
            if not self._closed:
                self._call(agen.aclose())

    async def _async_iter(self, agen, first) -> AsyncIterator[dict]:
        last = first
        try:
            if first is not None:
                yield first
            while True:
                try:
                    last = await self._bridge(agen.__anext__())
                except StopAsyncIteration:
                    return
                except EngineShutDown:
                    if _final(last):
                        return
                    raise
                yield last
        finally:
            if not self._closed:
                await self._bridge(agen.aclose())

    def run_coroutine(self, coro):
        """Run `coro` on the engine's event loop, where its TokenizerManager lives (what
        `radixlm run-batch` drives the OpenAI request handling on), and block for its result;
        an interrupted wait cancels it."""
        return self._call(coro)

    # ------------------------------------------------------------------ control
    def abort_request(self, rid: str = "", abort_all: bool = False, prefix: bool = False) -> int:
        """Abort `rid` and its own n > 1 children, every rid starting with `rid` (prefix=True),
        or everything. Their callers are answered at once; returns how many requests were hit.
        A rid not here yet (0) is kept as a tombstone for a few seconds and aborted on arrival."""
        sent = time.time()
        return self._call_soon(self.tokenizer_manager.abort_request, rid, abort_all, prefix, sent_time=sent)

    def open_session(self, capacity_of_str_len: int, session_id: str | None = None,
                     timeout: float | None = None) -> str:
        """A session whose turns continue from the KV it holds (docs/semantics.md §15): pass
        session_params={"id": ..., "rid": <the turn to continue>} to generate."""
        return self._call(self.tokenizer_manager.open_session(capacity_of_str_len, session_id, timeout))

    def close_session(self, session_id: str) -> None:
        self._call(self.tokenizer_manager.close_session(session_id))

    def pause_generation(self, mode: str = "abort") -> None:
        self._call(self.tokenizer_manager.pause_generation(mode))

    def continue_generation(self) -> None:
        self._call(self.tokenizer_manager.continue_generation())

    # ------------------------------------------------------------------ RL API
    def update_weights_from_tensor(self, named_tensors, flush_cache: bool = True,
                                   weight_version: str | None = None) -> dict:
        """Replace weights by Hugging Face name (list of (name, tensor) or a dict). Waits for
        running requests; all or nothing; bumps (or sets) the weight version."""
        return self._call(self.tokenizer_manager.update_weights_from_tensor(named_tensors, flush_cache,
                                                                            weight_version))

    def update_weights_from_disk(self, model_path: str, flush_cache: bool = True,
                                 weight_version: str | None = None) -> dict:
        return self._call(self.tokenizer_manager.update_weights_from_disk(model_path, flush_cache,
                                                                          weight_version))

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str = "nccl") -> dict:
        """Join a trainer's torch.distributed group as ranks rank_offset .. rank_offset + tp_size - 1
        (the trainer is rank 0); returns once every member has joined."""
        return self._call(self.tokenizer_manager.init_weights_update_group(
            master_address, master_port, rank_offset, world_size, group_name, backend))

    def update_weights_from_distributed(self, names: list[str], dtypes: list, shapes: list[list[int]],
                                        group_name: str = "weight_update_group", flush_cache: bool = True,
                                        weight_version: str | None = None, abort_all_requests: bool = False) -> dict:
        """Receive `names` (with these dtypes and shapes, whole) as the trainer broadcasts them on
        the group; waits for running requests, all or nothing, bumps (or sets) the weight version."""
        return self._call(self.tokenizer_manager.update_weights_from_distributed(
            names, dtypes, shapes, group_name, flush_cache, weight_version, abort_all_requests))

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        return self._call(self.tokenizer_manager.destroy_weights_update_group(group_name))

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        return self._call(self.tokenizer_manager.get_weights_by_name(name, truncate_size))

    def get_weight_version(self) -> str:
        return self.tokenizer_manager.weight_version

    def update_weight_version(self, weight_version: str) -> None:
        self.tokenizer_manager.update_weight_version(weight_version)  # a plain attribute write

    def release_memory_occupation(self) -> None:
        self._call(self.tokenizer_manager.release_memory_occupation())

    def resume_memory_occupation(self) -> None:
        self._call(self.tokenizer_manager.resume_memory_occupation())

    def flush_cache(self, timeout: float = 30.0) -> bool:
        return self._call(self.tokenizer_manager.flush_cache(timeout))

    def check_integrity(self) -> None:
        self._call(self.tokenizer_manager.check_integrity())

    def get_server_info(self) -> dict:
        info = self._call(self.tokenizer_manager.get_server_info())
        info["server_args"] = dict(vars(self.server_args))
        return info

"""The offline Engine: generate on text or token ids, in this process.

The engine owns a ModelRunner, a prefix cache and a Scheduler, and drives the scheduler
loop itself while a call waits for its requests.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

from radixlm.config import ServerArgs
from radixlm.messages import AbortReq, BatchTokenOut, ReqOutput
from radixlm.srt.detokenizer import IncrementalDetokenizer
from radixlm.srt.generate_request import GenerateItem, normalize_generate

logger = logging.getLogger(__name__)

# Batches at least this long show a progress bar.
PROGRESS_BAR_MIN_PROMPTS = 16


@dataclass
class ReqState:
    """What the caller has been told about one request so far."""
    rid: str
    prompt_tokens: int
    detok: IncrementalDetokenizer
    start: float = field(default_factory=time.perf_counter)
    output_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    new_ids: list[int] = field(default_factory=list)
    finish_reason: dict | None = None
    last: ReqOutput | None = None
    output_token_logprobs: list = field(default_factory=list)
    output_top_logprobs: list = field(default_factory=list)
    input_token_logprobs: list | None = None
    input_top_logprobs: list | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def _with_text(pairs, tokenizer, with_text: bool):
    if pairs is None:
        return None
    return [(lp, tok, tokenizer.decode([tok]) if with_text and tokenizer else None) for lp, tok in pairs]


class Engine:
    def __init__(self, model_path: str | None = None, **kwargs: Any) -> None:
        from radixlm.radix_cache.no_cache import NoPrefixCache
        from radixlm.radix_cache.radix_cache import RadixCache
        from radixlm.scheduler.cache_manager import CacheManager
        from radixlm.scheduler.scheduler import Scheduler
        from radixlm.srt.model_runner.runner import ModelRunner
        from radixlm.srt.weights.loader import load_tokenizer

        self.server_args = ServerArgs.from_kwargs(model_path=model_path, **kwargs)
        logging.basicConfig(level=self.server_args.log_level.upper())
        args = self.server_args
        self.runner = ModelRunner(args)
        self.tokenizer = load_tokenizer(args.tokenizer_path or self.runner.model_path)
        if args.disable_radix_cache:
            tree = NoPrefixCache(self.runner.req_to_token_pool, self.runner.allocator)
        else:
            tree = RadixCache(self.runner.req_to_token_pool, self.runner.allocator, args.page_size,
                              args.radix_eviction_policy)
        self.cache = CacheManager(tree, self.runner.req_to_token_pool, self.runner.allocator, args.page_size)
        sizes = self.runner.sizes
        self.scheduler = Scheduler(args, self.runner, self.cache,
                                   max_running_requests=sizes.max_running_requests,
                                   chunked_prefill_size=sizes.chunked_prefill_size,
                                   tokenizer=self.tokenizer, send_output=self._on_output)
        self._states: dict[str, ReqState] = {}
        self._closed = False

    # ------------------------------------------------------------------ lifecycle
    def shutdown(self) -> None:
        if not self._closed:
            self.scheduler.abort(AbortReq(abort_all=True))
            self._closed = True

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ generate
    def generate(self, prompt=None, sampling_params=None, input_ids=None, return_logprob=False,
                 logprob_start_len=None, top_logprobs_num=None, stream: bool = False, rid=None,
                 return_text_in_logprobs: bool = False):
        if self._closed:
            raise RuntimeError("the engine is shut down")
        items, is_batch = normalize_generate(
            self.tokenizer, vocab_size=self.runner.vocab_size, context_len=self.runner.max_context_len,
            prompt=prompt, input_ids=input_ids, sampling_params=sampling_params,
            return_logprob=return_logprob, logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num, rid=rid, stream=stream)
        rids = self._submit(items)
        if stream:
            return self._stream(rids, items[0], return_text_in_logprobs)
        self._run(rids, show_progress=is_batch and len(rids) >= PROGRESS_BAR_MIN_PROMPTS)
        results = [self._result(self._states.pop(r), return_text_in_logprobs) for r in rids]
        if not is_batch and len(results) == 1:
            return results[0]
        return results

    def _submit(self, items: list[GenerateItem]) -> list[str]:
        reqs = [r for item in items for r in item.expand()]
        clash = [r.rid for r in reqs if r.rid in self._states]
        if clash:
            raise ValueError(f"request id already in use: {clash[0]}")
        for item in items:
            sp = item.sampling_params
            for r in item.expand():
                self._states[r.rid] = ReqState(r.rid, len(r.input_ids), IncrementalDetokenizer(
                    self.tokenizer, sp.stop, sp.skip_special_tokens, sp.no_stop_trim))
        for r in reqs:
            self.scheduler.add_request(r)
        return [r.rid for r in reqs]

    def _run(self, rids: list[str], show_progress: bool) -> None:
        bar = None
        if show_progress:
            from tqdm import tqdm
            bar = tqdm(total=len(rids), desc="generate", unit="req")
        done = 0
        while True:
            n = sum(1 for r in rids if self._states[r].finished)
            if bar is not None and n > done:
                bar.update(n - done)
            done = n
            if done == len(rids):
                break
            if not self.scheduler.step():
                missing = [r for r in rids if not self._states[r].finished]
                raise RuntimeError(f"scheduler idle with unfinished requests {missing[:4]}")
        if bar is not None:
            bar.close()

    def _stream(self, rids: list[str], item: GenerateItem, with_text: bool) -> Iterator[dict]:
        try:
            while True:
                pending = [r for r in rids if r in self._states]
                if not pending:
                    return
                for r in pending:
                    st = self._states[r]
                    if st.new_ids or st.new_text or st.finished:
                        chunk = self._chunk(st, with_text)
                        if st.finished:
                            del self._states[r]
                        yield chunk
                if any(not self._states[r].finished for r in rids if r in self._states):
                    if not self.scheduler.step():
                        raise RuntimeError("scheduler idle with a streaming request unfinished")
        finally:
            live = [r for r in rids if r in self._states]
            for r in live:  # the caller stopped iterating: cancel what is left
                self.scheduler.abort(AbortReq(rid=r))
                self._states.pop(r, None)

    # ------------------------------------------------------------------ outputs
    def _on_output(self, batch: BatchTokenOut) -> None:
        for out in batch.outputs:
            st = self._states.get(out.rid)
            if st is None:
                continue
            st.output_ids.extend(out.new_token_ids)
            st.new_ids.extend(out.new_token_ids)
            st.new_text += st.detok.add(out.new_token_ids, finished=out.finish_reason is not None)
            st.output_token_logprobs.extend(out.output_token_logprobs)
            st.output_top_logprobs.extend(out.output_top_logprobs)
            if out.input_token_logprobs is not None and st.input_token_logprobs is None:
                st.input_token_logprobs = out.input_token_logprobs
                st.input_top_logprobs = out.input_top_logprobs
            st.last = out
            if out.finish_reason is not None:
                st.finish_reason = out.finish_reason

    def _meta(self, st: ReqState, with_text: bool) -> dict:
        out = st.last
        meta = {"id": st.rid, "finish_reason": st.finish_reason, "prompt_tokens": st.prompt_tokens,
                "completion_tokens": len(st.output_ids),
                "cached_tokens": out.cached_tokens if out else 0,
                "num_retractions": out.num_retractions if out else 0,
                "e2e_latency": time.perf_counter() - st.start}
        if st.output_token_logprobs or st.input_token_logprobs is not None:
            meta["output_token_logprobs"] = _with_text(st.output_token_logprobs, self.tokenizer, with_text)
            meta["output_top_logprobs"] = [_with_text(t, self.tokenizer, with_text)
                                           for t in st.output_top_logprobs]
            meta["input_token_logprobs"] = _with_text(st.input_token_logprobs or [], self.tokenizer,
                                                      with_text)
            meta["input_top_logprobs"] = [_with_text(t, self.tokenizer, with_text)
                                          for t in (st.input_top_logprobs or [])]
        return meta

    def _result(self, st: ReqState, with_text: bool) -> dict:
        return {"text": st.detok.output_text, "output_ids": list(st.output_ids),
                "meta_info": self._meta(st, with_text)}

    def _chunk(self, st: ReqState, with_text: bool) -> dict:
        chunk = {"text": st.new_text, "output_ids": st.new_ids, "meta_info": self._meta(st, with_text)}
        st.new_text, st.new_ids = "", []
        return chunk

    # ------------------------------------------------------------------ control
    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        if not rid and not abort_all:
            logger.warning("abort_request with an empty rid and abort_all=False is ignored")
            return
        self.scheduler.abort(AbortReq(rid=rid, abort_all=abort_all))

    def flush_cache(self) -> bool:
        return self.scheduler.flush_cache()

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def get_server_info(self) -> dict:
        info = self.scheduler.get_info()
        info.update({"model_path": self.runner.model_path, "dtype": str(self.runner.dtype).replace("torch.", ""),
                     "device": self.runner.device, "attention_backend": self.runner.attention_backend_name,
                     "max_total_num_tokens": self.runner.sizes.max_total_tokens,
                     "max_running_requests": self.runner.sizes.max_running_requests,
                     "chunked_prefill_size": self.runner.sizes.chunked_prefill_size,
                     "context_length": self.runner.max_context_len,
                     "server_args": {k: v for k, v in vars(self.server_args).items()}})
        return info

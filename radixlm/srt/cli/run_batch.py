"""`radixlm run-batch -i in.jsonl -o out.jsonl`: an OpenAI Batch file through an in-process
Engine (vLLM's `run-batch`; the format is in batch_format.py).

Every line is handled by the same code as the HTTP server's /v1/chat/completions and
/v1/completions (openai_serving.OpenAIServing: the same validation, chat template, sampling
defaults and response bodies), and all of them are submitted at once (up to --max-in-flight),
so the scheduler batches them continuously. Each result is written and flushed the moment its
request finishes: a crash loses nothing already written, and `--resume` then runs only the
custom_ids the output file does not have yet. A bad line gets an error line; the batch goes on.
"""
from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

from radixlm.srt.cli.batch_format import (CHAT_URL, BadLine, BatchLine, ResumeState, error_record, parse_line,
                                          read_resume_state, success_record)
from radixlm.srt.cli.options import MORE_OPTIONS, RawHelpFormatter, add_engine_options, engine_kwargs
from radixlm.srt.cli.preflight import UserError

# Requests handed to the engine at once: far more than one batch (so the scheduler always has
# work queued), few enough that a million-line file is not a million coroutines.
DEFAULT_MAX_IN_FLIGHT = 1024
DESCRIPTION = """Run an OpenAI Batch file (the JSONL format of vLLM's run-batch) through an in-process engine.
Input lines: {"custom_id", "method": "POST", "url": "/v1/chat/completions" or "/v1/completions", "body"}.
Output lines: {"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}, written as each
request finishes. A bad line gets an error line and the batch goes on; after a crash, --resume runs only what
the output file lacks. Bodies take what `radixlm serve` takes on the same routes."""


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("run-batch", help="run an OpenAI Batch file (JSONL) through an in-process engine",
                       description=DESCRIPTION, epilog=MORE_OPTIONS, formatter_class=RawHelpFormatter)
    p.add_argument("-i", "--input-file", required=True, help="the batch file (JSONL); - reads stdin")
    p.add_argument("-o", "--output-file", required=True, help="where results go (JSONL); - writes stdout")
    p.add_argument("--resume", action="store_true",
                   help="append to the output file, skipping the custom_ids it already has (after a crash)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name the bodies' `model` must match (default: the model's name, as `radixlm "
                        "serve` has it; the file name is accepted too)")
    p.add_argument("--max-in-flight", type=int, default=DEFAULT_MAX_IN_FLIGHT,
                   help="requests submitted to the engine at once")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar on stderr")
    add_engine_options(p)
    return p


def check_files(ns: argparse.Namespace) -> None:
    """UserError for files the batch could not use, before the model loads."""
    if ns.max_in_flight < 1:
        raise UserError("--max-in-flight must be >= 1")
    if ns.input_file != "-":
        if not os.path.isfile(ns.input_file):
            raise UserError(f"input file {ns.input_file!r} does not exist")
        if not os.access(ns.input_file, os.R_OK):
            raise UserError(f"cannot read input file {ns.input_file!r}: permission denied")
    if ns.output_file == "-":
        if ns.resume:
            raise UserError("--resume needs an output file (-o PATH), not stdout")
        return
    folder = os.path.dirname(os.path.abspath(ns.output_file))
    if not os.path.isdir(folder):
        raise UserError(f"cannot write {ns.output_file!r}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK) or (os.path.exists(ns.output_file) and not os.access(ns.output_file, os.W_OK)):
        raise UserError(f"cannot write {ns.output_file!r}: permission denied")


@dataclass
class BatchSummary:
    written: int = 0
    succeeded: int = 0
    failed: int = 0
    skipped: int = 0
    seconds: float = 0.0
    completion_tokens: int = 0
    failures: list[str] = field(default_factory=list)

    def line(self) -> str:
        rate = self.completion_tokens / self.seconds if self.seconds > 0 else 0.0
        return (f"radixlm: run-batch: {self.succeeded} succeeded, {self.failed} failed, {self.skipped} skipped "
                f"(already in the output); {self.completion_tokens} tokens generated in {self.seconds:.1f} s "
                f"({rate:.1f} tok/s)")


class BatchRunner:
    """Runs parsed lines through OpenAIServing on the engine's loop, writing each result as it
    finishes."""

    def __init__(self, serving, out: TextIO, max_in_flight: int, progress) -> None:
        self.serving = serving
        self.out = out
        self.max_in_flight = max_in_flight
        self.progress = progress  # TokenProgress or None
        self.nesting = getattr(serving.tm.args, "max_json_nesting", 64)  # the server's --max-json-nesting
        self.summary = BatchSummary()

    def write(self, record: dict) -> None:
        self.out.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.out.flush()  # a crash after this keeps the line
        self.summary.written += 1
        if record["error"] is None:
            self.summary.succeeded += 1
        else:
            self.summary.failed += 1

    async def _never_disconnects(self) -> dict:
        await asyncio.Event().wait()  # a batch line has no client that could go away
        return {}

    async def answer(self, line: BatchLine) -> dict:
        """The output record of one request (never raises: every failure is an error line)."""
        from radixlm.srt.http_utils import HTTPError, body_as
        from radixlm.srt.openai_protocol import ChatCompletionRequest, CompletionRequest

        try:
            if line.url == CHAT_URL:
                chat = body_as(line.body, ChatCompletionRequest, self.nesting)
                response = await self.serving.create_chat_completion(chat, self._never_disconnects)
            else:
                completion = body_as(line.body, CompletionRequest, self.nesting)
                response = await self.serving.create_completion(completion, self._never_disconnects)
        except HTTPError as e:
            return error_record(line.custom_id, e.message, e.status, e.param)
        except ValueError as e:
            return error_record(line.custom_id, str(e), 400)
        except Exception as e:  # the runtime went down, or a bug: this line fails, the batch goes on
            return error_record(line.custom_id, f"{type(e).__name__}: {e}", 500)
        return success_record(line.custom_id, json.loads(bytes(response.body)))

    async def run(self, lines: "asyncio.Queue[BatchLine | BadLine | None]") -> BatchSummary:
        """Runs the lines the queue yields until None (the end of the input)."""
        t0 = time.perf_counter()
        gate = asyncio.Semaphore(self.max_in_flight)
        tasks: set[asyncio.Task] = set()

        async def one(index: int, line: BatchLine) -> None:
            try:
                record = await self.answer(line)
            finally:
                gate.release()
            self.write(record)
            usage = (record["response"]["body"] or {}).get("usage") or {}
            self.summary.completion_tokens += int(usage.get("completion_tokens", 0))
            if self.progress is not None:
                self.progress.finish(index, int(usage.get("completion_tokens", 0)))

        try:
            while (line := await lines.get()) is not None:
                if isinstance(line, BadLine):
                    self.write(error_record(line.custom_id, line.message, line.status, line.param))
                    continue
                await gate.acquire()
                index = self.progress.add(line.max_new_tokens()) if self.progress is not None else 0
                task = asyncio.ensure_future(one(index, line))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            while tasks:
                await asyncio.gather(*list(tasks))
        finally:
            for t in list(tasks):
                t.cancel()
            self.summary.seconds = time.perf_counter() - t0
        return self.summary


def iter_lines(f: TextIO, resume: ResumeState, skipped: list[int]):
    """The input's requests (and bad lines) still to answer; skipped[0] counts the others."""
    unnamed_left = resume.unnamed_errors
    for number, raw in enumerate(f, 1):
        if not raw.strip():
            continue
        try:
            item: BatchLine | BadLine = parse_line(number, raw)
        except BadLine as e:
            item = e
        cid = item.custom_id
        if cid is not None and cid in resume.done_ids:
            skipped[0] += 1
            continue
        if cid is None and unnamed_left > 0:  # written before the crash, in input order
            unnamed_left -= 1
            skipped[0] += 1
            continue
        yield item


def _feed(f: TextIO, resume: ResumeState, skipped: list[int], loop: asyncio.AbstractEventLoop,
          queue: "asyncio.Queue[BatchLine | BadLine | None]") -> None:
    """In a thread: the input's lines into the queue as they are read (stdin may be a pipe that
    a producer is still writing), then None."""
    try:
        for item in iter_lines(f, resume, skipped):
            loop.call_soon_threadsafe(queue.put_nowait, item)
    except OSError as e:  # the lines read so far still run; the failure is the last line
        loop.call_soon_threadsafe(queue.put_nowait, BadLine(f"reading the input failed: {e}", None, 500))
    finally:
        loop.call_soon_threadsafe(queue.put_nowait, None)


async def _run_on_loop(engine, ns: argparse.Namespace, f: TextIO, resume: ResumeState, skipped: list[int],
                       out: TextIO) -> BatchSummary:
    from radixlm.srt.openai_serving import OpenAIServing
    from radixlm.srt.progress import TokenProgress
    from radixlm.srt.served_name import default_served_model_name

    tm = engine.tokenizer_manager
    serving = OpenAIServing(tm, ns.served_model_name or default_served_model_name(tm.model_path))
    progress = TokenProgress([], lambda: tm.tokens_generated, desc="run-batch").start() if ns.progress else None
    queue: asyncio.Queue = asyncio.Queue()
    reader = threading.Thread(target=_feed, args=(f, resume, skipped, asyncio.get_running_loop(), queue),
                              name="radixlm-batch-reader", daemon=True)
    reader.start()
    try:
        return await BatchRunner(serving, out, ns.max_in_flight, progress).run(queue)
    finally:
        if progress is not None:
            progress.close()
        await serving.chat_templates.aclose()


def run(ns: argparse.Namespace) -> int:
    from radixlm.srt.engine import Engine

    resume = read_resume_state(ns.output_file) if ns.resume else ResumeState(set(), 0)
    skipped = [0]
    # a line that is not UTF-8 becomes that line's JSON error, not the end of the batch
    f: Any = io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8", errors="replace") if ns.input_file == "-" \
        else open(ns.input_file, encoding="utf-8", errors="replace")
    out: Any = sys.stdout if ns.output_file == "-" else open(ns.output_file, "a" if ns.resume else "w",
                                                              encoding="utf-8")
    try:
        with Engine(**engine_kwargs(ns)) as engine:
            summary = engine.run_coroutine(_run_on_loop(engine, ns, f, resume, skipped, out))
    finally:
        if out is not sys.stdout:
            out.close()
        if ns.input_file != "-":
            f.close()
    summary.skipped = skipped[0]
    print(summary.line(), file=sys.stderr, flush=True)
    return 0

"""Abort latency, caller side and KV side; prints one JSON object (docs/cancel_chain.md).

    python benchmark/abort_latency.py [--model-path DIR] [--batch 8] [--aborts 100] [--out FILE]
                                      [--scheduler-nice 0,5] [--scheduler-policy normal,idle,fifo]
                                      [--caller-policy normal,fifo] [--no-http]

For overlap off and on, `--batch` streaming requests decode at once; one at a time, a live
one is stopped (and replaced, so the batch stays full), from three entries:
- engine_abort:     Engine.abort_request(rid) from the caller's thread;
- http_abort:       POST /abort_request to a `radixlm serve` subprocess;
- http_disconnect:  the client closes the stream's socket.
Measured from the moment of the abort call (or of the close), wall clock, one machine:
- answer_ms: until the caller holds its terminal answer (the final chunk). A disconnected
  client holds nothing: there it is until the front end accepted the abort (the request
  answered and detached; `front_end.recent_aborts`);
- front_end_accepted_ms (Engine and POST): until the TokenizerManager, on the engine's (or the
  server's) loop thread, answered the request (the first of the answer's hand-overs);
- post_returned_ms (POST): until the POST's own reply reached the client.
The POST goes out on a raw keep-alive socket, as the streams are read from raw sockets: an
HTTP client library would measure itself (httpx adds 1-1.5 ms p50 and 3-4 ms p99 per request
on these cores, unloaded, over the server's 0.3-0.5 ms p50).
- kv_release_ms: until the scheduler returned the request's KV (`recent_cancels`, recorded
  where the release happens, after every batch holding the request resolved).
- kv_step: whether that was the end of the step in progress: `launched_before_abort` counts the
  aborts whose last batch holding the request was launched before the abort call (so no step
  started after the abort held its KV), and `after_last_launch_ms` is the time from that batch's
  launch to the release, the length of the step that held it (compare with `step_ms`).
The decode step length (`step_ms`, median time between a stream's chunks) is reported next
to them: the target is the answer within 5 ms p99 whatever the step, the KV within one step.
Percentiles are nearest-rank (the p99 of 300 samples is the 297th smallest); `--aborts 300`
gives a p99 that is not just the maximum. `--scheduler-nice 0,5` repeats everything with the
scheduler at each CPU priority, `--scheduler-policy normal,idle,fifo` at each policy, `--caller-policy
normal,fifo` with the benchmark's own caller threads (the Engine's asyncio caller, the POST's
sender, the streams' readers) normal or under SCHED_FIFO (`compare`: every combination; the first
of each list is the headline).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH_DIR))

from benchmark.common import emit  # noqa: E402 - after the path set-up above


def pct(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0, "p50": None, "p90": None, "p99": None, "max": None}
    s = sorted(xs)

    def rank(q: float) -> float:  # nearest rank: the smallest value with a share >= q at or below it
        return round(s[max(0, math.ceil(q * len(s)) - 1)] * 1e3, 2)
    return {"n": len(s), "p50": rank(0.5), "p90": rank(0.9), "p99": rank(0.99), "max": round(s[-1] * 1e3, 2)}


def slowest(xs: list[float], n: int = 5) -> list[list[float]]:
    """[ordinal, ms] of the n largest values: whether the tail is start-up or steady state."""
    return [[i, round(x * 1e3, 1)] for i, x in sorted(enumerate(xs), key=lambda ix: -ix[1])[:n]]


def prompt(rng: random.Random, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab - 1) for _ in range(rng.randrange(16, 48))]


def front_end_accepted(info: dict, t0: dict[str, float]) -> list[float]:
    """time the front end answered and detached the request - abort time, for the rids of `t0`."""
    accepted = dict(info.get("front_end", {}).get("recent_aborts", []))
    return [accepted[r] - t for r, t in t0.items() if r in accepted]


def _cancels(info: dict, t0: dict[str, float]):
    """(abort time, KV release, last launch holding it) of the rids of `t0` (scheduler rids are rid#n)."""
    for sched_rid, _sent, released, *rest in info.get("recent_cancels", []):  # (absent on older servers)
        rid = sched_rid.rsplit("#", 1)[0]
        if rid in t0:
            yield t0[rid], released, (rest[0] if rest else None)


def kv_release(info: dict, t0: dict[str, float]) -> list[float]:
    """release wall time - abort time."""
    return [released - sent for sent, released, _ in _cancels(info, t0)]


def kv_step(info: dict, t0: dict[str, float]) -> dict:
    """Was the KV back at the end of the step in progress when the abort came?"""
    rows = [(sent, released, launch) for sent, released, launch in _cancels(info, t0) if launch is not None]
    late = [launch - sent for sent, _, launch in rows if launch > sent]
    return {"n": len(rows), "launched_before_abort": len(rows) - len(late),
            "launched_after_abort_ms": pct(late), "after_last_launch_ms": pct([r - lt for _, r, lt in rows])}


def caller_thread(policy: str) -> None:
    """The calling thread under the caller policy: fifo is SCHED_FIFO 1, reset to normal in the
    threads and processes it starts (the Engine's scheduler processes stay normal); normal puts
    the thread back."""
    if policy == "fifo":
        os.sched_setscheduler(0, os.SCHED_FIFO | os.SCHED_RESET_ON_FORK, os.sched_param(1))
    elif policy == "normal":
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    else:
        raise ValueError(f"unknown caller policy {policy!r}")


def batches_given_back(info: dict) -> dict:
    """Decode batches an abort took back before they ran (overlap) or before their launch."""
    return {k: info.get(k) for k in ("num_batches_taken_back", "num_batches_unbuilt")}


# ---------------------------------------------------------------------------- Engine
def run_engine(args, overlap: bool) -> dict:
    """The caller is an asyncio program (as RL frameworks are): streams via async_generate."""
    from radixlm import Engine

    params = {"max_new_tokens": args.output_len, "temperature": 0, "ignore_eos": True}
    with Engine(model_path=args.model_path, dtype=args.dtype, enable_overlap_schedule=overlap,
                disable_overlap_schedule=not overlap, scheduler_nice=args.nice,
                scheduler_policy=args.policy) as eng:
        vocab = eng.tokenizer_manager.vocab_size
        rng = random.Random(1)
        eng.generate(input_ids=prompt(rng, vocab), sampling_params={"max_new_tokens": 2})  # warm-up
        t0: dict[str, float] = {}
        answer: list[float] = []
        gaps: list[float] = []
        live: dict[str, bool] = {}  # rid -> streaming started

        async def consume(rid: str) -> None:
            last = None
            stream = await eng.async_generate(input_ids=prompt(random.Random(rid), vocab), sampling_params=params,
                                              rid=rid, stream=True)
            async for chunk in stream:
                now = time.time()
                if last is not None and chunk["output_ids"] and rid not in t0:
                    gaps.append((now - last) / len(chunk["output_ids"]))
                last = now
                live[rid] = True
                if chunk["meta_info"]["finish_reason"] is not None and rid in t0:
                    answer.append(now - t0[rid])
            live.pop(rid, None)

        async def go() -> None:
            tasks = []
            caller_thread(args.caller)

            def launch(i: int) -> None:
                rid = f"e{int(overlap)}-{i}"
                live[rid] = False
                tasks.append(asyncio.ensure_future(consume(rid)))
            for i in range(args.batch):
                launch(i)
            for k in range(args.aborts):
                await asyncio.sleep(rng.uniform(0.5, 1.5) * args.interval)
                ready = [r for r, started in live.items() if started and r not in t0]
                if not ready:
                    continue
                rid = rng.choice(ready)
                t0[rid] = time.time()
                eng.abort_request(rid)
                launch(args.batch + k)
            eng.abort_request(abort_all=True)
            await asyncio.gather(*tasks)
        asyncio.run(go())
        caller_thread("normal")
        time.sleep(0.5)
        info = eng.get_server_info()
        released = kv_release(info, t0)
        return {"engine_abort": {"answer_ms": pct(answer), "front_end_accepted_ms": pct(front_end_accepted(info, t0)),
                                 "kv_release_ms": pct(released), "kv_release_slowest": slowest(released),
                                 "kv_step": kv_step(info, t0), **batches_given_back(info),
                                 "scheduler_gc": info.get("gc")},
                "step_ms": round(statistics.median(gaps) * 1e3, 2) if gaps else None}


# ---------------------------------------------------------------------------- HTTP
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, args, overlap: bool) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-m", "radixlm", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--dtype", args.dtype, "--scheduler-nice", str(args.nice),
               "--scheduler-policy", args.policy, "--enable-overlap-schedule" if overlap else "--disable-overlap-schedule"]
        if args.model_path:
            cmd += ["--model-path", args.model_path]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import httpx
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=60)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "the server exited"
            try:
                if self.http.get("/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("server not ready")

    def stop(self) -> None:
        self.http.close()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class RawPost:
    """POSTs of small JSON bodies on one keep-alive raw socket, each written with one send."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def post(self, path: str, body: dict) -> dict:
        payload = json.dumps(body).encode()
        self.sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        buf = b""
        while b"\r\n\r\n" not in buf:
            buf += self.recv()
        head, rest = buf.split(b"\r\n\r\n", 1)
        length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        while len(rest) < length:
            rest += self.recv()
        assert head.startswith(b"HTTP/1.1 200"), head
        return json.loads(rest[:length])

    def recv(self) -> bytes:
        data = self.sock.recv(1 << 16)
        if not data:
            raise ConnectionError("the server closed the connection")
        return data

    def close(self) -> None:
        self.sock.close()


class Stream:
    """One streaming POST /generate on a raw socket, read by a thread."""

    def __init__(self, server: Server, rid: str, body: dict, on_event, caller: str) -> None:
        payload = json.dumps(body).encode()
        self.sock = socket.create_connection(("127.0.0.1", server.port))
        self.sock.sendall(f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          f"Connection: close\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
        self.rid, self.on_event, self.started = rid, on_event, threading.Event()
        threading.Thread(target=self._read, args=(caller,), daemon=True).start()

    def _read(self, caller: str) -> None:
        caller_thread(caller)
        buf = b""
        try:
            while True:
                data = self.sock.recv(1 << 16)
                if not data:
                    return
                buf += data
                while b"\n\n" in buf:
                    block, buf = buf.split(b"\n\n", 1)
                    line = block.split(b"data: ", 1)[-1]
                    if line.startswith(b"{"):
                        self.started.set()
                        self.on_event(self.rid, json.loads(line))
        except OSError:
            return  # closed by us (a disconnect)


def run_http(args, overlap: bool) -> dict:
    srv = Server(args, overlap)
    try:
        vocab = srv.http.get("/get_model_info").json()["vocab_size"]
        return {entry: run_entry(args, srv, entry, overlap, vocab) for entry in ("http_abort", "http_disconnect")}
    finally:
        srv.stop()


def run_entry(args, srv: Server, entry: str, overlap: bool, vocab: int) -> dict:
    rng = random.Random(2)
    params = {"max_new_tokens": args.output_len, "temperature": 0, "ignore_eos": True}
    t0: dict[str, float] = {}
    answer: list[float] = []
    post_returned: list[float] = []
    live: dict[str, Stream] = {}
    lock = threading.Lock()

    def on_event(rid: str, ev: dict) -> None:
        if (ev.get("meta_info") or {}).get("finish_reason") is not None:
            with lock:
                if rid in t0 and entry == "http_abort":
                    answer.append(time.time() - t0[rid])
                live.pop(rid, None)

    def launch(i: int) -> None:
        rid = f"{entry}{int(overlap)}-{i}"
        body = {"input_ids": prompt(random.Random(rid), vocab), "rid": rid, "stream": True,
                "sampling_params": params}
        # connected and sent outside the lock: a reader holding an aborted stream's final chunk
        # must not wait for this (it did, 2-3 ms, with the POST entry's answer counted late)
        stream = Stream(srv, rid, body, on_event, args.caller)
        with lock:
            live[rid] = stream

    # (opened now, used every ~interval: the server closes a keep-alive connection idle for 5 s)
    poster = RawPost(srv.port) if entry == "http_abort" else None
    caller_thread(args.caller)
    for i in range(args.batch):
        launch(i)
    for k in range(args.aborts):
        time.sleep(rng.uniform(0.5, 1.5) * args.interval)
        with lock:
            ready = [s for s in live.values() if s.started.is_set()]
        if not ready:
            continue
        s = rng.choice(ready)
        t0[s.rid] = time.time()
        if entry == "http_abort":
            assert poster is not None
            poster.post("/abort_request", {"rid": s.rid})
            post_returned.append(time.time() - t0[s.rid])
        else:
            s.sock.shutdown(socket.SHUT_RDWR)  # (a bare close() waits for the reader's recv)
            s.sock.close()
            with lock:
                live.pop(s.rid, None)
        launch(args.batch + k)
    if poster is not None:
        poster.close()
    caller_thread("normal")
    srv.http.post("/abort_request", json={"abort_all": True})
    time.sleep(0.5)
    info = srv.http.get("/get_server_info").json()
    accepted = front_end_accepted(info, t0)
    common = {"kv_release_ms": pct(kv_release(info, t0)), "kv_step": kv_step(info, t0), **batches_given_back(info),
              "scheduler_gc": info.get("gc")}
    if entry == "http_disconnect":
        return {"answer_ms": pct(accepted), **common}
    # the answer's hops: the server accepted the abort, the POST's reply reached the client, the
    # aborted stream's final chunk reached its reader thread (answer_ms)
    return {"answer_ms": pct(answer), "front_end_accepted_ms": pct(accepted),
            "post_returned_ms": pct(post_returned), **common}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", type=int, default=8, help="streams decoding at once")
    ap.add_argument("--aborts", type=int, default=100, help="aborts per entry and mode")
    ap.add_argument("--interval", type=float, default=0.2, help="mean seconds between aborts")
    ap.add_argument("--output-len", type=int, default=2000, help="long enough that only aborts end requests")
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-http", action="store_true")
    ap.add_argument("--scheduler-nice", default="0",
                    help="comma-separated --scheduler-nice values to compare (the first is the headline)")
    ap.add_argument("--scheduler-policy", default="normal",
                    help="comma-separated --scheduler-policy values to compare (normal, idle, fifo)")
    ap.add_argument("--caller-policy", default="normal",
                    help="comma-separated policies of the benchmark's caller threads to compare (normal, fifo)")
    args = ap.parse_args()
    settings = [(int(n), p, c) for c in args.caller_policy.split(",") for p in args.scheduler_policy.split(",")
                for n in args.scheduler_nice.split(",")]
    result: dict = {"workload": dict(vars(args))}
    for i, (nice, policy, caller) in enumerate(settings):
        args.nice, args.policy, args.caller = nice, policy, caller
        runs: dict = {"scheduler_nice": nice, "scheduler_policy": policy, "caller_policy": caller}
        for overlap in (False, True):
            mode = {**run_engine(args, overlap)}
            if not args.no_http:
                mode.update(run_http(args, overlap))
            runs["overlap_on" if overlap else "overlap_off"] = mode
        if i == 0:
            result.update(runs)
        else:
            result.setdefault("compare", []).append(runs)
    emit(result, args.out)


if __name__ == "__main__":
    main()

"""Prefill/decode disaggregation through the SGLang Model Gateway vs one co-located server.

    python benchmark/pd.py [--model-path DIR] [--requests 8] [--prompt-words 400] [--output-len 32]
                           [--concurrency 1,4] [--out F.json]

Disaggregated: a `radixlm serve --disaggregation-mode prefill` server on one core and a
`--disaggregation-mode decode` server on the other (one thread each), KV over radixlm's TCP
transfer backend, behind `smg launch --pd-disaggregation`. Co-located: one `radixlm serve` on
both cores (two threads) behind `smg launch --worker-urls` (the same gateway hop). Same total
cores and threads. Every request streams through the gateway with a prompt of its own (no
shared prefix); reported per setup and concurrency: TTFT and inter-token latency percentiles
(client side), output tok/s, and for the disaggregated setup the decode server's transfer
counters: bytes, rooms and the rate as the decode server sees it (bytes / time from a room's
first KV chunk to its last, which includes waiting for its next loop iteration while it decodes
other requests). `link` is the TCP backend alone: KV packed, sent over loopback, checked and
written, in one process and thread, for SmolLM2-135M's KV shape.

`co_located_one_core` is the same single server on one core and one thread: on a shared
2-core machine a two-thread server's OpenMP regions wait for a descheduled thread at every op
(docs/architecture.md), so the two-thread co-located numbers can be far worse than one
thread's; this third setup separates that effect from disaggregation's.

Caveat: on a 2-core machine disaggregation has nothing to gain in speed. Its point is that a
long prefill never stalls the decode steps of running requests (and that each side can be
sized for its phase); with one core per side, each phase gets half the machine and the
transfer is pure overhead. This measures that overhead honestly; it says nothing about a
multi-GPU deployment.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import emit  # noqa: E402,I001

from radixlm.srt.fleet.processes import ChildProcess, free_port, wait_until_ready  # noqa: E402

WORDS = ("river mountain lantern copper violet harbor meadow engine silver orchard canyon "
         "thunder pepper marble falcon glacier ribbon cobalt willow saddle").split()


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1000, 2) if xs else 0.0


def prompt(i: int, words: int) -> str:
    # a different first word per request: no prefix is shared between requests
    return f"Request {i}: " + " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(words))


def serve(name: str, model: str | None, port: int, cpus: list[int], extra: list[str], log) -> ChildProcess:
    argv = [sys.executable, "-m", "radixlm", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", "m", *(["--model-path", model] if model else []), *extra]
    env = dict(os.environ, OMP_NUM_THREADS=str(len(cpus)), MKL_NUM_THREADS=str(len(cpus)))
    return ChildProcess.start(name, argv, env=env, cpus=cpus, log=log)


def gateway(port: int, args: list[str], log) -> ChildProcess:
    argv = [sys.executable, "-m", "smg", "launch", "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port("127.0.0.1")),
            "--log-level", "warn", "--shutdown-grace-period-secs", "2", "--policy", "round_robin",
            # the data path is measured, not resilience: a saturated one-core worker that answers its
            # health check late must not be taken out of rotation mid-run
            "--disable-health-check", "--disable-circuit-breaker", *args]
    return ChildProcess.start("smg", argv, log=log)


def wait_gateway(proc: ChildProcess, url: str, workers: int) -> None:
    def ready(body: bytes) -> bool:
        try:
            return json.loads(body).get("healthy_workers", 0) >= workers
        except ValueError:
            return False
    wait_until_ready([proc], [url + "/readiness"], 120, check=ready)


async def one(c: httpx.AsyncClient, text: str, output_len: int) -> dict:
    body = {"text": text, "stream": True, "sampling_params": {"temperature": 0, "max_new_tokens": output_len,
                                                              "ignore_eos": True}}
    t0 = last = time.perf_counter()
    ttft: float | None = None
    itl: list[float] = []
    n_tokens = 0
    async with c.stream("POST", "/generate", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                raise RuntimeError(ev)
            got = ev["meta_info"]["completion_tokens"]
            if got > n_tokens:
                now = time.perf_counter()
                if ttft is None:
                    ttft = now - t0
                else:  # an event with k new tokens: k gaps of (time since the last event) / k
                    itl += [(now - last) / (got - n_tokens)] * (got - n_tokens)
                n_tokens, last = got, now
    assert ttft is not None, "no token came"
    return {"ttft": ttft, "itl": itl, "tokens": n_tokens, "e2e": time.perf_counter() - t0}


async def load(url: str, n: int, concurrency: int, words: int, output_len: int, base: int) -> dict:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600.0) as c:
        async def job(i: int) -> dict | str:
            async with sem:
                try:
                    return await one(c, prompt(base + i, words), output_len)
                except (httpx.HTTPError, RuntimeError) as e:
                    return f"{type(e).__name__}: {e}"
        t0 = time.perf_counter()
        got = await asyncio.gather(*(job(i) for i in range(n)))
        wall = time.perf_counter() - t0
    res = [r for r in got if isinstance(r, dict)]
    errors = [r for r in got if isinstance(r, str)]
    itl = [x for r in res for x in r["itl"]]
    return {"concurrency": concurrency, "requests": n, "errors": errors,
            "ttft_ms": {"p50": pct([r["ttft"] for r in res], 0.5), "p90": pct([r["ttft"] for r in res], 0.9)},
            "itl_ms": {"p50": pct(itl, 0.5), "p90": pct(itl, 0.9), "p99": pct(itl, 0.99)},
            "output_tok_s": round(sum(r["tokens"] for r in res) / wall, 2), "wall_s": round(wall, 2)}


def link_throughput(tokens: int, layers: int, kv_heads: int, head_dim: int, chunk_tokens: int, reps: int) -> dict:
    """The TCP backend alone, in one process and one thread: pack a prompt's KV (every layer's K
    and V, float32) into chunks, send them over ZeroMQ TCP on loopback from a bootstrap server
    to a decode link, receive, check and write them into another pool: MB/s of KV moved."""
    import torch
    import zmq

    from radixlm.disaggregation.kv_pages import read_chunk, write_chunk
    from radixlm.disaggregation.links import BootstrapServer, DecodeLinks
    from radixlm.disaggregation.protocol import checksum, decode, encode, num_chunks

    torch.set_num_threads(1)
    ctx = zmq.Context()
    port = free_port("127.0.0.1")
    server, link = BootstrapServer(ctx, "127.0.0.1", port), DecodeLinks(ctx)
    try:
        link.send(("127.0.0.1", port), encode("hello", [0, 0]))
        ident = None
        while ident is None:
            got = server.recv_all()
            ident = got[0][0] if got else None
            time.sleep(0.01)
        size = tokens + 1
        src = [torch.randn(size, kv_heads, head_dim) for _ in range(2 * layers)]
        dst = [torch.zeros(size, kv_heads, head_dim) for _ in range(2 * layers)]
        slots = torch.randperm(tokens) + 1  # scattered slots, as a pool gives them
        n = num_chunks(tokens, chunk_tokens) * len(src)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for b, buf in enumerate(src):
                for c in range(num_chunks(tokens, chunk_tokens)):
                    p = read_chunk(buf, slots[c * chunk_tokens:(c + 1) * chunk_tokens])
                    server.send(ident, encode("kv", [0, 0], b, c, checksum(p), payload=p))
            done = 0
            while done < n:
                for _, frames in link.recv_all():
                    h, p = decode(frames)
                    assert p is not None and checksum(p) == h[4]
                    write_chunk(dst[h[2]], slots[h[3] * chunk_tokens:(h[3] + 1) * chunk_tokens], p)
                    done += 1
            times.append(time.perf_counter() - t0)
        assert all(torch.equal(a[1:], b[1:]) for a, b in zip(src, dst))  # row 0: the padding slot
        mb = sum(int(b[1:].numel()) * b.element_size() for b in src) / 1e6
        best = min(times)
        return {"tokens": tokens, "mb": round(mb, 1), "chunk_tokens": chunk_tokens, "best_ms": round(best * 1000, 1),
                "mb_s": round(mb / best, 1)}
    finally:
        server.close()
        link.close()
        ctx.term()


def transfer_stats(decode_url: str) -> dict:
    return httpx.get(decode_url + "/get_server_info", timeout=30).json()["disaggregation"]


def run_setup(kind: str, ns, cpus: list[int], logs) -> dict:
    procs: list[ChildProcess] = []
    gw_port = free_port("127.0.0.1")
    url = f"http://127.0.0.1:{gw_port}"
    try:
        if kind == "disaggregated":
            pp, dp, bp = free_port("127.0.0.1"), free_port("127.0.0.1"), free_port("127.0.0.1")
            procs.append(serve("prefill", ns.model_path, pp, cpus[:1], ["--disaggregation-mode", "prefill",
                                                                       "--disaggregation-bootstrap-port", str(bp)], logs))
            procs.append(serve("decode", ns.model_path, dp, cpus[1:] or cpus[:1],
                               ["--disaggregation-mode", "decode"], logs))
            urls = [f"http://127.0.0.1:{pp}", f"http://127.0.0.1:{dp}"]
            wait_until_ready(procs, [u + "/health" for u in urls], 900)
            procs.append(gateway(gw_port, ["--pd-disaggregation", "--prefill", urls[0], str(bp), "--decode", urls[1]],
                                 logs))
            wait_gateway(procs[-1], url, 2)
        else:
            sp = free_port("127.0.0.1")
            procs.append(serve("co-located", ns.model_path, sp, cpus if kind == "co_located" else cpus[:1], [], logs))
            urls = [f"http://127.0.0.1:{sp}"]
            wait_until_ready(procs, [urls[0] + "/health"], 900)
            procs.append(gateway(gw_port, ["--worker-urls", urls[0]], logs))
            wait_gateway(procs[-1], url, 1)
        asyncio.run(load(url, 2, 1, ns.prompt_words, 4, 10_000))  # warm-up (kernels, first forwards)
        before = transfer_stats(urls[1]) if kind == "disaggregated" else None
        threads = 1 if kind == "co_located_one_core" else len(cpus)
        out: dict = {"threads": threads, "servers": len(urls), "runs": []}
        for k, conc in enumerate(int(c) for c in ns.concurrency.split(",")):
            out["runs"].append(asyncio.run(load(url, ns.requests, conc, ns.prompt_words, ns.output_len, 1000 * (k + 1))))
        if before is not None:
            after = transfer_stats(urls[1])
            moved = after["bytes"] - before["bytes"]
            secs = after["transfer_seconds"] - before["transfer_seconds"]
            rooms = after["rooms_completed"] - before["rooms_completed"]
            out["transfer"] = {"rooms": rooms, "mb": round(moved / 1e6, 2), "mb_per_room": round(moved / 1e6 / max(rooms, 1), 3),
                               "ms_per_room": round(secs * 1000 / max(rooms, 1), 2),
                               "loopback_mb_s": round(moved / 1e6 / secs, 1) if secs > 0 else None,
                               "aborted": after["rooms_aborted"], "timed_out": after["rooms_timed_out"]}
        return out
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in reversed(procs):
            p.wait_or_kill(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-words", type=int, default=400, help="prompt length in words (~1.3 tokens each)")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--setups", default="disaggregated,co_located,co_located_one_core")
    ap.add_argument("--no-link", action="store_true", help="skip the link-only measurement")
    ap.add_argument("--out", default=None)
    ns = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))[:2]
    result: dict = {"benchmark": "pd", "model": ns.model_path or "SmolLM2-135M-Instruct (default)",
                    "prompt_words": ns.prompt_words, "output_len": ns.output_len, "cores": cpus,
                    "caveat": "2 cores: each phase gets half the machine in the disaggregated setup; the transfer "
                              "is overhead with nothing to win (see the docstring)"}
    # SmolLM2-135M's KV shape: 30 layers x 3 KV heads x 64
    if not ns.no_link:
        result["link"] = [link_throughput(t, 30, 3, 64, ct, 3) for t, ct in ((512, 1024), (2048, 1024), (2048, 256))]
    with open(os.devnull, "wb") as logs:
        for kind in ns.setups.split(","):
            result[kind] = run_setup(kind, ns, cpus, logs if not os.environ.get("PD_BENCH_LOGS") else None)
    emit(result, ns.out)


if __name__ == "__main__":
    main()

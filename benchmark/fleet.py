"""A fleet behind the SGLang Model Gateway: routing policy vs prefix-cache hits; stop-path latency.

    python benchmark/fleet.py [--model-path DIR] [--workers 2] [--sessions N --turns N]
                              [--policies cache_aware,round_robin,builtin] [--out F.json] [radixlm serve args...]

Starts --workers `radixlm serve` replicas on loopback (the CPU cores split between them, as
`radixlm serve --dp-size` does) and, for each policy, a gateway in front of them: `smg launch
--policy P` for smg's policies, radixlm's built-in dispatcher (prefix_hash) for `builtin`.
Caches are flushed before each policy; then --sessions multi-turn chats run concurrently,
each turn sending the whole conversation so far (a long per-session system prompt, earlier
turns and answers) through the gateway. Reported per policy: the cached-token ratio
(usage.prompt_tokens_details.cached_tokens / prompt_tokens), output tok/s, requests/s, and
latency percentiles, plus how the requests spread over the workers.

Then the stop path: a request through the gateway whose client disconnects is aborted on
the worker; `kv_reclaim_ms` is the time from the client closing its socket to that worker
reporting no request and all KV free (polled on /get_server_info, ~1-2 ms per poll), for a
stream (after 3 chunks) and a non-streamed request, through smg and straight to the worker
(the same measurement without a gateway), --disconnect-reps times each.

Caveat: on a small machine the replicas share the memory bandwidth and, with fewer cores than
replicas, the cores themselves, so throughput across policies compares routing, not the
scaling a fleet of real machines would give.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import emit  # noqa: E402,I001

from radixlm.config import ServerArgs  # noqa: E402
from radixlm.srt.fleet.gateway import SmgGateway  # noqa: E402
from radixlm.srt.fleet.processes import ChildProcess, free_port, wait_until_ready  # noqa: E402
from radixlm.srt.fleet.replicas import start_replicas  # noqa: E402

SYSTEM = ("You are assistant number {s}. You always answer in the voice of a {role} and you remember "
          "everything about the user's project {s}: it is a {thing}, it started {k} years ago, and its "
          "budget is {b} coins. Be concise. ")
SMG_ARGS: tuple[str, ...] = ()  # smg's defaults
ROLES = ["pirate", "librarian", "chef", "astronaut", "gardener", "detective", "poet", "engineer"]
THINGS = ["bakery", "observatory", "boat", "garden", "museum", "robot", "library", "bridge"]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 4) if xs else 0.0


async def run_chats(url: str, model: str, sessions: int, turns: int, output_len: int) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600.0) as c:
        async def session(s: int) -> list[dict]:
            system = SYSTEM.format(s=s, role=ROLES[s % len(ROLES)], thing=THINGS[s % len(THINGS)], k=s + 2,
                                   b=100 * (s + 1)) * 4
            msgs = [{"role": "system", "content": system}]
            out = []
            for t in range(turns):
                msgs.append({"role": "user", "content": f"Turn {t}: what should project {s} do next?"})
                t0 = time.perf_counter()
                r = await c.post("/v1/chat/completions", json={"model": model, "messages": msgs, "max_tokens": output_len,
                                                                "temperature": 0, "ignore_eos": True})
                r.raise_for_status()
                body = r.json()
                usage = body["usage"]
                out.append({"latency": time.perf_counter() - t0, "prompt": usage["prompt_tokens"],
                            "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                            "completion": usage["completion_tokens"]})
                msgs.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
            return out
        t0 = time.perf_counter()
        results = [r for rs in await asyncio.gather(*(session(s) for s in range(sessions))) for r in rs]
        wall = time.perf_counter() - t0
    prompt = sum(r["prompt"] for r in results)
    cached = sum(r["cached"] for r in results)
    lat = [r["latency"] for r in results]
    return {"requests": len(results), "prompt_tokens": prompt, "cached_tokens": cached,
            "cached_token_ratio": round(cached / prompt, 4) if prompt else 0.0,
            "output_tok_s": round(sum(r["completion"] for r in results) / wall, 2),
            "requests_per_s": round(len(results) / wall, 3), "wall_s": round(wall, 2),
            "latency_s": {"p50": pct(lat, 0.5), "p90": pct(lat, 0.9), "p99": pct(lat, 0.99)}}


def requests_served(worker_urls: list[str]) -> list[int]:
    return [httpx.get(u + "/get_server_info", timeout=30).json().get("num_finished", 0) for u in worker_urls]


# ---------------------------------------------------------------------------- disconnects
def _busy(c: httpx.Client, url: str) -> bool:
    i = c.get(url + "/get_server_info").json()
    m = i["memory"]
    return (i["num_running_reqs"] + i["num_waiting_reqs"] > 0 or m["protected"] > 0
            or m["free"] + m["evictable"] != m["capacity"])


def kv_reclaim_ms(front: str, worker_urls: list[str], stream: bool, reps: int) -> dict:
    host, port = front.removeprefix("http://").split(":")
    body = json.dumps({"input_ids": [11, 12, 13, 14], "stream": stream,
                       "sampling_params": {"max_new_tokens": 1900, "ignore_eos": True}}).encode()
    out = []
    with httpx.Client(timeout=30) as c:
        for _ in range(reps):
            s = socket.create_connection((host, int(port)))
            s.sendall(f"POST /generate HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            if stream:
                buf = b""
                while buf.count(b"data:") < 3:
                    buf += s.recv(65536)
            deadline = time.monotonic() + 60
            while not any(_busy(c, u) for u in worker_urls):
                if time.monotonic() > deadline:
                    raise RuntimeError("the request never ran")
                time.sleep(0.001)
            t0 = time.perf_counter()
            s.close()
            while any(_busy(c, u) for u in worker_urls):
                pass
            out.append((time.perf_counter() - t0) * 1000)
            time.sleep(0.2)
    return {"median": round(statistics.median(out), 2), "p90": round(pct(out, 0.9), 2),
            "max": round(max(out), 2), "reps": reps}


# ---------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--served-model-name", default="fleet-model")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--policies", default="cache_aware,round_robin,builtin")
    ap.add_argument("--disconnect-reps", type=int, default=10)
    ap.add_argument("--out", default=None)
    ns, serve_args = ap.parse_known_args()
    sp = argparse.ArgumentParser()
    ServerArgs.add_cli_args(sp)
    args = ServerArgs.from_cli_args(sp.parse_args((["--model-path", ns.model_path] if ns.model_path else [])
                                                  + serve_args))
    replicas = start_replicas(args, ns.workers, ns.served_model_name, log=subprocess.DEVNULL)
    urls = [r.url for r in replicas]
    result: dict = {"workers": [{"url": r.url, "cpus": r.cpus} for r in replicas], "sessions": ns.sessions,
                    "turns": ns.turns, "output_len": ns.output_len, "server_args": serve_args,
                    "smg_args": list(SMG_ARGS),
                    "caveat": "replicas on one machine share its memory bandwidth (and cores when there are "
                              "fewer cores than replicas): throughput compares routing, not fleet scaling",
                    "policies": {}}
    try:
        wait_until_ready([r.process for r in replicas], [u + "/health" for u in urls], 600)
        smg_front = None
        for policy in ns.policies.split(","):
            if policy == "builtin":
                port = free_port()
                front = f"http://127.0.0.1:{port}"
                proc = ChildProcess.start("dispatcher", [sys.executable, "-m", "radixlm.srt.fleet.dispatcher",
                                                         "--port", str(port), "--worker-urls", *urls],
                                          log=subprocess.DEVNULL)
                wait_until_ready([proc], [front + "/health"], 60)
                stop = lambda p=proc: (p.terminate(), p.wait_or_kill(10))  # noqa: E731
            else:
                gw = SmgGateway(urls, policy=policy, extra_args=SMG_ARGS).start(log=subprocess.DEVNULL)
                gw.wait_ready()
                front, stop = gw.url, gw.stop
            try:
                for u in urls:
                    httpx.post(u + "/flush_cache", timeout=60).raise_for_status()
                before = requests_served(urls)
                r = asyncio.run(run_chats(front, ns.served_model_name, ns.sessions, ns.turns, ns.output_len))
                r["served_per_worker"] = [b - a for a, b in zip(before, requests_served(urls))]
                r["router"] = "radixlm builtin dispatcher (prefix_hash)" if policy == "builtin" else f"smg {policy}"
                result["policies"][policy] = r
                print(f"{policy}: {json.dumps(r)}", file=sys.stderr)
                if policy != "builtin" and smg_front is None:
                    result["disconnect_kv_reclaim_ms"] = {
                        f"via smg {policy}": {"stream": kv_reclaim_ms(front, urls, True, ns.disconnect_reps),
                                              "non_stream": kv_reclaim_ms(front, urls, False, ns.disconnect_reps)},
                        "direct to the worker": {"stream": kv_reclaim_ms(urls[0], urls, True, ns.disconnect_reps),
                                                 "non_stream": kv_reclaim_ms(urls[0], urls, False,
                                                                             ns.disconnect_reps)}}
                    smg_front = front
            finally:
                stop()
    finally:
        for r in replicas:
            r.process.terminate()
        for r in replicas:
            r.process.wait_or_kill(30)
    emit(result, ns.out)


if __name__ == "__main__":
    main()

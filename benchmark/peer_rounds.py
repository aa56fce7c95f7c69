"""Interleaved rounds: radixlm and a peer stay loaded side by side and take turns on the same
workload, so the machine's drift (a noisy VM's speed moves 15-40% within minutes) hits both
alike. A ratio is taken per round (radixlm's round against the peer's next to it) and the
median of those is reported, with every round's figures and, as a fairness check, the CPU
time the idle engine's processes used while the other one ran.

The peer runs its runner in "rounds" mode (peers/peer_io.serve_rounds): loaded once, one run
per `run K` line on its stdin, each result in a file of its own.
"""
from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

from common import BENCH_DIR, peer_env, peer_unavailable, venv_python

CLK_TCK = os.sysconf("SC_CLK_TCK")


class PeerFailed(RuntimeError):
    pass


def process_tree_cpu_s(root: int) -> float:
    """User + system CPU seconds of `root` and its live descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    times: dict[int, float] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid, ppid = int(name), int(fields[1])
        children.setdefault(ppid, []).append(pid)
        times[pid] = (int(fields[11]) + int(fields[12])) / CLK_TCK
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += times.get(pid, 0.0)
        todo += children.get(pid, [])
    return total


class PeerRounds:
    """A peer runner kept loaded; run_round(k) runs the workload once and returns its result."""

    def __init__(self, peer: str, venv: str, spec: dict, timeout: float) -> None:
        self.peer, self.timeout = peer, timeout
        python, why = venv_python(peer, venv)
        if python is None:
            self.error: dict | None = peer_unavailable(peer, why, missing_venv=venv)
            self.proc = None
            return
        self.error = None
        self._tmp = tempfile.TemporaryDirectory(prefix=f"radixlm-peer-{peer}-rounds-")
        spec_path = os.path.join(self._tmp.name, "spec.json")
        self.out = os.path.join(self._tmp.name, "result.json")
        with open(spec_path, "w") as f:
            json.dump({**spec, "mode": "rounds"}, f)
        runner = os.path.join(BENCH_DIR, "peers", f"{peer}_runner.py")
        print(f"starting peer {peer} for interleaved rounds: {python} {runner}", file=sys.stderr)
        # its logs go to our stderr (our stdout stays pure JSON); its own session, stopped by pid
        self.proc = subprocess.Popen([python, runner, spec_path, self.out], stdin=subprocess.PIPE,
                                     stdout=sys.stderr, stderr=sys.stderr, env=peer_env(), cwd=self._tmp.name,
                                     text=True, start_new_session=True)
        try:
            self.info = self._wait_file(self.out + ".ready")
        except PeerFailed as e:
            self.close()
            self.error = peer_unavailable(peer, str(e))

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def run_round(self, k: int) -> dict:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(f"run {k}\n")
        self.proc.stdin.flush()
        return self._wait_file(f"{self.out}.round{k}")

    def _wait_file(self, path: str) -> dict:
        assert self.proc is not None
        deadline = time.monotonic() + self.timeout
        while not os.path.exists(path):
            if self.proc.poll() is not None:
                raise PeerFailed(f"the {self.peer} runner exited with code {self.proc.returncode}")
            if time.monotonic() > deadline:
                raise PeerFailed(f"no {os.path.basename(path)} from the {self.peer} runner in {self.timeout:.0f} s")
            time.sleep(0.02)
        with open(path) as f:
            return json.load(f)

    def close(self) -> None:
        if self.proc is None:
            return
        try:
            if self.proc.poll() is None and self.proc.stdin is not None:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
            self.proc.wait(60)
        except (OSError, subprocess.TimeoutExpired):
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None
        self._tmp.cleanup()


def _rate(run: dict) -> float:
    """Output tokens/s unrounded where the run gives its count and wall (a prefill case makes one
    token a prompt in ~10 s: its rounded rate would decide the ratio)."""
    if run.get("output_tokens") and run.get("wall_s"):
        return run["output_tokens"] / run["wall_s"]
    return run["output_tok_per_s"]


def interleave(ours: Callable[[], dict], peers: dict[str, PeerRounds], rounds: int, pause_s: float) -> dict:
    """`rounds` rounds of radixlm (`ours()`: one run, a dict with output_tok_per_s) and each
    live peer, the order reversed every other round (ABBA: a steady drift favours nobody).
    Returns per engine its runs and median, the paired ratios and their median."""
    live = {name: p for name, p in peers.items() if p.error is None}
    me = os.getpid()
    runs: dict[str, list[dict]] = {"radixlm": [], **{name: [] for name in live}}

    def cpu_of(name: str) -> float:
        if name == "radixlm":  # our own tree, less the peers' (they are our children too)
            return process_tree_cpu_s(me) - sum(process_tree_cpu_s(p.pid) for p in live.values() if p.pid)
        pid = live[name].pid
        return process_tree_cpu_s(pid) if pid else 0.0

    for k in range(rounds):
        order = ["radixlm", *live] if k % 2 == 0 else [*reversed(list(live)), "radixlm"]
        for name in order:
            time.sleep(pause_s)  # the last engine's spinning threads go to sleep first
            idle = [n for n in runs if n != name]
            before = {n: cpu_of(n) for n in idle}
            res = ours() if name == "radixlm" else live[name].run_round(k)
            res["round"] = k
            res["idle_engines_cpu_s"] = {n: round(max(0.0, cpu_of(n) - before[n]), 3) for n in idle}
            runs[name].append(res)
    out: dict = {"rounds": rounds, "pause_s": pause_s}
    for name, rs in runs.items():
        rates = [r["output_tok_per_s"] for r in rs]
        out[name] = {"runs_output_tok_per_s": rates, "median_output_tok_per_s": round(statistics.median(rates), 1),
                     "runs_wall_s": [r.get("wall_s") for r in rs],
                     "runs_idle_engines_cpu_s": [r["idle_engines_cpu_s"] for r in rs], "first_run": rs[0]}
    for name in live:
        ratios = [_rate(a) / _rate(b) for a, b in zip(runs["radixlm"], runs[name])]
        out[f"paired_speedup_vs_{name}"] = [round(x, 3) for x in ratios]
        out[f"speedup_vs_{name}"] = round(statistics.median(ratios), 3)
    return out

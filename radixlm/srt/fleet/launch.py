"""`radixlm serve --dp-size N`: N replicas behind one router, supervised by this process.

    radixlm serve --dp-size 2 [--dp-router auto|smg|builtin] [--dp-policy cache_aware] ...

The replicas are `radixlm serve` processes on 127.0.0.1 (free ports), each pinned to its own
share of the cores with as many threads. In front, on --host/--port:
- `smg` (the SGLang Model Gateway) when it is installed (`auto`, the default): cache-aware
  routing over an approximate radix tree per worker, retries, circuit breaking, health
  checks, Prometheus on 127.0.0.1, and the RL control plane (`--enable-rl`: /v1/rl/...).
- otherwise radixlm's built-in dispatcher (`radixlm.srt.fleet.dispatcher`): prefix-hash
  or round-robin routing and the single server's control routes, fanned out. It exists so
  that `--dp-size` works without the optional `smg` package.
If any child exits, everything is stopped and the supervisor exits non-zero (as one server
does when its scheduler dies); SIGTERM/SIGINT stop the router and the replicas.
"""
from __future__ import annotations

import logging
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from radixlm.config import ServerArgs
from radixlm.srt.fleet.dispatcher import POLICIES as BUILTIN_POLICIES
from radixlm.srt.fleet.gateway import SMG_POLICIES, SmgGateway, smg_available
from radixlm.srt.fleet.processes import ChildProcess, wait_until_ready
from radixlm.srt.fleet.replicas import Replica, start_replicas

logger = logging.getLogger(__name__)

REPLICA_STARTUP_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 15.0
ROUTERS = ("auto", "smg", "builtin")


@dataclass(frozen=True)
class FleetOptions:
    dp_size: int
    router: str = "auto"
    policy: str = "cache_aware"

    def resolved_router(self) -> str:
        if self.router not in ROUTERS:
            raise ValueError(f"--dp-router must be one of {ROUTERS}, got {self.router!r}")
        if self.router == "smg" and not smg_available():
            raise ValueError("--dp-router smg: the `smg` package is not installed (pip install smg)")
        return "smg" if self.router == "smg" or (self.router == "auto" and smg_available()) else "builtin"

    def resolved_policy(self, router: str) -> str:
        if router == "smg":
            if self.policy not in SMG_POLICIES:
                raise ValueError(f"--dp-policy for smg must be one of {SMG_POLICIES}, got {self.policy!r}")
            return self.policy
        # the built-in dispatcher's nearest relative of cache_aware is prefix hashing
        policy = "prefix_hash" if self.policy == "cache_aware" else self.policy
        if policy not in BUILTIN_POLICIES:
            raise ValueError(f"--dp-policy for the built-in dispatcher must be cache_aware (= prefix_hash) "
                             f"or one of {BUILTIN_POLICIES}, got {self.policy!r}")
        return policy


def _start_router(router: str, policy: str, args: ServerArgs, urls: list[str]) -> tuple[ChildProcess, Callable[[], None]]:
    """The router's process (already in the supervisor's hands) and how to wait for it."""
    if router == "smg":
        extra = ["--health-check-interval-secs", "5"]
        api_key = getattr(args, "api_key", None)  # replicas check it; smg sends its --api-key to them
        gw = SmgGateway(urls, host=args.host, port=args.port, policy=policy, extra_args=extra,
                        api_key=api_key).start()
        assert gw.process is not None
        return gw.process, gw.wait_ready
    argv = [sys.executable, "-m", "radixlm.srt.fleet.dispatcher", "--host", args.host, "--port", str(args.port),
            "--policy", policy, "--log-level", args.log_level, "--worker-urls", *urls]
    proc = ChildProcess.start("dispatcher", argv)
    return proc, lambda: wait_until_ready([proc], [f"http://{args.host}:{args.port}/health"], 60.0)


def launch_dp(args: ServerArgs, options: FleetOptions, served_model_name: str | None = None) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s [fleet] %(levelname)s %(message)s")
    router = options.resolved_router()
    policy = options.resolved_policy(router)
    stop = {"signal": None}

    def on_signal(signum, frame) -> None:
        stop["signal"] = signum

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    replicas: list[Replica] = []
    children: list[ChildProcess] = []
    code = 0
    try:
        replicas = start_replicas(args, options.dp_size, served_model_name)
        children = [r.process for r in replicas]
        wait_until_ready(children, [r.url + "/health" for r in replicas], REPLICA_STARTUP_TIMEOUT_S)
        if stop["signal"] is None:
            proc, wait_ready = _start_router(router, policy, args, [r.url for r in replicas])
            children.append(proc)
            wait_ready()
            print(f"radixlm: ready: {options.dp_size} replicas behind "
                  f"{'smg' if router == 'smg' else 'the built-in dispatcher'} ({policy}) at "
                  f"http://{args.host}:{args.port} (pid {children[-1].pid}); replicas: "
                  + ", ".join(f"{r.url} cpus {r.cpus}" for r in replicas), flush=True)
        while stop["signal"] is None:
            dead = [c for c in children if not c.alive()]
            if dead:
                logger.error("%s exited unexpectedly (code %s); stopping the fleet", dead[0].name,
                             dead[0].popen.returncode)
                code = 1
                break
            time.sleep(0.2)
    except RuntimeError as e:
        logger.error("%s", e)
        code = 1
    finally:
        for c in reversed(children):  # router first: no new requests reach a stopping replica
            c.terminate()
        for c in children:
            c.wait_or_kill(STOP_TIMEOUT_S)
        for s, h in previous.items():
            signal.signal(s, h)
    return code

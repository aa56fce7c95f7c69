"""N engine replicas on one machine: one `radixlm serve` process each (with its own scheduler
and detokenizer), on loopback ports, each pinned to its own share of the CPU cores."""
from __future__ import annotations

import dataclasses
import logging
import os
import sys
from dataclasses import dataclass

from radixlm.config import ServerArgs
from radixlm.srt.fleet.processes import ChildProcess, free_port

logger = logging.getLogger(__name__)

REPLICA_HOST = "127.0.0.1"  # replicas are internal: only the gateway in front is public
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def split_cpus(n: int, cpus: list[int] | None = None) -> list[list[int]]:
    """Disjoint core sets, one per replica (the remainder goes to the first ones). With
    fewer cores than replicas every replica gets one core, shared round-robin."""
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else sorted(cpus)
    if not cpus:
        raise ValueError("no CPUs to split")
    if len(cpus) < n:
        logger.warning("%d replicas on %d cores: replicas share cores and compete", n, len(cpus))
        return [[cpus[i % len(cpus)]] for i in range(n)]
    base, extra = divmod(len(cpus), n)
    out, start = [], 0
    for i in range(n):
        size = base + (1 if i < extra else 0)
        out.append(cpus[start:start + size])
        start += size
    return out


def serve_argv(args: ServerArgs, served_model_name: str | None, port: int) -> list[str]:
    """`python -m radixlm serve` with every non-default server argument of `args`, on a
    loopback port."""
    argv = [sys.executable, "-m", "radixlm", "serve", "--host", REPLICA_HOST, "--port", str(port)]
    for f in dataclasses.fields(ServerArgs):
        if f.name in ("host", "port"):
            continue
        value = getattr(args, f.name)
        if value == f.default:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag)  # every bool option is a store_true flag defaulting to False
        else:
            argv += [flag, str(value)]
    if served_model_name:
        argv += ["--served-model-name", served_model_name]
    return argv


@dataclass
class Replica:
    index: int
    url: str
    cpus: list[int]
    process: ChildProcess


def start_replicas(args: ServerArgs, n: int, served_model_name: str | None = None,
                   cpus: list[int] | None = None, log=None) -> list[Replica]:
    replicas = []
    try:
        for i, share in enumerate(split_cpus(n, cpus)):
            port = free_port(REPLICA_HOST)
            env = dict(os.environ, **{k: str(len(share)) for k in THREAD_ENV})
            proc = ChildProcess.start(f"replica {i}", serve_argv(args, served_model_name, port), env=env,
                                      cpus=share, log=log)
            replicas.append(Replica(i, f"http://{REPLICA_HOST}:{port}", share, proc))
    except BaseException:
        for r in replicas:
            r.process.terminate()
        raise
    return replicas

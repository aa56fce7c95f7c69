"""Starting and stopping the scheduler and detokenizer processes.

Children are started as `python -m radixlm.srt.child` with their arguments pickled on
stdin, not through multiprocessing's spawn: spawn re-imports the caller's main script, which
would force every user script to guard itself with `if __name__ == "__main__"`.
Each child reports readiness (or its start-up error) on a ZMQ socket of the launcher.
"""
from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import time
from dataclasses import dataclass, field

import zmq

from radixlm.config import ServerArgs
from radixlm.ipc import PortArgs, Receiver, Sender
from radixlm.messages import ShutdownReq
from radixlm.srt.child import process_name

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0


def describe(name: str) -> str:
    """A child's name as an error message says it."""
    rank = name.rpartition("_tp")[2] if "_tp" in name else ""
    return f"{name} process (tensor-parallel rank {rank})" if rank else f"{name} process"


@dataclass
class RuntimeProcesses:
    ports: PortArgs
    procs: dict[str, subprocess.Popen]
    scheduler_info: dict = field(default_factory=dict)
    first_death: str | None = None  # the child whose unexpected exit brought the runtime down

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs.values())

    def stop_tp_ranks(self, dead: str) -> bool:
        """Rank `dead` exited: terminate the other scheduler ranks (they must not wait for it).
        Returns False if an earlier death already did (the caller need not report this one)."""
        if self.first_death is not None:
            return False
        self.first_death = dead
        ranks = [p for name, p in self.procs.items() if name.startswith("scheduler")]
        if len(ranks) > 1:
            for p in ranks:
                if p.poll() is None:
                    p.terminate()
        return True

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the children and remove the IPC files; safe to call twice."""
        if any(p.poll() is None for p in self.procs.values()):
            try:
                ctx = zmq.Context()
                for addr in (self.ports.scheduler_input, self.ports.detokenizer_input):
                    s = Sender(ctx, addr)
                    s.send(ShutdownReq())
                    s.sock.close(linger=200)
                ctx.term()
            except zmq.ZMQError:
                pass
        deadline = time.monotonic() + timeout
        for p in self.procs.values():
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.terminate()
                try:
                    p.wait(2.0)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        self.ports.cleanup()


def launch_subprocesses(args: ServerArgs) -> RuntimeProcesses:
    ports = PortArgs.new()
    ctx = zmq.Context()
    ready = Receiver(ctx, ports.ready)
    procs: dict[str, subprocess.Popen] = {}
    runtime = RuntimeProcesses(ports, procs)
    # One scheduler process per tensor-parallel rank; each the same code on the same
    # messages, with the same string hashing (nothing should depend on it; this makes sure).
    children = [("scheduler", r) for r in range(args.tp_size)] + [("detokenizer", 0)]
    env = dict(os.environ)
    if args.tp_size > 1:
        env.setdefault("PYTHONHASHSEED", "0")
    try:
        for kind, rank in children:
            p = subprocess.Popen([sys.executable, "-m", "radixlm.srt.child"], stdin=subprocess.PIPE, env=env)
            p.stdin.write(pickle.dumps((kind, args, ports, rank)))
            p.stdin.close()
            procs[process_name(kind, rank)] = p
        pending = set(procs)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while pending:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{', '.join(sorted(pending))} did not become ready within "
                                   f"{STARTUP_TIMEOUT_S:.0f} s")
            for name in pending:
                code = procs[name].poll()
                if code is not None:
                    raise RuntimeError(f"the {name} process exited during start-up (exit code {code})")
            if not ready.wait(100):
                continue
            msg = ready.recv()
            if msg.get("status") != "ready":
                raise RuntimeError(f"the {msg.get('kind')} process failed to start: {msg.get('error')}\n"
                                   f"{msg.get('traceback', '')}")
            pending.discard(msg["kind"])
            if msg["kind"] == "scheduler":
                runtime.scheduler_info = msg
    except BaseException:
        runtime.shutdown(timeout=1.0)
        raise
    finally:
        ready.sock.close(0)
        ctx.term()
    return runtime

"""Entry point of a runtime child process: `python -m radixlm.srt.child` with
(kind, ServerArgs, PortArgs, tp_rank) pickled on stdin."""
from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import traceback


class ReadyReporter:
    """Sends the child's start-up status to the launcher."""

    def __init__(self, kind: str, addr: str) -> None:
        import zmq

        from radixlm.ipc import Sender
        self.kind = kind
        self._ctx = zmq.Context()
        self._sender = Sender(self._ctx, addr)

    def error(self, exc: BaseException) -> None:
        """Report a start-up failure (the launcher raises it with this traceback)."""
        self.send({"status": "error", "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})

    def send(self, msg: dict) -> None:
        self._sender.send({**msg, "kind": self.kind})
        self._sender.sock.close(linger=1000)
        self._ctx.term()


def die_with_parent(ports) -> None:
    """Exit, removing the IPC dir, when the parent dies (no orphans, no stale IPC files):
    Linux sends SIGTERM to this process when its parent goes away."""
    def on_term(signum, frame) -> None:
        ports.cleanup()
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass
    if os.getppid() == 1:  # the parent died before prctl took effect
        on_term(signal.SIGTERM, None)


def process_name(kind: str, tp_rank: int = 0) -> str:
    """"scheduler" (TP rank 0, the one the other processes talk to), "scheduler_tp1", ..."""
    return f"{kind}_tp{tp_rank}" if tp_rank else kind


def main() -> None:
    kind, args, ports, tp_rank = pickle.loads(sys.stdin.buffer.read())
    die_with_parent(ports)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    name = process_name(kind, tp_rank)
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s [{name}] %(levelname)s %(name)s: %(message)s")
    reporter = ReadyReporter(name, ports.ready)
    if kind == "scheduler":
        from radixlm.srt.cpu_priority import lower_forward_priority
        lower_forward_priority(args.scheduler_nice, args.scheduler_policy)
        from radixlm.srt.scheduler_process import run_scheduler_process
        run_scheduler_process(args, ports, reporter, tp_rank)
    elif kind == "detokenizer":
        from radixlm.srt.detokenizer_process import run_detokenizer_process
        run_detokenizer_process(args, ports, reporter)
    else:
        raise SystemExit(f"unknown child kind {kind!r}")
    # Stopped in order (its sockets are closed): skip the interpreter's finalization, whose
    # garbage collection over torch's and transformers' module state took ~5 s, long enough
    # for the launcher to give up waiting and SIGTERM us.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

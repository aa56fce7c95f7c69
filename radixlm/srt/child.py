"""Entry point of a runtime child process: `python -m radixlm.srt.child` with
(kind, ServerArgs, PortArgs) pickled on stdin."""
from __future__ import annotations

import pickle
import sys


class ReadyReporter:
    """Sends the child's start-up status to the launcher."""

    def __init__(self, kind: str, addr: str) -> None:
        import zmq

        from radixlm.ipc import Sender
        self.kind = kind
        self._ctx = zmq.Context()
        self._sender = Sender(self._ctx, addr)

    def send(self, msg: dict) -> None:
        self._sender.send({**msg, "kind": self.kind})
        self._sender.sock.close(linger=1000)
        self._ctx.term()


def main() -> None:
    kind, args, ports = pickle.loads(sys.stdin.buffer.read())
    reporter = ReadyReporter(kind, ports.ready)
    if kind == "scheduler":
        from radixlm.srt.scheduler_process import run_scheduler_process
        run_scheduler_process(args, ports, reporter)
    elif kind == "detokenizer":
        from radixlm.srt.detokenizer_process import run_detokenizer_process
        run_detokenizer_process(args, ports, reporter)
    else:
        raise SystemExit(f"unknown child kind {kind!r}")


if __name__ == "__main__":
    main()

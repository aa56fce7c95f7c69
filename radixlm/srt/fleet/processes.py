"""Child processes of the fleet supervisor: started in their own session (so a stop reaches a
child's own children and nobody else's), tied to the supervisor's life, stopped by pid."""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _preexec(cpus: Sequence[int] | None) -> Callable[[], None]:
    def setup() -> None:
        # Linux: SIGTERM this child when the supervisor dies, so a killed supervisor
        # leaves no replicas behind (each replica stops its own scheduler the same way).
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        except OSError:
            pass
        if cpus:
            os.sched_setaffinity(0, cpus)
    return setup


@dataclass
class ChildProcess:
    name: str
    popen: subprocess.Popen

    @classmethod
    def start(cls, name: str, argv: Sequence[str], *, env: dict[str, str] | None = None,
              cpus: Sequence[int] | None = None, log=None) -> ChildProcess:
        popen = subprocess.Popen(list(argv), env=env, stdout=log, stderr=subprocess.STDOUT if log else None,
                                 start_new_session=True, preexec_fn=_preexec(cpus))
        logger.info("started %s (pid %d): %s", name, popen.pid, " ".join(argv))
        return cls(name, popen)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def terminate(self) -> None:
        """SIGTERM to the child (it stops its own children in order)."""
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)

    def wait_or_kill(self, timeout: float) -> int:
        """Wait for the exit; past the timeout, SIGKILL the child's whole process group."""
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            logger.warning("%s (pid %d) did not stop within %.0f s; killing its process group",
                           self.name, self.pid, timeout)
            try:
                os.killpg(self.pid, signal.SIGKILL)  # its own session: pgid == pid
            except ProcessLookupError:
                pass
            return self.popen.wait()


def http_ok(url: str, timeout: float = 2.0, check: Callable[[bytes], bool] | None = None,
            headers: dict[str, str] | None = None) -> bool:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as r:
            return r.status == 200 and (check is None or check(r.read()))
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_until_ready(children: Sequence[ChildProcess], urls: Sequence[str], timeout: float,
                     check: Callable[[bytes], bool] | None = None,
                     headers: dict[str, str] | None = None) -> None:
    """Until every `url` answers 200 (and `check`); raises if a child exits or time runs out."""
    pending = dict(zip(urls, children))
    deadline = time.monotonic() + timeout
    while pending:
        for url, child in list(pending.items()):
            if not child.alive():
                raise RuntimeError(f"{child.name} exited during start-up (exit code {child.popen.returncode})")
            if http_ok(url, check=check, headers=headers):
                del pending[url]
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"not ready within {timeout:.0f} s: {', '.join(sorted(pending))}")
        if pending:
            time.sleep(0.2)

"""A real `radixlm serve` in a subprocess for the HTTP tests: started on a free loopback port,
its output in a log file, stopped by its own pid with a check that nothing it started is left."""
from __future__ import annotations

from typing import TYPE_CHECKING

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx

if TYPE_CHECKING:
    import openai

SERVER_ARGS = ("--dtype", "float32", "--max-total-tokens", "8192", "--served-model-name", "tiny_llama")
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is gone for our purpose
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


class ServerProcess:
    """`python -m radixlm serve` in a subprocess; its output goes to a log file."""

    def __init__(self, model_dir: str, log_path: str, *extra: str, new_session: bool = False,
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", **(env or {}))
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "radixlm", "serve", "--model-path", model_dir,
                                      "--host", "127.0.0.1", "--port", str(self.port), *SERVER_ARGS, *extra],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=new_session)
        self.runtime: dict = {}

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.base + "/health", timeout=1.0).status_code == 200:
                    self.runtime = self.info()["runtime"]
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.log()}")

    def info(self) -> dict:
        return httpx.get(self.base + "/get_server_info", timeout=10.0).json()

    def openai(self) -> openai.OpenAI:
        import openai  # imported on use: tp_checks needs free_port only, where openai is absent (test/gpu)

        return openai.OpenAI(base_url=self.base + "/v1", api_key="x", max_retries=0, timeout=60.0)

    def stop(self, timeout: float = 15.0) -> tuple[int, float]:
        """SIGTERM; returns (exit code, seconds to exit). Asserts nothing is left behind."""
        t0 = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"server did not exit within {timeout} s of SIGTERM:\n{self.log()}")
        elapsed = time.monotonic() - t0
        self._log.close()
        for pid in self.runtime.get("child_pids", {}).values():
            deadline = time.monotonic() + 3.0
            while pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not pid_alive(pid), f"child {pid} outlived the server"
        ipc = self.runtime.get("ipc_dir")
        assert ipc and "radixlm-ipc-" in ipc and not os.path.exists(ipc), f"stale IPC dir {ipc}"
        return rc, elapsed


def assert_idle(server: ServerProcess, within: float = 0.5) -> float:
    """Waits until nothing runs or waits and no KV is held by requests; returns the wait."""
    t0 = time.monotonic()
    while True:
        info = server.info()
        mem = info["memory"]
        if (info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0 and mem["protected"] == 0
                and mem["free"] + mem["evictable"] == mem["capacity"]):
            return time.monotonic() - t0
        assert time.monotonic() - t0 < within, f"not idle after {within} s: {info}"
        time.sleep(0.01)


@contextlib.contextmanager
def serving(model_dir: str, log_path: str, *extra: str, cls: type[ServerProcess] | None = None):
    """A ready server for the with-block; stopped (if still running) after it."""
    srv = (cls or ServerProcess)(model_dir, log_path, *extra)
    try:
        srv.wait_ready()
        yield srv
    finally:
        if srv.proc.poll() is None:
            srv.stop()


def sse_events(lines) -> list:
    """The events of a server-sent-event stream's lines: parsed JSON, or "[DONE]"."""
    return [json.loads(x[5:]) if x[5:].strip() != "[DONE]" else "[DONE]" for x in lines if x.startswith("data:")]

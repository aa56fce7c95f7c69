"""The SGLang Model Gateway (`smg`, PyPI) in front of radixlm workers.

`smg launch` is one process (the Python launcher loads the Rust router in-process and
renames itself `smg::router`); it is started in its own session and stopped by its pid.
Its Prometheus endpoint binds 0.0.0.0:29000 unless told otherwise, so it is always given
127.0.0.1 and a free port.
"""
from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from radixlm.srt.fleet.processes import ChildProcess, free_port, wait_until_ready

# smg's routing policies (`smg launch --policy`); docs/fleet.md says what each does for
# radixlm's prefix cache.
SMG_POLICIES = ("cache_aware", "round_robin", "random", "power_of_two", "least_load", "prefix_hash",
                "consistent_hashing", "manual", "passthrough")


def smg_available() -> bool:
    return importlib.util.find_spec("smg") is not None


@dataclass
class SmgGateway:
    worker_urls: list[str]
    host: str = "127.0.0.1"
    port: int = 0
    policy: str = "cache_aware"
    enable_rl: bool = True
    extra_args: Sequence[str] = ()
    # smg waits this long for in-flight requests on SIGTERM (its default is 180 s); replicas
    # stopping at the same time abort theirs, so a short grace is enough.
    shutdown_grace_s: int = 5
    metrics_port: int = 0
    # smg polls each worker's /v1/loads this often (its default is 10 s)
    load_monitor_interval_s: int = 10
    api_key: str | None = None  # smg checks it on its routes and sends it to the workers
    process: ChildProcess | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.port = self.port or free_port(self.host)
        self.metrics_port = self.metrics_port or free_port("127.0.0.1")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def argv(self) -> list[str]:
        argv = [sys.executable, "-m", "smg", "launch", "--host", self.host, "--port", str(self.port),
                "--policy", self.policy, "--prometheus-host", "127.0.0.1",
                "--prometheus-port", str(self.metrics_port), "--log-level", "warn",
                "--shutdown-grace-period-secs", str(self.shutdown_grace_s),
                "--load-monitor-interval", str(self.load_monitor_interval_s)]
        if self.api_key:
            argv += ["--api-key", self.api_key]
        if self.worker_urls:
            argv += ["--worker-urls", *self.worker_urls]
        if self.enable_rl:
            argv.append("--enable-rl")
        return argv + list(self.extra_args)

    def start(self, log=None) -> SmgGateway:
        self.process = ChildProcess.start("smg gateway", self.argv(), log=log)
        return self

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Until every worker is healthy and in the gateway's load snapshot.

        `/readiness` is 200 once the gateway has one worker. The snapshot matters too: smg's
        load monitor polls the workers registered when it starts and then every
        `load_monitor_interval_s`, and until a worker has been polled its expected-wait score
        is never below the polled ones', so every cache miss (cache_aware's fallback) goes
        to the worker polled first."""
        assert self.process is not None
        want = set(self.worker_urls)
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None

        def all_healthy(body: bytes) -> bool:
            try:
                return json.loads(body).get("healthy_workers", 0) >= len(want)
            except ValueError:
                return False

        def all_polled(body: bytes) -> bool:
            try:
                return want <= {row.get("worker") for row in json.loads(body).get("loads", [])}
            except (ValueError, AttributeError):
                return False
        wait_until_ready([self.process], [self.url + "/readiness"], timeout, check=all_healthy)
        wait_until_ready([self.process], [self.url + "/get_loads"], timeout, check=all_polled, headers=headers)

    def stop(self, timeout: float = 10.0) -> int | None:
        if self.process is None:
            return None
        self.process.terminate()
        return self.process.wait_or_kill(timeout)

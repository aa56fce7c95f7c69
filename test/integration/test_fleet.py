"""A fleet behind the real SGLang Model Gateway (`smg`): two `radixlm serve` workers on loopback
(tiny random Llama, one thread each) and gateways started by the tests.

Routing (cache-aware keeps a prefix on one worker), native and OpenAI traffic, the stop
path (a disconnect at the gateway aborts on the worker; abort_all and pause fan out to every
worker; a retried attempt is never left running; a worker killed mid-stream errors its
clients), RL across the fleet, registration, `radixlm serve --dp-size` and the built-in
dispatcher."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from test.support.server import ServerProcess, free_port, pid_alive, sse_events

smg_rl = pytest.importorskip("smg.rl", reason="the smg gateway (dev extra) is not installed")

from radixlm.srt.fleet.gateway import SmgGateway  # noqa: E402

ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
SELECTOR = "model=tiny_llama"  # every worker of the fleet (smg derives `model` from the registry)
LONG = {"max_new_tokens": 1900, "ignore_eos": True}  # far longer than any test waits
STARTUP_S = 600.0  # seconds: start-up is ~10 s alone, minutes on a shared, overloaded machine


# ---------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def workers(tiny_llama_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("fleet")
    ws = [ServerProcess(tiny_llama_dir, str(d / f"worker{i}.log"), env=ONE_THREAD) for i in range(2)]
    try:
        for w in ws:
            w.wait_ready(STARTUP_S)
        w_clients = [httpx.Client(base_url=w.base, timeout=60.0) for w in ws]
        for w, c in zip(ws, w_clients):
            w.client = c
        yield ws
    finally:
        _stop_all(ws)


def _stop_all(servers) -> None:
    """Stop every server even when one of the stops fails (a failure is raised after)."""
    errors = []
    for w in servers:
        if w.proc.poll() is None:
            try:
                w.stop()
            except AssertionError as e:
                errors.append(e)
    if errors:
        raise errors[0]


def _start_gateway(workers, tmp_path_factory, name: str, *extra: str, policy: str = "cache_aware",
                   load_monitor_interval_s: int = 1) -> SmgGateway:
    """A gateway over `workers`, ready once it is polled every one's load (`wait_ready`): a
    short poll keeps that wait short."""
    log = open(tmp_path_factory.mktemp(name) / "smg.log", "wb")
    gw = SmgGateway([w.base for w in workers], policy=policy, extra_args=extra,
                    load_monitor_interval_s=load_monitor_interval_s)
    gw.start(log=log)
    gw.log = log
    try:
        gw.wait_ready()
    except BaseException:
        _stop_gateway(gw)
        raise
    return gw


def _stop_gateway(gw: SmgGateway) -> None:
    pid = gw.process.pid
    assert gw.stop() is not None
    gw.log.close()
    assert not pid_alive(pid)


@pytest.fixture(scope="module")
def gateway(workers, tmp_path_factory):
    gw = _start_gateway(workers, tmp_path_factory, "smg")
    yield gw
    _stop_gateway(gw)


@pytest.fixture(scope="module")
def gw(gateway):
    with httpx.Client(base_url=gateway.url, timeout=60.0) as c:
        yield c


# ---------------------------------------------------------------------------- helpers
def _info(w) -> dict:
    return w.client.get("/get_server_info").json()


def _busy(w) -> bool:
    i = _info(w)
    m = i["memory"]
    return (i["num_running_reqs"] + i["num_waiting_reqs"] + i["num_tokenizing_reqs"] > 0 or m["protected"] > 0
            or m["free"] + m["evictable"] != m["capacity"])


def _wait(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def _wait_idle(workers, timeout: float = 5.0) -> None:
    _wait(lambda: not any(_busy(w) for w in workers), timeout, "every worker to be idle with its KV free")


def _aborted(workers) -> list[int]:
    return [_info(w)["num_aborted"] for w in workers]


def _requests(workers) -> list[float]:
    """Requests each worker has received (its Prometheus counter)."""
    out = []
    for w in workers:
        m = re.search(r"^radixlm:num_requests_total (\S+)$", w.client.get("/metrics").text, re.M)
        out.append(float(m.group(1)))
    return out


def _raw_post(url: str, path: str, body: dict) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)))
    data = json.dumps(body).encode()
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def _fanout(gw_url: str, path: str, body: dict | None = None) -> smg_rl.FanoutResult:
    return smg_rl.RL(gw_url, timeout=120).fanout(path, {} if body is None else body, selector=SELECTOR)


# ---------------------------------------------------------------------------- registration and shapes
def test_gateway_registers_workers_as_sglang_engines(gateway, gw, workers):
    rows = smg_rl.RL(gateway.url).workers()
    assert sorted(r.url for r in rows) == sorted(w.base for w in workers)
    for r in rows:
        # owned_by "radixlm" and no /version: smg falls back to /server_info and sees SGLang
        assert r.engine == "sglang" and r.health == "ready" and r.connection_mode == "http"
        assert r.model_id == "tiny_llama" and r.tp_size == 1 and r.dp_size == 1
        assert r.labels["max_total_tokens"] == "8192" and r.capabilities["abort"] is True
    assert gw.get("/readiness").json() == {"status": "ready", "healthy_workers": 2, "total_workers": 2}
    w = workers[0].client
    assert w.get("/version").status_code == 404
    info = w.get("/server_info").json()
    assert info["served_model_name"] == "tiny_llama" and info["max_total_tokens"] == 8192
    assert info["weight_version"] == w.get("/model_info").json()["weight_version"]
    load = w.get("/v1/loads", params={"include": "core,memory"}).json()
    assert load["dp_rank_count"] == 1 and load["loads"][0]["max_total_num_tokens"] == 8192
    assert load["loads"][0]["memory"]["capacity"] == 8192
    assert w.get("/get_load").json()[0]["num_reqs"] >= 0
    # the gateway reads model info through any worker
    assert gw.get("/get_model_info").json()["served_model_name"] == "tiny_llama"


# ---------------------------------------------------------------------------- traffic
def test_native_generate_through_the_gateway(gw, workers):
    body = {"text": "The fleet says", "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}}
    direct = workers[0].client.post("/generate", json=body).json()
    out = gw.post("/generate", json=body)
    assert out.status_code == 200, out.text
    assert out.json()["output_ids"] == direct["output_ids"] and out.json()["text"] == direct["text"]
    with gw.stream("POST", "/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]" and events[-2]["text"] == direct["text"]
    assert events[-2]["meta_info"]["finish_reason"]["type"] == "length"
    batch = gw.post("/generate", json={"input_ids": [[1, 2, 3], [4, 5]], "sampling_params": {"max_new_tokens": 3}})
    assert batch.status_code == 200 and len(batch.json()) == 2
    # SGLang's seed name passes the gateway (it drops sampling fields it does not know)
    seeded = {"text": "x", "sampling_params": {"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 7}}
    assert gw.post("/generate", json=seeded).json()["output_ids"] == gw.post("/generate", json=seeded).json()["output_ids"]
    bad = gw.post("/generate", json={**body, "return_hidden_states": True})
    assert bad.status_code == 400 and "return_hidden_states" in bad.json()["error"]["message"]


def test_openai_client_through_the_gateway(gateway):
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0, timeout=60.0)
    assert [m.id for m in client.models.list().data] == ["tiny_llama"]
    msgs = [{"role": "user", "content": "Hello fleet"}]
    full = client.chat.completions.create(model="tiny_llama", messages=msgs, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert full.usage.completion_tokens == 8 and full.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(model="tiny_llama", messages=msgs, max_tokens=8, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    comp = client.completions.create(model="tiny_llama", prompt="Once", max_tokens=4, temperature=0)
    assert comp.usage.completion_tokens <= 4 and comp.choices[0].text is not None


def _prefix_workload(url: str, groups: int = 4, turns: int = 3) -> list[list[int]]:
    """`groups` distinct long prefixes, `turns` requests each (sequential): cached tokens."""
    out = []
    with httpx.Client(base_url=url, timeout=60.0) as c:
        for g in range(groups):
            prefix = f"Conversation {g}: " + " ".join(f"fact-{g}-{k} is blue" for k in range(40))
            out.append([c.post("/generate", json={"text": f"{prefix} Question {t}?",
                                                  "sampling_params": {"max_new_tokens": 2}}
                               ).json()["meta_info"]["cached_tokens"] for t in range(turns)])
    return out


def test_cache_aware_routing_keeps_a_prefix_on_one_worker(gw, workers, tmp_path_factory):
    # A gateway of its own: the module's gateway keeps its approximate tree of every earlier
    # test's requests (flush_cache does not reach it), so where a miss goes would depend on
    # test order. A miss goes to the lowest expected wait, which counts the prompts sent to
    # each worker since its last load poll: with smg's own 10 s poll the first two groups'
    # misses go to different workers, a 1 s poll often lands between them and resets the count.
    ca = _start_gateway(workers, tmp_path_factory, "smg_ca", load_monitor_interval_s=10)
    try:
        assert httpx.post(ca.url + "/flush_cache").status_code == 200  # fans out to every worker
        before = _requests(workers)
        cached = _prefix_workload(ca.url)
        served = [b - a for a, b in zip(before, _requests(workers))]
    finally:
        _stop_gateway(ca)
    # every later turn found its group's prefix cached on the worker that served the first turn
    for first, *later in cached:
        assert first < 10 and all(c >= 150 for c in later), cached  # (groups share a few tokens)
    assert all(s > 0 for s in served), f"distinct prefixes were not spread over the workers: {served}"
    # round_robin over the same workers alternates, so every other turn misses the cache
    rr = _start_gateway(workers, tmp_path_factory, "smg_rr", policy="round_robin")
    try:
        assert httpx.post(rr.url + "/flush_cache").status_code == 200
        rr_cached = _prefix_workload(rr.url)
    finally:
        _stop_gateway(rr)
    assert sum(map(sum, rr_cached)) < sum(map(sum, cached)), (rr_cached, cached)
    assert any(c == 0 for _, *later in rr_cached for c in later)


# ---------------------------------------------------------------------------- stop path
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
def test_disconnect_at_the_gateway_aborts_on_the_worker(gateway, workers, stream):
    _wait_idle(workers)
    aborted = _aborted(workers)
    s = _raw_post(gateway.url, "/generate", {"input_ids": [7, 8, 9], "stream": stream, "sampling_params": LONG})
    if stream:
        buf = b""
        while buf.count(b"data:") < 3:
            buf += s.recv(65536)
    _wait(lambda: any(_busy(w) for w in workers), 30, "the request to run on a worker")
    s.close()
    _wait_idle(workers)  # KV back long before 1,900 tokens could have been generated
    assert sum(_aborted(workers)) == sum(aborted) + 1


def test_abort_all_fans_out_to_every_worker(gateway, workers):
    results: dict[int, list] = {}

    def stream(i: int) -> None:  # one long stream on each worker, sent to it directly
        with workers[i].client.stream("POST", "/generate", json={"text": f"w{i}", "stream": True,
                                                                 "sampling_params": LONG}) as r:
            results[i] = sse_events(r.iter_lines())
    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    _wait(lambda: all(_info(w)["num_running_reqs"] == 1 for w in workers), 30, "both streams to run")
    res = _fanout(gateway.url, "abort_request", {"abort_all": True})
    assert res.total == res.succeeded == 2 and all(r.body["num_aborted"] == 1 for r in res.results.values())
    for t in threads:
        t.join(10)
        assert not t.is_alive()
    for events in results.values():
        assert events[-1] == "[DONE]" and events[-2]["meta_info"]["finish_reason"]["type"] == "abort"
    _wait_idle(workers)


def test_rl_pause_update_continue_across_the_fleet(gateway, gw, workers, tiny_llama_dir):
    rl = smg_rl.RL(gateway.url, timeout=120)
    held: dict = {}

    def late() -> None:  # arrives while the fleet is paused: held, then served on the new weights
        held["out"] = httpx.post(gateway.url + "/generate", timeout=60,
                                 json={"text": "held", "sampling_params": {"max_new_tokens": 3}}).json()
    with smg_rl.paused(rl, SELECTOR, mode="abort") as pause:
        assert pause.succeeded == 2
        t = threading.Thread(target=late)
        t.start()
        _wait(lambda: sum(_info(w)["num_tokenizing_reqs"] for w in workers) == 1, 30, "the request to be held")
        up = rl.fanout("update_weights_from_disk", {"model_path": tiny_llama_dir, "weight_version": "fleet-2"},
                       selector=SELECTOR)
        assert up.succeeded == 2 and {r.body["weight_version"] for r in up.results.values()} == {"fleet-2"}
        assert "out" not in held
    t.join(30)
    assert held["out"]["meta_info"]["weight_version"] == "fleet-2"
    versions = rl.fanout("get_weight_version", method="GET", selector=SELECTOR)
    assert {r.body["weight_version"] for r in versions.results.values()} == {"fleet-2"}
    for i in range(6):  # whichever worker serves it, a request says which weights it ran on
        out = gw.post("/generate", json={"text": f"after {i}", "sampling_params": {"max_new_tokens": 2}}).json()
        assert out["meta_info"]["weight_version"] == "fleet-2"
    assert all(w.client.get("/model_info").json()["weight_version"] == "fleet-2" for w in workers)


def test_gateway_retries_never_leave_an_attempt_running(workers, tmp_path_factory):
    """smg retries an attempt whose status is 408/429/500/502/503/504; its own request timeout
    is a 504, so every attempt of a too-slow request is cut, and each cut is an abort."""
    gw = _start_gateway(workers, tmp_path_factory, "smg_retry", "--request-timeout-secs", "1",
                        "--retry-max-retries", "3", "--retry-initial-backoff-ms", "10", policy="round_robin")
    try:
        _wait_idle(workers)
        reqs, aborted = _requests(workers), _aborted(workers)
        r = httpx.post(gw.url + "/generate", timeout=60, json={"input_ids": [3, 1, 4], "sampling_params": LONG})
        assert r.status_code == 504, r.text
        _wait_idle(workers)
        attempts = [b - a for a, b in zip(reqs, _requests(workers))]
        assert sum(attempts) == 3 and all(a >= 1 for a in attempts), attempts  # retried on the other worker
        assert sum(_aborted(workers)) - sum(aborted) == 3  # and every attempt was aborted, none finished
        # a stream is never retried once its 200 is sent: the timeout cuts it, once
        reqs, aborted = _requests(workers), _aborted(workers)
        with httpx.stream("POST", gw.url + "/generate", timeout=60,
                          json={"input_ids": [3, 1, 4], "stream": True, "sampling_params": LONG}) as s:
            assert s.status_code == 200
            events = sse_events(s.iter_lines())
        # smg ends the cut stream with an in-band error of its own
        assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "stream_error", events[-3:]
        _wait_idle(workers)
        assert sum(_requests(workers)) - sum(reqs) == 1 and sum(_aborted(workers)) - sum(aborted) == 1
    finally:
        _stop_gateway(gw)


def test_register_deregister_and_a_worker_killed_mid_stream(workers, tiny_llama_dir, tmp_path_factory):
    victim = ServerProcess(tiny_llama_dir, str(tmp_path_factory.mktemp("victim") / "w.log"), env=ONE_THREAD,
                           new_session=True)
    gw = None
    try:
        gw = _start_gateway(workers[:1], tmp_path_factory, "smg_kill", policy="round_robin")
        victim.wait_ready(STARTUP_S)
        # register through the gateway's worker API; it is probed, then routed to
        assert httpx.post(gw.url + "/workers", json={"url": victim.base}).status_code == 202
        _wait(lambda: httpx.get(gw.url + "/readiness").json().get("healthy_workers") == 2, 60, "registration")
        children = victim.info()["runtime"]["child_pids"].values()
        outcomes: list[str] = []
        seen = [0] * 4  # data events each client has read so far

        def counted(i: int, lines):
            for line in lines:
                seen[i] += line.startswith("data:")
                yield line

        def stream(i: int) -> None:
            try:
                with httpx.stream("POST", gw.url + "/generate", timeout=60,
                                  json={"text": f"kill {i}", "stream": True, "sampling_params": LONG}) as r:
                    events = sse_events(counted(i, r.iter_lines()))
                last = events[-2] if len(events) >= 2 and events[-1] == "[DONE]" else {}
                if "error" in last:
                    outcomes.append("error")  # smg's in-band error after the worker's stream broke
                elif last.get("meta_info", {}).get("finish_reason", {}).get("type") == "length":
                    outcomes.append("complete")
                else:
                    outcomes.append(f"truncated: {events[-2:]}")
            except httpx.HTTPError as e:
                outcomes.append(f"error {type(e).__name__}")
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        v = httpx.Client(base_url=victim.base, timeout=10)
        _wait(lambda: v.get("/get_server_info").json()["num_running_reqs"] == 2, 30, "two streams on the victim")
        # every client is mid-stream (its answer committed, far from its end) before the kill, so the two on the
        # victim can neither finish first nor be retried elsewhere by the gateway
        _wait(lambda: min(seen) >= 2, 30, "every client to read tokens")
        os.killpg(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait()
        for t in threads:
            t.join(120)  # the survivors decode to their end, slower on a loaded machine
            assert not t.is_alive(), "a client of the killed worker hangs"
        # the killed worker's two clients get an error, the other worker's two finish
        assert sorted(o.split(" ")[0] for o in outcomes) == ["complete", "complete", "error", "error"], outcomes
        # a non-streamed request routed to the dead worker fails to connect and is retried
        for i in range(4):
            r = httpx.post(gw.url + "/generate", timeout=60, json={"text": f"after {i}",
                                                                   "sampling_params": {"max_new_tokens": 2}})
            assert r.status_code == 200, r.text
        # deregister it
        wid = next(w["id"] for w in httpx.get(gw.url + "/workers").json()["workers"] if w["url"] == victim.base)
        assert httpx.delete(f"{gw.url}/workers/{wid}").status_code == 202
        _wait(lambda: [w["url"] for w in httpx.get(gw.url + "/workers").json()["workers"]] == [workers[0].base],
              30, "deregistration")
        for pid in children:
            _wait(lambda: not pid_alive(pid), 5, "the killed worker's children to exit")
    finally:
        if gw is not None:
            _stop_gateway(gw)
        if victim.proc.poll() is None:
            victim.stop()
    _wait_idle(workers[:1])


# ---------------------------------------------------------------------------- built-in dispatcher
def test_builtin_dispatcher(workers, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "dispatcher.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "radixlm.srt.fleet.dispatcher", "--port", str(port),
                             "--worker-urls", *[w.base for w in workers]], stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait(lambda: _ok(url + "/health"), 60, "the dispatcher")
        c = httpx.Client(base_url=url, timeout=60)
        assert c.post("/flush_cache").json()["success"] is True
        prefix = "Dispatcher: " + " ".join(f"item {k}" for k in range(60))
        cached = [c.post("/generate", json={"text": f"{prefix} {t}", "sampling_params": {"max_new_tokens": 2}}
                         ).json()["meta_info"]["cached_tokens"] for t in range(3)]
        assert cached[0] == 0 and min(cached[1:]) >= 100, cached  # the prefix stays on one replica
        with c.stream("POST", "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                            "max_tokens": 4, "stream": True}) as r:
            assert sse_events(r.iter_lines())[-1] == "[DONE]"
        assert c.get("/v1/models").json()["data"][0]["id"] == "tiny_llama"
        assert c.get("/server_info").json()["dp_size"] == 2
        # a client that disconnects from the dispatcher is aborted on the replica
        aborted = _aborted(workers)
        s = _raw_post(url, "/generate", {"input_ids": [2, 7, 1], "stream": True, "sampling_params": LONG})
        buf = b""
        while buf.count(b"data:") < 3:
            buf += s.recv(65536)
        s.close()
        _wait_idle(workers)
        assert sum(_aborted(workers)) == sum(aborted) + 1
        # control routes fan out to every replica
        res = c.post("/abort_request", json={"abort_all": True}).json()
        assert res["success"] and len(res["replicas"]) == 2
        assert c.post("/pause_generation", json={}).json()["success"]
        assert all(_info(w)["paused"] for w in workers)
        assert c.post("/continue_generation", json={}).json()["success"]
        assert not any(_info(w)["paused"] for w in workers)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        log.close()


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


# ---------------------------------------------------------------------------- radixlm serve --dp-size
@pytest.mark.parametrize("router", ["smg", "builtin"])
def test_serve_dp_size_two(tiny_llama_dir, tmp_path, router):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "dp.log"
    pids: list[int] = []
    log = open(log_path, "wb")
    proc = subprocess.Popen([sys.executable, "-m", "radixlm", "serve", "--dp-size", "2", "--dp-router", router,
                             "--model-path", tiny_llama_dir, "--dtype", "float32", "--max-total-tokens", "4096",
                             "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT,
                            env=dict(os.environ, HF_HUB_OFFLINE="1"))
    try:
        _wait(lambda: b"radixlm: ready: 2 replicas" in log_path.read_bytes() or proc.poll() is not None, STARTUP_S,
              "the fleet")
        text = log_path.read_text(errors="replace")
        assert proc.poll() is None, text
        replica_urls = re.findall(r"(http://127\.0\.0\.1:\d+) cpus", text)
        router_pid = int(re.search(r"\(pid (\d+)\); replicas", text).group(1))
        assert len(replica_urls) == 2
        out = httpx.post(url + "/generate", timeout=60, json={"text": "dp", "sampling_params": {"max_new_tokens": 3}})
        assert out.status_code == 200 and out.json()["meta_info"]["completion_tokens"] == 3
        # no --served-model-name: the replicas serve the model's own name (the checkpoint directory's),
        # and behind the built-in dispatcher, which lets the replicas check it, its aliases too
        name = os.path.basename(tiny_llama_dir)
        for model in [name] + ([tiny_llama_dir] if router == "builtin" else []):
            chat = httpx.post(url + "/v1/chat/completions", timeout=60,
                              json={"model": model, "messages": [{"role": "user", "content": "dp"}], "max_tokens": 2})
            assert chat.status_code == 200 and chat.json()["model"] == name, chat.text
        pids.append(router_pid)
        cpu_sets = []
        for r in replica_urls:
            info = httpx.get(r + "/get_server_info", timeout=10).json()
            pid = info["runtime"]["pid"]
            pids += [pid, *info["runtime"]["child_pids"].values()]
            cpu_sets.append(os.sched_getaffinity(pid))
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            assert f"OMP_NUM_THREADS={len(cpu_sets[-1])}".encode() in env
            for child in info["runtime"]["child_pids"].values():  # the scheduler runs on the same cores
                assert os.sched_getaffinity(child) == cpu_sets[-1]
        if len(os.sched_getaffinity(0)) >= 2:
            assert not cpu_sets[0] & cpu_sets[1], cpu_sets  # the cores are split, not shared
        if router == "smg":
            assert httpx.get(url + "/readiness").json()["healthy_workers"] == 2
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(30)
        log.close()
    assert rc == 0, log_path.read_text(errors="replace")
    for pid in pids:
        _wait(lambda: not pid_alive(pid), 5, f"pid {pid} to exit with the fleet")

"""Streaming through the real HTTP server: client disconnects abort at once (streaming and
not), 64 concurrent streams equal their non-streaming runs, multi-byte text is never split."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time

import httpx
import pytest

from test.support.sched_policy import fifo_permitted, task_policies
from test.support.server import ServerProcess, assert_idle

LONG = {"max_tokens": 1900, "ignore_eos": True}  # far longer than any test waits


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    srv = ServerProcess(tiny_llama_dir, str(tmp_path_factory.mktemp("http_stream") / "server.log"))
    try:
        srv.wait_ready()
        yield srv
    finally:
        if srv.proc.poll() is None:
            rc, _ = srv.stop()
            assert rc == 0


HANG = 120.0  # seconds after which a wait that should end at once is called a hang (a busy machine is slow)


def _aborted(server: ServerProcess) -> int:
    return server.info()["num_aborted"]


def assert_ended_by_abort(server: ServerProcess, aborted_before: int) -> None:
    """The disconnect aborted the request (it did not run to its end: its max_new_tokens is far
    beyond any wait here) and every KV slot is back; no wall-clock margin, so a busy machine
    passes."""
    assert_idle(server, within=HANG)
    assert _aborted(server) > aborted_before


def _wait_running(server: ServerProcess, n: int = 1, timeout: float = HANG) -> None:
    deadline = time.monotonic() + timeout
    while server.info()["num_running_reqs"] < n:
        assert time.monotonic() < deadline, "the request never started running"
        time.sleep(0.01)


# ---------------------------------------------------------------------------- disconnects
@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "talk"}], "stream": True, **LONG}),
    ("/v1/completions", {"prompt": "talk", "stream": True, "n": 2, **LONG}),
    ("/generate", {"text": "talk", "stream": True, "sampling_params": {"max_new_tokens": 1900, "ignore_eos": True}}),
])
def test_streaming_disconnect_aborts_at_once(server, path, body):
    before = _aborted(server)
    with httpx.Client(base_url=server.base, timeout=30.0) as c:
        with c.stream("POST", path, json=body) as r:
            assert r.status_code == 200
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data: ")
                if seen == 4:
                    break
        # leaving the block unread closes the connection
    assert_ended_by_abort(server, before)


def _raw_post(server: ServerProcess, path: str, body: dict) -> socket.socket:
    payload = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", server.port))
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return s


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "talk"}], **LONG}),
    ("/v1/completions", {"prompt": ["talk", "more"], **LONG}),
    ("/generate", {"text": "talk", "sampling_params": {"max_new_tokens": 1900, "ignore_eos": True}}),
])
def test_non_streaming_disconnect_aborts_at_once(server, path, body):
    before = _aborted(server)
    s = _raw_post(server, path, body)
    _wait_running(server)
    s.close()
    assert_ended_by_abort(server, before)


def test_client_timeout_aborts_non_streaming(server):
    before = _aborted(server)
    with httpx.Client(base_url=server.base, timeout=0.5) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/completions", json={"prompt": "wait for me", **LONG})
    assert_ended_by_abort(server, before)


def test_disconnect_while_waiting_in_queue(server):
    """A request held before admission (generation paused) is dropped too, never admitted later."""
    with httpx.Client(base_url=server.base, timeout=10.0) as c:
        assert c.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
        try:
            s = _raw_post(server, "/generate", {"text": "queued", "sampling_params": {"max_new_tokens": 4}})
            _wait_front(server, "paused", 1)  # held at the front end
            s.close()
            _wait_front(server, "paused", 0)  # dropped there
        finally:
            assert c.post("/continue_generation").status_code == 200
    assert_idle(server, within=HANG)
    assert server.info()["num_waiting_reqs"] == 0


def _wait_front(server: ServerProcess, place: str, n: int) -> None:
    deadline = time.monotonic() + HANG
    while server.info()["front_end"][place] != n:
        assert time.monotonic() < deadline, f"the front end never had {n} request(s) {place}"
        time.sleep(0.01)


# ---------------------------------------------------------------------------- concurrency
PROMPTS = ["The history of Rome", "How vaccines work", "Black holes are", "The French revolution",
           "Photosynthesis is", "Machine learning", "The water cycle", "Plate tectonics move"]


def test_64_concurrent_streams_equal_non_streaming(server):
    params = {"max_tokens": 16, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=server.base, timeout=60.0) as c:
        want = {p: c.post("/v1/completions", json={"prompt": p, **params}).json()["choices"][0]["text"]
                for p in PROMPTS}

    async def one(client: httpx.AsyncClient, prompt: str) -> str:
        text, done = "", False
        async with client.stream("POST", "/v1/completions", json={"prompt": prompt, "stream": True, **params}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    text += json.loads(line[6:])["choices"][0]["text"]
        assert done
        return text

    async def main() -> list[str]:
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
        async with httpx.AsyncClient(base_url=server.base, timeout=120.0, limits=limits) as client:
            return await asyncio.gather(*(one(client, PROMPTS[i % len(PROMPTS)]) for i in range(64)))

    got = asyncio.run(main())
    for i, text in enumerate(got):
        assert text == want[PROMPTS[i % len(PROMPTS)]], i
    assert_idle(server, within=HANG)


# ---------------------------------------------------------------------------- multi-byte text
MULTIBYTE = ["你好，世界！今天天气怎么样？", "🙂🚀 emoji: 🎉🎉", "日本語のテキストを書いてください", "Привет, мир! Ünïcödé"]


@pytest.mark.parametrize("prompt", MULTIBYTE)
def test_multibyte_stream_chunks_are_whole_characters(server, prompt):
    params = {"max_tokens": 48, "temperature": 1.0, "seed": 1234, "ignore_eos": True}
    with httpx.Client(base_url=server.base, timeout=60.0) as c:
        full = c.post("/v1/completions", json={"prompt": prompt, **params}).json()["choices"][0]["text"]
        chunks = []
        with c.stream("POST", "/v1/completions", json={"prompt": prompt, "stream": True, **params}) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:])["choices"][0]["text"])
        chat_chunks = []
        body = {"messages": [{"role": "user", "content": prompt}], "stream": True, **params}
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chat_chunks.append(json.loads(line[6:])["choices"][0]["delta"].get("content") or "")
        chat_full = c.post("/v1/chat/completions", json={**body, "stream": False}).json()
    assert "".join(chunks) == full
    assert "".join(chat_chunks) == chat_full["choices"][0]["message"]["content"]
    for pieces, whole in ((chunks, full), (chat_chunks, chat_full["choices"][0]["message"]["content"])):
        if "\ufffd" not in whole:
            assert not any("\ufffd" in p for p in pieces)


def test_multibyte_outputs_were_exercised(server):
    """The random model does emit non-ASCII text for these prompts (else the test above is moot)."""
    with httpx.Client(base_url=server.base, timeout=60.0) as c:
        texts = [c.post("/v1/completions", json={"prompt": p, "max_tokens": 48, "temperature": 1.0, "seed": 1234,
                                                 "ignore_eos": True}).json()["choices"][0]["text"]
                 for p in MULTIBYTE]
    assert any(ord(ch) > 127 for t in texts for ch in t)


def test_runtime_process_death_stops_the_server(server):
    """Last test of the module: a dead scheduler must not leave a server that hangs every
    request (the crash policy, docs/error_boundary.md): requests in flight are answered with
    a 500 at once, the server exits non-zero, and it still cleans up the other child and the
    IPC directory, so a supervisor can restart it."""
    import threading
    results: dict = {}

    def call(name: str, path: str, body: dict) -> None:
        with httpx.Client(base_url=server.base, timeout=60.0) as c:
            if body.get("stream"):
                with c.stream("POST", path, json=body) as r:
                    results[name] = [line for line in r.iter_lines() if line.startswith("data: ")]
            else:
                results[name] = c.post(path, json=body)
    calls = [threading.Thread(target=call, args=("plain", "/v1/completions", {"prompt": "a", **LONG})),
             threading.Thread(target=call, args=("stream", "/generate", {
                 "text": "b", "stream": True, "sampling_params": {"max_new_tokens": 1900, "ignore_eos": True}}))]
    for t in calls:
        t.start()
    _wait_running(server, 2)
    os.kill(server.runtime["child_pids"]["scheduler"], signal.SIGKILL)
    rc = server.proc.wait(30)
    for t in calls:
        t.join(30)
    assert rc != 0
    server.stop(timeout=30.0)  # asserts: children gone, IPC dir removed
    log = server.log()
    assert "scheduler process exited unexpectedly" in log and "stopped: the scheduler process died" in log
    assert results["plain"].status_code == 500 and "exited unexpectedly" in results["plain"].json()["error"]["message"]
    assert results["stream"][-1] == "data: [DONE]"
    assert json.loads(results["stream"][-2][6:])["error"]["code"] == 500


def test_sigterm_to_the_whole_process_group_is_a_clean_stop(tiny_llama_dir, tmp_path):
    """systemd, docker and `timeout` signal every process of the group: the children exit at
    once, and that must read as the orderly stop it is, not as a crashed runtime."""
    srv = ServerProcess(tiny_llama_dir, str(tmp_path / "server.log"), new_session=True)
    srv.wait_ready()
    os.killpg(srv.proc.pid, signal.SIGTERM)
    rc, _ = srv.stop()  # waits for the exit; asserts children gone and IPC dir removed
    assert rc == 0, srv.log()
    assert "exited unexpectedly" not in srv.log()


def test_a_fifo_server_runs_only_its_loop_thread_real_time(tiny_llama_dir, tmp_path):
    if not fifo_permitted():
        pytest.skip("SCHED_FIFO needs CAP_SYS_NICE or RLIMIT_RTPRIO here")
    srv = ServerProcess(tiny_llama_dir, str(tmp_path / "server.log"), "--scheduler-policy", "fifo")
    try:
        srv.wait_ready()
        body = {"text": "talk", "stream": True, "sampling_params": {"max_new_tokens": 1900, "ignore_eos": True}}
        with httpx.Client(base_url=srv.base, timeout=30.0) as c:
            with c.stream("POST", "/generate", json=body) as r:
                assert r.status_code == 200
                for i, _ in enumerate(r.iter_lines()):
                    if i == 4:
                        break
            policies = task_policies(srv.proc.pid)
        assert_ended_by_abort(srv, 0)  # the disconnect aborted it
        # the event loop (uvicorn's, the main thread) is real-time; the server's other threads
        # (ZMQ I/O, the executor's tokenization) and its children (the forward) are not
        assert policies.pop(srv.proc.pid) == os.SCHED_FIFO
        assert set(policies.values()) == {os.SCHED_OTHER}
        for child in srv.runtime["child_pids"].values():
            assert set(task_policies(child).values()) == {os.SCHED_OTHER}
    finally:
        if srv.proc.poll() is None:
            rc, _ = srv.stop()
            assert rc == 0

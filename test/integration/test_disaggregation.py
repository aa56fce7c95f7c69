"""Prefill/decode disaggregation behind the real SGLang Model Gateway (`smg launch
--pd-disaggregation`): one radixlm prefill server and one radixlm decode server on loopback
(tiny random Llama, float32, one thread each), KV over radixlm's TCP transfer backend.

Greedy outputs through the gateway equal a co-located server's (the prefill server itself,
asked directly without a room, runs a request start to end); streaming; n > 1; a shared prefix
computed once on the prefill side; aborts both ways; both servers' invariants checked after
every scenario and nothing left held."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from test.support.server import ServerProcess, assert_idle, free_port

pytest.importorskip("smg", reason="the smg gateway (dev extra) is not installed")

ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
STARTUP_S = 600.0
TIMEOUT_S = 10  # --disaggregation-transfer-timeout of both servers
PROMPT = "The quick brown fox jumps over the lazy dog because"
GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


class PD:
    def __init__(self, tiny_llama_dir: str, tmp) -> None:
        self.bootstrap_port = free_port()
        # --debug-check-integrity: every pool and tree invariant after every step of both servers
        common = ("--disaggregation-transfer-timeout", str(TIMEOUT_S), "--debug-check-integrity")
        # the prefill server's shorter context makes it refuse what the decode server takes
        self.prefill = ServerProcess(tiny_llama_dir, str(tmp / "prefill.log"), "--disaggregation-mode", "prefill",
                                     "--disaggregation-bootstrap-port", str(self.bootstrap_port),
                                     "--context-length", "1024", *common, env=ONE_THREAD)
        self.decode = ServerProcess(tiny_llama_dir, str(tmp / "decode.log"), "--disaggregation-mode", "decode",
                                    "--context-length", "2048", *common, env=ONE_THREAD)
        self.gateway: subprocess.Popen | None = None
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.gw_log = open(tmp / "smg.log", "wb")

    def start_gateway(self) -> None:
        argv = [sys.executable, "-m", "smg", "launch", "--host", "127.0.0.1", "--port", str(self.port),
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), "--log-level", "warn",
                "--shutdown-grace-period-secs", "2", "--pd-disaggregation",
                "--prefill", self.prefill.base, str(self.bootstrap_port), "--decode", self.decode.base,
                "--policy", "round_robin"]
        self.gateway = subprocess.Popen(argv, stdout=self.gw_log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.gateway.poll() is None, "smg exited"
            try:
                r = httpx.get(self.url + "/readiness", timeout=1.0)
                if r.status_code == 200 and r.json().get("healthy_workers", 0) >= 2:
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.2)
        raise AssertionError("the gateway did not become ready")

    def stop(self) -> None:
        if self.gateway is not None and self.gateway.poll() is None:
            os.kill(self.gateway.pid, signal.SIGTERM)
            try:
                self.gateway.wait(15)
            except subprocess.TimeoutExpired:
                self.gateway.kill()
                self.gateway.wait()
        self.gw_log.close()
        for s in (self.prefill, self.decode):
            if s.proc.poll() is None:
                s.stop()

    def check_clean(self) -> None:
        """Both servers alive (an invariant broken in any step would have ended them), nothing
        runs, waits or holds KV, no room left."""
        for s in (self.prefill, self.decode):
            assert s.proc.poll() is None, s.log()
            assert_idle(s, within=TIMEOUT_S + 10)
            assert s.info()["disaggregation"]["rooms"] == 0

    def transfer(self, side: str) -> dict:
        return (self.prefill if side == "prefill" else self.decode).info()["disaggregation"]


@pytest.fixture(scope="module")
def pd(tiny_llama_dir, tmp_path_factory):
    p = PD(tiny_llama_dir, tmp_path_factory.mktemp("pd"))
    try:
        p.prefill.wait_ready(STARTUP_S)
        p.decode.wait_ready(STARTUP_S)
        p.start_gateway()
        yield p
    finally:
        p.stop()


def _gen(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/generate", json=body, timeout=120.0)


def test_greedy_through_the_gateway_equals_a_co_located_server(pd):
    ref = _gen(pd.prefill.base, text=PROMPT, sampling_params=GREEDY).json()
    before = pd.transfer("decode")
    r = _gen(pd.url, text=PROMPT, sampling_params=GREEDY)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["output_ids"] == ref["output_ids"] and out["text"] == ref["text"]
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    after = pd.transfer("decode")
    assert after["rooms_completed"] == before["rooms_completed"] + 1
    assert after["bytes"] > before["bytes"]
    pd.check_clean()


def _sse(r: httpx.Response) -> list[dict]:
    out = []
    for line in r.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


def test_streaming_n_and_a_shared_prefix_reused_on_the_prefill_side(pd):
    ref = _gen(pd.prefill.base, text=PROMPT, sampling_params=GREEDY).json()
    with httpx.stream("POST", pd.url + "/generate", json={"text": PROMPT, "sampling_params": GREEDY,
                                                          "stream": True}, timeout=120.0) as r:
        assert r.status_code == 200
        events = _sse(r)
    assert events[-1]["output_ids"] == ref["output_ids"] or \
        [t for e in events for t in e.get("output_ids", [])][-len(ref["output_ids"]):] == ref["output_ids"]
    assert events[-1]["text"].endswith(ref["text"][-5:])
    # n > 1: one room for the request, one transfer per child
    outs = _gen(pd.url, text=PROMPT, sampling_params={**GREEDY, "n": 2}).json()
    assert [o["output_ids"] for o in outs] == [ref["output_ids"]] * 2
    # a long shared prefix: computed once on the prefill server, sent for each request
    system = "You are a helpful assistant who answers briefly and precisely. " * 6
    cached_before = pd.prefill.info()["num_cached_tokens"]
    a = _gen(pd.url, text=system + "Question one?", sampling_params=GREEDY).json()
    b = _gen(pd.url, text=system + "Question two?", sampling_params=GREEDY).json()
    assert pd.prefill.info()["num_cached_tokens"] - cached_before >= 40
    for out, q in ((a, "Question one?"), (b, "Question two?")):
        assert out["output_ids"] == _gen(pd.prefill.base, text=system + q, sampling_params=GREEDY).json()["output_ids"]
    # logprobs: the first output token's comes from the prefill server; the prompt's are the
    # prefill server's, merged by the gateway before the decode server's (none) in a non-streamed answer
    lp = _gen(pd.url, text=PROMPT, return_logprob=True, logprob_start_len=0, sampling_params=GREEDY).json()
    ref_lp = _gen(pd.prefill.base, text=PROMPT, return_logprob=True, logprob_start_len=0,
                  sampling_params=GREEDY).json()
    for key in ("output_token_logprobs", "input_token_logprobs"):
        got = [(None if x[0] is None else round(x[0], 4), x[1]) for x in lp["meta_info"][key]]
        want = [(None if x[0] is None else round(x[0], 4), x[1]) for x in ref_lp["meta_info"][key]]
        assert got == want, key
    pd.check_clean()


def test_openai_routes_through_the_gateway_are_disaggregated(pd):
    body = {"model": "tiny_llama", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "n": 2}
    ref = httpx.post(pd.prefill.base + "/v1/completions", json=body, timeout=120.0).json()
    before = pd.transfer("decode")["rooms_completed"]
    out = httpx.post(pd.url + "/v1/completions", json=body, timeout=120.0).json()
    assert [c["text"] for c in out["choices"]] == [c["text"] for c in ref["choices"]]
    chat = {"model": "tiny_llama", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8,
            "temperature": 0}
    ref_chat = httpx.post(pd.prefill.base + "/v1/chat/completions", json=chat, timeout=120.0).json()
    out_chat = httpx.post(pd.url + "/v1/chat/completions", json=chat, timeout=120.0).json()
    assert out_chat["choices"][0]["message"]["content"] == ref_chat["choices"][0]["message"]["content"]
    assert pd.transfer("decode")["rooms_completed"] == before + 3  # 2 choices + 1
    pd.check_clean()


def test_client_disconnect_and_abort_request_on_the_decode_side(pd):
    long = {"temperature": 0, "max_new_tokens": 900, "ignore_eos": True}  # fits both contexts
    before = pd.transfer("decode")["rooms_completed"]
    with httpx.stream("POST", pd.url + "/generate", json={"text": PROMPT, "sampling_params": long, "stream": True},
                      timeout=120.0) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # the first tokens came: the transfer is done; now the client goes
    pd.check_clean()  # the decode server aborted it (disconnect) and reclaimed its KV
    assert pd.transfer("decode")["rooms_completed"] == before + 1
    # /abort_request on the decode server while it decodes: the answer is an abort, not length
    import threading
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(r=_gen(pd.url, text=PROMPT, rid="abort-me",
                                                                sampling_params=long)))
    t.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and pd.decode.info()["num_running_reqs"] == 0:
        time.sleep(0.05)
    assert httpx.post(pd.decode.base + "/abort_request", json={"rid": "abort-me"}, timeout=10).status_code == 200
    t.join(60)
    out = result["r"].json()
    assert out["meta_info"]["finish_reason"]["type"] == "abort", out
    pd.check_clean()


def test_a_prompt_the_prefill_server_refuses_is_answered_at_once_not_after_a_timeout(pd):
    """The prefill server refuses (400) a request the decode server accepted: its rooms are
    answered with that error at once, so the decode server answers too, with the abort and
    its status, and nothing waits for the transfer timeout."""
    before = pd.transfer("decode")
    t0 = time.monotonic()
    r = _gen(pd.url, text=PROMPT, sampling_params={**GREEDY, "max_new_tokens": 1500})  # fits 2048, not 1024
    assert r.status_code == 400, r.text
    assert time.monotonic() - t0 < TIMEOUT_S
    pd.check_clean()
    after = pd.transfer("decode")
    assert after["rooms_completed"] == before["rooms_completed"]
    # ended by the prefill server's ABORT, or by the gateway dropping the decode leg on the 400
    assert after["rooms_aborted_by_peer"] + after["rooms_aborted"] > before["rooms_aborted_by_peer"] + \
        before["rooms_aborted"]
    # straight to the decode server, no gateway: the prefill server's refusal is what ends it
    prefill_refuses = {"text": PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": 1500},
                       "bootstrap_host": "127.0.0.1", "bootstrap_port": pd.bootstrap_port, "bootstrap_room": 4242}
    assert _gen(pd.prefill.base, **prefill_refuses).status_code == 400
    t0 = time.monotonic()
    r = _gen(pd.decode.base, **prefill_refuses)
    assert time.monotonic() - t0 < TIMEOUT_S
    out = r.json()
    assert r.status_code == 400 and "context length" in r.text, r.text
    assert pd.transfer("decode")["rooms_aborted_by_peer"] == after["rooms_aborted_by_peer"] + 1, out
    pd.check_clean()


@pytest.mark.slow  # waits out the transfer timeout (10 s)
def test_a_killed_prefill_server_ends_everything_on_the_decode_side(pd):
    """Last in the module: the prefill server dies (SIGKILL). Through the gateway the prefill leg
    fails to connect and the gateway drops both legs (the decode server aborts its side); a
    room sent straight to the decode server that names the dead prefill server times out and is
    answered 503, its slots reclaimed: nothing waits forever."""
    import shutil

    from test.support.server import pid_alive
    os.kill(pd.prefill.proc.pid, signal.SIGKILL)
    pd.prefill.proc.wait()
    for pid in pd.prefill.runtime.get("child_pids", {}).values():  # they die with their parent
        deadline = time.monotonic() + 10
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
    shutil.rmtree(pd.prefill.runtime.get("ipc_dir", ""), ignore_errors=True)
    r = _gen(pd.url, text=PROMPT, sampling_params=GREEDY)
    assert r.status_code >= 500, r.text
    t0 = time.monotonic()
    r = _gen(pd.decode.base, text=PROMPT, sampling_params=GREEDY, bootstrap_host="127.0.0.1",
             bootstrap_port=pd.bootstrap_port, bootstrap_room=12345)
    waited = time.monotonic() - t0
    assert r.status_code == 503, r.text
    assert "timed out" in r.text and TIMEOUT_S - 1 <= waited < TIMEOUT_S + 30
    assert pd.decode.proc.poll() is None
    assert_idle(pd.decode, within=60)
    assert pd.transfer("decode")["rooms_timed_out"] >= 1

"""The caller's side of the cancel chain over HTTP (the Engine side is
test_cancel_chain.py): `/abort_request` and client disconnects reach a request's own family
only, the weight-lock wait, duplicates behind the lock, pause -> update -> continue,
tombstones and counts, answers while the scheduler is frozen, and SIGTERM answering every
caller with 503."""
from __future__ import annotations

import os
import signal
import threading

import httpx
import pytest

from radixlm.srt.weight_serialization import serialize_named_tensors
from test.support.http_calls import (TIMEOUT, Call, abort, fresh_prompt, generate_body, pause, resume,
                                     server_info, terminal_result, wait_info)
from test.support.server import ServerProcess

LONG = {"max_new_tokens": 1500, "temperature": 0, "ignore_eos": True}
USER_ABORT = {"type": "abort", "message": "Aborted by the client", "status_code": 200}


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    srv = ServerProcess(tiny_llama_dir, str(tmp_path_factory.mktemp("cancel_chain") / "server.log"),
                        "--debug-check-integrity")
    try:
        srv.wait_ready()
        srv.client = httpx.Client(base_url=srv.base, timeout=TIMEOUT)
        yield srv
    finally:
        if getattr(srv, "client", None) is not None:
            srv.client.close()
        if srv.proc.poll() is None:
            srv.stop()


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.base, timeout=TIMEOUT) as c:
        yield c


def wait_front(server, key: str, n: int, what: str) -> None:
    """Until the front end's `key` place counter is n."""
    wait_info(server, lambda i: i["front_end"][key] == n, what)


def idle(server) -> None:
    wait_info(server, lambda i: i["num_running_reqs"] == 0 and i["num_waiting_reqs"] == 0
              and i["memory"]["protected"] == 0, "idle")
    wait_front(server, "sent", 0, "nothing sent")
    wait_front(server, "draining", 0, "nothing draining")


class Post(threading.Thread):
    """A blocking POST on a thread (for a call that waits on the server)."""

    def __init__(self, server, path: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.body, self.response, self.error = server.base + path, body, None, None
        self.start()

    def run(self) -> None:
        try:
            self.response = httpx.post(self.url, json=self.body, timeout=TIMEOUT)
        except httpx.HTTPError as e:
            self.error = e


def update_body(server) -> dict:
    """An update of one small tensor to its own values: a real update that changes nothing."""
    import torch
    w = server.client.post("/get_weights_by_name", json={"name": "model.norm.weight", "truncate_size": 10 ** 6})
    return {"serialized_named_tensors": serialize_named_tensors({"model.norm.weight": torch.tensor(w.json())})}


def behind_the_lock(server, rid: str) -> tuple[Call, Post, Call]:
    """A runs (holds the read side), an update waits for A, `rid` waits for the update."""
    a = Call(server, generate_body(f"{rid}-A", fresh_prompt(8), LONG, True))
    a.wait_events(1)
    update = Post(server, "/update_weights_from_tensor", update_body(server))
    wait_front(server, "writers_waiting", 1, "the update waits for A")
    b = Call(server, generate_body(rid, fresh_prompt(8), {"max_new_tokens": 5, "temperature": 0}, False))
    wait_front(server, "weight_lock", 1, "waiting for the weight lock")
    return a, update, b


def test_abort_and_disconnect_reach_the_family_never_a_lookalike(server, http):
    job, lookalike = (Call(server, generate_body(r, fresh_prompt(8), LONG, True)) for r in ("hjob", "hjob_1"))
    fam = Call(server, generate_body("hfam", fresh_prompt(8), {**LONG, "n": 2}, True))
    wait_info(server, lambda i: i["num_running_reqs"] == 4, "all running")
    pause(http)
    try:
        assert abort(http, "hjob") == 1
        assert abort(http, "hfam") == 2
        assert terminal_result(job)["meta_info"]["finish_reason"] == USER_ABORT
        fam.finish()
        finals = [e for e in fam.events()[:-1] if e["meta_info"]["finish_reason"] is not None]
        assert sorted(e["index"] for e in finals) == [0, 1]
        wait_front(server, "sent", 1, "the look-alike runs on")
    finally:
        resume(http)
    gone = Call(server, generate_body("hjob", fresh_prompt(8), LONG, True))
    gone.wait_events(2)
    gone.close()  # the client hangs up: its own request only is aborted
    wait_info(server, lambda i: i["num_running_reqs"] == 1, "the disconnect")
    assert abort(http, "hjob_1") == 1
    assert terminal_result(lookalike)["meta_info"]["finish_reason"] == USER_ABORT
    idle(server)


def test_a_request_waiting_for_the_weight_lock_is_aborted(server, http):
    a, update, b = behind_the_lock(server, "hlock")
    assert abort(http, "hlock") == 1
    out = terminal_result(b)
    assert out["meta_info"]["finish_reason"] == USER_ABORT and out["output_ids"] == []
    a.close()
    update.join(TIMEOUT)
    assert update.response is not None and update.response.status_code == 200, update.response
    idle(server)


def test_a_duplicate_rid_behind_the_lock_is_refused_at_once(server, http):
    a, update, b = behind_the_lock(server, "hdup")
    r = http.post("/generate", json=generate_body("hdup", fresh_prompt(4), {"max_new_tokens": 2}, False),
                  timeout=TIMEOUT)
    assert r.status_code == 400 and "duplicate request id" in r.json()["error"]["message"]
    a.close()
    update.join(TIMEOUT)
    out = terminal_result(b)  # the first one is whole
    assert out["meta_info"]["finish_reason"]["type"] == "length" and len(out["output_ids"]) == 5
    idle(server)


def test_a_paused_server_applies_a_weight_update_at_once(server, http):
    call = Call(server, generate_body("hpaused", fresh_prompt(8), {**LONG, "max_new_tokens": 120}, True))
    call.wait_events(3)
    pause(http)
    try:
        r = http.post("/update_weights_from_tensor", json={**update_body(server), "weight_version": "hv2"},
                      timeout=TIMEOUT)
        assert r.status_code == 200 and r.json()["weight_version"] == "hv2"
    finally:
        resume(http)
    final = terminal_result(call)["meta_info"]
    assert final["finish_reason"]["type"] == "length"
    assert [v for v, _ in final["weight_versions"]][-1] == "hv2" and len(final["weight_versions"]) == 2
    idle(server)


def test_an_abort_before_the_request_arrives_is_applied(server, http):
    assert abort(http, "hlater") == 0  # hit nothing now; kept as a tombstone
    r = http.post("/generate", json=generate_body("hlater", fresh_prompt(4), {"max_new_tokens": 4}, False))
    assert r.status_code == 200
    assert r.json()["meta_info"]["finish_reason"] == USER_ABORT and r.json()["output_ids"] == []
    r = http.post("/generate", json=generate_body("hlater", fresh_prompt(4), {"max_new_tokens": 4}, False))
    assert r.json()["meta_info"]["finish_reason"]["type"] == "length"
    idle(server)


def test_the_caller_is_answered_while_the_scheduler_is_frozen(server, http):
    pid = server.runtime["child_pids"]["scheduler"]
    stream = Call(server, generate_body("hfrozen", fresh_prompt(8), LONG, True))
    plain = Call(server, generate_body("hfrozen-json", fresh_prompt(8), LONG, False))
    stream.wait_events(3)
    wait_info(server, lambda i: i["num_running_reqs"] == 2, "both running")
    os.kill(pid, signal.SIGSTOP)
    try:
        # /get_server_info would wait for the scheduler: only the front end answers now
        assert abort(http, "hfrozen") == 1 and abort(http, "hfrozen-json") == 1
        final = terminal_result(stream)
        assert final["meta_info"]["finish_reason"] == USER_ABORT and len(final["output_ids"]) >= 3
        out = terminal_result(plain)
        assert out["meta_info"]["finish_reason"] == USER_ABORT
    finally:
        os.kill(pid, signal.SIGCONT)
    idle(server)
    info = server_info(server)
    assert {r.split("#")[0] for r, *_ in info["recent_cancels"]} >= {"hfrozen", "hfrozen-json"}


def test_sigterm_answers_every_caller_with_503(server):
    """Last test of the module: a running request and one behind the weight lock."""
    a, _update, b = behind_the_lock(server, "hterm")
    plain = Call(server, generate_body("hterm-json", fresh_prompt(8), LONG, False))
    wait_front(server, "weight_lock", 2, "two behind the lock")
    server.client.close()
    rc, _ = server.stop(timeout=60)  # (an idle server takes ~15 s on a loaded 2-core machine)
    assert rc == 0
    for call in (b, plain):
        status, body = call.finish()
        assert status == 503 and b"shutting down" in body, (status, body)
    a.finish()
    events = a.events()
    assert events[-1] == "[DONE]" and "shutting down" in events[-2]["error"]["message"]

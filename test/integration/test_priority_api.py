"""Priority scheduling through the Engine and the HTTP server (tiny random Llama, float32): a
high-priority request preempts a running low one (one running slot), the low one's greedy
output is the same as alone; `priority` on /generate and the OpenAI routes; per-priority
counts in server info (their /metrics rendering: test/unit/scheduler/test_priority.py)."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from radixlm import Engine
from radixlm.messages import ContinueReq, PauseReq
from test.support.server import serving

LOW_PROMPT = [5, 17, 99, 4, 250, 31, 7, 8, 1000, 12]
HIGH_PROMPT = [9, 9, 401, 33, 2, 70]
GREEDY = {"temperature": 0, "ignore_eos": True}


def _wait_for(cond, what: str, limit_s: float = 120.0) -> None:
    """Poll a condition of the server's state (no timing margin: the limit only ends a hang)."""
    end = time.monotonic() + limit_s
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"never: {what}")
        time.sleep(0.005)


def test_engine_preempts_for_a_higher_priority_and_keeps_outputs(tiny_llama_dir):
    with Engine(model_path=tiny_llama_dir, dtype="float32", max_total_tokens=4096, max_running_requests=1,
                enable_priority_scheduling=True, debug_check_integrity=True) as eng:
        alone = eng.generate(input_ids=LOW_PROMPT, sampling_params={"max_new_tokens": 40, **GREEDY})
        high_alone = eng.generate(input_ids=HIGH_PROMPT, sampling_params={"max_new_tokens": 4, **GREEDY},
                                  priority=50)
        order: list[str] = []
        results: dict[str, dict] = {}
        low = eng.generate(input_ids=LOW_PROMPT, sampling_params={"max_new_tokens": 40, **GREEDY},
                           priority=0, stream=True)
        first = next(low)  # running now
        # hold it running while the high one arrives: the scheduler only (the front end's pause
        # would hold the high one back too)
        eng._call(eng.tokenizer_manager.rpc(PauseReq(mode="in_place")))

        def high() -> None:
            results["high"] = eng.generate(input_ids=HIGH_PROMPT, sampling_params={"max_new_tokens": 4, **GREEDY},
                                           priority=50)
            order.append("high")

        t = threading.Thread(target=high)
        t.start()
        _wait_for(lambda: eng.get_server_info()["priority"]["queued"] == {"50": 1}, "the high one queued")
        info = eng.get_server_info()["priority"]
        assert info["running"] == {"0": 1}
        eng._call(eng.tokenizer_manager.rpc(ContinueReq()))
        streamed = list(first["output_ids"])
        for chunk in low:
            streamed += chunk["output_ids"]  # each chunk carries its new tokens
        order.append("low")
        t.join()
        assert order == ["high", "low"]
        assert streamed == alone["output_ids"]  # resumed after its preemption, exactly
        assert results["high"]["output_ids"] == high_alone["output_ids"]
        info = eng.get_server_info()
        assert info["priority"]["preempted_total"] == {"0": 1} and info["num_retractions"] == 1
        with pytest.raises(ValueError, match="priority must be an integer"):
            eng.generate(input_ids=HIGH_PROMPT, sampling_params={"max_new_tokens": 1}, priority="high")
        # sessions through the Engine: the second turn continues from the first's KV
        sid = eng.open_session(500)
        sp = {"max_new_tokens": 5, **GREEDY}
        one = eng.generate(input_ids=LOW_PROMPT, sampling_params=sp, rid="e1", session_params={"id": sid})
        two = eng.generate(input_ids=HIGH_PROMPT, sampling_params=sp, session_params={"id": sid, "rid": "e1"})
        history = LOW_PROMPT + one["output_ids"] + HIGH_PROMPT
        assert two["meta_info"]["cached_tokens"] == len(LOW_PROMPT) + 5 - 1
        assert two["output_ids"] == eng.generate(input_ids=history, sampling_params=sp)["output_ids"]
        eng.close_session(sid)
        with pytest.raises(ValueError, match="not open"):
            eng.close_session(sid)
        with pytest.raises(ValueError, match="session_params.offset"):
            eng.generate(input_ids=HIGH_PROMPT, session_params={"id": sid, "offset": -1})
        eng.check_integrity()
        assert eng.get_server_info()["sessions"]["held_tokens"] == 0


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("prio") / "server.log")
    with serving(tiny_llama_dir, log, "--enable-priority-scheduling", "--schedule-low-priority-values-first",
                 "--default-priority", "3", "--priority-scheduling-preemption-threshold", "2") as srv:
        yield srv


def test_http_priority_fields_and_metrics(server):
    with httpx.Client(base_url=server.base, timeout=60.0) as http:
        r = http.post("/generate", json={"input_ids": LOW_PROMPT, "priority": 1,
                                         "sampling_params": {"max_new_tokens": 2, **GREEDY}})
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 2
        r = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2, "priority": 7})
        assert r.status_code == 200
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                    "max_tokens": 2, "priority": -2})
        assert r.status_code == 200
        for path, body in (("/generate", {"input_ids": LOW_PROMPT, "priority": "urgent"}),
                           ("/v1/completions", {"prompt": "x", "max_tokens": 1, "priority": 1.5})):
            r = http.post(path, json=body)
            assert r.status_code == 400 and "priority" in r.text, (path, r.text)
        info = server.info()
        assert info["server_args"]["enable_priority_scheduling"] is True
        assert info["server_args"]["priority_scheduling_preemption_threshold"] == 2
        assert info["priority"]["preempted_total"] == {} and info["priority"]["queued"] == {}
        assert "radixlm:priority_requests" in http.get("/metrics").text


def test_http_sessions(server):
    """/open_session, turns with session_params on /generate, /close_session (the same server:
    sessions do not depend on priority scheduling)."""
    with httpx.Client(base_url=server.base, timeout=60.0) as http:
        r = http.post("/open_session", json={"capacity_of_str_len": 1000, "timeout": 600.0})
        assert r.status_code == 200
        sid = r.json()
        assert isinstance(sid, str) and sid
        assert http.post("/open_session", json={"capacity_of_str_len": 1000, "session_id": sid}).status_code == 400
        assert http.post("/open_session", json={"capacity_of_str_len": 0}).status_code == 400
        sp = {"max_new_tokens": 6, **GREEDY}
        one = http.post("/generate", json={"input_ids": LOW_PROMPT, "rid": "turn-1", "sampling_params": sp,
                                           "session_params": {"id": sid}}).json()
        two = http.post("/generate", json={"input_ids": HIGH_PROMPT, "rid": "turn-2", "sampling_params": sp,
                                           "session_params": {"id": sid, "rid": "turn-1"}}).json()
        assert "meta_info" in one and "meta_info" in two, (one, two)
        history = LOW_PROMPT + one["output_ids"] + HIGH_PROMPT
        assert two["meta_info"]["prompt_tokens"] == len(history)
        assert two["meta_info"]["cached_tokens"] == len(LOW_PROMPT) + 6 - 1  # the session's KV
        plain = http.post("/generate", json={"input_ids": history, "sampling_params": sp}).json()
        assert two["output_ids"] == plain["output_ids"]
        assert server.info()["sessions"]["open"] == 1
        bad = http.post("/generate", json={"input_ids": HIGH_PROMPT, "sampling_params": sp,
                                           "session_params": {"id": sid, "rid": "no-such-turn"}})
        assert bad.status_code == 400 and "does not exist" in bad.text
        bad = http.post("/generate", json={"input_ids": HIGH_PROMPT, "session_params": {"id": sid, "bogus": 1}})
        assert bad.status_code == 400 and "bogus" in bad.text
        assert http.post("/close_session", json={"session_id": sid}).status_code == 200
        assert http.post("/close_session", json={"session_id": sid}).status_code == 400
        info = server.info()
        assert info["sessions"] == {"open": 0, "held_tokens": 0, "turns_from_held_kv": 1}
        after = http.post("/generate", json={"input_ids": HIGH_PROMPT, "sampling_params": sp,
                                             "session_params": {"id": sid, "rid": "turn-1"}})
        assert after.status_code == 400 and "not open" in after.text

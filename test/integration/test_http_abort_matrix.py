"""The abort matrix over HTTP: every state a request can be in (semantics §1) × every
HTTP way to stop it (`POST /abort_request` for a streaming and a non-streaming request, and the
client closing the socket of either), on a real server with the tiny model, overlap off and on.

Each cell pins the victim in its state with the server's own mechanisms, checks that the
server really has it there (`/get_server_info`), applies the entry, and asserts:
- exactly one terminal response: a stream ends once, with the one final chunk then `[DONE]`;
  a non-streaming call gets one JSON; for a disconnect the scheduler records exactly one abort,
  in the place the request was (`aborts_<place>`);
- `finish_reason == {"type": "abort", "message": "Aborted by the client", "status_code": 200}`
  with the output generated so far (a prefix of the undisturbed greedy output; a retracted
  request keeps what it produced before the retraction, `num_retractions` says so);
- pool conservation: the server runs with `--debug-check-integrity` (any violation raises in
  the scheduler), and once idle no KV is held by requests, `free + evictable == capacity`,
  and after a flush `free == capacity`; the computed chunks of an aborted chunked prefill
  stay as evictable cache, and resubmitting the prompt reuses exactly them;
- no ERROR or traceback in the server's log; the rid is free again at once.

How states are pinned (no debug hook needed). `/pause_generation in_place` freezes the
scheduler with every request where it is, and holds new requests in the tokenizer manager
(`num_tokenizing_reqs`, added to /get_server_info for this); a victim sent while paused starts
exactly when `/continue_generation` releases it.
- tokenizing: held while paused;
- waiting: two long requests fill `--max-running-requests 2`; the victim queues behind them;
- chunked prefill at chunk k: a 240-token prompt with `--chunked-prefill-size 2`, paused in
  place mid-prefill (`chunked`), or stopped while it keeps chunking (`chunked_live`: with
  overlap on, the chunk is then in the launched batch, `aborts_in_flight`);
- running decode: paused in place (`running`), or stopped while decoding (`running_live`:
  with overlap on the request is then in the launched batch, `aborts_in_flight`);
- retracted and waiting: two requests decode into a 256-token pool until the younger one is
  retracted (`--schedule-conservativeness 0.05` overcommits admission), then paused in place;
- just finished: the entry comes once the final output is out: nothing is aborted;
- unknown rid: a no-op that hits nothing, not even a running rid it is a prefix of.
Overlap off and on each get a server; a state runs in both modes where overlap changes where
the request is. The moments that depend on timing (mid-prefill, before the blockers or the
retraction move on) are verified after the fact and retried with a fresh request when
missed, so no assertion depends on timing. The OpenAI endpoints get the running cell too.
"""
from __future__ import annotations

import json
import random

import httpx
import pytest

from test.support.http_calls import (TIMEOUT, Call, abort, fresh_prompt, fresh_rid, generate_body, pause, resume,
                                     server_info, terminal_result, wait_info)
from test.support.server import ServerProcess

POOL = 256
CHUNK = 2
MATRIX_ARGS = ("--max-total-tokens", str(POOL), "--max-running-requests", "2", "--chunked-prefill-size", str(CHUNK),
               "--schedule-conservativeness", "0.05", "--debug-check-integrity",
               "--attention-backend", "torch_native")  # the abort path, not kernels, is under test
USER_ABORT = {"type": "abort", "message": "Aborted by the client", "status_code": 200}
PLACES = ("waiting", "chunked", "running", "in_flight", "grammar")
ENTRIES = ("abort_stream", "abort_json", "disconnect_stream", "disconnect_json")
LONG_PROMPT = 240  # fits the pool with room to spare: 120 chunks
# Long decodes. Admission needs prompt + max_new_tokens free, and reserves only
# new_token_ratio (0.035 here; 1 with ignore_eos) of the rest of each running request, so two
# of these are admitted together, and two decoding together outgrow the pool (a retraction at
# ~120 tokens each). min_new_tokens keeps EOS out without ignore_eos.
FOREVER = {"max_new_tokens": 150, "min_new_tokens": 150, "temperature": 0}
# Retraction: `first` runs, the victim joins it (admitted while `first` has < ~50 tokens),
# together they outgrow the pool at ~120 tokens each, the victim (fewer tokens) is retracted.
# It then stays waiting: `first` now reserves ~(its output + 20) tokens, more than the pool
# has left for the victim. `first` outlives the retraction by ~120 tokens (then it fills the
# pool alone and would be aborted "out of memory"; the cell pauses long before).
FIRST = {"max_new_tokens": 1000, "min_new_tokens": 1000, "temperature": 0}
ATTEMPTS = 4


# ---------------------------------------------------------------------------- servers
def _start(tiny_llama_dir, tmp_path_factory, overlap: bool):
    extra = "--enable-overlap-schedule" if overlap else "--disable-overlap-schedule"
    with pytest.MonkeyPatch.context() as mp:
        # One torch thread: all the tiny model can use, and with other work on the machine,
        # spinning OpenMP threads made some decode steps 100x slower.
        mp.setenv("OMP_NUM_THREADS", "1")
        srv = ServerProcess(tiny_llama_dir, str(tmp_path_factory.mktemp("abort_matrix") / "server.log"),
                            *MATRIX_ARGS, extra)
    try:
        srv.wait_ready()
        srv.overlap = overlap
        srv.client = httpx.Client(base_url=srv.base, timeout=TIMEOUT)
        assert server_info(srv)["overlap"] is overlap
        yield srv
    finally:
        if getattr(srv, "client", None) is not None:
            srv.client.close()
        if srv.proc.poll() is None:
            rc, _ = srv.stop()
            assert rc == 0
    assert_clean_log(srv, 0)


@pytest.fixture(scope="module")
def server_overlap_off(tiny_llama_dir, tmp_path_factory):
    yield from _start(tiny_llama_dir, tmp_path_factory, overlap=False)


@pytest.fixture(scope="module")
def server_overlap_on(tiny_llama_dir, tmp_path_factory):
    yield from _start(tiny_llama_dir, tmp_path_factory, overlap=True)


@pytest.fixture
def server(request, mode):
    return request.getfixturevalue(f"server_{mode}")


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.base, timeout=TIMEOUT) as c:
        yield c


def counters(info: dict) -> dict:
    return {"num_aborted": info["num_aborted"], "num_finished": info["num_finished"],
            "taken_back": info["num_batches_taken_back"], **{p: info[f"aborts_{p}"] for p in PLACES}}


def requests_received(http: httpx.Client) -> float:
    line = [ln for ln in http.get("/metrics").text.splitlines() if ln.startswith("radixlm:num_requests_total")]
    return float(line[0].split()[-1])


def assert_clean_log(server: ServerProcess, start: int) -> None:
    """No error and no traceback in what the server (and its children) logged since `start`."""
    log = server.log()[start:]
    assert "Traceback" not in log and " ERROR " not in log, log


def is_idle(info: dict) -> bool:
    mem = info["memory"]
    return (info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0 and info["num_tokenizing_reqs"] == 0
            and mem["protected"] == 0 and mem["free"] + mem["evictable"] == mem["capacity"])


def settle(server: ServerProcess, http: httpx.Client) -> dict:
    """Idle (no request holds KV: free + evictable == capacity), then flushed back to the
    fresh server's figures. Returns the idle info before the flush."""
    info = wait_info(server, is_idle, "idle")
    assert info["memory"]["capacity"] == POOL and not info["paused"] and not info["tokenizer_paused"]
    assert http.post("/flush_cache").status_code == 200
    mem = server_info(server)["memory"]
    assert mem == {"capacity": POOL, "free": POOL, "evictable": 0, "protected": 0}, mem
    return info


def greedy(http: httpx.Client, prompt: list[int], n: int) -> list[int]:
    if n == 0:
        return []
    out = http.post("/generate", json=generate_body(fresh_rid("ref-"), prompt,
                                                    {"max_new_tokens": n, "min_new_tokens": n, "temperature": 0},
                                                    stream=False))
    assert out.status_code == 200, out.text
    return out.json()["output_ids"]


class Missed(Exception):
    """A timing-based pin missed its moment (verified, not assumed): retry with a new request."""


# ---------------------------------------------------------------------------- states
class Cell:
    """What one matrix cell started: its calls (victim first) and whether it paused the
    server; `cleanup` undoes both whatever happened."""

    def __init__(self, server: ServerProcess, http: httpx.Client) -> None:
        self.server, self.http = server, http
        self.calls: list[Call] = []
        self.paused = False
        self.victim: Call | None = None
        self.prompt: list[int] = []
        self.place: str | None = None  # where the scheduler has the victim; None: not sent
        self.retracted = False

    def call(self, body: dict) -> Call:
        c = Call(self.server, body)
        self.calls.append(c)
        return c

    def pause(self) -> None:
        self.paused = True
        pause(self.http)

    def resume(self) -> None:
        if self.paused:
            resume(self.http)
            self.paused = False

    def cleanup(self, check: bool) -> None:
        """Unpause, abort what is still open; with `check`, each of those ends in exactly one
        terminal abort too."""
        self.resume()
        for c in self.calls:
            if c.closed:
                continue
            if c.rid:
                abort(self.http, c.rid)
            if check:
                assert terminal_result(c)["meta_info"]["finish_reason"] == USER_ABORT
            c.close()


def pin_tokenizing(cell: Cell, rid: str, stream: bool) -> None:
    cell.pause()
    cell.prompt = fresh_prompt(12)
    cell.victim = cell.call(generate_body(rid, cell.prompt, {"max_new_tokens": 8}, stream))
    info = wait_info(cell.server, lambda i: i["num_tokenizing_reqs"] == 1, "held in the tokenizer manager")
    assert info["num_waiting_reqs"] == 0 and info["num_running_reqs"] == 0


def _send_held(cell: Cell, body: dict) -> Call:
    """Send `body` while generation is paused: the request waits in the tokenizer manager, and
    `cell.resume()` later releases it into a scheduler that is exactly where it was."""
    cell.pause()
    call = cell.call(body)
    wait_info(cell.server, lambda i: i["num_tokenizing_reqs"] == 1, "held in the tokenizer manager")
    return call


def pin_waiting(cell: Cell, rid: str, stream: bool) -> None:
    for i in range(2):
        cell.call(generate_body(f"{rid}-blocker{i}", fresh_prompt(6), FOREVER, True)).wait_events(1)
    cell.prompt = fresh_prompt(12)
    cell.victim = _send_held(cell, generate_body(rid, cell.prompt, {"max_new_tokens": 8}, stream))
    base = server_info(cell.server)
    cell.resume()
    wait_info(cell.server, lambda i: i["num_waiting_reqs"] == 1, "queued behind max_running_requests")
    cell.pause()
    info = server_info(cell.server)
    # (the blockers retract each other after ~120 tokens; the pause comes long before)
    if not (info["num_running_reqs"] == 2 and info["num_waiting_reqs"] == 1
            and info["num_retractions"] == base["num_retractions"]):
        raise Missed(f"not pinned in the waiting queue: {info}")
    cell.place = "waiting"


def _pin_chunked(cell: Cell, rid: str, stream: bool, live: bool) -> None:
    base = server_info(cell.server)
    cell.prompt = fresh_prompt(LONG_PROMPT)
    # Held first, so its prefill starts when we say: the whole prefill (120 chunks) is then
    # the window for what follows.
    cell.victim = _send_held(cell, generate_body(rid, cell.prompt, {"max_new_tokens": 4}, stream))
    cell.resume()
    wait_info(cell.server, lambda i: i["num_prefill_tokens"] > base["num_prefill_tokens"], "prefill started")
    if live:  # chunks keep running; with overlap on, the one in flight holds the request
        cell.place = "in_flight" if cell.server.overlap else "chunked"
        return
    cell.pause()
    info = server_info(cell.server)
    done = info["num_prefill_tokens"] - base["num_prefill_tokens"]
    if not (info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 1 and 0 < done < LONG_PROMPT):
        raise Missed(f"paused after {done} of {LONG_PROMPT} prompt tokens: {info}")
    cell.place = "chunked"


def pin_chunked(cell: Cell, rid: str, stream: bool) -> None:
    _pin_chunked(cell, rid, stream, live=False)


def pin_chunked_live(cell: Cell, rid: str, stream: bool) -> None:
    _pin_chunked(cell, rid, stream, live=True)


def _pin_running(cell: Cell, rid: str, stream: bool, live: bool) -> None:
    base = server_info(cell.server)
    cell.prompt = fresh_prompt(12)
    cell.victim = cell.call(generate_body(rid, cell.prompt, FOREVER, stream))
    wait_info(cell.server, lambda i: i["num_running_reqs"] == 1
              and i["num_decode_tokens"] >= base["num_decode_tokens"] + 3, "decoding")
    if live:  # with overlap on, a decoding request is inside the launched batch (or the abort
        # takes that batch back before it starts: _run_cell accepts either)
        cell.place = "in_flight" if cell.server.overlap else "running"
        return
    cell.pause()
    assert server_info(cell.server)["num_running_reqs"] == 1
    cell.place = "running"


def pin_running(cell: Cell, rid: str, stream: bool) -> None:
    _pin_running(cell, rid, stream, live=False)


def pin_running_live(cell: Cell, rid: str, stream: bool) -> None:
    _pin_running(cell, rid, stream, live=True)


def pin_retracted(cell: Cell, rid: str, stream: bool) -> None:
    # `first` is admitted first and so is ahead in output: the victim is the one retracted
    cell.call(generate_body(f"{rid}-first", fresh_prompt(8), FIRST, True)).wait_events(1)
    cell.prompt = fresh_prompt(8)
    cell.victim = _send_held(cell, generate_body(rid, cell.prompt, FOREVER, stream))
    base = server_info(cell.server)
    cell.resume()
    wait_info(cell.server, lambda i: i["num_retractions"] > base["num_retractions"], "retraction")
    cell.pause()
    info = server_info(cell.server)
    if not (info["num_retractions"] == base["num_retractions"] + 1 and info["num_running_reqs"] == 1
            and info["num_waiting_reqs"] == 1):
        raise Missed(f"not pinned retracted-and-waiting: {info}")
    cell.place = "waiting"
    cell.retracted = True


STATES = {"tokenizing": pin_tokenizing, "waiting": pin_waiting, "chunked": pin_chunked,
          "chunked_live": pin_chunked_live, "running": pin_running, "running_live": pin_running_live,
          "retracted": pin_retracted}


# ---------------------------------------------------------------------------- the matrix
def _apply(cell: Cell, entry: str, before: dict) -> dict | None:
    """Apply the entry to the victim; returns its final result (None for a disconnect).
    Raises Missed when a live (unpaused) victim finished on its own first."""
    victim, http, server = cell.victim, cell.http, cell.server
    if entry.startswith("abort"):
        n = abort(http, victim.rid)
        if n == 0 and not cell.paused:
            raise Missed("the request finished before the abort")
        assert n == 1
        assert abort(http, victim.rid) == 0  # deduplicated: a second call is a no-op
        final = terminal_result(victim)
        if final["meta_info"]["finish_reason"]["type"] != "abort" and not cell.paused:
            raise Missed(f"the request finished on its own first: {final['meta_info']}")
        return final
    victim.close()
    if cell.place is None:  # tokenizing: the request is dropped before it is ever sent
        wait_info(server, lambda i: i["num_tokenizing_reqs"] == 0, "held request dropped")
    else:  # the victim ends in the scheduler (aborted; or, if live, maybe finished first)
        info = wait_info(server, lambda i: i["num_finished"] > before["num_finished"], "disconnect seen")
        if info["num_aborted"] == before["num_aborted"] and not cell.paused:
            raise Missed("the request finished before the disconnect")
    return None


def _run_cell(server: ServerProcess, http: httpx.Client, state: str, entry: str, rid: str) -> None:
    stream = entry.endswith("stream")
    start_log = len(server.log())
    settle(server, http)
    received = requests_received(http)
    cell = Cell(server, http)
    try:
        STATES[state](cell, rid, stream)
        before = counters(server_info(server))
        final = _apply(cell, entry, before)
        # The caller is answered when the front end accepts the abort; the scheduler counts
        # the request as finished once every batch holding it has resolved.
        after = counters(wait_info(server, lambda i: cell.place is None or i["num_finished"] > before["num_finished"],
                                   "the scheduler finished the victim"))
        delta = {k: after[k] - before[k] for k in after}
        want = {k: 0 for k in delta}
        if cell.place is not None:
            place = cell.place
            if place == "in_flight" and state == "running_live" and delta["taken_back"] == 1:
                # the abort arrived while the forward ran: the decode batch queued behind it was
                # taken back (abort_watch.py), so the abort found the request running
                place = "running"
                want["taken_back"] = 1
            want.update(num_aborted=1, num_finished=1, **{place: 1})
        if state == "chunked_live" and (delta != want or (final is not None and final["output_ids"])):
            raise Missed(f"the prefill was over before the abort: {delta}")
        assert delta == want, (cell.place, delta)  # one terminal output, from where the request was
        if final is not None:
            meta = final["meta_info"]
            assert meta["finish_reason"] == USER_ABORT and meta["id"] == rid, meta
            assert meta["num_retractions"] == (1 if cell.retracted else 0), meta
            if state.startswith("running") or cell.retracted:
                assert final["output_ids"], "the output generated so far"
            else:  # not decoding yet: nothing generated
                assert final["output_ids"] == [] and meta["completion_tokens"] == 0, final
        cell.cleanup(check=True)
        idle = wait_info(server, is_idle, "idle after the cell")
        if state.startswith("chunked"):
            # the computed chunks stay in the tree as evictable cache (semantics §3)
            kept = idle["memory"]["evictable"]
            if state == "chunked_live" and kept >= LONG_PROMPT:
                raise Missed(f"the prefill was over before the abort ({kept} tokens cached)")
            assert 0 < kept < LONG_PROMPT, idle["memory"]
            again = http.post("/generate", json=generate_body(rid + "-again", cell.prompt, {"max_new_tokens": 1},
                                                              False)).json()
            assert again["meta_info"]["cached_tokens"] == kept  # a resubmission reuses them
        if final is not None and final["output_ids"]:
            # the partial output is exactly what an undisturbed greedy run produces first
            assert final["output_ids"] == greedy(http, cell.prompt, len(final["output_ids"]))
        if cell.place is None:
            assert requests_received(http) == received  # the held request was never admitted
        # the rid is free again at once and the server keeps serving
        again = http.post("/generate", json=generate_body(rid, fresh_prompt(5), {"max_new_tokens": 2}, False))
        assert again.status_code == 200 and again.json()["meta_info"]["finish_reason"]["type"] == "length"
        settle(server, http)
    finally:
        cell.cleanup(check=False)
    assert_clean_log(server, start_log)


# Where overlap changes nothing (the tokenizer manager; a paused decode without overlap is the
# live one) a state runs in one mode only.
STATES_BY_MODE = {
    "overlap_off": ("tokenizing", "waiting", "chunked", "running_live", "retracted"),
    "overlap_on": ("waiting", "chunked", "chunked_live", "running", "running_live", "retracted"),
}
CELLS = [(mode, state, entry) for mode, states in STATES_BY_MODE.items() for state in states for entry in ENTRIES]


@pytest.mark.parametrize("mode,state,entry", CELLS)
def test_abort_matrix(server, http, state, entry):
    for attempt in range(ATTEMPTS):
        try:
            _run_cell(server, http, state, entry, rid=f"{state}-{entry}-{attempt}")
            return
        except Missed as e:
            print(f"{state}/{entry}: attempt {attempt} missed the moment: {e}")
            if attempt == ATTEMPTS - 1:
                raise AssertionError(f"could not pin the request in {ATTEMPTS} attempts: {e}") from e
            settle(server, http)


@pytest.mark.parametrize("mode", STATES_BY_MODE)
@pytest.mark.parametrize("entry", ENTRIES)
def test_just_finished(server, http, entry):
    """The entry arrives once the request has finished: nothing is aborted, the one terminal
    output is the normal finish."""
    start_log = len(server.log())
    settle(server, http)
    stream = entry.endswith("stream")
    rid = f"finished-{entry}"
    before = counters(server_info(server))
    call = Call(server, generate_body(rid, fresh_prompt(10), {"max_new_tokens": 4, "min_new_tokens": 4}, stream))
    if entry == "disconnect_stream":  # gone right after the final chunk, maybe before [DONE]
        call.wait_events(until=lambda e: e != "[DONE]" and e["meta_info"]["finish_reason"] is not None)
        call.close()
    else:
        final = terminal_result(call)
        assert final["meta_info"]["finish_reason"]["type"] == "length" and len(final["output_ids"]) == 4
        if entry.startswith("abort"):
            assert abort(http, rid) == 0
    info = wait_info(server, is_idle, "idle")
    delta = {k: v - before[k] for k, v in counters(info).items()}
    assert delta == {**{k: 0 for k in delta}, "num_finished": 1}, delta
    settle(server, http)
    assert_clean_log(server, start_log)


@pytest.mark.parametrize("mode", STATES_BY_MODE)
def test_unknown_rid_is_a_no_op(server, http):
    """An unknown rid hits nothing, not even a running request whose rid it starts with, and
    the server keeps serving."""
    start_log = len(server.log())
    settle(server, http)
    before = counters(server_info(server))
    call = Call(server, generate_body("unknown-prefix-victim", fresh_prompt(8),
                                      {"max_new_tokens": 40, "min_new_tokens": 40, "temperature": 0}, True))
    call.wait_events(2)
    for rid in ("never-sent", "unknown-prefix", "unknown-prefix-victi", "unknown-prefix-victim_x"):
        assert abort(http, rid) == 0
    r = http.post("/abort_request", json={"rid": ""})  # empty rid without abort_all: ignored
    assert r.status_code == 200 and r.json()["num_aborted"] == 0
    final = terminal_result(call)
    assert final["meta_info"]["finish_reason"]["type"] == "length" and len(final["output_ids"]) == 40
    info = wait_info(server, is_idle, "idle")
    delta = {k: v - before[k] for k, v in counters(info).items()}
    assert delta == {**{k: 0 for k in delta}, "num_finished": 1}, delta
    ok = http.post("/generate", json=generate_body("after-unknown", fresh_prompt(4), {"max_new_tokens": 2}, False))
    assert ok.status_code == 200
    settle(server, http)
    assert_clean_log(server, start_log)


@pytest.mark.parametrize("mode", ["overlap_off"])
@pytest.mark.parametrize("path,stream", [("/v1/completions", True), ("/v1/completions", False),
                                         ("/v1/chat/completions", True), ("/v1/chat/completions", False)])
def test_openai_surfaces_report_the_abort(server, http, path, stream):
    """The running-decode cell through the OpenAI endpoints (rid given in the body): one final
    choice with finish_reason "abort" and the text so far, then [DONE] for a stream."""
    start_log = len(server.log())
    settle(server, http)
    rid = f"openai-{path.rsplit('/', 1)[-1]}-{stream}"
    body = {"rid": rid, "stream": stream, "max_tokens": 150, "min_tokens": 150, "temperature": 0}
    if "chat" in path:
        body["messages"] = [{"role": "user", "content": "Tell me a long story."}]
    else:
        body["prompt"] = "Once upon a time"
    base = server_info(server)
    call = Call(server, body, path=path)
    wait_info(server, lambda i: i["num_decode_tokens"] >= base["num_decode_tokens"] + 3, "decoding")
    assert abort(http, rid) == 1
    status, raw = call.finish()
    assert status == 200, raw
    if stream:
        events = call.events()
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        choices = [c for e in events[:-1] for c in e["choices"]]
        finishes = [c["finish_reason"] for c in choices if c["finish_reason"] is not None]
        assert finishes == ["abort"] and choices[-1]["finish_reason"] == "abort"
        text = "".join(c.get("text") or (c.get("delta") or {}).get("content") or "" for c in choices)
    else:
        out = json.loads(raw)
        assert [c["finish_reason"] for c in out["choices"]] == ["abort"]
        assert 0 < out["usage"]["completion_tokens"] < 150
        choice = out["choices"][0]
        text = choice["text"] if "text" in choice else choice["message"]["content"]
    assert text  # the text generated so far
    info = wait_info(server, is_idle, "idle")
    assert info["aborts_running"] == base["aborts_running"] + 1 and info["num_aborted"] == base["num_aborted"] + 1
    settle(server, http)
    assert_clean_log(server, start_log)


@pytest.mark.parametrize("mode", STATES_BY_MODE)
def test_storm_of_aborts_and_disconnects(server, http, mode):
    """Every cell at once, at random moments: 2 rounds of 24 requests (streams and not, n = 2
    families, prompts up to 100 tokens, the small pool retracting), with aborts, disconnects,
    pauses in place and by retraction, and an abort_all. Every request that is not hung up on
    gets exactly one terminal response with status 200 (none "out of memory": each fits the
    pool alone), and the server ends idle, conserved, with a clean log."""
    start_log = len(server.log())
    settle(server, http)
    rng = random.Random(7)
    for rnd in range(2):
        calls: list[Call] = []
        for i in range(24):
            n = 2 if rng.random() < 0.15 else 1
            max_new = rng.randrange(5, 100)
            params = {"max_new_tokens": max_new, "temperature": 0, "n": n}
            if rng.random() < 0.5:
                params["min_new_tokens"] = max_new
            prompt = fresh_prompt(rng.choice([5, 20, 60, 100]))
            calls.append(Call(server, generate_body(f"storm{rnd}-{i}", prompt, params, rng.random() < 0.5)))
            if n == 2 and rnd == 0:  # a look-alike of the family's rid: never hit by the family's aborts
                look = Call(server, generate_body(f"storm{rnd}-{i}_7", fresh_prompt(10),
                                                  {"max_new_tokens": 20, "min_new_tokens": 20, "temperature": 0},
                                                  False))
                look.lookalike = True
                calls.append(look)
            if rng.random() < 0.1:
                assert http.post("/pause_generation", json={"mode": rng.choice(["in_place", "retract"])}).status_code == 200
                resume(http)
        for c in calls:
            if getattr(c, "lookalike", False):
                continue
            fate = rng.random()
            if fate < 0.3:
                c.close()
            elif fate < 0.6:
                abort(http, c.rid)
        if rnd == 1:
            assert http.post("/abort_request", json={"abort_all": True}).status_code == 200
        for c in [c for c in calls if not c.closed]:
            status, body = c.finish()
            assert status == 200, (c.rid, body[:300])
            if c.stream:
                events = c.events()
                assert events[-1] == "[DONE]" and events.count("[DONE]") == 1, (c.rid, events[-3:])
                finals = [e for e in events[:-1] if e["meta_info"]["finish_reason"] is not None]
                assert sorted(e.get("index", 0) for e in finals) == sorted({e.get("index", 0) for e in events[:-1]})
            else:
                out = json.loads(body)
                assert all(o["meta_info"]["finish_reason"] is not None for o in (out if isinstance(out, list) else [out]))
                if getattr(c, "lookalike", False):
                    assert out["meta_info"]["finish_reason"]["type"] == "length", (c.rid, out["meta_info"])
        settle(server, http)
    assert_clean_log(server, start_log)

"""The caller's side of the cancel chain through the Engine (docs/cancel_chain.md):
families by identity, the weight-lock wait as a place, one-step duplicate checks, shutdown
and interrupted callers, pause -> weight update -> continue, tombstones, and the caller
answered at once (shown with the scheduler process frozen by SIGSTOP, so nothing here
depends on timing: a caller that is not answered at the front end would wait forever)."""
from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest
import torch

from radixlm import Engine
from test.support.engine_checks import assert_idle_and_empty, random_prompt

GREEDY = {"temperature": 0, "ignore_eos": True}
LONG = {"max_new_tokens": 1500, **GREEDY}  # far longer than any test waits: ends by abort only
HANG = 120.0  # seconds after which a wait that should end at once is called a hang (a busy machine is slow)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    eng = Engine(model_path=tiny_llama_dir, dtype="float32", max_total_tokens=16384, debug_check_integrity=True,
                 enable_overlap_schedule=True)
    yield eng
    eng.shutdown()


class Background:
    """fn() on a thread; .result() re-raises what it raised."""

    def __init__(self, fn) -> None:
        self.value = self.error = None
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self.thread.start()

    def _run(self, fn) -> None:
        try:
            self.value = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            self.error = e

    def done(self, timeout: float = HANG) -> bool:
        self.thread.join(timeout)
        return not self.thread.is_alive()

    def result(self, timeout: float = HANG):
        assert self.done(timeout), "the call was not answered"
        if self.error is not None:
            raise self.error
        return self.value


def wait_until(engine: Engine, pred, what: str, timeout: float = HANG) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        info = engine.get_server_info()
        if pred(info):
            return info
        assert time.monotonic() < deadline, f"{what}: not reached: {info}"
        time.sleep(0.01)


def wait_front(engine: Engine, key: str, n: int, what: str) -> None:
    """Until the front end's `key` place counter is n."""
    wait_until(engine, lambda i: i["front_end"][key] == n, what)


def wait_received(engine: Engine, rid: str, n: int) -> None:
    """Until the front end holds at least n output ids of `rid`."""
    def received() -> int:
        st = engine.tokenizer_manager.states.get(rid)
        return 0 if st is None else len(st.output_ids) + sum(len(p.out.new_token_ids) for p in list(st.pending))
    deadline = time.monotonic() + HANG
    while received() < n:
        assert time.monotonic() < deadline, f"{rid}: fewer than {n} ids reached the front end"
        time.sleep(0.005)


def gen(engine: Engine, rid: str, seed: int, params=None, **kw):
    return lambda: engine.generate(input_ids=random_prompt(seed, 8), sampling_params=params or LONG, rid=rid, **kw)


def same_weights(engine: Engine) -> dict:
    """An update that changes nothing (keeps the module's greedy outputs), still a real update."""
    name = "model.norm.weight"
    return {name: torch.tensor(engine.get_weights_by_name(name, 10 ** 6))}


def read_stream(stream, into: list):
    def run():
        for chunk in stream:
            into.append(chunk)
        return into
    return Background(run)


# ---------------------------------------------------------------------------- 1. families
def test_abort_hits_a_family_by_identity_never_a_lookalike(engine):
    calls = {rid: Background(gen(engine, rid, i, params={**LONG, "n": n}))
             for i, (rid, n) in enumerate([("job", 1), ("job_1", 1), ("fam", 3), ("fam_7", 1)])}
    wait_until(engine, lambda i: i["num_running_reqs"] == 6, "all running")
    engine.pause_generation("in_place")  # everyone stays where it is while we abort
    try:
        counts = [engine.abort_request("job"), engine.abort_request("fam"), engine.abort_request("job")]
        assert calls["job"].result()["meta_info"]["finish_reason"]["type"] == "abort"
        assert [r["meta_info"]["finish_reason"]["type"] for r in calls["fam"].result()] == ["abort"] * 3
        assert not calls["job_1"].done(0.5) and not calls["fam_7"].done(0)  # the look-alikes run on
        assert counts == [1, 3, 0]  # job; fam's own three children; a second abort is a no-op
        assert engine.abort_request("fam_", prefix=True) == 1  # a prefix is matched only when asked
        assert calls["fam_7"].result()["meta_info"]["finish_reason"]["type"] == "abort"
    finally:
        engine.continue_generation()
    assert not calls["job_1"].done(0.5)  # still decoding
    # a caller that goes away (closes its stream) aborts its own request only
    stream = engine.generate(input_ids=random_prompt(9, 8), sampling_params=LONG, rid="job", stream=True)
    next(stream)
    stream.close()
    assert not calls["job_1"].done(0.5)
    assert engine.abort_request("job_1") == 1
    assert calls["job_1"].result()["meta_info"]["finish_reason"]["type"] == "abort"
    assert_idle_and_empty(engine)


# ---------------------------------------------------------------------------- 2, 3. the weight lock
def _request_behind_the_lock(engine: Engine, rid: str):
    """A holds the read side; an update waits for A; `rid` waits for the update. Returns
    (A's stream, the update, the request)."""
    a = engine.generate(input_ids=random_prompt(20, 8), sampling_params=LONG, rid=f"{rid}-A", stream=True)
    next(a)
    new = same_weights(engine)
    update = Background(lambda: engine.update_weights_from_tensor(new))
    wait_front(engine, "writers_waiting", 1, "the update waits for A")
    req = Background(gen(engine, rid, 21, params={"max_new_tokens": 6, **GREEDY}))
    wait_front(engine, "weight_lock", 1, "waiting for the weight lock")
    return a, update, req


@pytest.mark.parametrize("how", ["abort_request", "abort_all", "pause_abort"])
def test_a_request_waiting_for_the_weight_lock_is_aborted_and_never_runs(engine, how):
    a, update, req = _request_behind_the_lock(engine, f"lockwait-{how}")
    if how == "abort_request":
        n = engine.abort_request(f"lockwait-{how}")
    elif how == "abort_all":
        n = engine.abort_request(abort_all=True)
    else:
        engine.pause_generation("abort")
    try:
        out = req.result()  # answered now, though the update still waits
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert out["output_ids"] == [] and out["meta_info"]["completion_tokens"] == 0
        if how != "pause_abort":
            assert n == (1 if how == "abort_request" else 2)  # (abort_all: A too)
    finally:
        a.close()  # (aborts A if it still runs) the update goes ahead
        assert update.result()["num_tensors"] == 1
        if how == "pause_abort":
            engine.continue_generation()
        req.done()
    assert_idle_and_empty(engine)
    assert engine.get_server_info()["front_end"]["weight_lock"] == 0


def test_a_duplicate_rid_behind_the_lock_is_refused_at_once(engine):
    a, update, first = _request_behind_the_lock(engine, "dup")
    second = Background(gen(engine, "dup", 22, params={"max_new_tokens": 3, **GREEDY}))
    with pytest.raises(ValueError, match="duplicate request id 'dup'"):
        second.result()
    a.close()
    update.result()
    out = first.result()  # the first one is whole: its state was never taken by the other
    assert out["meta_info"]["finish_reason"]["type"] == "length" and len(out["output_ids"]) == 6
    assert engine.tokenizer_manager.table.names == {} and engine.tokenizer_manager.states == {}
    assert_idle_and_empty(engine)


# ---------------------------------------------------------------------------- 6. pause -> update -> continue
def _perturbed(engine: Engine, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight",
                 "model.layers.1.self_attn.v_proj.weight"):
        w = torch.tensor(engine.get_weights_by_name(name, 10 ** 6))
        out[name] = w + 0.3 * torch.randn(w.shape, generator=g)
    return out


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_a_paused_engine_applies_a_weight_update_at_once(engine, mode):
    n = 200
    seed = 30 if mode == "retract" else 35
    prompts = {f"pu-{mode}-{i}": random_prompt(seed + i, 12) for i in range(2)}
    old, new = engine.get_weight_version(), _perturbed(engine, 7)
    chunks = {rid: [] for rid in prompts}
    readers = {rid: read_stream(engine.generate(input_ids=p, sampling_params={"max_new_tokens": n, **GREEDY},
                                                rid=rid, stream=True), chunks[rid]) for rid, p in prompts.items()}
    deadline = time.monotonic() + HANG
    while not all(len(c) >= 3 for c in chunks.values()):
        assert time.monotonic() < deadline
        time.sleep(0.005)
    engine.pause_generation(mode)
    try:
        update = Background(lambda: engine.update_weights_from_tensor(new, weight_version=f"after-{mode}"))
        res = update.result()  # while paused: the paused requests do not hold it back
        assert res["weight_version"] == f"after-{mode}"
    finally:
        engine.continue_generation()
    for rid, prompt in prompts.items():
        got = readers[rid].result()
        meta = got[-1]["meta_info"]
        ids = [t for c in got for t in c["output_ids"]]
        assert meta["finish_reason"]["type"] == "length" and len(ids) == n
        (v0, s0), (v1, k) = meta["weight_versions"]  # which weights produced which tokens
        assert (v0, s0, v1) == (old, 0, f"after-{mode}") and 3 <= k < n
        assert meta["weight_version"] == f"after-{mode}"
        if mode == "retract":
            # recomputed under the new weights (its old KV is in the old namespace): the rest is
            # exactly what the new weights give for prompt + the tokens before the update
            assert meta["num_retractions"] >= 1
            redo = engine.generate(input_ids=prompt + ids[:k], sampling_params={"max_new_tokens": n - k, **GREEDY})
            assert redo["output_ids"] == ids[k:]
        # KV computed under other weights is never reused
        fresh = engine.generate(input_ids=prompt + ids[:k], sampling_params={"max_new_tokens": 1})
        if mode == "in_place":
            assert fresh["meta_info"]["cached_tokens"] == 0
    assert_idle_and_empty(engine)


# ---------------------------------------------------------------------------- 7. tombstones, counts
def test_an_abort_before_the_request_arrives_is_kept_and_applied(engine):
    n = engine.abort_request("early-bird")  # not here yet: kept as a tombstone
    out = engine.generate(input_ids=random_prompt(40, 8), sampling_params={"max_new_tokens": 5}, rid="early-bird")
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and out["output_ids"] == []
    assert n == 0  # it hit nothing when it was made
    again = engine.generate(input_ids=random_prompt(40, 8), sampling_params={"max_new_tokens": 5, **GREEDY},
                            rid="early-bird")  # the tombstone is spent
    assert again["meta_info"]["finish_reason"]["type"] == "length"
    # a rid just answered is not tombstoned: reusing it right after a late abort runs normally
    assert engine.abort_request("early-bird") == 0
    third = engine.generate(input_ids=random_prompt(40, 8), sampling_params={"max_new_tokens": 5, **GREEDY},
                            rid="early-bird")
    assert third["meta_info"]["finish_reason"]["type"] == "length"
    # a family child aborted before its family exists
    assert engine.abort_request("kids_1") == 0
    kids = engine.generate(input_ids=random_prompt(41, 8), sampling_params={"max_new_tokens": 5, "n": 3, **GREEDY},
                           rid="kids")
    assert [k["meta_info"]["finish_reason"]["type"] for k in kids] == ["length", "abort", "length"]
    assert_idle_and_empty(engine)


# ---------------------------------------------------------------------------- 8. answered at once
def test_the_caller_is_answered_while_the_scheduler_is_frozen(engine):
    pid = engine.procs.procs["scheduler"].pid
    got: list = []
    stream = engine.generate(input_ids=random_prompt(50, 8), sampling_params=LONG, rid="frozen", stream=True)
    got += [next(stream), next(stream), next(stream)]
    blocking = Background(gen(engine, "frozen-json", 51))
    wait_until(engine, lambda i: i["num_running_reqs"] == 2, "both running")
    os.kill(pid, signal.SIGSTOP)
    try:
        counts = [engine.abort_request("frozen"), engine.abort_request("frozen-json")]
        rest = read_stream(stream, got).result()  # answered by the front end: the scheduler is stopped
        final = rest[-1]["meta_info"]
        assert final["finish_reason"] == {"type": "abort", "message": "Aborted by the client", "status_code": 200}
        delivered = [t for c in rest for t in c["output_ids"]]
        assert final["completion_tokens"] == len(delivered) >= 3
        out = blocking.result()
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert out["meta_info"]["completion_tokens"] == len(out["output_ids"])
        assert counts == [1, 1]
        # the rid is free at once, while the old request is still in the (stopped) scheduler
        reuse = Background(gen(engine, "frozen", 52, params={"max_new_tokens": 6, **GREEDY}))
        time.sleep(0.2)
    finally:
        os.kill(pid, signal.SIGCONT)
    again = reuse.result()
    assert again["meta_info"]["finish_reason"]["type"] == "length" and len(again["output_ids"]) == 6
    ref = engine.generate(input_ids=random_prompt(52, 8), sampling_params={"max_new_tokens": 6, **GREEDY})
    assert again["output_ids"] == ref["output_ids"]  # nothing of the old request reached the new one
    info = wait_until(engine, lambda i: i["front_end"]["draining"] == 0 and i["num_running_reqs"] == 0,
                      "the scheduler let the aborted requests go")
    assert {r.split("#")[0] for r, *_ in info["recent_cancels"]} >= {"frozen", "frozen-json"}
    assert_idle_and_empty(engine)


def test_a_non_streamed_answer_has_the_text_of_its_ids(engine):
    """A non-streamed request's text is decoded only at its end (DetokParams.text_at_end), so
    the front end's own answer decodes the ids it holds: every id received, and its text."""
    from radixlm.messages import DetokParams
    from radixlm.srt.detokenizer import released_text
    pid = engine.procs.procs["scheduler"].pid
    blocking = Background(gen(engine, "decoded", 53))

    def received() -> int:  # ids the front end holds for it (read from the test's thread: a count)
        st = engine.tokenizer_manager.states.get("decoded")
        return 0 if st is None else len(st.output_ids) + sum(len(p.out.new_token_ids) for p in list(st.pending))

    deadline = time.monotonic() + HANG
    while received() < 4:
        assert time.monotonic() < deadline, "no ids reached the front end"
        time.sleep(0.01)
    os.kill(pid, signal.SIGSTOP)
    try:
        assert engine.abort_request("decoded") == 1
        out = blocking.result()
    finally:
        os.kill(pid, signal.SIGCONT)
    ids = out["output_ids"]
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and len(ids) >= 4
    tok = engine.tokenizer_manager.tokenizer
    assert out["text"] and out["text"] == released_text(tok, DetokParams(), ids)
    assert tok.decode(ids).startswith(out["text"])
    wait_until(engine, lambda i: i["front_end"]["draining"] == 0 and i["num_running_reqs"] == 0, "let go")
    assert_idle_and_empty(engine)


def test_aborts_landing_anywhere_in_an_overlapped_step_end_alone_and_free_their_kv(engine):
    """Overlap: an abort arrives while one forward runs and the next batch is queued behind it.
    Whether that batch has not started yet, and is taken back (abort_watch.py), depends on where
    in the step the abort lands: that path is pinned down with a held forward in
    test/unit/scheduler/test_abort_watch.py. Here, on the real engine, aborts land after 1 to 5
    of their request's tokens, wherever the step is then: each ends its own request with what
    it produced, the others decode on, and no KV is left behind (the engine checks every pool
    and tree invariant after every step, debug_check_integrity)."""
    others = [Background(gen(engine, f"tb-keep{i}", 80 + i)) for i in range(3)]
    try:
        for i in range(10):
            rid = f"tb-{i}"
            call = Background(gen(engine, rid, 90 + i))
            wait_received(engine, rid, 1 + i % 5)
            assert engine.abort_request(rid) == 1
            out = call.result()
            assert out["meta_info"]["finish_reason"]["type"] == "abort" and len(out["output_ids"]) >= 1 + i % 5
            wait_until(engine, lambda info: info["num_running_reqs"] == 3, "the aborted request let go")
    finally:
        kept = engine.abort_request("tb-keep", prefix=True)
    assert kept == 3  # every other one was still decoding
    for c in others:
        assert c.result()["meta_info"]["finish_reason"]["type"] == "abort"
    assert_idle_and_empty(engine)


# ---------------------------------------------------------------------------- 5. interrupted callers
@pytest.mark.parametrize("stream", [False, True])
def test_interrupting_a_blocking_call_aborts_its_request(engine, stream):
    before = engine.get_server_info()["num_aborted"]
    main = threading.main_thread().ident

    def interrupt():
        wait_until(engine, lambda i: i["num_running_reqs"] == 1, "running")
        signal.pthread_kill(main, signal.SIGINT)
    # A shell starting the suite in the background (`cmd &`) ignores SIGINT for it, and Python
    # then installs no KeyboardInterrupt handler: install it for this test.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    t = threading.Thread(target=interrupt, daemon=True)
    t.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            if stream:
                for _ in engine.generate(input_ids=random_prompt(60, 8), sampling_params=LONG, stream=True):
                    pass
            else:
                engine.generate(input_ids=random_prompt(60, 8), sampling_params=LONG)
    finally:
        t.join(HANG)
        signal.signal(signal.SIGINT, previous)
    info = wait_until(engine, lambda i: i["num_running_reqs"] == 0, "the interrupted request ended")
    assert info["num_aborted"] == before + 1  # aborted, not run to its end
    assert engine.tokenizer_manager.states == {}
    assert_idle_and_empty(engine)


def test_a_call_given_up_before_the_loop_starts_it_never_runs(engine):
    """The interrupted stream's race: the caller gave up while the loop had not yet started its
    call (so it did not wait for it), then closed the generator whose step the loop was about to
    start ("aclose(): asynchronous generator is already running"). A call the caller gave up
    on before it started must never start."""
    ran = []

    async def step():
        ran.append(True)

    release = threading.Event()
    engine._loop.call_soon_threadsafe(release.wait, 5.0)  # the loop is busy: the call is queued
    try:
        with pytest.raises(TimeoutError):
            engine._call(step(), timeout=0.05)
    finally:
        release.set()
    assert engine._call(asyncio.sleep(0, "after")) == "after"  # the queued call was dropped first
    assert ran == []


# ---------------------------------------------------------------------------- 4. shutdown
def test_shutdown_answers_every_blocked_caller(tiny_llama_dir):
    eng = Engine(model_path=tiny_llama_dir, dtype="float32", max_total_tokens=16384)
    try:
        p = random_prompt(70, 8)
        held = eng.generate(input_ids=p, sampling_params=LONG, stream=True)
        next(held)  # holds the weight lock's read side
        new = same_weights(eng)
        callers = {
            "generate": Background(lambda: eng.generate(input_ids=p, sampling_params=LONG)),
            "stream": read_stream(eng.generate(input_ids=p, sampling_params=LONG, stream=True), []),
            "held stream": read_stream(held, []),
            "async": Background(lambda: asyncio.run(eng.async_generate(input_ids=p, sampling_params=LONG))),
        }
        wait_until(eng, lambda i: i["num_running_reqs"] == 4, "all running")
        callers["update"] = Background(lambda: eng.update_weights_from_tensor(new))
        wait_front(eng, "writers_waiting", 1, "the update waits")
        callers["behind the lock"] = Background(lambda: eng.generate(input_ids=p, sampling_params=LONG))
        wait_front(eng, "weight_lock", 1, "behind the lock")
    finally:
        eng.shutdown()
    for name, c in callers.items():
        assert c.done(), f"{name}: not answered by shutdown"
        if name == "update":
            assert isinstance(c.error, (RuntimeError, ValueError)), c.error
            continue
        assert c.error is None, (name, c.error)
        final = c.value[-1] if isinstance(c.value, list) else c.value
        fr = final["meta_info"]["finish_reason"]
        assert fr["type"] == "abort" and fr["status_code"] == 503 and "shutting down" in fr["message"], (name, fr)
    with pytest.raises(RuntimeError, match="shut down"):
        eng.generate(input_ids=p, sampling_params={"max_new_tokens": 1})

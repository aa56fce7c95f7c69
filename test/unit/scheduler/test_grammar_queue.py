"""The grammar queue at the scheduler (semantics §1, §3 method 2) with a fake grammar backend:
compile wait, abort during compile, compile failure, retraction and a storm. Every test runs
with the overlap loop on and off (conftest.py), with check_integrity after every step."""
from __future__ import annotations

import random
import time

from radixlm.messages import AbortReq, TokenizedGenerateReq
from radixlm.sampling_params import SamplingParams

from radixlm.core import Req
from radixlm.scheduler.grammar_queue import GrammarQueue

from test.support.fake_grammar import FakeGrammarBackend, constrained_reference
from test.support.fake_runner import reference_output
from test.support.scheduler_harness import make_harness


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(97) for _ in range(n)]


def _steps(h, n: int) -> None:
    for _ in range(n):
        h.scheduler.step()
        h.scheduler.check_integrity()


def _wait_started(backend: FakeGrammarBackend, keys: list[tuple[str, str]]) -> None:
    deadline = time.monotonic() + 10
    while not all(backend.started[k] for k in keys):
        assert time.monotonic() < deadline, "compiles never started"
        time.sleep(0.005)


def test_request_waits_for_its_compile_then_decodes_constrained():
    backend = FakeGrammarBackend()
    backend.gate.clear()
    h = make_harness(grammar_backend=backend)
    p1, p2 = _prompt(10, 1), _prompt(12, 2)
    a = h.submit(p1, regex="mod=3,len=6", max_new_tokens=20, stream=True)
    b = h.submit(p2, max_new_tokens=5)
    _steps(h, 12)
    assert [r.rid for r in h.scheduler.grammar_queue.reqs] == [a]
    assert a not in h.outputs, "nothing may run before the grammar is compiled"
    assert h.final(b).finish_reason["type"] == "length"  # the free request did not wait
    assert not h.scheduler.is_idle()
    backend.gate.set()
    h.run()
    ref, finish = constrained_reference(p1, "mod=3,len=6", 20)
    assert h.tokens(a) == ref and all(t % 3 == 0 for t in ref)
    assert h.final(a).finish_reason == {"type": "stop", "matched": ref[-1]}
    assert h.tokens(b) == reference_output(p2, 5)
    h.assert_idle_and_conserved()


def test_children_share_one_compile_and_own_their_matchers():
    backend = FakeGrammarBackend()
    h = make_harness(grammar_backend=backend)
    p = _prompt(9, 3)
    spec = "mod=2,len=7"
    for c in range(3):
        h.submit(p, rid=f"fam_{c}", ebnf=spec, max_new_tokens=30)
    h.run()
    ref, _ = constrained_reference(p, spec, 30)
    for c in range(3):  # one shared matcher would have run out after the first child
        assert h.tokens(f"fam_{c}") == ref
        assert h.final(f"fam_{c}").finish_reason["type"] == "stop"
    assert backend.compiles[("ebnf", spec)] == 1
    assert h.scheduler.grammar_queue.stats["grammar_cache_hits"] == 2
    h.assert_idle_and_conserved()


def test_abort_in_the_grammar_queue_cancels_the_compile_and_answers_at_once():
    backend = FakeGrammarBackend()
    backend.gate.clear()
    h = make_harness(grammar_backend=backend)
    k1, k2, k3 = "mod=2,len=4", "mod=5,len=3", "mod=7,len=2"
    a = h.submit(_prompt(8, 4), regex=k1, max_new_tokens=10)
    b = h.submit(_prompt(8, 5), regex=k2, max_new_tokens=10)
    c = h.submit(_prompt(8, 6), regex=k3, max_new_tokens=10)
    d = h.submit(_prompt(8, 7), max_new_tokens=6)
    _wait_started(backend, [("regex", k1), ("regex", k2)])  # both pool threads busy, k3 queued
    sched = h.scheduler
    assert sched.abort(AbortReq(rid=c)) == 1
    fin = h.final(c)  # answered by the abort call itself, before any step
    assert fin.finish_reason["type"] == "abort" and fin.finish_reason["status_code"] == 200
    assert fin.new_token_ids == []
    assert sched.grammar_queue.stats["grammar_compiles_cancelled"] == 1
    assert sched.abort(AbortReq(rid=a)) == 1  # running compile: not interrupted, result cached
    assert h.final(a).finish_reason["type"] == "abort"
    assert sched.stats.aborts_grammar == 2
    backend.gate.set()
    h.run()
    assert backend.started[("regex", k3)] == 0, "the cancelled compile ran"
    assert h.tokens(b) == constrained_reference(_prompt(8, 5), k2, 10)[0]
    assert h.tokens(d) == reference_output(_prompt(8, 7), 6)
    # the rid is free again (no state leaked by the queued abort) and the compile is cached
    h.submit(_prompt(8, 4), rid=a, regex=k1, max_new_tokens=10)
    h.run()
    assert len([o for o in h.outputs[a] if o.finish_reason]) == 2
    assert h.outputs[a][-1].finish_reason["type"] == "stop"
    assert backend.compiles[("regex", k1)] == 1
    h.assert_idle_and_conserved()


def test_compile_failure_answers_400_and_harms_nobody():
    backend = FakeGrammarBackend()
    h = make_harness(grammar_backend=backend)
    good_p, free_p = _prompt(11, 8), _prompt(13, 9)
    bad1 = h.submit(_prompt(5, 10), regex="bad[", max_new_tokens=8, stream=True)
    good = h.submit(good_p, regex="mod=4,len=5", max_new_tokens=8)
    free = h.submit(free_p, max_new_tokens=9)
    h.run()
    bad2 = h.submit(_prompt(6, 11), regex="bad[", max_new_tokens=8)  # the failure is cached
    h.run()
    for rid in (bad1, bad2):
        fr = h.final(rid).finish_reason
        assert fr["type"] == "abort" and fr["status_code"] == 400
        assert "invalid regex" in fr["message"] and "cannot parse" in fr["message"]
        assert h.tokens(rid) == []
    assert backend.compiles[("regex", "bad[")] == 1
    assert h.tokens(good) == constrained_reference(good_p, "mod=4,len=5", 8)[0]
    assert h.tokens(free) == reference_output(free_p, 9)
    h.assert_idle_and_conserved()


def test_without_a_backend_structured_requests_get_400():
    h = make_harness()
    rid = h.submit(_prompt(5, 12), json_schema={"type": "object"})
    fr = h.final(rid).finish_reason
    assert fr["type"] == "abort" and fr["status_code"] == 400 and "not available" in fr["message"]
    h.assert_idle_and_conserved()


def test_timeout_in_the_grammar_queue_is_503():
    backend = FakeGrammarBackend()
    backend.gate.clear()
    h = make_harness(grammar_backend=backend)
    h.scheduler.add_request(TokenizedGenerateReq(
        rid="slow", input_ids=_prompt(5, 13), timeout=0.02,
        sampling_params=SamplingParams.from_dict({"regex": "mod=2,len=3"})))
    time.sleep(0.05)
    h.scheduler.step()
    fr = h.final("slow").finish_reason
    assert fr["type"] == "abort" and fr["status_code"] == 503
    backend.gate.set()
    h.run()
    h.assert_idle_and_conserved()


def test_retraction_keeps_the_matcher_and_finish_releases_it():
    backend = FakeGrammarBackend()
    h = make_harness(capacity=220, max_running=8, grammar_backend=backend, schedule_conservativeness=0.3)
    specs = {f"g{i}": (_prompt(12, 20 + i), f"mod={2 + i % 3},len=45") for i in range(6)}
    for rid, (p, spec) in specs.items():
        h.submit(p, rid=rid, regex=spec, max_new_tokens=60)
    _steps(h, 3)
    reqs = [r for r in h.scheduler.live_reqs() + h.scheduler.waiting if r.rid in specs]
    assert reqs and all(r.grammar is not None for r in reqs)
    h.run()
    for rid, (p, spec) in specs.items():
        assert h.tokens(rid) == constrained_reference(p, spec, 60)[0], rid
        assert h.final(rid).finish_reason["type"] == "stop"
    assert sum(h.final(rid).num_retractions for rid in specs) > 0, "the pool was meant to force retractions"
    assert all(r.grammar is None for r in reqs)
    h.assert_idle_and_conserved()


def test_storm_of_constrained_and_free_requests_with_aborts():
    rng = random.Random(17)
    backend = FakeGrammarBackend()
    h = make_harness(capacity=160, max_running=16, chunk=16, grammar_backend=backend,
                     schedule_conservativeness=0.3)
    grammars = [f"mod={m},len={n}" for m, n in ((2, 9), (3, 25), (5, 40), (7, 4))] + ["bad-1", "bad-2"]
    expect: dict[str, tuple[list[int], str | None]] = {}
    live: list[str] = []
    for i in range(160):
        p = _prompt(rng.randrange(4, 30), 500 + i)
        n = rng.randrange(1, 50)
        rid = f"s{i}"
        kind = rng.random()
        rids = [f"{rid}_{c}" for c in range(3)] if rng.random() < 0.1 else [rid]
        for r in rids:
            if kind < 0.5:
                spec = rng.choice(grammars)
                h.submit(p, rid=r, max_new_tokens=n, stream=bool(i % 2), **{rng.choice(["regex", "ebnf"]): spec})
                expect[r] = (None, "400") if spec.startswith("bad") else constrained_reference(p, spec, n)
            else:
                h.submit(p, rid=r, max_new_tokens=n, stream=bool(i % 2))
                expect[r] = (reference_output(p, n), "length")
            live.append(r)
        if rng.random() < 0.3:
            backend.gate.clear()  # let some requests sit in the grammar queue for a while
        for _ in range(rng.randrange(0, 3)):
            h.scheduler.step()
            h.scheduler.check_integrity()
        backend.gate.set()
        roll = rng.random()
        if roll < 0.15:
            h.scheduler.abort(AbortReq(rid=rng.choice(live)))
        elif roll < 0.17:
            h.scheduler.abort(AbortReq(rid=rid))  # a family by its parent rid
        elif roll < 0.175:
            h.scheduler.abort(AbortReq(abort_all=True))
    h.run()
    aborted = 0
    for rid, (ref, finish) in expect.items():
        fin = h.final(rid)  # exactly one terminal output, and it is the last one
        fr, toks = fin.finish_reason, h.tokens(rid)
        if finish == "400":
            assert fr["type"] == "abort" and fr["status_code"] in (400, 200), rid
            assert toks == []
            continue
        assert toks == ref[:len(toks)], rid  # never a token outside the undisturbed output
        if fr["type"] == "abort":
            aborted += 1
        else:
            assert toks == ref and fr["type"] == finish, rid
    assert aborted > 5
    assert h.scheduler.stats.num_retractions > 0
    h.assert_idle_and_conserved()


def test_compile_cache_is_bounded_but_keeps_what_requests_wait_for():
    backend = FakeGrammarBackend()
    q = GrammarQueue(backend, cache_size=2)
    keys = [("regex", f"mod={m},len=3") for m in (2, 3, 5, 7)]
    for key in keys:
        q.add(Req(rid=key[1], origin_input_ids=[1], sampling_params=SamplingParams()), key)
        q.wait(5)
        ready, failed = q.pop_ready()
        assert len(ready) == 1 and not failed and ready[0].grammar is not None
    assert list(q._cache) == keys[2:]  # least recently used finished compiles dropped
    backend.gate.clear()
    waiting = [Req(rid=f"w{i}", origin_input_ids=[1], sampling_params=SamplingParams()) for i in range(3)]
    for i, r in enumerate(waiting):
        q.add(r, ("ebnf", f"mod={i + 2},len=2"))
    assert len(q._cache) == 3  # over the limit rather than dropping a compile someone waits for
    backend.gate.set()
    deadline = time.monotonic() + 10
    while len(q):
        assert time.monotonic() < deadline, "compiles never finished"
        q.wait(0.05)
        q.pop_ready()
    q.shutdown()

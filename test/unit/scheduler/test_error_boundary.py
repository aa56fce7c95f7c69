"""The per-request error boundary (scheduler/error_boundary.py): a failure injected into one
request's row ends that request with a 500 abort; co-batched requests finish with exactly
the tokens they would have produced alone; every KV slot comes back (check_integrity runs
after every step); nothing a failed forward wrote is published in the prefix tree. Every
test runs with the overlap loop on and off (conftest.py)."""
from __future__ import annotations

import random

import pytest

from radixlm.messages import TokenizedGenerateReq
from radixlm.sampling_params import SamplingParams

from .fake_runner import reference_output
from .harness import make_harness

POISON = "poison"


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(97) for _ in range(n)]


def _raise_for_poison(after_tokens: int = 0):
    def hook(batch) -> None:
        for i, req in enumerate(batch.reqs):
            # the batch's own view of the output (overlap: the live list may be ahead)
            out = batch.output_snapshots[i] if batch.output_snapshots is not None else req.output_ids
            if req.rid == POISON and len(out) >= after_tokens:
                raise RuntimeError("injected failure")
    return hook


def _submit_group(h, n: int = 5, max_new: int = 8) -> dict[str, list[int]]:
    prompts = {f"ok{i}": _prompt(10 + i, i) for i in range(n)}
    for rid, p in prompts.items():
        h.submit(p, rid=rid, max_new_tokens=max_new)
    return prompts


def _check_others(h, prompts: dict[str, list[int]], max_new: int = 8) -> None:
    for rid, p in prompts.items():
        assert h.tokens(rid) == reference_output(p, max_new), rid
        assert h.final(rid).finish_reason["type"] == "length"


def _check_poison_aborted(h) -> dict:
    fr = h.final(POISON).finish_reason
    assert fr["type"] == "abort" and fr["status_code"] == 500 and "internal error" in fr["message"]
    return fr


@pytest.mark.parametrize("where", ["forward", "result"])
@pytest.mark.parametrize("after_tokens", [0, 3])
def test_a_failing_row_ends_that_request_only(where, after_tokens):
    h = make_harness()
    hook = _raise_for_poison(after_tokens)
    if where == "forward":
        h.runner.fail_forward = hook
    else:
        h.runner.fail_result = hook
    prompts = _submit_group(h)
    poison_prompt = _prompt(12, 99)
    h.submit(poison_prompt, rid=POISON, max_new_tokens=8)
    h.run()
    _check_others(h, prompts)
    _check_poison_aborted(h)
    assert len(h.tokens(POISON)) <= after_tokens
    assert h.scheduler.stats["num_request_errors"] >= 1 and h.scheduler.stats["num_batch_replays"] >= 1
    h.assert_idle_and_conserved()
    # KV of the failed request past its last good prefill is freed, not cached: a request
    # continuing its sequence finds at most the prompt (published by a successful prefill)
    h.runner.fail_forward = h.runner.fail_result = None
    seq = poison_prompt + h.tokens(POISON)
    again = h.submit(seq, max_new_tokens=2)
    h.run()
    assert h.final(again).cached_tokens <= (0 if after_tokens == 0 else len(poison_prompt))
    assert h.tokens(again) == reference_output(seq, 2)
    h.assert_idle_and_conserved()


def test_every_row_failing_ends_every_request_and_the_scheduler_keeps_going():
    h = make_harness()
    h.runner.fail_forward = lambda batch: (_ for _ in ()).throw(RuntimeError("model broken"))
    rids = [h.submit(_prompt(8, i), max_new_tokens=4) for i in range(3)]
    h.run()
    assert all(h.final(r).finish_reason["status_code"] == 500 for r in rids)
    h.assert_idle_and_conserved()
    h.runner.fail_forward = None
    ok = h.submit(_prompt(8, 7), max_new_tokens=4)
    h.run()
    assert h.tokens(ok) == reference_output(_prompt(8, 7), 4)


def test_output_processing_failure(monkeypatch):
    h = make_harness()
    real = h.scheduler.stop_checker.check

    def check(req):
        if req.rid == POISON and len(req.output_ids) == 2:
            raise ValueError("injected in the stop check")
        real(req)
    monkeypatch.setattr(h.scheduler.stop_checker, "check", check)
    prompts = _submit_group(h)
    h.submit(_prompt(12, 99), rid=POISON, max_new_tokens=8)
    h.run()
    _check_others(h, prompts)
    fr = _check_poison_aborted(h)
    assert "processing its output" in fr["message"]
    h.assert_idle_and_conserved()


def test_admission_failure(monkeypatch):
    h = make_harness()
    real = h.cache.match
    monkeypatch.setattr(h.cache, "match", lambda req: (_ for _ in ()).throw(KeyError("injected"))
                        if req.rid == POISON else real(req))
    prompts = _submit_group(h)
    h.submit(_prompt(12, 99), rid=POISON, max_new_tokens=8)
    h.run()
    _check_others(h, prompts)
    assert "being scheduled" in _check_poison_aborted(h)["message"]
    h.assert_idle_and_conserved()


def test_a_message_the_scheduler_cannot_take_is_answered():
    h = make_harness()
    prompts = _submit_group(h)
    h.scheduler.handle(TokenizedGenerateReq(rid=POISON, input_ids=None, sampling_params=SamplingParams()))
    h.run()
    _check_others(h, prompts)
    assert "being admitted" in _check_poison_aborted(h)["message"]
    h.assert_idle_and_conserved()


def test_grammar_rows_replay_when_the_failure_came_before_their_matchers_moved():
    from .fake_grammar import FakeGrammarBackend, constrained_reference
    h = make_harness(grammar_backend=FakeGrammarBackend())
    h.runner.fail_forward = _raise_for_poison(2)  # raises before any matcher of the batch advances
    spec = "mod=3,len=6"
    prompt = _prompt(9, 5)
    g = h.submit(prompt, rid="g", max_new_tokens=10, regex=spec)
    prompts = _submit_group(h, n=2)
    h.submit(_prompt(12, 99), rid=POISON, max_new_tokens=8)
    h.run()
    _check_others(h, prompts)
    _check_poison_aborted(h)
    want, kind = constrained_reference(prompt, spec, 10)
    assert h.tokens(g) == want and h.final(g).finish_reason["type"] == kind
    h.assert_idle_and_conserved()


def test_grammar_rows_whose_matcher_moved_are_ended_not_replayed():
    """A batch failing after its matchers took their tokens (here: reading its result) cannot
    run its grammar rows again; they end with a 500 too (documented limitation)."""
    from .fake_grammar import FakeGrammarBackend
    h = make_harness(grammar_backend=FakeGrammarBackend())
    h.runner.fail_result = _raise_for_poison(2)
    g = h.submit(_prompt(9, 5), rid="g", max_new_tokens=10, regex="mod=3,len=8")
    prompts = _submit_group(h, n=2)
    h.submit(_prompt(12, 99), rid=POISON, max_new_tokens=8)
    h.run()
    _check_others(h, prompts)
    _check_poison_aborted(h)
    assert h.final(g).finish_reason["status_code"] == 500
    h.assert_idle_and_conserved()

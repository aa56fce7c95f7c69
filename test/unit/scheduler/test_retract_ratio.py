"""new_token_ratio constants (semantics §4) and retraction victim order."""
import pytest

from radixlm.core import Req
from radixlm.sampling_params import SamplingParams
from radixlm.scheduler.retract import NewTokenRatioTracker, retraction_order


def _req(rid, prompt, out, max_new=100, priority=0):
    r = Req(rid, [1] * prompt, SamplingParams(max_new_tokens=max_new), priority=priority)
    r.output_ids = [2] * out
    return r


def test_ratio_init_floor_decay_and_reset():
    t = NewTokenRatioTracker(1.0)
    assert t.value == pytest.approx(0.7)
    assert t.floor == pytest.approx(0.7 * 0.14)
    for _ in range(300):
        t.on_decode_step()
    assert t.value == pytest.approx(0.7 - 300 * (0.7 - 0.098) / 600)
    for _ in range(400):
        t.on_decode_step()
    assert t.value == pytest.approx(t.floor)  # linear decay to the floor over 600 steps
    t.on_idle()
    assert t.value == pytest.approx(0.7)
    assert NewTokenRatioTracker(2.0).value == 1.0  # capped at 1


def test_ratio_after_retract_and_recovery():
    """sglang#26248: after a retraction the ratio jumps, then decays again, so admission
    (and decode batch size) recovers instead of collapsing."""
    t = NewTokenRatioTracker(1.0)
    remaining = [_req("a", 10, 30, 200), _req("b", 10, 10, 100)]
    t.on_retract(remaining)
    assert t.value == pytest.approx(min(1.0, (40 + 20 * 2) / (300 + 1)))
    high = t.value
    for _ in range(100):
        t.on_decode_step()
    assert t.value < high


def test_victim_order_length_and_priority():
    reqs = [_req("long_out", 10, 50), _req("short_out_short_prompt", 5, 2), _req("short_out_long_prompt", 40, 2)]
    order = retraction_order(reqs, "length")
    assert [r.rid for r in reversed(order)] == ["short_out_long_prompt", "short_out_short_prompt", "long_out"]
    reqs = [_req("hi", 10, 1, priority=5), _req("lo", 10, 30, priority=-1)]
    assert retraction_order(reqs, "priority")[-1].rid == "lo"

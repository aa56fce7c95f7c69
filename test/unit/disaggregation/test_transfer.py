"""The rooms state machines of prefill/decode disaggregation (radixlm/disaggregation), driven
through two real schedulers over fake runners whose KV records tokens, with message-level
faults: delay, drop, duplicate, reorder, a chunk after an abort, a dead peer.

Every scenario ends with: exactly one terminal answer per request on each side, no slot held
on either side (check_integrity after every step, conservation at the end), and outputs equal
to the co-located reference (the fake runner also asserts, on every forward, that a request
reads only its own tokens)."""
from __future__ import annotations

import pytest

from radixlm.scheduler.requests import Place

from test.support.fake_runner import reference_output
from test.support.pd_harness import make_pair

PROMPT = list(range(1, 20))


def _check_ok(pair, rid, prompt, max_new):
    assert pair.d.tokens(rid) == reference_output(prompt, max_new)
    assert pair.d.final(rid).finish_reason["type"] in ("length", "stop")
    assert pair.p.final(rid).finish_reason["type"] != "abort"


def _check_abort(pair, rid, status=None):
    fin = pair.d.final(rid).finish_reason
    assert fin["type"] == "abort", fin  # never "length" for a request whose KV did not come
    if status is not None:
        assert fin["status_code"] == status, fin
    pair.p.final(rid)  # the prefill side answered too, exactly once
    return fin


@pytest.mark.parametrize("overlap", [False, True])
def test_kv_moves_and_decode_continues_from_it(overlap):
    pair = make_pair(overlap=overlap)
    for i in range(3):
        pair.submit(PROMPT + [i], f"r{i}", max_new_tokens=5)
    pair.run()
    for i in range(3):
        _check_ok(pair, f"r{i}", PROMPT + [i], 5)
    # the decode server computed no prompt: one forward token per output after the first
    assert pair.d.runner.tokens_computed == 3 * 4
    assert pair.dtx.counters.rooms_completed == pair.ptx.counters.rooms_completed == 3
    assert pair.dtx.counters.bytes == 3 * 20 * 8
    pair.assert_clean()


def test_shared_prefix_is_computed_once_on_the_prefill_side_and_sent_each_time():
    pair = make_pair()
    pair.submit(PROMPT, "a", max_new_tokens=3)
    pair.run()
    pair.submit(PROMPT + [5, 6], "b", max_new_tokens=3)
    pair.run()
    assert pair.p.final("b").cached_tokens == len(PROMPT)
    assert pair.p.runner.tokens_computed == len(PROMPT) + 2
    _check_ok(pair, "b", PROMPT + [5, 6], 3)
    # the decode server holds the first prompt in its tree by then: only the rest travels
    assert pair.ptx.counters.bytes == (len(PROMPT) + 2) * 8
    pair.assert_clean()


def test_decode_side_prefix_asks_only_for_the_rest():
    """Multi-turn: the decode server's tree holds the first turn (it inserted what it received
    and generated), so the second turn's WANT starts after it."""
    pair = make_pair()
    pair.submit(PROMPT, "t1", max_new_tokens=4)
    pair.run()
    turn2 = PROMPT + pair.d.tokens("t1") + [7, 8]
    before = pair.dtx.counters.bytes
    pair.submit(turn2, "t2", max_new_tokens=4)
    pair.run()
    _check_ok(pair, "t2", turn2, 4)
    assert pair.d.final("t2").cached_tokens >= len(PROMPT)
    assert pair.dtx.counters.bytes - before <= (len(turn2) - len(PROMPT)) * 8
    pair.assert_clean()


def test_n_children_share_a_room_by_index():
    pair = make_pair()
    pair.submit(PROMPT, "f", n=3, max_new_tokens=4)
    pair.run()
    for i in range(3):
        _check_ok(pair, f"f_{i}", PROMPT, 4)
    assert pair.dtx.counters.rooms_completed == 3
    pair.assert_clean()


def test_first_token_ends_the_request():
    pair = make_pair()
    pair.submit(PROMPT, "one", max_new_tokens=1)
    pair.run()
    _check_ok(pair, "one", PROMPT, 1)
    assert pair.d.runner.tokens_computed == 0
    pair.assert_clean()


@pytest.mark.parametrize("fault", ["dup", "reorder", "hold_then_release"])
def test_duplicates_reorder_and_delay_still_give_the_same_tokens(fault):
    if fault == "dup":
        pair = make_pair(fault=lambda d, h: "dup")
    elif fault == "reorder":
        pair = make_pair(reorder_seed=7)
    else:
        pair = make_pair(fault=lambda d, h: "hold" if d == "p2d" and h[0] == "kv" else "deliver")
    for i in range(4):
        pair.submit(PROMPT + [i], f"r{i}", max_new_tokens=4)
    if fault == "hold_then_release":
        for _ in range(10):
            pair.step()
        assert pair.dtx.counters.rooms_completed == 0  # DONE came, chunks did not: no decode
        assert all(r.done is not None for r in pair.dtx.rooms.values())
        pair.wire.fault = None
        pair.wire.release("p2d")
    pair.run()
    for i in range(4):
        _check_ok(pair, f"r{i}", PROMPT + [i], 4)
    if fault == "dup":
        assert pair.dtx.counters.duplicate_chunks > 0
    pair.assert_clean()


def test_a_dropped_chunk_never_decodes_and_times_out_on_both_sides():
    dropped = []

    def drop_one(direction, header):
        if direction == "p2d" and header[0] == "kv" and not dropped:
            dropped.append(header)
            return "drop"
        return "deliver"
    pair = make_pair(fault=drop_one, timeout_s=5.0)
    pair.submit(PROMPT, "x", max_new_tokens=4)
    pair.run()
    fin = _check_abort(pair, "x", 503)
    assert "timed out" in fin["message"]
    assert pair.d.tokens("x") == []
    assert pair.d.runner.tokens_computed == 0
    # whichever side's clock notices first ends it and tells the other
    assert pair.dtx.counters.rooms_timed_out + pair.ptx.counters.rooms_timed_out >= 1
    assert pair.p.final("x").finish_reason["type"] == "abort"
    pair.assert_clean()


@pytest.mark.parametrize("overlap", [False, True])
def test_a_chunk_after_a_decode_side_abort_is_dropped_never_written(overlap):
    """The decode side aborts while the transfer is in flight, its slots go to the next request
    at once, then the dead room's chunks arrive: they are dropped, the new request's KV is intact."""
    pair = make_pair(fault=lambda d, h: "hold" if d == "p2d" and h[0] in ("kv", "done") else "deliver",
                     d_args={"capacity": 24}, overlap=overlap)  # the next request must take the victim's slots
    pair.submit(PROMPT, "victim", max_new_tokens=4)
    for _ in range(6):
        pair.step()
    room = next(iter(pair.dtx.rooms.values()))
    assert room.allocated and pair.wire.held["p2d"], "the transfer should be in flight"
    slots = pair.d.cache.req_to_token_pool.req_to_token[room.req.req_pool_idx, :len(PROMPT)].clone()
    pair.abort("decode", "victim")
    # the next request gets the very slots the dead room was writing
    pair.wire.fault = None
    other = [60 + i for i in range(len(PROMPT))]
    pair.submit(other, "next", max_new_tokens=4)  # allocated at once
    nroom = next(r for r in pair.dtx.rooms.values() if r.req.rid == "next")
    now = pair.d.cache.req_to_token_pool.req_to_token[nroom.req.req_pool_idx, :len(other)]
    assert set(now.tolist()) & set(slots.tolist()), "the freed slots were not reused (test premise)"
    for _ in range(4):
        pair.step()
    pair.wire.release("p2d")  # the victim's late chunks and DONE
    pair.run()
    assert pair.dtx.counters.dropped_messages > 0
    _check_abort(pair, "victim")
    _check_ok(pair, "next", other, 4)
    pair.assert_clean()


@pytest.mark.parametrize("overlap", [False, True])
def test_prefill_side_abort_reaches_the_decode_side_as_an_abort_not_length(overlap):
    pair = make_pair(fault=lambda d, h: "hold" if d == "d2p" and h[0] == "want" else "deliver", overlap=overlap)
    pair.submit(PROMPT, "c", max_new_tokens=4)
    for _ in range(6):
        pair.step()
    assert pair.p.scheduler.requests.count(Place.TRANSFER) == 1  # prefilled, waiting for the WANT
    pair.abort("prefill", "c")
    pair.wire.fault = None
    pair.wire.release("d2p")
    pair.run()
    fin = _check_abort(pair, "c")
    assert fin["status_code"] != 200 and "prefill" not in fin.get("matched", "")
    assert pair.dtx.counters.rooms_aborted_by_peer == 1
    pair.assert_clean()


def test_prefill_refuses_an_over_long_prompt_and_the_decode_side_answers_400():
    pair = make_pair(p_args={"context": 16})  # the decode server would take it
    pair.run()
    pair.p.runner.max_context_len = 16
    pair.submit(PROMPT, "long", max_new_tokens=4)
    pair.run()
    _check_abort(pair, "long", 400)
    assert pair.d.runner.tokens_computed == 0
    pair.assert_clean()


@pytest.mark.parametrize("dead", ["prefill", "decode"])
def test_a_dead_peer_times_out_and_every_slot_is_reclaimed(dead):
    pair = make_pair(timeout_s=5.0)
    pair.submit(PROMPT, "a", max_new_tokens=4)
    pair.submit(PROMPT + [1], "b", max_new_tokens=4)
    pair.wire.dead.add(dead)
    pair.run()
    survivor = pair.d if dead == "prefill" else pair.p
    for rid in ("a", "b"):
        fin = survivor.final(rid).finish_reason
        assert fin["type"] == "abort" and fin["status_code"] == 503, fin
    tx = pair.dtx if dead == "prefill" else pair.ptx
    assert tx.counters.rooms_timed_out >= 1
    survivor.assert_idle_and_conserved()
    assert not tx.rooms


def test_decode_side_retraction_re_prefills_locally():
    """A decode server short of KV retracts a request that came by transfer; it resumes by
    computing its prompt + output here (its room is done), and the tokens are unchanged."""
    pair = make_pair(d_args={"capacity": 96})
    prompts = [[10 * i + j for j in range(1, 20)] for i in range(4)]
    for i, pr in enumerate(prompts):
        pair.submit(pr, f"q{i}", max_new_tokens=14, ignore_eos=True)
    pair.run()
    assert pair.d.scheduler.stats.num_retractions > 0
    for i, pr in enumerate(prompts):
        _check_ok(pair, f"q{i}", pr, 14)
    pair.assert_clean()


@pytest.mark.parametrize("abort_one", [False, True])
def test_decode_side_retraction_with_hicache_loads_back_from_the_host_tier(abort_one):
    """With HiCache on the decode server, a retracted request's KV (received by transfer, then
    decoded) is backed up to the host tier and loaded back on resume; fresh slots are
    poisoned, so KV that did not arrive (or was not loaded) fails the forward. An abort of a
    retracted request while its copies are in flight leaks nothing."""
    pair = make_pair(decode_hicache=True, d_args={"capacity": 96})
    prompts = [[10 * i + j for j in range(1, 20)] for i in range(4)]
    for i, pr in enumerate(prompts):
        pair.submit(pr, f"h{i}", max_new_tokens=14, ignore_eos=True)
    aborted = None
    for _ in range(2000):
        if pair.idle():
            break
        pair.step()
        if abort_one and aborted is None:
            waiting = [r for r in pair.d.scheduler.waiting if r.num_retractions]
            if waiting:
                aborted = waiting[0].rid
                pair.abort("decode", aborted)
    pair.run()
    assert pair.d.scheduler.stats.num_retractions > 0
    stats = pair.d.stats()
    assert stats["host_hit_tokens"] > 0 or abort_one, stats
    for i, pr in enumerate(prompts):
        if f"h{i}" == aborted:
            assert pair.d.final(aborted).finish_reason["type"] == "abort"
        else:
            _check_ok(pair, f"h{i}", pr, 14)
    pair.d.settle()
    pair.assert_clean()


def test_a_request_timeout_applies_while_it_waits_for_its_kv():
    pair = make_pair(fault=lambda d, h: "hold" if d == "p2d" and h[0] == "done" else "deliver")
    from radixlm.messages import TokenizedGenerateReq
    from radixlm.sampling_params import SamplingParams
    pair.p.scheduler.add_request(TokenizedGenerateReq(rid="t", input_ids=PROMPT, sampling_params=SamplingParams(
        max_new_tokens=4), bootstrap=("prefill", 1, 77, 0)))
    pair.d.scheduler.add_request(TokenizedGenerateReq(rid="t", input_ids=PROMPT, sampling_params=SamplingParams(
        max_new_tokens=4), bootstrap=("prefill", 1, 77, 0), timeout=5.0))
    for _ in range(5):
        pair.step()
    pair.d.scheduler.requests.first(Place.TRANSFER).created_time -= 10  # its deadline has passed
    pair.run()
    fin = _check_abort(pair, "t", 503)
    assert pair.d.runner.tokens_computed == 0, fin
    pair.assert_clean()


def test_abort_while_waiting_for_decode_slots_and_duplicate_rooms():
    pair = make_pair(d_args={"capacity": 24})
    pair.submit(PROMPT, "big", max_new_tokens=3)
    pair.submit([50 + i for i in range(19)], "waits", max_new_tokens=3)  # no room for its slots yet
    pair.step()
    waiting = [r for r in pair.dtx.rooms.values() if not r.allocated]
    assert waiting and waiting[0].req.rid == "waits"
    pair.abort("decode", "waits")
    room = pair.submit(PROMPT, "dup", max_new_tokens=3, to=("decode",), room=1)  # room 1 is "big"'s
    assert room == 1
    pair.run()
    assert pair.d.final("dup").finish_reason["status_code"] == 400
    _check_ok(pair, "big", PROMPT, 3)
    _check_abort(pair, "waits")
    pair.assert_clean()

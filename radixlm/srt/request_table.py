"""The front end's request table: every request the TokenizerManager knows, from its arrival
to its answer, where it is, which family it belongs to, and what an abort finds.

Places before the scheduler (docs/cancel_chain.md): `tokenizing`, `paused` (held until
continue_generation), `weight_lock` (waiting for the read side of the weight-update lock);
then `sent`. A request answered at the front end while the scheduler still holds it is
`draining` until the scheduler's own terminal output for it arrives, which is dropped.
An abort that finds nothing leaves a short-lived tombstone, applied when the rid arrives.

Families are known by identity: a call's `n` > 1 children are recorded when the call's
requests are created, so an abort of `job` reaches `job`'s own children and never an
unrelated `job_1`. Matching by prefix happens only when asked for.
"""
from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field
from typing import Any

from radixlm.messages import DetokParams, ReqOutput, ReqTextOutput

# An abort that hits nothing is kept this long for a request that has not arrived yet.
TOMBSTONE_TTL_S = 10.0
MAX_TOMBSTONES = 1024
# Answered rids are remembered as long: an abort that comes after the answer is a no-op, not
# a tombstone that would abort a later request reusing the rid.
MAX_RECENT = 4096
# Requests answered at the front end whose scheduler half has not reported its end yet.
MAX_DRAINING = 65536
# (rid, wall time) of the latest aborts accepted at the front end (latency benchmarks).
RECENT_ABORTS = 256

USER_ABORT = {"type": "abort", "message": "Aborted by the client", "status_code": 200}

TOKENIZING, PAUSED, WEIGHT_LOCK, SENT = "tokenizing", "paused", "weight_lock", "sent"


def abort_reason(message: str, status_code: int) -> dict:
    return {"type": "abort", "message": message, "status_code": status_code}


@dataclass(eq=False)
class ReqState:
    """One scheduler-level request as its caller sees it (meta_info["id"] is `rid`)."""
    rid: str
    prompt_tokens: int
    stream: bool
    call: "Call"
    parent: str | None = None  # the caller's rid of an n > 1 family
    # The scheduler's id: unique per submission, so a late output of an aborted request can
    # never be mistaken for a new request that reuses its rid.
    sched_rid: str = ""
    sent: bool = False
    done: bool = False  # its terminal output is in `pending` or absorbed
    # [version, index of the first output token computed under it]; more than one segment
    # only when a weight update came while the request was paused.
    weight_versions: list[list] = field(default_factory=list)
    start: float = field(default_factory=time.perf_counter)
    pending: list[ReqTextOutput] = field(default_factory=list)
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    finish_reason: dict | None = None
    cached_tokens: int = 0
    num_retractions: int = 0
    # speculative decoding: (verify steps, draft tokens, accepted tokens); None when off
    spec: tuple[int, int, int] | None = None
    output_token_logprobs: list = field(default_factory=list)
    output_top_logprobs: list = field(default_factory=list)
    input_token_logprobs: list | None = None
    input_top_logprobs: list | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    detok: DetokParams | None = None  # from its first output (text_at_end: see _answer_text)
    # a logprob position's top list: the top_logprobs_num best, then token_ids_logprob's entries
    top_logprobs_num: int = 0
    token_ids_logprob: tuple[int, ...] = ()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def terminal_output(st: ReqState, reason: dict) -> ReqTextOutput:
    """The front end's own final output for `st`: what was received so far, and `reason`."""
    last = st.pending[-1].out if st.pending else None
    received = len(st.output_ids) + sum(len(p.out.new_token_ids) for p in st.pending)
    return ReqTextOutput(ReqOutput(
        rid=st.sched_rid, new_token_ids=[], finish_reason=reason, prompt_tokens=st.prompt_tokens,
        completion_tokens=received, cached_tokens=last.cached_tokens if last else st.cached_tokens,
        num_retractions=last.num_retractions if last else st.num_retractions), "")


class Call:
    """One generate call: the caller's rids (one per prompt), then its requests."""

    def __init__(self, rids: list[str], n_hints: list[int], is_batch: bool) -> None:
        self.rids = rids
        self.n_hints = dict(zip(rids, n_hints))  # expected family sizes, for abort counts
        self.is_batch = is_batch
        self.place = TOKENIZING
        self.registered = False
        self.aborted: dict[str, dict] = {}  # caller rid -> reason, before its requests exist
        self.states: list[ReqState] = []
        self.wake = asyncio.Event()  # any output, abort or error for this call
        self.error: BaseException | None = None
        self.holds_read = False  # the read side of the weight lock

    @property
    def all_answered(self) -> bool:
        if self.registered:
            return all(st.done for st in self.states)
        return len(self.aborted) == len(self.rids)

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.wake.set()


class RequestTable:
    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.names: dict[str, Call] = {}  # every rid in use (callers' and children) -> its call
        self.states: dict[str, ReqState] = {}
        self.by_sched: dict[str, ReqState] = {}
        self.families: dict[str, list[str]] = {}  # parent rid -> children, while the call lives
        self.draining: collections.OrderedDict[str, float] = collections.OrderedDict()
        self.recent_aborts: collections.deque[tuple[str, float]] = collections.deque(maxlen=RECENT_ABORTS)
        self._tombstones: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._recent: collections.OrderedDict[str, float] = collections.OrderedDict()

    # ------------------------------------------------------------------ arrival
    def arrive(self, rids: list[str], n_hints: list[int], is_batch: bool) -> Call:
        """Claim the caller's rids (a duplicate of a live rid is refused) and apply tombstones."""
        if not all(isinstance(r, str) and r for r in rids):
            raise ValueError("rid must be a non-empty string")
        if len(set(rids)) != len(rids):
            raise ValueError("rids within one call must be distinct")
        for r in rids:
            if r in self.names:
                raise ValueError(f"duplicate request id {r!r}: a request with this id is running")
        call = Call(rids, n_hints, is_batch)
        self.calls.append(call)
        for r in rids:
            self.names[r] = call
            self._recent.pop(r, None)
            if self._take_tombstone(r):
                call.aborted[r] = USER_ABORT
        return call

    def register(self, call: Call, reqs: list, parents: list[str | None]) -> list[ReqState]:
        """Create the call's requests, in one step with no await: the children's names are
        claimed, tombstones and aborts of the call's rids applied (those are answered now)."""
        for r, p in zip(reqs, parents):
            owner = self.names.get(r.rid)
            if p is not None and owner is not None and (owner is not call or r.rid in call.rids):
                raise ValueError(f"duplicate request id {r.rid!r}: a request with this id is running")
        for r, p in zip(reqs, parents):
            st = ReqState(r.rid, len(r.input_ids), bool(r.stream), call, parent=p,
                          top_logprobs_num=r.top_logprobs_num, token_ids_logprob=r.token_ids_logprob)
            self.names[r.rid] = call
            self.states[r.rid] = st
            call.states.append(st)
            if p is not None:
                self.families.setdefault(p, []).append(r.rid)
            reason = call.aborted.get(p if p is not None else r.rid)
            if reason is None and p is not None and self._take_tombstone(r.rid):
                reason = USER_ABORT
            if reason is not None:
                st.done = True
                st.pending.append(terminal_output(st, reason))
        call.registered = True
        return call.states

    def send(self, st: ReqState, sched_rid: str) -> None:
        st.sched_rid, st.sent = sched_rid, True
        self.by_sched[sched_rid] = st

    # ------------------------------------------------------------------ abort
    def find(self, rid: str, abort_all: bool, prefix: bool) -> tuple[list[tuple[Call, str]], list[ReqState]]:
        """What an abort names and has not answered yet: callers' rids whose requests do not
        exist yet (tokenizing), and requests. Exact: the rid itself and its own children."""
        if abort_all or prefix:
            calls = self.calls
        else:
            call = self.names.get(rid)
            calls = [call] if call is not None else []

        def hit(name: str | None) -> bool:
            return name is not None and (abort_all or (name.startswith(rid) if prefix else name == rid))
        early: list[tuple[Call, str]] = []
        reqs: list[ReqState] = []
        for call in calls:
            if call.registered:
                reqs += [st for st in call.states if not st.done and (hit(st.rid) or hit(st.parent))]
            else:
                early += [(call, r) for r in call.rids if r not in call.aborted and hit(r)]
        return early, reqs

    def detach(self, st: ReqState) -> None:
        """`st` was answered at the front end: later scheduler outputs for it are dropped."""
        if st.sent and self.by_sched.get(st.sched_rid) is st:
            del self.by_sched[st.sched_rid]
            self.draining[st.sched_rid] = time.time()
            while len(self.draining) > MAX_DRAINING:
                self.draining.popitem(last=False)

    def drop(self, out: ReqOutput) -> None:
        """An output for a request the front end already answered."""
        if out.finish_reason is not None:
            self.draining.pop(out.rid, None)  # the scheduler let it go

    def tombstone(self, rid: str) -> bool:
        """Keep an abort of a rid that is not here (and not just answered) for its arrival."""
        now = time.monotonic()
        self._expire(now)
        if not rid or rid in self.names or rid in self._recent:
            return False
        self._tombstones[rid] = now + TOMBSTONE_TTL_S
        self._tombstones.move_to_end(rid)
        while len(self._tombstones) > MAX_TOMBSTONES:
            self._tombstones.popitem(last=False)
        return True

    def _take_tombstone(self, rid: str) -> bool:
        expiry = self._tombstones.pop(rid, None)
        return expiry is not None and expiry > time.monotonic()

    def _expire(self, now: float) -> None:
        for od in (self._tombstones, self._recent):
            while od and next(iter(od.values())) <= now:
                od.popitem(last=False)

    # ------------------------------------------------------------------ end
    def end(self, call: Call) -> None:
        """The call answered its caller: free its names (remembered as recently answered)."""
        now = time.monotonic()
        self._expire(now)
        for st in call.states:
            if self.states.get(st.rid) is st:
                del self.states[st.rid]
            if st.sent and self.by_sched.get(st.sched_rid) is st:
                del self.by_sched[st.sched_rid]
        for p in call.rids:
            if p in self.families and self.names.get(p) is call:
                del self.families[p]
        for name in call.rids + [st.rid for st in call.states]:
            if self.names.get(name) is call:
                del self.names[name]
                self._recent[name] = now + TOMBSTONE_TTL_S
                self._recent.move_to_end(name)
        while len(self._recent) > MAX_RECENT:
            self._recent.popitem(last=False)
        if call in self.calls:
            self.calls.remove(call)

    # ------------------------------------------------------------------ reporting
    def places(self) -> dict[str, Any]:
        """How many requests are in each front-end place right now."""
        counts = {TOKENIZING: 0, PAUSED: 0, WEIGHT_LOCK: 0, SENT: 0}
        for call in self.calls:
            if not call.registered:
                counts[TOKENIZING] += sum(call.n_hints[r] for r in call.rids if r not in call.aborted)
                continue
            for st in call.states:
                if not st.done:
                    counts[SENT if st.sent else call.place] += 1
        self._expire(time.monotonic())
        return {**counts, "draining": len(self.draining), "tombstones": len(self._tombstones)}

    def num_unsent(self) -> int:
        p = self.places()
        return p[TOKENIZING] + p[PAUSED] + p[WEIGHT_LOCK]

"""Sessions (SGLang's session control, semantics §15): a conversation whose turns continue from
the KV of an earlier turn without matching the prefix cache again.

A session records every finished turn's tokens (prompt + output) by rid, and owns the KV of at
most one finished turn: the `Req` of that turn stays alive after its finish, holding its request
slot and KV (`held`), instead of being released. A new turn naming it takes that KV over at
admission (`CacheManager.hand_over`); a turn that cannot use it (another branch, a different
weight namespace, a shorter prefix than the tree's part) leaves it, and it goes back to the
prefix cache when it is replaced. Every way the held KV leaves a session (a later turn's finish,
close, timeout, abort_all, flush_cache, a weight update) is `CacheManager.release`, through
`release`, once: a held request holds no slot afterwards.
"""
from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from radixlm.core import Req
from radixlm.messages import SessionParams

__all__ = ["Session", "SessionTable", "SessionError"]


class SessionError(ValueError):
    """A turn or a session call the client got wrong (answered with 400)."""


@dataclass
class Turn:
    tokens: list[int]  # the turn's prompt (with the history it continued) and its output
    input_len: int  # how many of `tokens` were its prompt
    parent: str | None


@dataclass
class Session:
    id: str
    capacity: int  # most tokens of KV the session holds
    timeout: float | None  # closed after this long with no turn in flight (s)
    last_active: float
    turns: dict[str, Turn] = field(default_factory=dict)
    held: Req | None = None  # the finished turn whose KV the session owns
    held_name: str | None = None
    # turns in flight: their name in the session and the turn each continues
    in_flight: dict[Req, tuple[str, str | None]] = field(default_factory=dict)


class SessionTable:
    def __init__(self, release: Callable[[Req, bool], None], trim: Callable[[Req], None]) -> None:
        self.sessions: dict[str, Session] = {}
        self._turn_of: dict[Req, Session] = {}  # turns in flight
        self._release = release  # CacheManager.release: the one exit
        self._trim = trim  # give back uncommitted slots (a speculative or overlap step's)
        self.num_handed_over = 0  # turns that continued from session-held KV

    # ------------------------------------------------------------------ open / close
    def open(self, capacity: int, timeout: float | None, now: float, session_id: str | None = None) -> str:
        if capacity < 1:
            raise SessionError(f"capacity_of_str_len must be a positive number of tokens, got {capacity}")
        if timeout is not None and not timeout > 0:
            raise SessionError(f"timeout must be a positive number of seconds, got {timeout}")
        sid = session_id or uuid.uuid4().hex
        if sid in self.sessions:
            raise SessionError(f"session {sid!r} is already open")
        self.sessions[sid] = Session(sid, capacity, timeout, now)
        return sid

    def close(self, sid: str) -> list[Req]:
        """Forget the session and release its KV; returns its turns in flight (the caller
        stops them: they finish as ordinary requests)."""
        session = self.sessions.pop(sid, None)
        if session is None:
            raise SessionError(f"session {sid!r} is not open")
        self._drop_held(session, insert=True)
        for req in session.in_flight:
            del self._turn_of[req]
        return list(session.in_flight)

    def expired(self, now: float) -> list[str]:
        return [s.id for s in self.sessions.values()
                if s.timeout is not None and not s.in_flight and now - s.last_active > s.timeout]

    def drop_kv(self, insert: bool) -> None:
        """Every session gives its KV back (abort_all: to the prefix cache; flush_cache and
        weight updates: freed, insert=False); histories stay, later turns recompute."""
        for session in self.sessions.values():
            self._drop_held(session, insert)

    def _drop_held(self, session: Session, insert: bool) -> None:
        if session.held is not None:
            held, session.held = session.held, None
            self._release(held, insert)

    def held_reqs(self) -> list[Req]:
        """The requests whose KV sessions own (check_integrity counts them as live)."""
        return [s.held for s in self.sessions.values() if s.held is not None]

    # ------------------------------------------------------------------ a new turn
    def prompt(self, params: SessionParams, input_ids: list[int]) -> list[int]:
        """The turn's whole prompt (the history it continues + its input); raises SessionError
        for a turn the session cannot take. Changes nothing (see `start`)."""
        session = self._session(params.id)
        parent = self._parent(session, params)
        prev: list[int] = []
        if parent is not None:
            prev = parent.tokens[:parent.input_len] if params.drop_previous_output else parent.tokens
        if parent is not None and params.offset:
            if not 0 <= params.offset <= len(prev):
                raise SessionError(f"session offset {params.offset} is outside the {len(prev)} tokens of turn "
                                   f"{params.rid!r}")
            prev = prev[:params.offset]
        if len(prev) + len(input_ids) > session.capacity:
            raise SessionError(f"the turn's prompt ({len(prev) + len(input_ids)} tokens) exceeds the session's "
                               f"capacity of {session.capacity} tokens")
        return prev + list(input_ids)

    def start(self, req: Req, params: SessionParams, now: float) -> list[Req]:
        """`req` (validated, with its `prompt`, queued) is a turn of the session from now on. With
        `replace`, the turns after the one named (all, with no rid) leave the session's
        history; returns those still in flight, for the caller to stop."""
        session = self._session(params.id)
        session.last_active = now
        stopped: list[Req] = []
        if params.replace:
            dropped = self._descendants(session, params.rid)
            for rid in dropped:
                del session.turns[rid]
            if session.held is not None and session.held_name in dropped:
                self._drop_held(session, insert=True)
            for turn, (_, parent) in list(session.in_flight.items()):
                if params.rid is None or parent in dropped or parent == params.rid:
                    stopped.append(turn)
                    del session.in_flight[turn]
                    del self._turn_of[turn]
        session.in_flight[req] = (params.turn or req.rid, params.rid)
        self._turn_of[req] = session
        return stopped

    def _session(self, sid: str) -> Session:
        session = self.sessions.get(sid)
        if session is None:
            raise SessionError(f"session {sid!r} is not open")
        return session

    @staticmethod
    def _parent(session: Session, params: SessionParams) -> Turn | None:
        if params.rid is None:
            return None
        turn = session.turns.get(params.rid)
        if turn is None:
            busy = any(name == params.rid for name, _ in session.in_flight.values())
            raise SessionError(f"turn {params.rid!r} of session {session.id!r} "
                               + ("has not finished" if busy else "does not exist"))
        return turn

    @staticmethod
    def _descendants(session: Session, rid: str | None) -> set[str]:
        if rid is None:
            return set(session.turns)
        out: set[str] = set()
        grew = True
        while grew:
            grew = False
            for r, t in session.turns.items():
                if r not in out and (t.parent == rid or t.parent in out):
                    out.add(r)
                    grew = True
        return out

    # ------------------------------------------------------------------ admission
    def source(self, req: Req) -> tuple[Req, int] | None:
        """The session-held request whose KV `req` continues, and how many of its tokens it
        keeps; None when `req` is no such turn (it matches the prefix cache as usual)."""
        session = self._turn_of.get(req)
        if session is None or session.held is None or req.output_ids:
            return None
        held = session.held
        if session.in_flight[req][1] != session.held_name or held.extra_key != req.extra_key:
            return None
        fill, prev = req.fill_ids, held.fill_ids
        keep = 0
        limit = min(len(prev), held.kv_committed_len, len(fill) - 1)
        if req.return_logprob and req.logprob_start_len >= 0:
            limit = min(limit, max(req.logprob_start_len - 1, 0))  # those positions are computed
        while keep < limit and fill[keep] == prev[keep]:
            keep += 1
        return (held, keep) if keep >= held.cache_protected_len and keep > 0 else None

    def handed_over(self, req: Req) -> None:
        session = self._turn_of[req]
        session.held = None
        self.num_handed_over += 1

    # ------------------------------------------------------------------ a turn ends
    def keep(self, req: Req, now: float, usable: bool = True) -> bool:
        """`req` finished and its KV is about to be released: True when its session keeps it
        instead (a turn that ended normally, within the capacity; `usable`: its KV may be
        published); the KV held before goes back to the prefix cache."""
        session = self._turn_of.pop(req, None)
        if session is None:
            return False
        name, parent = session.in_flight.pop(req)
        session.last_active = now
        reason = req.finish_reason
        if not usable or reason is None or reason.type == "abort":
            return False  # an aborted or failed turn is not part of the history
        session.turns[name] = Turn(list(req.fill_ids), len(req.origin_input_ids), parent)
        if req.kv_poisoned or req.req_pool_idx is None or req.kv_committed_len > session.capacity:
            return False
        self._trim(req)  # no draft or overlap slot stays in the session
        self._drop_held(session, insert=True)
        session.held, session.held_name = req, name
        return True

    def info(self) -> dict[str, Any]:
        return {"sessions": {"open": len(self.sessions),
                             "held_tokens": sum(r.kv_allocated_len for r in self.held_reqs()),
                             "turns_from_held_kv": self.num_handed_over}}

"""Which requests an AbortReq names (semantics §3)."""
from __future__ import annotations

import re
from collections.abc import Callable

from radixlm.messages import AbortReq

_CHILD = re.compile(r"_\d+$")


def abort_matches(msg: AbortReq, rid: str) -> bool:
    """A rid matches itself and its parallel-sampling children `rid_0 … rid_{n-1}`, never an
    unrelated rid that merely starts with the same characters (unless prefix mode)."""
    if msg.abort_all:
        return True
    if msg.rids:
        return rid in msg.rids
    if not msg.rid:
        return False
    if rid == msg.rid:
        return True
    if msg.prefix:
        return rid.startswith(msg.rid)
    return rid.startswith(msg.rid) and _CHILD.fullmatch(rid[len(msg.rid):]) is not None


def abort_matcher(msg: AbortReq) -> Callable[[str], bool]:
    """abort_matches(msg, ·), with an exact rid list looked up as a set (an abort_all of a
    large batch meets every request)."""
    if msg.rids and not msg.abort_all:
        wanted = set(msg.rids)
        return wanted.__contains__
    return lambda rid: abort_matches(msg, rid)

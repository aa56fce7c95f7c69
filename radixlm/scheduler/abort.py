"""Which requests an AbortReq names (semantics §3, §10).

The scheduler knows requests by their unique submission rids (`rid#n`); the front end
resolves families (n > 1 children, known by identity) to exact rids before it sends an abort,
so nothing here guesses a family from the shape of a rid.
"""
from __future__ import annotations

from radixlm.messages import AbortReq


def abort_matches(msg: AbortReq, rid: str) -> bool:
    """Exact rids (`rids`), one rid exactly, every rid starting with `rid` (prefix=True), or all."""
    if msg.abort_all:
        return True
    if msg.rids:
        return rid in msg.rids
    if not msg.rid:
        return False
    return rid.startswith(msg.rid) if msg.prefix else rid == msg.rid

"""The links a side sends and receives frames on.

`Link` is all the rooms state machines see: `send(peer, frames)` (False when the peer cannot
be reached) and `recv_all()` (every message waiting now, with the peer it came from). A peer
is the prefill server's `(host, port)` on the decode side and the decode server's link
identity on the prefill side.

The TCP backend is ZeroMQ: the prefill server's bootstrap server is a ROUTER bound on
`--disaggregation-bootstrap-port`; each decode server connects one DEALER per prefill server
it hears of (the host and port come with each request). Both directions travel on that one
connection, so the decode server needs no port of its own. Sends never block (no high-water
mark): a side's scheduler thread is never held up by a slow peer.
"""
from __future__ import annotations

import typing
import uuid
from collections.abc import Hashable
from typing import Any, Protocol

import zmq

__all__ = ["Link", "BootstrapServer", "DecodeLinks"]

Peer = Hashable


class Link(Protocol):
    def send(self, peer: Peer, frames: list[bytes]) -> bool: ...

    def recv_all(self) -> list[tuple[Peer, list[bytes]]]: ...

    def sockets(self) -> list[zmq.Socket[Any]]: ...

    def close(self) -> None: ...


def _recv_multipart(sock: zmq.Socket[Any]) -> list[bytes] | None:
    try:
        return sock.recv_multipart(zmq.NOBLOCK)
    except zmq.Again:
        return None


class BootstrapServer:
    """The prefill side: a ROUTER on host:port; peers are the DEALER identities."""

    def __init__(self, ctx: zmq.Context[Any], host: str, port: int) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unknown peer raises instead of a silent drop
        self.sock.bind(f"tcp://{host}:{port}")

    def send(self, peer: Peer, frames: list[bytes]) -> bool:
        try:
            self.sock.send_multipart([peer, *frames], zmq.NOBLOCK)
            return True
        except zmq.ZMQError:  # EHOSTUNREACH: the peer disconnected
            return False

    def recv_all(self) -> list[tuple[Peer, list[bytes]]]:
        out: list[tuple[Peer, list[bytes]]] = []
        while (msg := _recv_multipart(self.sock)) is not None:
            out.append((bytes(msg[0]), list(msg[1:])))
        return out

    def sockets(self) -> list[zmq.Socket[Any]]:
        return [self.sock]

    def close(self) -> None:
        self.sock.close(linger=0)


class DecodeLinks:
    """The decode side: one DEALER per prefill server, connected when first needed."""

    def __init__(self, ctx: zmq.Context[Any]) -> None:
        self.ctx = ctx
        self.socks: dict[Peer, zmq.Socket[Any]] = {}
        self.identity = uuid.uuid4().hex.encode()

    def _sock(self, peer: Peer) -> zmq.Socket[Any]:
        sock = self.socks.get(peer)
        if sock is None:
            host, port = typing.cast(tuple[str, int], peer)  # a decode side's peers are (host, port)
            sock = self.ctx.socket(zmq.DEALER)
            for opt, value in ((zmq.LINGER, 0), (zmq.SNDHWM, 0), (zmq.RCVHWM, 0),
                               (zmq.IDENTITY, self.identity)):
                sock.setsockopt(opt, value)
            sock.connect(f"tcp://{host}:{port}")
            self.socks[peer] = sock
        return sock

    def send(self, peer: Peer, frames: list[bytes]) -> bool:
        try:
            self._sock(peer).send_multipart(frames, zmq.NOBLOCK)
            return True
        except zmq.ZMQError:
            return False

    def recv_all(self) -> list[tuple[Peer, list[bytes]]]:
        out: list[tuple[Peer, list[bytes]]] = []
        for peer, sock in self.socks.items():
            while (msg := _recv_multipart(sock)) is not None:
                out.append((peer, list(msg)))
        return out

    def sockets(self) -> list[zmq.Socket[Any]]:
        return list(self.socks.values())

    def close(self) -> None:
        for sock in self.socks.values():
            sock.close(linger=0)
        self.socks.clear()

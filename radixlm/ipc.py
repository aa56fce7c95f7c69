"""Typed ZMQ queues between the three processes (ipc:// sockets in a private temp dir).

    TokenizerManager --PUSH--> Scheduler --PUSH--> Detokenizer --PUSH--> TokenizerManager

Each socket carries messages from `radixlm.messages`, encoded by its one codec.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass

import zmq
import zmq.asyncio

from radixlm.messages import decode, encode


@dataclass(frozen=True)
class PortArgs:
    dir: str
    scheduler_input: str
    detokenizer_input: str
    tokenizer_input: str
    ready: str
    # torch.distributed rendezvous of the tensor-parallel ranks: a file store in the same dir
    tp_init_method: str = ""

    @staticmethod
    def new() -> "PortArgs":
        d = tempfile.mkdtemp(prefix="radixlm-ipc-")
        return PortArgs(d, f"ipc://{d}/scheduler", f"ipc://{d}/detokenizer", f"ipc://{d}/tokenizer",
                        f"ipc://{d}/ready", f"file://{d}/tp_store")

    def cleanup(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def _socket(ctx: zmq.Context, kind: int, addr: str, bind: bool):
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if kind == zmq.PUSH:
        sock.setsockopt(zmq.SNDHWM, 0)
    else:
        sock.setsockopt(zmq.RCVHWM, 0)
    (sock.bind if bind else sock.connect)(addr)
    return sock


class Receiver:
    def __init__(self, ctx: zmq.Context, addr: str) -> None:
        self.sock = _socket(ctx, zmq.PULL, addr, bind=True)

    def recv_all(self) -> list:
        """Every message waiting now, without blocking."""
        out = []
        while True:
            try:
                out.append(decode(self.sock.recv(zmq.NOBLOCK)))
            except zmq.Again:
                return out

    def wait(self, timeout_ms: int) -> bool:
        return bool(self.sock.poll(timeout_ms, zmq.POLLIN))

    def recv(self):
        return decode(self.sock.recv())


class Sender:
    def __init__(self, ctx: zmq.Context, addr: str) -> None:
        self.sock = _socket(ctx, zmq.PUSH, addr, bind=False)

    def send(self, msg) -> None:
        self.sock.send(encode(msg))


class AsyncReceiver:
    def __init__(self, ctx: zmq.asyncio.Context, addr: str) -> None:
        self.sock = _socket(ctx, zmq.PULL, addr, bind=True)

    async def recv(self):
        return decode(await self.sock.recv())


class AsyncSender:
    """Sends from asyncio code; a PUSH with no high-water mark never blocks, so a plain
    non-awaited send keeps ordering with the caller's code."""

    def __init__(self, ctx: zmq.Context, addr: str) -> None:
        self.sock = _socket(ctx, zmq.PUSH, addr, bind=False)

    def send(self, msg) -> None:
        self.sock.send(encode(msg))


def remove_ipc_dir(port_args: PortArgs) -> None:
    if os.path.isdir(port_args.dir):
        port_args.cleanup()

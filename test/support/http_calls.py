"""Raw HTTP calls for the abort and cancel-chain tests: one POST on its own socket, read
incrementally (so it can be closed at any moment), and the polls and control calls around it.
`server_info`/`wait_info` use the server's kept-alive `client`."""
from __future__ import annotations

import itertools
import json
import random
import socket
import time

import httpx

from test.support.server import ServerProcess

TIMEOUT = 30.0


# ---------------------------------------------------------------------------- a raw HTTP call
class Call:
    """One POST on its own socket (`Connection: close`), read incrementally without blocking
    the test, so it can be sent before its request reaches the state under test and closed
    (a disconnect) at any moment."""

    def __init__(self, server: ServerProcess, body: dict, path: str = "/generate") -> None:
        self.rid = body.get("rid")
        self.stream = bool(body.get("stream"))
        payload = json.dumps(body).encode()
        self.sock = socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT)
        self.sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          f"Connection: close\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
        self.raw = b""
        self.eof = False
        self.closed = False

    def _pump(self, timeout: float) -> None:
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(1 << 16)
        except TimeoutError:
            return
        if not data:
            self.eof = True
        self.raw += data

    def _split(self) -> tuple[int | None, dict, bytes]:
        head, sep, body = self.raw.partition(b"\r\n\r\n")
        if not sep:
            return None, {}, b""
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
        if headers.get("transfer-encoding") == "chunked":
            out, rest = b"", body
            while True:  # complete chunks only; a partial one waits for more bytes
                size_line, sep, after = rest.partition(b"\r\n")
                if not sep:
                    break
                size = int(size_line.split(b";")[0], 16)
                if size == 0 or len(after) < size + 2:
                    break
                out += after[:size]
                rest = after[size + 2:]
            body = out
        return status, headers, body

    def events(self) -> list:
        """The SSE data events received so far (complete ones); "[DONE]" as a string."""
        _, _, body = self._split()
        out = []
        for block in body.split(b"\n\n")[:-1]:
            for line in block.decode().split("\n"):
                if line.startswith("data: "):
                    out.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
        return out

    def wait_events(self, n: int = 1, until=None, timeout: float = TIMEOUT) -> list:
        """Read until n events have arrived (and, with `until`, one of them satisfies it)."""
        deadline = time.monotonic() + timeout
        while True:
            events = self.events()
            if len(events) >= n and (until is None or any(until(e) for e in events)):
                return events
            assert not self.eof, f"connection closed after {len(events)} events: {self.raw[-500:]!r}"
            assert time.monotonic() < deadline, f"the awaited event did not arrive in {timeout} s"
            self._pump(0.05)

    def finish(self, timeout: float = TIMEOUT) -> tuple[int, bytes]:
        """Read to the end of the response; (status, de-chunked body)."""
        deadline = time.monotonic() + timeout
        while not self.eof:
            assert time.monotonic() < deadline, f"response not complete after {timeout} s: {self.raw[-500:]!r}"
            self._pump(0.05)
        self.close()
        status, _, body = self._split()
        assert status is not None, self.raw
        return status, body

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sock.close()


def generate_body(rid: str, prompt: list[int], params: dict, stream: bool) -> dict:
    return {"input_ids": prompt, "rid": rid, "stream": stream, "sampling_params": dict(params)}


def one_terminal_stream(events: list) -> dict:
    """The stream ended exactly once: the only chunk with a finish reason is the last one,
    then one [DONE]; outputs are cumulative. Returns the final chunk."""
    assert events and events[-1] == "[DONE]" and events.count("[DONE]") == 1, events[-3:]
    chunks = events[:-1]
    assert chunks, "no final chunk before [DONE]"
    finals = [c for c in chunks if c["meta_info"]["finish_reason"] is not None]
    assert finals == [chunks[-1]], [c["meta_info"]["finish_reason"] for c in chunks]
    for a, b in itertools.pairwise(chunks):
        assert b["output_ids"][:len(a["output_ids"])] == a["output_ids"]
    final = chunks[-1]
    assert final["meta_info"]["completion_tokens"] == len(final["output_ids"])
    return final


def terminal_result(call: Call) -> dict:
    """Exactly one terminal response of a call, stream or not: its final result."""
    status, body = call.finish()
    assert status == 200, body
    if call.stream:
        return one_terminal_stream(call.events())
    out = json.loads(body)
    assert isinstance(out, dict) and out["meta_info"]["completion_tokens"] == len(out["output_ids"])
    return out


# ---------------------------------------------------------------------------- server helpers
def server_info(server: ServerProcess) -> dict:
    """/get_server_info over the server's kept-alive connection (polls react faster)."""
    r = server.client.get("/get_server_info")
    assert r.status_code == 200, r.text
    return r.json()


def wait_info(server: ServerProcess, pred, what: str, timeout: float = TIMEOUT) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        info = server_info(server)
        if pred(info):
            return info
        assert time.monotonic() < deadline, f"{what}: not reached in {timeout} s: {info}"
        time.sleep(0.001)


def pause(http: httpx.Client) -> None:
    assert http.post("/pause_generation", json={"mode": "in_place"}).status_code == 200


def resume(http: httpx.Client) -> None:
    assert http.post("/continue_generation").status_code == 200


def abort(http: httpx.Client, rid: str) -> int:
    r = http.post("/abort_request", json={"rid": rid})
    assert r.status_code == 200 and r.json()["success"] is True
    return r.json()["num_aborted"]



_rng = random.Random(4)


def fresh_prompt(n: int) -> list[int]:
    """Random token ids, different every call (no prefix-cache hits between cells)."""
    return [_rng.randrange(3, 49000) for _ in range(n)]


def fresh_rid(prefix: str) -> str:
    """A rid never used before (drawn from the same generator as the prompts)."""
    return prefix + str(_rng.random())

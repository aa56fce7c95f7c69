"""The README's runnable blocks run as written: every fenced block after a `<!-- runnable -->`
line is executed against one real `radixlm serve` of the default model (started here on a free
127.0.0.1 port, stopped by its pid), with the README's 127.0.0.1:30000 / localhost:30000
rewritten to it. Shell blocks run under `bash -euo pipefail`; Python blocks in a subprocess of
this interpreter (the Engine ones load the model themselves). Blocks not so marked (install
commands, fragments) are not run."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
import pytest

from test.support.server import free_port, pid_alive

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(ROOT, "README.md")
MARK = "<!-- runnable -->"
README_ADDRESSES = ("http://127.0.0.1:30000", "http://localhost:30000", "127.0.0.1:30000", "localhost:30000")
BLOCK_TIMEOUT = 900  # seconds: a hang detector only (a block loading the model on a busy machine is slow)


@dataclass(frozen=True)
class Block:
    line: int  # where the fence opens in README.md
    lang: str
    code: str


def runnable_blocks(text: str) -> list[Block]:
    """The fenced blocks whose fence follows a `<!-- runnable -->` line (blank lines between allowed)."""
    lines = text.splitlines()
    blocks, armed, i = [], False, 0
    while i < len(lines):
        line = lines[i].strip()
        if line == MARK:
            armed = True
        elif line.startswith("```"):
            lang, start = line[3:].strip(), i
            body = []
            i += 1
            while i < len(lines) and not lines[i].strip().startswith("```"):
                body.append(lines[i])
                i += 1
            if armed:
                blocks.append(Block(start + 1, lang, "\n".join(body) + "\n"))
            armed = False
        elif line:
            armed = False
        i += 1
    return blocks


def test_the_runnable_marker_is_read_as_the_readme_means_it():
    text = "\n".join(["<!-- runnable -->", "```bash", "echo one", "```", "", "```bash", "echo two", "```",
                      "<!-- runnable -->", "", "```python", "print(3)", "```",
                      "<!-- runnable -->", "words in between", "```bash", "echo four", "```"])
    assert runnable_blocks(text) == [Block(2, "bash", "echo one\n"), Block(11, "python", "print(3)\n")]


def test_every_readme_block_is_marked_or_is_an_install_command_or_a_fragment():
    """The blocks a reader would run are the runnable ones: the README has some of each kind, and
    the unmarked ones are the set-up commands (they install) and the RL fragment (needs a trainer)."""
    with open(README) as f:
        text = f.read()
    marked = runnable_blocks(text)
    assert {b.lang for b in marked} == {"bash", "python"}
    all_blocks = re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)
    unmarked = [code for _, code in all_blocks if all(code != b.code for b in marked)]
    for code in unmarked:
        assert "pip install" in code or "engine." in code and "Engine(" not in code, code


def rewrite(code: str, base: str) -> str:
    host_port = base.removeprefix("http://")
    for addr in README_ADDRESSES:
        code = code.replace(addr, base if addr.startswith("http") else host_port)
    return code


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`radixlm serve` as the README starts it (the default model), on a free loopback port."""
    port = free_port()
    cmd = [sys.executable, "-m", "radixlm", "serve", "--host", "127.0.0.1", "--port", str(port)]
    help_text = subprocess.run([sys.executable, "-m", "radixlm", "serve", "--help"], capture_output=True,
                               text=True, timeout=300).stdout
    if "--served-model-name" in help_text:  # the README's requests name the model so
        cmd += ["--served-model-name", "SmolLM2-135M-Instruct"]
    log_path = tmp_path_factory.mktemp("readme") / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                env=dict(os.environ, HF_HUB_OFFLINE="1"))
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + BLOCK_TIMEOUT
        while True:
            assert proc.poll() is None, f"the server exited with {proc.returncode}:\n{log_path.read_text()}"
            try:
                if httpx.get(base + "/health", timeout=5.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"the server never became ready:\n{log_path.read_text()}"
            time.sleep(0.2)
        yield base
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
        assert not pid_alive(proc.pid)


def _blocks() -> list[Block]:
    with open(README) as f:
        return runnable_blocks(f.read())


@pytest.mark.slow
@pytest.mark.parametrize("block", _blocks(), ids=lambda b: f"README.md:{b.line}:{b.lang}")
def test_readme_block_runs_as_written(server, block, tmp_path):
    code = rewrite(block.code, server)
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    if block.lang == "python":
        script = tmp_path / "block.py"
        script.write_text(code)
        argv = [sys.executable, str(script)]
    else:
        assert block.lang in ("bash", "sh"), f"README.md:{block.line}: no runner for {block.lang!r}"
        # `radixlm` as the README's reader has it: this interpreter's console script, or the module
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        shim = bin_dir / "radixlm"
        shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m radixlm "$@"\n')
        shim.chmod(0o755)
        env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
        argv = ["bash", "-euo", "pipefail", "-c", code]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=BLOCK_TIMEOUT)
    where = f"README.md:{block.line} ({block.lang}) exited {done.returncode}\n{done.stdout}\n{done.stderr}"
    assert done.returncode == 0, where
    out = done.stdout.strip()
    assert out, where  # every block prints what it shows
    if out.startswith("{"):  # a JSON answer (curl, a batch result line): no error object in it
        assert json.loads(out).get("error") is None, where

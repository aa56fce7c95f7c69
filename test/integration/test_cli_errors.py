"""What a user's first mistakes look like on the command line: one line on stderr, exit code 2,
no traceback (unless --log-level debug), and nothing loaded first. Each runs
`python -m radixlm ...` as a user would."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest


def radixlm(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "radixlm", *argv], capture_output=True, text=True, env=env,
                          timeout=timeout)


def first_line(proc: subprocess.CompletedProcess) -> str:
    return proc.stderr.splitlines()[0] if proc.stderr else ""


def assert_one_line(proc: subprocess.CompletedProcess, line: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert first_line(proc) == line
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


def test_a_model_path_that_does_not_exist(tmp_path):
    missing = str(tmp_path / "nope")
    assert_one_line(radixlm("generate", "hi", "--model-path", missing),
                    f"radixlm: error: model path {missing!r} does not exist")


def test_debug_shows_the_traceback(tmp_path):
    missing = str(tmp_path / "nope")
    proc = radixlm("generate", "hi", "--model-path", missing, "--log-level", "debug")
    assert proc.returncode == 2
    assert first_line(proc) == "Traceback (most recent call last):"
    assert proc.stderr.splitlines()[-1] == f"radixlm: error: model path {missing!r} does not exist"


def test_a_file_that_is_not_a_model(tmp_path):
    garbage = tmp_path / "model.gguf"
    garbage.write_bytes(b"\x00" * 64)
    assert_one_line(radixlm("run-batch", "-i", "-", "-o", "-", "--model-path", str(garbage)),
                    f"radixlm: error: {garbage} is not a GGUF file (bad magic)")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads every file whatever its mode")
def test_an_unreadable_file(tmp_path):
    locked = tmp_path / "model.gguf"
    locked.write_bytes(b"GGUF")
    locked.chmod(0)
    assert_one_line(radixlm("generate", "hi", "--model-path", str(locked)),
                    f"radixlm: error: cannot read {locked}: permission denied")


def test_an_unknown_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    from radixlm.srt.models.registry import MODEL_ARCHS

    assert_one_line(radixlm("serve", "--model-path", str(tmp_path), "--port", "0"),
                    f"radixlm: error: {tmp_path}: architecture 'GPT2LMHeadModel' is not supported "
                    f"(supported: {', '.join(MODEL_ARCHS.names())})")


def test_a_port_in_use_is_reported_before_the_model_is_looked_at(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        # the model path is wrong too: the port's error coming first shows it is checked
        # before the model (and so before any loading)
        proc = radixlm("serve", "--port", str(port), "--model-path", str(tmp_path / "nope"))
    assert_one_line(proc, f"radixlm: error: port {port} on 127.0.0.1 is already in use (choose another with --port)")


def test_a_bad_engine_option():
    assert_one_line(radixlm("generate", "hi", "--page-size", "0"), "radixlm: error: page_size must be >= 1")


def test_run_batch_files(tmp_path):
    assert_one_line(radixlm("run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", "-"),
                    f"radixlm: error: input file {str(tmp_path / 'in.jsonl')!r} does not exist")
    (tmp_path / "in.jsonl").write_text("")
    assert_one_line(radixlm("run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", "-", "--resume"),
                    "radixlm: error: --resume needs an output file (-o PATH), not stdout")

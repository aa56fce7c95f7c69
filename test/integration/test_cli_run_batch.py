"""`radixlm run-batch` as a user runs it: the OpenAI Batch format in and out (stdin and stdout
with `-`), bad lines answered without stopping the batch, and a crash after K written lines
that `--resume` completes without duplicates. The crash is placed by feeding the input through
a pipe: the first lines are sent, the test waits for their answers in the output file, and
kills the process before it has seen the rest, so nothing depends on the machine's speed."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ENGINE = ("--dtype", "float32", "--max-total-tokens", "4096")
RECORD_KEYS = {"id", "custom_id", "response", "error"}
WAIT_S = 600.0  # a ceiling for a stuck run, never reached by a working one


def _cmd(model: str, *argv: str) -> list[str]:
    return [sys.executable, "-m", "radixlm", "run-batch", "--model-path", model, *ENGINE, *argv]


def _env() -> dict[str, str]:
    return dict(os.environ, HF_HUB_OFFLINE="1")


def _req(custom_id: str, url: str = "/v1/completions", **body) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _records(text: str) -> list[dict]:
    return [json.loads(x) for x in text.splitlines() if x.strip()]


def _by_id(records: list[dict]) -> dict:
    return {r["custom_id"]: r for r in records}


def test_formats_stdin_stdout_and_bad_lines(tiny_llama_dir):
    name = os.path.basename(tiny_llama_dir)
    lines = [
        _req("chat", "/v1/chat/completions", model=name, messages=[{"role": "user", "content": "hi"}],
             max_tokens=5, ignore_eos=True),
        _req("completion", prompt="Once upon a time", max_tokens=4, temperature=0, ignore_eos=True, n=2),
        "{this is not json",
        _req("embeddings", "/v1/embeddings", input="x"),
        _req("bad-body", prompt="x", temperature=-1),
        _req("other-model", model="gpt-4", prompt="x"),
        json.dumps({"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}),
        _req("stream", prompt="x", stream=True),
        _req("last", prompt="The end", max_tokens=3, ignore_eos=True),
        _req("priority", prompt="x", max_tokens=2, ignore_eos=True, priority=5),  # vLLM's field, as over HTTP
        _req("bad-priority", prompt="x", priority="high"),
    ]
    proc = subprocess.run(_cmd(tiny_llama_dir, "-i", "-", "-o", "-"), input="\n".join(lines) + "\n",
                          capture_output=True, text=True, env=_env(), timeout=WAIT_S)
    assert proc.returncode == 0, proc.stderr
    records = _records(proc.stdout)
    assert len(records) == len(lines)  # one line out per line in, none lost, none stopped the batch
    for r in records:
        assert set(r) == RECORD_KEYS and set(r["response"]) == {"status_code", "request_id", "body"}
        assert r["id"].startswith("radixlm-") and r["response"]["request_id"].startswith("radixlm-batch-")
    named = _by_id(records)
    assert Counter(r["custom_id"] for r in records)[None] == 2  # bad JSON, no custom_id

    chat = named["chat"]
    assert chat["error"] is None and chat["response"]["status_code"] == 200
    body = chat["response"]["body"]
    assert body["object"] == "chat.completion" and body["model"] == name
    assert body["usage"]["completion_tokens"] == 5 and body["choices"][0]["message"]["role"] == "assistant"
    comp = named["completion"]["response"]["body"]
    assert comp["object"] == "text_completion" and len(comp["choices"]) == 2
    assert comp["choices"][0]["text"] == comp["choices"][1]["text"]  # greedy: both choices agree
    assert comp["usage"]["completion_tokens"] == 8
    assert named["last"]["response"]["body"]["usage"]["completion_tokens"] == 3
    assert named["priority"]["response"]["body"]["usage"]["completion_tokens"] == 2

    def error(cid: str) -> tuple[int, str, str | None]:
        r = named[cid]
        assert r["response"]["body"] is None
        e = r["error"]["error"]
        assert e["code"] == r["response"]["status_code"]
        return r["response"]["status_code"], e["message"], e["param"]

    assert error("embeddings")[0] == 400 and "url '/v1/embeddings' is not supported" in error("embeddings")[1]
    assert error("bad-body")[0] == 400 and error("bad-body")[2] == "temperature"
    assert error("other-model") == (404, "The model `gpt-4` does not exist.", "model")
    assert "stream is not supported" in error("stream")[1]
    assert error("bad-priority")[0] == 400 and "priority" in error("bad-priority")[1]
    unnamed = [r["error"]["error"]["message"] for r in records if r["custom_id"] is None]
    assert any("line 3: malformed JSON" in m for m in unnamed)
    assert any("line 7: custom_id must be a non-empty string" in m for m in unnamed)
    assert "radixlm: run-batch: 4 succeeded, 7 failed" in proc.stderr


def _wait_for_lines(path: Path, k: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the batch ended before it was killed"
        if path.exists() and path.read_text().count("\n") >= k:
            return
        time.sleep(0.05)
    raise AssertionError(f"{path} never had {k} lines")


def test_a_crash_mid_file_and_resume(tiny_llama_dir, tmp_path):
    lines = [_req(f"q{i}", prompt=f"Question number {i}", max_tokens=4, ignore_eos=True) for i in range(8)]
    lines.insert(1, "{broken")
    out = tmp_path / "out.jsonl"
    first = lines[:3]  # q0, the broken line, q1
    proc = subprocess.Popen(_cmd(tiny_llama_dir, "-i", "-", "-o", str(out)), stdin=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=_env())
    try:
        assert proc.stdin is not None
        proc.stdin.write("\n".join(first) + "\n")
        proc.stdin.flush()
        _wait_for_lines(out, len(first), proc)
    finally:
        proc.kill()  # mid-file: the rest of the input was never sent
        proc.wait()
    before = out.read_text()
    assert sorted(r["custom_id"] or "" for r in _records(before)) == ["", "q0", "q1"]

    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    done = subprocess.run(_cmd(tiny_llama_dir, "-i", str(tmp_path / "in.jsonl"), "-o", str(out), "--resume"),
                          capture_output=True, text=True, env=_env(), timeout=WAIT_S)
    assert done.returncode == 0, done.stderr
    after = out.read_text()
    assert after.startswith(before)  # what was written before the crash is kept as it was
    records = _records(after)
    assert Counter(r["custom_id"] for r in records) == Counter([None] + [f"q{i}" for i in range(8)])
    assert all(r["error"] is None for r in records if r["custom_id"] is not None)
    assert "6 succeeded, 0 failed, 3 skipped" in done.stderr

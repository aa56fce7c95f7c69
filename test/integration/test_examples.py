"""Each script in examples/ runs on the default model and shows what it says it shows."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
HANG = 1800  # seconds: a hang detector only (the model loads once per example)


def run_example(name: str, *args: str) -> str:
    env = dict(os.environ, HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run([sys.executable, os.path.join(EXAMPLES, name), *args], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=HANG)
    assert done.returncode == 0, f"{name} exited {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


CHECKS = {"rl_rollout.py"}  # every example has a test below


def test_every_example_has_a_test():
    assert {f for f in os.listdir(EXAMPLES) if f.endswith(".py")} == CHECKS


@pytest.mark.slow
def test_rl_rollout_updates_weights_then_resumes_aborted_rollouts_from_the_cache():
    out = run_example("rl_rollout.py", "--steps", "2", "--max-new-tokens", "16")
    versions = re.findall(r"pushed 1 tensor\(s\) -> version (\S+)", out)
    assert versions == ["step-1", "step-2"], out
    assert re.search(r"step 1: weight_version=step-1 ", out), out  # the second step ran on the pushed weights
    partial = re.findall(r"partial (\d+) tokens \((\w+)\), resumed \+(\d+) with (\d+) of (\d+) prompt tokens cached",
                         out)
    assert len(partial) == 4, out
    for got, reason, rest, cached, prompt_len in partial:
        # aborted after its first token, before its end; resumed to the full length, its prompt
        # and partial output (but the last token, whose KV the resumed request computes) from the cache
        assert reason == "abort" and 1 <= int(got) < 64, out
        assert int(got) + int(rest) == 64, out
        assert 0 < int(cached) < int(prompt_len), out

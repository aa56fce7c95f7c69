"""Runs the Triton kernel tests (`_interp_*.py`) under TRITON_INTERPRET=1 on CPU.

The interpreter flag is read when triton is first imported, so it cannot be switched on
inside a pytest process that may already have imported triton (or that must not see the
flag: it would also change other tests). Each `_interp_*.py` file therefore runs in its
own `python -m pytest` subprocess; those files do not match `test_*.py` and are never
collected directly.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
FILES = sorted(p.name for p in HERE.glob("_interp_*.py"))


@pytest.mark.parametrize("name", FILES)
def test_under_triton_interpreter(name: str) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", str(HERE / name)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    tail = (proc.stdout + proc.stderr)[-6000:]
    if proc.returncode == 5:  # "no tests collected" cannot happen unless everything skipped
        pytest.skip(f"{name}: nothing ran\n{tail}")
    assert proc.returncode == 0, f"{name} failed under TRITON_INTERPRET=1:\n{tail}"
    if " skipped" in proc.stdout and " passed" not in proc.stdout:
        pytest.skip(f"{name}: all skipped\n{tail}")

"""Loading the native kernels must not change the caller's floating-point environment: a
library linked with -ffast-math turns on flush-to-zero / denormals-are-zero for the whole
process (gcc's crtfastmath.o), which silently changes every float operation of the program
that loaded it (an RL trainer in the same process, hypothesis' float strategies, ...)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from radixlm.kernels.cpu import build

CHECK = """
import sys
tiny = 5e-324  # the smallest subnormal double
assert tiny * 1.0 == tiny and tiny / 2.0 == 0.0 and 2.2250738585072014e-308 / 2 > 0
from radixlm.kernels.cpu import build
lib = build.load()
print("loaded" if lib is not None else "unavailable")
print(repr(tiny * 1.0), repr(2.2250738585072014e-308 / 2 > 0))
"""


def test_loading_the_kernels_keeps_subnormals():
    if build.load() is None:
        pytest.skip("no native kernels on this machine")
    # a fresh process: this one may have loaded other libraries already
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split()
    assert lines[0] == "loaded"
    assert lines[1:] == ["5e-324", "True"], "loading the kernels flushed subnormals to zero"

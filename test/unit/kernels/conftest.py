"""Fixtures that run a test once per build of the native kernels worth checking on this
machine (build.load_variant):
- `kernel_isa`: the native one, and on AVX-512 machines also the AVX2 one, so the AVX2 code
  paths are tested on every CI processor, not only on AVX2-only ones;
- `bf16_kernel_isa`: those, and on an AMX CPU also the build without AMX, so that both bf16
  paths (tiles and AVX512-BF16) are checked there;
- `amx_isa`: the native build, and on an AMX CPU the build without AMX (kernels with no AVX2
  path)."""
from __future__ import annotations

import pytest

from radixlm.kernels.cpu import build
from radixlm.kernels.cpu.cpuinfo import cpu_flags

_NO_AMX = ["avx512"] if {"amx_bf16", "amx_tile"} <= cpu_flags() else []


def use_build(name: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Make ops call the `name` build for this test (skipped where it cannot be built)."""
    if name != "native":
        lib = build.load_variant(name)
        if lib is None:
            pytest.skip(f"the {name} build of the native kernels is unavailable")
        monkeypatch.setattr(build, "_lib", lib)
        monkeypatch.setattr(build, "_tried", True)
    return name


@pytest.fixture(params=build.variants())
def kernel_isa(request, monkeypatch) -> str:
    return use_build(request.param, monkeypatch)


@pytest.fixture(params=[*build.variants(), *_NO_AMX])
def bf16_kernel_isa(request, monkeypatch) -> str:
    return use_build(request.param, monkeypatch)


@pytest.fixture(params=["native", *_NO_AMX])
def amx_isa(request, monkeypatch) -> str:
    return use_build(request.param, monkeypatch)

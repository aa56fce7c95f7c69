"""`kernel_isa`: runs a test once per build of the native kernels worth checking on this
machine: the native one, and on AVX-512 machines also the AVX2 one (build.load_variant), so
the AVX2 code paths are tested on every CI processor, not only on AVX2-only ones."""
from __future__ import annotations

import pytest

from radixlm.kernels.cpu import build


@pytest.fixture(params=build.variants())
def kernel_isa(request, monkeypatch) -> str:
    if request.param != "native":
        lib = build.load_variant(request.param)
        if lib is None:
            pytest.skip(f"the {request.param} build of the native kernels is unavailable")
        monkeypatch.setattr(build, "_lib", lib)
        monkeypatch.setattr(build, "_tried", True)
    return request.param

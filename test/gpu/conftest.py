"""CUDA-only checks of the Triton kernels and the triton/flashinfer backends.

Every test here is skipped without a CUDA device (and the triton/flashinfer ones
without their package), so `pytest test/` stays green on CPU-only machines.
"""
from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "test/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)

"""Triton kernels for attention and KV movement, each with a pure-torch reference twin.

Importing this package does not import triton: the kernel modules (`decode_attention`,
`extend_attention`, `kv_ops`) import it at their top, and only the triton attention
backend and the tests import them. The torch twins live in `reference` and `indices`,
which depend on torch alone, so CPU-only code and CI without triton can use them.

TRITON_INTERPRET=1 must be in the environment before triton is first imported for the
kernels to run on CPU tensors (the tests under test/unit/kernels do this).
"""
from __future__ import annotations

import importlib.util


def triton_available() -> bool:
    """True when the triton package can be imported (without importing it)."""
    return importlib.util.find_spec("triton") is not None

"""Named tensors over HTTP: a list of (name, tensor) as base64 of a torch.save payload.

Loading uses `torch.load(weights_only=True)`, which refuses anything but tensors and plain
containers, so a request body cannot run code in the server.
"""
from __future__ import annotations

import base64
import io

import torch


def serialize_named_tensors(named_tensors) -> str:
    if isinstance(named_tensors, dict):
        named_tensors = list(named_tensors.items())
    buf = io.BytesIO()
    torch.save([(str(n), t.detach().cpu().contiguous()) for n, t in named_tensors], buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def deserialize_named_tensors(data: str) -> list[tuple[str, torch.Tensor]]:
    try:
        raw = base64.b64decode(data, validate=True)
        obj = torch.load(io.BytesIO(raw), weights_only=True)
    except Exception as e:
        raise ValueError(f"serialized_named_tensors is not a valid payload: {e}") from None
    if not isinstance(obj, (list, tuple)) or not all(
            isinstance(x, (list, tuple)) and len(x) == 2 and isinstance(x[0], str) and isinstance(x[1], torch.Tensor)
            for x in obj):
        raise ValueError("serialized_named_tensors must hold a list of (name, tensor) pairs")
    return [(n, t) for n, t in obj]

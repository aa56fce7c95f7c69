"""The storage tier's building blocks: page keys, the page format, and the backend contract.

A storage page is `STORAGE_PAGE_TOKENS` tokens (rounded up to a multiple of the cache's page
size) of KV, every buffer of the device pool, in one blob. Its key is a chained hash: page i's
key hashes page i-1's key and page i's token ids, and the chain starts from a seed that hashes
the cache namespace (the model, the KV layout, and the tree's `extra_key`: weight version,
adapter, cache salt). So a key names a page together with everything before it, and two
engines that would compute the same KV for a prefix find the same keys.

A page blob carries a header (magic, its key, payload length, a blake2b checksum of the
payload): a torn or corrupted file, or a file under the wrong name, is refused on read.

Backends are called only from the storage tier's worker threads (storage_tier.py); one may
block for seconds (a dead remote store) without touching the scheduler.
"""
from __future__ import annotations

import hashlib
import struct
from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

__all__ = ["STORAGE_PAGE_TOKENS", "StorageBackend", "CorruptPage", "page_keys", "namespace_seed",
           "storage_page_tokens", "encode_page", "decode_page", "layout_fingerprint", "STORAGE_BACKENDS"]

# Small pages make a file per few tokens (the open/close dominates); large ones waste the tail
# of every prompt that is shorter than a page.
STORAGE_PAGE_TOKENS = 64
STORAGE_BACKENDS = ("file", "mooncake")
_MAGIC = b"RLMKVPG1"
_HEADER = struct.Struct("<8s16sQ16s")  # magic, key, payload bytes, checksum


class CorruptPage(Exception):
    """A stored page failed its checks (checksum, key, size)."""


def storage_page_tokens(page_size: int) -> int:
    return -(-STORAGE_PAGE_TOKENS // page_size) * page_size


def layout_fingerprint(buffers: Sequence[torch.Tensor]) -> str:
    """Shapes and dtypes of one token slot in every buffer: pages of another layout never match."""
    return ";".join(f"{tuple(b.shape[1:])}:{b.dtype}" for b in buffers)


def namespace_seed(model_id: str, layout: str, extra_key: str | None) -> bytes:
    text = f"{model_id}\x00{layout}\x00{'' if extra_key is None else extra_key}"
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def page_keys(token_ids: Sequence[int], page_tokens: int, seed: bytes) -> list[str]:
    """Keys of the whole pages of `token_ids` (hex strings), each chained on the one before."""
    keys: list[str] = []
    prev = seed
    for start in range(0, len(token_ids) // page_tokens * page_tokens, page_tokens):
        page = struct.pack(f"<{page_tokens}q", *token_ids[start:start + page_tokens])
        prev = hashlib.blake2b(prev + page, digest_size=16).digest()
        keys.append(prev.hex())
    return keys


def encode_page(key: str, rows: Sequence[torch.Tensor]) -> bytes:
    """One page's rows of every buffer (each `[page_tokens, ...]`) as a checked blob."""
    payload = b"".join(r.contiguous().view(torch.uint8).numpy().tobytes() for r in rows)
    digest = hashlib.blake2b(payload, digest_size=16).digest()
    return _HEADER.pack(_MAGIC, bytes.fromhex(key), len(payload), digest) + payload


def decode_page(key: str, blob: bytes, like: Sequence[torch.Tensor], page_tokens: int) -> list[torch.Tensor]:
    """The rows of every buffer from a blob written by `encode_page`; `like` are the pool's
    buffers (shape and dtype per token). Raises CorruptPage on any mismatch."""
    if len(blob) < _HEADER.size:
        raise CorruptPage(f"page {key}: {len(blob)} bytes, shorter than its header")
    magic, raw_key, size, digest = _HEADER.unpack_from(blob)
    payload = memoryview(blob)[_HEADER.size:]
    if magic != _MAGIC or raw_key != bytes.fromhex(key):
        raise CorruptPage(f"page {key}: wrong magic or key in its header")
    if size != len(payload) or hashlib.blake2b(payload, digest_size=16).digest() != digest:
        raise CorruptPage(f"page {key}: checksum or size mismatch")
    rows: list[torch.Tensor] = []
    off = 0
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    for b in like:
        n = page_tokens * b[0].numel() * b.element_size()
        if off + n > len(data):
            raise CorruptPage(f"page {key}: payload too short for the pool's layout")
        rows.append(data[off:off + n].view(b.dtype).reshape(page_tokens, *b.shape[1:]).clone())
        off += n
    if off != len(data):
        raise CorruptPage(f"page {key}: payload longer than the pool's layout")
    return rows


class StorageBackend(ABC):
    """A key -> blob store. Called from worker threads only; may raise OSError (or any
    exception) and may block: the tier counts the error and recomputes."""

    name: str = "storage"

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def get(self, key: str) -> bytes | None:
        """The blob, or None when absent."""

    @abstractmethod
    def set(self, key: str, blob: bytes) -> None: ...

    @abstractmethod
    def delete(self, key: str) -> None:
        """Drop a page (a corrupt one); absent is fine."""

    def close(self) -> None:
        """Release connections (called once, at shutdown)."""

"""Storage backends by their `--hicache-storage-backend` name."""
from __future__ import annotations

from radixlm.hicache.storage import STORAGE_BACKENDS, StorageBackend

__all__ = ["build_storage_backend"]


def build_storage_backend(name: str, directory: str = "", extra_config: str = "") -> StorageBackend:
    if name == "file":
        from radixlm.hicache.storage_file import FileStorage

        return FileStorage(directory)
    if name == "mooncake":
        from radixlm.hicache.storage_mooncake import MooncakeStorage

        return MooncakeStorage(extra_config)
    raise ValueError(f"unknown HiCache storage backend {name!r}; choose from {STORAGE_BACKENDS}")

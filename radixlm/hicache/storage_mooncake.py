"""`--hicache-storage-backend mooncake`: pages in Mooncake Store.

The store is a `mooncake_master` (started by the user) and the memory its clients contribute:
this engine's client gives `global_segment_size` bytes of it, so its pages live as long as the
engine does unless a standalone `mooncake_client` holds them. Engines pointed at one master
share pages. Settings come from `--hicache-storage-backend-extra-config` (JSON) or, as in
SGLang, the environment:

| key | environment | default |
|---|---|---|
| `master_server_address` | `MOONCAKE_MASTER` | required, `host:port` |
| `local_hostname` | `MOONCAKE_LOCAL_HOSTNAME` | `127.0.0.1` |
| `metadata_server` | `MOONCAKE_TE_META_DATA_SERVER` | `P2PHANDSHAKE` |
| `protocol` | `MOONCAKE_PROTOCOL` | `tcp` |
| `device_name` | `MOONCAKE_DEVICE` | `""` |
| `global_segment_size` | `MOONCAKE_GLOBAL_SEGMENT_SIZE` | 256 MiB |
| `local_buffer_size` | `MOONCAKE_LOCAL_BUFFER_SIZE` | 64 MiB |

The client connects on first use, on the storage tier's worker thread: a master that does not
answer delays storage, never the scheduler. The Python package is PyPI's
`mooncake-transfer-engine-non-cuda` (CPU) or `mooncake-transfer-engine`; its import needs
libibverbs (Debian: `libibverbs1`), even without an RDMA device.
"""
from __future__ import annotations

import json
import os
import threading
from typing import Any

from radixlm.hicache.storage import StorageBackend

__all__ = ["MooncakeStorage", "mooncake_import_error", "mooncake_settings"]

_DEFAULTS: dict[str, tuple[str, Any]] = {
    "master_server_address": ("MOONCAKE_MASTER", ""),
    "local_hostname": ("MOONCAKE_LOCAL_HOSTNAME", "127.0.0.1"),
    "metadata_server": ("MOONCAKE_TE_META_DATA_SERVER", "P2PHANDSHAKE"),
    "protocol": ("MOONCAKE_PROTOCOL", "tcp"),
    "device_name": ("MOONCAKE_DEVICE", ""),
    "global_segment_size": ("MOONCAKE_GLOBAL_SEGMENT_SIZE", 256 << 20),
    "local_buffer_size": ("MOONCAKE_LOCAL_BUFFER_SIZE", 64 << 20),
}


def mooncake_import_error() -> str | None:
    """Why Mooncake Store cannot be used here, or None when it can."""
    try:
        from mooncake.store import MooncakeDistributedStore  # type: ignore[import-not-found, unused-ignore]  # noqa: F401
    except Exception as e:  # noqa: BLE001 - ImportError or a missing shared library (OSError)
        return f"mooncake.store cannot be imported: {e}"
    return None


def mooncake_settings(extra_config: str = "") -> dict[str, Any]:
    given = json.loads(extra_config) if extra_config else {}
    if not isinstance(given, dict):
        raise ValueError("hicache_storage_backend_extra_config must be a JSON object")
    unknown = sorted(set(given) - set(_DEFAULTS))
    if unknown:
        raise ValueError(f"unknown Mooncake setting(s) {unknown}; known: {sorted(_DEFAULTS)}")
    out: dict[str, Any] = {}
    for name, (env, default) in _DEFAULTS.items():
        value = given.get(name, os.environ.get(env, default))
        out[name] = int(value) if isinstance(default, int) else str(value)
    if not out["master_server_address"]:
        raise ValueError("hicache_storage_backend mooncake needs the master's host:port: "
                         "master_server_address in --hicache-storage-backend-extra-config, or MOONCAKE_MASTER")
    return out


class MooncakeStorage(StorageBackend):
    name = "mooncake"

    def __init__(self, extra_config: str = "") -> None:
        self.settings = mooncake_settings(extra_config)
        why = mooncake_import_error()
        if why is not None:
            raise ValueError(f"hicache_storage_backend mooncake: {why}")
        self._store: Any = None
        self._lock = threading.Lock()

    def _client(self) -> Any:
        with self._lock:
            if self._store is None:
                from mooncake.store import MooncakeDistributedStore  # type: ignore[import-not-found, unused-ignore]

                s = self.settings
                store = MooncakeDistributedStore()
                rc = store.setup(s["local_hostname"], s["metadata_server"], s["global_segment_size"],
                                 s["local_buffer_size"], s["protocol"], s["device_name"], s["master_server_address"])
                if rc != 0:
                    raise OSError(f"Mooncake Store setup against {s['master_server_address']} failed ({rc})")
                self._store = store
            return self._store

    def exists(self, key: str) -> bool:
        return int(self._client().is_exist(key)) == 1

    def get(self, key: str) -> bytes | None:
        blob = self._client().get(key)
        return bytes(blob) if blob else None

    def set(self, key: str, blob: bytes) -> None:
        rc = self._client().put(key, blob)
        if rc != 0:
            raise OSError(f"Mooncake Store put failed ({rc})")

    def delete(self, key: str) -> None:
        self._client().remove(key)  # a page still leased by a reader stays; a later put replaces it

    def close(self) -> None:
        with self._lock:
            if self._store is not None:
                self._store.close()
                self._store = None

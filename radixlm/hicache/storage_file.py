"""`--hicache-storage-backend file`: one file per page in a directory.

The directory is the index: a page exists when its file does, so pages written by an engine
that has exited (or by another engine sharing the directory) are found after a restart. Files
are written under a temporary name and renamed into place, so a reader never sees half a page
(a torn file from a crash is refused by the page checksum and deleted). Pages are spread over
256 subdirectories by the first byte of their key.
"""
from __future__ import annotations

import os
import tempfile

from radixlm.hicache.storage import StorageBackend

__all__ = ["FileStorage"]


class FileStorage(StorageBackend):
    name = "file"

    def __init__(self, directory: str) -> None:
        if not directory:
            raise ValueError("--hicache-storage-backend file needs --hicache-storage-dir")
        self.directory = os.path.abspath(directory)
        # Creation may fail (read-only parent): the backend still starts, and every write
        # fails and is counted, so a bad directory degrades to recomputation.
        try:
            os.makedirs(self.directory, exist_ok=True)
        except OSError:
            pass

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, key[:2], key + ".kvpage")

    def exists(self, key: str) -> bool:
        return os.path.exists(self._path(key))

    def get(self, key: str) -> bytes | None:
        try:
            with open(self._path(key), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def set(self, key: str, blob: bytes) -> None:
        path = self._path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    def delete(self, key: str) -> None:
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            pass

    def num_pages(self) -> int:
        """Pages on disk (for tests and server info; walks the directory)."""
        n = 0
        for _, _, files in os.walk(self.directory):
            n += sum(f.endswith(".kvpage") for f in files)
        return n

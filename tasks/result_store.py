"""Prefect results kept under the run's storage root (file://, s3:// or obs://), through tasks.storage.

Prefect persists a task's result (and finds it again by cache key) through a WritableFileSystem block that
is saved server-side. This block adapts our Storage to that interface, so cached chunk results live beside
the checkpoints they describe and survive a lost Prefect home directory or a different worker machine.
"""

from __future__ import annotations

import hashlib

from prefect._internal.compatibility.async_dispatch import async_dispatch
from prefect.filesystems import WritableFileSystem

from tasks.storage import join_key, open_storage

RESULTS_PREFIX = "prefect-results"


class StorageRootResults(WritableFileSystem):
    """Result storage at `{root_uri}/prefect-results/`."""

    _block_type_slug = "vimeflow-storage-root-results"
    root_uri: str

    def _key(self, path: str) -> str:
        return join_key(RESULTS_PREFIX, path)

    async def aread_path(self, path: str) -> bytes:
        return open_storage(self.root_uri).get_bytes(self._key(path))

    @async_dispatch(aread_path)
    def read_path(self, path: str) -> bytes:
        return open_storage(self.root_uri).get_bytes(self._key(path))

    async def awrite_path(self, path: str, content: bytes) -> str:
        open_storage(self.root_uri).put_bytes(self._key(path), content)
        return path

    @async_dispatch(awrite_path)
    def write_path(self, path: str, content: bytes) -> str:
        open_storage(self.root_uri).put_bytes(self._key(path), content)
        return path


def results_block(root_uri: str) -> StorageRootResults:
    """The saved block for `root_uri` (Prefect only accepts saved blocks as task result storage)."""
    block = StorageRootResults(root_uri=root_uri)
    name = "results-" + hashlib.sha256(root_uri.encode()).hexdigest()[:16]
    block.save(name, overwrite=True)
    return block

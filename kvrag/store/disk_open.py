"""Opening a ``DiskStore``'s directory: the lock held while it is opened (or created), its two
diskcache caches with their files checked first, and the failures of the environment (another
process holding the database lock, permissions, a full disk) told apart from a damaged store,
so their messages never advise deleting a healthy one.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import diskcache
import diskcache.core

from kvrag.errors import StoreError
from kvrag.store.confined import check_db_files, sanitize_settings


class DirLock:
    """An exclusive lock between processes on the file ``path`` (flock on POSIX, msvcrt on
    Windows), held while a store is opened (or created)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> DirLock:
        # O_NOFOLLOW: a lock file planted as a symlink must not create or open a file elsewhere.
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            self._f = os.fdopen(os.open(self.path, flags, 0o644), "a+b")
        except OSError as e:
            raise StoreError(
                f"cannot open the lock file {self.path} ({e.strerror}): a store directory must hold its own files"
            ) from e
        try:
            import fcntl

            fcntl.flock(self._f.fileno(), fcntl.LOCK_EX)
        except ImportError:  # Windows
            import msvcrt

            self._f.seek(0)
            msvcrt.locking(self._f.fileno(), msvcrt.LK_LOCK, 1)  # type: ignore[attr-defined]  # Windows-only module
        return self

    def __exit__(self, *exc) -> None:
        self._f.close()  # closing the file releases the lock


def open_cache(directory: Path, name: str, wait_s: float, **settings) -> diskcache.Cache:
    """The diskcache cache ``directory/name`` with ``settings``, once its files are checked to
    be the store's own and its settings cleaned of anything diskcache would obey but never
    writes (``kvrag.store.confined``); a write waits ``wait_s`` seconds for the database lock."""
    path = directory / name
    check_db_files(path)
    sanitize_settings(path / diskcache.core.DBNAME, wait_s)
    cache = diskcache.Cache(str(path), **settings)
    # diskcache opens this thread's connection while its own timeout is still 0 (it retries
    # by hand during __init__): give it the store's wait for the write lock too.
    cache._con.execute(f"PRAGMA busy_timeout = {int(wait_s * 1000)}")
    return cache


def environment_error(e: BaseException, doing: str, directory: Path, timeout: float) -> StoreError | None:
    """A StoreError for a failure of the environment rather than of the store in
    ``directory`` -- another process holding the database lock, a full disk -- whose message
    says so (and does not advise deleting a healthy store); None for any other error."""
    text = str(e).lower()
    if isinstance(e, diskcache.Timeout) or "database is locked" in text or "database is busy" in text:
        return StoreError(
            f"cannot {doing} the DiskStore in {directory}: another process has held its database "
            f"locked for over {timeout:g} s ({e or 'timeout'}); the store is not damaged: retry "
            "once that process is done, or raise DiskStore(timeout=...)"
        )
    if isinstance(e, PermissionError) or getattr(e, "errno", None) in (errno.EACCES, errno.EPERM, errno.EROFS):
        where = getattr(e, "filename", None)
        return StoreError(
            f"cannot {doing} the DiskStore in {directory}: permission denied"
            f"{f' on {where}' if where else ''} ({getattr(e, 'strerror', None) or e}); make the whole directory "
            f"writable by this user (e.g. chown -R / chmod -R u+rwX {directory}) or pass a writable cache_dir"
        )
    if getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "disk is full" in text:
        return StoreError(
            f"cannot {doing} the DiskStore in {directory}: the disk is full ({e}); the store is "
            "not damaged and its entries are still served: free space (or lower size_limit) and retry"
        )
    return None

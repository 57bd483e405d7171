"""A store directory is data, never code: the diskcache ``Disk`` and the checks that make a
crafted ``cache.db`` (copied, shared over a network filesystem, restored from a backup) worth
at most a miss.

diskcache's own ``Disk`` obeys each row it reads: ``raw = 0`` unpickles the key (so iterating
the keys runs a crafted pickle), ``mode = MODE_PICKLE`` unpickles the value (``get`` runs it),
and ``filename`` is joined to the directory as it is, so ``../../x``, an absolute path or a
symlink makes ``get`` read any file and the corrupt-entry path delete it, with its emptied
parent directory. Its ``Settings`` table is obeyed too: every ``sqlite_*`` row becomes a
``PRAGMA`` and every ``disk_*`` row an attribute of the ``Disk``.

kvrag writes only ``str`` keys and ``bytes``/``str`` values, so ``ConfinedDisk`` refuses
everything else rather than interpreting it. We subclass ``Disk`` instead of reading the rows
with sqlite3 ourselves because every diskcache path that turns a row into a Python object or a
file (get, iterkeys, delete, the removal of replaced files) goes through these few methods:
confining them covers paths we would otherwise re-implement and keep in step with diskcache.

- keys: a stored key that is not a raw ``str`` comes back as ``None`` (callers skip it); only
  ``str`` keys are accepted.
- values: a pickled value, or a raw value of another type than ``bytes``/``str``, is refused
  with ``OSError``, which diskcache treats as "the value vanished": a miss.
- files: a file name is a relative path of plain components (no ``..``, not absolute), opened
  one directory at a time from the cache directory without following symlinks, non-blocking
  (a FIFO never hangs the open), and must be a regular file. Removal and the creation of a new
  value file walk the same way, so they can only touch names inside the directory.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import io
import logging
import os
import re
import socket
import sqlite3
import stat
import threading
from pathlib import Path

import diskcache
import diskcache.core
from diskcache.core import MODE_BINARY, MODE_RAW, MODE_TEXT

from kvrag.errors import StoreError

log = logging.getLogger(__name__)

_O = lambda name: getattr(os, name, 0)  # noqa: E731  (flags missing on some platforms)
_DIR_FLAGS = os.O_RDONLY | _O("O_DIRECTORY") | _O("O_NOFOLLOW") | _O("O_CLOEXEC")
_FILE_FLAGS = os.O_RDONLY | _O("O_NOFOLLOW") | _O("O_NONBLOCK") | _O("O_CLOEXEC") | _O("O_BINARY")
# Without dir_fd (Windows) the walk falls back to refusing any symlink on the way.
_AT = {os.open, os.unlink, os.mkdir, os.rmdir} <= os.supports_dir_fd

#: diskcache settings this kvrag lets a store's Settings table hold (all that diskcache itself
#: writes); a ``sqlite_*`` value must be a plain word or number, as diskcache interpolates it
#: into a PRAGMA statement.
_KNOWN_SETTINGS = frozenset(diskcache.DEFAULT_SETTINGS) | frozenset(diskcache.core.METADATA)
_PRAGMA_VALUE = re.compile(r"-?[0-9]{1,19}|[A-Za-z]{1,16}")


def _parts(name: object) -> list[str]:
    """The components of a row's file name, or OSError if it could leave the directory."""
    if not isinstance(name, str) or not name or os.path.isabs(name) or os.path.splitdrive(name)[0]:
        raise OSError(errno.EPERM, f"file name {name!r} is not a relative path inside the store")
    parts = re.split(r"[\\/]", name)
    if len(parts) > 8 or any(p in ("", ".", "..") or "\0" in p for p in parts):
        raise OSError(errno.EPERM, f"file name {name!r} is not a relative path inside the store")
    return parts


class ConfinedDisk(diskcache.Disk):
    """``diskcache.Disk`` for kvrag's two caches: refuses pickles and non-``str`` keys, and
    confines every file it opens or removes to the cache directory (module docstring)."""

    def __init__(self, directory, min_file_size=0, pickle_protocol=0):
        super().__init__(directory, min_file_size=min_file_size, pickle_protocol=pickle_protocol)
        # Kept apart from diskcache's ``_directory`` attribute: the root files are confined to.
        self._root = str(directory)
        self._local = threading.local()

    # ---- keys ----------------------------------------------------------------------
    def put(self, key):
        if type(key) is not str:  # noqa: E721 -- a str subclass could pickle itself
            raise TypeError(f"kvrag's caches take str keys only, got {type(key).__name__}")
        return key, True

    def get(self, key, raw):
        # A pickled (raw = 0) or non-text key is never ours: never unpickled, skipped by callers.
        return key if raw and type(key) is str else None  # noqa: E721

    # ---- values --------------------------------------------------------------------
    def store(self, value, read, key=diskcache.core.UNKNOWN):
        if type(value) not in (bytes, str):
            raise TypeError(f"kvrag's caches store bytes or str only, got {type(value).__name__}")
        self._local.written = None
        size, mode, filename, db_value = super().store(value, read, key=key)
        self._local.written = filename  # for DiskStore to remove if the row is never committed
        return size, mode, filename, db_value

    def last_written(self) -> str | None:
        """The file name of this thread's last ``store`` (None if it kept the value in SQLite)."""
        return getattr(self._local, "written", None)

    def _write(self, full_path, iterator, mode, encoding=None):
        """diskcache's write of a new value file, but with each directory on the way created
        and opened without following symlinks (a crafted ``blobs/xx`` link would otherwise
        receive the file) and the file created exclusively. A write cut short (disk full)
        removes its file: it is ours and no row will point at it."""
        parts = _parts(os.path.relpath(full_path, self._root))
        if not _AT:
            self._fallback_path(parts)  # refuses a symlink on the way
            try:
                return super()._write(full_path, iterator, mode, encoding)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.remove(full_path)
                raise
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O("O_NOFOLLOW") | _O("O_CLOEXEC")
        for attempt in range(10):  # as diskcache: another process may remove an emptied directory
            try:
                with self._dirs(parts, create=True) as fds:
                    fd = os.open(parts[-1], flags, 0o644, dir_fd=fds[-1])
                break
            except FileNotFoundError:
                if attempt == 9:
                    raise
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise OSError(
                        e.errno,
                        f"{os.path.join(self._root, *parts[:-1])} is not a directory of the "
                        "store (a symbolic link?): not written",
                    ) from None
                raise
        try:
            with open(fd, "wb" if "b" in mode else "w", encoding=None if "b" in mode else encoding) as writer:
                size = 0
                for chunk in iterator:
                    size += len(chunk)
                    writer.write(chunk)
                return size
        except BaseException:
            with contextlib.suppress(OSError), self._dirs(parts) as fds:
                os.unlink(parts[-1], dir_fd=fds[-1])
            raise

    def fetch(self, mode, filename, value, read):
        if mode == MODE_RAW and type(value) in (bytes, str):
            if read:
                return io.BytesIO(value.encode("utf-8") if type(value) is str else value)
            return value
        if mode in (MODE_BINARY, MODE_TEXT):
            handle = self.open(filename)
            if read:
                return handle
            with handle:
                data = handle.read()
            if mode == MODE_BINARY:
                return data
            try:
                return data.decode("utf-8")
            except UnicodeDecodeError as e:
                raise OSError(errno.EILSEQ, f"{filename!r} is not UTF-8 text: {e}") from None
        log.warning(
            "DiskStore: refused a row of %s with mode %r and a %s value (kvrag never writes "
            "pickled or other values): treated as missing",
            self._root,
            mode,
            type(value).__name__,
        )
        raise OSError(errno.EPERM, f"refused a row with mode {mode!r}")

    # ---- files ---------------------------------------------------------------------
    def filename(self, key=diskcache.core.UNKNOWN, value=diskcache.core.UNKNOWN):
        """diskcache's random ``xx/yy/<hex>.val`` name with the writer's host and pid added
        (``<hex>.<host>-<pid>.val``), so that ``writer_is_dead`` can tell the file of a write
        that can never commit from one still in progress."""
        hex_name = os.urandom(16).hex()
        name = os.path.join(hex_name[:2], hex_name[2:4], f"{hex_name[4:]}.{_host_id()}-{os.getpid()}.val")
        return name, os.path.join(self._root, name)

    @staticmethod
    def writer_is_dead(filename: str) -> bool:
        """Whether ``filename`` was written by a process of this host (same machine, boot and
        pid namespace) that no longer runs: such a file without a row is provably dead (its
        writer can no longer commit the row). False when unsure (another host, a name without
        an owner, a pid that runs -- possibly reused, then the file waits for gc's grace)."""
        m = re.search(r"\.([0-9a-f]{8})-([0-9]{1,10})\.val$", str(filename))
        if os.name != "posix" or m is None or m.group(1) != _host_id():  # os.kill(pid, 0) kills on Windows
            return False
        pid = int(m.group(2))
        if pid == os.getpid():
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:  # EPERM: it runs, as another user
            return False
        return False

    @contextlib.contextmanager
    def _dirs(self, parts: list[str], create: bool = False):
        """File descriptors of the cache directory and each directory on the way to the
        file ``parts`` (none followed through a symlink; with ``create``, made if missing)."""
        fds = [os.open(self._root, _DIR_FLAGS & ~_O("O_NOFOLLOW"))]  # the store itself may be a link
        try:
            for p in parts[:-1]:
                if create:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(p, 0o755, dir_fd=fds[-1])
                fds.append(os.open(p, _DIR_FLAGS, dir_fd=fds[-1]))
            yield fds
        finally:
            for fd in fds:
                os.close(fd)

    def _fallback_path(self, parts: list[str]) -> str:
        path = self._root
        for p in parts:
            path = os.path.join(path, p)
            if os.path.islink(path):
                raise OSError(errno.ELOOP, f"{path} is a symbolic link")
        return path

    def open(self, filename) -> io.BufferedReader:
        """The regular file ``filename`` (relative to the cache directory), opened for reading;
        OSError if it is outside the directory, reached through a symlink, or not a regular file
        (a FIFO, a device)."""
        parts = _parts(filename)
        if _AT:
            with self._dirs(parts) as fds:
                fd = os.open(parts[-1], _FILE_FLAGS, dir_fd=fds[-1])
        else:
            fd = os.open(self._fallback_path(parts), _FILE_FLAGS)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, f"{filename!r} is not a regular file")
            raw = io.FileIO(fd, "rb", closefd=True)
        except BaseException:
            os.close(fd)
            raise
        raw.name = os.path.join(self._root, filename)  # identifies this version (diskcache never reuses a name)
        return io.BufferedReader(raw)

    def exists(self, filename) -> bool:
        """Whether ``filename`` names a regular file inside the directory (False for a name
        outside it: such a row points at nothing of ours)."""
        try:
            self.open(filename).close()
            return True
        except OSError as e:
            return e.errno not in (errno.ENOENT, errno.EPERM, errno.ELOOP, errno.ENOTDIR, errno.EINVAL)

    def remove(self, file_path):
        """Unlink ``file_path`` inside the directory and the directories below it it leaves
        empty; a name outside the directory is refused (logged), errors are suppressed as in
        diskcache (two processes may remove the same file)."""
        try:
            parts = _parts(file_path)
        except OSError as e:
            log.warning("DiskStore: not removing %s: %s", file_path, e.strerror)
            return
        with contextlib.suppress(OSError):
            if not _AT:
                path = self._fallback_path(parts)
                os.remove(path)
                for _ in parts[:-1]:
                    path = os.path.dirname(path)
                    os.rmdir(path)
                return
            with self._dirs(parts) as fds:
                os.unlink(parts[-1], dir_fd=fds[-1])
                for i in range(len(parts) - 1, 0, -1):  # emptied directories, never the root
                    os.rmdir(parts[i - 1], dir_fd=fds[i - 1])


@functools.lru_cache(maxsize=1)
def _host_id() -> str:
    """8 hex digits naming this host, boot and pid namespace: pids are comparable only within it."""
    parts = [socket.gethostname()]
    for path in ("/proc/sys/kernel/random/boot_id", "/proc/self/ns/pid"):
        try:
            parts.append(os.readlink(path) if path.endswith("/pid") else Path(path).read_text().strip())
        except OSError:
            parts.append("")
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:8]


def check_db_files(directory: Path) -> None:
    """Refuse a cache directory whose SQLite files are symlinks or special files: SQLite would
    follow the link and write wherever it points, or block on a FIFO."""
    for path in (directory, *(directory / (diskcache.core.DBNAME + s) for s in ("", "-wal", "-shm", "-journal"))):
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(st.st_mode) or not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
            raise StoreError(
                f"{path} is a symbolic link or a special file, not part of a DiskStore: "
                "a store directory must hold its own files"
            )


def _setting_ok(key: object, value: object) -> bool:
    if key not in _KNOWN_SETTINGS:
        return False
    if key == "eviction_policy":
        return value in diskcache.EVICTION_POLICY
    if isinstance(key, str) and key.startswith("sqlite_"):
        return type(value) in (int, str) and bool(_PRAGMA_VALUE.fullmatch(str(value)))
    return type(value) is int and value >= 0  # counts, sizes, limits, flags


def sanitize_settings(db: Path, timeout: float) -> None:
    """Remove the rows of a store's ``Settings`` table that diskcache would act on but never
    writes itself: unknown keys (``sqlite_<pragma>``, ``disk_<attribute>``) and values that are
    not plain words or numbers. diskcache then re-creates its defaults for what was removed.
    Taken under a write lock, which also tells a locked-out store (``database is locked``
    after ``timeout`` seconds) from a damaged one before diskcache's own 60 s retries."""
    if not db.exists():
        return
    con = sqlite3.connect(str(db), timeout=timeout, isolation_level=None)
    try:
        con.execute("PRAGMA mmap_size = 0")  # read the file, never a SIGBUS on a damaged one
        con.execute("BEGIN IMMEDIATE")
        try:
            rows = con.execute("SELECT key, value FROM Settings").fetchall()
        except sqlite3.OperationalError:  # no Settings table yet: diskcache creates it
            rows = []
        bad = [key for key, value in rows if not _setting_ok(key, value)]
        for key in bad:
            log.warning("DiskStore: %s holds a setting diskcache would obey but never writes (%r); removed", db, key)
            con.execute("DELETE FROM Settings WHERE key = ?", (key,))
        con.execute("COMMIT")
    finally:
        con.close()

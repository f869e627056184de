"""Opening a store directory: the LMDB environment, its named databases, the format check, the
clean-shutdown marker and the lock that tells openers apart; and running transactions on it.

LMDB settings follow docs/STORAGE.md: a large map (the byte budget is enforced by the store,
not by ``MapFullError``), no writemap, ``sync=False`` plus a background ``env.sync()`` (the
writer), readahead on (off makes cold large values ~10x slower).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import lmdb

from kvstrata import fsmode
from kvstrata.tiers import records as rec

log = logging.getLogger(__name__)

T = TypeVar("T")


class StoreFormatError(Exception):
    """The directory holds a store this build cannot read (other format version, not kvstrata)."""


class StoreUnavailableError(Exception):
    """The store directory is missing, not a directory, not writable, or cannot be opened."""


class _SharedEnvs:
    """One ``lmdb.Environment`` per store directory per process, reference counted.

    LMDB forbids opening the same environment twice in one process; two engines, or an engine and
    a tool, in one process must still be able to open the same store. Each opener keeps its own
    lock-file descriptor and threads; only the environment is shared.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._envs: dict[tuple[str, bool], list[Any]] = {}  # (realpath, readonly) -> [env, refs]

    def acquire(self, path: Path, readonly: bool, opener: Callable[[], lmdb.Environment]) -> lmdb.Environment:
        key = (os.path.realpath(path), readonly)
        with self._lock:
            entry = self._envs.get(key)
            if entry is None:
                entry = self._envs[key] = [opener(), 0]
            entry[1] += 1
            return entry[0]

    def release(self, env: lmdb.Environment) -> None:
        with self._lock:
            for key, entry in list(self._envs.items()):
                if entry[0] is env:
                    entry[1] -= 1
                    if entry[1] == 0:
                        del self._envs[key]
                        env.close()
                    return
        env.close()


_SHARED_ENVS = _SharedEnvs()


class _Gate:
    """Readers-writer gate around LMDB transactions.

    ``env.set_mapsize`` (needed after another process grew the map) is only legal while this
    process has no transaction open; py-lmdb does not check that (docs/STORAGE.md).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._active = 0
        self._exclusive = False

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            while self._exclusive:
                self._cond.wait()
            self._active += 1
        try:
            yield
        finally:
            with self._cond:
                self._active -= 1
                if self._active == 0:
                    self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            while self._exclusive:
                self._cond.wait()
            self._exclusive = True
            while self._active:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()


class StoreEnv:
    """An open store directory: environment, database handles, lock, session marker.

    ``first`` tells whether this writable opener was the only one when it opened (only then does
    a cleared clean marker mean the last session ended without ``close()``); ``unclean`` is that
    verdict. ``on_map_resized`` is called after adopting a map grown by another process.
    ``mode``: a directory this creates gets it, the files it creates the same bits without
    execute (``kvstrata.fsmode``); what exists keeps its modes. ``session=False``: a writable
    opener working for another that has the store open already (the put process,
    ``put_process.py``): it neither reads nor rewrites the clean-shutdown marker. Any writable
    opener waits for a write transaction running meanwhile to end (py-lmdb opens a writable
    environment's database handles in a write transaction).
    """

    def __init__(self, path: Path, *, map_size: int, create: bool, readonly: bool,
                 mode: int = fsmode.DEFAULT_DIR_MODE, session: bool = True) -> None:
        self.path = path
        self.readonly = readonly
        self._mode = mode
        self.unclean = False
        self.map_resized = 0
        self._gate = _Gate()
        self._closed = False
        self._lock_fd: int | None = None
        self._prepare_dir(create)
        first = self._take_lock() if not readonly else False
        try:
            self.env = _SHARED_ENVS.acquire(path, readonly, lambda: self._open_env(map_size, create))
            try:
                self.handles = self._open_dbs()
                self._check_format()
                if not readonly and session:
                    self._start_session(first)
                if first:  # let other openers in now that the marker has been read
                    assert self._lock_fd is not None
                    fcntl.flock(self._lock_fd, fcntl.LOCK_SH)
            except BaseException:
                _SHARED_ENVS.release(self.env)
                raise
        except BaseException:
            self._release_lock()
            raise
        self.max_key = self.env.max_key_size()

    # ---- opening ------------------------------------------------------------------------------

    def _prepare_dir(self, create: bool) -> None:
        path = self.path
        if not path.exists():
            if not create or self.readonly:
                raise StoreUnavailableError(f"no store at {path}: the directory does not exist (create=False)")
            try:
                fsmode.make_dirs(path, self._mode)
            except OSError as exc:
                raise StoreUnavailableError(f"cannot create store directory {path}: {exc.strerror or exc}") from exc
        if not path.is_dir():
            raise StoreUnavailableError(f"store path {path} exists but is not a directory")
        if not self.readonly and not os.access(path, os.W_OK | os.X_OK):
            raise StoreUnavailableError(f"store directory {path} is not writable by this user")
        data = path / rec.DATA_FILE
        if not data.exists() and (not create or self.readonly):
            raise StoreUnavailableError(f"no store at {path}: {rec.DATA_FILE} is missing (create=False)")
        # Empty: a failed copy, or a store another opener is creating right now (its files are
        # made before LMDB writes its first pages, see _open_env): a creating opener joins it.
        if data.exists() and data.stat().st_size == 0 and (not create or self.readonly):
            raise StoreFormatError(f"{data} is empty: not a kvstrata store (a failed copy?)")

    def _take_lock(self) -> bool:
        """Share a lock file with the other writable openers; True when we are the only one."""
        try:
            fd = self._create(rec.LOCK_FILE)
        except OSError as exc:
            raise StoreUnavailableError(f"store directory {self.path} is not writable: {exc.strerror}") from exc
        self._lock_fd = fd
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            fcntl.flock(fd, fcntl.LOCK_SH)
            return False

    def _create(self, name: str) -> int:
        """Open the store file ``name``, created with the store's file mode when missing (an
        existing store's: that of its data file, e.g. a lock table a compaction removed)."""
        mode = fsmode.file_mode(self._mode)
        with contextlib.suppress(OSError):
            mode = stat.S_IMODE((self.path / rec.DATA_FILE).stat().st_mode)
        try:
            fd = os.open(self.path / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
        except FileExistsError:
            return os.open(self.path / name, os.O_RDWR)
        os.fchmod(fd, mode)  # exactly: the umask may have removed a group bit store_mode asked for
        return fd

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing drops the flock
            self._lock_fd = None

    def _open_env(self, map_size: int, create: bool) -> lmdb.Environment:
        if create and not self.readonly:
            # LMDB creates data.mdb and lock.mdb with 0644 less the umask: make them ours first.
            for name in (rec.DATA_FILE, rec.LMDB_LOCK_FILE):
                try:
                    os.close(self._create(name))
                except OSError as exc:
                    raise StoreUnavailableError(f"cannot create {self.path / name}: {exc.strerror or exc}") from exc
        try:
            return lmdb.open(
                str(self.path), map_size=map_size, subdir=True, readonly=self.readonly,
                create=create and not self.readonly,
                sync=False,  # durability comes from the writer's periodic env.sync()
                metasync=False,
                writemap=False,  # slower with sync and pre-sizes the file to map_size
                readahead=True,  # readahead off makes cold large values ~10x slower
                meminit=False, max_dbs=4, max_readers=512, max_spare_txns=16, lock=True,
                mode=fsmode.file_mode(self._mode),
            )
        except (lmdb.InvalidError, lmdb.VersionMismatchError, lmdb.IncompatibleError,
                lmdb.CorruptedError) as exc:
            raise StoreFormatError(f"{self.path} does not hold an LMDB store this build can read: {exc}") from exc
        except (lmdb.Error, OSError) as exc:
            raise StoreUnavailableError(f"cannot open store at {self.path}: {exc}") from exc

    def _open_dbs(self) -> rec.Handles:
        env = self.env
        try:
            if self.readonly:
                return rec.Handles.open(env, create=False)
            with env.begin(write=True) as txn:
                main = env.open_db(txn=txn)
                # Named databases are keys of the main one: a non-empty main database without
                # our "meta" key belongs to some other program.
                if txn.stat(main)["entries"] and txn.get(rec.DB_META) is None:
                    raise StoreFormatError(f"{self.path} holds an LMDB environment that is not a kvstrata store")
                return rec.Handles.open(env, txn)
        except lmdb.NotFoundError as exc:
            raise StoreFormatError(f"{self.path} is not a kvstrata store (missing named databases)") from exc
        except lmdb.ReadonlyError as exc:
            raise StoreUnavailableError(f"store at {self.path} is not writable: {exc}") from exc
        except lmdb.Error as exc:
            raise StoreFormatError(f"{self.path} is not a kvstrata store: {exc}") from exc

    def _check_format(self) -> None:
        h = self.handles
        try:
            with self.env.begin() as txn:
                raw = txn.get(rec.META_FORMAT, db=h.meta)
                empty = txn.stat(h.payload)["entries"] == 0 and txn.stat(h.index)["entries"] == 0
        except lmdb.Error as exc:
            raise StoreFormatError(f"{self.path}: the store's structure is damaged ({exc})") from exc
        if raw is None:
            if not empty:
                raise StoreFormatError(f"store at {self.path} has no format version; expected {rec.FORMAT_VERSION}")
            if self.readonly:
                raise StoreUnavailableError(f"store at {self.path} is empty and not initialised")
            with self.env.begin(write=True) as txn:
                txn.put(rec.META_FORMAT, str(rec.FORMAT_VERSION).encode(), db=h.meta)
            return
        try:
            found: int | str = int(raw)
        except ValueError:
            found = bytes(raw).decode(errors="replace")
        if found != rec.FORMAT_VERSION:
            raise StoreFormatError(
                f"store at {self.path} has format version {found}; this build reads version {rec.FORMAT_VERSION}")

    def _start_session(self, first: bool) -> None:
        """Read and clear the clean-shutdown marker; make the cleared marker durable first."""
        self.env.reader_check()  # drop reader slots left by killed processes
        try:
            with self.env.begin(write=True) as txn:
                marker = txn.get(rec.META_CLEAN, db=self.handles.meta)
                # A never-closed new store has no marker; "0": a session ended without close().
                self.unclean = first and marker == b"0"
                txn.put(rec.META_CLEAN, b"0", db=self.handles.meta)
        except rec.LMDB_DAMAGE as exc:  # e.g. the free-page list's root damaged: no write works
            raise StoreFormatError(
                f"store at {self.path} cannot be written: its structure is damaged ({exc}); "
                f"`kvstrata verify --repair {self.path}` rebuilds it from the records it can read"
            ) from exc
        self.env.sync(True)
        if self.unclean:
            log.warning("store at %s was not closed cleanly: verifying every record", self.path)

    # ---- transactions -----------------------------------------------------------------------

    def txn(self, fn: Callable[[lmdb.Transaction[Any]], T], *, write: bool = False, buffers: bool = False) -> T:
        """Run ``fn`` in one transaction (committed when ``write``), retrying after another
        process grew the map. StoreUnavailableError once closed."""
        for _ in range(8):
            try:
                with self._gate.shared():
                    if self._closed:
                        raise StoreUnavailableError(f"store at {self.path} is closed")
                    with rec.begin(self.env, write=write, buffers=buffers) as txn:
                        return fn(txn)
            except lmdb.MapResizedError:
                # Adopt the size another process grew the map to (0: whatever the file says).
                with self._gate.exclusive():
                    if not self._closed:
                        self.env.set_mapsize(0)
                self.map_resized += 1
        raise StoreUnavailableError(f"store at {self.path}: map keeps being resized by another process")

    def last_txnid(self) -> int:
        """The id of the last write transaction committed to the store, by any process. Inside
        the gate: ``mdb_env_info`` reads the meta pages through the map, which adopting another
        process's map size replaces."""
        with self._gate.shared():
            if self._closed:
                raise StoreUnavailableError(f"store at {self.path} is closed")
            return int(self.env.info()["last_txnid"])

    def sync(self) -> None:
        with self._gate.shared():
            if not self._closed:
                self.env.sync(True)

    def mark_clean(self) -> None:
        """Set the clean-shutdown marker, unless another writable opener still has the store."""
        assert self._lock_fd is not None
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return
        with self.env.begin(write=True) as txn:
            txn.put(rec.META_CLEAN, b"1", db=self.handles.meta)
        self.env.sync(True)

    def close(self) -> None:
        with self._gate.exclusive():
            if self._closed:
                return
            self._closed = True
            _SHARED_ENVS.release(self.env)
        self._release_lock()

"""The disk tier: a compressed, checksummed, crash-aware LMDB store of KV chunks.

One LMDB environment per directory with three named databases:

* ``payload``: store key -> codec frame (``kvstrata.tiers.codec``), one large value per key;
* ``index``: store key -> :class:`IndexRecord` (msgpack, ~40 B), iterated at startup and by
  compaction without touching the payload pages;
* ``meta``: format version, clean-shutdown marker, running totals, namespace registry.

LMDB settings follow storage-facts.md §4: a large map (the byte budget is enforced here, not by
``MapFullError``), no writemap, ``sync=False`` plus a background ``env.sync()`` every second
(sooner once 64 MiB are dirty), one put per transaction for large values, and short read
transactions that decompress straight out of the zero-copy mmap view.

Access ticks (for LRU eviction) are kept in memory by reads and flushed in batches by the writer;
an unclean shutdown (the ``clean`` marker still cleared at open) starts a background pass that
verifies every record's checksum and drops the bad ones, while gets stay safe because every
decode checks the checksum of what it wrote.

Threads: every write (puts, deletes, access-tick flushes, evictions) runs on one writer thread;
reads run in the caller's thread (callers use a thread pool), each in its own short read
transaction. Several processes may open the same store: LMDB serialises their write
transactions and the running totals live in ``meta`` so that they stay exact across processes.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import lmdb
import msgspec

from kvstrata.compaction.policy import (  # one retention rule, shared with compaction
    select_lru_victims,
    select_victims,
)
from kvstrata.tiers import codec
from kvstrata.tiers import codec as codec_mod

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = [
    "FORMAT_VERSION",
    "CorruptRecord",
    "DiskStore",
    "IndexRecord",
    "StoreFormatError",
    "StoreUnavailableError",
    "select_lru_victims",
]

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
CorruptRecord = codec.CorruptRecord

_DB_PAYLOAD = b"payload"
_DB_INDEX = b"index"
_DB_META = b"meta"
_META_FORMAT = b"format_version"
_META_CLEAN = b"clean"
_META_TOTALS = b"totals"
_META_NS = b"ns:"
_LOCK_FILE = "kvstrata.lock"


class _SharedEnvs:
    """One ``lmdb.Environment`` per store directory per process, reference counted.

    LMDB forbids opening the same environment twice in one process; two engines, or an engine and a
    tool, in one process must still be able to open the same store. Each ``DiskStore`` keeps its own
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

# Values at least this large get a transaction of their own: batching large values makes LMDB
# malloc and fault dirty overflow pages per transaction (0.3-0.9x, storage-facts.md §4.1).
_LARGE_VALUE = 256 << 10
_SMALL_BATCH_BYTES = 1 << 20
_SMALL_BATCH_COUNT = 64
_TOUCH_FLUSH_MAX = 4096  # pending access ticks that force an early flush
_ITER_BATCH = 1024  # index entries read per short transaction by iter_index

T = TypeVar("T")


class StoreFormatError(Exception):
    """The directory holds a store this build cannot read (other format version, not kvstrata)."""


class StoreUnavailableError(Exception):
    """The store directory is missing, not a directory, not writable, or cannot be opened."""


class IndexRecord(msgspec.Struct, array_like=True, frozen=True):
    """Per-key metadata kept apart from the payload so scans never touch payload pages."""

    raw_len: int
    stored_len: int
    codec: int
    checksum: int
    tick: int  # last access, microseconds since the epoch (comparable across processes)
    group: int  # KV-cache group index: the last 4 bytes of the chunk key, big-endian
    dtype: str


class _Totals(msgspec.Struct, array_like=True):
    entries: int = 0
    raw_bytes: int = 0
    stored_bytes: int = 0


def _group_of(key: bytes) -> int:
    return int.from_bytes(key[-4:], "big") if len(key) >= 20 else 0


def _now_us() -> int:
    return time.time_ns() // 1000


# ---------------------------------------------------------------------------------------------
# Small helpers


class _Gate:
    """Readers-writer gate around LMDB transactions.

    ``env.set_mapsize`` (needed after another process grew the map) is only legal while this
    process has no transaction open; py-lmdb does not check that (storage-facts.md §4.3).
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


@dataclass(slots=True)
class _PutJob:
    key: bytes
    frame: bytes
    info: codec.FrameInfo
    tick: int
    future: Future[bool]


@dataclass(slots=True)
class _CallJob:
    fn: Callable[[], Any]
    future: Future[Any]


_STOP = object()


@dataclass(slots=True)
class _PutOutcome:
    written: bool = False
    evicted: int = 0
    evicted_bytes: int = 0
    reason: str = ""


# ---------------------------------------------------------------------------------------------


class DiskStore:
    """Compressed LMDB store of KV chunks; see the module docstring and docs/DESIGN.md.

    ``budget_bytes`` caps the stored (compressed frame) bytes; the LMDB file is ~1.0-1.3x that.
    When a put would exceed it, the least recently used entries are evicted, ``evict_slack``
    (a fraction of the budget) more than needed so that the index scan behind an eviction is
    amortised over many puts. ``map_size`` only reserves address space (no writemap), so keep
    it large. ``level``/``codec`` select the codec (``kvstrata.tiers.codec``; "raw" stores
    uncompressed frames). ``sync_interval_s``/``sync_bytes`` pace the background ``env.sync()``;
    ``touch_flush_interval_s`` paces the batched write of access ticks; after a full map or disk
    the store stops admitting for ``full_retry_s`` seconds, then tries again.
    ``readonly=True`` opens an existing store for reads only (no writer thread, no ticks).
    Every method is thread-safe.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        budget_bytes: int,
        map_size: int = 1 << 40,
        level: int = 1,
        codec: str = "auto",
        create: bool = True,
        readonly: bool = False,
        sync_interval_s: float = 1.0,
        sync_bytes: int = 64 << 20,
        touch_flush_interval_s: float = 1.0,
        evict_slack: float = 1.0 / 64,
        full_retry_s: float = 30.0,
        max_age_s: float | None = None,
    ) -> None:
        if codec not in ("auto", "raw"):
            raise ValueError(f"codec must be 'auto' or 'raw', not {codec!r}")
        if budget_bytes <= 0:
            raise ValueError("budget_bytes must be positive")
        self.path = Path(path)
        self.budget_bytes = int(budget_bytes)
        self.readonly = readonly
        self._level = level
        self._codec_mode: codec_mod.Mode = "raw" if codec == "raw" else "auto"
        self._sync_interval = sync_interval_s
        self._sync_bytes = sync_bytes
        self._touch_interval = touch_flush_interval_s
        self._evict_slack = max(0.0, evict_slack)
        self._full_retry_s = full_retry_s
        # Retention: whenever the writer evicts, chunks idle longer than this go first (and go
        # even when the budget alone would keep them); `kvstrata compact --max-age` applies it now.
        self._max_age_us = None if max_age_s is None else int(max_age_s * 1_000_000)

        self._counts: dict[str, int] = dict.fromkeys(_COUNTERS, 0)
        self._count_lock = threading.Lock()
        self._touched: dict[bytes, int] = {}
        self._touch_lock = threading.Lock()
        self._tick_lock = threading.Lock()
        self._last_tick = 0
        self._gate = _Gate()
        self._closed = False
        self._admitting = True
        self._retry_at = 0.0
        self._full_logged = False
        self._dirty = threading.Event()
        self._dirty_bytes = 0
        self._sync_wake = threading.Event()
        self._stop = threading.Event()
        # Told the store keys of records deleted (evicted, expired, dropped as corrupt, deleted)
        # once their transaction committed; called on the thread that deleted them, so it must
        # not wait on this store. The tier hierarchy forgets those chunks' disk copies and turns
        # them into KV cache events.
        self.on_removed: Callable[[list[bytes]], None] | None = None
        self._removed = threading.local()  # keys deleted by this thread's latest write txn
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock_fd: int | None = None
        self._recovered = threading.Event()
        self._recovered.set()
        self._verified = False  # the verification after an unclean open ran to the end
        self._close_lock = threading.Lock()
        self.unclean_shutdown = False

        self._prepare_dir(create)
        first = self._take_lock() if not readonly else False
        try:
            self._env = _SHARED_ENVS.acquire(
                self.path, readonly, lambda: self._open_env(map_size, create)
            )
            try:
                self._open_dbs()
                self._check_format()
                if not readonly:
                    self._start_session(first)
                    if first:  # let other openers in now that the marker has been read
                        assert self._lock_fd is not None
                        fcntl.flock(self._lock_fd, fcntl.LOCK_SH)
            except BaseException:
                _SHARED_ENVS.release(self._env)
                raise
        except BaseException:
            self._release_lock()
            raise
        self._max_key = self._env.max_key_size()
        self._submit_lock = threading.Lock()
        self._writer_open = not readonly
        self._writer = self._spawn(self._writer_loop, "writer")
        self._syncer = self._spawn(self._syncer_loop, "sync")
        self._verifier: threading.Thread | None = None
        if self.unclean_shutdown:
            self._recovered.clear()
            self._verifier = self._spawn(self._recover, "verify")

    # ---- opening ------------------------------------------------------------------------------

    def _prepare_dir(self, create: bool) -> None:
        path = self.path
        if not path.exists():
            if not create or self.readonly:
                raise StoreUnavailableError(
                    f"no store at {path}: the directory does not exist (create=False)"
                )
            try:
                path.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StoreUnavailableError(
                    f"cannot create store directory {path}: {exc.strerror or exc}"
                ) from exc
        if not path.is_dir():
            raise StoreUnavailableError(f"store path {path} exists but is not a directory")
        if not self.readonly and not os.access(path, os.W_OK | os.X_OK):
            raise StoreUnavailableError(f"store directory {path} is not writable by this user")
        if not (path / "data.mdb").exists() and (not create or self.readonly):
            raise StoreUnavailableError(f"no store at {path}: data.mdb is missing (create=False)")

    def _take_lock(self) -> bool:
        """Share a lock file with the other writable openers; True when we are the only one.

        Only the first opener may read the clean-shutdown marker as "the last session ended
        cleanly": while another process has the store open, the marker is cleared by design.
        """
        try:
            fd = os.open(self.path / _LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise StoreUnavailableError(
                f"store directory {self.path} is not writable: {exc.strerror}"
            ) from exc
        self._lock_fd = fd
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            fcntl.flock(fd, fcntl.LOCK_SH)
            return False

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing drops the flock
            self._lock_fd = None

    def _open_env(self, map_size: int, create: bool) -> lmdb.Environment:
        try:
            return lmdb.open(
                str(self.path),
                map_size=map_size,
                subdir=True,
                readonly=self.readonly,
                create=create and not self.readonly,
                sync=False,  # durability comes from the periodic env.sync() (storage-facts §4.1)
                metasync=False,
                writemap=False,  # slower with sync and pre-sizes the file to map_size
                readahead=True,  # readahead off makes cold large values ~10x slower
                meminit=False,
                max_dbs=4,
                max_readers=512,
                max_spare_txns=16,
                lock=True,
            )
        except (
            lmdb.InvalidError,
            lmdb.VersionMismatchError,
            lmdb.IncompatibleError,
            lmdb.CorruptedError,
        ) as exc:
            raise StoreFormatError(
                f"{self.path} does not hold an LMDB store this build can read: {exc}"
            ) from exc
        except (lmdb.Error, OSError) as exc:
            raise StoreUnavailableError(f"cannot open store at {self.path}: {exc}") from exc

    def _open_dbs(self) -> None:
        try:
            if self.readonly:
                # Without txn=, py-lmdb opens each handle in a committed read transaction;
                # handles opened inside an open read transaction are invalid outside it.
                self._payload = self._env.open_db(_DB_PAYLOAD, create=False)
                self._index = self._env.open_db(_DB_INDEX, create=False)
                self._meta = self._env.open_db(_DB_META, create=False)
            else:
                with self._env.begin(write=True) as txn:
                    main = self._env.open_db(txn=txn)
                    # Named databases are keys of the main one: a non-empty main database
                    # without our "meta" key belongs to some other program.
                    foreign = txn.stat(main)["entries"] and txn.get(_DB_META) is None
                    if foreign:
                        raise StoreFormatError(
                            f"{self.path} holds an LMDB environment that is not a kvstrata store"
                        )
                    self._payload = self._env.open_db(_DB_PAYLOAD, txn=txn)
                    self._index = self._env.open_db(_DB_INDEX, txn=txn)
                    self._meta = self._env.open_db(_DB_META, txn=txn)
        except lmdb.NotFoundError as exc:
            raise StoreFormatError(
                f"{self.path} is not a kvstrata store (missing named databases)"
            ) from exc
        except lmdb.Error as exc:
            if isinstance(exc, lmdb.ReadonlyError):
                raise StoreUnavailableError(f"store at {self.path} is not writable: {exc}") from exc
            raise StoreFormatError(f"{self.path} is not a kvstrata store: {exc}") from exc

    def _check_format(self) -> None:
        with self._env.begin() as txn:
            raw = txn.get(_META_FORMAT, db=self._meta)
            empty = (
                txn.stat(self._payload)["entries"] == 0 and txn.stat(self._index)["entries"] == 0
            )
        if raw is None:
            if not empty:
                raise StoreFormatError(
                    f"store at {self.path} has no format version; expected {FORMAT_VERSION}"
                )
            if self.readonly:
                raise StoreUnavailableError(f"store at {self.path} is empty and not initialised")
            with self._env.begin(write=True) as txn:
                txn.put(_META_FORMAT, str(FORMAT_VERSION).encode(), db=self._meta)
            return
        try:
            found: int | str = int(raw)
        except ValueError:
            found = raw.decode(errors="replace")
        if found != FORMAT_VERSION:
            raise StoreFormatError(
                f"store at {self.path} has format version {found}; this build reads version {FORMAT_VERSION}"
            )

    def _start_session(self, first: bool) -> None:
        """Read and clear the clean-shutdown marker; make the cleared marker durable first."""
        self._env.reader_check()  # drop reader slots left by killed processes
        with self._env.begin(write=True) as txn:
            marker = txn.get(_META_CLEAN, db=self._meta)
            # A never-closed new store has no marker; "0" means a session ended without close().
            self.unclean_shutdown = first and marker == b"0"
            txn.put(_META_CLEAN, b"0", db=self._meta)
        self._env.sync(True)
        if self.unclean_shutdown:
            log.warning("store at %s was not closed cleanly: verifying every record", self.path)

    def _spawn(self, target: Callable[[], None], name: str) -> threading.Thread:
        thread = threading.Thread(target=target, name=f"kvstrata-disk-{name}", daemon=True)
        if not self.readonly:
            thread.start()
        return thread

    # ---- transactions ---------------------------------------------------------------------------

    def _adopt_map_size(self) -> None:
        # Another process grew the map: adopt its size (0 = "whatever the file says").
        with self._gate.exclusive():
            if not self._closed:
                self._env.set_mapsize(0)
        self._bump("map_resized")

    def _txn(
        self, fn: Callable[[lmdb.Transaction], T], *, write: bool = False, buffers: bool = False
    ) -> T:
        """Run ``fn`` in one transaction (committed when ``write``), retrying after MapResized."""
        for _ in range(8):
            if write:  # records deleted in this transaction, reported once it commits
                self._removed.keys = []
            try:
                with self._gate.shared():
                    if self._closed:
                        raise StoreUnavailableError(f"store at {self.path} is closed")
                    with self._env.begin(write=write, buffers=buffers) as txn:
                        result = fn(txn)
                if write:
                    self._report_removed()  # committed: the records are gone
                return result
            except lmdb.MapResizedError:
                self._adopt_map_size()
        raise StoreUnavailableError(
            f"store at {self.path}: map keeps being resized by another process"
        )

    def _bump(self, name: str, n: int = 1) -> None:
        with self._count_lock:
            self._counts[name] += n

    def _next_tick(self) -> int:
        # Wall-clock microseconds (comparable across processes), strictly increasing here.
        with self._tick_lock:
            self._last_tick = max(self._last_tick + 1, _now_us())
            return self._last_tick

    def _touch(self, key: bytes) -> None:
        if self.readonly:
            return
        tick = self._next_tick()
        with self._touch_lock:
            self._touched[key] = tick
            many = len(self._touched) >= _TOUCH_FLUSH_MAX
        if many:
            self._submit(_CallJob(self._flush_touches, Future()))

    # ---- public API: reads ------------------------------------------------------------------

    def get_into(self, key: bytes, out: Buffer) -> int | None:
        """Decode the value of ``key`` into ``out``; bytes written, or None (miss or corrupt).

        A corrupt record counts as a miss (and is deleted by the writer); ``out`` may then hold
        garbage. Decompression runs inside the short read transaction, straight from the mmap.
        """

        def read(txn: lmdb.Transaction) -> int | None | codec.CorruptRecord:
            view = txn.get(key, db=self._payload)
            if view is None:
                return None
            try:
                return codec.decode_into(view, out)
            except codec.CorruptRecord as exc:
                return exc

        try:
            result = self._txn(read, buffers=True)
        except StoreUnavailableError:
            self._bump("misses")
            return None
        except ValueError as exc:  # out too small: a layout mismatch, never a crash
            log.debug("get_into(%s): %s", key.hex(), exc)
            self._bump("size_mismatch")
            self._bump("misses")
            return None
        if result is None:
            self._bump("misses")
            return None
        if isinstance(result, codec.CorruptRecord):
            self._on_corrupt(key, result)
            return None
        self._bump("hits")
        self._touch(key)
        return result

    def touch_many(self, keys: Sequence[bytes]) -> None:
        """Record an access to these keys without reading them (a chunk served from the host
        tier): eviction and ``max_age_s`` see them as recently used. Buffered in memory and
        written with the read ticks; never blocks; unknown keys are ignored when written."""
        if self.readonly or not keys:
            return
        tick = self._next_tick()  # one access time for the batch: one lock round, not one per key
        with self._touch_lock:
            touched = self._touched
            for key in keys:
                touched[key] = tick
            many = len(touched) >= _TOUCH_FLUSH_MAX
        if many:
            self._submit(_CallJob(self._flush_touches, Future()))

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Which keys are stored: one short read transaction, ~0.5 µs per key (cursor seeks)."""

        self._bump("lookups", len(keys))
        try:
            return self._txn(lambda txn: self._probe(txn, keys), buffers=True)
        except StoreUnavailableError:
            return [False] * len(keys)

    def _probe(self, txn: lmdb.Transaction, keys: Sequence[bytes]) -> list[bool]:
        # A cursor seek answers presence without materialising the value: ~0.5 µs per key,
        # against ~1.4 µs for txn.get (measured on 10k keys).
        cursor = txn.cursor(db=self._index)
        return [cursor.set_key(k) for k in keys]

    def iter_index(self) -> Iterator[tuple[bytes, IndexRecord]]:
        """Every (key, record) in key order, reading batches in separate short transactions.

        A transaction held across the caller's loop would pin freed pages and grow the file
        (storage-facts.md §5). Ticks include access not yet flushed to disk.
        """
        after: bytes | None = None
        while True:
            batch = self._txn(lambda txn, a=after: self._index_batch(txn, a))
            with self._touch_lock:
                touched = dict(self._touched) if self._touched else {}
            for key, rec in batch:
                tick = touched.get(key)
                yield (
                    key,
                    (msgspec.structs.replace(rec, tick=tick) if tick and tick > rec.tick else rec),
                )
            if len(batch) < _ITER_BATCH:
                return
            after = batch[-1][0]

    def _index_batch(
        self, txn: lmdb.Transaction, after: bytes | None
    ) -> list[tuple[bytes, IndexRecord]]:
        cursor = txn.cursor(db=self._index)
        if after is None:
            found = cursor.first()
        else:
            found = cursor.set_range(after)
            if found and cursor.key() == after:
                found = cursor.next()
        batch: list[tuple[bytes, IndexRecord]] = []
        while found and len(batch) < _ITER_BATCH:
            batch.append((cursor.key(), _decode_record(cursor.value())))
            found = cursor.next()
        return batch

    def namespaces(self) -> dict[bytes, dict[str, Any]]:
        """The registered namespaces (fingerprint -> info dict)."""

        def scan(txn: lmdb.Transaction) -> dict[bytes, dict[str, Any]]:
            cursor = txn.cursor(db=self._meta)
            out: dict[bytes, dict[str, Any]] = {}
            found = cursor.set_range(_META_NS)
            while found and cursor.key().startswith(_META_NS):
                out[cursor.key()[len(_META_NS) :]] = msgspec.json.decode(cursor.value())
                found = cursor.next()
            return out

        return self._txn(scan)

    def stats(self) -> dict[str, Any]:
        """Counters and totals; totals come from the store (exact across processes)."""
        try:
            totals = self._txn(self._read_totals)
        except StoreUnavailableError:
            totals = _Totals()
        with self._count_lock:
            counts = dict(self._counts)
        with self._touch_lock:
            pending = len(self._touched)
        try:
            file_bytes = (self.path / "data.mdb").stat().st_size
        except OSError:
            file_bytes = 0
        return {
            "path": str(self.path),
            "entries": totals.entries,
            "raw_bytes": totals.raw_bytes,
            "stored_bytes": totals.stored_bytes,
            "compression_ratio": totals.raw_bytes / totals.stored_bytes
            if totals.stored_bytes
            else 1.0,
            "budget_bytes": self.budget_bytes,
            "file_bytes": file_bytes,
            "admitting": self._admitting,
            "unclean_shutdown": self.unclean_shutdown,
            "recovering": not self._recovered.is_set(),
            "pending_touches": pending,
            "codec": self._codec_mode,
            "level": self._level,
            **counts,
        }

    # ---- public API: writes -------------------------------------------------------------------

    def put_many(self, entries: Sequence[tuple[bytes, Buffer, str]]) -> int:
        """Compress and store ``(key, data, dtype)`` entries; returns how many are now stored.

        Keys already stored are not rewritten (a chunk key names its content) and count as
        stored. Compression runs in the calling thread (callers parallelise across a pool) and
        overlaps the writer thread's puts. A full map or disk, or an entry larger than the
        budget, drops entries and counts them; it never raises.
        """
        if not entries:
            return 0
        for key, data, dtype in entries:  # ValueError for bad input before any work
            self._check_key(key)
            if memoryview(data).nbytes % codec.itemsize(dtype):
                raise ValueError(
                    f"{memoryview(data).nbytes} bytes is not a whole number of {dtype} elements"
                )
        if not self._writer_open or not self._admission_open():
            self._bump("admission_drops", len(entries))
            return 0
        try:
            present = self._txn(
                lambda txn: self._probe(txn, [key for key, _, _ in entries]), buffers=True
            )
        except StoreUnavailableError:
            self._bump("admission_drops", len(entries))
            return 0
        stored = 0
        futures: list[Future[bool]] = []
        for (key, data, dtype), here in zip(entries, present, strict=True):
            if here:
                stored += 1
                self._touch(key)
                continue
            frame = codec.encode(data, dtype, level=self._level, mode=self._codec_mode)
            job = _PutJob(key, frame, codec.frame_info(frame), self._next_tick(), Future())
            if not self._submit(job):
                self._bump("admission_drops")
                continue
            futures.append(job.future)
        self._bump("put_present", stored)
        return stored + sum(1 for fut in futures if fut.result())

    def delete_many(self, keys: Sequence[bytes]) -> int:
        """Delete keys; returns how many were stored."""
        if not keys:
            return 0
        for key in keys:
            self._check_key(key)
        return self._call(
            lambda: self._txn(lambda txn: self._delete_in(txn, keys, "deletes"), write=True)
        )

    def register_namespace(self, ns: bytes, info: dict[str, Any]) -> None:
        """Record a namespace fingerprint and what it describes (model, dtype, layout, rank)."""
        if not isinstance(ns, bytes) or not ns:
            raise ValueError("namespace must be non-empty bytes")
        value = msgspec.json.encode(info)
        self._call(
            lambda: self._txn(lambda txn: txn.put(_META_NS + ns, value, db=self._meta), write=True)
        )

    def sync(self) -> None:
        """Write everything queued so far (and access ticks) and make it durable."""
        if not self._writer_open:
            return
        self._call(self._flush_touches)
        self._env_sync()

    def wait_recovery(self, timeout: float | None = None) -> bool:
        """Wait for the verification started by an unclean open to end (or be cut short by
        close()); True unless the timeout expired."""
        return self._recovered.wait(timeout)

    def close(self) -> None:
        """Flush, sync, mark the shutdown clean (when no other process has the store open)."""
        with self._close_lock:
            if not self._closed:
                self._close()

    def _close(self) -> None:
        if not self.readonly:
            self._stop.set()
            self._sync_wake.set()
            if self._verifier is not None:
                self._verifier.join()  # it waits on the writer: stop it while the writer runs
            with contextlib.suppress(StoreUnavailableError):
                self._call(self._flush_touches)
            with self._submit_lock:
                self._writer_open = False
                self._queue.put(_STOP)
            self._writer.join()
            self._syncer.join()
            with contextlib.suppress(lmdb.Error):
                self._env_sync()
                if not self.unclean_shutdown or self._verified:  # else verify again next time
                    self._mark_clean()
        with self._gate.exclusive():
            self._closed = True
            _SHARED_ENVS.release(self._env)
        self._release_lock()

    def __enter__(self) -> DiskStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- write side internals -----------------------------------------------------------------

    def _check_key(self, key: bytes) -> None:
        if not isinstance(key, bytes) or not 0 < len(key) <= self._max_key:
            raise ValueError(f"store keys must be 1..{self._max_key} bytes, got {key!r:.40}")

    def _admission_open(self) -> bool:
        if self._admitting:
            return True
        if time.monotonic() >= self._retry_at:
            self._admitting = True  # try again: eviction or the user may have freed space
            return True
        return False

    def _submit(self, job: _PutJob | _CallJob) -> bool:
        # Under the lock that queues _STOP: no job can land behind it and wait forever.
        with self._submit_lock:
            if not self._writer_open:
                return False
            self._queue.put(job)
            return True

    def _call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the writer thread and wait for its result."""
        if threading.current_thread() is self._writer:
            return fn()
        job: _CallJob = _CallJob(fn, Future())
        if not self._submit(job):
            raise StoreUnavailableError(
                f"store at {self.path} is {'read-only' if self.readonly else 'closed'}"
            )
        return job.future.result()

    def _writer_loop(self) -> None:
        last_flush = time.monotonic()
        carry: Any = None
        while True:
            job = carry
            carry = None
            if job is None:
                try:
                    job = self._queue.get(timeout=self._touch_interval)
                except queue.Empty:
                    job = None
            if job is _STOP:
                self._fail_queued()
                return
            if isinstance(job, _PutJob):
                carry = self._run_puts(job)
            elif isinstance(job, _CallJob):
                _run_call(job)
            if time.monotonic() - last_flush >= self._touch_interval:
                last_flush = time.monotonic()
                try:
                    self._flush_touches()
                except Exception:  # ticks are advisory; keep the writer alive
                    log.exception("store at %s: flushing access ticks failed", self.path)

    def _fail_queued(self) -> None:
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(job, _PutJob):
                job.future.set_result(False)
            elif isinstance(job, _CallJob):
                job.future.set_exception(StoreUnavailableError(f"store at {self.path} is closed"))

    def _run_puts(self, first: _PutJob) -> Any:
        """Write ``first`` (plus following small puts in the same transaction).

        Returns a job taken from the queue that did not fit the batch, for the loop to run next.
        """
        jobs = [first]
        carry: Any = None
        if len(first.frame) < _LARGE_VALUE:
            size = len(first.frame)
            while len(jobs) < _SMALL_BATCH_COUNT and size < _SMALL_BATCH_BYTES:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if not isinstance(nxt, _PutJob) or len(nxt.frame) >= _LARGE_VALUE:
                    carry = nxt
                    break
                jobs.append(nxt)
                size += len(nxt.frame)
        try:
            outcomes = self._write_batch(jobs)
        except Exception:  # a bug must not kill the writer and leave callers waiting forever
            log.exception("store at %s: writing %d entries failed", self.path, len(jobs))
            self._bump("admission_drops", len(jobs))
            outcomes = [_PutOutcome() for _ in jobs]
        for job, outcome in zip(jobs, outcomes, strict=True):
            job.future.set_result(outcome.written)
        return carry

    def _write_batch(self, jobs: list[_PutJob]) -> list[_PutOutcome]:
        def body(txn: lmdb.Transaction) -> list[_PutOutcome]:
            totals = self._read_totals(txn)
            outcomes = [self._put_in(txn, totals, job) for job in jobs]
            txn.put(_META_TOTALS, msgspec.msgpack.encode(totals), db=self._meta)
            return outcomes

        try:
            outcomes = self._txn(body, write=True)
        except (lmdb.Error, OSError) as exc:  # MapFullError, DiskError (ENOSPC), EFBIG, EIO...
            self._on_write_failure(exc)
            self._bump("admission_drops", len(jobs))
            return [_PutOutcome() for _ in jobs]
        self._mark_dirty(sum(len(job.frame) for job in jobs))
        for outcome in outcomes:
            self._bump("evictions", outcome.evicted)
            self._bump("evicted_bytes", outcome.evicted_bytes)
            if outcome.written:
                self._bump("puts")
            elif outcome.reason:
                self._bump(outcome.reason)
        return outcomes

    def _put_in(self, txn: lmdb.Transaction, totals: _Totals, job: _PutJob) -> _PutOutcome:
        outcome = _PutOutcome()
        if txn.get(job.key, db=self._index) is not None:
            outcome.written = True  # stored meanwhile (same key, same content)
            return outcome
        stored = len(job.frame)
        if stored > self.budget_bytes:
            outcome.reason = "too_large_drops"
            return outcome
        over = totals.stored_bytes + stored - self.budget_bytes
        if over > 0:
            need = over + int(self._evict_slack * self.budget_bytes)
            expire = None if self._max_age_us is None else _now_us() - self._max_age_us
            victims = select_victims(self._eviction_candidates(txn), need_bytes=need, expire_before_us=expire)
            outcome.evicted, outcome.evicted_bytes = self._delete_records(txn, totals, victims)
        rec = IndexRecord(
            raw_len=job.info.raw_len,
            stored_len=stored,
            codec=job.info.codec,
            checksum=job.info.checksum,
            tick=job.tick,
            group=_group_of(job.key),
            dtype=job.info.dtype,
        )
        txn.put(job.key, job.frame, db=self._payload)
        txn.put(job.key, msgspec.msgpack.encode(rec), db=self._index)
        totals.entries += 1
        totals.raw_bytes += rec.raw_len
        totals.stored_bytes += stored
        outcome.written = True
        return outcome

    def _eviction_candidates(self, txn: lmdb.Transaction) -> Iterator[tuple[bytes, int, int]]:
        with self._touch_lock:
            touched = dict(self._touched)
        cursor = txn.cursor(db=self._index)
        for key, value in cursor:
            rec = _decode_record(value)
            yield key, max(rec.tick, touched.get(key, 0)), rec.stored_len

    def _report_removed(self) -> None:
        removed = self._removed.keys
        if removed and self.on_removed is not None:
            try:
                self.on_removed(removed)
            except Exception:
                log.exception("store at %s: on_removed callback failed", self.path)

    def _delete_records(
        self, txn: lmdb.Transaction, totals: _Totals, keys: Iterable[bytes]
    ) -> tuple[int, int]:
        count = freed = 0
        removed = getattr(self._removed, "keys", None)
        for key in keys:
            value = txn.pop(key, db=self._index)
            if value is None:
                continue
            txn.delete(key, db=self._payload)
            if removed is not None:
                removed.append(bytes(key))
            rec = _decode_record(value)
            totals.entries -= 1
            totals.raw_bytes -= rec.raw_len
            totals.stored_bytes -= rec.stored_len
            count += 1
            freed += rec.stored_len
        with self._touch_lock:
            for key in keys:
                self._touched.pop(key, None)
        return count, freed

    def _delete_in(self, txn: lmdb.Transaction, keys: Sequence[bytes], counter: str) -> int:
        totals = self._read_totals(txn)
        count, _ = self._delete_records(txn, totals, list(keys))
        txn.put(_META_TOTALS, msgspec.msgpack.encode(totals), db=self._meta)
        self._bump(counter, count)
        self._mark_dirty()
        return count

    def _read_totals(self, txn: lmdb.Transaction) -> _Totals:
        raw = txn.get(_META_TOTALS, db=self._meta)
        return msgspec.msgpack.decode(raw, type=_Totals) if raw is not None else _Totals()

    def _on_write_failure(self, exc: BaseException) -> None:
        """Full map or disk: stop admitting for a while, log once, count; reads go on."""
        self._admitting = False
        self._retry_at = time.monotonic() + self._full_retry_s
        self._bump("full_events")
        if not self._full_logged:
            self._full_logged = True
            hint = " (disk full)" if getattr(exc, "errno", None) == errno.ENOSPC else ""
            log.warning(
                "store at %s stopped admitting new chunks for %.0fs%s: %s: %s",
                self.path,
                self._full_retry_s,
                hint,
                type(exc).__name__,
                exc,
            )

    def _flush_touches(self) -> None:
        """Write the buffered last-access ticks (reads never write, storage-facts §5)."""
        with self._touch_lock:
            if not self._touched:
                return
            pending, self._touched = self._touched, {}

        def body(txn: lmdb.Transaction) -> None:
            for key, tick in pending.items():
                value = txn.get(key, db=self._index)
                if value is None:
                    continue
                rec = _decode_record(value)
                if tick > rec.tick:
                    txn.put(
                        key,
                        msgspec.msgpack.encode(msgspec.structs.replace(rec, tick=tick)),
                        db=self._index,
                    )

        try:
            self._txn(body, write=True)
        except (lmdb.Error, OSError) as exc:
            self._on_write_failure(exc)  # ticks are advisory: losing them only blurs LRU order
            return
        self._bump("tick_flushes")
        self._mark_dirty()

    def _on_corrupt(self, key: bytes, exc: codec.CorruptRecord) -> None:
        self._bump("corrupt")
        self._bump("misses")
        log.warning(
            "store at %s: corrupt record %s (%s); treated as a miss", self.path, key.hex(), exc
        )
        self._submit(_CallJob(lambda: self._drop_if_corrupt([key], "corrupt_dropped"), Future()))

    def _drop_if_corrupt(self, keys: Sequence[bytes], counter: str) -> int:
        """Re-check on the writer thread, then delete: the key may have been rewritten since."""
        bad = [key for key in keys if not self._record_ok(key)]
        if not bad:
            return 0
        try:
            return self._txn(lambda txn: self._delete_in(txn, bad, counter), write=True)
        except (lmdb.Error, OSError) as exc:
            self._on_write_failure(exc)
            return 0

    def _record_ok(self, key: bytes) -> bool:
        def check(txn: lmdb.Transaction) -> bool:
            value = txn.get(key, db=self._index)
            payload = txn.get(key, db=self._payload)
            if value is None and payload is None:
                return True  # already gone
            if value is None or payload is None:
                return False
            try:
                rec = _decode_record(value)
            except msgspec.DecodeError:
                return False
            if len(payload) != rec.stored_len:
                return False
            try:
                codec.decode_into(payload, codec.scratch(rec.raw_len))
            except (codec.CorruptRecord, ValueError):
                return False
            return True

        return self._txn(check, buffers=True)

    def _mark_dirty(self, nbytes: int = 0) -> None:
        self._dirty.set()
        self._dirty_bytes += nbytes  # approximate (no lock): it only paces the syncer
        if self._dirty_bytes >= self._sync_bytes:
            self._sync_wake.set()

    def _env_sync(self) -> None:
        self._dirty.clear()
        self._dirty_bytes = 0
        with self._gate.shared():
            if not self._closed:
                self._env.sync(True)

    def _syncer_loop(self) -> None:
        # A thread of its own so that flushing overlaps the writer's next puts. It runs every
        # sync_interval_s, and early once sync_bytes are dirty: a burst is then flushed while
        # it is still being compressed instead of all at the end.
        while True:
            self._sync_wake.wait(self._sync_interval)
            self._sync_wake.clear()
            if self._stop.is_set():
                return
            if self._dirty.is_set():
                try:
                    self._env_sync()
                except lmdb.Error as exc:
                    self._bump("sync_errors")
                    log.warning("store at %s: env.sync failed: %s", self.path, exc)

    def _mark_clean(self) -> None:
        # Only the last writable opener may mark the store clean: the others still write.
        assert self._lock_fd is not None
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return
        with self._env.begin(write=True) as txn:
            txn.put(_META_CLEAN, b"1", db=self._meta)
        self._env.sync(True)

    # ---- recovery after an unclean shutdown ------------------------------------------------------

    def _recover(self) -> None:
        """Verify every record (size and checksum), drop the bad ones and orphans, recount.

        Runs in the background: reads are safe meanwhile because every get verifies the
        checksum of what it decodes anyway; this pass frees the space of bad records and
        repairs the totals.
        """
        try:
            checked = dropped = 0
            for batch in _batched((key for key, _ in self.iter_index()), 256):
                if self._stop.is_set():
                    return  # close() leaves the marker cleared, so the next open verifies again
                # Verify here; only the (rare) deletions go through the writer thread.
                bad = [key for key in batch if not self._record_ok(key)]
                checked += len(batch)
                self._bump("recovery_checked", len(batch))
                if bad:
                    dropped += self._call(
                        lambda b=bad: self._drop_if_corrupt(b, "recovery_dropped")
                    )
            dropped += self._call(self._drop_orphans)
            self._call(self._recount)
            log.warning(
                "store at %s: verified %d records after unclean shutdown, dropped %d",
                self.path,
                checked,
                dropped,
            )
            self._verified = True
        except StoreUnavailableError:
            return
        except Exception:  # never let a verifier crash take the store down
            log.exception("store at %s: verification after unclean shutdown failed", self.path)
        finally:
            self._recovered.set()

    def _drop_orphans(self) -> int:
        def body(txn: lmdb.Transaction) -> int:
            index = txn.cursor(db=self._index)
            orphans = [
                key
                for key in txn.cursor(db=self._payload).iternext(values=False)
                if not index.set_key(key)
            ]
            for key in orphans:
                txn.delete(key, db=self._payload)
            return len(orphans)

        count = self._txn(body, write=True)
        self._bump("recovery_dropped", count)
        return count

    def _recount(self) -> None:
        def body(txn: lmdb.Transaction) -> None:
            totals = _Totals()
            for _, value in txn.cursor(db=self._index):
                rec = _decode_record(value)
                totals.entries += 1
                totals.raw_bytes += rec.raw_len
                totals.stored_bytes += rec.stored_len
            txn.put(_META_TOTALS, msgspec.msgpack.encode(totals), db=self._meta)

        self._txn(body, write=True)
        self._mark_dirty()


# ---------------------------------------------------------------------------------------------

_COUNTERS = (
    "hits",
    "misses",
    "lookups",
    "corrupt",
    "corrupt_dropped",
    "size_mismatch",
    "puts",
    "put_present",
    "deletes",
    "evictions",
    "evicted_bytes",
    "admission_drops",
    "too_large_drops",
    "full_events",
    "map_resized",
    "tick_flushes",
    "sync_errors",
    "recovery_checked",
    "recovery_dropped",
)

_INDEX_DECODER = msgspec.msgpack.Decoder(IndexRecord)


def _decode_record(value: Buffer) -> IndexRecord:
    return _INDEX_DECODER.decode(value)


def _run_call(job: _CallJob) -> None:
    try:
        job.future.set_result(job.fn())
    except BaseException as exc:  # handed to the waiting caller
        job.future.set_exception(exc)


def _batched(items: Iterable[T], n: int) -> Iterator[list[T]]:
    it = iter(items)
    while batch := list(itertools.islice(it, n)):
        yield batch

"""The disk tier: a compressed, checksummed, crash-aware LMDB store of KV chunks.

``DiskStore`` is the façade over the parts of ``kvstrata.tiers.disk``: ``env`` (opening the
directory, transactions), ``writer`` (the writer and sync threads; ``putter``: puts and
evictions), ``views`` (what it shows without changing it), ``recovery`` (the verification
after an unclean shutdown), ``damage`` (what a read that finds damage does),
``slab_processes`` (reads and writes in child processes over host slabs) and the record layer
``kvstrata.tiers.records`` (what one transaction reads and writes). Reads run in the caller's
thread (callers use a thread pool), each in its own short read transaction that decompresses
straight out of the zero-copy map view; every write runs on the writer thread (or, framed by
the write processes, in the put process it hands them to).
Several processes may open the same store: LMDB serialises their write transactions and the
running totals live in the store, so that they stay exact across processes.

Nothing the store *contains* makes a read raise: a record that is damaged, or that is another
key's (frames are bound to their key), is a counted miss, logged, and dropped by the writer.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import lmdb

from kvstrata import fsmode
from kvstrata.tiers import codec
from kvstrata.tiers import records as rec
from kvstrata.tiers.codec import parse_mode as parse_codec_mode
from kvstrata.tiers.disk.counters import Counters
from kvstrata.tiers.disk.damage import Damage
from kvstrata.tiers.disk.encoders import DiskEncoders, EncodeItem, Framed
from kvstrata.tiers.disk.env import StoreEnv, StoreUnavailableError
from kvstrata.tiers.disk.readers import DiskReaders, Outcome
from kvstrata.tiers.disk.recovery import Recovery
from kvstrata.tiers.disk.slab_processes import SlabProcesses
from kvstrata.tiers.disk.views import StoreViews
from kvstrata.tiers.disk.write_jobs import PutJob, now_us, when_committed
from kvstrata.tiers.disk.writer import Writer

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from kvstrata.auth import ValueAuth
    from kvstrata.tiers.host import HostSlab

log = logging.getLogger(__name__)

T = TypeVar("T")


class DiskStore:
    """Compressed LMDB store of KV chunks; see the module docstring and docs/DESIGN.md. A lower
    tier of the hierarchy (``kvstrata.tiers.lower.ScannableTier``).

    ``budget_bytes`` caps the stored (compressed frame) bytes; the LMDB file is ~1.0-1.3x that.
    When a put would exceed it, the least recently used entries are evicted, ``evict_slack``
    (a fraction of the budget) more than needed so that the index scan behind an eviction is
    amortised over many puts. ``map_size`` only reserves address space (no writemap), so keep
    it large. ``level``/``codec`` select the codec ("raw" stores uncompressed frames).
    ``sync_interval_s``/``sync_bytes`` pace the background ``env.sync()``;
    ``touch_flush_interval_s`` paces the batched write of access ticks; after a full map or disk
    the store stops admitting for ``full_retry_s`` seconds, then tries again. ``max_age_s``:
    whenever the writer evicts, chunks idle longer than this go first. ``idle_writer``: the
    writer and sync threads run at idle CPU priority (a serving engine's store; reads are
    unaffected). ``readonly=True`` opens an existing store for reads only (no writer thread, no ticks).
    ``mode``: the directory mode a new store is created with (files: the same bits without
    execute; ``kvstrata.fsmode``). ``auth``: every record written carries a MAC under it, and a
    record whose MAC is missing or wrong is a counted miss (``forged``) and is dropped (a store
    on shared storage others can write to; docs/SECURITY.md). ``reserve_bytes``: free space the
    store leaves its file system; once a put would go below it, the store stays at the size it
    has and makes room by evicting (``kvstrata.tiers.disk.writer``; 0: no reserve).
    Every method is thread-safe.
    """

    tier_name = "disk"

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
        reserve_bytes: int = 0,
        idle_writer: bool = False,
        mode: int = fsmode.DEFAULT_DIR_MODE,
        auth: ValueAuth | None = None,
        clock_us: Callable[[], int] = now_us,
    ) -> None:
        codec_mode = parse_codec_mode(codec)
        if budget_bytes <= 0:
            raise ValueError("budget_bytes must be positive")
        self.path = Path(path)
        self.budget_bytes = int(budget_bytes)
        self.readonly = readonly
        self._level = level
        self._codec_mode = codec_mode
        self._counts = Counters()
        self._tick_lock = threading.Lock()
        self._last_tick = 0
        self._clock_us = clock_us  # wall-clock microseconds: access ticks and max_age_s
        self._close_lock = threading.Lock()
        self._closed = False
        self._auth = auth
        self._env = StoreEnv(self.path, map_size=map_size, create=create, readonly=readonly, mode=mode)
        self._processes = SlabProcesses(self.path, auth=auth, map_size=map_size, level=level,
                                        codec_mode=codec_mode)
        self.h = self._env.handles
        self.unclean_shutdown = self._env.unclean
        self._writer: Writer | None = None
        self._recovery: Recovery | None = None
        if not readonly:
            self._writer = Writer(
                self._env, self._counts, budget_bytes=self.budget_bytes, evict_slack=evict_slack,
                max_age_s=max_age_s, sync_interval_s=sync_interval_s, sync_bytes=sync_bytes,
                touch_flush_interval_s=touch_flush_interval_s, full_retry_s=full_retry_s,
                reserve_bytes=reserve_bytes, idle=idle_writer, clock_us=clock_us)
            if self.unclean_shutdown:
                self._recovery = Recovery(self._writer, self._counts)
        self._damage = Damage(self.path, self._counts, self._writer, auth, self._touch)
        self._views = StoreViews(self._env, self._counts, self._damage, self._writer)

    # ---- transactions for the tools ---------------------------------------------------------------

    def read(self, fn: Callable[[lmdb.Transaction[Any], rec.Handles], T], *, buffers: bool = False) -> T:
        """``fn(txn, handles)`` in one short read transaction (``kvstrata.tiers.records``)."""
        return self._env.txn(lambda txn: fn(txn, self.h), buffers=buffers)

    def write(self, fn: Callable[[lmdb.Transaction[Any], rec.Handles], T], *, buffers: bool = False) -> T:
        """``fn(txn, handles)`` in one write transaction on the writer thread, serialised with
        the store's own puts and evictions; an exception inside ``fn`` commits nothing."""
        if self._writer is None:
            raise ValueError(f"store at {self.path} is open read-only")
        # Tracked only as a whole: ``fn`` may add index records without reporting them.
        return self._writer.write(lambda txn: fn(txn, self.h), buffers=buffers, tracked=False)

    @property
    def on_removed(self) -> Callable[[list[bytes]], None] | None:
        """Told the store keys of records deleted (evicted, expired, dropped as corrupt, deleted)
        once their transaction committed, on the writer thread: it must not wait on this store."""
        return None if self._writer is None else self._writer.on_removed

    @on_removed.setter
    def on_removed(self, fn: Callable[[list[bytes]], None] | None) -> None:
        if self._writer is not None:
            self._writer.on_removed = fn

    # ---- reads ----------------------------------------------------------------------------------

    def get_into(self, key: bytes, out: Buffer) -> int | None:
        """Decode the value of ``key`` into ``out``; bytes written, or None (a miss, or a record
        that is damaged or not this key's: counted, logged, dropped). ``out`` may then hold
        garbage. Decompression runs inside the short read transaction, straight from the map."""
        if self._damage.quarantined(key):
            self._counts.bump("misses")
            return None
        return self._damage.account_read(key, self.read_outcome(key, out))

    def read_outcome(self, key: bytes, out: Buffer) -> Outcome:
        """The read of ``get_into`` alone, counting and dropping nothing (what a read process
        does, ``disk/readers.py``): ``("ok", bytes written | None | the record's problem)``,
        ``("size", why)`` when ``out`` is too small, ``("error", why)`` when the store failed."""
        try:
            return "ok", self._env.txn(lambda txn: rec.read_into(txn, self.h, key, out, self._auth), buffers=True)
        except ValueError as exc:  # out too small: a layout mismatch, never a crash
            return "size", str(exc)
        except (StoreUnavailableError, lmdb.Error) as exc:
            return "error", (type(exc).__name__, str(exc))

    def get_many_into_slab(self, slab: HostSlab, items: Sequence[tuple[bytes, int, int, int]],
                           landed: Callable[[int, int | None], None]) -> None:
        """``get_into`` of each ``(key, slot, offset, length)`` into ``slab``, ``landed(i, bytes
        written or None)`` as each lands, in order: by the read processes when they were given
        this slab (:meth:`use_read_processes`), else (none, another slab, or once they fail)
        here."""
        sent: list[int] = []  # the items to read, by index into ``items``
        for i, (key, *_) in enumerate(items):
            if self._damage.quarantined(key):
                self._counts.bump("misses")
                landed(i, None)
            else:
                sent.append(i)

        def answer(j: int, outcome: Outcome) -> None:
            landed(sent[j], self._damage.account_read(items[sent[j]][0], outcome))

        # The rest (all without processes, or past where they failed) is read here, over what a
        # dying process may have half written.
        sent = sent[self._processes.read_many(slab, [items[i] for i in sent], answer):]
        for i in sent:
            key, slot, offset, length = items[i]
            landed(i, self.get_into(key, slab.view(slot, offset, length)))

    def use_read_processes(self, slab: HostSlab, processes: int) -> None:
        """Read chunks for ``get_many_into_slab`` in ``processes`` processes of their own, each
        with the store open read-only and ``slab`` mapped (``disk/readers.py``); 0 reads in the
        calling threads. Raises ProcessesUnavailable when they cannot start."""
        self._processes.use_readers(slab, processes)

    @property
    def read_processes(self) -> DiskReaders | None:
        """The processes ``get_many_into_slab`` reads in (``use_read_processes``), or None."""
        return self._processes.readers

    def touch_many(self, keys: Sequence[bytes]) -> None:
        """Record an access to these keys without reading them (a chunk served from the host
        tier): eviction and ``max_age_s`` see them as recently used. Buffered, never blocks."""
        if keys:
            self._touch(keys)

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Which keys are stored: from the writer's in-memory mirror of the index while it is
        current (``tiers/disk/index_mirror.py``: no GIL release per key), else one short read
        transaction, ~0.5 µs per key (cursor seeks)."""
        try:
            found, mirrored = self._present(keys)
        except (StoreUnavailableError, lmdb.Error) as exc:
            self._damage.log("lookup failed", exc)
            return [False] * len(keys)
        self._counts.bump_many(lookups=len(keys), mirrored_lookups=len(keys) if mirrored else 0)
        return found

    def _present(self, keys: Sequence[bytes]) -> tuple[list[bool], bool]:
        """Which keys are stored (never the quarantined), and whether the index mirror said so
        (else one read transaction said so)."""
        writer = self._writer
        if writer is not None:
            found = writer.index_mirror.answer(keys, self._env.last_txnid())
            if found is not None:
                return self._damage.unquarantined(keys, found), True
        return self._env.txn(lambda txn: self._probe(txn, keys), buffers=True), False

    def _probe(self, txn: lmdb.Transaction, keys: Sequence[bytes]) -> list[bool]:
        # A cursor seek answers presence without materialising the value.
        cursor = txn.cursor(db=self.h.index)
        return self._damage.unquarantined(keys, [cursor.set_key(k) for k in keys])

    # ---- views (``disk/views.py``) ---------------------------------------------------------------

    def iter_index(self) -> Iterator[tuple[bytes, rec.IndexRecord]]:
        """Every readable (key, record) in key order, ticks including access not yet written
        (``StoreViews.iter_index``)."""
        return self._views.iter_index()

    def scan(self, db: Literal["index", "payload", "meta"] = "index", *, prefix: bytes = b"",
             values: bool = True, damage: list[str] | None = None) -> Iterator[list[tuple[bytes, bytes | None]]]:
        """Batches of ``(key, value copy or None)`` of one database (``StoreViews.scan``)."""
        return self._views.scan(db, prefix=prefix, values=values, damage=damage)

    def page_census(self) -> dict[str, int]:
        """LMDB's own account of the file (``StoreViews.page_census``)."""
        return self._views.page_census()

    def key_namespaces(self) -> list[bytes]:
        """The distinct namespaces of the stored keys (a record may outlive its registration)."""
        return self._views.key_namespaces()

    def namespaces(self) -> dict[bytes, dict[str, Any]]:
        """The registered namespaces (fingerprint -> description); unreadable entries skipped."""
        return self._views.namespaces()

    def stats(self) -> dict[str, Any]:
        """Counters and totals; totals come from the store (exact across processes)."""
        totals = self._views.totals()
        counts = self._counts.snapshot()
        counts["map_resized"] = self._env.map_resized
        writer = self._writer
        return {
            "path": str(self.path),
            "entries": totals.entries,
            "raw_bytes": totals.raw_bytes,
            "stored_bytes": totals.stored_bytes,
            "compression_ratio": totals.raw_bytes / totals.stored_bytes if totals.stored_bytes else 1.0,
            "budget_bytes": self.budget_bytes,
            # The file system's reserve, and the stored bytes it holds the store to (None: not now).
            "reserve_bytes": writer.reserve.reserve_bytes if writer is not None else 0,
            "reserve_cap_bytes": writer.reserve.cap if writer is not None else None,
            "file_bytes": self._views.file_bytes(),
            "admitting": writer.admitting if writer is not None else False,
            "unclean_shutdown": self.unclean_shutdown,
            "recovering": self._recovery is not None and not self._recovery.done.is_set(),
            "pending_touches": len(writer.touched()) if writer is not None else 0,
            "codec": self._codec_mode,
            "level": self._level,
            **counts,
        }

    # ---- writes ---------------------------------------------------------------------------------

    def put_many(self, entries: Sequence[tuple[bytes, Buffer, str]]) -> int:
        """Compress and store ``(key, data, dtype)`` entries; returns how many are now stored.

        Keys already stored are not rewritten (a chunk key names its content) and count as
        stored. Compression runs in the calling thread (callers parallelise across a pool) and
        overlaps the writer thread's puts. A full map or disk, or an entry larger than the
        budget, drops entries and counts them; it never raises for those.
        """
        present, futures = self._submit_puts(entries)
        return present + sum(1 for fut in futures if fut.result())

    def put_many_then(self, entries: Sequence[tuple[bytes, Buffer, str]], done: Callable[[int], None]) -> None:
        """``put_many`` without waiting for the writer: compresses in the calling thread, then
        returns; ``done(stored)`` is called once every entry is committed or dropped, on the
        writer thread (in this thread when nothing had to be written). So an idle-priority
        caller, which a busy CPU may not run again for a second, does not hold up the report
        of a committed write (docs/BENCHMARKS.md, "A write is reported when it commits")."""
        when_committed(*self._submit_puts(entries), done)

    def put_many_from_slab_then(self, slab: HostSlab, items: Sequence[EncodeItem],
                                done: Callable[[int], None]) -> None:
        """``put_many_then`` of ``(key, slot, offset, length, dtype)`` shards of ``slab``,
        framed in the write processes when they were given this slab
        (:meth:`use_write_processes`), else (none, another slab, or once they fail) here."""
        entries = [(key, slab.view(slot, offset, length), dtype) for key, slot, offset, length, dtype in items]
        when_committed(*self._submit_puts(entries, (slab, items)), done)

    def use_write_processes(self, slab: HostSlab, processes: int, *, idle: bool = False,
                            put_process: bool = True) -> None:
        """Frame chunks for ``put_many_from_slab_then`` in ``processes`` processes of their own,
        each with ``slab`` mapped (``disk/encoders.py``), at idle CPU priority if ``idle``, and
        put what they framed in one more (``put_process``: ``disk/writer.py``, "The put
        process"; False: in the writer thread); 0 frames in the calling threads. Raises
        ProcessesUnavailable when they cannot start."""
        writer = self._writer
        self._processes.use_encoders(slab, processes, idle=idle,
                                     put_rules=None if writer is None else writer.put_rules())
        if writer is not None:
            encoders = self._processes.encoders
            writer.use_put_process(encoders.put_pool if encoders is not None and put_process else None)

    @property
    def write_processes(self) -> DiskEncoders | None:
        """The processes ``put_many_from_slab_then`` frames in (``use_write_processes``), or None."""
        return self._processes.encoders

    def _submit_puts(self, entries: Sequence[tuple[bytes, Buffer, str]],
                     slab_items: tuple[HostSlab, Sequence[EncodeItem]] | None = None) -> tuple[int, list[Future[bool]]]:
        """Frame the entries not stored yet and queue them for the writer: (entries already
        stored, the queued puts' futures). With ``slab_items`` (the same entries as places in a
        slab) the write processes frame them if they map that slab, as far as they can."""
        if not entries:
            return 0, []
        for key, data, dtype in entries:  # ValueError for bad input before any work
            self._check_key(key)
            if memoryview(data).nbytes % codec.itemsize(dtype):
                raise ValueError(f"{memoryview(data).nbytes} bytes is not a whole number of {dtype} elements")
        writer = self._writer
        if writer is None or not writer.open or not writer.admission_open():
            self._counts.bump("admission_drops", len(entries))
            return 0, []
        try:
            # The mirror while current: a GIL release instead of several (a put comes from a
            # write thread the engine's own threads hold the GIL against).
            present, _ = self._present([key for key, _, _ in entries])
        except (StoreUnavailableError, lmdb.Error):
            self._counts.bump("admission_drops", len(entries))
            return 0, []
        todo = [i for i, here in enumerate(present) if not here]
        stored = len(entries) - len(todo)
        for i, here in enumerate(present):
            if here:
                self._touch([entries[i][0]])
        self._counts.bump("put_present", stored)
        batch = None
        if slab_items is not None:
            slab, places_in_slab = slab_items
            batch = self._processes.frame_many(slab, [places_in_slab[i] for i in todo])
        framed: list[Framed] = [None] * len(todo) if batch is None else batch.framed
        places: list[tuple[int, int, int] | None] = [None] * len(todo) if batch is None else batch.places
        futures: list[Future[bool]] = []
        in_batch: list[Future[bool]] = []  # the puts whose frames are the batch's
        try:
            for i, got, place in zip(todo, framed, places, strict=True):
                key, data, dtype = entries[i]
                if got is None:
                    frame: bytes | memoryview = codec.encode(data, dtype, key=key, level=self._level, mode=self._codec_mode)
                    mac = b"" if self._auth is None else self._auth.tag(key, frame)
                else:
                    frame, mac = got
                job = PutJob(key, frame, codec.frame_info(frame), self._next_tick(), Future(), mac, place,
                             None if place is None or batch is None else batch.pool.put_pool)
                if not writer.submit(job):
                    self._counts.bump("admission_drops")
                    continue
                futures.append(job.future)
                if got is not None:
                    in_batch.append(job.future)
        finally:
            self._counts.bump("process_framed", sum(got is not None for got in framed))
            if batch is not None:
                batch.release_after(in_batch)
        return stored, futures

    def delete_many(self, keys: Sequence[bytes]) -> int:
        """Delete keys; returns how many were stored."""
        if not keys:
            return 0
        for key in keys:
            self._check_key(key)
        writer = self._require_writer()

        def body(txn: lmdb.Transaction) -> int:
            totals = rec.current_totals(txn, self.h)
            count, _ = writer.delete(txn, totals, keys)
            rec.write_totals(txn, self.h, totals)
            return count

        count = writer.write(body)
        self._counts.bump("deletes", count)
        return count

    def register_namespace(self, ns: bytes, info: dict[str, Any]) -> None:
        """Record a namespace fingerprint and what it describes (model, dtype, layout, rank)."""
        if not isinstance(ns, bytes) or not ns:
            raise ValueError("namespace must be non-empty bytes")
        self._require_writer().write(lambda txn: rec.register_namespace(txn, self.h, ns, info))

    def sync(self) -> None:
        """Write everything queued so far (and access ticks) and make it durable."""
        writer = self._writer
        if writer is None or not writer.open:
            return
        writer.call(writer.flush_touches)
        writer.sync()

    def wait_recovery(self, timeout: float | None = None) -> bool:
        """Wait for the verification started by an unclean open to end (or be cut short by
        close()); True unless the timeout expired."""
        return self._recovery is None or self._recovery.done.wait(timeout)

    def close(self) -> None:
        """Flush, sync, mark the shutdown clean (when no other process has the store open)."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            self._processes.close()  # the puts they framed are still written (the frames stay mapped)
            writer = self._writer
            if writer is not None:
                writer.request_stop()
                if self._recovery is not None:
                    self._recovery.join()  # it waits on the writer: stop it while the writer runs
                writer.stop()
                verified = self._recovery is None or self._recovery.verified
                if verified:  # else the next open verifies again
                    try:
                        self._env.mark_clean()
                    except lmdb.Error as exc:
                        log.warning("store at %s: could not mark it clean: %s", self.path, exc)
            self._env.close()

    def __enter__(self) -> DiskStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals --------------------------------------------------------------------------------

    def _require_writer(self) -> Writer:
        if self._writer is None or not self._writer.open:
            raise StoreUnavailableError(f"store at {self.path} is {'read-only' if self.readonly else 'closed'}")
        return self._writer

    def _check_key(self, key: bytes) -> None:
        if not isinstance(key, bytes) or not 0 < len(key) <= self._env.max_key:
            raise ValueError(f"store keys must be 1..{self._env.max_key} bytes, got {key!r:.40}")

    def _next_tick(self) -> int:
        # Wall-clock microseconds (comparable across processes), strictly increasing here.
        with self._tick_lock:
            self._last_tick = max(self._last_tick + 1, self._clock_us())
            return self._last_tick

    def _touch(self, keys: Sequence[bytes]) -> None:
        if self._writer is not None:
            self._writer.touch(keys, self._next_tick())

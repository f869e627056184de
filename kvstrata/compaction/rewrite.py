"""Rewrite a store's LMDB file: compacted, so that the space of deleted records really comes back
(``rewrite_locked``), or rebuilt from its sound records only (``rebuild_locked``), for a store
whose structure is damaged (a record whose page numbers point into another record's pages).

LMDB never shrinks its file: deleted pages only go on a free list for later writes. The way to
return them to the file system is a compacting copy (``env.copy(compact=True)`` writes live pages
only) swapped in place of the original. That is safe only while no other process has the store
open, because an open environment keeps using the old file and its lock table.

Who has the store open is known from the lock file every writable ``DiskStore`` holds a shared
``flock`` on for as long as it is open: holding it *exclusively* proves no server or tool is
using the store, and keeps any that starts meanwhile waiting (its ``LOCK_SH`` blocks) until the
swap is done. Read-only openers (which take no lock) keep reading the file they opened: the old
inode stays alive and consistent under them.

Crash safety: the copy is written to a temporary directory inside the store, checked, fsynced,
and renamed over ``data.mdb`` (atomic); the old LMDB lock table is removed *before* the rename so
no process ever pairs the new file with the old reader table (a new one is created by the next
opener). An interrupted run leaves the original file untouched and a stale temporary directory,
removed by the next run.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb

from kvstrata.tiers import record_scans as scans
from kvstrata.tiers import records as rec

_TMP_PREFIX = ".compact-"
# The compacted copy needs room for the live pages; keep this much spare on top.
_SPACE_MARGIN = 64 << 20


class StoreBusyError(Exception):
    """Another process has the store open, so its file cannot be replaced now."""


class RewriteError(Exception):
    """The compacted copy could not be made or did not check out; the store file is as it was."""


@dataclass(frozen=True)
class RewriteResult:
    file_bytes_before: int
    file_bytes_after: int

    @property
    def reclaimed_bytes(self) -> int:
        return self.file_bytes_before - self.file_bytes_after


def busy_message(path: Path) -> str:
    return (
        f"store at {path} is open by another process (a running server or kvstrata tool); "
        "rewriting its file needs the store to itself, so nothing was changed. Stop that "
        "process, or pass --no-rewrite to only evict (safe while it runs; LMDB reuses the freed "
        "pages but the file keeps its size)"
    )


def read_only_reason(path: Path) -> str | None:
    """Why the store at ``path`` cannot be changed (a read-only file system, no write
    permission), or None."""
    try:
        if os.statvfs(path).f_flag & os.ST_RDONLY:
            return f"store at {path} is on a read-only file system"
    except OSError as exc:
        return f"cannot inspect the file system of {path}: {exc.strerror or exc}"
    if not os.access(path, os.W_OK | os.X_OK) or not os.access(path / rec.DATA_FILE, os.W_OK):
        return f"store at {path} is not writable by this user"
    return None


@contextlib.contextmanager
def exclusive(path: Path) -> Iterator[None]:
    """Hold the store's lock file exclusively, or raise :class:`StoreBusyError` at once."""
    try:
        fd = os.open(path / rec.LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        raise RewriteError(read_only_reason(path) or
                           f"cannot open the lock file of {path}: {exc.strerror or exc}") from exc
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StoreBusyError(busy_message(path)) from None
        yield
    finally:
        os.close(fd)  # drops the lock


def is_busy(path: Path) -> bool:
    """True while some process has the store open writable (a server or a writing tool)."""
    try:
        with exclusive(path):
            return False
    except StoreBusyError:
        return True


@dataclass(frozen=True)
class _Census:
    entries: dict[bytes, int]
    live_bytes: int  # pages of every database: what a compacted copy writes


def _census(path: Path) -> _Census:
    env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=4, subdir=True)
    try:
        psize = env.stat()["psize"]
        pages = 2  # the two meta pages
        entries: dict[bytes, int] = {}
        with env.begin() as txn:
            for name in (None, *rec.DB_NAMES):
                st = txn.stat(env.open_db(name, txn=txn, create=False))
                pages += st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"]
                if name is not None:
                    entries[name] = st["entries"]
        return _Census(entries, pages * psize)
    finally:
        env.close()


def _fsync_path(path: Path, *, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_stale_temporaries(path: Path) -> None:
    for stale in path.glob(_TMP_PREFIX + "*"):
        shutil.rmtree(stale, ignore_errors=True)


def rewrite_locked(path: Path) -> RewriteResult:
    """Compact ``path``'s LMDB file in place. The caller holds :func:`exclusive`."""
    data = path / rec.DATA_FILE
    before = data.stat().st_size
    remove_stale_temporaries(path)
    try:
        census = _census(path)
    except lmdb.Error as exc:
        raise RewriteError(f"cannot read store at {path}: {exc}") from exc
    free = shutil.disk_usage(path).free
    if free < census.live_bytes + _SPACE_MARGIN:
        raise RewriteError(
            f"not enough free disk space next to {path} for the compacted copy "
            f"({census.live_bytes + _SPACE_MARGIN} bytes needed, {free} free); "
            "the store file was not rewritten"
        )
    tmp = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=path))
    try:
        env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=4, subdir=True)
        try:
            env.copy(str(tmp), compact=True)
        except lmdb.Error as exc:
            raise RewriteError(
                f"compacted copy of {path} failed: {exc}; the store file was not rewritten"
            ) from exc
        finally:
            env.close()
        copy = tmp / rec.DATA_FILE
        got = _census(tmp).entries
        if got != census.entries:
            raise RewriteError(
                f"compacted copy of {path} does not match the original ({got} != "
                f"{census.entries}); the store file was not rewritten"
            )
        _swap_in(copy, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return RewriteResult(before, data.stat().st_size)


def _swap_in(copy: Path, path: Path) -> None:
    """Replace ``path``'s data file with ``copy`` (same mode), durably."""
    data = path / rec.DATA_FILE
    os.chmod(copy, stat.S_IMODE(data.stat().st_mode))
    _fsync_path(copy)
    # Old reader table first, then the file: no opener can pair the new file with it.
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path / rec.LMDB_LOCK_FILE)
    os.replace(copy, data)
    _fsync_path(path, directory=True)


@dataclass(frozen=True)
class RebuildResult:
    kept: int
    left_out: int


def rebuild_locked(path: Path) -> RebuildResult:
    """Copy every sound record of ``path`` (``records.check``) with the readable namespace
    entries into a new LMDB file and swap it in; the totals are recounted and the store marked
    clean. The caller holds :func:`exclusive`. A record whose pages belong to another record
    cannot be deleted in place without freeing that record's pages: a rebuild never frees
    anything, it only leaves the damaged records out."""
    data = path / rec.DATA_FILE
    remove_stale_temporaries(path)
    need = data.stat().st_size + _SPACE_MARGIN  # at most the live records of the damaged file
    free = shutil.disk_usage(path).free
    if free < need:
        raise RewriteError(f"not enough free disk space next to {path} to rebuild it ({need} bytes "
                           f"needed, {free} free); the store file was not rewritten")
    tmp = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=path))
    try:
        try:
            kept, left_out = _copy_sound_records(path, tmp)
        except lmdb.Error as exc:
            raise RewriteError(f"rebuilding {path} failed: {exc}; the store file was not rewritten") from exc
        _swap_in(tmp / rec.DATA_FILE, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return RebuildResult(kept, left_out)


def _copy_sound_records(src: Path, dst: Path) -> tuple[int, int]:
    old = lmdb.open(str(src), readonly=True, lock=False, max_dbs=4, subdir=True)
    new = lmdb.open(str(dst), map_size=old.info()["map_size"], max_dbs=4, subdir=True,
                    sync=False, metasync=False)
    kept = left_out = 0
    try:
        h_old = rec.Handles.open(old, create=False)

        def read(body: Any, buffers: bool = True) -> Any:
            # One short transaction at a time: damage found in one leaves it unusable.
            with rec.begin(old, buffers=buffers) as txn:
                return body(txn, h_old)

        with new.begin(write=True) as wtxn:
            h_new = rec.Handles.open(new, wtxn)
            totals = rec.Totals()
            after: bytes | None = None
            while True:
                try:
                    rows = read(lambda txn, h, a=after: scans.scan_batch(txn, h.index, a, values=False),
                                buffers=False)
                except rec.LMDB_DAMAGE:
                    break  # the index cannot be read past a damaged page: keep what came before
                for key, present, problem in rec.check_all(read, [k for k, _ in rows]):
                    copied = read(lambda txn, h, k=key: _sound_copy(txn, h, k), buffers=False) \
                        if present and problem is None else None
                    if copied is None:
                        left_out += 1  # damaged, unreachable by its key, or another key's
                        continue
                    rec.put(wtxn, h_new, key, copied[1], copied[0], totals)
                    kept += 1
                if len(rows) < rec.SCAN_BATCH:
                    break
                after = rows[-1][0]
            try:
                namespaces, _bad = read(rec.namespaces, buffers=False)
            except rec.LMDB_DAMAGE:
                namespaces = {}  # the records stay; they show as unregistered
            for ns, info in namespaces.items():
                rec.register_namespace(wtxn, h_new, ns, info)
            wtxn.put(rec.META_FORMAT, str(rec.FORMAT_VERSION).encode(), db=h_new.meta)
            wtxn.put(rec.META_CLEAN, b"1", db=h_new.meta)
            rec.write_totals(wtxn, h_new, totals)
        new.sync(True)
    finally:
        new.close()
        old.close()
    return kept, left_out


def _sound_copy(txn: lmdb.Transaction, h: rec.Handles, key: bytes) -> tuple[rec.IndexRecord, bytes] | None:
    found = rec.decode_index(txn.get(key, db=h.index))
    payload = txn.get(key, db=h.payload)
    if found is None or payload is None or rec.check_frame(found, key, payload, decode=False) is not None:
        return None
    return found, bytes(payload)

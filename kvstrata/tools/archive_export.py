"""``kvstrata export DIR ARCHIVE [--fingerprint F]``: a portable archive of a store or one namespace.

Records are streamed in key order straight from the store's memory map into the archive (format:
``kvstrata.compaction.archive``), each one verified on the way (decompressed and checksummed:
a corrupt record is left out and reported, never exported). The archive is written to a temporary
file next to ARCHIVE and renamed into place when complete, so a failed or interrupted export never
leaves a file that looks like an archive. Read-only and safe while servers use the store.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import lmdb

from kvstrata.compaction.archive import ArchiveWriter
from kvstrata.tiers import codec
from kvstrata.tiers import records as rec
from kvstrata.tiers.disk import FORMAT_VERSION, DiskStore
from kvstrata.tools import support as ts
from kvstrata.tools.cli import CLIError

_BATCH = 8  # records per read transaction (and per verification task)


class _Sound(NamedTuple):
    key: bytes
    tick: int
    frame: bytes  # a copy out of the map
    raw_len: int


class _Bad(NamedTuple):
    key: bytes
    problem: str


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", type=Path, metavar="DIR", help="store directory")
    parser.add_argument("archive", type=Path, metavar="ARCHIVE", help="archive file to write")
    parser.add_argument(
        "--fingerprint", metavar="F", default=None, help="export one namespace (hex or unique prefix)"
    )
    parser.add_argument("--force", action="store_true", help="overwrite an existing archive file")
    parser.add_argument(
        "--threads", type=int, default=min(4, os.cpu_count() or 1), metavar="N", help="verification threads"
    )


def _read_batch(store: DiskStore, keys: list[bytes]) -> list[_Sound | _Bad]:
    out: list[_Sound | _Bad] = []
    for key, present, problem in rec.check_all(lambda body: store.read(body, buffers=True), keys):
        if not present:
            continue  # evicted since the scan
        if problem is not None:
            out.append(_Bad(key, problem))
            continue
        sound = store.read(partial(_copy_out, key=key), buffers=True)
        if sound is not None:  # None: gone since the check
            out.append(sound)
    return out


def _copy_out(txn: lmdb.Transaction, h: rec.Handles, key: bytes) -> _Sound | None:
    found = rec.decode_index(txn.get(key, db=h.index))
    payload = txn.get(key, db=h.payload)
    # The same frame the check decoded (same header and key-bound checksum): not decoded again.
    if found is None or payload is None or rec.check_frame(found, key, payload, decode=False) is not None:
        return None
    # One copy out of the map: the transaction must end before the file write.
    return _Sound(key, found.tick, bytes(payload), found.raw_len)


def _records(store: DiskStore, prefix: bytes, threads: int) -> Iterator[_Sound | _Bad]:
    """Every record under ``prefix`` in key order, verified on ``threads`` threads."""
    window: deque[Future[list[_Sound | _Bad]]] = deque()
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="kvstrata-export") as pool:
        for batch in store.scan("index", prefix=prefix, values=False):
            keys = [key for key, _ in batch]
            for i in range(0, len(keys), _BATCH):
                window.append(pool.submit(_read_batch, store, keys[i : i + _BATCH]))
                # Bounded lookahead: at most 2 x threads batches of frames in memory.
                if len(window) >= 2 * max(1, threads):
                    yield from window.popleft().result()
        while window:
            yield from window.popleft().result()


def _count(store: DiskStore, prefix: bytes) -> tuple[int, int]:
    chunks = stored = 0
    for batch in store.scan("index", prefix=prefix):
        for _, value in batch:
            found = rec.decode_index(value)
            chunks += 1
            stored += found.stored_len if found is not None else 0
    return chunks, stored


def run(args: argparse.Namespace) -> dict[str, Any]:
    archive: Path = args.archive
    if archive.exists() and not args.force:
        raise CLIError(f"{archive} exists; pass --force to overwrite it")
    if not archive.parent.is_dir():
        raise CLIError(f"cannot write {archive}: {archive.parent} is not a directory")
    store = ts.open_store(args.dir, readonly=True)
    tmp = archive.with_name(f".{archive.name}.partial-{os.getpid()}")
    try:
        registered = store.namespaces()
        ns = b""
        if args.fingerprint is not None:
            ns = ts.resolve_fingerprint(args.fingerprint, ts.store_namespaces(store))
        infos = {k.hex(): v for k, v in registered.items() if k.startswith(ns)}
        manifest = {
            "format": "kvstrata-archive",
            "created_us": time.time_ns() // 1000,
            "store_format_version": FORMAT_VERSION,
            "frame_version": codec.VERSION,
            "source": str(args.dir.resolve()),
            "fingerprint": ns.hex() or None,
            "namespaces": infos,
        }
        _, total_bytes = _count(store, ns)
        skipped: list[_Bad] = []
        # Owner-only, like a store: an archive holds every exported prompt's KV.
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as out, \
                ts.progress(total_bytes, "exporting", unit_bytes=True) as bar:
            writer = ArchiveWriter(out, manifest)
            for item in _records(store, ns, args.threads):
                if isinstance(item, _Bad):
                    skipped.append(item)
                    continue
                writer.add(item.key, item.tick, item.frame, item.raw_len)
                bar.update(len(item.frame))
            summary = writer.finish()
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, archive)
    except OSError as exc:
        raise CLIError(f"cannot write {archive}: {exc.strerror or exc}") from None
    finally:
        store.close()
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    if skipped:
        ts.warn(
            "export",
            f"left out {len(skipped)} corrupt record(s); run `kvstrata verify {args.dir}` for details",
        )
    return {
        "archive": str(archive),
        "fingerprint": ns.hex() or None,
        "namespaces": sorted(infos),
        "records": summary.records,
        "raw_bytes": summary.raw_bytes,
        "stored_bytes": summary.stored_bytes,
        "archive_bytes": archive.stat().st_size,
        "skipped_corrupt": len(skipped),
    }

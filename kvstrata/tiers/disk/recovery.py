"""Verification after an unclean shutdown: check every record, drop the bad ones, the orphan
payloads and the unreadable index records, and recount the totals.

It runs in the background while the store serves: reads are safe meanwhile because every read
checks its record (``records.read_into``) anyway; this pass frees the space of bad records and
repairs the totals. Only the (rare) deletions go through the writer thread.
"""

from __future__ import annotations

import logging
import threading
from functools import partial
from typing import TYPE_CHECKING

import lmdb

from kvstrata.tiers import record_scans as scans
from kvstrata.tiers import records as rec
from kvstrata.tiers.disk.counters import Counters
from kvstrata.tiers.disk.env import StoreUnavailableError
from kvstrata.tiers.disk.writer import Writer
from kvstrata.tiers.priority import name_this_thread

if TYPE_CHECKING:
    from kvstrata.auth import ValueAuth

log = logging.getLogger(__name__)

_BATCH = 256  # records checked per read transaction


def drop_if_bad(writer: Writer, keys: list[bytes], counter: str, auth: ValueAuth | None = None) -> int:
    """On the writer thread: re-check ``keys`` (one may have been rewritten since it was found
    bad) and delete those still bad, keeping the totals exact (recounted when an unreadable index
    record goes, since it was never counted reliably)."""
    h = writer.h

    def body(txn: lmdb.Transaction) -> int:
        problems = {key: rec.check(txn, h, key, auth=auth)[1] for key in keys}
        bad = [key for key, problem in problems.items() if problem is not None]
        for key in bad:
            if not rec.deletable_in_place(problems[key]):  # type: ignore[arg-type]
                writer.quarantine(key, f"{key.hex()}: {problems[key]}")
        bad = [key for key in bad if key not in writer.quarantined]
        if not bad:
            return 0
        unreadable = any(rec.decode_index(txn.get(k, db=h.index)) is None for k in bad)
        totals = rec.current_totals(txn, h)
        count, _ = writer.delete(txn, totals, bad)
        rec.write_totals(txn, h, rec.recount(txn, h)[0] if unreadable else totals)
        return count

    try:
        dropped = writer.write(body, buffers=True)
    except (lmdb.Error, OSError) as exc:
        writer.on_write_failure(exc)
        return 0
    writer.counts.bump(counter, dropped)
    return dropped


class Recovery:
    """The verification pass of one store, on a thread of its own (see the module docstring)."""

    def __init__(self, writer: Writer, counters: Counters) -> None:
        self.writer = writer
        self.counts = counters
        self.done = threading.Event()
        self.verified = False  # ran to the end: the store may be marked clean at close
        self._thread = threading.Thread(target=self._run, name="kvstrata-disk-verify", daemon=True)
        self._thread.start()

    def join(self) -> None:
        self._thread.join()

    def _run(self) -> None:
        name_this_thread()
        env, h, writer = self.writer.env, self.writer.h, self.writer
        try:
            checked = dropped = 0
            after: bytes | None = None
            while True:
                if writer.stopping:
                    return  # close() leaves the marker cleared: the next open verifies again
                rows = env.txn(partial(scans.scan_batch, db=h.index, after=after, values=False, limit=_BATCH))
                keys = [key for key, _ in rows]
                checked_keys = rec.check_all(lambda body: env.txn(lambda txn: body(txn, h), buffers=True), keys)
                bad = [k for k, _present, problem in checked_keys if problem is not None]
                checked += len(keys)
                self.counts.bump("recovery_checked", len(keys))
                if bad:
                    dropped += drop_if_bad(writer, bad, "recovery_dropped")
                if len(rows) < _BATCH:
                    break
                after = keys[-1]
            dropped += writer.call(self._drop_orphans)
            writer.write(lambda txn: rec.write_totals(txn, h, rec.recount(txn, h)[0]))
            log.warning("store at %s: verified %d records after unclean shutdown, dropped %d",
                        env.path, checked, dropped)
            self.verified = True
        except StoreUnavailableError:
            return
        except Exception:  # never let a verifier crash take the store down
            log.exception("store at %s: verification after unclean shutdown failed", env.path)
        finally:
            self.done.set()

    def _drop_orphans(self) -> int:
        h = self.writer.h

        def body(txn: lmdb.Transaction) -> int:
            index = txn.cursor(db=h.index)
            orphans = [bytes(key) for key in txn.cursor(db=h.payload).iternext(values=False)
                       if not index.set_key(key)]
            for key in orphans:
                txn.delete(key, db=h.payload)
            return len(orphans)

        count = self.writer.write(body)
        self.counts.bump("recovery_dropped", count)
        return count

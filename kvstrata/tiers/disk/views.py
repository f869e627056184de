"""What a store shows without changing it: its index (with the access ticks not written yet),
batched scans of its databases, LMDB's own account of the file, the namespaces, and the running
totals. Each view reads in short transactions of its own (one held across a caller's loop would
pin freed pages and grow the file) and never raises for what the store contains: an unreadable
record is skipped, counted and dropped by the writer (``damage``).
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

import lmdb
import msgspec

from kvstrata.tiers import record_scans as scans
from kvstrata.tiers import records as rec
from kvstrata.tiers.disk.counters import Counters
from kvstrata.tiers.disk.damage import Damage
from kvstrata.tiers.disk.env import StoreEnv, StoreUnavailableError

if TYPE_CHECKING:
    from kvstrata.tiers.disk.writer import Writer


class StoreViews:
    """The read-only views of one open store: its environment, counters, damage handling and
    writer (None when the store is read-only: ticks are then what the store holds, and nothing
    is dropped or rewritten)."""

    def __init__(self, env: StoreEnv, counts: Counters, damage: Damage, writer: Writer | None) -> None:
        self._env = env
        self.h = env.handles
        self._counts = counts
        self._damage = damage
        self._writer = writer

    def iter_index(self) -> Iterator[tuple[bytes, rec.IndexRecord]]:
        """Every readable (key, record) in key order, in batches of separate short transactions.
        Ticks include access not yet written. Unreadable index records are skipped, counted and
        dropped by the writer."""
        after: bytes | None = None
        while True:
            try:
                good, bad, after = self._env.txn(partial(scans.index_batch, h=self.h, after=after))
            except lmdb.Error as exc:  # the index's own pages are damaged: stop, never raise
                self._damage.log("the index cannot be read past this point", exc)
                return
            if bad:
                self._counts.bump("index_unreadable", len(bad))
                self._damage.log(f"{len(bad)} unreadable index record(s), e.g. {bad[0].hex()}", None)
                self._damage.drop_soon(bad)
            touched = self._writer.touched() if self._writer is not None else {}
            for key, found in good:
                tick = touched.get(key)
                yield key, (msgspec.structs.replace(found, tick=tick) if tick and tick > found.tick else found)
            if after is None:
                return

    def scan(self, db: Literal["index", "payload", "meta"] = "index", *, prefix: bytes = b"",
             values: bool = True, damage: list[str] | None = None) -> Iterator[list[tuple[bytes, bytes | None]]]:
        """Batches of ``(key, value copy or None)`` of one database in key order, under
        ``prefix``, each batch its own short read transaction (payload keys are read without
        touching their value pages when ``values`` is False). ``damage``: a damaged page of
        LMDB's own structure ends the scan, said there, instead of raising."""
        handle = getattr(self.h, db)
        after: bytes | None = None
        while True:
            try:
                batch = self._env.txn(partial(scans.scan_batch, db=handle, after=after, prefix=prefix, values=values))
            except rec.LMDB_DAMAGE as exc:
                if damage is None:
                    raise
                damage.append(f"the {db} database cannot be read past a damaged page ({exc})")
                return
            if batch:
                yield batch
            if len(batch) < rec.SCAN_BATCH:
                return
            after = batch[-1][0]

    def page_census(self) -> dict[str, int]:
        """LMDB's own account of the file: page size, the last page in use (from the meta page),
        the pages the databases use, and the pages the file has. A meta page that names a last
        page beyond the file, or fewer pages than the databases use, is damaged."""
        info, psize = self._env.env.info(), self._env.env.stat()["psize"]
        live_bytes = self._env.txn(lambda txn: rec.live_bytes(txn, self.h))
        return {"psize": psize, "last_pgno": int(info["last_pgno"]),
                "live_pages": live_bytes // psize, "file_pages": self.file_bytes() // psize}

    def file_bytes(self) -> int:
        """The size of the store's data file (0 when it cannot be read)."""
        try:
            return (self._env.path / rec.DATA_FILE).stat().st_size
        except OSError:
            return 0

    def key_namespaces(self) -> list[bytes]:
        """The distinct namespaces of the stored keys (a record may outlive its registration)."""
        return self._env.txn(lambda txn: scans.key_namespaces(txn, self.h))

    def namespaces(self) -> dict[bytes, dict[str, Any]]:
        """The registered namespaces (fingerprint -> description); unreadable entries skipped."""
        found, bad = self._env.txn(lambda txn: rec.namespaces(txn, self.h))
        if bad:
            self._damage.log(f"{len(bad)} unreadable namespace entr(ies), e.g. {bad[0].hex()}", None)
        return found

    def totals(self) -> rec.Totals:
        """The running totals the store keeps (exact across processes); recounted when their
        record is unreadable (derived data: the writer then stores the recount once), zeros
        when the store cannot be read."""
        try:
            return self._env.txn(self._totals_now)
        except (StoreUnavailableError, lmdb.Error):
            return rec.Totals()

    def _totals_now(self, txn: lmdb.Transaction) -> rec.Totals:
        totals = rec.read_totals(txn, self.h)
        if totals is not None:
            return totals
        self._damage.log("the totals record is unreadable; recounted", None)
        if self._writer is not None:
            self._writer.call_soon(self._rewrite_totals)
        return rec.recount(txn, self.h)[0]

    def _rewrite_totals(self) -> None:
        assert self._writer is not None
        self._counts.bump("totals_recounted")
        self._writer.write(lambda txn: rec.write_totals(txn, self.h, rec.recount(txn, self.h)[0]))

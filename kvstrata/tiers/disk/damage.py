"""What a store does with the damage its reads find: a read's outcome counted, a record that is
damaged, forged or another key's logged and dropped (or quarantined where it cannot be deleted
in place), store-level failures logged once per kind. Nothing here raises: to a reader, damage
is a counted miss (docs/DESIGN.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstrata.tiers import records as rec
from kvstrata.tiers.disk.counters import Counters
from kvstrata.tiers.disk.recovery import drop_if_bad

if TYPE_CHECKING:
    from kvstrata.auth import ValueAuth
    from kvstrata.tiers.disk.writer import Writer

log = logging.getLogger(__name__)


class Damage:
    """The damage handling of the store at ``path``: its counters, its writer (None when the
    store is read-only: nothing is dropped), its MAC key, and ``touch(keys)`` for a hit."""

    def __init__(self, path: Path, counts: Counters, writer: Writer | None, auth: ValueAuth | None,
                 touch: Callable[[Sequence[bytes]], None]) -> None:
        self.path = path
        self._counts = counts
        self._writer = writer
        self._auth = auth
        self._touch = touch
        self._logged: set[str] = set()

    def quarantined(self, key: bytes) -> bool:
        """A record found bad that could not be dropped in place: never served."""
        writer = self._writer
        return writer is not None and bool(writer.quarantined) and key in writer.quarantined

    def unquarantined(self, keys: Sequence[bytes], found: list[bool]) -> list[bool]:
        """``found`` (which ``keys`` are stored), with the quarantined ones not."""
        quarantined = self._writer.quarantined if self._writer is not None else None
        if quarantined:
            found = [f and k not in quarantined for k, f in zip(keys, found, strict=True)]
        return found

    def account_read(self, key: bytes, outcome: tuple[str, Any]) -> int | None:
        """Count a read's outcome (``DiskStore.read_outcome``), touch a hit, drop a bad record;
        the bytes read or None."""
        kind, result = outcome
        if kind == "size":
            log.debug("get_into(%s): %s", key.hex(), result)
            self._counts.bump("size_mismatch")
            result = None
        elif kind == "error":
            kind_name, message = result
            self.log(f"read of {key.hex()} failed: {kind_name}: {message}", None, kind=kind_name)
            result = None
        if result is None:
            self._counts.bump("misses")
            return None
        if isinstance(result, str):
            self.corrupt(key, result)
            return None
        self._counts.bump("hits")
        self._touch([key])
        return int(result)

    def corrupt(self, key: bytes, problem: str) -> None:
        """A read found record ``key`` bad (``problem``): a counted miss; the record is dropped
        by the writer (forged, or deletable in place) or quarantined."""
        if problem == rec.FORGED:
            self._counts.bump_many(forged=1, misses=1)
            if "forged" not in self._logged:  # a store under another key: every record
                self._logged.add("forged")
                log.warning("store at %s: record %s not served: %s; dropped, and counted as "
                            "'forged' (logged once)", self.path, key.hex(), problem)
            writer = self._writer
            if writer is not None:
                auth = self._auth
                writer.call_soon(lambda: drop_if_bad(writer, [key], "forged_dropped", auth))
            return
        self._counts.bump_many(corrupt=1, misses=1)
        log.warning("store at %s: corrupt record %s (%s); treated as a miss", self.path, key.hex(), problem)
        if rec.deletable_in_place(problem):
            self.drop_soon([key])
        elif self._writer is not None:
            self._writer.quarantine(key, f"{key.hex()}: {problem}")

    def drop_soon(self, keys: list[bytes]) -> None:
        """Have the writer re-check these records and drop those still bad."""
        writer = self._writer
        if writer is not None:
            writer.call_soon(lambda: drop_if_bad(writer, keys, "corrupt_dropped"))

    def log(self, what: str, exc: BaseException | None, kind: str | None = None) -> None:
        """Log a store-level problem once per kind (a damaged store would flood the log): the
        exception's type, ``kind``, or else ``what`` itself."""
        kind = kind or (what if exc is None else type(exc).__name__)
        if kind in self._logged:
            return
        self._logged.add(kind)
        log.warning("store at %s: %s%s", self.path, what, f": {exc}" if exc is not None else "")

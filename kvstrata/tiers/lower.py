"""The interface of a tier below the host tier: the local disk store, a shared remote store.

The hierarchy (``kvstrata.tiers.hierarchy``) composes ``host index -> [lower tiers]``: a lookup
asks the tiers in order, a chunk found in one is promoted from it into a host slot, and
write-behind copies host chunks down into every tier that admits them. A tier stores one record
per chunk and tensor-parallel shard, under ``namespace + chunk key``; a chunk is in a tier only
when every shard is. Records are bound to their keys and checked on read: a tier answers a
damaged or foreign record as a miss, never with wrong bytes and never with an exception.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from typing_extensions import Buffer


@runtime_checkable
class LowerTier(Protocol):
    """What the hierarchy needs of a lower tier (``DiskStore`` implements it)."""

    #: The tier's name in statistics and KV cache events ("disk", "remote").
    tier_name: str
    #: Told the store keys of records the tier itself removed (evicted, dropped as corrupt),
    #: once removed; called on the tier's own thread and must not wait on the tier.
    on_removed: Callable[[list[bytes]], None] | None

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Which store keys the tier holds now; all False when it cannot answer."""
        ...

    def get_into(self, key: bytes, out: Buffer) -> int | None:
        """Decode ``key``'s record into ``out``: bytes written, or None (miss, damaged, foreign)."""
        ...

    def put_many(self, entries: Sequence[tuple[bytes, Buffer, str]]) -> int:
        """Store ``(key, data, dtype)`` entries; how many are now stored. Drops (and counts)
        rather than raising when the tier is full or unavailable."""
        ...

    def put_many_then(self, entries: Sequence[tuple[bytes, Buffer, str]], done: Callable[[int], None]) -> None:
        """``put_many`` that may return before the entries are stored: ``done(stored)`` is
        called once, when they are, on whichever thread finished them (it must not block)."""
        ...

    def delete_many(self, keys: Sequence[bytes]) -> int:
        ...

    def touch_many(self, keys: Sequence[bytes]) -> None:
        """The chunks were used (served from a tier above): keep them longer."""
        ...

    def stats(self) -> dict[str, Any]:
        ...

    def close(self) -> None:
        ...


@runtime_checkable
class ReconnectingTier(LowerTier, Protocol):
    """A lower tier that can be unavailable for a while and says when it answers again (a shared
    server: its breaker, ``kvstrata.tiers.remote.breaker``)."""

    #: Told when the tier answers again after it was unavailable; called on the tier's own
    #: thread and must not wait on the tier.
    on_available: Callable[[], None] | None


@runtime_checkable
class ScannableTier(LowerTier, Protocol):
    """A lower tier that can list what it holds (a local store: warm start, disk announcement)."""

    def iter_index(self) -> Iterator[tuple[bytes, Any]]:
        """Every ``(store key, record)``; records have a ``tick`` (last access, µs)."""
        ...


def all_shards_present(tier: LowerTier, namespaces: Sequence[bytes], keys: Sequence[bytes]) -> list[bool]:
    """Per chunk key: whether ``tier`` holds the record of every namespace (shard)."""
    if not keys:
        return []
    n = len(namespaces)
    if n == 1:
        ns = namespaces[0]
        return tier.contains_many([ns + k for k in keys])
    probe = tier.contains_many([ns + k for k in keys for ns in namespaces])
    return [all(probe[i * n : (i + 1) * n]) for i in range(len(keys))]

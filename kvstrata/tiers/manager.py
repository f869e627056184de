"""What the scheduler-side connector needs of the tiers, in the style of vLLM's
``OffloadingManager``: look chunks up, prepare and complete stores and loads, and report tier
changes and statistics. ``kvstrata.tiers.hierarchy.Hierarchy`` implements it."""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from kvstrata.presence import Presence
from kvstrata.tiers.lower import LowerTier

if TYPE_CHECKING:
    from kvstrata.tiers.hierarchy import PromotionBudget


class TierManager(Protocol):
    @property
    def tiers(self) -> list[LowerTier]:
        """The lower tiers, nearest first."""
        ...

    def lookup_many(self, keys: Sequence[bytes], promoting: MutableMapping[bytes, str] | None = None, *,
                    stream: bool = False, prefix: bool = False,
                    protect: set[bytes] | None = None, offered: set[bytes] | None = None,
                    defer_promotions: bool = False, wait_for_room: bool = False,
                    queued: set[bytes] | None = None, reserve: int = 0,
                    budget: PromotionBudget | None = None) -> list[Presence]:
        """HIT / PENDING / MISS per chunk key; chunks only in a lower tier start their
        promotion (see ``Hierarchy.lookup_many``)."""
        ...

    def hold_room(self, *, head: bool = False) -> int:
        """Chunks ``hold`` (with ``head``) could pin now that it does not pin yet."""
        ...

    def host_room(self) -> int:
        """Host slots a promotion could take now."""
        ...

    def store_room(self) -> int:
        """Host slots a store could take now (fewer: it never evicts a chunk the disk has not got)."""
        ...

    def promote_queued(self, keys: Sequence[bytes], promoting: MutableMapping[bytes, str] | None,
                       queued: set[bytes]) -> list[Presence]:
        """Start the promotions a lookup queued for want of host room, as far as room goes
        (see ``Hierarchy.promote_queued``)."""
        ...

    def launch_deferred_promotions(self) -> None:
        """Run the promotions held by lookups with ``defer_promotions``."""
        ...

    def holds_many(self, keys: Sequence[bytes], *, prefix: bool = False) -> list[bool]:
        """Which chunks some tier holds, without promoting, counting or touching anything
        (``prefix``: only a run's held start is asked for, see ``Hierarchy.holds_many``)."""
        ...

    def in_flight(self, keys: Sequence[bytes]) -> bool: ...

    def wait_promotions(self, keys: Sequence[bytes], timeout: float | None) -> bool: ...

    def hold(self, keys: Sequence[bytes], *, head: bool = False) -> list[bytes]:
        """Pin chunks a waiting request's lookup found until it loads them (bounded, more for
        the ``head`` of vLLM's waiting queue; see ``Hierarchy.hold``); returns the keys pinned."""
        ...

    def release_held(self, keys: Sequence[bytes]) -> None: ...

    def prepare_store(self, keys: Sequence[bytes]) -> dict[bytes, int] | None:
        """Host slots for the chunks to store (all or nothing); {} when all are present."""
        ...

    def complete_store(self, keys: Sequence[bytes], success: bool = True) -> None: ...

    def prepare_load(self, keys: Sequence[bytes]) -> list[int]: ...

    def prepare_streamed_load(self, keys: Sequence[bytes]) -> list[tuple[int, int]]: ...

    def complete_load(self, keys: Sequence[bytes]) -> None: ...

    def reset(self) -> bool: ...

    def warm_start(self, max_chunks: int) -> None: ...

    def announce_disk(self) -> None: ...

    def take_events(self) -> list[tuple[str, bool, list[bytes]]]: ...

    def stats(self) -> dict[str, Any]: ...

    def close(self, timeout: float | None = None, *, flush_unwritten: bool = True) -> bool: ...

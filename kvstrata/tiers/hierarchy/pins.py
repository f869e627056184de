"""The host slots the connector pins: stores (device -> host), loads (host -> device) and the
holds of waiting requests. ``HostPins`` is one half of ``hierarchy.Hierarchy``, which holds the
state it reads and writes (``shared.Shared``, the pool, the write-behind and the promoter)."""

from __future__ import annotations

from collections.abc import Container, Sequence
from typing import TYPE_CHECKING

from kvstrata.tiers.hierarchy.shared import TIER_HOST

if TYPE_CHECKING:
    from kvstrata.tiers.hierarchy.promoter import Promoter
    from kvstrata.tiers.hierarchy.shared import Shared
    from kvstrata.tiers.hierarchy.write_behind import WriteBehind
    from kvstrata.tiers.host import HostPool


class HostPins:
    """Pins on host slots: ``prepare_store``/``complete_store``, ``prepare_load``,
    ``prepare_streamed_load``/``complete_load``, and ``hold``/``release_held``."""

    # The hierarchy's state this half uses (set in Hierarchy.__init__).
    _s: Shared
    pool: HostPool
    _writes: WriteBehind
    _promoter: Promoter

    def hold_room(self, *, head: bool = False) -> int:
        """Chunks :meth:`hold` (with ``head``) could pin now that it does not pin yet."""
        with self._s.lock:
            return max(0, self._hold_room_locked(head))

    def _hold_room_locked(self, head: bool) -> int:
        # Holds pin at most half the host tier's slots at once, or three quarters for the
        # request vLLM schedules next (``hold``).
        slots = self.pool.num_slots
        return (slots * 3 // 4 if head else slots // 2) - len(self._s.held)

    def hold(self, keys: Sequence[bytes], *, head: bool = False) -> list[bytes]:
        """Pin chunks a waiting request's lookup found, in the host tier or promoting into it,
        until the request is looked up again and loads them: a lookup that answers PENDING, or
        a hit vLLM finds no blocks for in that step, runs again only when vLLM's scheduler
        reaches the request again, and meanwhile its landed chunks would be idle slots that
        other requests' stores and promotions evict (a small host tier then promotes the same
        chunks over and over: docs/BENCHMARKS.md, "Holding a waiting request's chunks"). At
        most half the host tier's slots are held at once, first come first held (a request's
        keys in prefix order), but up to three quarters by the ``head`` of vLLM's waiting queue
        (the request it schedules next, whose promotions no budget bounds): the others leave
        it a quarter at least (docs/BENCHMARKS.md, "The head of the queue holds more"). Stores
        still in flight are not held. Returns the keys pinned (a key once per pin): release
        them with :meth:`release_held`."""
        s = self._s
        pool = self.pool
        out: list[bytes] = []
        with s.lock:
            if s.closed:
                return out
            held = s.held
            room = self._hold_room_locked(head)
            for key in keys:
                entry = pool.get(key)
                if entry is None or not (entry[1] or key in s.promoting):
                    continue
                n = held.get(key, 0)
                if not n:
                    if room <= 0:
                        s.counts["waiting_holds_capped"] += 1
                        continue
                    room -= 1
                held[key] = n + 1
                pool.acquire(key)
                out.append(key)
            s.counts["waiting_holds"] += len(out)
        return out

    def release_held(self, keys: Sequence[bytes]) -> None:
        """Unpin chunks :meth:`hold` pinned (once per key returned)."""
        if not keys:
            return
        s = self._s
        with s.lock:
            held = s.held
            for key in keys:
                n = held.get(key, 0)
                if n <= 1:
                    held.pop(key, None)
                else:
                    held[key] = n - 1
            self._promoter.release(keys)

    def prepare_store(self, keys: Sequence[bytes]) -> dict[bytes, int] | None:
        """Host slots for the keys not present yet (they become PENDING), or None if the host
        tier cannot make room for all of them (nothing is allocated then)."""
        s = self._s
        with s.lock:
            if s.closed:
                return None
            new = list(dict.fromkeys(k for k in keys if k not in self.pool))
            slots = self.pool.allocate(new, _Either(set(keys), self._writes.kept_from_stores())) if new else []
            if slots is None:
                s.counts["store_no_room"] += 1
                return None
            s.storing.update(new)
            for key in new:
                s.offer(key)
            s.counts["stores_prepared"] += len(new)
            return dict(zip(new, slots, strict=True))

    def complete_store(self, keys: Sequence[bytes], success: bool = True) -> None:
        """The device -> host copies of ``keys`` finished: HIT (and queued for write-behind
        where admitted), or dropped when ``success`` is False."""
        s = self._s
        start = []
        with s.lock:
            for key in keys:
                if key not in s.storing:
                    s.counts["store_unknown"] += 1
                    continue
                s.storing.discard(key)
                if not success:
                    self.pool.discard(key)
                    s.counts["stores_failed"] += 1
                    continue
                self.pool.mark_ready(key)
                self.pool.release(key)
                s.bad.discard(key)
                s.counts["stores_completed"] += 1
                s.journal.add(TIER_HOST, False, [key])
                start += self._writes.admitted(key, s.offers.get(key, 1))
            self._writes.schedule(start)

    def prepare_load(self, keys: Sequence[bytes]) -> list[int]:
        """Pin the (HIT) keys' slots for a host -> device load; returns their slots.

        Raises KeyError (pinning nothing) if a key is not readable in the host tier.
        """
        s = self._s
        with s.lock:
            missing = [k for k in keys if not self.pool.is_ready(k)]
            if missing:
                raise KeyError(f"{len(missing)} chunk(s) not in the host tier, e.g. {missing[0].hex()}")
            slots = [self.pool.acquire(k) for k in keys]
            for key in keys:
                self.pool.touch(key)
            if s.unread:
                s.unread.difference_update(keys)
            s.counts["loads_prepared"] += len(keys)
            return slots

    def prepare_streamed_load(self, keys: Sequence[bytes]) -> list[tuple[int, int]]:
        """Pin the keys' slots for a host -> device load that may start before a promotion
        landed; returns ``(slot, ticket)`` per key.

        Ticket 0: the chunk is in the host tier now. A positive ticket: wait until the slab's
        landing board shows it for the slot (``landed[slot] >> 1 >= ticket``; the chunk is
        there when the value is exactly ``ticket << 1``, anything else means it failed). Ticket
        -1: the chunk is gone already (its promotion failed since the lookup); the load fails.
        Release every key with :meth:`complete_load` as usual.
        """
        s = self._s
        with s.lock:
            out = self._promoter.streamed(keys)
            s.counts["loads_prepared"] += len(keys)
            s.counts["loads_streamed"] += sum(1 for _, t in out if t > 0)
        return out

    def complete_load(self, keys: Sequence[bytes]) -> None:
        """Unpin slots taken by ``prepare_load`` or ``prepare_streamed_load`` (once per key per
        call)."""
        with self._s.lock:
            self._promoter.release(keys)


class _Either:
    """Keys in either of two containers (``HostPool.allocate``'s ``protected``)."""

    __slots__ = ("_a", "_b")

    def __init__(self, a: Container[bytes], b: Container[bytes]) -> None:
        self._a, self._b = a, b

    def __contains__(self, key: object) -> bool:
        return key in self._a or key in self._b

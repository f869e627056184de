"""Lookups in the hierarchy: the host index first, then the lower tiers, starting promotions.

Runs on the scheduler's critical path, so the host index is read under one lock with list
comprehensions over the keys, and the lower tiers are asked outside it, in order (a chunk is
promoted from the first tier that holds all its shards). A full-attention run is probed as a
prefix (nothing promoted past its first missing chunk); chunks a request's lookup answered HIT
are never evicted by its later probes. The answers and counters are the hierarchy's
(``hierarchy.Hierarchy.lookup_many``).
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping, Sequence
from itertools import compress

from kvstrata.presence import Presence
from kvstrata.tiers.hierarchy.promoter import Promoter
from kvstrata.tiers.hierarchy.shared import PromotionBudget, Shared, TierLink
from kvstrata.tiers.hierarchy.write_behind import WriteBehind
from kvstrata.tiers.host import HostPool
from kvstrata.tiers.lower import all_shards_present

logger = logging.getLogger(__name__)

_ABSENT, _READY, _NOT_READY = HostPool.ABSENT, HostPool.READY, HostPool.NOT_READY
_HIT, _PENDING, _MISS = Presence.HIT, Presence.PENDING, Presence.MISS
# Indexed by HostPool.lookup_many's states (ABSENT=0, READY=1, NOT_READY=2).
_BY_HOST_STATE = (_MISS, _HIT, _PENDING)
PREFIX_BATCH = 32  # the first batch of a prefix run asked of the lower tiers (``Lookup.find``)


class Lookup:
    def __init__(self, shared: Shared, writes: WriteBehind, promoter: Promoter) -> None:
        self.s = shared
        self.writes = writes
        self.promoter = promoter

    def holds(self, keys: Sequence[bytes], prefix: bool = False) -> list[bool]:
        """Which chunks some tier holds (``Hierarchy.holds_many``): no access recorded, no
        promotion started, nothing counted. ``prefix``: as ``find``'s."""
        s = self.s
        with s.lock:
            if s.closed:
                return [False] * len(keys)
            found = [h != _ABSENT for h in s.pool.lookup_many(keys, touch=False)]
            bad = s.bad
            rest = [i for i, f in enumerate(found) if not f and (not bad or keys[i] not in bad)]
        for i in self.find(keys, rest, prefix) if rest else ():
            found[i] = True
        return found

    def lookup(
        self,
        keys: Sequence[bytes],
        count_offers: bool,
        promoting: MutableMapping[bytes, str] | None = None,
        stream: bool = False,
        prefix: bool = False,
        protect: set[bytes] | None = None,
        offered: set[bytes] | None = None,
        defer: bool = False,
        wait_for_room: bool = False,
        queued: set[bytes] | None = None,
        reserve: int = 0,
        budget: PromotionBudget | None = None,
    ) -> list[Presence]:
        # Kept to C-level iteration and list comprehensions over the keys: this runs on the
        # scheduler's critical path, for hundreds of keys every step a long prompt waits.
        s = self.s
        links = s.links
        # Per key, whether this lookup offers it (admission, reuse evidence, the lower tiers'
        # access order): not if the same request's earlier lookups did (``offered``), which is
        # every key when a waiting request is looked up again.
        if not offered:
            fresh = [True] * len(keys)
        elif offered.issuperset(keys):
            fresh = []
        else:
            fresh = [k not in offered for k in keys]
        any_fresh = True in fresh
        with s.lock:
            if s.closed:
                return [_MISS] * len(keys)
            host = self.s.pool.lookup_many(keys)
            states = list(map(_BY_HOST_STATE.__getitem__, host))
            # Host hits of chunks a lower tier holds: tell the tier they were used, or its LRU
            # (and max_age_s) would evict first the chunks served most often from the host tier.
            used = [[k for k, h, f in zip(keys, host, fresh, strict=True) if f and h == _READY and k in link.resident]
                    if link.resident and any_fresh else [] for link in links]
            streamed = 0  # HIT answers that are promotions in flight (counted as pending)
            if s.promoting and (promoting is not None or stream) and _NOT_READY in host:
                landing = [i for i, h in enumerate(host) if h == _NOT_READY and keys[i] in s.promoting]
                if promoting is not None:
                    promoting.update((keys[i], s.promoting[keys[i]]) for i in landing)
                if stream:
                    for i in landing:
                        states[i] = _HIT
                    streamed += len(landing)
            if count_offers and any_fresh and any(link.admit_after > 1 for link in links):
                admitted = []
                for k in (k for k, h, f in zip(keys, host, fresh, strict=True) if f and h == _READY):
                    admitted += self.writes.admitted(k, s.offer(k))
                self.writes.schedule(admitted)
            candidates: list[int] = []
            if links and _ABSENT in host:
                bad = s.bad
                candidates = list(compress(range(len(host)), map(_ABSENT.__eq__, host)))
                if bad:
                    candidates = [i for i in candidates if keys[i] not in bad]
            if not candidates:
                self._count(states, streamed)
            if count_offers:  # a request came back for chunks the tiers hold
                for link, ks in zip(links, used, strict=True):
                    if ks:
                        link.reuse.read_back(sum(map(s.chunk_bytes, ks)))
        for link, ks in zip(links, used, strict=True):
            if ks:
                link.tier.touch_many([ns + k for k in ks for ns in self.s.namespaces])
        if offered is not None and any_fresh:
            offered.update(keys)
        if not candidates:
            return states
        source = self.find(keys, candidates, prefix)
        self._start_promotions(keys, states, source, streamed, promoting, stream, protect,
                                ([i for i in candidates if fresh[i]] if any_fresh else [])
                                if count_offers else None, defer, wait_for_room, queued, reserve,
                                budget)
        return states

    def find(self, keys: Sequence[bytes], candidates: list[int], prefix: bool) -> dict[int, TierLink]:
        """Which lower tier holds each candidate (every shard), asking the tiers in order
        outside the lock; with ``prefix``, nothing past the first key no tier holds.

        A prefix run is asked in batches growing fourfold from ``PREFIX_BATCH`` keys and stops
        at the first key no tier holds: a long prompt of which the tiers hold only the first
        chunks (a shared system prompt) costs a few probes, not one per chunk each time a
        waiting request is looked up again (docs/BENCHMARKS.md, "The scheduler's side at GPU
        scale")."""
        if not prefix:
            return self._find(keys, candidates)
        bad = self.s.bad
        if bad:  # a chunk whose promotion failed ends the run there
            first_bad = next((i for i, k in enumerate(keys) if k in bad), len(keys))
            candidates = [i for i in candidates if i < first_bad]
        source: dict[int, TierLink] = {}
        start, size = 0, PREFIX_BATCH
        while start < len(candidates):
            batch = candidates[start:start + size]
            found = self._find(keys, batch)
            first_miss = next((i for i in batch if i not in found), None)
            if first_miss is not None:
                source.update((i, link) for i, link in found.items() if i < first_miss)
                break
            source.update(found)
            start += size
            size *= 4
        return source

    def _find(self, keys: Sequence[bytes], candidates: list[int]) -> dict[int, TierLink]:
        source: dict[int, TierLink] = {}
        rest = candidates
        for link in self.s.links:
            if not rest:
                break
            try:
                found = all_shards_present(link.tier, self.s.namespaces, [keys[i] for i in rest])
            except Exception:
                logger.exception("kvstrata: %s lookup failed; treating as misses", link.name)
                found = [False] * len(rest)
            source.update((i, link) for i, f in zip(rest, found, strict=True) if f)
            rest = [i for i, f in zip(rest, found, strict=True) if not f]
        return source

    def _start_promotions(self, keys: Sequence[bytes], states: list[Presence], source: dict[int, TierLink],
                          streamed: int, promoting: MutableMapping[bytes, str] | None, stream: bool,
                          protect: set[bytes] | None, asked: list[int] | None, defer: bool = False,
                          wait_for_room: bool = False, queued: set[bytes] | None = None,
                          reserve: int = 0, budget: PromotionBudget | None = None) -> None:
        """``asked``: the keys (indices) a request's lookup looked for below the host tier, for
        the tiers' reuse evidence (None: a promotion that is no request's). ``defer``: the
        reads are held until ``Promoter.launch_deferred``. ``wait_for_room``: a chunk the host
        tier has no room for answers PENDING (ask again later) instead of MISS, when this
        lookup's promotions could all fit in the host tier once its holders let go. ``queued``
        (streamed loads only): otherwise such a chunk answers HIT and is added there, to be
        promoted and loaded once room frees (``Hierarchy.lookup_many``). ``reserve``: host
        slots these promotions leave to others (loads in pieces waiting for room): a chunk that
        would take one of them has no room. ``budget``: promotions this lookup may still start
        (spent here); a chunk past it is answered as one without room."""
        s = self.s
        items = []
        with s.lock:
            if asked is not None:
                self._note_read_back(keys, source, asked)
            protected: set[bytes] | None = None
            room = not s.closed
            held_back = False  # room ends for want of budget
            order = sorted(source)
            # Waiting is worth it only where the promotions could all fit in the tier at all.
            wait_for_room = wait_for_room and len(order) <= s.pool.num_slots
            if not wait_for_room and queued is None:
                budget = None  # a chunk held back would be computed: promote what room allows
            slots_of = (self._allocate_all(keys, order, states, protect, reserve, budget)
                        if room else {})
            if slots_of:  # every absent chunk got its slot at once (the usual case): one pass
                answer = _HIT if stream else _PENDING
                rest = []  # those in the host tier already (a store meanwhile, a duplicate key)
                for i in order:
                    key = keys[i]
                    slot = slots_of.pop(key, None)
                    if slot is None:
                        rest.append(i)
                    else:
                        items.append((key, slot, source[i]))
                        states[i] = answer
                self.promoter.start_many(items)
                if budget is not None:
                    budget.left -= len(items)
                streamed += stream * len(items)
                if promoting is not None:
                    promoting.update((key, link.name) for key, _, link in items)
                order = rest
            for i in order:
                key = keys[i]
                st = self.s.pool.lookup_many((key,), touch=False)[0]
                if st != _ABSENT:  # appeared meanwhile (a store, or a duplicate key)
                    if st == _READY:
                        states[i] = _HIT
                    elif stream and key in s.promoting:
                        states[i] = _HIT
                        streamed += 1
                    else:
                        states[i] = _PENDING
                    continue
                if budget is not None and budget.left <= 0:
                    # What this lookup could not hold: promoted now, it would be evicted by
                    # other requests' promotions and stores before its request loads it.
                    room, held_back = False, True
                if not room:
                    s.counts["promote_held_back"] += held_back
                    streamed += self._no_room(keys, states, i, source[i], wait_for_room, queued, promoting)
                    continue
                if protected is None:
                    protected = {k for k, st in zip(keys, states, strict=True) if st == _HIT}
                    if protect:
                        protected |= protect
                slots = (self.s.pool.allocate((key,), protected, self.writes.kept_from_stores())
                         if s.pool.room > reserve else None)
                if slots is None:
                    # The host tier is full of pinned chunks: answer MISS rather than PENDING
                    # so that the request does not wait on a promotion that never starts, unless
                    # it may wait for room (then it asks again, and starts it then).
                    room = False
                    streamed += self._no_room(keys, states, i, source[i], wait_for_room, queued, promoting)
                    continue
                items.append(self.promoter.start(key, slots[0], source[i]))
                if budget is not None:
                    budget.left -= 1
                states[i] = _HIT if stream else _PENDING
                streamed += stream
                if promoting is not None:
                    promoting[key] = source[i].name
            self.promoter.launch(items, defer)
            self._count(states, streamed)

    def _no_room(self, keys: Sequence[bytes], states: list[Presence], i: int, link: TierLink,
                 wait_for_room: bool, queued: set[bytes] | None,
                 promoting: MutableMapping[bytes, str] | None) -> int:
        """Chunk ``i`` of a lookup found no host slot for its promotion (or the hierarchy is
        closed). Returns 1 when it answers HIT as a queued promotion (counted as pending). Under
        the lock."""
        s = self.s
        if s.closed:
            return 0
        if wait_for_room:
            states[i] = _PENDING
            s.counts["promote_room_waits"] += 1
        elif queued is not None:
            states[i] = _HIT
            queued.add(keys[i])
            if promoting is not None:
                promoting[keys[i]] = link.name
            s.counts["promote_queued"] += 1
            return 1
        else:
            s.counts["promote_no_room"] += 1
        return 0

    def _allocate_all(self, keys: Sequence[bytes], order: list[int], states: list[Presence],
                      protect: set[bytes] | None, reserve: int = 0,
                      budget: PromotionBudget | None = None) -> dict[bytes, int]:
        """Host slots for every chunk of ``order`` not in the host tier, in one allocation (one
        pass over the eviction order instead of one per chunk); {} when they do not all fit,
        and the caller then allocates chunk by chunk, as far as room goes. Under the lock."""
        pool = self.s.pool
        wanted = list(dict.fromkeys(keys[i] for i in order))
        absent = [k for k, st in zip(wanted, pool.lookup_many(wanted, touch=False), strict=True) if st == _ABSENT]
        if not absent or pool.room - len(absent) < reserve or (budget is not None and len(absent) > budget.left):
            return {}
        protected = {k for k, st in zip(keys, states, strict=True) if st == _HIT}
        if protect:
            protected |= protect
        slots = pool.allocate(absent, protected, self.writes.kept_from_stores())
        return {} if slots is None else dict(zip(absent, slots, strict=True))

    def _note_read_back(self, keys: Sequence[bytes], source: dict[int, TierLink], asked: list[int]) -> None:
        """A request looked for ``asked`` below the host tier: those a tier holds, and those it
        lost before their write, count as read back from it (``reuse``). Under the lock."""
        s = self.s
        wanted = set(asked)
        for link in s.links:
            found = [keys[i] for i, src in source.items() if src is link and i in wanted]
            if found:
                link.reuse.read_back(sum(map(s.chunk_bytes, found)))
            if link.reuse.has_lost:
                link.reuse.asked_for([keys[i] for i in asked if i not in source])

    def _count(self, states: list[Presence], streamed: int = 0) -> None:
        c = self.s.counts
        c["lookups"] += len(states)
        c["lookup_hits"] += states.count(_HIT) - streamed
        c["lookup_pending"] += states.count(_PENDING) + streamed

"""Whether a lower tier's writes are read back: the evidence that decides if the write-behind may
take the engine's CPU (its normal-priority threads) when its idle-priority ones fall behind.

On a CPU-bound engine every core second the write-behind takes is a second the model waits for
(docs/BENCHMARKS.md, "Overhead"): keeping the disk complete there cost a workload without reuse
1.1-1.2x its time. On a workload whose later requests come back for what was stored, the same
writes are what serves them (multi-round sessions under load: 733 stores refused and most
second rounds recomputed when writes got no CPU). So the write-behind pays for catching up only
while the tier's writes are read back.

Evidence, per tier, counted in bytes: chunks a request's lookup found in the tier (a promotion
starts), chunks it found in the host tier that the tier holds too (the workload comes back;
once the host tier evicts them, the tier serves them), and chunks a lookup asked for that the
write-behind had admitted to the tier but lost (the host tier evicted them before their write:
they would have been served). Against it, the bytes admitted for writing. Both decay by half
every ``half_life_bytes`` admitted, so a workload that stops reusing turns the catching-up off
again, and one that starts turns it on within a few requests. A tier that has had nothing admitted yet but serves (a restarted store) counts as
read back.

Until a tier has been given ``warm_up_bytes`` of writes (the half-life, at most WARM_UP_BYTES),
the evidence cannot have come yet (a session's second round arrives after its first was
stored): the meter assumes reuse meanwhile, the common case for a KV cache, so a fresh server
under load does not lose the first sessions' chunks waiting for proof. A workload without
reuse pays that once per process.
"""

from __future__ import annotations

from collections import OrderedDict

# Bytes read back per byte admitted, above which catching up is worth the engine's CPU. A
# workload without reuse reads back ~0 (a few duplicate prompts); multi-round sessions and
# shared prefixes read back a large part of what they store (0.4-1).
MIN_REUSE = 0.1
# The most a fresh tier writes on the assumption of reuse: about a CPU-second of compression
# and puts here (docs/BENCHMARKS.md), once per process.
WARM_UP_BYTES = 256 << 20


class ReuseMeter:
    """Decayed bytes admitted to one lower tier and bytes read back from it (module docstring).

    Not thread-safe: called under the hierarchy's lock.
    """

    def __init__(self, half_life_bytes: int, *, ghost_capacity: int = 1 << 14,
                 min_reuse: float = MIN_REUSE) -> None:
        if half_life_bytes <= 0:
            raise ValueError("half_life_bytes must be positive")
        self.half_life = float(half_life_bytes)
        self.warm_up = min(self.half_life, WARM_UP_BYTES)
        self.min_reuse = min_reuse
        self.admitted_bytes = 0.0
        self.reused_bytes = 0.0
        self.total_admitted = 0  # undecayed: the warm-up (module docstring)
        # Chunks admitted to the tier whose write was lost (evicted from the host tier first),
        # most recent last: a lookup asking for one is evidence the write would have paid.
        self._lost: OrderedDict[bytes, int] = OrderedDict()
        self._ghost_capacity = ghost_capacity

    def admitted(self, nbytes: int) -> None:
        self.total_admitted += nbytes
        decay = 0.5 ** (nbytes / self.half_life)
        self.admitted_bytes = self.admitted_bytes * decay + nbytes
        self.reused_bytes *= decay

    def read_back(self, nbytes: int) -> None:
        self.reused_bytes += nbytes

    def lost(self, key: bytes, nbytes: int) -> None:
        self._lost[key] = nbytes
        self._lost.move_to_end(key)
        while len(self._lost) > self._ghost_capacity:
            self._lost.popitem(last=False)

    @property
    def has_lost(self) -> bool:
        return bool(self._lost)

    def asked_for(self, keys: list[bytes]) -> None:
        """A request's lookup found none of ``keys`` in the tier: those it lost count as read
        back (once each)."""
        if not self._lost:
            return
        for key in keys:
            nbytes = self._lost.pop(key, None)
            if nbytes is not None:
                self.reused_bytes += nbytes

    @property
    def ratio(self) -> float:
        if self.admitted_bytes <= 0:
            return 1.0 if self.reused_bytes > 0 else 0.0
        return self.reused_bytes / self.admitted_bytes

    def paying(self) -> bool:
        """Whether the tier's writes are read back enough to take the engine's CPU for them
        (assumed during the warm-up: module docstring)."""
        return self.total_admitted < self.warm_up or self.ratio >= self.min_reuse

"""Whether a lower tier's writes are read back: the ``write_reuse`` gauge (per tier, and
``vllm:kvstrata_disk_write_reuse``), the share of what the write-behind gave the tier that
requests came back for. It tells an operator whether the tier pays for its writes (a workload
without reuse reads back ~0; multi-round sessions and shared prefixes 0.4-1). It once gated the
write-behind's catch-up; waiting for it lost the first pass of multi-round sessions
(docs/BENCHMARKS.md, "Catching up without waiting for reuse").

Evidence, per tier, counted in bytes: chunks a request's lookup found in the tier (a promotion
starts), chunks it found in the host tier that the tier holds too (the workload comes back;
once the host tier evicts them, the tier serves them), and chunks a lookup asked for that the
write-behind had admitted to the tier but lost (the host tier evicted them before their write:
they would have been served). Against it, the bytes admitted for writing. Both decay by half
every ``half_life_bytes`` admitted, so the gauge follows a workload that stops reusing, or
starts, within a few requests. A tier that has had nothing admitted yet but serves (a restarted
store) counts as read back.
"""

from __future__ import annotations

from collections import OrderedDict


class ReuseMeter:
    """Decayed bytes admitted to one lower tier and bytes read back from it (module docstring).

    Not thread-safe: called under the hierarchy's lock.
    """

    def __init__(self, half_life_bytes: int, *, ghost_capacity: int = 1 << 14) -> None:
        if half_life_bytes <= 0:
            raise ValueError("half_life_bytes must be positive")
        self.half_life = float(half_life_bytes)
        self.admitted_bytes = 0.0
        self.reused_bytes = 0.0
        # Chunks admitted to the tier whose write was lost (evicted from the host tier first),
        # most recent last: a lookup asking for one is evidence the write would have paid.
        self._lost: OrderedDict[bytes, int] = OrderedDict()
        self._ghost_capacity = ghost_capacity

    def admitted(self, nbytes: int) -> None:
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

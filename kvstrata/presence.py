"""What a tier answers for one chunk key. Shared by the tiers and the pure semantics."""

from __future__ import annotations

import enum


class Presence(enum.IntEnum):
    """Lookup answer for one chunk, mirroring vLLM's kv_offload ``LookupResult``.

    HIT: readable now (in the host tier). PENDING: present but not readable yet (a store to the host
    is in flight, or a disk -> host promotion was started); ask again next step. RETRY: unknown yet.
    MISS: not stored anywhere (or corrupt: a corrupt record is always a miss).
    """

    MISS = 0
    HIT = 1
    PENDING = 2
    RETRY = 3

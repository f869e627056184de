"""The scheduler's per-request bookkeeping: a request's chunk keys and block ids per group, its
lookup's findings, and the jobs in flight for it (``StrataScheduler`` and its lookup and store
halves share these records).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.request import Request

from kvstrata import semantics
from kvstrata.tiers.hierarchy import TIER_HOST

logger = logging.getLogger(__name__)


@dataclass
class GroupState:
    keys: list[bytes] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    next_stored_chunk: int = 0
    # key -> chunk index, kept only for self-describing KV events
    chunk_of: dict[bytes, int] = field(default_factory=dict)


@dataclass
class PieceLoad:
    """A load larger than the host tier's room, brought in pieces: each piece is promoted into
    the host tier, copied to the device and unpinned before the next one is promoted
    (``connector/pieces.py``); vLLM's request waits for its remote KVs until the last one."""

    transfers: list[semantics.ChunkTransfer]  # still to load, in plan order
    hit: tuple[int, dict[str, int]]  # the whole load's (tokens, of which per lower tier)
    # A piece failed, a chunk left every tier, the request finished or the cache was reset:
    # the load's last job then fails it (vLLM recomputes, or frees the request's blocks).
    failed: bool = False
    # Since when the next piece has waited for host-tier room (None: not waiting).
    waiting_since: float | None = None


@dataclass
class RequestState:
    req: Request
    groups: dict[int, GroupState]
    max_load_tokens: int | None = None
    max_offload_tokens: int | None = None
    num_local: int = 0
    jobs: set[int] = field(default_factory=set)
    finished_signaled: bool = False
    # keys a lookup of this request found only in a lower tier (promoted), with that tier's
    # name: for per-tier hit attribution
    promoted: dict[bytes, str] = field(default_factory=dict)
    # Chunks this request's lookups already asked the tiers for: a request waiting to be
    # scheduled is looked up again every step, and it offers each chunk (disk admission, the
    # tiers' reuse evidence) once, however often it is looked up.
    offered: set[bytes] = field(default_factory=set)
    load_keys: list[tuple[int, int, bytes]] = field(default_factory=list)  # (start, end, key)
    lookup_started: float | None = None
    hit_sources: dict[CacheHitSource, int] = field(default_factory=dict)
    # Chunks the last (deferred) lookup found still on their way into the host tier: until one
    # of them lands, the same lookup would defer again, so it is not re-run.
    awaiting: list[bytes] = field(default_factory=list)
    # Chunks pinned in the host tier for this request while its lookup waits (and until its
    # load is prepared): what the lookup found there or promoting into it (Hierarchy.hold).
    held: list[bytes] = field(default_factory=list)
    # Whether its last lookup was its step's first: vLLM looks its waiting requests up in queue
    # order, so this is the one it schedules next (it may hold more: Hierarchy.hold's ``head``).
    head_of_queue: bool = False
    # What the last lookup found for a hit vLLM has not allocated blocks for yet: held at the
    # end of the step's scheduling if it still has not (``LookupMixin.hold_unallocated_hits``).
    hit_found: list[bytes] | None = None
    # Where the last lookup's hit ends inside a block (a partial tail, R30), for the load plan.
    partial_boundary: int | None = None
    # The prompt's tail keys per group (semantics.prompt_tail), hashed once on first use; and
    # whether the last lookup's hit includes the tail.
    prompt_tail_keys: dict[int, bytes] | None = None
    prompt_tail_hashed: bool = False
    prompt_tail_hit: bool = False
    # The host tier had no room for the prompt's tail in the step that completed the prompt:
    # asked again at the next steps, while decoding is still inside its chunk.
    tail_store_refused: bool = False
    # A stored tail serving this longer prompt (semantics.tail_extension): the candidate tails'
    # keys per group by length, for the chunk start they were computed at, and the keys of the
    # tail the last lookup's hit ends in (None: it ends elsewhere).
    extension_start: int | None = None
    extension_tails: dict[int, dict[int, bytes]] = field(default_factory=dict)
    extension_none_at: float | None = None  # when the tiers last held none of those tails
    extension_keys: Mapping[int, bytes] | None = None
    # Whether the last lookup's hit is loaded synchronously (before its step's forward).
    sync_load: bool = False
    # Chunks the last lookup answered HIT although the host tier had no room to promote them
    # (streamed loads): its load brings them in later pieces.
    queued: set[bytes] = field(default_factory=set)
    # The rest of a load brought in pieces, while the request waits for it (None: no such load).
    pieces: PieceLoad | None = None
    # A load of this request in pieces waited too long for host-tier room and was given up:
    # its later lookups compute what does not fit instead of loading it in pieces again.
    no_pieces: bool = False
    # Tokens kvstrata served this request by the tier they came from (its last load that
    # succeeded), handed back in the request's output (``SERVED_PARAM``).
    served: dict[str, int] = field(default_factory=dict)


# The key of a finished request's ``kv_transfer_params`` (``RequestOutput.kv_transfer_params``)
# under which kvstrata says what it served that request: ``{tier: tokens}``, present only when it
# served some. vLLM's ``num_cached_tokens`` also counts its own prefix-cache hits; this does not.
SERVED_PARAM = "kvstrata_served_tokens"


@dataclass
class Job:
    req_id: str
    is_store: bool
    keys: list[bytes]
    pending: int
    fenced: list[int] = field(default_factory=list)
    deferred_fence: list[int] = field(default_factory=list)
    submitted_at: float = field(default_factory=time.monotonic)
    # loads: (tokens, of which promoted from each lower tier), counted on success
    hit: tuple[int, dict[str, int]] = field(default_factory=lambda: (0, {}))
    failed: bool = False  # some worker reported it failed (the others may report later)
    # A synchronous load: what the request was served before it (restored if it fails).
    served_before: dict[str, int] | None = None
    # A load's piece other than its last (PieceLoad): served and counted with the last one.
    partial: bool = False


def served_by_tier(tokens: int, lower: dict[str, int]) -> dict[str, int]:
    """What a load served, by tier: ``lower`` the tokens promoted from each lower tier, the rest
    from the host tier (tiers without tokens left out)."""
    served = {TIER_HOST: tokens - sum(lower.values()), **lower}
    return {tier: n for tier, n in served.items() if n}


def request_cap(req: Request, name: str) -> int | None:
    params = req.kv_transfer_params
    raw = params.get(name) if params else None
    if raw is None:
        return None
    if type(raw) is int and raw >= 0:
        return raw
    logger.warning("kvstrata: kv_transfer_params[%r] must be a non-negative int, got %r; ignoring", name, raw)
    return None

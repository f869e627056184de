"""Helpers of the differential tests of kvstrata's semantics against vLLM 0.32.0's own
``OffloadingConnectorScheduler`` (tests/integration/test_semantics_differential_*.py): seeded random
group layouts of every family, and a lookup case asked of vLLM and of kvstrata.

The importing test module skips without vLLM and puts this directory on ``sys.path`` first.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from vllm_offload_harness import ScriptedManager, build_scheduler, make_request

from kvstrata.presence import Presence
from kvstrata.semantics import (
    GroupGeometry,
    GroupKind,
    Layout,
    chunk_keys,
    lookup_hit,
    partial_tail_hit,
    round_down,
)

FAMILIES = (
    "fa",
    "sw",
    "fa+fa_eagle",
    "fa_eagle",
    "fa+sw",
    "fa+sw_eagle",
    "fa_eagle+sw",
    "sw_eagle",
    "sw+sw",
    "fa+sw+sw",
    "fa+sw_eagle+sw",
    "sw+sw_eagle",
    "fa+chunked",
    "fa+mamba",
    "fa_eagle+mamba",
    "fa+sw+mamba",
    "fa+mamba_eagle",
    "fa+fa_other_block",
    "spec_no_annotation",
    "fa+mamba_tail",
)


# --------------------------------------------------------------------------- random layouts
def _random_group(rng: random.Random, kind: str, index: int, tph: int, bpc: int) -> GroupGeometry:
    drafter = kind.endswith("_eagle")
    base = kind.removesuffix("_eagle")
    tpb = tph * rng.choice((1, 2, 3, 4))
    common = dict(index=index, tokens_per_block=tpb, blocks_per_chunk=bpc, tokens_per_hash=tph)
    if base == "sw":
        # Small windows too: the store reachability mask is only sparse when the window needs
        # fewer blocks than an alignment segment holds (R31).
        return GroupGeometry(
            kind=GroupKind.SLIDING,
            sliding_window=rng.randint(1, rng.choice((2 * tpb, 4 * tpb * bpc))),
            extra_retained_tokens=rng.choice((0, 0, 1, 3, tpb)),
            is_drafter=drafter,
            **common,
        )
    if base == "chunked":
        return GroupGeometry(
            kind=GroupKind.CHUNKED_LOCAL,
            attention_chunk_size=rng.randint(1, 3 * tpb * bpc),
            **common,
        )
    return GroupGeometry(kind=GroupKind.FULL, is_drafter=drafter, **common)


def _family_groups(
    rng: random.Random, family: str, tph: int, bpc: int, first: int
) -> list[GroupGeometry]:
    if family == "spec_no_annotation":
        family = rng.choice(("fa+sw", "fa+mamba", "fa+fa_other_block"))
    groups: list[GroupGeometry] = []
    for part in family.split("+"):
        index = first + len(groups)
        if part.startswith("mamba"):
            # Mamba blocks coarser than the attention blocks make R26 reachable.
            fa_tpb = groups[0].tokens_per_block if groups else tph
            groups.append(
                GroupGeometry(
                    index=index,
                    kind=GroupKind.MAMBA,
                    tokens_per_block=fa_tpb * rng.choice((1, 2, 4, 8)),
                    blocks_per_chunk=bpc,
                    tokens_per_hash=tph,
                    is_drafter=part.endswith("_eagle"),
                )
            )
        elif part == "fa_other_block":
            other = groups[0].tokens_per_block + tph * rng.randint(1, 3)
            groups.append(GroupGeometry(index, GroupKind.FULL, other, bpc, tph))
        else:
            groups.append(_random_group(rng, part, index, tph, bpc))
    return groups


def any_random_layout(rng: random.Random) -> tuple[Layout, str]:
    # Mamba hybrids twice as often: R26 needs a Mamba group and a finer stored prefix.
    family = rng.choice(FAMILIES + ("fa+mamba", "fa_eagle+mamba", "fa+sw+mamba"))
    tph = rng.choice((2, 4))
    bpc = rng.randint(1, 4)
    first = rng.choice((0, 0, 1))  # index 0 may be a non-offloaded group
    if family == "fa+mamba_tail":
        # The partial-tail layout (R7): one block per chunk, one block size, coarser than a hash.
        tpb = tph * rng.choice((2, 3, 4))
        groups = [
            GroupGeometry(first, GroupKind.FULL, tpb, 1, tph),
            GroupGeometry(first + 1, GroupKind.MAMBA, tpb, 1, tph),
        ]
        return Layout(tuple(groups), retention_interval=rng.choice((None, 0))), family
    groups = _family_groups(rng, family, tph, bpc, first)
    windowed_tpc = [g.tokens_per_chunk for g in groups if g.is_windowed]
    unit = math.lcm(*windowed_tpc) if windowed_tpc else 1
    retention = rng.choice((None, 0, unit * rng.randint(1, 3)))
    return Layout(tuple(groups), retention_interval=retention), family


# --------------------------------------------------------------------------- lookup cases
@dataclass
class LookupCase:
    layout: Layout
    family: str
    num_tokens: int
    local: int
    max_new: int | None
    max_load: int | None
    hashes: list[bytes]
    ready: set[bytes] = field(default_factory=set)
    pending: set[bytes] = field(default_factory=set)
    retry: set[bytes] = field(default_factory=set)
    loading: set[bytes] = field(default_factory=set)

    @property
    def speculative(self) -> bool:
        return self.family == "spec_no_annotation" or any(g.is_drafter for g in self.layout.groups)

    def keys(self) -> dict[int, list[bytes]]:
        return {g.index: chunk_keys(self.hashes, g) for g in self.layout.groups}


def vllm_lookup(case: LookupCase, *, max_new: int | None, with_loading: bool):
    manager = ScriptedManager(num_chunks=1 << 20)
    manager.seed(case.ready, case.pending)
    manager.retry_keys = set(case.retry)
    sched = build_scheduler(case.layout, manager, speculative=case.speculative)
    if with_loading:
        sched._chunks_being_loaded = set(case.loading)
    assert sched.config.supports_partial_tail == case.layout.supports_partial_tail
    params = {"max_load_tokens": case.max_load} if case.max_load is not None else None
    request = make_request(
        "req",
        num_tokens=case.num_tokens,
        num_prompt_tokens=case.num_tokens,
        block_hashes=case.hashes,
        kv_transfer_params=params,
    )
    sched.on_new_request(request)
    hit, is_async = sched.get_num_new_matched_tokens(request, case.local, max_new)
    assert is_async == bool(hit)
    return hit, sched, request, manager


def kvstrata_lookup(case: LookupCase) -> int | None:
    return kvstrata_lookup_with_tail(case)[0]


def kvstrata_lookup_with_tail(
    case: LookupCase, *, vllm_parity: bool = True
) -> tuple[int | None, int | None]:
    """(hit, partial-tail boundary) as the adapter computes them; ``vllm_parity`` searches tails
    only above every group's complete hit, as vLLM does."""

    def probe(keys):
        return [
            Presence.RETRY
            if k in case.retry
            else Presence.PENDING
            if k in case.pending
            else Presence.HIT
            if k in case.ready
            else Presence.MISS
            for k in keys
        ]

    hit = lookup_hit(
        case.layout,
        num_tokens=case.num_tokens,
        local_computed=case.local,
        keys=case.keys(),
        probe=probe,
        max_new_tokens=case.max_new,
        max_load_tokens=case.max_load,
        being_loaded=case.loading.__contains__,
    )
    return partial_tail_hit(
        case.layout,
        complete_hit=hit,
        num_prompt_tokens=case.num_tokens,
        local_computed=case.local,
        block_hashes=case.hashes,
        probe=probe,
        max_new_tokens=case.max_new,
        max_load_tokens=case.max_load,
        keys=None if vllm_parity else case.keys(),
        being_loaded=case.loading.__contains__,
    )


def vllm_mamba_aligned_cap(case: LookupCase) -> tuple[int | None, int | None, int]:
    """(vLLM's first hit, the ``max_num_new_tokens`` at which vLLM's hit is Mamba-aligned, rounds).

    Each round asks vLLM again with its boundary capped at the Mamba chunk below its last hit:
    ``max_num_new_tokens = aligned - local + 1`` makes vLLM's initial cap (minus the recomputed
    last token, rounded to the Mamba chunk) exactly ``aligned``.
    """
    # With partial tails (one block size, one block per chunk) complete hits are Mamba-aligned,
    # and a partial one ends inside the block by design: nothing to round.
    mamba_tpc = None if case.layout.supports_partial_tail else case.layout.mamba_tokens_per_chunk
    first, *_ = vllm_lookup(case, max_new=case.max_new, with_loading=False)
    hit, max_new, rounds = first, case.max_new, 0
    while hit and mamba_tpc and (case.local + hit) % mamba_tpc:
        aligned = round_down(case.local + hit, mamba_tpc)
        max_new = aligned - case.local + 1
        hit, *_ = vllm_lookup(case, max_new=max_new, with_loading=False)
        rounds += 1
    return first, max_new, rounds

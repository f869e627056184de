"""kvstrata's pure semantics against vLLM 0.32.0's own ``OffloadingConnectorScheduler``.

Seeded random traces over random group layouts. Lookup: the tokens served (and the load plan for a
hit) must equal vLLM's, except where vLLM's hit ends off an align-mode Mamba chunk boundary (R26,
E7): kvstrata then serves what vLLM serves with its cap at that boundary rounded down — never more
than vLLM's hit rounded down to the Mamba chunk — and the traces must contain such cases. Stores:
step by step through prefill, decode (with multi-token acceptance) and finish or abort, the chunks
offered, the blocks copied and the per-group scan positions must equal vLLM's.

Lookups include layouts with partial tails (R7, R30): hits that end inside a block at a boundary
every group stored, and their load plans, must equal vLLM's too.

R<n> and the worked examples (E7) are those of docs/SEMANTICS.md.
"""

from __future__ import annotations

import math
import random
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")
pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).parent))

from vllm.v1.request import RequestStatus  # noqa: E402
from vllm_offload_harness import (  # noqa: E402
    ScriptedManager,
    StoreScript,
    build_scheduler,
    fake_block,
    make_request,
)

from kvstrata.presence import Presence  # noqa: E402
from kvstrata.semantics import (  # noqa: E402
    ChunkTransfer,
    GroupGeometry,
    GroupKind,
    Layout,
    boundary_key,
    cdiv,
    chunk_keys,
    lookup_hit,
    offloadable_tokens,
    partial_tail_hit,
    plan_load,
    plan_store,
    round_down,
)

NUM_LOOKUP_CASES = 3000
NUM_STORE_TRACES = 400

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


def test_layout_geometry_matches_vllm_config() -> None:
    """Derived geometry (R3-R5, R7, R20) equals what vLLM's scheduler derives for the same groups."""
    rng = random.Random(1234)
    partial_tail_layouts = 0
    for _ in range(400):
        layout, family = any_random_layout(rng)
        sched = build_scheduler(layout, ScriptedManager(num_chunks=8), speculative=True)
        config = sched.config
        partial_tail_layouts += layout.supports_partial_tail
        assert config.supports_partial_tail == layout.supports_partial_tail, layout
        assert config.alignment_tokens == layout.alignment_tokens, layout
        assert sched._mamba_align_size == layout.mamba_tokens_per_chunk, layout
        by_position = [c.group_idx for c in config.kv_group_configs]
        assert [by_position[i] for i in sched._lookup_groups] == [
            g.index for g in layout.lookup_order
        ]
        for c, g in zip(config.kv_group_configs, layout.groups, strict=True):
            assert (c.group_idx, c.tokens_per_chunk, c.hashes_per_chunk) == (
                g.index,
                g.tokens_per_chunk,
                g.hashes_per_chunk,
            )
            assert c.sliding_window_size_in_chunks == g.window_chunks, g
            assert c.is_eagle_group == g.is_drafter and c.requires_cow_source == g.is_align_mamba
            for n in rng.sample(range(1, 400), 5):
                assert c.load_window_size_in_chunks(n) == g.load_window_chunks(n), (g, n)
    assert partial_tail_layouts > 20  # the R7 family is generated


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


def _window_runs(rng: random.Random, n: int, window: int) -> list[int]:
    """Runs of about one window separated by short gaps: the window scan's hard cases (R19)."""
    stored: list[int] = []
    i = n - 1 - rng.randint(0, 2)
    while i >= 0:
        run = max(1, window + rng.choice((-1, 0, 0, 1, 2)))
        stored += range(max(0, i - run + 1), i + 1)
        i -= run + rng.randint(1, 2)
    return stored


def _stored_subset(
    rng: random.Random, n: int, mode: str, shared_end: float, window: int | None
) -> list[int]:
    """Indices of a group's stored chunks. ``shared_end`` (a fraction of the prompt) correlates the
    groups: what an earlier, shorter request stored; ``staggered`` gives each group its own end."""
    if mode == "independent" and rng.random() < 0.5:
        # Full attention stored whole, windowed groups in window-sized runs.
        return list(range(n)) if window is None else _window_runs(rng, n, window)
    if mode == "all":
        return list(range(n))
    if mode == "shared_prefix":
        return list(range(int(n * shared_end)))
    if mode == "staggered":
        return list(range(rng.randint(0, n)))
    pattern = rng.choice(("all", "prefix", "random", "suffix", "holes", "none"))
    if pattern == "all":
        return list(range(n))
    if pattern == "prefix":
        return list(range(rng.randint(0, n)))
    if pattern == "suffix":
        return list(range(rng.randint(0, n), n))
    if pattern == "random":
        p = rng.random()
        return [i for i in range(n) if rng.random() < p]
    if pattern == "holes":
        return [i for i in range(n) if rng.random() < 0.85]
    return []


def random_lookup_case(rng: random.Random, case_id: int) -> LookupCase:
    layout, family = any_random_layout(rng)
    max_tpc = max(g.tokens_per_chunk for g in layout.groups)
    num_tokens = (
        rng.randint(1, 8 * max_tpc) if rng.random() < 0.2 else rng.randint(max_tpc, 8 * max_tpc)
    )
    if rng.random() < 0.2:  # prompts on or next to a chunk boundary
        num_tokens = max(1, max_tpc * rng.randint(1, 6) + rng.choice((-1, 0, 1)))
    tph = layout.tokens_per_hash
    hashes = [f"{case_id}:{i}".encode() for i in range(num_tokens // tph)]
    block = layout.scheduler_block_tokens
    local = 0
    if rng.random() < 0.4:
        local = block * rng.randint(0, (num_tokens - 1) // block // rng.choice((1, 2, 4)))
    case = LookupCase(
        layout=layout,
        family=family,
        num_tokens=num_tokens,
        local=local,
        max_new=rng.randint(0, num_tokens) if rng.random() < 0.15 else None,
        max_load=rng.randint(0, num_tokens) if rng.random() < 0.1 else None,
        hashes=hashes,
    )
    mode = rng.choice(("all", "shared_prefix", "staggered", "independent", "independent"))
    shared_end = rng.random()
    pending_rate = rng.choice((0.0, 0.0, 0.02, 0.1))
    for g in layout.groups:
        keys = case.keys()[g.index]
        stored = set(_stored_subset(rng, len(keys), mode, shared_end, g.window_chunks))
        for i, key in enumerate(keys):
            if i in stored:
                (case.pending if rng.random() < pending_rate else case.ready).add(key)
            elif rng.random() < pending_rate:
                case.pending.add(key)
    if layout.supports_partial_tail:
        _seed_partial_tails(rng, case, pending_rate)
    all_keys = [k for keys in case.keys().values() for k in keys]
    if all_keys and rng.random() < 0.08:
        case.retry.update(rng.sample(all_keys, k=min(len(all_keys), rng.randint(1, 2))))
    if all_keys and rng.random() < 0.08:
        case.loading.update(rng.sample(all_keys, k=min(len(all_keys), rng.randint(1, 2))))
    return case


def _seed_partial_tails(rng: random.Random, case: LookupCase, pending_rate: float) -> None:
    """Boundary keys inside blocks (R13) for a few boundaries: for every group, or all but one."""
    layout = case.layout
    tph, tpb = layout.tokens_per_hash, layout.groups[0].tokens_per_block
    inside = [b for b in range(tph, case.num_tokens, tph) if b % tpb]
    if rng.random() < 0.5:
        pending_rate = max(pending_rate, 0.2)  # tails still on their way: kvstrata waits (R30)
    if rng.random() < 0.3:
        # A kernel that exports the checkpoint inside the forward (Mamba2): a one-chunk prefill
        # hands off the state at the tail only, none at block boundaries.
        for g in layout.groups:
            if g.kind is GroupKind.MAMBA:
                case.ready.difference_update(case.keys()[g.index])
    chosen = rng.sample(inside, k=min(len(inside), rng.randint(0, 5)))
    replay = round_down(case.num_tokens - 1, tph)
    if replay in inside and rng.random() < 0.6:
        chosen.append(replay)  # what the scheduler hands off: the replay boundary
    for boundary in sorted(set(chosen)):
        missing = rng.choice([None, None, *layout.groups])
        for g in layout.groups:
            if g is missing:
                continue
            key = boundary_key(case.hashes, boundary, g)
            (case.pending if rng.random() < pending_rate else case.ready).add(key)


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


def _fake_allocation(layout: Layout, local: int, cached: int, rng: random.Random):
    """Block lists as vLLM's managers allocate them for a hit: local (hashed) blocks, nulls for
    positions a windowed group skips, fresh blocks from there to the hit's end."""
    next_id = iter(range(1, 1 << 30))
    count = max(g.index for g in layout.groups) + 1
    blocks: list[list] = [[] for _ in range(count)]
    for g in layout.groups:
        tpb = g.tokens_per_block
        num_blocks = cdiv(cached, tpb)
        fresh_from = cdiv(local, tpb)
        if g.kind is GroupKind.SLIDING:
            skipped = max(0, cached - g.sliding_window + 1 - g.extra_retained_tokens)
            fresh_from = max(fresh_from, skipped // tpb)
        elif g.kind is GroupKind.CHUNKED_LOCAL:
            fresh_from = max(
                fresh_from, cached // g.attention_chunk_size * g.attention_chunk_size // tpb
            )
        elif g.kind is GroupKind.MAMBA:
            fresh_from = max(fresh_from, num_blocks - 1)
        for i in range(num_blocks + rng.randint(0, 2)):
            if i < cdiv(local, tpb):
                blocks[g.index].append(
                    fake_block(next(next_id) if rng.random() < 0.5 else 0, hashed=True)
                )
            elif i < fresh_from:
                blocks[g.index].append(fake_block(0, hashed=False))
            else:
                blocks[g.index].append(fake_block(next(next_id), hashed=False))
    return blocks


def awaited_tail(case: LookupCase, complete_hit: int, prefix_end: int | None = None) -> bool:
    """Whether a boundary above ``complete_hit``, inside the block after ``prefix_end`` (default:
    the complete hit's end) or below, has every group's key stored, some still pending (kvstrata
    then defers, R30)."""
    layout = case.layout
    if not layout.supports_partial_tail:
        return False
    tph, tpb = layout.tokens_per_hash, layout.groups[0].tokens_per_block
    end = case.local + complete_hit
    top = min(case.num_tokens - 1, (end if prefix_end is None else prefix_end) + tpb - 1)
    for cap in (case.max_new, case.max_load):
        if cap is not None:
            top = min(top, case.local + cap)
    for b in range(round_down(top, tph), end, -tph):
        keys = [boundary_key(case.hashes, b, g) for g in layout.groups]
        present = all(k in case.ready or k in case.pending or k in case.retry for k in keys)
        if present and not all(k in case.ready and k not in case.retry for k in keys):
            return True
    return False


def _fa_prefix_end(case: LookupCase, start: int) -> int:
    """End of the full-attention groups' stored prefix from ``start`` (their chunk keys ready)."""
    end = case.num_tokens
    for g in case.layout.groups:
        if g.kind is GroupKind.FULL:
            keys = case.keys()[g.index]
            n = start // g.tokens_per_chunk
            while n < len(keys) and keys[n] in case.ready and keys[n] not in case.retry:
                n += 1
            end = min(end, n * g.tokens_per_chunk)
    return max(end, start)


def _tail_on_its_way(case: LookupCase, complete_hit: int) -> bool:
    """A boundary past ``complete_hit``, within a block of the full-attention prefix counting
    keys on their way, whose boundary keys are all stored or on their way, and some of them or of
    the prefix chunks below it are on their way."""
    layout = case.layout
    tph, tpb = layout.tokens_per_hash, layout.groups[0].tokens_per_block
    known = case.ready | case.pending | case.retry
    settled = {k for k in case.ready if k not in case.pending and k not in case.retry}
    end = case.local + complete_hit
    fa = [g for g in layout.groups if g.kind is GroupKind.FULL]

    def prefix(keys_ok: set[bytes]) -> int:
        stop = case.num_tokens
        for g in fa:
            keys, n = case.keys()[g.index], end // tpb
            while n < len(keys) and keys[n] in keys_ok:
                n += 1
            stop = min(stop, n * tpb)
        return max(stop, end)

    top = min(case.num_tokens - 1, prefix(known) + tpb - 1)
    for cap in (case.max_new, case.max_load):
        if cap is not None:
            top = min(top, case.local + cap)
    for b in range(round_down(top, tph), end, -tph):
        keys = [boundary_key(case.hashes, b, g) for g in layout.groups]
        if all(k in known for k in keys) and (
            not all(k in settled for k in keys) or b // tpb * tpb > prefix(settled)
        ):
            return True
    return False


def check_tail_beyond_complete_hit(
    case: LookupCase, vllm_hit: int | None, max_new: int | None
) -> str:
    """kvstrata's tail search past the full-attention prefix (``keys``), against vLLM's answer
    for the same case with a Mamba state stored at every block boundary below the tail: what a
    scheduler that splits the prefill there would have handed off. Returns an outcome label."""
    served, boundary = kvstrata_lookup_with_tail(case, vllm_parity=False)
    parity, _ = kvstrata_lookup_with_tail(case)
    if served == parity:
        return "tail_same"
    context = f"{case}: vLLM {vllm_hit}, parity {parity}, extended {served}"
    assert case.layout.supports_partial_tail, context
    prefix_end = _fa_prefix_end(case, case.local + (vllm_hit or 0))
    tpb = case.layout.groups[0].tokens_per_block
    added = {
        k
        for g in case.layout.groups
        if g.kind is GroupKind.MAMBA
        for k in case.keys()[g.index][: prefix_end // tpb]
    }
    augmented = LookupCase(
        **{**case.__dict__, "ready": case.ready | added, "pending": case.pending - added}
    )
    vllm_augmented, *_ = vllm_lookup(augmented, max_new=max_new, with_loading=True)
    if served is None:
        # Waiting for a boundary whose keys (or the prefix below it) are on their way, or for a
        # chunk another request loads.
        assert vllm_hit is not None, context
        assert _tail_on_its_way(case, vllm_hit) or vllm_augmented is None, context
        return "tail_deferred_beyond"
    # More than vLLM serves (or a tail where vLLM waits for lower ones still promoting), from
    # keys that are all stored, and never more than vLLM serves with those Mamba states.
    assert vllm_hit is None or served > vllm_hit, context
    end = case.local + served
    assert all(boundary_key(case.hashes, end, g) in case.ready for g in case.layout.groups), context
    assert vllm_augmented is None or served <= vllm_augmented, context
    return "tail_beyond_complete_hit"


def check_load_plan(
    case: LookupCase,
    hit: int,
    sched,
    request,
    manager,
    rng: random.Random,
    boundary: int | None = None,
) -> None:
    cached = case.local + hit
    blocks = _fake_allocation(case.layout, case.local, cached, rng)
    sched.update_state_after_alloc(request, SimpleNamespace(blocks=tuple(blocks)), hit)
    [job] = sched._current_batch_load_jobs.values()
    tail_keys = None
    if boundary is not None:
        tail_keys = {g.index: boundary_key(case.hashes, boundary, g) for g in case.layout.groups}
    transfers = plan_load(
        case.layout,
        local_computed=case.local,
        hit_tokens=hit,
        block_ids={g.index: [b.block_id for b in blocks[g.index]] for g in case.layout.groups},
        keys=case.keys(),
        tail_keys=tail_keys,
    )
    assert manager.last_load_keys == [t.key for t in transfers]
    dst = job.dst_spec
    assert dst.block_ids.tolist() == [b for t in transfers for b in t.block_ids]
    for pos, g in enumerate(case.layout.groups):
        mine = [t for t in transfers if t.group == g.index]
        assert dst.group_sizes[pos] == sum(len(t.block_ids) for t in mine)
        if mine:
            first = mine[0]
            assert (
                dst.block_indices[pos]
                == first.chunk_index * g.blocks_per_chunk + first.first_block_in_chunk
            )


def test_lookup_matches_vllm_except_mamba_rounding() -> None:
    rng = random.Random(20240601)
    outcomes: Counter[str] = Counter()
    families: Counter[str] = Counter()
    rounded_exactly = 0
    for case_id in range(NUM_LOOKUP_CASES):
        case = random_lookup_case(rng, case_id)
        families[case.family] += 1
        first, max_new, rounds = vllm_mamba_aligned_cap(case)
        expected, sched, request, manager = vllm_lookup(case, max_new=max_new, with_loading=True)
        served, boundary = kvstrata_lookup_with_tail(case)
        context = f"case {case_id}: {case}"
        if served is None and expected and awaited_tail(case, expected):
            # kvstrata waits for a boundary every group holds but some still promote (R30):
            # vLLM serves its complete hit without the tail.
            outcomes["tail_awaited"] += 1
            continue
        assert served == expected, context
        vllm_boundary = sched._req_status[request.request_id].partial_tail_boundary
        assert boundary == vllm_boundary, context
        outcomes["partial_tail"] += boundary is not None
        outcomes[check_tail_beyond_complete_hit(case, expected, max_new)] += 1
        if rounds:
            outcomes["mamba_rounded"] += 1
            mamba_tpc = case.layout.mamba_tokens_per_chunk
            assert mamba_tpc is not None and first
            vllm_rounded = round_down(case.local + first, mamba_tpc) - case.local
            # kvstrata never serves past the Mamba boundary below vLLM's hit (R26).
            assert served is None or served <= max(vllm_rounded, 0), context
            assert served is None or served == 0 or (case.local + served) % mamba_tpc == 0, context
            rounded_exactly += served == max(vllm_rounded, 0)
        outcomes["none" if served is None else "zero" if served == 0 else "hit"] += 1
        if served:
            check_load_plan(case, served, sched, request, manager, rng, boundary)
    print(
        f"lookup differential: {NUM_LOOKUP_CASES} cases, {dict(outcomes)}, rounded exactly to "
        f"vLLM's hit rounded down: {rounded_exactly}; families {dict(families)}"
    )
    # The traces must exercise every outcome, and the R26 difference must actually occur.
    assert outcomes["hit"] > NUM_LOOKUP_CASES // 4
    assert outcomes["zero"] > 50 and outcomes["none"] > 20
    assert outcomes["mamba_rounded"] >= 10 and rounded_exactly >= 5
    assert outcomes["partial_tail"] >= 20 and outcomes["tail_awaited"] >= 2
    assert outcomes["tail_beyond_complete_hit"] >= 10
    assert len(families) == len(FAMILIES)


def _pinned_case(groups, num_tokens, stored, retention=None) -> LookupCase:
    layout = Layout(tuple(groups), retention_interval=retention)
    tph = layout.tokens_per_hash
    case = LookupCase(
        layout,
        "pinned",
        num_tokens,
        0,
        None,
        None,
        [f"p:{i}".encode() for i in range(num_tokens // tph)],
    )
    for g in layout.groups:
        keys = case.keys()[g.index]
        case.ready.update(keys[i] for i in stored[g.index] if i < len(keys))
    return case


def _fa(i, tpb, drafter=False):
    return GroupGeometry(i, GroupKind.FULL, tpb, 1, min(tpb, 16), is_drafter=drafter)


def _sw4(i, drafter=False):
    return GroupGeometry(i, GroupKind.SLIDING, 4, 1, 4, sliding_window=4, is_drafter=drafter)


def _m256(i):
    return GroupGeometry(i, GroupKind.MAMBA, 256, 1, 16)


PINNED = {
    # R26: FA stored to 496 (or 320), both Mamba states: vLLM loads the state @512.
    "r26_496": ((_fa(0, 16), _m256(1)), 600, {0: range(31), 1: [0, 1]}, 496, 256),
    "r26_320": ((_fa(0, 16), _m256(1)), 600, {0: range(20), 1: [0, 1]}, 320, 256),
    # E7: a drafter pop lands under the Mamba boundary.
    "e7": ((_fa(0, 16, drafter=True), _m256(1)), 600, {0: range(32), 1: [0, 1]}, 496, 256),
    "e7_all": ((_fa(0, 16, drafter=True), _m256(1)), 600, {0: range(37), 1: [0, 1]}, 512, 512),
    # A regular group tightens after a drafter was verified: the drafter pops again (R27).
    "drafter_repop": (
        (_sw4(0, drafter=True), _sw4(1)),
        33,
        {0: [0, 1, 2, 3, 6, 7], 1: range(5)},
        12,
        12,
    ),
}


@pytest.mark.parametrize("name", sorted(PINNED))
def test_pinned_cases(name: str) -> None:
    groups, num_tokens, stored, vllm_expected, kvstrata_expected = PINNED[name]
    case = _pinned_case(groups, num_tokens, stored)
    assert vllm_lookup(case, max_new=None, with_loading=True)[0] == vllm_expected
    assert kvstrata_lookup(case) == kvstrata_expected
    first, max_new, _ = vllm_mamba_aligned_cap(case)
    assert vllm_lookup(case, max_new=max_new, with_loading=True)[0] == kvstrata_expected


# --------------------------------------------------------------------------- store traces
@dataclass
class StoreTrace:
    layout: Layout
    family: str
    prompt: int
    total: int
    hashes: list[bytes]
    offload_prompt_only: bool
    max_offload: int | None
    shared_prefix_boundary: int | None
    abort_after_step: int | None


def random_store_trace(rng: random.Random, trace_id: int) -> StoreTrace:
    layout, family = any_random_layout(rng)
    max_tpc = max(g.tokens_per_chunk for g in layout.groups)
    prompt = rng.randint(1, 5 * max_tpc)
    total = prompt + rng.randint(1, 3 * max_tpc)  # a request samples at least one token
    return StoreTrace(
        layout=layout,
        family=family,
        prompt=prompt,
        total=total,
        hashes=[f"s{trace_id}:{i}".encode() for i in range((total + 4) // layout.tokens_per_hash)],
        offload_prompt_only=rng.random() < 0.3,
        max_offload=rng.randint(0, total) if rng.random() < 0.15 else None,
        shared_prefix_boundary=rng.randint(1, prompt) if rng.random() < 0.2 else None,
        abort_after_step=rng.randint(0, 6) if rng.random() < 0.15 else None,
    )


def _new_block_ids(
    g: GroupGeometry, have: int, computed: int, until: int, ids, rng: random.Random
) -> list[int]:
    """Block ids a step allocates for positions ``have..`` up to token ``until``: null where the
    group already skips the position (as vLLM's managers allocate)."""
    target = cdiv(until, g.tokens_per_block)
    tpb = g.tokens_per_block
    if g.kind is GroupKind.SLIDING:
        skipped = max(0, computed - g.sliding_window + 1 - g.extra_retained_tokens)
    elif g.kind is GroupKind.CHUNKED_LOCAL:
        skipped = computed // g.attention_chunk_size * g.attention_chunk_size
    elif g.kind is GroupKind.MAMBA:
        skipped = max(0, (target - 1) * tpb)  # align mode keeps only the newest state block
    else:
        skipped = 0
    return [0 if (p + 1) * tpb <= skipped else next(ids) for p in range(have, target)]


def _zero_stale_leading_blocks(
    g: GroupGeometry, blocks: list[int], next_stored: int, rng: random.Random
) -> None:
    """A freed sliding-window block re-allocated to someone else is zeroed (``_update_req_states``).

    Only leading blocks of a chunk are zeroed here: kvstrata refuses chunks with a null block after
    a real one, where vLLM would copy the remaining blocks to the wrong offsets.
    """
    bpc = g.blocks_per_chunk
    complete = len(blocks) // bpc
    if complete <= next_stored or rng.random() > 0.3:
        return
    chunk = rng.randint(next_stored, complete - 1)
    for j in range(rng.randint(1, bpc)):
        blocks[chunk * bpc + j] = 0


def _answer(rng: random.Random, offered: list[bytes]):
    """What the store answers an offer: ``prepare_store`` outcomes incl. failure and partial."""
    r = rng.random()
    if r < 0.1:
        return "none"
    if r < 0.15:
        return "empty"
    if r < 0.3:
        return set(rng.sample(offered, k=rng.randint(0, len(offered))))
    return "all"


def _expected_src(layout: Layout, accepted: list[ChunkTransfer]):
    ids, sizes, indices = [], [], []
    for g in layout.groups:
        mine = [t for t in accepted if t.group == g.index]
        ids += [b for t in mine for b in t.block_ids]
        sizes.append(sum(len(t.block_ids) for t in mine))
        indices.append(
            mine[0].chunk_index * g.blocks_per_chunk + mine[0].first_block_in_chunk if mine else 0
        )
    return ids, sizes, indices


def run_store_trace(trace: StoreTrace, rng: random.Random) -> Counter[str]:
    layout = trace.layout
    script = StoreScript()
    speculative = trace.family == "spec_no_annotation" or any(g.is_drafter for g in layout.groups)
    sched = build_scheduler(
        layout, script, speculative=speculative, offload_prompt_only=trace.offload_prompt_only
    )
    params = {"max_offload_tokens": trace.max_offload} if trace.max_offload is not None else None
    request = make_request(
        "req",
        num_tokens=trace.prompt,
        num_prompt_tokens=trace.prompt,
        block_hashes=[],
        kv_transfer_params=params,
    )
    request.shared_prefix_boundary = trace.shared_prefix_boundary
    sched.on_new_request(request)
    vstate = sched._req_status["req"]
    tph = layout.tokens_per_hash
    ids = iter(range(1, 1 << 30))
    blocks = {g.index: [] for g in layout.groups}
    next_stored = {g.index: 0 for g in layout.groups}
    stats: Counter[str] = Counter()
    computed, num_tokens, step = 0, trace.prompt, 0

    def compare(scheduled: int, finished: bool, aborted: bool) -> None:
        request.block_hashes = trace.hashes[: num_tokens // tph]
        vstate.update_offload_keys()  # as _update_req_states / request_finished do (R38)
        keys = {g.index: chunk_keys(request.block_hashes, g) for g in layout.groups}
        offers_before = len(script.offers)
        offloadable = offloadable_tokens(
            num_computed=computed,
            num_scheduled=scheduled,
            num_tokens=num_tokens,
            num_prompt_tokens=trace.prompt,
            finished=finished,
            aborted=aborted,
            offload_prompt_only=trace.offload_prompt_only,
            max_offload_tokens=trace.max_offload,
        )
        candidates, advanced = plan_store(
            layout,
            offloadable=offloadable,
            num_prompt_tokens=trace.prompt,
            finished=finished,
            next_stored_chunk=next_stored,
            block_ids=blocks,
            keys=keys,
            prompt_offloadable=min(
                trace.prompt, trace.max_offload if trace.max_offload is not None else trace.prompt
            ),
            shared_prefix_boundary=trace.shared_prefix_boundary,
            keep_served_tails=False,  # vLLM's stores; kvstrata's extra tails are tested in unit tests
        )
        offered = [c.key for c in candidates]
        answer = _answer(rng, offered)
        script.answers = [answer]
        so = SimpleNamespace(
            num_scheduled_tokens={} if finished else {"req": scheduled},
            finished_req_ids={"req"} if finished else set(),
        )
        jobs = sched._build_store_jobs(so)
        vllm_offered = script.offers[offers_before] if len(script.offers) > offers_before else []
        where = f"step {step} of {trace}"
        assert vllm_offered == offered, where
        if not offered:
            answer = "all"
        if answer != "none":
            for g, n in advanced.items():
                next_stored[g] = max(next_stored[g], n)
        for pos, g in enumerate(layout.groups):
            assert vstate.group_states[pos].next_stored_chunk_idx == next_stored[g.index], where
        accepted = (
            []
            if answer in ("none", "empty")
            else [c for c in candidates if answer == "all" or c.key in answer]
        )
        if accepted:
            [job] = jobs.values()
            ids_, sizes, indices = _expected_src(layout, accepted)
            assert job.src_spec.block_ids.tolist() == ids_, where
            assert list(job.src_spec.group_sizes) == sizes, where
            for pos, size in enumerate(sizes):
                if size:
                    assert job.src_spec.block_indices[pos] == indices[pos], where
        else:
            assert not jobs, where
        stats["offers"] += bool(offered)
        stats["chunks"] += len(accepted)
        stats["drafter_held_back"] += sum(
            1
            for g in layout.groups
            if g.is_drafter and advanced[g.index] < offloadable // g.tokens_per_chunk
        )

    aborted = False
    while True:
        drafts = 0
        if computed < trace.prompt:  # chunked prefill
            scheduled = min(
                trace.prompt - computed, rng.randint(1, 3 * layout.scheduler_block_tokens)
            )
        else:  # decode: the last sampled token plus 0-3 draft tokens
            drafts = rng.randint(0, 3)
            scheduled = 1 + drafts
        request.num_computed_tokens = computed
        request.num_tokens = num_tokens
        for pos, g in enumerate(layout.groups):
            gb = blocks[g.index]
            if g.kind is GroupKind.SLIDING:
                _zero_stale_leading_blocks(g, gb, next_stored[g.index], rng)
                vstate.group_states[pos].block_ids[:] = gb
            new = _new_block_ids(g, len(gb), computed, computed + scheduled, ids, rng)
            gb.extend(new)
            vstate.group_states[pos].block_ids.extend(new)
        compare(scheduled, finished=False, aborted=False)
        step += 1
        if computed + scheduled < num_tokens:
            computed += scheduled
        else:
            # The step reached the end of the sequence: it samples a token, and in decode
            # accepts 0..drafts draft tokens (their KV was computed by this step).
            accepted = rng.randint(0, drafts)
            computed = num_tokens + accepted
            num_tokens = computed + 1
        if trace.abort_after_step is not None and step > trace.abort_after_step:
            aborted = True
            break
        if num_tokens >= trace.total:
            break  # the last sampled token stops the request; its KV is never computed
    request.status = RequestStatus.FINISHED_ABORTED if aborted else RequestStatus.FINISHED_STOPPED
    request.is_finished.return_value = True
    request.num_computed_tokens = computed
    request.num_tokens = num_tokens
    compare(0, finished=True, aborted=aborted)
    return stats


def test_store_plans_match_vllm() -> None:
    rng = random.Random(7350)
    totals: Counter[str] = Counter()
    for trace_id in range(NUM_STORE_TRACES):
        trace = random_store_trace(rng, trace_id)
        totals += run_store_trace(trace, rng)
        totals[trace.family] += 1
    print(f"store differential: {NUM_STORE_TRACES} traces, {dict(totals)}")
    assert totals["chunks"] > 1000 and totals["drafter_held_back"] > 20

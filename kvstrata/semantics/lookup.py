"""Lookup: the longest prefix beyond the local GPU hit that every group can serve (docs/SEMANTICS.md R15-R27)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from kvstrata.presence import Presence
from kvstrata.semantics.geometry import GroupGeometry, Layout, cdiv, round_down
from kvstrata.semantics.keys import boundary_key

Probe = Callable[[Sequence[bytes]], Sequence[Presence]]


def prefix_run(keys: Sequence[bytes], probe: Probe) -> int | None:
    """Leading servable chunks of a full-attention group (R18); None = ask again later.

    HIT counts; PENDING counts but defers; RETRY defers without counting and the scan goes on (a
    tier may start an async lookup for the keys behind it); MISS ends the run. All keys are probed
    in one batch: answers past the first MISS are ignored, so ``probe`` may be a *prefix probe*
    that looks nothing up (and starts no promotion) past the first key it cannot serve.
    """
    if not keys:
        return 0
    answers = _checked(probe, keys)
    # Counted with list operations: a long prompt's run is hundreds of chunks, looked up again
    # at every step its request waits.
    try:
        run = answers.index(Presence.MISS)
    except ValueError:
        run = len(answers)
    head = answers[:run]
    return None if Presence.PENDING in head or Presence.RETRY in head else run


def window_run(
    keys: Sequence[bytes], window: int, probe: Probe, initial_window: int | None = None
) -> int | None:
    """End (exclusive index into ``keys``) of the rightmost run of ``window`` servable chunks (R19).

    The scan goes right to left. The first run must be ``initial_window`` long (a boundary inside
    a chunk needs one more chunk to its left, R20); any gap resets the requirement to ``window``. A
    PENDING chunk counts toward a run but defers it, unless a gap to its left makes it useless. With
    no complete run the leading hits are served (prefix fallback). None = ask again later.

    Keys are probed right to left in batches just large enough to complete the current run, so
    keys left of the run that wins are (almost) never probed: a probe may start a disk promotion.
    """
    need = initial_window or window
    streak = 0
    defer = pending = False
    end = len(keys)
    while end > 0:
        lo = max(0, end - max(need - streak, 1))
        answers = _checked(probe, keys[lo:end])
        for idx in range(end - 1, lo - 1, -1):
            answer = answers[idx - lo]
            if answer is Presence.HIT or answer is Presence.PENDING:
                streak += 1
                pending |= answer is Presence.PENDING
            else:
                defer |= answer is Presence.RETRY
                # A gap: nothing to its right can be served, and the next run ends on a chunk
                # boundary, so it needs only the plain window.
                streak = 0
                pending = False
                need = window
            if streak == need:
                return None if defer or pending else idx + need
        end = lo
    return None if defer or pending else streak


def _checked(probe: Probe, keys: Sequence[bytes]) -> Sequence[Presence]:
    answers = probe(keys)
    if len(answers) != len(keys):
        raise ValueError(f"probe answered {len(answers)} keys for {len(keys)} asked")
    return answers


def initial_cap(
    layout: Layout,
    *,
    num_tokens: int,
    local_computed: int,
    max_new_tokens: int | None,
    max_load_tokens: int | None,
) -> int:
    """The absolute boundary a hit may reach before any group is asked (R17.1-2, R24)."""
    cap = num_tokens
    if max_new_tokens is not None:
        cap = min(cap, local_computed + max_new_tokens)
    if max_load_tokens is not None:
        cap = min(cap, local_computed + max_load_tokens)
    if layout.windowed_groups:
        # The last prompt token is always recomputed (its logits are needed), and windowed groups
        # cannot be served up to the whole prompt and then backed off by one token.
        cap -= 1
        mamba_tpc = layout.mamba_tokens_per_chunk
        if mamba_tpc is not None:
            cap = round_down(cap, mamba_tpc)
    return cap


class _Convergence:
    """vLLM's ``_lookup_complete_chunks`` loop (R17.3): groups tighten a shared boundary until stable.

    Each group in lookup order may lower ``max_hit``; a lowered boundary can invalidate what a group
    already confirmed, so the loop re-runs all groups (after a deferral) or the windowed groups
    (whose window must end at the new boundary) until nothing changes.
    """

    def __init__(
        self,
        layout: Layout,
        *,
        local_computed: int,
        keys: Mapping[int, Sequence[bytes]],
        probe: Probe,
        round_to_chunks: bool,
        probe_prefix: Probe | None = None,
    ) -> None:
        self.layout = layout
        self.local = local_computed
        self.keys = keys
        self.probe = probe
        self.probe_prefix = probe_prefix or probe
        # With a per-request load cap, vLLM rounds the boundary down to each group's chunk.
        self.round_to_chunks = round_to_chunks

    def run(self, cap: int) -> int | None:
        max_hit = cap
        num_hit = 0
        defer = False
        # Drafter groups that already dropped their volatile tail for the current boundary (R27).
        verified: set[int] = set()
        pending: tuple[GroupGeometry, ...] = self.layout.lookup_order
        while pending:
            looked_up_windowed = False
            current, pending = pending, ()
            for geom in current:
                tpc = geom.tokens_per_chunk
                keys = self.keys[geom.index]
                max_hit = min(max_hit, len(keys) * tpc)
                if self.round_to_chunks:
                    max_hit = round_down(max_hit, tpc)
                if max_hit - self.local < tpc:
                    return 0  # less than one chunk of this group is left to load
                unverified = geom.is_drafter and geom.index not in verified
                hits, start = self._group_hits(geom, keys, max_hit, unverified)
                if hits == 0:
                    return 0  # a group that can serve nothing ends the whole lookup
                if hits is None:
                    defer = True
                else:
                    if unverified:
                        hits -= 1  # drop the volatile drafter tail (R27)
                        verified.add(geom.index)
                    max_hit = min(max_hit, tpc * (start + hits))
                new_hit = max_hit - self.local
                if new_hit < tpc:
                    return 0
                if new_hit < num_hit:
                    if not geom.is_drafter:
                        # A tighter boundary from a regular group: drafters must drop a tail again.
                        verified.clear()
                    if defer:
                        defer = False
                        pending = self.layout.lookup_order
                    elif looked_up_windowed and not pending:
                        pending = self.layout.windowed_groups
                looked_up_windowed |= geom.is_windowed
                num_hit = new_hit
        return None if defer else num_hit

    def _group_hits(
        self, geom: GroupGeometry, keys: Sequence[bytes], max_hit: int, unverified: bool
    ) -> tuple[int | None, int]:
        """(servable chunks counted from ``start``, ``start``) for one group at ``max_hit``."""
        tpc = geom.tokens_per_chunk
        query_max = max_hit
        if unverified:
            # Query one chunk more than the boundary: the pop then lands on that extra chunk
            # instead of cutting below a coarser sibling's chunk (R27; issue 52735 defect 2 was
            # widening only sliding-window groups).
            query_max = min(max_hit + tpc, len(keys) * tpc)
        num_chunks = min(cdiv(query_max, tpc), len(keys))
        start = self.local // tpc
        window_keys = keys[start:num_chunks]
        window = geom.window_chunks
        if window is None:
            return prefix_run(window_keys, self.probe_prefix), start
        candidate_end = min(max_hit, (num_chunks - int(unverified)) * tpc)
        initial = geom.load_window_chunks(candidate_end)
        assert initial is not None
        extra = int(unverified)  # a drafter window needs one chunk beyond it (W + 1)
        return window_run(window_keys, window + extra, self.probe, initial + extra), start


def _hit_chunk_being_loaded(
    layout: Layout,
    keys: Mapping[int, Sequence[bytes]],
    local: int,
    end: int,
    being_loaded: Callable[[bytes], bool],
) -> bool:
    """Whether a chunk this hit would load is being loaded for another request (R17.5).

    Then the request should wait and hit the GPU prefix cache once that load lands.
    """
    for geom in layout.groups:
        tpc = geom.tokens_per_chunk
        group_keys = keys[geom.index][local // tpc : cdiv(end, tpc)]
        window = geom.load_window_chunks(end)
        if window is not None:
            group_keys = group_keys[-window:]
        if any(map(being_loaded, group_keys)):
            return True
    return False


def lookup_hit(
    layout: Layout,
    *,
    num_tokens: int,
    local_computed: int,
    keys: Mapping[int, Sequence[bytes]],
    probe: Probe,
    max_new_tokens: int | None = None,
    max_load_tokens: int | None = None,
    being_loaded: Callable[[bytes], bool] | None = None,
    align_final_to_mamba: bool = True,
    probe_prefix: Probe | None = None,
) -> int | None:
    """Tokens loadable beyond ``local_computed`` (0 = nothing), or None = ask again next step.

    ``keys[g]`` are group ``g``'s chunk keys (``chunk_keys``) for the request's current hashes.
    ``probe(keys) -> presences`` answers a batch of keys; ``probe_prefix`` (default ``probe``)
    answers a full-attention group's run, and may answer MISS for every key after the first
    MISS without looking it up (see ``prefix_run``). ``being_loaded(key)``: that chunk is being
    loaded for another request (only with GPU prefix caching on; None otherwise).

    With ``align_final_to_mamba`` (kvstrata's behaviour) a hit whose end is not on an align-mode
    Mamba chunk boundary is looked up again with the boundary rounded down to it, until it is: the
    Mamba state loaded is then exactly the state at the hit's end. vLLM 0.32.0 rounds only the
    initial cap (R26 hazard, incl. after a drafter pop, E7) and serves the state from beyond the hit.
    """
    cap = initial_cap(
        layout,
        num_tokens=num_tokens,
        local_computed=local_computed,
        max_new_tokens=max_new_tokens,
        max_load_tokens=max_load_tokens,
    )
    search = _Convergence(
        layout,
        local_computed=local_computed,
        keys=keys,
        probe=probe,
        round_to_chunks=max_load_tokens is not None,
        probe_prefix=probe_prefix,
    )
    mamba_tpc = layout.mamba_tokens_per_chunk if align_final_to_mamba else None
    while True:
        hit = search.run(cap)
        if not hit:
            return hit  # 0 or None
        end = local_computed + hit
        if mamba_tpc is None or end % mamba_tpc == 0:
            break
        # R26: a finer group stopped short of a Mamba boundary; only the state at a boundary at or
        # below the hit is usable, and every group must be re-checked at that boundary.
        cap = round_down(end, mamba_tpc)
    if being_loaded is not None and _hit_chunk_being_loaded(
        layout, keys, local_computed, local_computed + hit, being_loaded
    ):
        return None
    return worthwhile_hit(hit, num_tokens=num_tokens, local_computed=local_computed)


def worthwhile_hit(hit: int, *, num_tokens: int, local_computed: int) -> int:
    """``hit``, or 0 when it would save nothing: a hit reaching the whole request makes vLLM
    recompute its last token, so one that does not reach past ``local_computed + 1`` gains
    nothing — and a hit of a one-token prompt is rewound to 0 computed tokens, which vLLM
    takes for a new request and looks up again, forever (R21)."""
    if local_computed + hit >= num_tokens and num_tokens - 1 <= local_computed:
        return 0
    return hit


def partial_tail_hit(
    layout: Layout,
    *,
    complete_hit: int | None,
    num_prompt_tokens: int,
    local_computed: int,
    block_hashes: Sequence[bytes],
    probe: Probe,
    max_new_tokens: int | None = None,
    max_load_tokens: int | None = None,
    keys: Mapping[int, Sequence[bytes]] | None = None,
    being_loaded: Callable[[bytes], bool] | None = None,
    probe_prefix: Probe | None = None,
) -> tuple[int | None, int | None]:
    """Extend a complete-chunk hit into the next block at hash granularity (R7, R30).

    Only for layouts with ``supports_partial_tail`` (one block per chunk, one block size, an
    align-mode Mamba group whose block is coarser than a hash): there a complete-chunk hit may
    leave up to a block minus one hash of the prompt to recompute. The scheduler stores the state
    at the replay boundary (and shared-prefix junctions) under boundary keys (R13) for every group:
    the attention block holding that boundary and the Mamba state after it.

    Boundaries from ``min(num_prompt_tokens - 1, end of the block after the hit - 1)`` (and the
    caps), rounded down to a hash, down to the complete hit, are tried in turn; each needs every
    group's boundary key. Keys are probed one at a time so that a miss in one group does not start
    disk promotions of the others. Returns ``(hit, boundary)``: the hit beyond ``local_computed``
    (the complete hit if no boundary is servable) and the boundary served, if any. A hit of None
    means ask again later: when keys on their way were seen and there is no complete hit (vLLM),
    and — kvstrata only — when a boundary that every group holds is still on its way into the host
    tier. vLLM then serves the complete hit alone, so after a restart, with every key on disk, it
    would recompute the tail (up to a block) to save the wait for two promotions.

    ``keys`` (kvstrata; None reproduces vLLM): the groups' chunk keys. With them the tail may lie
    in the block after the full-attention groups' own complete prefix, even when no Mamba state
    is stored at a block boundary below it: a Mamba group needs only the state at the hit's end.
    Backends that export the checkpoint from inside the forward (vLLM's Mamba2 layers) do not
    split a one-chunk prefill, so they hand off the state at the tail alone; vLLM's lookup,
    which searches tails only above a complete hit of every group, serves such prompts nothing.
    Past the complete hit, a chunk being loaded for another request defers (as R17.5 does below).
    ``probe_prefix``: as in ``lookup_hit``, for the attention prefix past the complete hit.
    """
    if complete_hit is None or not layout.supports_partial_tail:
        return complete_hit, None
    complete_end = local_computed + complete_hit
    tph = layout.tokens_per_hash
    limit = num_prompt_tokens - 1
    if max_new_tokens is not None:
        limit = min(limit, local_computed + max_new_tokens)
    if max_load_tokens is not None:
        limit = min(limit, local_computed + max_load_tokens)
    # Where the full-attention prefix ends: stored (ready), or once the keys on their way land.
    ready_end = reachable_end = complete_end
    if keys is not None:
        ready_end, reachable_end = _attention_prefix_ends(
            layout, keys, complete_end, limit, probe_prefix or probe
        )
    tpb = layout.groups[0].tokens_per_block
    max_boundary = round_down(min(limit, reachable_end + tpb - 1), tph)
    # Past vLLM's block, Mamba states are rare (tails, junctions): ask for them all at once and
    # look at the other groups only where every Mamba group has one. A long attention prefix
    # then costs one batched probe, not one probe per hash boundary.
    beyond = range(max_boundary, complete_end + tpb - 1, -tph)
    no_state = _boundaries_without_state(layout, block_hashes, beyond, probe) if beyond else set()
    pending = awaited = False
    for boundary in range(max_boundary, complete_end, -tph):
        if boundary in no_state:
            continue
        servable, waiting, whole = _boundary_presence(layout, block_hashes, boundary, probe)
        # vLLM's rule (no complete hit: any key on its way defers) covers the block after the
        # complete hit; further up only a boundary every group holds or is getting is awaited.
        pending |= waiting and boundary < complete_end + tpb
        if not (servable or whole):
            continue
        if servable and boundary // tpb * tpb <= ready_end:
            if keys is not None and being_loaded is not None and _hit_chunk_being_loaded(
                layout, keys, complete_end, boundary // tpb * tpb, being_loaded
            ):
                return None, None  # the chunks up to the tail's block: as R17.5
            # Past the complete hit (``keys``), a block-aligned boundary is an ordinary chunk end.
            return boundary - local_computed, boundary if boundary % tpb else None
        awaited = True  # every key is there or on its way (boundary keys or the prefix below)
    if pending and complete_hit == 0 or awaited:
        return None, None
    return complete_hit, None


def _attention_prefix_ends(
    layout: Layout,
    keys: Mapping[int, Sequence[bytes]],
    complete_end: int,
    limit: int,
    probe: Probe,
) -> tuple[int, int]:
    """How far every full-attention group's prefix runs past ``complete_end`` (chunks ending at
    or below ``limit``): (stored, stored or on its way)."""
    ready = reachable = limit
    for geom in layout.groups:
        if geom.is_windowed:
            continue  # the Mamba group: it needs only the state at the boundary
        tpc = geom.tokens_per_chunk
        start = complete_end // tpc
        group_keys = keys[geom.index][start : limit // tpc]
        answers = _checked(probe, group_keys) if group_keys else []
        hits = next((i for i, a in enumerate(answers) if a is not Presence.HIT), len(answers))
        present = next((i for i, a in enumerate(answers) if a is Presence.MISS), len(answers))
        ready = min(ready, (start + hits) * tpc)
        reachable = min(reachable, (start + present) * tpc)
    return max(ready, complete_end), max(reachable, complete_end)


def _boundaries_without_state(
    layout: Layout, block_hashes: Sequence[bytes], boundaries: range, probe: Probe
) -> set[int]:
    """The boundaries where some align-mode Mamba group has no state (one probe per group)."""
    missing: set[int] = set()
    for geom in layout.groups:
        if geom.is_align_mamba:
            answers = _checked(probe, [boundary_key(block_hashes, b, geom) for b in boundaries])
            missing.update(b for b, a in zip(boundaries, answers, strict=True) if a is Presence.MISS)
    return missing


def _boundary_presence(
    layout: Layout, block_hashes: Sequence[bytes], boundary: int, probe: Probe
) -> tuple[bool, bool, bool]:
    """(every group holds its boundary key, some key seen is on its way, every group holds or
    is getting its key while some are on their way).

    The scan stops at the first group that misses; a key on its way before that still counts as
    on its way (as in vLLM: with no complete hit the lookup then defers). RETRY counts as on its
    way.
    """
    waiting = False
    for geom in layout.groups:
        [answer] = _checked(probe, [boundary_key(block_hashes, boundary, geom)])
        if answer is Presence.MISS:
            return False, waiting, False
        waiting |= answer is not Presence.HIT
    return not waiting, waiting, waiting

"""Stores: which chunks of a request to offer, and when (docs/SEMANTICS.md §3.8 D, R28-R31)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from kvstrata.semantics.geometry import GroupGeometry, GroupKind, Layout, cdiv
from kvstrata.semantics.transfers import ChunkTransfer


def offloadable_tokens(
    *,
    num_computed: int,
    num_scheduled: int,
    num_tokens: int,
    num_prompt_tokens: int,
    finished: bool,
    aborted: bool,
    offload_prompt_only: bool,
    max_offload_tokens: int | None,
) -> int:
    """Leading tokens whose KV exists once this step ran and may be offloaded (§3.8 D1-D2).

    Running: ``num_computed + num_scheduled``. Finished: ``max(num_prompt_tokens, num_tokens - 1)``
    (the final sampled token's slot is never written, so a block ending there is not stored).
    Aborted: ``num_computed``. Then capped by ``num_tokens``, ``max_offload_tokens`` and, with
    ``offload_prompt_only`` (vLLM's default), the prompt.
    """
    if aborted:
        after = num_computed
    elif finished:
        after = max(num_prompt_tokens, num_tokens - 1)
    else:
        after = num_computed + num_scheduled
    n = min(after, num_tokens)
    if max_offload_tokens is not None:
        n = min(n, max_offload_tokens)
    if offload_prompt_only:
        n = min(n, num_prompt_tokens)
    return n


def storable_chunks(
    geom: GroupGeometry,
    *,
    offloadable_tokens: int,
    num_prompt_tokens: int,
    finished: bool,
    allocated_blocks: int,
    num_keys: int,
) -> int:
    """Leading chunks of a group that are computed, allocated and keyed (R28, R29).

    A drafter group holds back its last chunk while the request decodes: the drafter KV of the last
    accepted position may still be rewritten after a rejected draft. Prefill chunks are stable (the
    drafter input of a chunk's last position is the next prompt token). Once the request finished
    nothing can rewrite the tail, so the held-back chunk becomes storable (finish-time tail
    promotion; never storing it was issue 52735 defect 3).
    """
    num = offloadable_tokens // geom.tokens_per_chunk
    decoding = offloadable_tokens > num_prompt_tokens
    if geom.is_drafter and decoding and not finished:
        num = max(0, num - 1)
    return min(num, allocated_blocks // geom.blocks_per_chunk, num_keys)


def sliding_reachable_mask(
    geom: GroupGeometry,
    *,
    start_block: int,
    end_block: int,
    alignment_tokens: int | None,
    retention_interval: int | None,
    reachable_boundaries: Sequence[int] = (),
    final_segment_end_block: int | None = None,
) -> list[bool] | None:
    """Blocks ``[start_block, end_block)`` of a sliding-window group that some hit can use (R31).

    Port of vLLM's ``SlidingWindowManager.reachable_block_mask`` with the window widened by
    ``extra_retained_tokens`` (offload restores all retained history). A hit ends on an
    ``alignment_tokens`` boundary and needs the ``need`` blocks before it (a drafter: one more,
    ending one block past the boundary). None = every block is reachable.
    """
    if alignment_tokens is None:
        return None
    block_size = geom.tokens_per_block
    if alignment_tokens % block_size:
        return None  # a sub-block alignment is not representable: keep everything
    assert geom.sliding_window is not None
    window = geom.sliding_window + geom.extra_retained_tokens
    need = cdiv(window - 1, block_size) + int(geom.is_drafter)
    shift = int(geom.is_drafter)
    mask = [False] * (end_block - start_block)

    segment_tokens = alignment_tokens if retention_interval is None else retention_interval or None
    if segment_tokens is not None:
        per_segment = segment_tokens // block_size
        if need >= per_segment:
            return None
        for i in range(start_block, end_block):
            if i >= shift and (i - shift) % per_segment >= per_segment - need:
                mask[i - start_block] = True
        if final_segment_end_block is not None and not geom.is_drafter:
            # The request's last, incomplete segment: its own tail is a reachable boundary too.
            final_size = final_segment_end_block % per_segment
            if final_size:
                tail_start = max(
                    final_segment_end_block - final_size, final_segment_end_block - need
                )
                for i in range(
                    max(start_block, tail_start), min(end_block, final_segment_end_block)
                ):
                    mask[i - start_block] = True

    if retention_interval is not None:
        # The replay boundary and shared-prefix junctions: keep the tail ending on each.
        for boundary in reachable_boundaries:
            end = boundary // alignment_tokens * alignment_tokens // block_size + shift
            for j in range(max(start_block, end - need), min(end_block, end)):
                mask[j - start_block] = True
    return mask


def mamba_reachable_mask(
    geom: GroupGeometry,
    *,
    start_block: int,
    end_block: int,
    alignment_tokens: int | None,
    retention_interval: int | None,
    reachable_boundaries: Sequence[int] = (),
) -> list[bool] | None:
    """Port of vLLM's ``MambaManager.reachable_block_mask`` (used for non-align Mamba stores)."""
    if retention_interval is None or alignment_tokens is None:
        return None
    block_size = geom.tokens_per_block
    mask = [False] * (end_block - start_block)
    if retention_interval:
        per_segment = retention_interval // block_size
        if per_segment <= 1:
            return None
        first = (start_block + per_segment) // per_segment * per_segment - 1
        for i in range(first - start_block, len(mask), per_segment):
            mask[i] = True
    for boundary in reachable_boundaries:
        block = boundary // alignment_tokens * alignment_tokens // block_size - 1
        if start_block <= block < end_block:
            mask[block - start_block] = True
    return mask


def _reachable_mask(
    layout: Layout,
    geom: GroupGeometry,
    start_chunk: int,
    end_chunk: int,
    final_segment_end_chunk: int | None,
    boundaries: Sequence[int],
) -> list[bool] | None:
    bpc = layout.blocks_per_chunk
    if geom.kind is GroupKind.SLIDING:
        return sliding_reachable_mask(
            geom,
            start_block=start_chunk * bpc,
            end_block=end_chunk * bpc,
            alignment_tokens=layout.alignment_tokens,
            retention_interval=layout.retention_interval,
            reachable_boundaries=boundaries,
            final_segment_end_block=(
                None if final_segment_end_chunk is None else final_segment_end_chunk * bpc
            ),
        )
    if geom.kind is GroupKind.MAMBA:
        return mamba_reachable_mask(
            geom,
            start_block=start_chunk * bpc,
            end_block=end_chunk * bpc,
            alignment_tokens=layout.alignment_tokens,
            retention_interval=layout.retention_interval,
            reachable_boundaries=boundaries,
        )
    return None  # full attention, chunked local: every chunk can serve a hit


def _final_sliding_alignment_blocks(layout: Layout, geom: GroupGeometry) -> int | None:
    """Blocks per alignment segment for the final-tail rule (non-drafter sliding groups only)."""
    align = layout.alignment_tokens
    if align is None or geom.is_drafter or geom.kind is not GroupKind.SLIDING:
        return None
    if align % geom.tokens_per_block:
        return None
    return align // geom.tokens_per_block


def _chunk_reachable(mask: list[bool] | None, chunk_offset: int, bpc: int) -> bool:
    """A chunk is worth storing if any of its blocks can serve a hit."""
    return mask is None or any(mask[chunk_offset * bpc : (chunk_offset + 1) * bpc])


def _store_transfer(
    geom: GroupGeometry, chunk: int, key: bytes, blocks: Sequence[int]
) -> ChunkTransfer | None:
    """The chunk's stored blocks: its real blocks after any leading skipped (null) positions.

    vLLM tests only the chunk's last block for null. kvstrata also refuses a chunk with a null
    block after a real one (a stale, re-allocated sliding-window block): its blocks could not be
    placed at their offsets.
    """
    bpc = geom.blocks_per_chunk
    ids = blocks[chunk * bpc : (chunk + 1) * bpc]
    if not ids or ids[-1] == 0:
        return None
    first = 0
    while ids[first] == 0:
        first += 1
    if 0 in ids[first:]:
        return None
    return ChunkTransfer(geom.index, chunk, key, tuple(ids[first:]), first)


def _store_horizon(
    layout: Layout, geom: GroupGeometry, num_chunks: int, prompt_chunks: int, finished: bool
) -> int | None:
    """End of the request's final segment, whose tail a later hit may use (R31 final segment).

    The prompt horizon while prefilling, all storable chunks once finished; none during active
    decode (a decode frontier is no final boundary), with a retention interval, or for drafters.
    """
    if layout.retention_interval is not None or geom.is_drafter:
        return None
    if finished:
        return num_chunks
    if num_chunks <= prompt_chunks:
        return prompt_chunks
    return None


def _group_candidates(
    layout: Layout,
    geom: GroupGeometry,
    *,
    num_chunks: int,
    next_stored: int,
    prompt_chunks: int,
    finished: bool,
    blocks: Sequence[int],
    keys: Sequence[bytes],
    boundaries: Sequence[int],
) -> list[ChunkTransfer]:
    """Chunks of one group to offer, for a request whose storable chunks are ``[0, num_chunks)``."""
    bpc = layout.blocks_per_chunk
    start = next_stored
    horizon = _store_horizon(layout, geom, num_chunks, prompt_chunks, finished)
    final_align = _final_sliding_alignment_blocks(layout, geom)
    # On finish (dense retention), the last partial segment may have ended past the prompt
    # horizon: rewind the scan to that segment so its real tail gets stored now.
    reconsider = (
        finished
        and num_chunks != prompt_chunks
        and layout.retention_interval is None
        and final_align is not None
    )
    if reconsider:
        assert final_align is not None
        horizon_blocks = num_chunks * bpc
        start = min(start, (horizon_blocks - horizon_blocks % final_align) // bpc)
    if num_chunks <= start:
        return []
    mask = _reachable_mask(layout, geom, start, num_chunks, horizon, boundaries)
    prompt_mask = (
        _reachable_mask(layout, geom, start, num_chunks, prompt_chunks, boundaries)
        if reconsider
        else None
    )
    out = []
    for offset, chunk in enumerate(range(start, num_chunks)):
        if reconsider and chunk < next_stored and _chunk_reachable(prompt_mask, offset, bpc):
            continue  # already considered under the prompt horizon
        if not _chunk_reachable(mask, offset, bpc):
            continue
        transfer = _store_transfer(geom, chunk, keys[chunk], blocks)
        if transfer is not None:
            out.append(transfer)
    return out


def served_boundaries(layout: Layout, boundaries: Sequence[int]) -> tuple[int, ...]:
    """Where hits searched from ``boundaries`` end: one drafter chunk lower (R27 pop), and rounded
    down to the align-mode Mamba chunk (R24/R26). Boundaries not already in ``boundaries``."""
    found = set(boundaries)
    lowered = list(boundaries)
    for geom in layout.groups:
        if geom.is_drafter:
            lowered += [b - geom.tokens_per_chunk for b in boundaries]
    mamba = layout.mamba_tokens_per_chunk
    if mamba:
        lowered += [b // mamba * mamba for b in lowered]
    out = []
    for b in lowered:
        if b > 0 and b not in found:
            found.add(b)
            out.append(b)
    return tuple(out)


def store_pending(
    layout: Layout, *, offloadable: int, finished: bool, next_stored_chunk: Mapping[int, int]
) -> bool:
    """Whether ``plan_store`` could offer or advance anything this step; False only where it
    would return no candidates and every group's ``next_stored_chunk`` unchanged.

    The adapter asks this first for every scheduled request at every step (most steps of a
    request store nothing: a decode step, a prefill that has not filled a chunk): a running
    request is due once some group's offloadable chunks pass its scan position; a finished one
    always is (finish-time promotion and the final segment's rewind, R29/R31).
    """
    if finished:
        return True
    return any(
        offloadable // geom.tokens_per_chunk > next_stored_chunk.get(geom.index, 0)
        for geom in layout.groups
    )


def plan_store(
    layout: Layout,
    *,
    offloadable: int,
    num_prompt_tokens: int,
    finished: bool,
    next_stored_chunk: Mapping[int, int],
    block_ids: Mapping[int, Sequence[int]],
    keys: Mapping[int, Sequence[bytes]],
    prompt_offloadable: int | None = None,
    shared_prefix_boundary: int | None = None,
    keep_served_tails: bool = True,
) -> tuple[list[ChunkTransfer], dict[int, int]]:
    """Chunks to offer for storing this step, and each group's next chunk to consider (§3.8 D).

    ``offloadable``: ``offloadable_tokens(...)`` for this step. ``prompt_offloadable``: the same
    for the prompt alone (``offloadable_tokens`` with ``num_computed=num_prompt_tokens``, not
    finished), default ``num_prompt_tokens``. ``next_stored_chunk[g]``: the adapter's per-group scan
    position (0 for a new request, ``chunks_covered`` after a load). ``block_ids[g]``: the request's
    block ids of group ``g`` so far (0 = null: skipped or stale). ``shared_prefix_boundary``:
    vLLM's ``Request.shared_prefix_boundary`` (a reuse point, R31).

    Candidates are ordered group by group (layout order), chunk by chunk; offer them all to the
    store at once. Unless that offer fails for lack of space (then retry later: keep the old scan
    positions), set each group's position to ``max(old, returned)`` — also when nothing was
    offered or accepted. Align-mode Mamba groups contribute no candidates (R25).

    ``keep_served_tails`` (kvstrata; False reproduces vLLM 0.32.0): under a sparse retention
    interval vLLM keeps a sliding window's tail only where a replay's hit *starts* its search (the
    replay boundary), but a drafter group's pop ends the hit one drafter chunk lower, and an
    align-mode Mamba group rounds it down to the Mamba chunk: there no window tail was kept, and
    the replay is served nothing. kvstrata also keeps the tails ending where such hits end.
    """
    if prompt_offloadable is None:
        prompt_offloadable = num_prompt_tokens
    boundaries: tuple[int, ...] = ()
    if layout.retention_interval is not None:
        boundaries = (num_prompt_tokens - 1,)
        if shared_prefix_boundary:
            boundaries += (shared_prefix_boundary,)
        if keep_served_tails:
            boundaries += served_boundaries(layout, boundaries)
    candidates: list[ChunkTransfer] = []
    advanced: dict[int, int] = {}
    for geom in layout.groups:
        blocks = block_ids[geom.index]
        group_keys = keys[geom.index]
        num_chunks = storable_chunks(
            geom,
            offloadable_tokens=offloadable,
            num_prompt_tokens=num_prompt_tokens,
            finished=finished,
            allocated_blocks=len(blocks),
            num_keys=len(group_keys),
        )
        next_stored = next_stored_chunk.get(geom.index, 0)
        advanced[geom.index] = max(next_stored, num_chunks)
        if geom.is_align_mamba:
            continue
        candidates += _group_candidates(
            layout,
            geom,
            num_chunks=num_chunks,
            next_stored=next_stored,
            prompt_chunks=prompt_offloadable // geom.tokens_per_chunk,
            finished=finished,
            blocks=blocks,
            keys=group_keys,
            boundaries=boundaries,
        )
    return candidates, advanced


def plan_store_within(
    layout: Layout,
    room: int,
    *,
    offloadable: int,
    num_prompt_tokens: int,
    next_stored_chunk: Mapping[int, int],
    block_ids: Mapping[int, Sequence[int]],
    keys: Mapping[int, Sequence[bytes]],
    prompt_offloadable: int | None = None,
    shared_prefix_boundary: int | None = None,
    keep_served_tails: bool = True,
) -> tuple[list[ChunkTransfer], dict[int, int]]:
    """What ``room`` candidates hold of this step's store plan, when the whole offer found no
    room (§3.8 D5): each group's plan as if only its first ``cut`` tokens had been computed
    (what an earlier step of the running request offers), the rest offered again from the
    returned scan positions, as after any store.

    Windowed groups (sliding window, chunked local, Mamba) come first, whole: their blocks leave
    the request's table as it runs on, while a full-attention group's stay until it finishes.
    The full-attention groups then take the largest cut, a multiple of their smallest chunk,
    that the rest of the room holds. Where the windowed groups' plan alone is more than the
    room, every group takes one cut. The plan is the running request's even for a finished one
    (its finish-time extras, R29 and the final segment's tail, need the whole offer).
    ``([], {})`` when not even the first cut fits, or no cut offers anything.
    """
    if room <= 0:
        return [], {}

    def plan(cut: int) -> tuple[list[ChunkTransfer], dict[int, int]]:
        return plan_store(
            layout, offloadable=cut, num_prompt_tokens=num_prompt_tokens, finished=False,
            next_stored_chunk=next_stored_chunk, block_ids=block_ids, keys=keys,
            prompt_offloadable=prompt_offloadable, shared_prefix_boundary=shared_prefix_boundary,
            keep_served_tails=keep_served_tails,
        )  # fmt: skip

    storing = [g for g in layout.groups if not g.is_align_mamba]
    full = {g.index for g in storing if not g.is_windowed}
    windowed_first: tuple[list[ChunkTransfer], dict[int, int]] = ([], {})
    if full and len(full) < len(storing):
        whole, advanced = plan(offloadable)
        windowed = [t for t in whole if t.group not in full]
        if len(windowed) <= room:
            windowed_first = (windowed, {g: n for g, n in advanced.items() if g not in full})
    kept, kept_advanced = windowed_first
    cut_groups = [g for g in storing if g.index in full] if windowed_first[1] else storing
    candidates, advanced = _longest_cut(plan, room - len(kept), offloadable, cut_groups)
    if not kept and not candidates:
        return [], {}
    order = {g.index: i for i, g in enumerate(layout.groups)}
    merged = sorted(kept + candidates, key=lambda t: (order[t.group], t.chunk_index))
    return merged, {**advanced, **kept_advanced}


def _longest_cut(
    plan: Callable[[int], tuple[list[ChunkTransfer], dict[int, int]]],
    room: int,
    offloadable: int,
    groups: Sequence[GroupGeometry],
) -> tuple[list[ChunkTransfer], dict[int, int]]:
    """``groups``' candidates and scan positions for the largest cut whose candidates number at
    most ``room`` and offer something (``([], {})`` if none)."""
    if room <= 0 or not groups:
        return [], {}
    indices = {g.index for g in groups}
    grain = min(g.tokens_per_chunk for g in groups)
    best: tuple[list[ChunkTransfer], dict[int, int]] = ([], {})
    # Binary search over cuts: the candidates grow with the cut (a drafter's held-back chunk
    # can make them shrink by one where decoding starts, which at worst picks a shorter cut).
    lo, hi = 1, offloadable // grain
    while lo <= hi:
        mid = (lo + hi) // 2
        whole, advanced = plan(mid * grain)
        candidates = [t for t in whole if t.group in indices]
        if len(candidates) <= room:
            if candidates:
                best = (candidates, {g: n for g, n in advanced.items() if g in indices})
            lo = mid + 1
        else:
            hi = mid - 1
    return best

"""What moves between GPU blocks and chunks: loads (docs/SEMANTICS.md R22, R35), Mamba boundary and partial-tail
stores (§3.8 B, C)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvstrata.semantics.geometry import GroupGeometry, Layout, cdiv
from kvstrata.semantics.keys import boundary_key


@dataclass(frozen=True)
class ChunkTransfer:
    """One chunk of one group and the GPU blocks it is copied from (store) or into (load).

    ``block_ids`` are the chunk's blocks ``first_block_in_chunk, first_block_in_chunk + 1, ...``
    (never the null block 0): a chunk is entered at an offset when its first blocks are already
    local (loads) or were skipped sliding-window positions (stores); a load that ends inside a chunk
    covers only the leading blocks the hit reaches.
    """

    group: int
    chunk_index: int
    key: bytes
    block_ids: tuple[int, ...]
    first_block_in_chunk: int

    def __post_init__(self) -> None:
        if not self.block_ids or 0 in self.block_ids:
            raise ValueError(
                f"chunk {self.chunk_index} of group {self.group}: bad blocks {self.block_ids}"
            )


def chunks_covered(layout: Layout, tokens: int) -> dict[int, int]:
    """Per group, chunks that a prefix of ``tokens`` tokens touches (``cdiv(tokens, tpc)``).

    After a load of ``tokens`` cached tokens these chunks need not be stored again (R35,
    CHUNK_LEVEL policy): the adapter sets its ``next_stored_chunk`` to this.
    """
    return {g.index: cdiv(tokens, g.tokens_per_chunk) for g in layout.groups}


def first_fresh_block(block_ids: Sequence[int], local_computed: int, geom: GroupGeometry) -> int:
    """Where a group's load region starts: the first non-null block at/after the local hit (R35).

    Sparse groups (sliding window, Mamba) may hold blocks below the local boundary and null blocks
    for positions they skip; neither is a load destination. ``len(block_ids)`` when there is none.
    """
    for i in range(cdiv(local_computed, geom.tokens_per_block), len(block_ids)):
        if block_ids[i] != 0:
            return i
    return len(block_ids)


def plan_load(
    layout: Layout,
    *,
    local_computed: int,
    hit_tokens: int,
    block_ids: Mapping[int, Sequence[int]],
    keys: Mapping[int, Sequence[bytes]],
    load_start_block: Mapping[int, int] | None = None,
    tail_keys: Mapping[int, bytes] | None = None,
) -> list[ChunkTransfer]:
    """Chunks to load for a hit of ``hit_tokens`` beyond ``local_computed`` (R22, R35).

    ``block_ids[g]``: the request's GPU block ids of group ``g`` after allocation (0 = null block),
    at least ``cdiv(local_computed + hit_tokens, tokens_per_block)`` of them. ``load_start_block[g]``
    optionally overrides where the group's fresh blocks start (the adapter may know better, e.g.
    from block hashes); by default ``first_fresh_block``. Every block from the load start up to the
    hit's end must be a real block. Result: group order of ``layout.groups``, then chunk order.

    ``tail_keys[g]``: for a hit ending at a partial-tail boundary (``partial_tail_hit``), group
    ``g``'s boundary key, which replaces the key of the chunk holding the boundary (R35).
    """
    if local_computed < 0 or hit_tokens <= 0:
        raise ValueError(f"nothing to load: local {local_computed}, hit {hit_tokens}")
    cached = local_computed + hit_tokens
    transfers: list[ChunkTransfer] = []
    for geom in layout.groups:
        blocks = block_ids[geom.index]
        num_blocks = cdiv(cached, geom.tokens_per_block)
        if len(blocks) < num_blocks:
            raise ValueError(
                f"group {geom.index}: {len(blocks)} blocks allocated, a hit to {cached} tokens needs {num_blocks}"
            )
        if load_start_block is not None and geom.index in load_start_block:
            start = load_start_block[geom.index]
        else:
            start = first_fresh_block(blocks[:num_blocks], local_computed, geom)
        group_keys = list(keys[geom.index])
        if tail_keys is not None:
            if cached % geom.tokens_per_chunk == 0:
                raise ValueError(f"a partial-tail load ends on a chunk boundary ({cached})")
            tail_chunk = cached // geom.tokens_per_chunk
            group_keys = [*group_keys[:tail_chunk], tail_keys[geom.index]]
        transfers.extend(_group_load(geom, blocks, group_keys, start, num_blocks))
    return transfers


def _group_load(
    geom: GroupGeometry, blocks: Sequence[int], keys: Sequence[bytes], start: int, stop: int
) -> list[ChunkTransfer]:
    bpc = geom.blocks_per_chunk
    out: list[ChunkTransfer] = []
    if start >= stop:
        return out  # every block up to the hit's end is local or skipped
    for chunk in range(start // bpc, cdiv(stop, bpc)):
        lo, hi = max(chunk * bpc, start), min((chunk + 1) * bpc, stop)
        ids = tuple(blocks[lo:hi])
        if 0 in ids:
            raise ValueError(
                f"group {geom.index}: null block inside the load region {start}..{stop}"
            )
        out.append(ChunkTransfer(geom.index, chunk, keys[chunk], ids, lo - chunk * bpc))
    return out


def plan_boundary_stores(
    layout: Layout,
    offers: Sequence[tuple[int, int, int]],
    *,
    offloadable: int,
    block_hashes: Sequence[bytes],
) -> list[ChunkTransfer]:
    """One single-block store per usable hand-off ``(group, block_id, boundary_tokens)`` (§3.8 B).

    The scheduler offers the exact block holding each align-mode Mamba state it commits to the GPU
    prefix cache (``boundary_state_offloads``); that is the only valid source of a Mamba state (R25).
    An offer is usable when its group is offloaded, its block is real, its boundary is a chunk
    boundary of that group and within ``offloadable`` (= ``offloadable_tokens`` with
    ``num_computed=num_tokens, num_scheduled=0``, not finished). The state is keyed by the boundary
    key (R13) and sits in the chunk's block ``boundary / tokens_per_block - 1``.
    """
    by_index = {g.index: g for g in layout.groups}
    out = []
    for group, block_id, boundary in offers:
        geom = by_index.get(group)
        if geom is None or block_id == 0 or boundary <= 0:
            continue
        if boundary > offloadable or boundary % geom.tokens_per_chunk:
            continue
        block = boundary // geom.tokens_per_block - 1
        out.append(
            ChunkTransfer(
                group=group,
                chunk_index=boundary // geom.tokens_per_chunk - 1,
                key=boundary_key(block_hashes, boundary, geom),
                block_ids=(block_id,),
                first_block_in_chunk=block % geom.blocks_per_chunk,
            )
        )
    return out


def plan_partial_tail_stores(
    layout: Layout,
    offers: Sequence[tuple[int, int, int]],
    *,
    block_ids: Mapping[int, Sequence[int]],
    block_hashes: Sequence[bytes],
    max_boundary: int,
) -> list[list[ChunkTransfer]]:
    """Partial-tail stores from one request's hand-offs (§3.8 C, R7 layouts only).

    The scheduler hands off an align-mode Mamba state at a boundary inside a block (the replay
    boundary or a shared-prefix junction) as ``(group, cow_block_id, boundary)``. Every group is
    then stored at that boundary under its boundary key (R13): the Mamba groups from the offered
    copy-on-write block, the other groups from the request's block holding the boundary, whose
    leading positions are the tokens before it. One list of transfers per boundary, to be offered
    to the store together (a boundary is servable only when every group has it).

    Skipped: block-aligned offers (``plan_boundary_stores`` takes those), boundaries off the hash
    grid or past ``max_boundary`` (the prompt, or the request's ``max_offload_tokens``), a Mamba
    group without an offer, a group whose block is not allocated yet or is null.
    """
    if not layout.supports_partial_tail:
        return []
    tpb = layout.groups[0].tokens_per_block
    by_boundary: dict[int, dict[int, int]] = {}
    for group, block_id, boundary in offers:
        if boundary % tpb:
            by_boundary.setdefault(boundary, {})[group] = block_id
    out = []
    for boundary, cow_blocks in sorted(by_boundary.items()):
        if boundary <= 0 or boundary % layout.tokens_per_hash or boundary > max_boundary:
            continue
        block = boundary // tpb
        transfers = []
        for geom in layout.groups:
            if geom.is_align_mamba:
                block_id = cow_blocks.get(geom.index, 0)
            else:
                ids = block_ids.get(geom.index, ())
                block_id = ids[block] if block < len(ids) else 0
            if block_id == 0:
                break
            key = boundary_key(block_hashes, boundary, geom)
            transfers.append(ChunkTransfer(geom.index, block, key, (block_id,), 0))
        else:
            out.append(transfers)
    return out

"""Chunk keys: the vLLM block hash that ends a chunk, plus the group index (docs/SEMANTICS.md R12, R13)."""

from __future__ import annotations

from collections.abc import Sequence

from kvstrata.semantics.geometry import GroupGeometry


def make_key(block_hash: bytes, group_index: int) -> bytes:
    """vLLM's ``make_offload_key``: hash bytes + 4-byte big-endian group index."""
    return bytes(block_hash) + group_index.to_bytes(4, "big", signed=False)


def chunk_keys(block_hashes: Sequence[bytes], geom: GroupGeometry, start: int = 0) -> list[bytes]:
    """Keys of the complete chunks ``start, start+1, ...`` that ``block_hashes`` already cover (R12).

    Chunk ``i`` is keyed by ``block_hashes[(i + 1) * hashes_per_chunk - 1]``; because block hashes
    chain, that key fingerprints the whole prefix ``[0, (i + 1) * tokens_per_chunk)``. Call it again
    with ``start=len(keys)`` as hashes appear to extend a request's key list.
    """
    hpc = geom.hashes_per_chunk
    return [
        make_key(block_hashes[i], geom.index)
        for i in range((start + 1) * hpc - 1, len(block_hashes), hpc)
    ]


def boundary_key(block_hashes: Sequence[bytes], boundary_tokens: int, geom: GroupGeometry) -> bytes:
    """Key of the state after ``boundary_tokens`` tokens (Mamba hand-offs, partial tails; R13).

    For a chunk-aligned boundary it equals that chunk's ordinary key.
    """
    tph = geom.tokens_per_hash
    if boundary_tokens <= 0 or boundary_tokens % tph:
        raise ValueError(f"boundary {boundary_tokens} is not a positive multiple of {tph} tokens")
    return make_key(block_hashes[boundary_tokens // tph - 1], geom.index)

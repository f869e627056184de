"""Per-group chunk geometry and the layout of all offloaded groups (docs/SEMANTICS.md §3.1, R1-R8)."""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ``a``."""
    return -(-a // b)


def round_down(a: int, b: int) -> int:
    return a // b * b


class GroupKind(enum.Enum):
    """What a KV cache group's layers need to resume from a prefix."""

    FULL = "full"  # every token of the prefix (prefix lookup, R18)
    SLIDING = "sliding"  # the last ``sliding_window`` tokens (window lookup, R19)
    CHUNKED_LOCAL = "chunked_local"  # the current attention chunk
    MAMBA = "mamba"  # one recurrent state at the boundary (window of one chunk, R24)


@dataclass(frozen=True)
class GroupGeometry:
    """One offloaded KV cache group: how its blocks form chunks and what a hit needs.

    ``index`` is vLLM's group index (position in ``kv_cache_groups``); it is part of every chunk key.
    ``is_drafter`` is vLLM's ``is_eagle_group`` as resolved by the adapter (``resolve_drafter_flags``,
    R6): speculative decoding on but no group annotated -> no drafter group at all.
    ``mamba_align`` (MAMBA only): vLLM's ``mamba_cache_mode == "align"``. Align-mode states are stored
    only from the scheduler's boundary hand-offs (R25) and the hit is rounded to their chunk (R24).
    """

    index: int
    kind: GroupKind
    tokens_per_block: int
    blocks_per_chunk: int
    tokens_per_hash: int
    sliding_window: int | None = None
    extra_retained_tokens: int = 0
    attention_chunk_size: int | None = None
    is_drafter: bool = False
    mamba_align: bool = True

    def __post_init__(self) -> None:
        if self.index < 0:
            raise ValueError(f"group index must be >= 0, got {self.index}")
        for name in ("tokens_per_block", "blocks_per_chunk", "tokens_per_hash"):
            if getattr(self, name) <= 0:
                raise ValueError(f"group {self.index}: {name} must be > 0")
        if self.tokens_per_block % self.tokens_per_hash:
            raise ValueError(
                f"group {self.index}: block size {self.tokens_per_block} is not a multiple of "
                f"the hash block size {self.tokens_per_hash}"
            )
        if self.kind is GroupKind.SLIDING and not (self.sliding_window and self.sliding_window > 0):
            raise ValueError(f"group {self.index}: a sliding-window group needs sliding_window > 0")
        if self.kind is GroupKind.CHUNKED_LOCAL and not (
            self.attention_chunk_size and self.attention_chunk_size > 0
        ):
            raise ValueError(
                f"group {self.index}: a chunked-local group needs attention_chunk_size > 0"
            )
        if self.extra_retained_tokens < 0:
            raise ValueError(f"group {self.index}: extra_retained_tokens must be >= 0")

    @property
    def tokens_per_chunk(self) -> int:
        return self.tokens_per_block * self.blocks_per_chunk

    @property
    def hashes_per_chunk(self) -> int:
        return self.tokens_per_chunk // self.tokens_per_hash

    @property
    def is_windowed(self) -> bool:
        """Served from the right of the hit (R19) rather than as a prefix (R18)."""
        return self.kind is not GroupKind.FULL

    @property
    def is_align_mamba(self) -> bool:
        """Align-mode Mamba: states come only from boundary hand-offs (vLLM ``requires_cow_source``)."""
        return self.kind is GroupKind.MAMBA and self.mamba_align

    @property
    def window_chunks(self) -> int | None:
        """Consecutive chunks a hit needs, ending at the boundary (R3). None = full attention."""
        tpc = self.tokens_per_chunk
        if self.kind is GroupKind.SLIDING:
            assert self.sliding_window is not None
            return max(
                cdiv(self.sliding_window, tpc),
                cdiv(self.sliding_window - 1 + self.extra_retained_tokens, tpc),
            )
        if self.kind is GroupKind.CHUNKED_LOCAL:
            assert self.attention_chunk_size is not None
            return cdiv(self.attention_chunk_size, tpc)
        if self.kind is GroupKind.MAMBA:
            return 1
        return None

    def load_window_chunks(self, num_tokens: int) -> int | None:
        """Chunks a load ending at ``num_tokens`` must cover (R20).

        A sliding-window hit may end inside a chunk; the blocks the window then needs can reach one
        chunk further left than ``window_chunks`` counts from a chunk-aligned end.
        """
        window = self.window_chunks
        if self.kind is GroupKind.SLIDING:
            assert window is not None and self.sliding_window is not None
            right_padding = -num_tokens % self.tokens_per_chunk
            window = max(
                window,
                cdiv(
                    self.sliding_window - 1 + self.extra_retained_tokens + right_padding,
                    self.tokens_per_chunk,
                ),
            )
        return window


def resolve_drafter_flags(annotated: Sequence[bool], *, speculative: bool) -> tuple[bool, ...]:
    """Which groups are drafter groups, from vLLM's ``is_eagle_group`` annotations (R6).

    Exactly the annotated groups, and none without speculative decoding. In particular, speculative
    decoding on with no annotated group (shared-group MTP models) means *no* drafter group: marking
    every group as a drafter (vLLM's former fallback, issue 52735 defect 1) pops a chunk off groups
    whose servable window is a single chunk and zeroes the whole hit.
    """
    if not speculative:
        return tuple(False for _ in annotated)
    return tuple(bool(a) for a in annotated)


@dataclass(frozen=True)
class Layout:
    """All offloaded groups of a model plus the GPU cache's retention policy.

    ``retention_interval`` is ``cache_config.prefix_cache_retention_interval``: None = dense
    (a sliding-window tail at every alignment boundary), 0 = only the replay and shared-prefix
    boundaries (vLLM's default), > 0 = one tail per interval plus those boundaries (R8, R31).
    """

    groups: tuple[GroupGeometry, ...]
    retention_interval: int | None = 0

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError("a layout needs at least one offloaded group")
        indices = [g.index for g in self.groups]
        if len(set(indices)) != len(indices):
            raise ValueError(f"duplicate group indices: {indices}")
        if len({g.blocks_per_chunk for g in self.groups}) != 1:
            raise ValueError("blocks_per_chunk is global: every group must use the same value")
        if len({g.tokens_per_hash for g in self.groups}) != 1:
            raise ValueError("tokens_per_hash is global: every group must use the same value")
        mamba = {g.tokens_per_chunk for g in self.groups if g.is_align_mamba}
        if len(mamba) > 1:
            raise ValueError(
                f"align-mode Mamba groups disagree on their chunk size: {sorted(mamba)}"
            )
        if self.retention_interval is not None:
            if self.retention_interval < 0:
                raise ValueError("retention_interval must be non-negative")
            for g in self.groups:
                if g.is_windowed and self.retention_interval % g.tokens_per_chunk:
                    raise ValueError(
                        f"retention_interval {self.retention_interval} must be a multiple of "
                        f"group {g.index}'s chunk ({g.tokens_per_chunk} tokens)"
                    )

    @property
    def blocks_per_chunk(self) -> int:
        return self.groups[0].blocks_per_chunk

    @property
    def tokens_per_hash(self) -> int:
        return self.groups[0].tokens_per_hash

    def group(self, index: int) -> GroupGeometry:
        """The group with vLLM group index ``index``."""
        for g in self.groups:
            if g.index == index:
                return g
        raise KeyError(index)

    @cached_property
    def lookup_order(self) -> tuple[GroupGeometry, ...]:
        """Full-attention groups in config order, then windowed groups by window, largest first (R3).

        The sort is stable, so windowed groups of equal window keep config order, as in vLLM.
        """
        full = [g for g in self.groups if not g.is_windowed]
        windowed = sorted(
            (g for g in self.groups if g.is_windowed),
            key=lambda g: g.window_chunks or 0,
            reverse=True,
        )
        return (*full, *windowed)

    @cached_property
    def windowed_groups(self) -> tuple[GroupGeometry, ...]:
        return tuple(g for g in self.lookup_order if g.is_windowed)

    @cached_property
    def alignment_tokens(self) -> int | None:
        """The boundary granularity that store reachability assumes (R4).

        The full-attention chunk if all full-attention groups agree on it, None if they disagree,
        and the largest chunk of any group when there is no full-attention group.
        """
        full = {g.tokens_per_chunk for g in self.groups if not g.is_windowed}
        if len(full) == 1:
            return next(iter(full))
        if not full:
            return max(g.tokens_per_chunk for g in self.groups)
        return None

    @cached_property
    def mamba_tokens_per_chunk(self) -> int | None:
        """The chunk of the align-mode Mamba group(s), to which hits are rounded (R5, R24)."""
        for g in self.groups:
            if g.is_align_mamba:
                return g.tokens_per_chunk
        return None

    @cached_property
    def supports_partial_tail(self) -> bool:
        """Whether hits may end inside a block, at hash granularity (R7, DCP 1 assumed).

        One block per chunk, one block size, an align-mode Mamba group whose block is coarser than
        a hash, no windowed group but Mamba, no drafter: one boundary then names every group's
        state (``partial_tail_hit``, ``plan_partial_tail_stores``).
        """
        return (
            self.blocks_per_chunk == 1
            and len({g.tokens_per_block for g in self.groups}) == 1
            and any(
                g.is_align_mamba and g.tokens_per_block > g.tokens_per_hash for g in self.groups
            )
            and all(not g.is_windowed or g.is_align_mamba for g in self.groups)
            and not any(g.is_drafter for g in self.groups)
        )

    @cached_property
    def serves_prompt_tails(self) -> bool:
        """Whether the prompt's last partial chunk is stored and served (``prompt_tail``).

        Every group full attention or sliding window, with one chunk size, no drafter: an
        attention page holds each position's KV independently, so a partially filled block is a
        valid prefix of itself. A sliding-window group extended from the last chunk boundary to
        the prompt's end needs the window before the end, which lies inside the window the
        complete hit already required plus the tail block. Mamba groups (a state, not a page per
        position) and drafter KV at the last positions (R27) are excluded.
        """
        return (
            all(
                g.kind in (GroupKind.FULL, GroupKind.SLIDING) and not g.is_drafter
                for g in self.groups
            )
            and len({g.tokens_per_chunk for g in self.groups}) == 1
        )

    @cached_property
    def scheduler_block_tokens(self) -> int:
        """vLLM's scheduler block: the lcm of the group block sizes (docs/SEMANTICS.md §2.3)."""
        return math.lcm(*(g.tokens_per_block for g in self.groups))

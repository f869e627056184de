"""Helpers of the tests of kvstrata's pure store/lookup semantics (tests/unit/test_semantics_*.py):
group builders, block hashes and chunk keys, ``serve`` (a lookup over stored chunks), key probes,
the layouts of docs/SEMANTICS.md §3's worked examples E1 and E3, and ``run_request`` (one request's
stores into a ``MemoryStore``, looked up again by ``served_after``).

Baseline "E": 16-token blocks, 2 blocks per chunk (32-token chunks), 16-token hashes.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence

from kvstrata.presence import Presence
from kvstrata.semantics import (
    GroupGeometry,
    GroupKind,
    Layout,
    cdiv,
    chunk_keys,
    lookup_hit,
    offloadable_tokens,
    plan_boundary_stores,
    plan_store,
    plan_store_within,
)

HIT, MISS, PENDING, RETRY = Presence.HIT, Presence.MISS, Presence.PENDING, Presence.RETRY


def fa(index: int = 0, tpb: int = 16, bpc: int = 2, tph: int = 16, drafter: bool = False):
    return GroupGeometry(index, GroupKind.FULL, tpb, bpc, tph, is_drafter=drafter)


def sw(index, window, tpb=16, bpc=2, tph=16, extra=0, drafter=False):
    return GroupGeometry(
        index, GroupKind.SLIDING, tpb, bpc, tph, sliding_window=window,
        extra_retained_tokens=extra, is_drafter=drafter,
    )  # fmt: skip


def mamba(index, tpb, bpc=1, tph=16, drafter=False):
    return GroupGeometry(index, GroupKind.MAMBA, tpb, bpc, tph, is_drafter=drafter)


def hashes(num_tokens: int, tph: int, tag: str = "") -> list[bytes]:
    return [f"{tag}h{i}".encode() for i in range(num_tokens // tph)]


def keys_of(layout: Layout, block_hashes: Sequence[bytes]) -> dict[int, list[bytes]]:
    return {g.index: chunk_keys(block_hashes, g) for g in layout.groups}


def serve(
    layout: Layout,
    num_tokens: int,
    stored: Mapping[int, Iterable[int]] | None = None,
    *,
    local: int = 0,
    pending: Mapping[int, Iterable[int]] = {},  # noqa: B006
    hashed_tokens: int | None = None,
    **kwargs,
) -> int | None:
    """Tokens served for a prompt of ``num_tokens`` when group g holds chunks ``stored[g]``
    (None = every complete chunk of every group). ``hashed_tokens``: tokens with block hashes
    (default ``num_tokens``; more = keys beyond the prompt, as vLLM's unit tests set up)."""
    keys = keys_of(layout, hashes(hashed_tokens or num_tokens, layout.tokens_per_hash))
    answers: dict[bytes, Presence] = {}
    for g, ks in keys.items():
        chosen = range(len(ks)) if stored is None else stored.get(g, ())
        answers.update((ks[i], HIT) for i in chosen if i < len(ks))
        answers.update((ks[i], PENDING) for i in pending.get(g, ()) if i < len(ks))
    return lookup_hit(
        layout,
        num_tokens=num_tokens,
        local_computed=local,
        keys=keys,
        probe=lambda batch: [answers.get(k, MISS) for k in batch],
        **kwargs,
    )


def probe_of(answers: Sequence[Presence], calls: list | None = None):
    """A probe over keys ``b"0", b"1", ...`` answering ``answers[i]`` for key i."""

    def probe(batch):
        if calls is not None:
            calls.append(list(batch))
        return [answers[int(k)] for k in batch]

    return probe


def idx_keys(n: int) -> list[bytes]:
    return [str(i).encode() for i in range(n)]


# Baseline "E" and the layouts of the worked examples E1 and E3; "T4": 4-token blocks and hashes,
# one block per chunk.
E = dict(tpb=16, bpc=2, tph=16)
E1 = Layout((fa(0, **E),))
E3 = Layout((fa(0, **E), sw(1, 64, **E)), retention_interval=None)
T4 = dict(tpb=4, bpc=1, tph=4)


def mamba_hybrid(fa_drafter: bool = False, mamba_drafter: bool = False) -> Layout:
    """FA 4-token blocks + Mamba-align 16 (the 52735 reproduction's shape)."""
    return Layout(
        (
            fa(0, tpb=4, bpc=1, tph=4, drafter=fa_drafter),
            mamba(1, 16, bpc=1, tph=4, drafter=mamba_drafter),
        )
    )


class MemoryStore:
    """The smallest tier: a set of stored keys."""

    def __init__(self) -> None:
        self.keys: set[bytes] = set()

    def probe(self, batch):
        return [HIT if k in self.keys else MISS for k in batch]


def run_request(
    layout: Layout,
    store: MemoryStore,
    prompt: int,
    *,
    decode: int = 0,
    prefill_step: int | None = None,
    offload_prompt_only: bool = True,
    tag: str = "",
    keep_served_tails: bool = True,
    room: int | None = None,
) -> list[list[tuple[int, int]]]:
    """Prefill (in steps), decode one token per step, finish; store what ``plan_store`` offers and
    the Mamba states the scheduler would hand off (every Mamba chunk boundary computed so far).
    ``room``: a host tier with room for that many chunks a step before the finish: an offer of
    more stores ``plan_store_within``'s start of it, as the adapter does (§3.8 D5).
    Returns the (group, chunk) stored per step."""
    total = prompt + decode + 1  # the last sampled token is never computed
    hs = hashes(total, layout.tokens_per_hash, tag)
    ids = itertools.count(1)
    blocks: dict[int, list[int]] = {g.index: [] for g in layout.groups}
    next_stored = {g.index: 0 for g in layout.groups}
    steps: list[list[tuple[int, int]]] = []
    computed, num_tokens = 0, prompt

    def step(scheduled: int, finished: bool) -> None:
        visible = hs[: num_tokens // layout.tokens_per_hash]
        for g in layout.groups:
            blocks[g.index] += [
                next(ids)
                for _ in range(len(blocks[g.index]), cdiv(computed + scheduled, g.tokens_per_block))
            ]
        offloadable = offloadable_tokens(
            num_computed=computed, num_scheduled=scheduled, num_tokens=num_tokens,
            num_prompt_tokens=prompt, finished=finished, aborted=False,
            offload_prompt_only=offload_prompt_only, max_offload_tokens=None,
        )  # fmt: skip
        plan = {
            "num_prompt_tokens": prompt, "next_stored_chunk": dict(next_stored), "block_ids": blocks,
            "keys": keys_of(layout, visible), "keep_served_tails": keep_served_tails,
        }  # fmt: skip
        candidates, advanced = plan_store(layout, offloadable=offloadable, finished=finished, **plan)
        if room is not None and not finished and len(candidates) > room:
            candidates, advanced = plan_store_within(layout, room, offloadable=offloadable, **plan)
            assert len(candidates) <= room
        limit = offloadable_tokens(
            num_computed=num_tokens, num_scheduled=0, num_tokens=num_tokens,
            num_prompt_tokens=prompt, finished=False, aborted=False,
            offload_prompt_only=offload_prompt_only, max_offload_tokens=None,
        )  # fmt: skip
        offers = [
            (g.index, blocks[g.index][b // g.tokens_per_block - 1], b)
            for g in layout.groups
            if g.is_align_mamba
            for b in range(g.tokens_per_chunk, computed + scheduled + 1, g.tokens_per_chunk)
        ]
        candidates += plan_boundary_stores(layout, offers, offloadable=limit, block_hashes=visible)
        stored = [(c.group, c.chunk_index) for c in candidates if c.key not in store.keys]
        store.keys.update(c.key for c in candidates)
        next_stored.update({g: max(next_stored[g], n) for g, n in advanced.items()})
        steps.append(stored)

    while computed < prompt:
        scheduled = min(prompt - computed, prefill_step or prompt)
        step(scheduled, False)
        computed += scheduled
    num_tokens += 1
    for _ in range(decode):
        step(1, False)
        computed += 1
        num_tokens += 1
    step(0, True)
    return steps


def served_after(layout: Layout, store: MemoryStore, num_tokens: int, tag: str = "") -> int | None:
    keys = keys_of(layout, hashes(num_tokens, layout.tokens_per_hash, tag))
    return lookup_hit(layout, num_tokens=num_tokens, local_computed=0, keys=keys, probe=store.probe)

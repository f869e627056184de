"""Where a block's page lives: in vLLM's KV tensors (device side) and in a transfer (chunk side).

vLLM hands ``register_kv_caches`` one tensor per layer, all views of one int8 allocation
(``[B, H, N, C]``, possibly strided by the layout; Mamba layers int8 ``[B, 1, 1, page]``); layers of
different groups alias the same bytes, so a block id is only meaningful with its own group's
layers. Pages are treated as opaque bytes. Nothing here depends on the device type.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

NULL_BLOCK = 0


class Transfer(NamedTuple):
    """One chunk's part of a job: ``block_ids[i]`` <-> position ``first_block + i`` of the chunk
    in host slot ``slot``. Block id 0 (the null block) is skipped."""

    group: int
    slot: int
    first_block: int
    block_ids: Sequence[int]


@dataclass
class LayerPages:
    """Per-block byte rows of one layer: ``rows[b]`` is block ``b``'s page.

    ``dense``: ``rows`` is an int8 ``[num_blocks, page]`` view (the page is one contiguous run of
    bytes, in physical order). Otherwise (layouts with the block dim inside a page, e.g. LHBNC)
    ``rows`` is int8 ``[num_blocks, *inner]`` and a page is its logical bytes.
    """

    rows: torch.Tensor
    page: int
    dense: bool

    @property
    def inner(self) -> tuple[int, ...]:
        return tuple(self.rows.shape[1:])


def kv_device(kv_caches: Mapping[str, torch.Tensor]) -> torch.device:
    """The device of vLLM's KV tensors (all views of one allocation, so one device)."""
    if not kv_caches:
        raise ValueError("no KV cache tensors")
    return next(iter(kv_caches.values())).device


def layer_pages(t: torch.Tensor, num_blocks: int, name: str) -> LayerPages:
    """Byte rows of one layer's KV tensor; raises ValueError for a shape the stager cannot use."""
    if t.dim() < 2:
        raise ValueError(f"KV tensor {name} has shape {tuple(t.shape)}; expected [B, ...]")
    if t.shape[0] != num_blocks:
        if t.shape[0] % num_blocks:
            raise ValueError(
                f"KV tensor {name} has {t.shape[0]} blocks, not a multiple of {num_blocks}"
            )
        t = t.unflatten(0, (num_blocks, -1))  # kernel blocks -> manager blocks (a pure view)
    if t.stride(-1) != 1:
        raise ValueError(f"KV tensor {name}: last dim must have stride 1 (strides {t.stride()})")
    b = t.view(torch.int8)  # strides now in bytes
    page = int(np.prod(b.shape[1:]))
    # Dense when the non-block dims, ordered by stride, tile the page with no gap: then a page is
    # one byte run and can move with one copy (or one per run of adjacent blocks).
    dims = sorted((d for d in range(1, b.dim()) if b.shape[d] > 1), key=b.stride, reverse=True)
    expect, dense = 1, True
    for d in reversed(dims):
        if b.stride(d) != expect:
            dense = False
            break
        expect *= b.shape[d]
    if dense:
        rows = b.as_strided((num_blocks, page), (b.stride(0), 1), b.storage_offset())
        return LayerPages(rows, page, True)
    return LayerPages(b, page, False)


def group_pages(
    g: int,
    names: Sequence[str],
    kv_caches: Mapping[str, torch.Tensor],
    num_blocks: int,
    group_page_bytes: Sequence[int] | None,
) -> tuple[list[LayerPages], int]:
    """Group ``g``'s layers and their common page size; ValueError if it cannot be staged."""
    if not names:
        raise ValueError(f"group {g} has no layers")
    missing = [n for n in names if n not in kv_caches]
    if missing:
        raise ValueError(f"group {g}: no KV tensor for layers {missing}")
    layers = [layer_pages(kv_caches[n], num_blocks, n) for n in names]
    pages = {layer.page for layer in layers}
    if len(pages) != 1:
        raise ValueError(f"group {g} mixes page sizes {sorted(pages)}")
    page = pages.pop()
    if group_page_bytes is not None and group_page_bytes[g] != page:
        raise ValueError(
            f"group {g}: KV tensors hold {page}-byte pages, expected {group_page_bytes[g]}"
        )
    return layers, page


def block_runs(
    first: int, block_ids: Sequence[int]
) -> tuple[list[tuple[int, list[int]]], list[int]]:
    """Split a transfer into runs of consecutive chunk positions holding real blocks.

    Returns ``([(position of the run's first block, block ids)], [positions of null blocks])``.
    """
    runs: list[tuple[int, list[int]]] = []
    nulls: list[int] = []
    current: list[int] | None = None
    for i, bid in enumerate(block_ids):
        bid = int(bid)
        if bid == NULL_BLOCK:
            nulls.append(first + i)
            current = None
        elif current is None:
            current = [bid]
            runs.append((first + i, current))
        else:
            current.append(bid)
    return runs, nulls

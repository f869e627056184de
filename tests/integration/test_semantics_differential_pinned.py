"""Pinned lookups where kvstrata deliberately differs from vLLM 0.32.0's own
``OffloadingConnectorScheduler`` (R26, E7, R27 of docs/SEMANTICS.md): vLLM's hit, kvstrata's, and
vLLM's own hit with its cap at the Mamba boundary, which must equal kvstrata's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).parent))

from semantics_differential_helpers import (  # noqa: E402
    LookupCase,
    kvstrata_lookup,
    vllm_lookup,
    vllm_mamba_aligned_cap,
)

from kvstrata.semantics import (  # noqa: E402
    GroupGeometry,
    GroupKind,
    Layout,
)


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

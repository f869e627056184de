"""kvstrata's layout geometry against vLLM 0.32.0's own ``OffloadingConnectorScheduler``: over
seeded random group layouts the derived geometry (R3-R5, R7, R20 of docs/SEMANTICS.md) must equal
what vLLM's scheduler derives for the same groups."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).parent))

from semantics_differential_helpers import (  # noqa: E402
    any_random_layout,
)
from vllm_offload_harness import (  # noqa: E402
    ScriptedManager,
    build_scheduler,
)


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

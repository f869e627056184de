"""KV cache events (--kv-events-config) under vLLM 0.32.0's real Scheduler, on CPU: what enters and
leaves kvstrata's host tier and disk, named as vLLM names its blocks, self-describing or not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from connector_scheduler_helpers import (
    PARTIAL_TAIL,
    assert_host_tier_released,
    token_prompt,
)
from kv_event_payloads import described_blocks
from strata_harness import G, Runner

pytestmark = pytest.mark.integration


# ---- KV cache events (--kv-events-config) ----------------------------------------------------------
def _events(r: Runner, kind: str, medium: str) -> list[Any]:
    return [e for batch in r.published for e in batch.events
            if type(e).__name__ == kind and e.medium == medium]


def _one_more_step(r: Runner) -> None:
    """A step whose output the scheduler sees (under async scheduling, one more to drain)."""
    r.step()
    r.run_until_idle()


def _hashes(events: list[Any]) -> set[Any]:
    return {h for e in events for h in e.block_hashes}


def test_kv_cache_events_name_the_blocks_vllm_names(runners, tmp_path: Path) -> None:
    """With KV cache events on, what enters kvstrata's host tier (medium CPU) and its disk
    (STORAGE) is published with the block hashes vLLM's own GPU events carry for the same
    blocks, so a router can tell which engine holds a prefix in which tier; evictions from the
    host tier are published too. A restarted engine announces what it promotes from disk."""
    store = tmp_path / "persist"
    prompt = token_prompt(96)  # six whole blocks
    r = runners([G("full", 16)], store=store, kv_events=True)
    r.serve(prompt, 1)
    assert_host_tier_released(r)  # write-behind done
    _one_more_step(r)  # an (empty) step publishes what the disk tier reported meanwhile
    gpu = _hashes(_events(r, "BlockStored", "GPU"))
    assert len(gpu) == 6
    assert _hashes(_events(r, "BlockStored", "CPU")) == gpu
    assert _hashes(_events(r, "BlockStored", "STORAGE")) == gpu
    assert all(e.group_idx == 0 for e in _events(r, "BlockStored", "CPU"))
    r.connector.reset_cache()  # the host tier empties: every chunk removed from CPU
    _one_more_step(r)
    assert _hashes(_events(r, "BlockRemoved", "CPU")) == gpu
    r.close()

    again = runners([G("full", 16)], store=store, kv_events=True)
    assert again.serve(prompt, 1) == 96
    assert _hashes(_events(again, "BlockStored", "CPU")) == gpu  # promoted from disk


def _gpu_blocks(r: Runner, group: int | None = None) -> dict[Any, Any]:
    """vLLM's own GPU ``BlockStored`` payloads, by block hash: (parent, token ids, block size)."""
    return described_blocks(_events(r, "BlockStored", "GPU"), group)


def test_self_describing_kv_events_carry_each_chunks_blocks_and_tokens(runners, tmp_path: Path) -> None:
    """``self_describing_kv_events``: every chunk (two blocks here) entering the host tier (CPU)
    or the disk (STORAGE) is published with the hashes, parents, token ids and block size vLLM's
    own GPU events give its blocks; removals name every block hash of the chunk; and a restarted
    engine describes what it promotes from disk, learnt from the lookup that asked for it."""
    store = tmp_path / "persist"
    prompt = token_prompt(96)  # six blocks, three chunks
    extra = {"self_describing_kv_events": True, "blocks_per_chunk": 2}
    r = runners([G("full", 16)], store=store, kv_events=True, extra=extra)
    r.serve(prompt, 1)
    assert_host_tier_released(r)
    _one_more_step(r)
    gpu = _gpu_blocks(r)
    assert len(gpu) == 6
    cpu_events = _events(r, "BlockStored", "CPU")
    assert len(cpu_events) == 3 and all(len(e.block_hashes) == 2 for e in cpu_events)
    assert described_blocks(cpu_events) == gpu
    assert described_blocks(_events(r, "BlockStored", "STORAGE")) == gpu
    assert {e.kv_cache_spec_kind for e in cpu_events} == {"full_attention"}
    r.connector.reset_cache()  # the host tier empties
    _one_more_step(r)
    assert _hashes(_events(r, "BlockRemoved", "CPU")) == set(gpu)
    r.close()

    again = runners([G("full", 16)], store=store, kv_events=True, extra=extra)
    assert again.serve(prompt, 1) == 96
    assert described_blocks(_events(again, "BlockStored", "CPU")) == gpu  # promoted, described
    again.connector.reset_cache()
    _one_more_step(again)
    assert _hashes(_events(again, "BlockRemoved", "CPU")) == set(gpu)
    # Still on disk, so still described: the disk's own removals (as its eviction makes them)
    # name every block hash of each chunk.
    disk = next(t for t in again.connector.scheduler.hierarchy.tiers if t.tier_name == "disk")
    assert disk.delete_many([key for key, _ in disk.iter_index()]) == 3
    _one_more_step(again)
    assert _hashes(_events(again, "BlockRemoved", "STORAGE")) == set(gpu)


def test_self_describing_kv_events_keep_the_placeholder_for_windowed_groups(runners) -> None:
    """A sliding-window group's chunks keep vLLM's placeholder payload (no token ids) while the
    full-attention group's chunks of the same prompt are described."""
    extra = {"self_describing_kv_events": True}
    r = runners([G("full", 16), G("sw", 16, window=32)], kv_events=True, extra=extra)
    r.serve(token_prompt(96), 1)
    assert_host_tier_released(r)
    _one_more_step(r)
    cpu = _events(r, "BlockStored", "CPU")
    full = [e for e in cpu if e.group_idx == 0]
    windowed = [e for e in cpu if e.group_idx == 1]
    assert full and windowed
    assert all(e.token_ids and e.block_size == 16 for e in full)
    assert all(e.token_ids == [] and e.block_size == 0 for e in windowed)


def test_self_describing_kv_events_with_hashes_finer_than_blocks(runners) -> None:
    """A Mamba-align hybrid hashed every 4 tokens (``prefix_match_unit``): the full-attention
    chunks are described with vLLM's block-level hashes and tokens, exactly as its GPU events
    give them; the Mamba states and the partial tails at the replay boundary (28) keep the
    placeholder."""
    r = runners(PARTIAL_TAIL, prefix_match_unit=4, kv_events=True,
                extra={"self_describing_kv_events": True})
    r.serve(token_prompt(30), 1)
    assert_host_tier_released(r)
    _one_more_step(r)
    cpu = _events(r, "BlockStored", "CPU")
    described = [e for e in cpu if e.token_ids]
    # vLLM's GPU events also name the cached 4-token pieces past the last whole block.
    gpu_full = {h: p for h, p in _gpu_blocks(r, group=0).items() if p[2] == 16}
    assert len(gpu_full) == 1  # one whole 16-token block of the 30-token prompt
    assert described_blocks(described) == gpu_full
    assert all(e.group_idx == 0 for e in described)
    placeholders = [e for e in cpu if not e.token_ids]
    assert {e.group_idx for e in placeholders} == {0, 1}  # partial tails of both, Mamba states


def test_no_kv_cache_events_unless_the_engine_asks(runners) -> None:
    r = runners([G("full", 16)])
    r.serve(token_prompt(96), 1)
    assert r.connector.take_events() == []
    assert not any(e.medium in ("CPU", "STORAGE") for batch in r.published for e in batch.events)

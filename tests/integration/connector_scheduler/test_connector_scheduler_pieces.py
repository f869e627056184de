"""Hits larger than the host tier's room, loaded in pieces through it (connector/pieces.py) under
vLLM 0.32.0's real Scheduler, on CPU: every loaded page byte-checked; a piece that fails, a chunk
that leaves the store, an abort and a cache reset each end the load as a failed one (recomputed,
never served wrong), with nothing left pinned."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from connector_scheduler_helpers import (
    assert_host_tier_released,
    slow_disk_reads,
    token_prompt,
)
from strata_harness import G, Runner
from vllm.v1.request import Request

pytestmark = pytest.mark.integration

LAYOUTS = {"full": [G("full", 16)], "full+sw": [G("full", 16), G("sw", 16, window=32)]}


def _served_after_restart(runners, store: Path, groups: list[G], prompt: list[int], tp: int = 1,
                          free: int | None = None, **extra) -> tuple[Runner, list[bytes]]:
    """A restarted engine over ``store``; with ``free``, every host slot but ``free`` is held
    by stores in flight (returned: release them with ``complete_store``)."""
    r = runners(groups, store=store, tp=tp, extra={"host_room_wait_s": 0.0, **extra})
    pinned: list[bytes] = []
    if free is not None:
        pinned = [os.urandom(28) + bytes(4) for _ in range(r.connector.scheduler.plan.num_slots - free)]
        assert r.connector.scheduler.hierarchy.prepare_store(pinned) is not None
    return r, pinned


def _stored(runners, tmp_path: Path, groups: list[G], prompts: list[list[int]], tp: int = 1) -> Path:
    store = tmp_path / "persist"
    first = runners(groups, store=store, tp=tp)
    for prompt in prompts:
        first.serve(prompt, 1)
    first.close()
    return store


def _loading_in_pieces(runners, tmp_path: Path, monkeypatch, prompt: list[int],
                       max_tokens: int) -> tuple[Runner, list[bytes], Request]:
    """A restarted engine with two host slots free, its disk reads slowed, one step into the
    request for ``prompt`` (six chunks on disk): its load has begun in pieces."""
    groups = LAYOUTS["full"]
    store = _stored(runners, tmp_path, groups, [prompt])
    r, pinned = _served_after_restart(runners, store, groups, prompt, free=2)
    slow_disk_reads(monkeypatch, 0.03)
    req = r.add(prompt, max_tokens)
    r.step()
    assert req.request_id in r.connector.scheduler._pieced  # the load began in pieces
    return r, pinned, req


def _finish(r: Runner, *reqs) -> None:
    steps = 0
    while not all(req.is_finished() for req in reqs):
        r.step()
        steps += 1
        assert steps < 100_000, "a request was never served"  # a hang guard
    r.run_until_idle()


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_hit_larger_than_the_host_tier_s_room_is_loaded_whole_in_pieces(
        runners, tmp_path: Path, layout: str, tp: int) -> None:
    """Three host slots free, a restarted engine's 200-token prompt on disk (12 chunks and a
    prompt tail, twice as many with the window group): the request is served exactly what an
    engine with room is served, every page byte-checked, in pieces of at most three chunks;
    the load's pins all let go. Watched failing before loads came in pieces (48 tokens)."""
    groups = LAYOUTS[layout]
    prompt = token_prompt(200)
    store = _stored(runners, tmp_path, groups, [prompt], tp)
    tight, pinned = _served_after_restart(runners, store, groups, prompt, tp, free=3)
    req = tight.add(prompt, 1)
    _finish(tight, req)
    assert tight.load_errors == []
    served = tight.loaded_tokens[req.request_id]
    data = tight.stats.data
    assert data["pieced_loads"] == 1 and data["load_pieces"] >= 3, data
    assert data["hit_tokens_disk"] == served and data["load_failures"] == 0
    tight.connector.scheduler.hierarchy.complete_store(pinned, success=False)
    assert_host_tier_released(tight)  # the load's pins all let go
    tight.close()
    roomy, _ = _served_after_restart(runners, store, groups, prompt, tp)
    assert roomy.serve(prompt, 1) == served >= 192
    assert roomy.stats.data["pieced_loads"] == 0 and roomy.load_errors == []


@pytest.mark.parametrize("slow_reads", [False, True], ids=["reads", "slow-reads"])
def test_two_loads_in_pieces_share_the_room(runners, tmp_path: Path, monkeypatch, slow_reads: bool) -> None:
    """Two restarted requests, each six chunks on disk, and three host slots free: both are
    served whole (the older load takes the room first; neither waits on the other for ever).
    With disk reads slowed, the second load waits steps for room while the first one's last
    piece lands: a load in flight, so not a wait to give up on (``host_room_wait_s`` is 0
    here). Watched failing when only pieces before the last counted: the second load given
    up, 48 tokens served."""
    groups = LAYOUTS["full"]
    prompts = [token_prompt(96, seed=1), token_prompt(96, seed=2)]
    store = _stored(runners, tmp_path, groups, prompts)
    r, pinned = _served_after_restart(runners, store, groups, prompts[0], free=3)
    if slow_reads:
        slow_disk_reads(monkeypatch, 0.03)
    reqs = [r.add(p, 1) for p in prompts]
    _finish(r, *reqs)
    assert [r.loaded_tokens[q.request_id] for q in reqs] == [96, 96]
    assert r.load_errors == [] and r.stats.data["pieced_loads"] == 2
    r.connector.scheduler.hierarchy.complete_store(pinned, success=False)
    assert_host_tier_released(r)


def test_room_freed_goes_to_a_load_in_pieces_before_a_store(runners, tmp_path: Path) -> None:
    """Three host slots free: one restarted request loads six chunks in pieces while another
    computes a new 200-token prompt, whose stores want those slots at every step. The slots a
    piece gives back go to the next piece first (the store takes what is left, cut to it), so
    the load is never left waiting with no load in flight (``host_room_wait_s`` is 0 here):
    served whole, none given up, and the new prompt is stored too once the load is done.
    Watched failing with the stores first: the load given up, 48 tokens served."""
    groups = LAYOUTS["full"]
    loading = token_prompt(96, seed=1)
    store = _stored(runners, tmp_path, groups, [loading])
    r, pinned = _served_after_restart(runners, store, groups, loading, free=3)
    storing = token_prompt(200, seed=2)
    writer = r.add(storing, 40)
    reader = r.add(loading, 1)
    _finish(r, writer, reader)
    assert r.load_errors == []
    data = r.stats.data
    assert r.loaded_tokens[reader.request_id] == 96
    assert data["pieced_loads"] == 1 and data["pieced_loads_given_up"] == 0, data
    assert data["stores_cut"] >= 1, data
    r.connector.scheduler.hierarchy.complete_store(pinned, success=False)
    assert_host_tier_released(r)


def test_a_new_request_s_lookup_leaves_a_load_in_pieces_its_room(runners, tmp_path: Path, monkeypatch) -> None:
    """Three host slots free: one restarted request's six chunks load in pieces; a second
    request for six other chunks on disk arrives meanwhile. Its lookup runs before the load's
    next piece in each step, and would promote into the slots each piece gives back and hold
    them while it waits for room for the rest (``host_room_wait_s``), leaving the load waiting
    with nothing in flight: with many such lookups the loads were given up (26 of 36 in the
    tight-host-tier equivalence round on Gemma 3). The room those loads still need is theirs
    first: the second request's chunks are promoted only once the first load has all of its
    own, and both are served whole, none given up. Watched failing without it: three of the
    second request's chunks promoted before the first load's last piece."""
    groups = LAYOUTS["full"]
    prompts = [token_prompt(96, seed=1), token_prompt(96, seed=2)]
    store = _stored(runners, tmp_path, groups, prompts)
    r, pinned = _served_after_restart(runners, store, groups, prompts[0], free=3, host_room_wait_s=0.5)
    slow_disk_reads(monkeypatch, 0.03)
    first = r.add(prompts[0], 1)
    steps = 0
    while first.request_id not in r.connector.scheduler._pieced:  # its lookup waits for room
        r.step()  # first (host_room_wait_s), then its load begins in pieces
        steps += 1
        assert steps < 100_000 and not first.is_finished(), "the load never began in pieces"
    second = r.add(prompts[1], 1)
    hierarchy = r.connector.scheduler.hierarchy
    while first.request_id in r.connector.scheduler._pieced:
        r.step()
        assert not first.is_finished()
    # Its last piece is out: every promotion so far was its own (six chunks).
    assert hierarchy.stats()["promotions_started"] == 6
    _finish(r, first, second)
    assert r.load_errors == []
    assert [r.loaded_tokens.get(q.request_id) for q in (first, second)] == [96, 96]
    data = r.stats.data
    assert data["pieced_loads_given_up"] == 0 and data["load_failures"] == 0, data
    r.connector.scheduler.hierarchy.complete_store(pinned, success=False)
    assert_host_tier_released(r)


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2-rank1-corrupt"])
def test_a_corrupt_chunk_in_a_later_piece_fails_the_load(runners, tmp_path: Path, tp: int) -> None:
    """Chunk 4 of 6 is corrupt (with two ranks, only rank 1's record) and two host slots are
    free: the pieces before it load, its piece fails, the load ends failed on every rank (vLLM
    recomputes), and the retry is served chunks 0-3 only, byte-checked, never chunk 4."""
    from test_connector_scheduler_disk_loads import _chunk_store_keys, _flip_payload_byte

    groups = LAYOUTS["full"]
    prompt = token_prompt(96)
    store = tmp_path / "persist"
    first = runners(groups, store=store, tp=tp)
    first.serve(prompt, 1)
    bad = _chunk_store_keys(first, prompt, rank=tp - 1)[4]
    first.close()
    _flip_payload_byte(store, bad)
    r, pinned = _served_after_restart(runners, store, groups, prompt, tp, free=2)
    req = r.add(prompt, 1)
    _finish(r, req)
    assert r.load_errors == []
    data = r.stats.data
    assert data["load_failures"] == 1 and data["pieced_loads"] >= 1, data
    assert r.loaded_tokens[req.request_id] == 64  # the retry: chunks 0-3
    assert data["hit_tokens"] == 64 == data["hit_tokens_disk"]
    hierarchy = r.connector.scheduler.hierarchy
    assert hierarchy.stats()["promotions_failed"] == 1
    hierarchy.complete_store(pinned, success=False)
    assert_host_tier_released(r)


def test_a_chunk_gone_from_every_tier_before_its_piece_fails_the_load(
        runners, tmp_path: Path, monkeypatch) -> None:
    """Chunk 5's record is deleted from the disk while the first pieces load: its piece finds
    it in no tier, the load ends failed, and the retry is served the 80 tokens before it."""
    from test_connector_scheduler_disk_loads import _chunk_store_keys

    prompt = token_prompt(96)
    r, pinned, req = _loading_in_pieces(runners, tmp_path, monkeypatch, prompt, 1)
    assert r.connector.scheduler.hierarchy.tiers[0].delete_many(_chunk_store_keys(r, prompt)[5:]) == 1
    _finish(r, req)
    assert r.load_errors == []
    assert r.stats.data["load_failures"] == 1
    assert r.loaded_tokens[req.request_id] == 80
    r.connector.scheduler.hierarchy.complete_store(pinned, success=False)
    assert_host_tier_released(r)


@pytest.mark.parametrize("end", ["abort", "reset"])
def test_a_load_in_pieces_ended_by_an_abort_or_a_reset(runners, tmp_path: Path, monkeypatch, end: str) -> None:
    """The client disconnects, or the prefix cache is reset, while a load comes in pieces: vLLM
    keeps the request's blocks until the load reports finished, so kvstrata ends it (a last job
    that fails), releases every slot, and the prompt is served whole afterwards."""
    from vllm.v1.request import RequestStatus

    prompt = token_prompt(96)
    r, pinned, req = _loading_in_pieces(runners, tmp_path, monkeypatch, prompt, 4)
    sched = r.connector.scheduler
    if end == "abort":
        r.scheduler.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
        # The engine core's own loop condition: vLLM steps on while the aborted request's
        # blocks wait for its load to report finished.
        steps = 0
        while r.scheduler.has_requests():
            r.step()
            steps += 1
            assert steps < 100_000, "the aborted request's load never ended"  # a hang guard
        r.run_until_idle()
    else:
        r.connector.reset_cache()
        _finish(r, req)
    assert not sched._pieced
    if end == "abort":
        assert req.status == RequestStatus.FINISHED_ABORTED and req.num_output_tokens == 0
        assert req.request_id not in r.scheduler.requests  # vLLM freed its blocks
    else:
        assert req.num_output_tokens == 4  # recomputed after the failed load
    sched.hierarchy.complete_store(pinned, success=False)
    assert_host_tier_released(r)
    r.drop_gpu_prefix_cache()
    assert r.serve(prompt, 1) == 96
    assert r.load_errors == []


def test_a_load_in_pieces_that_finds_no_room_is_given_up_and_computed(runners, tmp_path: Path) -> None:
    """Every host slot is held (stores in flight) when a restarted engine's request finds its 6
    chunks on disk: its lookup answers them all, but no piece ever gets room and no piece is in
    flight to give any back. Once it waited ``host_room_wait_s`` the load is ended failed and
    vLLM recomputes the request, which then computes what does not fit rather than waiting again
    (never served wrong: the harness checks every attended position). Once the slots are let go,
    the next request is served whole."""
    groups = LAYOUTS["full"]
    prompt = token_prompt(96)
    store = _stored(runners, tmp_path, groups, [prompt])
    r, pinned = _served_after_restart(runners, store, groups, prompt, free=0)
    req = r.add(prompt, 2)
    _finish(r, req)
    assert r.load_errors == []
    data = r.stats.data
    assert data["pieced_loads"] == 1 and data["pieced_loads_given_up"] == 1, data
    assert data["load_failures"] == 1 and data["hit_tokens"] == 0, data
    assert req.num_output_tokens == 2
    r.connector.scheduler.hierarchy.complete_store(pinned, success=False)
    assert_host_tier_released(r)
    r.drop_gpu_prefix_cache()
    assert r.serve(prompt, 1) == 96
    assert r.load_errors == []

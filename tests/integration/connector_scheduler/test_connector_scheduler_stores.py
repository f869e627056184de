"""Stores larger than the host tier's room under vLLM 0.32.0's real Scheduler, on CPU: the start
of the offer the room holds is stored now and the rest in later steps (semantics
``plan_store_within``, docs/SEMANTICS.md §3.8 D5), every loaded page byte-checked."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from connector_scheduler_helpers import token_prompt
from strata_harness import G, Runner

pytestmark = pytest.mark.integration

LAYOUTS = {"full": [G("full", 16)], "full+sw": [G("full", 16), G("sw", 16, window=32)]}


def _three_slots_free(r: Runner) -> list[bytes]:
    """Every host slot but three held by stores in flight; returns their keys."""
    pinned = [os.urandom(28) + bytes(4) for _ in range(r.connector.scheduler.plan.num_slots - 3)]
    assert r.connector.scheduler.hierarchy.prepare_store(pinned) is not None
    return pinned


@contextmanager
def _disk_writes_held(r: Runner) -> Iterator[None]:
    """The disk tier's writes wait until the block ends (the real LMDB store behind a gate), so
    the chunks a store wrote keep their host slots: what a later offer finds free does not
    depend on how fast the write-behind's thread ran."""
    disk = r.connector.scheduler.hierarchy.tiers[0]
    gate = threading.Event()
    for name in ("put_many_then", "put_many_from_slab_then"):
        write = getattr(disk, name)

        def held(*args, write=write, **kw):
            gate.wait(60)
            return write(*args, **kw)

        setattr(disk, name, held)
    try:
        yield
    finally:
        gate.set()


def _wait_for_room(r: Runner, pinned: list[bytes]) -> None:
    """Until the three free slots are free again, unless a store is in flight (the workers
    report it in the next step): the write-behind lets a stored chunk's slot go once it is on
    disk, on its own threads, so each store then finds the whole room."""
    hierarchy = r.connector.scheduler.hierarchy
    deadline = time.monotonic() + 30
    while hierarchy.host_room() < 3:
        counts = hierarchy.stats()
        in_flight = counts["stores_prepared"] - counts["stores_completed"] - counts["stores_failed"]
        if in_flight > len(pinned):
            return
        assert time.monotonic() < deadline, "the write-behind never let a slot go"
        time.sleep(0.005)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_prefill_larger_than_the_host_tier_s_room_is_stored_in_starts(runners, layout: str) -> None:
    """Three host slots free and a 200-token prompt prefilled in one step (12 chunks, twice as
    many with the window group's blocks): each store stores the start of the rest that the
    room holds while the request decodes, and the prompt is then served whole (the window
    layout one token short, R21). Watched failing with whole offers only: every offer refused,
    0 served."""
    groups = LAYOUTS[layout]
    r = runners(groups)
    pinned = _three_slots_free(r)
    prompt = token_prompt(200)
    req = r.add(prompt, 64)
    while not req.is_finished():
        _wait_for_room(r, pinned)
        r.step()
    r.run_until_idle()
    r.connector.scheduler.hierarchy.complete_store(pinned, success=False)  # the holders let go
    r.drop_gpu_prefix_cache()
    assert r.serve(prompt, 1) == (200 if layout == "full" else 199)
    assert r.stats.data["stores_cut"] >= 3  # at most three of the twelve chunks a store
    assert r.load_errors == [], r.load_errors


def test_a_request_that_finished_with_its_prompt_stores_the_start_the_room_holds(runners) -> None:
    """A one-token answer: the request finishes in the step that computes its prompt, so the
    offers it gets are that step's and its finished request's in the next (under async
    scheduling, a step later still). Three slots free: the first offer stores the first three
    chunks, and they are served. The disk's writes are held meanwhile, so the later offer finds
    the three slots still full rather than freed by however many writes the write-behind's
    thread finished (with a pause between steps and the writes free, it stored three more: 96
    served under both schedulers). Watched failing with whole offers only: 0 served."""
    r = runners(LAYOUTS["full"])
    pinned = _three_slots_free(r)
    prompt = token_prompt(200)
    with _disk_writes_held(r):
        r.serve(prompt, 1)
        r.connector.scheduler.hierarchy.complete_store(pinned, success=False)
        r.drop_gpu_prefix_cache()
        assert r.serve(prompt, 1) == 48
    assert r.stats.data["stores_cut"] == 1
    assert r.load_errors == [], r.load_errors

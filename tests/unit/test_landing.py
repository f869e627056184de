"""LandingWaiter: streamed loads copy each slot only after its promotion's ticket landed clean.

The board is a real HostSlab's ``landed`` array; the "device" is a byte array the copy function
fills from the slot, so every test can see exactly which bytes were copied and when.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from affinity_helper import PROCESS_CPUS, needs_two_cpus, on_one_cpu, thread_cpus

from kvstrata.tiers.host import HostSlab
from kvstrata.tiers.landing import LandingWaiter

SLOT = 4096
DEADLINE_S = 30.0


def eventually(cond, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


class Rig:
    """A slab, a device buffer (one row per slot) and a waiter copying slot -> device row."""

    def __init__(self, tmp_path, *, on_host: bool = True) -> None:
        self.slab = HostSlab(tmp_path / "landing.slab", SLOT, 8)
        self.device = np.zeros((8, SLOT), dtype=np.uint8)
        self.copied: list[int] = []
        self.copy_started = threading.Event()
        self.copy_gate = threading.Event()
        self.copy_gate.set()

        def copy(t) -> None:
            _group, slot, _first, _blocks = t
            self.copy_started.set()
            assert self.copy_gate.wait(DEADLINE_S)
            self.device[slot] = self.slab.array[slot]
            self.copied.append(slot)

        self.waiter = LandingWaiter(self.slab.landed, copy if on_host else None)

    def land(self, slot: int, ticket: int, *, failed: bool = False, fill: int | None = None) -> None:
        if fill is not None:
            self.slab.array[slot] = fill
        self.slab.landed[slot] = ticket << 1 | failed

    def results(self) -> dict[int, bool]:
        out: dict[int, bool] = {}
        eventually(lambda: bool(out.update(self.waiter.poll()) or out), "a result")
        return out

    def close(self) -> None:
        self.waiter.close()
        self.slab.close()


@pytest.fixture
def rig(tmp_path):
    r = Rig(tmp_path)
    yield r
    r.close()


def transfers(*slots: int) -> list[tuple]:
    return [(0, s, 0, (s,)) for s in slots]


def test_copies_each_slot_as_it_lands(rig):
    rig.slab.array[3] = 33  # slot 3 is in the host tier already (ticket 0)
    rig.waiter.submit(7, transfers(1, 2, 3), [11, 12, 0])
    eventually(lambda: rig.copied == [3], "the resident slot's copy")
    assert rig.waiter.poll() == []
    rig.land(2, 12, fill=22)
    eventually(lambda: rig.copied == [3, 2], "the first landed slot")
    assert rig.waiter.poll() == [] and not rig.device[1].any()
    rig.land(1, 11, fill=11)
    assert rig.results() == {7: True}
    assert rig.copied == [3, 2, 1]
    assert (rig.device[1] == 11).all() and (rig.device[2] == 22).all() and (rig.device[3] == 33).all()


def test_wait_blocks_until_the_job_is_copied_or_failed(rig):
    """A synchronous streamed load (the worker, before the forward): wait() returns once every
    chunk was copied, not before; a job that fails ends the wait too."""
    rig.waiter.submit(1, transfers(1, 2), [5, 6])
    assert rig.waiter.wait([1], timeout=0.05) is False and rig.copied == []
    landed = threading.Timer(0.05, lambda: (rig.land(1, 5, fill=1), rig.land(2, 6, fill=2)))
    landed.start()
    assert rig.waiter.wait([1], timeout=DEADLINE_S) is True
    assert sorted(rig.copied) == [1, 2] and (rig.device[2] == 2).all()
    assert rig.waiter.poll() == [(1, True)]
    rig.waiter.submit(2, transfers(3), [7])
    threading.Timer(0.05, lambda: rig.land(3, 7, failed=True)).start()
    assert rig.waiter.wait([2], timeout=DEADLINE_S) is True
    assert rig.waiter.poll() == [(2, False)] and 3 not in rig.copied
    landed.join()


def test_an_older_ticket_on_the_board_is_not_mistaken_for_ours(rig):
    rig.land(1, 4, fill=99)  # an earlier promotion in the same slot
    rig.waiter.submit(1, transfers(1), [5])
    time.sleep(0.02)
    assert rig.copied == [] and rig.waiter.poll() == []
    rig.land(1, 5, fill=5)
    assert rig.results() == {1: True}
    assert (rig.device[1] == 5).all()


@pytest.mark.parametrize("how", ["failed", "slot-moved-on", "gone"])
def test_a_chunk_that_never_lands_clean_fails_the_job_without_copying_it(rig, how):
    rig.waiter.submit(3, transfers(1, 2), [8, -1 if how == "gone" else 9])
    rig.land(1, 8, fill=8)
    if how == "failed":
        rig.land(2, 9, failed=True, fill=77)
    elif how == "slot-moved-on":  # failed, freed, and promoted into again by a later ticket
        rig.land(2, 10, fill=77)
    assert rig.results() == {3: False}
    assert not rig.device[2].any()


def test_cancel_stops_a_waiting_job_before_any_further_copy(rig):
    rig.copy_gate.clear()
    rig.waiter.submit(4, transfers(1, 2), [21, 22])
    rig.land(1, 21, fill=1)
    assert rig.copy_started.wait(DEADLINE_S)  # slot 1's copy is running, held at the gate
    done = threading.Event()
    cancelled: list[int] = []

    def cancel() -> None:
        cancelled.extend(rig.waiter.cancel([4]))
        done.set()

    threading.Thread(target=cancel).start()
    assert not done.wait(0.05)  # cancel waits for the copy in progress
    rig.copy_gate.set()
    assert done.wait(DEADLINE_S) and cancelled == [4]
    rig.land(2, 22, fill=2)
    time.sleep(0.02)
    assert rig.copied == [1] and not rig.device[2].any()
    assert rig.waiter.poll() == [(4, False)]


def test_accelerator_jobs_come_back_whole_once_every_chunk_landed(tmp_path):
    r = Rig(tmp_path, on_host=False)
    try:
        r.waiter.submit(9, transfers(1, 2), [1, 2])
        r.land(1, 1)
        time.sleep(0.02)
        assert r.waiter.take_ready() == []
        r.land(2, 2)
        got: list = []
        eventually(lambda: bool(got.extend(r.waiter.take_ready()) or got), "the ready job")
        assert got == [(9, transfers(1, 2))] and r.waiter.poll() == [] and r.copied == []
    finally:
        r.close()


def test_close_fails_the_jobs_still_waiting(tmp_path):
    r = Rig(tmp_path)
    r.waiter.submit(5, transfers(1), [3])
    r.waiter.close()
    assert r.waiter.poll() == [(5, False)]
    r.slab.close()


@needs_two_cpus
@pytest.mark.parametrize("on_host", [True, False])
def test_the_landing_thread_leaves_the_openmp_core_only_where_it_copies(tmp_path, on_host: bool) -> None:
    """Started on a CPU worker's main thread (bound to OpenMP thread 0's core): a waiter that
    copies on the host runs on every core of the process; one that only watches the board for
    an accelerator keeps the binding it was started with."""
    others = set(thread_cpus("kvs-landing"))  # other waiters' threads, if any are still alive
    rig = on_one_cpu(lambda: Rig(tmp_path, on_host=on_host))

    def mine() -> list[frozenset[int]]:
        return [cpus for tid, cpus in thread_cpus("kvs-landing").items() if tid not in others]

    try:
        eventually(lambda: len(mine()) == 1, "the landing thread's name")
        expected = PROCESS_CPUS if on_host else frozenset({min(PROCESS_CPUS)})
        eventually(lambda: mine() == [expected], "its CPUs")
        time.sleep(0.05)  # and it stays so
        assert mine() == [expected]
    finally:
        rig.close()

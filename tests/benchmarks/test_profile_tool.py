"""The disk-TTFT profiler's hand-off of events from vLLM's engine-core process (the profile itself
runs real engines for minutes: run by hand)."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from benchmarks import profile_disk_ttft as prof


@pytest.fixture(autouse=True)
def _clean_events():
    prof._events.clear()
    prof._cpu_marks.clear()
    yield
    prof._events.clear()
    prof._cpu_marks.clear()


def test_engine_core_events_are_dumped_then_merged_into_the_timeline(tmp_path: Path) -> None:
    # What the engine-core process records: the request's arrival, a read and the forward.
    prof._events.extend([
        (prof._ARRIVAL, 10.0, 10.001, -1),
        ("DiskStore.get_into", 10.01, 10.05, -1),
        (prof._FORWARD, 10.06, 10.2, 1),
        ("DiskStore.get_into", 11.0, 11.1, -1),  # after the first token: not counted
    ])
    prof._dump_events(tmp_path)
    [dumped] = list(tmp_path.glob("*.json"))
    assert dumped.name == f"{os.getpid()}.json"  # written under a temporary name, then renamed
    assert set(json.loads(dumped.read_text())) == {"events", "major_faults", "storage_read_bytes",
                                                          "cpu_marks"}

    prof._events.clear()  # the profiling child's own process saw none of it
    totals = prof._merge_engine_core_events(tmp_path)
    assert set(totals) == {"major_faults", "storage_read_bytes"}
    timeline = prof.summarise(ttft_s=0.25)
    assert timeline["DiskStore.get_into"]["calls"] == 1
    assert timeline["DiskStore.get_into"]["first_s"] == pytest.approx(0.01, abs=1e-3)
    assert timeline[prof._FORWARD]["compute_steps"] == 1


def test_window_events_list_each_call_of_the_request_in_start_order() -> None:
    # Two processes' events arrive unordered (the engine core's are merged after the child's).
    prof._events.extend([
        (prof._FORWARD, 5.06, 5.2, 1),
        ("DiskStore.get_into", 4.0, 4.1, -1),  # an earlier request: before the last arrival
        (prof._ARRIVAL, 5.0, 5.001, -1),
        ("DiskStore.get_into", 5.03, 5.05, -1),
        ("DiskStore.get_into", 5.01, 5.02, -1),
        ("DiskStore.get_into", 5.4, 5.5, -1),  # after the first token
    ])
    events = prof.window_events(ttft_s=0.25)
    assert [e[0] for e in events] == ["DiskStore.get_into", "DiskStore.get_into", prof._FORWARD]
    assert [e[1] for e in events] == pytest.approx([0.01, 0.03, 0.06], abs=1e-6)
    assert [e[2] for e in events] == pytest.approx([0.01, 0.02, 0.14], abs=1e-6)
    prof._events.clear()
    assert prof.window_events(ttft_s=0.25) == []  # no arrival, no window


def test_nothing_is_dumped_without_events(tmp_path: Path) -> None:
    prof._dump_events(tmp_path)
    assert not list(tmp_path.iterdir())
    assert prof._merge_engine_core_events(tmp_path) == {"major_faults": 0, "storage_read_bytes": 0}


def test_cpu_snapshot_names_this_process_threads_and_counts_their_cpu() -> None:
    done = threading.Event()

    def spin() -> None:
        x = 0
        while not done.is_set():
            x += 1

    worker = threading.Thread(target=spin, name="kvstrata-read_0")
    me = f"{prof._comm('/proc/self/comm')}[{os.getpid()}]"
    # The pool's numbered suffix is folded; a thread born after the first snapshot counts from 0.
    row = f"{me} thread kvstrata-read"
    before = prof._cpu_snapshot()
    worker.start()
    # Waits for the spinning thread's CPU to show (however loaded the machine), not a fixed time:
    # a snapshot that did not count it would never show it.
    for _ in range(6000):
        after = prof._cpu_snapshot()
        if after.get(row, 0.0) > 0.02:
            break
        time.sleep(0.01)
    done.set()
    worker.join()
    assert row not in before
    assert after[row] > 0.02
    assert after[f"{me} thread MainThread"] >= before[f"{me} thread MainThread"]
    assert any(k.startswith("process ") for k in after)  # every other process, once


def test_cpu_breakdown_lines_up_each_process_window_by_time() -> None:
    sched, model = 100, 200
    # The scheduler process sees the arrival and schedules the computing step; the model process
    # gets no empty steps, so its window starts at its last mark before the arrival.
    prof._cpu_marks.extend([
        ("forward_end", 9.0, model, {"m thread Main": 1.0, "m thread landing": 0.5,
                                     "process other[7]": 3.0}),
        ("arrival", 10.0, sched, {"s thread read": 0.0, "s thread Main": 2.0,
                                  "process other[7]": 3.0, f"process m[{model}]": 1.5}),
        ("compute_scheduled", 10.1, sched, {"s thread read": 0.12, "s thread Main": 2.01,
                                            "process other[7]": 3.03,
                                            f"process m[{model}]": 1.6,
                                            "process newborn[8]": 5.0}),
        ("forward_start", 10.102, model, {"m thread Main": 1.02, "m thread landing": 0.52,
                                          "process other[7]": 3.03}),
        ("forward_end", 10.15, model, {"m thread Main": 1.07, "m thread landing": 0.52,
                                       "process other[7]": 3.031}),
    ])
    out = prof.cpu_breakdown()
    load, forward = out["load"], out["forward"]
    assert load["s thread read"] == pytest.approx(0.12)
    assert load["s thread Main"] == pytest.approx(0.01)
    assert load["m thread Main"] == pytest.approx(0.02)
    assert load["m thread landing"] == pytest.approx(0.02)
    assert load["process other[7]"] == pytest.approx(0.03)  # counted once, from the scheduler
    assert f"process m[{model}]" not in load  # its threads are listed instead
    assert "process newborn[8]" not in load  # born inside the window: unknown share
    assert load["all_s"] == pytest.approx(0.12 + 0.01 + 0.02 + 0.02 + 0.03)
    assert list(load)[1] == "s thread read"  # largest first
    assert forward["m thread Main"] == pytest.approx(0.05)
    assert "m thread landing" not in forward  # under the 2 ms floor


def test_cpu_breakdown_is_empty_without_an_arrival() -> None:
    assert prof.cpu_breakdown() == {}

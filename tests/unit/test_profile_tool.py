"""The disk-TTFT profiler's hand-off of events from vLLM's engine-core process (the profile itself
runs real engines for minutes: run by hand)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvstrata.tools import profile_disk_ttft as prof


@pytest.fixture(autouse=True)
def _clean_events():
    prof._events.clear()
    yield
    prof._events.clear()


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
    assert set(json.loads(dumped.read_text())) == {"events", "major_faults", "storage_read_bytes"}

    prof._events.clear()  # the profiling child's own process saw none of it
    totals = prof._merge_engine_core_events(tmp_path)
    assert set(totals) == {"major_faults", "storage_read_bytes"}
    timeline = prof.summarise(ttft_s=0.25)
    assert timeline["DiskStore.get_into"]["calls"] == 1
    assert timeline["DiskStore.get_into"]["first_s"] == pytest.approx(0.01, abs=1e-3)
    assert timeline[prof._FORWARD]["compute_steps"] == 1


def test_nothing_is_dumped_without_events(tmp_path: Path) -> None:
    prof._dump_events(tmp_path)
    assert not list(tmp_path.iterdir())
    assert prof._merge_engine_core_events(tmp_path) == {"major_faults": 0, "storage_read_bytes": 0}

"""``kvstrata verify`` next to live writers: records evicted while it runs are gone, not damage.

Two writer processes put into one store past its budget (every put evicts the least recently
used records) while ``verify`` runs again and again; each run must find the store sound. Before
the fix a record evicted between verify's index scan and its check was reported as an "entry
unreachable by its key" and verify exited 1 on a sound store.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstrata.tiers.disk import DiskStore
from kvstrata.tools.cli import main

HELPER = Path(__file__).with_name("disk_helper.py")
BUDGET = 1 << 20
SIZE = 4096
MIN_RUNS = 5
MIN_EVICTED_DURING = 200  # records evicted while a verify ran, over all runs
MAX_RUNS = 400


def _keys(path: Path) -> set[bytes]:
    with DiskStore(path, budget_bytes=1 << 40, readonly=True, create=False) as store:
        return {k for k, _ in store.iter_index()}


def _wait_for_line(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("put "), (line, proc.poll())


@pytest.fixture
def writers(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "store"
    procs: list[subprocess.Popen[str]] = []
    try:
        for first in (0, 1 << 40):  # two key ranges: evictions land all over the key order
            procs.append(subprocess.Popen(
                [sys.executable, str(HELPER), "writer", str(path), str(first), "0", "--forever",
                 "--size", str(SIZE), "--budget", str(BUDGET)],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))
            _wait_for_line(procs[-1])  # the first writer created the store
        yield path
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_verify_finds_a_store_under_live_writers_sound(
        writers: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs = evicted_during = 0
    while runs < MIN_RUNS or evicted_during < MIN_EVICTED_DURING:
        assert runs < MAX_RUNS, f"the writers evicted only {evicted_during} records during {runs} runs"
        before = _keys(writers)
        rc = main(["verify", "--json", str(writers)])
        out = capsys.readouterr().out
        assert rc == 0, out[:3000]  # sound: every record is checked or gone, none is "unreachable"
        evicted_during += len(before - _keys(writers))
        runs += 1

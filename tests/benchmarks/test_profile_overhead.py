"""The overhead profiler's sampling and attribution, on this test process with a real py-spy (the
profile itself runs engines for minutes: run by hand)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from benchmarks import profile_overhead as prof
from kvstrata.tiers.hierarchy.shared import chunk_group


def _spin(seconds: float) -> int:
    n = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(200):
            n += chunk_group(b"\x00" * 12 + n.to_bytes(4, "big")[-4:]) & 1
    return n


def test_gil_and_running_time_are_attributed_per_thread_and_to_kvstrata(tmp_path: Path) -> None:
    sleeper = threading.Thread(target=time.sleep, args=(3.0,), name="sleeper_3")
    with prof.PySpy(tmp_path / "gil.txt", 100, gil=True) as gil, \
            prof.PySpy(tmp_path / "running.txt", 100, gil=False) as running:
        sleeper.start()
        _spin(2.0)  # the main thread runs kvstrata's chunk_group in a Python loop
        sleeper.join()
    out = prof.summarise(gil.text(), running.text(), 100)
    main = out["threads"]["MainThread"]
    # Shares of the samples, not seconds: a loaded machine samples less often, not differently.
    # The spinning main thread holds the GIL in most samples that find it held and is runnable.
    gil_total = sum(t["gil_s"] for t in out["threads"].values())
    assert main["gil_s"] > gil_total / 2 and main["runnable_s"] > 0
    assert 0 < out["main_thread_gil_in_kvstrata_s"] < out["main_thread_gil_s"]
    [(top, seconds)] = list(out["main_thread_kvstrata_functions_s"].items())[:1]
    assert top.startswith("chunk_group (tiers/hierarchy/shared.py") and seconds > 0
    # A sleeping thread holds no GIL and waits for no CPU (at most a few samples as it starts,
    # 5 at this rate; the label drops the pool suffix).
    sleeper_figures = out["threads"].get("sleeper", {"gil_s": 0.0, "runnable_s": 0.0})
    assert sleeper_figures["gil_s"] <= 5 / 100 and sleeper_figures["runnable_s"] <= 5 / 100


def test_raw_lines_parse_with_and_without_thread_names() -> None:
    raw = ("thread (0x7f12): kvstrata-write_1;run (/x/threading.py:982);put (" + prof.KVSTRATA_DIR
           + "tiers/disk/store.py:10) 7\n"
           "thread (4242);<native> 3\n"
           "garbage\n")
    parsed = prof.parse_raw(raw)
    assert parsed[0][0] == "kvstrata-write" and parsed[0][2] == 7
    assert parsed[0][1][-1] == ("put", prof.KVSTRATA_DIR + "tiers/disk/store.py")
    assert parsed[1][0] == "native" and parsed[1][2] == 3
    assert len(parsed) == 2

"""Two writer processes on one store at once (overlapping and distinct keys) and a reader
process reading meanwhile; with a budget large enough for everything, and with one that makes
both writers evict at the same time.

Required: every process exits cleanly, the reader never sees wrong bytes, afterwards every
record reads back as written (all of them when nothing had to be evicted), the totals match
the index, and ``kvstrata verify`` says sound.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torture as t

from kvstrata.tiers.disk import DiskStore

# writer A puts records 0..89, writer B 60..149: 30 records both put, 120 distinct in all
A, B = (0, 90), (60, 90)
TOTAL = 150


@pytest.mark.parametrize("budget", [1 << 40, 512 << 10], ids=["no-eviction", "evicting"])
def test_two_writers_and_a_reader_on_one_store(tmp_path: Path, budget: int) -> None:
    path = tmp_path / "store"
    DiskStore(path, budget_bytes=budget).close()  # created before the children race to open it
    seed = t.seed_for("two-processes", budget)
    children = [
        t.Child("writer", str(path), str(first), str(count), str(seed + n), str(budget))
        for n, (first, count) in enumerate((A, B))
    ]
    evicting = budget < 1 << 40
    reader = t.Child("reader", str(path), "0", str(TOTAL), "3" if evicting else "30")
    tal = t.tally("two processes on one store")
    tal.trials += 1
    reports = []
    try:
        for child in [*children, reader]:
            line = child.next(timeout=120)
            if child.proc.wait(60) != 0:
                tal.crashed += 1
                raise AssertionError(f"seed={seed}: a child failed: {child.stderr()}")
            reports.append(json.loads(line))
    finally:
        for child in [*children, reader]:
            child.close()
    (a, b, seen), problems = reports, []
    if seen["wrong"]:
        tal.wrong += len(seen["wrong"])
        problems.append(f"the reader saw WRONG bytes for {len(seen['wrong'])} record(s)")
    if not evicting and (a["stored"], b["stored"], seen["seen"]) != (A[1], B[1], TOTAL):
        problems.append(f"stored {a['stored']} + {b['stored']} of {A[1]} + {B[1]}, the reader saw "
                        f"{seen['seen']} of {TOTAL}, and nothing was evicted")
    with DiskStore(path, budget_bytes=budget, create=False) as store:
        if store.unclean_shutdown:
            problems.append("the store was not marked clean after every process closed it")
        for i in range(TOTAL):
            key = t.writers_key(i)
            out = bytearray(t.value_len(key))
            n = store.get_into(key, out)
            if n is None:
                tal.detected += 1
            elif bytes(out[:n]) == t.expected(key):
                tal.served += 1
            else:
                tal.wrong += 1
                problems.append(f"WRONG bytes for record {i}")
        index = dict(store.iter_index())
        stats = store.stats()
    if not evicting and len(index) != TOTAL:
        problems.append(f"{len(index)} records stored, {TOTAL} were put and none evicted")
    if (stats["entries"], stats["stored_bytes"]) != (len(index), sum(r.stored_len for r in index.values())):
        problems.append(f"totals {stats['entries']}/{stats['stored_bytes']} differ from the index")
    run = t.cli("verify", "--json", str(path))
    if run.rc != 0 or run.report.get("status") != "sound":
        problems.append(f"verify: {run.describe()}")
    assert not problems, f"seed={seed}: " + "; ".join(problems)

"""``benchmarks/write_contention.py``: its options, and one short run of every variant (a small
chunk, a fraction of a second each) that checks each figure is reported and kvstrata's disk
variant really stored its chunks. Its times are the experiment's output, never asserted."""

from __future__ import annotations

import json
import multiprocessing as mp
from pathlib import Path

import pytest
from usage_helper import refusal

from benchmarks import write_contention


@pytest.mark.parametrize("argv, message", [
    (["--variants", "disk,nope"], "--variants: unknown nope"),
    (["--variants", ","], "--variants: unknown (none given)"),
    (["--sizes", "4096,x"], "--sizes: not a list of integers"),
    (["--sizes", "5000"], "each a positive multiple of 4096"),
    (["--chunk-bytes", "3"], "--chunk-bytes must be even"),
    (["--repeat", "0"], "--repeat positive"),
])
def test_bad_options_name_what_is_wrong(argv, message, capsys) -> None:
    assert message in refusal(write_contention.parse_args, argv, capsys)


def test_every_variant_reports_its_figures(tmp_path: Path, capsys) -> None:
    code = write_contention.main([
        "--chunk-bytes", str(64 << 10), "--rate", "40", "--seconds", "0.25", "--repeat", "1",
        "--forward-threads", "1", "--sizes", "8192", "--dir", str(tmp_path)])
    result = json.loads(capsys.readouterr().out)
    assert code == 0
    assert set(result["summary"]) == set(write_contention.VARIANTS)
    for variant, row in result["summary"].items():
        assert row["forward_it_per_s"] > 0 and row["forward_vs_none"] > 0, (variant, row)
        [run] = result["runs"][variant]
        if variant != "none":
            # Paced at 40/s for 0.25 s: at most eleven chunks however fast the writes (how many
            # a loaded machine gets through is timing, not asserted), every one timed.
            assert 1 <= run["chunks"] <= 11 and row["cpu_ms_per_chunk"] >= 0, (variant, run)
    assert set(result["size_sweep"]["8192"]) == {"buffered_cpu_ms_per_write", "odirect_cpu_ms_per_write"}
    assert list(tmp_path.iterdir()) == []  # its scratch directory is gone


def test_the_disk_variant_stores_what_it_writes(tmp_path: Path) -> None:
    from kvstrata.tiers.disk.store import DiskStore

    args = write_contention.parse_args(["--chunk-bytes", str(64 << 10), "--rate", "100", "--seconds", "0.1"])
    ctx = mp.get_context("spawn")
    ready, go, out = ctx.Event(), ctx.Event(), ctx.Queue()
    go.set()
    write_contention.write_chunks("disk", args.chunk_bytes, args.rate, args.seconds, str(tmp_path), ready, go, out)
    chunks = out.get(timeout=10)["chunks"]
    with DiskStore(tmp_path, budget_bytes=1 << 30) as store:
        assert store.stats()["entries"] == chunks > 0

"""``benchmarks/write_throughput.py``: its options, and one short run of two thread counts (a few
small chunks) that checks every chunk of the burst was written and every figure is reported. Its
speeds are the experiment's output, never asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from usage_helper import refusal

from benchmarks import write_throughput


@pytest.mark.parametrize(("argv", "says"), [
    (["--threads", "a,b"], "--threads: comma-separated counts, not 'a,b'"),
    *[(argv, "--threads, --chunks, --shards, --repeat positive; --chunk-bytes even")
      for argv in (["--threads", "0"], ["--threads", "2,0"], ["--chunks", "0"], ["--shards", "0"],
                   ["--repeat", "0"], ["--chunk-bytes", "3"])],
])
def test_bad_options_name_what_is_wrong(argv, says, capsys) -> None:
    assert says in refusal(write_throughput.parse_args, argv, capsys)


def test_a_short_burst_is_written_with_each_thread_count(tmp_path: Path, capsys) -> None:
    code = write_throughput.main(["--threads", "1,2", "--chunks", "6", "--shards", "2",
                                  "--chunk-bytes", str(64 << 10), "--repeat", "1", "--dir", str(tmp_path)])
    result = json.loads(capsys.readouterr().out)
    assert code == 0
    assert result["burst_bytes"] == 6 * 2 * (64 << 10)
    assert set(result["write_threads"]) == {"1", "2"}
    for row in result["write_threads"].values():
        assert len(row["gbps"]) == len(row["seconds"]) == 1 and row["gbps_median"] > 0
        assert row["write_threads_cpu_s"][0] >= 0 and row["disk_writer_cpu_s"][0] >= 0
    assert "vs_first" in result["write_threads"]["2"]
    assert list(tmp_path.iterdir()) == []  # its stores are removed

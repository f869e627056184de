"""``benchmarks/gil_contention.py``: its options, and one short run (two small chunks, one switch
interval) that checks the child process reads and encodes the store's chunks, a hierarchy
promotes them with and without read processes and writes chunks behind with
and without write processes, and every figure is reported. Its speeds are the
experiment's output, never asserted."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from usage_helper import refusal

from benchmarks import gil_contention


@pytest.mark.parametrize(("argv", "says"), [
    (["--switch-intervals", "fast"], "--switch-intervals: comma-separated seconds, not 'fast'"),
    *[(argv, "--chunk-bytes even, --chunks, --seconds, --batch, --processes and --switch-intervals positive")
      for argv in (["--chunk-bytes", "3"], ["--chunks", "0"], ["--seconds", "0"], ["--batch", "0"],
                   ["--processes", "0"], ["--switch-intervals", "0.001,0"])],
    (["--parts", "writes,everything"], "--parts: comma-separated, of promotions, threads, writes; not 'writes,everything'"),
])
def test_bad_options_name_what_is_wrong(argv, says, capsys) -> None:
    assert says in refusal(gil_contention.parse_args, argv, capsys)


def test_a_short_run_reports_every_figure(tmp_path: Path, capsys) -> None:
    interval = sys.getswitchinterval()
    code = gil_contention.main(["--chunk-bytes", str(64 << 10), "--chunks", "2", "--seconds", "0.2",
                                "--batch", "2", "--processes", "1", "--switch-intervals", "0.001", "--dir", str(tmp_path)])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["batch"] == 2 and result["chunk_bytes"] == 64 << 10
    row = result["switch_intervals"]["0.001"]
    assert row["busy_iterations_per_s"] > 0
    for op in ("read", "encode"):
        figures = row[op]
        # The child answers only when every chunk it was sent was in the store: a rate above
        # zero means its reads found them.
        for name in ("thread_alone_gbps", "thread_beside_busy_gbps", "process_beside_busy_gbps"):
            assert figures[name] > 0, name
        assert set(figures["busy_rate_vs_alone"]) == {"thread", "process"}
    # A real hierarchy promoted every chunk (it raises if one failed or did not land), with its
    # reads in its threads and in its read processes.
    promoted = result["promotions"]["0.001"]
    for processes in (0, 1):
        assert promoted[f"read_processes_{processes}"]["alone_gbps"] > 0
        assert promoted[f"read_processes_{processes}"]["beside_busy_gbps"] > 0
    assert promoted["processes_vs_threads_beside_busy"] > 0
    # ... and wrote fresh chunks behind (it raises if one failed or never completed), framed in
    # its write threads and in its write processes.
    # ... and, framed in its write processes, put by the put process and by the writer thread.
    written = result["writes_behind"]
    for name in ("write_processes_0", "write_processes_1", "write_processes_1_writer_thread"):
        assert written["0.001"][name]["alone_gbps"] > 0
        assert written["0.001"][name]["beside_busy_gbps"] > 0
    assert written["0.001"]["put_process_vs_writer_thread_beside_busy"] > 0
    assert written["framed_by_processes"] > 0 and written["put_by_the_put_process"] > 0
    assert sys.getswitchinterval() == interval  # restored
    assert list(tmp_path.iterdir()) == []  # its store is removed


def test_parts_run_alone(tmp_path: Path, capsys) -> None:
    assert gil_contention.main(["--chunk-bytes", str(64 << 10), "--chunks", "2", "--seconds", "0.1",
                                "--processes", "1", "--switch-intervals", "0.001", "--dir", str(tmp_path),
                                "--parts", "writes"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["switch_intervals"] is None and result["promotions"] is None
    assert result["writes_behind"]["put_by_the_put_process"] > 0

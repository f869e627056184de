"""``benchmarks/write_report_lag.py``: its options, and one short run of both ways of reporting
(no busy processes, a few small chunks) that checks every stored chunk was committed and reported.
Its lags are the experiment's output, never asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from usage_helper import refusal

from benchmarks import write_report_lag


@pytest.mark.parametrize("argv", [["--busy", "-1"], ["--chunks", "0"], ["--rate", "0"], ["--repeat", "0"],
                                  ["--chunk-bytes", "3"]])
def test_bad_options_name_what_is_wrong(argv, capsys) -> None:
    assert "--chunks, --rate, --repeat positive" in refusal(write_report_lag.parse_args, argv, capsys)


def test_both_ways_report_every_chunk(tmp_path: Path, capsys) -> None:
    code = write_report_lag.main(["--busy", "0", "--chunks", "4", "--chunk-bytes", str(64 << 10),
                                  "--rate", "100", "--repeat", "1", "--dir", str(tmp_path)])
    result = json.loads(capsys.readouterr().out)
    assert code == 0
    assert set(result["commit_to_report"]) == set(write_report_lag.VARIANTS)
    for variant, row in result["commit_to_report"].items():
        assert row["chunks"] == 4, (variant, row)
        assert 0 <= row["median_ms"] <= row["max_ms"], (variant, row)
    assert list(tmp_path.iterdir()) == []  # its stores are removed

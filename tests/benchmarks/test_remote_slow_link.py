"""The slow-link experiment end to end on an unshaped loopback (shaping needs root and changes
the machine's loopback: run by hand, benchmarks/README.md): a real Redis server, both deadlines,
the JSON it prints. Deadlines far above the time a 2 MiB write takes: a busy CI machine must not
turn this into a test of its own load."""

from __future__ import annotations

import json

import pytest

from benchmarks import remote_slow_link


def test_both_deadlines_store_a_chunk_over_an_unshaped_loopback(capsys: pytest.CaptureFixture[str]) -> None:
    assert remote_slow_link.main(["--rate", "none", "--mib", "2", "--write-timeouts", "3", "5"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["rate"] == "none" and out["value_mib"] == 2.0
    assert set(out["results"]) == {"write_timeout_3s", "write_timeout_5s"}
    for r in out["results"].values():
        assert r["stored"] == 1 and r["tier_available_after"] and r["unavailable"] == 0, r

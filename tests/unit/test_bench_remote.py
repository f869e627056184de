"""``kvstrata bench remote --quick``: the CLI end to end on a tiny synthetic workload (a
redis-server the bench starts itself, no engine). Checks the JSON's shape, never its timings.
Needs ``redis-server`` on PATH, as the shared tier's tests do (``scripts/env.sh`` installs it)."""

from __future__ import annotations

import json

from kvstrata.tools.cli import build_parser, main


def test_bench_remote_options() -> None:
    args = build_parser().parse_args(["bench", "remote", "--json"])
    assert (args.tokens, args.rounds, args.remote_url, args.codec, args.quick) == (
        None, 3, None, "auto", False)


def test_bench_remote_quick_json(capsys) -> None:
    assert main(["bench", "remote", "--quick", "--json", "--tokens", "256"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("remote_load_vs_raw_get", "bytes_vs_raw", "remote_load_MBps", "raw_get_MBps",
                "remote_load_mac_vs_no_mac", "remote_load_mac_MBps"):
        assert out[key] > 0, key
    assert out["bytes_vs_raw"] < 1.0  # the synthetic KV compresses
    assert out["load"]["verified"] is True
    assert out["load"]["chunks"] == 2 and out["tokens"] == 256
    assert out["first_token"] == "skipped (--quick)"
    assert "remote_ttft_vs_disk_ttft" not in out
    assert set(out["goals"]) == {"remote_load_vs_raw_get>=0.8", "bytes_vs_raw<=0.7", "remote_load_mac_vs_no_mac>=0.9",
                                 "remote_ttft_vs_disk_ttft<=1.3", "remote_ttft_vs_cold<=0.1"}
    assert out["goals"]["remote_ttft_vs_disk_ttft<=1.3"] is None  # not measured, not failed
    assert out["server"]["how"].startswith("started by the bench")


def test_bench_remote_refuses_bad_counts(capsys) -> None:
    assert main(["bench", "remote", "--quick", "--rounds", "0"]) == 2
    assert "at least 1" in capsys.readouterr().err

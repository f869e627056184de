"""``benchmarks/scheduler_overhead.py``: its options, and one tiny run of every configuration
through vLLM's real AsyncScheduler that checks each figure is reported and kvstrata served the
second rounds. Its times are the experiment's output, never asserted."""

from __future__ import annotations

import json

import pytest
from usage_helper import refusal

pytest.importorskip("vllm")

from benchmarks import scheduler_overhead  # noqa: E402


@pytest.mark.parametrize("argv, message", [
    (["--configs", "kvstrata,nope"], "unknown configuration(s) nope"),
    (["--users", "0"], "--users must be positive"),
    (["--forward-ms", "-1"], "--forward-ms must not be negative"),
    (["--system-tokens", "9000"], "--system-tokens must not exceed --prompt-tokens"),
    (["--kvstrata-config", "{"], "--kvstrata-config is not JSON"),
    (["--kvstrata-config", "[1]"], "--kvstrata-config must be a JSON object"),
    (["--vllm-offload-config", "nope"], "--vllm-offload-config is not JSON"),
    (["--num-blocks", "0"], "--num-blocks must be positive"),
])
def test_bad_options_name_what_is_wrong(argv, message, capsys) -> None:
    assert message in refusal(scheduler_overhead.parse_args, argv, capsys)


def run(argv: list[str], capsys) -> dict:
    """The benchmark's JSON for ``argv`` (it exited 0)."""
    assert scheduler_overhead.main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_every_configuration_reports_its_figures(capsys) -> None:
    # Three users whose contexts do not fit the device's 60 blocks: second rounds come back for
    # prefixes vLLM's own cache evicted.
    result = run([
        "--users", "3", "--rounds", "2", "--system-tokens", "64", "--prompt-tokens", "512",
        "--question-tokens", "16", "--answer-tokens", "8", "--arrival-steps", "1", "--num-blocks", "60",
        "--forward-ms", "1", "--forward-us-per-token", "0", "--host-bytes", "8MiB"], capsys)
    figs = result["configs"]
    assert set(figs) == set(scheduler_overhead.CONFIGS)
    for name, fig in figs.items():
        assert fig["steps"] > 0 and fig["engine_core_us"]["mean"] > 0, (name, fig)
        assert fig["computed_tokens"] > 0, (name, fig)
    none, mine = figs["none"], figs["kvstrata"]
    assert none["connector_us"] is None and none["served_tokens"] is None
    assert mine["connector_us"]["mean"] > 0 and mine["worker_us"]["mean"] > 0
    assert set(mine["connector_hook_s"]) >= {"get_num_new_matched_tokens", "build_connector_meta"}
    # The second rounds were served from kvstrata's tiers, and the engine computed that much less.
    assert mine["served_tokens"] > 0, mine
    assert mine["computed_tokens"] < none["computed_tokens"], (mine, none)
    assert mine["engine_core_us_added"].keys() == {"mean", "p50", "p99"}
    assert 0 < mine["computed_tokens_vs_none"] < 1
    assert result["connector_us_mean_vs_vllm_tiered_fs"] > 0
    for fig in figs.values():
        assert fig["gpu_wait"].keys() == {"steps", "ms", "share_of_forward"}
        assert 0 <= fig["gpu_wait"]["steps"] < fig["steps"]
    # kvstrata's automatic options resolved as on a GPU engine (the default --kvstrata-device).
    assert result["kvstrata_device"] == "cuda"
    assert mine["resolved"]["sync_loads"] is False and mine["resolved"]["write_threads"] >= 1
    assert mine["resolved"]["read_processes"] >= 1
    assert mine["resolved"]["write_processes"] == mine["resolved"]["write_threads"]


def test_kvstrata_options_resolve_for_the_device_asked(capsys) -> None:
    """``--kvstrata-device cpu``: a CPU engine's synchronous loads, single write thread and
    reads and framing in its threads."""
    result = run([
        "--configs", "kvstrata", "--kvstrata-device", "cpu", "--users", "2", "--rounds", "1",
        "--system-tokens", "16", "--prompt-tokens", "64", "--question-tokens", "8", "--answer-tokens", "4",
        "--forward-ms", "0", "--forward-us-per-token", "0", "--host-bytes", "8MiB"], capsys)
    assert result["kvstrata_device"] == "cpu"
    assert result["configs"]["kvstrata"]["resolved"] == {"sync_loads": True, "write_threads": 1,
                                                         "read_processes": 0, "write_processes": 0}


def test_the_gpu_waits_for_what_the_engine_core_does_beyond_the_forward() -> None:
    """Step 1's forward (5 ms) overlaps step 0's output processing (4 ms, recorded with step 1)
    and step 2's scheduling (3 ms): the GPU waits 2 ms. Step 0's overlaps 0 + 2 ms: no wait."""
    t = scheduler_overhead.Timings(schedule=[1e-3, 2e-3, 3e-3], update=[0.0, 4e-3, 0.0],
                                   forward=[5e-3, 5e-3, 5e-3])
    assert t.gpu_wait() == {"steps": 1, "ms": 2.0, "share_of_forward": round(2 / 15, 5)}

"""``benchmarks/cold_store_cost.py``: its options, and one slow run on a tiny random checkpoint
(kvstrata and vLLM alone, two cold prompts each) that checks every figure is reported. Its times
are the experiment's output, never asserted."""

from __future__ import annotations

import json

import pytest
from usage_helper import refusal

from benchmarks import cold_store_cost


@pytest.mark.parametrize("argv, message", [
    (["--configs", "kvstrata,nope"], "--configs: unknown nope"),
    (["--prompts", "0"], "--prompts and --rounds must be at least 1"),
    (["--kvstrata-config", "[1]"], "expected a JSON object"),
    (["--kvstrata-config", "{"], "--kvstrata-config: not JSON"),
])
def test_bad_options_name_what_is_wrong(argv, message, capsys) -> None:
    assert message in refusal(cold_store_cost.parse_args, argv, capsys)


@pytest.mark.slow
def test_cold_prompts_on_a_tiny_model_report_each_configuration(capsys) -> None:
    code = cold_store_cost.main([
        "--tiny", "--configs", "kvstrata,vllm", "--prompts", "2", "--prompt-tokens", "300",
        "--max-model-len", "1024", "--kv-cache-bytes", str(16 << 20), "--host-bytes", str(16 << 20),
        "--kvstrata-config", '{"zstd_level": 3}'])
    result = json.loads(capsys.readouterr().out)
    assert code == 0, result
    assert result["kvstrata_config"] == {"zstd_level": 3}
    for name in ("kvstrata", "vllm"):
        [run] = result["runs"][name]
        assert len(run["ttft_s"]) == 2 and all(t > 0 for t in run["ttft_s"]), run
        assert run["first_ttft_s"] > 0, run  # the warm-up's, reported apart
        assert result["ttft_median_s"][name] == run["ttft_median_s"] > 0
        assert run["cpu_s"]["total"] > 0, run

"""``kvstrata bench serve``: its options, workload, figures and charts without an engine, and one
slow end-to-end run on a tiny random checkpoint (two users, one round) that checks every field
is reported. Speeds are never asserted: they are the benchmark's output, not a test's."""

from __future__ import annotations

import argparse
import json
import socket
import sys
from pathlib import Path

import pytest

from kvstrata.bench import configs, report, serve, server, steps
from kvstrata.bench.client import RequestResult, SeenPrefixes, common_prefix
from kvstrata.bench.peers import PeerUnavailable
from kvstrata.bench.server import (
    ApiServer,
    ServerError,
    ServerSpec,
    hit_tokens,
    parse_metrics,
    phase_sums,
)
from kvstrata.bench.workload import WorkloadError, WorkloadSpec, build_workload
from kvstrata.tools.cli import main

TOP_LEVEL = ("ttft_mean_vs_vllm", "ttft_mean_vs_native_best", "ttft_p99_vs_native_best",
             "throughput_vs_vllm", "throughput_vs_native_best", "errors", "chart",
             "ttft_mean_vs_lmcache", "configs", "workload", "clean_stops", "tracebacks",
             "shutdown_tracebacks", "computed_tokens_vs_native_best")
PER_CONFIG = ("ttft_samples_s", "ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s",
              "output_tok_per_s", "errors", "hit_tokens", "ttft_mean_by_round_s", "clean_stop",
              "tracebacks", "shutdown_tracebacks", "cpu_s", "requests_detail", "loadavg_start",
              "computed_tokens", "floor_tokens", "disk_free_start_bytes")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    p.add_argument("--json", action="store_true")
    return p


@pytest.mark.parametrize("argv, message", [
    (["--configs", "vllm,nope"], "--configs: unknown nope"),
    (["--sweep", "1k"], "--sweep: expected comma-separated token counts"),
    (["--sweep", "16"], "at least 64 tokens"),
    (["--users", "0"], "users and rounds must be >= 1"),
    (["--context-max", "9000"], "over the servers' max model length"),
    (["--host-bytes", "lots", "--tiny"], "--host-bytes"),
    (["--kvstrata-config", '{"codec": "nope"}'], "'codec'"),
    (["--kvstrata-config", "[1]"], "expected a JSON object"),
    (["--repeat", "0"], "--repeat must be at least 1"),
])
def test_bad_options_name_what_is_wrong(argv, message, capsys, tmp_path) -> None:
    try:
        code = main(["bench", "serve", "--out", str(tmp_path), "--no-progress", *argv])
    except SystemExit as exc:  # argparse's own refusal (a type check): the same exit status
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def _tiny_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({
        "vocab_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "hidden_size": 256, "torch_dtype": "float32"}))
    return tmp_path


def test_workload_is_seeded_multi_round_and_long(tmp_path) -> None:
    model = _tiny_dir(tmp_path)
    spec = WorkloadSpec(users=3, rounds=2, seed=7)
    a, b = build_workload(model, spec), build_workload(model, spec)
    assert [u.first_prompt for u in a.users] == [u.first_prompt for u in b.users]
    assert [u.arrival_s for u in a.users] == [u.arrival_s for u in b.users]
    assert a.users[0].arrival_s == 0 and a.users[1].arrival_s > 0
    shared = a.users[0].first_prompt[:spec.system_tokens]
    for u in a.users:
        assert u.first_prompt[:spec.system_tokens] == shared  # the shared system prompt
        assert spec.context_min <= u.context_tokens <= spec.context_max
        assert len(u.questions) == spec.rounds - 1 and len(u.think_s) == spec.rounds - 1
    assert a.users[0].first_prompt != a.users[1].first_prompt
    other = build_workload(model, WorkloadSpec(users=3, rounds=2, seed=8))
    assert other.users[0].first_prompt != a.users[0].first_prompt
    with pytest.raises(WorkloadError, match="max model length"):
        WorkloadSpec(context_max=8000).check(4096)


def _result(user: int, rnd: int, ttft: float, ok: bool = True) -> RequestResult:
    return RequestResult(user=user, round=rnd, server=0, prompt_tokens=100, ok=ok,
                         error="" if ok else "HTTP 500", ttft_s=ttft if ok else None,
                         itl_s=[0.01, 0.02], output_tokens=3 if ok else 0)


def test_figures_and_ratios() -> None:
    fig = report.summarise([_result(0, 0, 1.0), _result(0, 1, 0.5), _result(1, 0, 2.0, ok=False)],
                           wall_s=2.0)
    assert fig["errors"] == 1 and fig["requests"] == 3
    assert fig["ttft_mean_s"] == 0.75 and fig["ttft_p50_s"] == 0.75
    assert fig["output_tok_per_s"] == 3.0 and fig["ttft_mean_by_round_s"] == {"1": 1.0, "2": 0.5}
    runs = {"vllm": {"ttft_mean_s": 2.0, "ttft_p99_s": 4.0, "output_tok_per_s": 10.0},
            "vllm_cpu_offload": {"ttft_mean_s": 1.0, "ttft_p99_s": 2.0, "output_tok_per_s": 20.0},
            "vllm_tiered_fs": {"ttft_mean_s": 1.5, "ttft_p99_s": 1.0, "output_tok_per_s": 25.0},
            "lmcache": {"skipped": "not installed"},
            "kvstrata": {"ttft_mean_s": 0.5, "ttft_p99_s": 0.5, "output_tok_per_s": 25.0,
                         "errors": 1}}
    r = report.ratios(runs)
    assert r["ttft_mean_vs_vllm"] == 0.25 and r["ttft_mean_vs_native_best"] == 0.5
    assert r["ttft_p99_vs_native_best"] == 0.5 and r["throughput_vs_native_best"] == 1.0
    assert r["throughput_vs_vllm"] == 2.5 and r["ttft_mean_vs_lmcache"] is None
    assert r["errors"] == 1


def test_the_floor_counts_what_no_earlier_request_had_sent() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2 and common_prefix([], [1]) == 0
    assert common_prefix([7, 8], [7, 8, 9]) == 2 and common_prefix([9], [8]) == 0
    seen = SeenPrefixes()
    system, ctx_a, ctx_b = [1] * 10, [2] * 30, [3] * 20
    first_a = system + ctx_a
    assert seen.reusable(first_a) == 0
    a = seen.add(first_a)
    # The second user shares the system prompt with the first, whose prefill is under way.
    assert seen.reusable(system + ctx_b) == 10
    seen.add(system + ctx_b)
    # The first user's next round: its prompt, its answer (once it finished) and a question.
    answer, question = [4] * 5, [5] * 3
    assert seen.reusable(first_a + answer + question) == 40  # the answer is not known yet
    seen.extend(a, first_a + answer)
    assert seen.reusable(first_a + answer + question) == 45
    results = [RequestResult(user=0, round=0, server=0, prompt_tokens=40, reusable_tokens=0),
               RequestResult(user=1, round=0, server=0, prompt_tokens=30, reusable_tokens=10),
               RequestResult(user=0, round=1, server=0, prompt_tokens=48, reusable_tokens=45),
               RequestResult(user=0, round=2, server=0, prompt_tokens=48, reusable_tokens=48)]
    # Each prompt past its reusable prefix, and at least the one token vLLM always computes.
    assert report.floor_tokens(results) == 40 + 20 + 3 + 1
    assert report.summarise(results, wall_s=1.0)["floor_tokens"] == 64
    hits = {"vllm_prefix_cache": 30.0, "external": 50.0, "kvstrata_disk": 50.0}
    assert report.computed_tokens(166, hits) == 86
    assert report.computed_tokens(166, {"vllm_prefix_cache": 30.0}) == 136  # no connector
    assert report.computed_tokens(166, {}) is None  # the server did not report


def test_computed_tokens_are_compared_with_the_peer_that_computed_fewest() -> None:
    runs = {"vllm": {"ttft_mean_s": 2.0, "computed_tokens": 900},
            "vllm_cpu_offload": {"ttft_mean_s": 1.0, "computed_tokens": 700},
            "vllm_tiered_fs": {"ttft_mean_s": 1.5, "computed_tokens": 500},
            "kvstrata": {"ttft_mean_s": 0.5, "computed_tokens": 450}}
    assert report.ratios(runs)["computed_tokens_vs_native_best"] == 0.9
    runs["vllm_tiered_fs"]["computed_tokens"] = None
    assert report.ratios(runs)["computed_tokens_vs_native_best"] == round(450 / 700, 3)
    del runs["kvstrata"]["computed_tokens"]
    assert report.ratios(runs)["computed_tokens_vs_native_best"] is None


def test_repeated_runs_pool_every_request_and_spread_each_ratio() -> None:
    def run(ttfts: list[float], wall: float, **extra) -> tuple[dict, list[RequestResult]]:
        results = [_result(i, 0, t) for i, t in enumerate(ttfts)]
        fig = {**report.summarise(results, wall), "ttft_samples_s": ttfts, "clean_stop": True,
               "tracebacks": 0, "shutdown_tracebacks": 1, "stores_clean_shutdown": True,
               "hit_tokens": {"kvstrata_disk": 256.0}, **extra}
        return fig, results

    first = run([1.0, 3.0], 2.0, computed_tokens=120,
                engine_steps={"steps": 4, "context_tokens": 120, "max_running": 2})
    second = run([2.0, 6.0, 10.0], 4.0, kvstrata={"store_jobs": 2.0}, computed_tokens=80)
    fig = report.pooled([first, second, ({"failed": "no start"}, [])])
    assert fig["computed_tokens"] == 200 and fig["floor_tokens"] == 500  # 5 cold 100-token prompts
    assert fig["runs"] == 2 and fig["runs_failed"] == 1 and fig["requests"] == 5
    assert fig["ttft_mean_s"] == 4.4 and fig["ttft_p50_s"] == 3.0
    assert fig["ttft_p99_s"] == report.percentile([1.0, 2.0, 3.0, 6.0, 10.0], 99)
    assert fig["output_tok_per_s"] == 2.5  # 15 tokens over 6 s of the two runs' wall time
    assert fig["ttft_samples_s"] == [1.0, 3.0, 2.0, 6.0, 10.0]
    assert fig["hit_tokens"] == {"kvstrata_disk": 512.0} and fig["kvstrata"] == {"store_jobs": 2.0}
    assert fig["shutdown_tracebacks"] == 2 and fig["clean_stop"] and fig["stores_clean_shutdown"]
    assert fig["engine_steps"]["steps"] == 4 and fig["engine_steps"]["max_running"] == 2
    second[0]["clean_stop"] = False
    assert report.pooled([first, second])["clean_stop"] is False
    second[0]["computed_tokens"] = None  # one run without vLLM's counters: no sum
    assert report.pooled([first, second])["computed_tokens"] is None
    assert report.pooled([({"skipped": "x"}, [])]) == {"skipped": "x"}
    assert serve.run_orders(["vllm", "lmcache", "kvstrata"], 3) == [
        ["vllm", "lmcache", "kvstrata"], ["kvstrata", "lmcache", "vllm"], ["vllm", "lmcache", "kvstrata"]]
    assert serve.run_orders(["kvstrata"], 1) == [["kvstrata"]]
    spread = report.spread([{"ttft_mean_vs_vllm": 0.3, "ttft_p99_vs_native_best": 0.9},
                            {"ttft_mean_vs_vllm": 0.2, "ttft_p99_vs_native_best": None},
                            {"ttft_mean_vs_vllm": 0.25}])
    assert spread["ttft_mean_vs_vllm"] == {"min": 0.2, "median": 0.25, "max": 0.3}
    assert spread["ttft_p99_vs_native_best"] == {"min": 0.9, "median": 0.9, "max": 0.9}
    assert spread["ttft_mean_vs_lmcache"] is None


# A stand-in for the API server where only its port matters: a real process that binds the port
# it is given (failing as vLLM's does when it is taken) and answers /health.
_HEALTH_SERVER = """
import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


class _HealthSpec(ServerSpec):
    def command(self, port: int) -> list[str]:
        return [sys.executable, "-c", _HEALTH_SERVER, str(port)]


def test_a_server_whose_port_was_taken_starts_again_on_another(tmp_path, monkeypatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))  # bound, not listening: a health check is refused at once
        busy = taken.getsockname()[1]
        picks = iter([busy, busy])  # then free ports again
        real_free_port = server.free_port
        monkeypatch.setattr(server, "free_port", lambda: next(picks, None) or real_free_port())
        srv = ApiServer("s", _HealthSpec(model="m", kv_cache_bytes=1), tmp_path / "s.log")
        try:
            server.wait_healthy([srv], deadline_s=60)
            assert srv.port != busy and srv.port_retries == 2
        finally:
            srv.stop()
        assert srv.clean_stop is False  # the stand-in dies of SIGTERM: only vLLM's server exits 0
        # Every pick taken: the start fails, naming why, after START_ATTEMPTS tries.
        monkeypatch.setattr(server, "free_port", lambda: busy)
        srv = ApiServer("t", _HealthSpec(model="m", kv_cache_bytes=1), tmp_path / "t.log")
        try:
            with pytest.raises(ServerError, match=server.PORT_TAKEN):
                server.wait_healthy([srv], deadline_s=60)
            assert srv.port_retries == server.START_ATTEMPTS - 1
        finally:
            srv.stop()


def test_metrics_are_parsed_per_tier() -> None:
    text = "\n".join([
        "# HELP x", 'vllm:kvstrata_hit_tokens_disk_total{engine="0"} 256.0',
        'vllm:kvstrata_hit_tokens_disk_total{engine="1"} 128.0',
        'vllm:kvstrata_hit_tokens_disk_created{engine="0"} 1.7e9',
        'vllm:prompt_tokens_cached_by_source_total{engine="0",source="host"} 64.0',
        "vllm:prefix_cache_hits_total 512.0"])
    m = parse_metrics(text)
    assert m["vllm:kvstrata_hit_tokens_disk_total"] == 384.0
    assert m["vllm:prompt_tokens_cached_by_source_total{source=host}"] == 64.0
    hits = hit_tokens({"vllm:prefix_cache_hits_total": 500.0}, m)
    assert hits["vllm_prefix_cache"] == 12.0 and hits["kvstrata_disk"] == 384.0
    assert hits["by_source_host"] == 64.0


def test_request_phases_are_deltas_of_vllms_histograms() -> None:
    before = parse_metrics("\n".join([
        'vllm:request_queue_time_seconds_sum{engine="0"} 1.5',
        'vllm:request_queue_time_seconds_count{engine="0"} 3.0']))
    after = parse_metrics("\n".join([
        'vllm:request_queue_time_seconds_sum{engine="0"} 7.5',
        'vllm:request_queue_time_seconds_count{engine="0"} 6.0',
        'vllm:request_queue_time_seconds_bucket{engine="0",le="1.0"} 4.0',
        'vllm:request_prefill_time_seconds_sum{engine="0"} 0.9',
        'vllm:request_prefill_time_seconds_count{engine="0"} 3.0']))
    assert phase_sums(before, after) == {"queue": (6.0, 3.0), "prefill": (0.9, 3.0)}


# Lines of a kvstrata server's log (bench serve, SmolLM2, 2026-12-06) as vLLM 0.32 writes them
# with --enable-logging-iteration-details, among lines that are not steps.
_STEP_LOG = """\
(APIServer pid=28392) INFO 12-06 19:04:35 [api_utils.py:286] non-default args: {'enable_logging_iteration_details': True}
(APIServer pid=28392) INFO 12-06 19:05:00 [loggers.py:199] Engine 000: Iteration(0): 1 context requests, 2048 context tokens, 0 generation requests, 0 generation tokens, iteration elapsed time: 2414.60 ms, CPU KV cache usage: 23.2%
(APIServer pid=28392) INFO 12-06 19:05:03 [loggers.py:199] Engine 000: Iteration(1): 2 context requests, 2048 context tokens, 0 generation requests, 0 generation tokens, iteration elapsed time: 2874.66 ms, CPU KV cache usage: 47.8%
(APIServer pid=28392) INFO 12-06 19:05:05 [loggers.py:199] Engine 000: Iteration(2): 1 context requests, 1029 context tokens, 1 generation requests, 1 generation tokens, iteration elapsed time: 1880.09 ms, CPU KV cache usage: 60.9%
(APIServer pid=28392) INFO 12-06 19:05:05 [loggers.py:199] Engine 000: Iteration(3): 0 context requests, 0 context tokens, 2 generation requests, 2 generation tokens, iteration elapsed time: 126.56 ms, CPU KV cache usage: 60.9%
(APIServer pid=28392) INFO 12-06 19:05:05 [loggers.py:199] Engine 000: Iteration(4): 0 context requests, 0 context tokens, 2 generation requests, 2 generation tokens, iteration elapsed time: 63.26 ms, CPU KV cache usage: 60.9%
(APIServer pid=28392) INFO 12-06 19:05:09 [loggers.py:257] Engine 000: Avg prompt throughput: 538.1 tokens/s
"""


def test_engine_steps_are_read_from_the_servers_iteration_lines(tmp_path) -> None:
    log = tmp_path / "kvstrata_0.log"
    log.write_text(_STEP_LOG)
    fig = steps.log_steps(log)
    assert fig == {"steps": 5, "prefill_steps": 3, "shared_prefill_steps": 1, "decode_only_steps": 2,
                   "context_tokens": 5125, "generation_tokens": 5, "prefill_step_s": 7.169,
                   "decode_only_s": 0.19, "max_running": 2,
                   "decode_step_running": 2, "decode_step_ms": 94.91,
                   "decode_steps_by_running": {"2": {"steps": 2, "median_ms": 94.91}}}
    # The machine-speed probe is the median of the full-batch decode-only steps only: a step
    # that decoded fewer requests (a batch draining) is left out.
    draining = _STEP_LOG.splitlines()[5].replace("Iteration(4)", "Iteration(5)").replace(
        "2 generation requests, 2 generation tokens", "1 generation requests, 1 generation tokens"
    ).replace("63.26 ms", "10.00 ms")
    probe = steps.summarise_steps([*_STEP_LOG.splitlines(), draining])
    assert probe is not None and probe["decode_only_steps"] == 3 and probe["decode_step_ms"] == 94.91
    # Per batch size, each its own median: configurations compare at the same batch.
    assert probe["decode_steps_by_running"] == {"1": {"steps": 1, "median_ms": 10.0},
                                                "2": {"steps": 2, "median_ms": 94.91}}
    # Prefill steps only: no decode step to time.
    prefill_only = steps.summarise_steps(_STEP_LOG.splitlines()[:3])
    assert prefill_only is not None and prefill_only["decode_step_ms"] is None
    # A log without step lines (a server started without them) or none at all: no figures.
    assert steps.summarise_steps(_STEP_LOG.splitlines()[:1]) is None
    assert steps.log_steps(tmp_path / "missing.log") is None
    # Two servers (or runs) of one configuration: summed, the most running at once kept.
    other = {**fig, "max_running": 3, "steps": 1, "decode_step_ms": 45.09}
    both = steps.combine([fig, None, other, prefill_only])
    assert both is not None and both["steps"] == 8 and both["max_running"] == 3
    assert both["decode_step_ms"] == 70.0  # the median of the probes that have one
    # Per batch size: steps summed, the median of the servers' medians.
    other_probe = {**probe, "decode_steps_by_running": {"1": {"steps": 4, "median_ms": 20.0},
                                                        "3": {"steps": 1, "median_ms": 150.0}}}
    mixed = steps.combine([probe, other_probe, prefill_only])
    assert mixed is not None and mixed["decode_steps_by_running"] == {
        "1": {"steps": 5, "median_ms": 15.0}, "2": {"steps": 2, "median_ms": 94.91},
        "3": {"steps": 1, "median_ms": 150.0}}
    assert both["context_tokens"] == 14346 and both["prefill_step_s"] == 19.627
    assert steps.combine([None, None]) is None
    # Every server the bench starts logs its steps; a spec may opt out.
    spec = ServerSpec(model="m", kv_cache_bytes=1 << 20)
    assert "--enable-logging-iteration-details" in spec.command(8000)
    spec.log_steps = False
    assert "--enable-logging-iteration-details" not in spec.command(8000)


def test_charts_are_png(tmp_path) -> None:
    path = report.serve_chart(tmp_path / "c.png", {"vllm": [1.0, 2.0], "kvstrata": [0.5]},
                              {"vllm": {"1": 1.5}, "kvstrata": {"1": 0.5, "2": None}}, "t")
    assert path and Path(path).read_bytes()[:4] == b"\x89PNG"
    runs = {"vllm": {"ttft_mean_s": 1.0, "ttft_p50_s": 0.9, "ttft_p90_s": 1.5, "ttft_p99_s": 2.0,
                     "ttft_mean_by_round_s": {"1": 1.0, "2": 1.2}}, "lmcache": {"skipped": "x"}}
    path = report.percentile_chart(tmp_path / "p.png", runs, "t")
    assert path and Path(path).read_bytes()[:4] == b"\x89PNG"
    path = report.sweep_chart(tmp_path / "s.png", {"cold": {"1024": 0.5, "2048": 1.0}}, "t")
    assert path and Path(path).read_bytes()[:4] == b"\x89PNG"


def test_a_peer_that_cannot_run_is_skipped_with_its_reason(tmp_path, monkeypatch) -> None:
    def unavailable(*a, **k):
        raise PeerUnavailable("pip could not install lmcache==0.5.6: no network")

    monkeypatch.setattr(configs, "ensure_lmcache_venv", unavailable)
    base = configs.BaseSettings(model=str(tmp_path), kv_cache_bytes=1 << 20, host_bytes=1 << 20,
                                max_model_len=1024, max_num_seqs=2)
    wl = build_workload(_tiny_dir(tmp_path), WorkloadSpec(users=1, rounds=1, context_min=10,
                                                           context_max=20))
    fig, results = serve.run_config("lmcache", base, wl, tmp_path / "out",
                                    serve.Progress(1, enabled=False))
    assert fig == {"skipped": "pip could not install lmcache==0.5.6: no network"}
    assert results == []


def test_kvstrata_config_may_size_kvstrata_s_host_tier_alone(tmp_path) -> None:
    # --kvstrata-config '{"host_bytes": ...}' used to fail every kvstrata configuration
    # (host_bytes given twice); now it sizes kvstrata's host tier while the peers keep --host-bytes.
    def extra(setup: configs.Setup) -> list[dict]:
        return [spec.kv_transfer_config["kv_connector_extra_config"] for spec in setup.specs]

    base = configs.BaseSettings(model=str(tmp_path), kv_cache_bytes=1 << 20, host_bytes=1 << 27,
                                max_model_len=1024, max_num_seqs=2,
                                kvstrata_options={"host_bytes": "2GiB", "codec": "raw"})
    for name in ("kvstrata", "kvstrata_host_only", "two_replicas"):
        for options in extra(configs.build_setup(name, base, tmp_path / name)):
            assert options["host_bytes"] == "2GiB" and options["codec"] == "raw", name
    assert extra(configs.build_setup("kvstrata_host_only", base, tmp_path / "h"))[0]["disk"] is False
    cpu = configs.build_setup("vllm_cpu_offload", base, tmp_path / "cpu").specs[0]
    assert str(1 << 27) in json.dumps(cpu.kv_transfer_config)  # the peer keeps --host-bytes
    base.kvstrata_options = {}
    assert extra(configs.build_setup("kvstrata", base, tmp_path / "k"))[0]["host_bytes"] == 1 << 27


@pytest.mark.slow
def test_serve_bench_runs_end_to_end_on_a_tiny_model(tmp_path, capsys) -> None:
    # Two users, one round, vLLM alone and kvstrata, one run (the ratios against vLLM's
    # offloading and LMCache are computed by the same code, test_figures_and_ratios; repeated
    # runs' order, pooling and spread in test_repeated_runs_pool_every_request_and_spread_each_
    # ratio; vLLM's fs offloading on CPU runs in tests/benchmarks/test_vllm_fs_baseline.py): two
    # servers keep the suite's time.
    out = tmp_path / "bench"
    argv = ["bench", "serve", "--json", "--tiny", "--no-progress", "--out", str(out),
            "--users", "2", "--rounds", "1", "--context-min", "200", "--context-max", "300",
            "--system-tokens", "64", "--max-tokens", "4", "--max-model-len", "1024",
            "--arrival-rate", "5", "--configs", "vllm,kvstrata",
            "--host-bytes", "16MiB", "--kvstrata-config", '{"zstd_level": 3}']
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    for key in TOP_LEVEL:
        assert key in result, key
    assert result["errors"] == 0, result
    assert Path(result["chart"]).read_bytes()[:4] == b"\x89PNG"
    assert isinstance(result["ttft_mean_vs_vllm"], float), result
    assert "runs" not in result and "repeat" not in result
    for name in ("vllm", "kvstrata"):
        fig = result["configs"][name]
        for key in PER_CONFIG:
            assert key in fig, (name, key)
        assert fig["requests"] == 2 and fig["ttft_mean_s"] is not None, fig
        assert len(fig["ttft_samples_s"]) == 2, fig
        assert fig["tracebacks"] == 0, fig["log_problems"]
        assert fig["clean_stop"] is True, fig
        assert fig["cpu_s"][0]["total"] > 0 and len(fig["requests_detail"]) == 2, fig
        # Two users share the system prompt: the second could reuse it, nothing else.
        reusable = sorted(r["reusable_tokens"] for r in fig["requests_detail"])
        assert reusable[0] == 0 and 64 <= reusable[1] < 300, reusable
        assert fig["floor_tokens"] == fig["prompt_tokens"] - reusable[1], fig
        assert fig["floor_tokens"] <= fig["computed_tokens"] <= fig["prompt_tokens"], fig
        # Each response said how many of its prompt tokens the server did not compute (at
        # least one it always computes); vLLM's counters count a preempted request's hits
        # again when it is admitted again, never less.
        cached = [(r["cached_tokens"], r["prompt_tokens"]) for r in fig["requests_detail"]]
        assert all(isinstance(c, int) and 0 <= c < n for c, n in cached), cached
        assert sum(c for c, _ in cached) <= fig["prompt_tokens"] - fig["computed_tokens"], (cached, fig)
        assert set(fig["phase_mean_s"]) == {"queue", "prefill", "decode"}, fig
        # The engine's steps computed what vLLM's counters say it computed, and decoded
        # every answer token but the first of each request (which its last prefill makes).
        eng = fig["engine_steps"]
        assert eng["context_tokens"] == fig["computed_tokens"], (eng, fig)
        assert eng["generation_tokens"] == fig["output_tokens"] - fig["requests"], (eng, fig)
        assert eng["prefill_steps"] >= 1 and 1 <= eng["max_running"] <= 2, eng
        assert eng["decode_only_steps"] == 0 or eng["decode_step_ms"] > 0, eng
    # Each configuration's stores are deleted once checked (no --keep-stores); the logs stay.
    assert not (out / "work" / "kvstrata").exists() and (out / "logs").is_dir()
    assert result["configs"]["kvstrata"]["disk_free_start_bytes"] > 0
    ours = result["configs"]["kvstrata"]
    assert ours["stores_clean_shutdown"] is True
    assert "kvstrata_disk" in ours["hit_tokens"]
    # kvstrata's own figures, and the options --kvstrata-config added reached its server.
    assert ours["kvstrata"]["store_jobs"] >= 2 and "allocation_failures" in ours["kvstrata"]
    assert "'zstd_level': 3" in (out / "logs" / "kvstrata_0.log").read_text()
    for key in ("ttft_mean_vs_vllm", "throughput_vs_vllm"):
        assert isinstance(result[key], float), key
    assert json.loads((out / "serve.json").read_text())["configs"].keys() == result["configs"].keys()


def test_the_lmcache_shim_gives_vllms_dispatcher_a_safe_vars(tmp_path) -> None:
    # The shim the LMCache environment imports at start-up (bench/peers.py): vLLM's
    # triton_utils.dispatcher gets a vars() that returns {} where the builtin returns a non-dict
    # (llvmlite's ffi.lib once numba is imported), and the builtin's result otherwise.
    import os
    import subprocess
    import sys

    from kvstrata.bench.peers import SHIM_MODULE, SHIM_SOURCE

    (tmp_path / f"{SHIM_MODULE}.py").write_text(SHIM_SOURCE)
    code = (f"import {SHIM_MODULE}\n"
            "import vllm.triton_utils.dispatcher as d\n"
            "class Fake:\n"
            "    @property\n"
            "    def __dict__(self):\n"
            "        return 'not a dict'\n"
            "assert d.vars(Fake()) == {}\n"
            "class Real:\n"
            "    pass\n"
            "r = Real(); r.x = 1\n"
            "assert d.vars(r) == {'x': 1}\n"
            "print('ok')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def _processes_naming(text: str) -> list[int]:
    """Live processes whose command line contains ``text`` (zombies excluded)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if text.encode() in (entry / "cmdline").read_bytes() and \
                    (entry / "stat").read_text().split(") ")[-1][:1] != "Z":
                found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.mark.slow
def test_a_bench_stopped_by_sigterm_stops_its_servers(tmp_path) -> None:
    """``kill`` of a running ``bench serve`` (a job scheduler's stop, a container's): the API
    servers run in sessions of their own and outlived it before SIGTERM unwound the command as
    Ctrl-C does; now each is stopped, and the command exits with 143. Watched failing without
    the handler (the server stayed, the command died by the signal)."""
    import contextlib
    import os
    import signal
    import subprocess
    import time

    out = tmp_path / "bench"
    argv = [sys.executable, "-m", "kvstrata.tools.cli", "bench", "serve", "--tiny", "--no-progress",
            "--out", str(out), "--users", "4", "--rounds", "3", "--context-min", "200",
            "--context-max", "300", "--system-tokens", "64", "--max-tokens", "4",
            "--max-model-len", "1024", "--arrival-rate", "0.2", "--configs", "kvstrata",
            "--host-bytes", "16MiB"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = out / "logs" / "kvstrata_0.log"
    deadline = time.monotonic() + 240
    try:
        # Serving: vLLM's API server says so once it answers.
        while not (log.exists() and "Application startup complete" in log.read_text(errors="replace")):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the server never started"
            time.sleep(0.5)
        servers = _processes_naming(str(out / "work"))
        assert servers, "no server process found"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    left = [pid for pid in servers if pid in _processes_naming(str(out / "work"))]
    for pid in left:  # a failure here must not leave a server (and its engine) running on
        with contextlib.suppress(ProcessLookupError):
            os.killpg(os.getpgid(pid), signal.SIGKILL)
    assert proc.returncode == 143, err[-2000:]
    assert "kvstrata: terminated" in err
    assert left == [], left

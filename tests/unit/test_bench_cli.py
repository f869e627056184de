"""The benchmark commands' argument handling (the benchmarks themselves run real engines for
minutes and print timings: they are run by hand, never as timed tests)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstrata.tools.cli import build_parser, main


def test_bench_e2e_options() -> None:
    parser = build_parser()
    plain = parser.parse_args(["bench", "e2e", "--json"])
    assert (plain.prompt_tokens, plain.repeat, plain.in_process) == (4096, 1, False)
    assert parser.parse_args(["bench", "e2e", "--repeat", "3"]).repeat == 3  # both spellings
    assert parser.parse_args(["bench", "e2e", "--repeats", "2"]).repeat == 2
    assert parser.parse_args(["bench", "e2e", "--kvstrata-config", '{"codec": "raw"}']).kvstrata_config == {
        "codec": "raw"}


@pytest.mark.parametrize(("value", "message"), [
    ("[1]", "expected a JSON object"),
    ("{codec", "not JSON"),
    ('{"codek": "raw"}', "codek"),
])
def test_bench_e2e_checks_kvstrata_options_up_front(value, message, capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "e2e", "--kvstrata-config", value])
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["--vs-vllm-fs"],  # the side-by-side comparison lives in benchmarks/bench_vs_vllm.py
    ["--prompt-tokens", "2048", "4096"],  # one length
])
def test_bench_e2e_refuses_what_moved_to_benchmarks(argv, capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "e2e", *argv])
    assert "unrecognized arguments" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    (["--prompt-tokens", "10"], "--prompt-tokens must be between 64 and 8176"),
    (["--prompt-tokens", "8100", "--max-tokens", "100"], "between 64 and 8092"),
    (["--repeat", "0"], "--repeat must be at least 1"),
])
def test_bench_e2e_rejects_bad_options_before_starting_anything(argv, message, capsys) -> None:
    assert main(["bench", "e2e", *argv]) != 0
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    (["--prompt-tokens", "10"], "--prompt-tokens must be between 64 and 8152"),  # 40 tokens answer
    (["--prompt-tokens", "8177", "--max-tokens", "16"], "between 64 and 8176"),
])
def test_demo_takes_prompts_up_to_the_context_minus_the_answer(argv, message, capsys, tmp_path) -> None:
    # The same bound as bench e2e (it was a fixed 8000); checked before the store or model.
    assert main(["demo", "--store", str(tmp_path / "store"), *argv]) != 0
    assert message in capsys.readouterr().err
    assert not (tmp_path / "store").exists()


def test_bench_overhead_options_and_workloads() -> None:
    from kvstrata.bench.overhead import workload_batches

    args = build_parser().parse_args(["bench", "overhead", "--prompts", "6", "--prompt-tokens", "64",
                                      "--batches", "3", "--workload", "mixed"])
    assert (args.prompts, args.prompt_tokens, args.batches, args.workload) == (6, 64, 3, "mixed")
    assert args.configs[0] == "none"
    assert "vllm_cache_all" not in args.configs  # the reference runs only when named
    fresh = workload_batches("no_reuse", args)
    assert len(fresh) == 3 and all(len(b) == 6 and all(len(p) == 64 for p in b) for b in fresh)
    assert len({tuple(p[:8]) for b in fresh for p in b}) == 18  # nothing shared
    mixed = workload_batches("mixed", args)
    assert mixed[0] == workload_batches("mixed", args)[0]  # seeded: the same for every engine
    for b in (1, 2):  # half of each later batch extends a prompt of the batch before
        assert [p[:56] for p in mixed[b][:3]] == [p[:56] for p in mixed[b - 1][:3]]
        assert all(p[:56] not in [q[:56] for q in mixed[b - 1]] for p in mixed[b][3:])


def test_bench_overhead_needs_the_baseline(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "overhead", "--configs", "default"])


def test_bench_overhead_sizes_vllms_cache_below_the_shared_prefixes() -> None:
    from kvstrata.bench.overhead import KV_BYTES_PER_TOKEN, engine_options

    args = build_parser().parse_args(["bench", "overhead", "--prompts", "10", "--prompt-tokens", "90",
                                      "--max-tokens", "10"])
    assert args.device_cache_batches == 0.5
    opts = engine_options(Path("/m"), {}, Path("/s"), args)
    assert opts.kv_cache_memory_bytes == 10 * 100 * KV_BYTES_PER_TOKEN // 2
    # The reference: vLLM alone, its cache holding every batch of the run (3 by default) and more.
    reference = engine_options(Path("/m"), None, Path("/s"), args, cache_all=True)
    assert reference.store is None and reference.kv_cache_memory_bytes == 10 * 100 * KV_BYTES_PER_TOKEN * 4
    with pytest.raises(SystemExit):
        main(["bench", "overhead", "--device-cache-batches", "0"])


def test_bench_overhead_reports_kvstratas_saving_against_the_reference() -> None:
    from kvstrata.bench.overhead import _report

    def rows(*batch_s: float) -> list[dict]:
        return [{"batch_s": list(batch_s), "hit_tokens": 0, "vllm_prefix_hits": 0, "disk_write_MBps": 0.0,
                 "chunks_written": 0, "chunks_dropped": 0, "thread_cpu_s_per_batch": {},
                 "io_bytes_per_batch": {}}]
    args = build_parser().parse_args(["bench", "overhead"])
    out = _report({"no_reuse": {"none": rows(10.0, 10.0), "default": rows(10.4, 10.4),
                                "vllm_cache_all": rows(9.8, 9.8)},
                   "mixed": {"none": rows(10.0, 10.0), "default": rows(7.0, 7.0),
                             "vllm_cache_all": rows(6.0, 6.0)}}, args)
    assert out["no_reuse_ideal_time_ratio"] == 0.98  # what the reference's larger cache alone gives
    assert out["mixed_time_ratio"] == 0.7 and out["mixed_ideal_time_ratio"] == 0.6
    assert out["mixed_share_of_ideal"] == 0.75  # 30 % saved of the 40 % any cache could save
    assert out["goals"]["mixed_time_ratio"]["met"] is True

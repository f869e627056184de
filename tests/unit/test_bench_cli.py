"""The benchmark commands' argument handling (the benchmarks themselves run real engines for
minutes and print timings: they are run by hand, never as timed tests)."""

from __future__ import annotations

import pytest

from kvstrata.tools.cli import build_parser, main


def test_bench_e2e_takes_the_side_by_side_options() -> None:
    parser = build_parser()
    plain = parser.parse_args(["bench", "e2e", "--json"])
    assert (plain.prompt_tokens, plain.repeat, plain.vs_vllm_fs, plain.in_process) == (None, None, False, False)
    side = parser.parse_args(["bench", "e2e", "--vs-vllm-fs", "--prompt-tokens", "4096", "8192",
                              "--repeats", "2", "--vllm-copy-threads", "2"])
    assert (side.prompt_tokens, side.repeat, side.vs_vllm_fs, side.vllm_copy_threads) == ([4096, 8192], 2, True, 2)
    assert parser.parse_args(["bench", "e2e", "--repeat", "3"]).repeat == 3  # both spellings
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


@pytest.mark.parametrize(("argv", "message"), [
    (["--prompt-tokens", "2048", "4096"], "several lengths only with --vs-vllm-fs"),
    (["--prompt-tokens", "10"], "--prompt-tokens must be between 64 and 8176"),
    (["--prompt-tokens", "8100", "--max-tokens", "100"], "between 64 and 8092"),
    (["--repeat", "0"], "--repeat must be at least 1"),
    (["--vs-vllm-fs", "--repeats", "0"], "--repeats must be >= 1"),
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

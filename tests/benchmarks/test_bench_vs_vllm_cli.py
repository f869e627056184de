"""``python -m benchmarks.bench_vs_vllm``'s argument handling (the comparison itself runs real
engines for many minutes and prints timings: it is run by hand, never as a timed test)."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import pytest

from benchmarks import bench_vs_vllm, profile_disk_ttft


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    bench_vs_vllm.add_arguments(parser)
    return parser


def test_side_by_side_options() -> None:
    args = _parser().parse_args(["--prompt-tokens", "4096", "8192", "--repeats", "2",
                                 "--vllm-copy-threads", "2", "--kvstrata-config",
                                 '{"codec": "raw"}'])
    assert (args.prompt_tokens, args.repeat, args.vllm_copy_threads) == ([4096, 8192], 2, 2)
    assert args.kvstrata_config == {"codec": "raw"}
    defaults = _parser().parse_args([])
    assert (defaults.prompt_tokens, defaults.repeat, defaults.in_process) == (
        list(bench_vs_vllm.DEFAULT_PROMPT_TOKENS), None, False)
    assert _parser().parse_args(["--repeat", "3"]).repeat == 3  # both spellings


def test_kvstrata_options_are_checked_up_front(capsys) -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["--kvstrata-config", '{"codek": "raw"}'])
    assert "codek" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--repeats", "0"], ["--prompt-tokens", "10"]])
def test_bad_options_are_refused_before_starting_anything(argv, capsys) -> None:
    assert bench_vs_vllm.main(argv) == 2
    assert "--repeats must be >= 1 and every --prompt-tokens >= 64" in capsys.readouterr().err


def test_the_profiler_takes_the_same_options_and_its_own_prompt_length() -> None:
    # profile_disk_ttft defines --prompt-tokens (one length) before adding bench_vs_vllm's.
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompt-tokens", type=int, default=8192)
    bench_vs_vllm.add_arguments(parser)
    args = parser.parse_args(["--prompt-tokens", "4096", "--vllm-copy-threads", "2"])
    assert (args.prompt_tokens, args.vllm_copy_threads) == (4096, 2)
    assert profile_disk_ttft.SYSTEM_TARGETS["vllm_fs"][-1].startswith("benchmarks.vllm_fs_baseline:")


def test_the_package_never_imports_the_benchmarks() -> None:
    # benchmarks/ is not in the wheel, and the comparison builds on kvstrata's own bench (not the
    # other way round): no module of the package may import it.
    import kvstrata

    offenders = []
    for path in Path(kvstrata.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] == "benchmarks"]
    assert offenders == []

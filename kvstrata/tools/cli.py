"""The ``kvstrata`` command line.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and ``run(args)``; the
module is imported only when its subcommand runs, so ``kvstrata --help`` and the store tools start
fast and never import vLLM unless they need it. ``run`` returns a dict (printed as JSON with
``--json``, as an aligned summary otherwise) or an exit code.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import signal
import sys
import threading
from typing import Any

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("kvstrata.tools.demo", "run a real vLLM engine with kvstrata: cold, host tier, restart, disk tier"),
    "warmup": ("kvstrata.tools.warmup", "fill a store offline by running vLLM over a JSONL corpus (prefill only)"),
    "inspect": ("kvstrata.tools.inspect", "what a store holds: fingerprints, chunks, bytes, ratio, ages, budget"),
    "verify": ("kvstrata.tools.verify", "check every record's checksum and the index; --repair drops bad records"),
    "compact": ("kvstrata.tools.compact", "evict down to a budget and rewrite the LMDB file compacted"),
    "export": ("kvstrata.tools.archive_export", "write a portable checksummed archive of a store (or one model)"),
    "import": ("kvstrata.tools.archive_import", "verify an archive, then merge it into a store (all or nothing)"),
    "purge": ("kvstrata.tools.purge", "remove one model's (fingerprint's) chunks from a store"),
    "gpu-check": ("kvstrata.tools.gpu_check", "on a CUDA/XPU machine: device tests, stager GB/s, demo TTFTs, decode ITL"),
}
BENCHES: dict[str, tuple[str, str]] = {
    "disk": ("kvstrata.bench.disk", "disk tier vs raw file I/O (MB/s, compression ratio)"),
    "tiers": ("kvstrata.bench.tiers", "host tier vs memcpy, batched lookup cost, prefetch overlap"),
    "e2e": ("kvstrata.bench.e2e", "time to first token on a real vLLM engine: cold, host, disk"),
    "overhead": ("kvstrata.bench.overhead", "what kvstrata costs a workload without reuse, and a mixed one"),
    "remote": ("kvstrata.bench.remote", "shared tier (Redis): load rate vs plain GET, bytes, TTFT vs disk"),
    "serve": ("kvstrata.bench.serve", "the OpenAI server under multi-round long-context load vs vLLM alone, "
              "vLLM's offloading, LMCache"),
}


def _add_module_parser(sub: Any, name: str, module: str, help_text: str) -> None:
    parser = sub.add_parser(name, help=help_text, description=help_text)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(_module=module)
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:  # a missing optional dependency must not break the other commands
        parser.set_defaults(_import_error=str(exc))
        return
    mod.add_arguments(parser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvstrata",
        description="kvstrata: a disk-tiered KV-cache offload backend for vLLM "
        "(device -> host -> zstd-compressed LMDB).",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in COMMANDS.items():
        _add_module_parser(sub, name, module, help_text)
    bench = sub.add_parser("bench", help="benchmarks that print JSON (never timed tests)")
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for name, (module, help_text) in BENCHES.items():
        _add_module_parser(bench_sub, name, module, help_text)
    return parser


def _print_human(result: dict[str, Any]) -> None:
    width = max((len(k) for k in result), default=0)
    for key, value in result.items():
        if isinstance(value, (dict, list)):
            value = json.dumps(value, default=str)
        print(f"{key:<{width}}  {value}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if getattr(args, "_import_error", None):
        print(f"kvstrata: this command needs a missing dependency: {args._import_error}", file=sys.stderr)
        return 2
    module = importlib.import_module(args._module)
    on_main_thread = threading.current_thread() is threading.main_thread()
    # Python sets signal handlers on the main thread only (tests call main() from others).
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if on_main_thread else None
    try:
        result = module.run(args)
    except Terminated:
        print("kvstrata: terminated", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("kvstrata: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `kvstrata inspect DIR | head`
        return 0
    except CLIError as exc:
        print(f"kvstrata {args.command}: {exc}", file=sys.stderr)
        return 2
    finally:
        if on_main_thread:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
    if isinstance(result, int):
        return result
    if result is None:
        return 0
    exit_code = int(result.pop("_exit_code", 0)) if isinstance(result, dict) else 0
    if args.json:
        print(json.dumps(result, default=str))
    else:
        _print_human(result)
    return exit_code


class CLIError(Exception):
    """A user-facing error: printed as one line naming what is wrong, exit status 2."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (a job scheduler, ``kill``, a container's stop) unwinds a command as Ctrl-C does,
    so that what it started is stopped and what it opened is closed: the API servers of ``bench
    serve`` run in sessions of their own and outlived a benchmark killed by the default action."""


def _on_sigterm(signum: int, frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second one ends the process at once
    raise Terminated


if __name__ == "__main__":
    # Run as ``python -m``: import the package's module so tools' CLIError is this same class.
    from kvstrata.tools.cli import main as _main

    sys.exit(_main())

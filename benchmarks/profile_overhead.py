"""Where the time of ``kvstrata bench overhead`` goes: the GIL, each thread, syscalls, writeback.

Runs one configuration of the overhead benchmark (same workloads, model and engine options as
``kvstrata bench overhead``) in this process, warm-up batch first, and over the timed batches:

* samples every thread with py-spy (``--nonblocking``: the process is never stopped) twice at
  once: once only the thread holding the GIL (``--gil``), once every thread not asleep (running,
  or runnable and waiting for a CPU: an idle-priority thread on a busy machine is mostly the
  latter). Per thread (named as in the bench: pool suffixes dropped): seconds holding the GIL
  and seconds runnable, and for the main thread (vLLM's scheduler, the model's Python and the connector
  hooks) the share of its GIL time spent in kvstrata's code, with the kvstrata functions that
  hold it longest (the innermost kvstrata frame of each sample);
* CPU seconds per thread (``/proc/self/task``, as the bench reports them);
* this process's syscalls and storage bytes (``/proc/self/io``: ``syscr``, ``syscw``,
  ``read_bytes``, ``write_bytes``, ``cancelled_write_bytes``) and the machine's page-cache
  writeback (``/proc/vmstat``: pages dirtied and written; the largest ``nr_dirty`` and
  ``nr_writeback`` seen, sampled every 0.2 s).

py-spy comes with the ``test`` extra (``scripts/env.sh`` installs it). Sampling is not free on a
2-core machine (two samplers at 100 Hz made 22-second batches take 31-36 s here; the default 25
Hz costs less): read the attributions, and compare batch times only between runs of this
profiler, never with the bench's.

The workload options are the bench's (``--prompts``, ``--prompt-tokens``, ``--batches``,
``--device-cache-batches``, ``--kvstrata-config``, ``--store`` ...); ``--configs`` and ``--rounds``
do not apply (one engine, one configuration).

    .venv/bin/python -m benchmarks.profile_overhead --workload mixed --config default
    .venv/bin/python -m benchmarks.profile_overhead --workload mixed --config none
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import kvstrata
from kvstrata.bench import overhead as bench_overhead
from kvstrata.bench.e2e import smollm2
from kvstrata.tools.engine import build_llm, generate, shutdown_llm, thread_cpu_seconds

KVSTRATA_DIR = str(Path(kvstrata.__file__).resolve().parent) + os.sep
# The CLI and its engine harness call vLLM (``generate``): not the connector's time.
HARNESS_DIR = KVSTRATA_DIR + "tools" + os.sep
IO_FIELDS = ("syscr", "syscw", "read_bytes", "write_bytes", "cancelled_write_bytes")
VMSTAT_COUNTERS = ("nr_dirtied", "nr_written", "pgpgout")
VMSTAT_LEVELS = ("nr_dirty", "nr_writeback")
# py-spy's raw format: "<thread>;<frame>;...;<frame> <count>", the thread as
# "thread (<id>): <name>" (or "thread (<id>)" for a thread without a Python name), a frame as
# "<function> (<file>:<line>)".
_THREAD = re.compile(r"^thread \((?:0x)?[0-9a-fA-F]+\)(?::\s*(?P<name>.*))?$")
_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*?)(?::\d+)?\)$")


def thread_label(name: str | None) -> str:
    """The bench's thread names: a pool thread's ``_N`` suffix dropped."""
    if not name:
        return "native"
    return name.rstrip("0123456789").rstrip("_-") or name


def parse_raw(text: str) -> list[tuple[str, list[tuple[str, str]], int]]:
    """py-spy raw samples as ``(thread label, [(function, file)] outermost first, count)``."""
    out = []
    for line in text.splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        parts = stack.split(";")
        m = _THREAD.match(parts[0])
        if m is None:
            continue
        frames = []
        for part in parts[1:]:
            f = _FRAME.match(part)
            frames.append((f["func"], f["file"]) if f else (part, ""))
        out.append((thread_label(m["name"]), frames, int(count)))
    return out


def in_kvstrata(file: str) -> bool:
    """A frame of kvstrata's serving code (the connector, the tiers), not of its tools."""
    return file.startswith(KVSTRATA_DIR) and not file.startswith(HARNESS_DIR)


def summarise(gil: str, running: str, rate: int, *, top: int = 12) -> dict[str, Any]:
    """Per thread: seconds holding the GIL and seconds runnable; for the main thread, kvstrata's
    share of its GIL time and the kvstrata functions holding it longest."""
    per_thread: dict[str, dict[str, float]] = {}
    main_gil = main_kv = 0
    kv_funcs: Counter[str] = Counter()
    for label, frames, n in parse_raw(gil):
        per_thread.setdefault(label, {"gil_s": 0.0, "runnable_s": 0.0})["gil_s"] += n / rate
        if label == "MainThread":
            main_gil += n
            inner = next((f for f in reversed(frames) if in_kvstrata(f[1])), None)
            if inner is not None:
                main_kv += n
                kv_funcs[f"{inner[0]} ({inner[1].removeprefix(KVSTRATA_DIR)})"] += n
    for label, _frames, n in parse_raw(running):
        per_thread.setdefault(label, {"gil_s": 0.0, "runnable_s": 0.0})["runnable_s"] += n / rate
    return {
        "threads": {k: {m: round(v, 3) for m, v in d.items()}
                    for k, d in sorted(per_thread.items(), key=lambda kv: -kv[1]["gil_s"])},
        "main_thread_gil_s": round(main_gil / rate, 3),
        "main_thread_gil_in_kvstrata_s": round(main_kv / rate, 3),
        "main_thread_kvstrata_functions_s": {k: round(n / rate, 3) for k, n in kv_funcs.most_common(top)},
    }


def read_io() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/io").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in IO_FIELDS:
            out[key] = int(value)
    return out


def read_vmstat() -> dict[str, int]:
    out = {}
    for line in Path("/proc/vmstat").read_text().splitlines():
        key, _, value = line.partition(" ")
        if key in VMSTAT_COUNTERS or key in VMSTAT_LEVELS:
            out[key] = int(value)
    return out


class WritebackSampler:
    """The largest dirty / under-writeback page counts seen while it runs (every 0.2 s)."""

    def __init__(self, interval_s: float = 0.2) -> None:
        self.peaks = dict.fromkeys(VMSTAT_LEVELS, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), name="writeback-sampler",
                                        daemon=True)

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            now = read_vmstat()
            for k in VMSTAT_LEVELS:
                self.peaks[k] = max(self.peaks[k], now.get(k, 0))

    def __enter__(self) -> WritebackSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


class PySpy:
    """``py-spy record`` of this process into a raw file, stopped (SIGINT) on exit."""

    def __init__(self, out: Path, rate: int, gil: bool) -> None:
        exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        if not Path(exe).exists():
            raise SystemExit("profile_overhead: py-spy not found (scripts/env.sh installs it)")
        cmd = [exe, "record", "--pid", str(os.getpid()), "--rate", str(rate), "--format", "raw",
               "--threads", "--full-filenames", "--nonblocking", "-o", str(out)]
        self.out = out
        self.cmd = [*cmd, "--gil"] if gil else cmd
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> PySpy:
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(1.0)  # attached before the batches start
        if self.proc.poll() is not None:
            raise SystemExit(f"profile_overhead: py-spy failed: {self.proc.stderr.read().decode()[-500:]}")  # type: ignore[union-attr]
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None
        self.proc.send_signal(2)
        self.proc.wait(timeout=60)

    def text(self) -> str:
        return self.out.read_text() if self.out.exists() else ""


def run(args: argparse.Namespace) -> dict[str, Any]:
    def say(msg: str) -> None:
        print(f"profile overhead: {msg}", file=sys.stderr, flush=True)

    if args.config not in bench_overhead.CONFIGS:
        raise SystemExit(f"profile_overhead: --config must be one of {list(bench_overhead.CONFIGS)}")
    model = smollm2(args, say)
    batches = bench_overhead.workload_batches(args.workload, args)
    if args.store is not None:
        args.store.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kvstrata-profile-overhead-", dir=args.store))
    try:
        opts = bench_overhead.engine_options(
            model, bench_overhead.CONFIGS[args.config], work / "store", args,
            cache_all=args.config == bench_overhead.REFERENCE)
        say(f"{args.workload}/{args.config}: starting the engine")
        llm = build_llm(opts)
        try:
            say("warm-up batch")
            generate(llm, batches[0], args.max_tokens)
            cpu0, io0, vm0 = thread_cpu_seconds(), read_io(), read_vmstat()
            with PySpy(work / "gil.txt", args.rate, gil=True) as gil, \
                    PySpy(work / "running.txt", args.rate, gil=False) as running, \
                    WritebackSampler() as sampler:
                t0 = time.perf_counter()
                walls = []
                for i, batch in enumerate(batches[1:], 1):
                    say(f"batch {i}/{len(batches) - 1}")
                    t = time.perf_counter()
                    generate(llm, batch, args.max_tokens)
                    walls.append(round(time.perf_counter() - t, 3))
                seconds = time.perf_counter() - t0
            cpu1, io1, vm1 = thread_cpu_seconds(), read_io(), read_vmstat()
        finally:
            shutdown_llm(llm)
        profile = summarise(gil.text(), running.text(), args.rate)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    n = len(walls)
    per_batch = {k: round((cpu1.get(k, 0.0) - cpu0.get(k, 0.0)) / n, 3) for k in cpu1
                 if not k.startswith("io:") and cpu1.get(k, 0.0) - cpu0.get(k, 0.0) > 0}
    return {
        "workload": args.workload, "config": args.config, "batch_s": walls,
        "profiled_s": round(seconds, 3), "sample_rate_hz": args.rate,
        "gil_and_runnable_s_per_batch": {
            k: {m: round(v / n, 3) for m, v in d.items()} for k, d in profile["threads"].items()},
        "main_thread_gil_s_per_batch": round(profile["main_thread_gil_s"] / n, 3),
        "main_thread_gil_in_kvstrata_s_per_batch": round(profile["main_thread_gil_in_kvstrata_s"] / n, 3),
        "main_thread_kvstrata_functions_s_per_batch": {
            k: round(v / n, 3) for k, v in profile["main_thread_kvstrata_functions_s"].items()},
        "thread_cpu_s_per_batch": dict(sorted(per_batch.items(), key=lambda kv: -kv[1])),
        "process_io_per_batch": {k: (io1[k] - io0[k]) // n for k in io1},
        "writeback": {**{f"{k}_pages_per_batch": (vm1[k] - vm0[k]) // n for k in VMSTAT_COUNTERS},
                      **{f"peak_{k}_pages": v for k, v in sampler.peaks.items()}},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profile_overhead", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_overhead.add_arguments(parser)
    parser.set_defaults(workload="mixed")
    parser.add_argument("--config", default="default",
                        help=f"one of {', '.join(bench_overhead.CONFIGS)} (default %(default)s)")
    parser.add_argument("--rate", type=int, default=25, help="py-spy samples per second (default %(default)s)")
    args = parser.parse_args(argv)
    if args.workload == "both":
        parser.error("--workload: one of no_reuse, mixed")
    # vLLM logs to stdout by default; the engine runs in this process and stdout is the JSON's.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    print(json.dumps(run(args), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

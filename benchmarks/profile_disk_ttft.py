"""Where a disk-tier first token goes: a timeline of one restarted engine's first request.

For kvstrata or vLLM's fs tier (the contenders of ``benchmarks/bench_vs_vllm.py``, same engine
options):
process 1 stores the prompt (cold request, as in the benchmark); process 2, a real restart with
the page cache dropped, runs the prompt once with timing wrappers around the engine loop, the
model forward, the connector hooks and each system's lookup / disk read / decompress / copy
functions. Each wrapped function reports calls, busy seconds (summed over threads) and its span
(first start, last end) relative to the request's arrival, counting only calls that start before
the first token. Python-level wrappers add a few microseconds per call; the per-block functions
are called at most a few thousand times, so the overhead stays in the low milliseconds.

``cpu_s`` says where the machine's CPU went while the load ran (arrival to the first computing
forward) and during that forward: CPU seconds per thread of each vLLM process (kvstrata's read
pool, its landing copier, vLLM's main loops) and per other process. Each of its four snapshots
costs about 1 ms on the request's path.

With vLLM's multiprocess engine (the benchmark's default) the scheduler and the connector's
scheduler side run in the engine-core process, the model and the connector's worker side in a
worker process it starts. vLLM spawns both: each imports this module as its main module, installs
the same wrappers there and hands its events back in a file when it shuts down.

``.venv/bin/python -m benchmarks.profile_disk_ttft --system vllm_fs --prompt-tokens 8192`` from
the repository root (``--events`` adds every timed call; the ``benchmarks/bench_vs_vllm.py``
options apply). Prints a JSON list, one object per system.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks._env import export_repo_root
from kvstrata.tools.jobs import JobError, child_env, run_job, run_job_subprocess

# "module:Class.method" or "module:function"; missing targets are skipped (versions move).
COMMON_TARGETS = (
    "vllm.v1.core.sched.scheduler:Scheduler.add_request",
    "vllm.v1.engine.core:EngineCore.step",
    "vllm.v1.engine.core:EngineCore.step_with_batch_queue",
    "vllm.v1.core.sched.scheduler:Scheduler.schedule",
    "vllm.v1.core.sched.scheduler:Scheduler.update_from_output",
    "vllm.v1.worker.cpu_model_runner:CPUModelRunner.execute_model",
    "vllm.v1.worker.cpu_model_runner:CPUModelRunner.sample_tokens",
)
SYSTEM_TARGETS = {
    "kvstrata": (
        "kvstrata.connector.connector:StrataConnector.get_num_new_matched_tokens",
        "kvstrata.connector.connector:StrataConnector.update_state_after_alloc",
        "kvstrata.connector.connector:StrataConnector.build_connector_meta",
        "kvstrata.connector.connector:StrataConnector.update_connector_output",
        "kvstrata.connector.connector:StrataConnector.start_load_kv",
        "kvstrata.connector.connector:StrataConnector.wait_for_layer_load",
        "kvstrata.connector.connector:StrataConnector.get_finished",
        "kvstrata.tiers.hierarchy:Hierarchy.lookup_many",
        "kvstrata.tiers.hierarchy:Hierarchy.promote",
        "kvstrata.tiers.hierarchy:Hierarchy._read_chunk",
        "kvstrata.tiers.hierarchy.promoter:Promoter._read",  # the same read, after the tiers split
        "kvstrata.tiers.disk:DiskStore.get_into",
        "kvstrata.tiers.codec:decode_into",
        "kvstrata.tiers.device:DeviceStager.load",
        "kvstrata.tiers.device:DeviceStager._load_cpu",
        "kvstrata.tiers.device.cpu:CpuStager._load_cpu",
    ),
    "vllm_fs": (
        "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector:"
        "OffloadingConnector.get_num_new_matched_tokens",
        "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector:"
        "OffloadingConnector.update_state_after_alloc",
        "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector:"
        "OffloadingConnector.build_connector_meta",
        "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector:"
        "OffloadingConnector.update_connector_output",
        "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector:"
        "OffloadingConnector.start_load_kv",
        "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector:"
        "OffloadingConnector.get_finished",
        "vllm.v1.kv_offload.tiering.manager:TieringOffloadingManager.lookup",
        "vllm.v1.kv_offload.tiering.manager:TieringOffloadingManager.on_schedule_end",
        "vllm.v1.kv_offload.tiering.fs.manager:FsAsyncLookupManager.batch_lookup",
        "vllm.v1.kv_offload.tiering.fs.manager:batch_load_block",
        "vllm.v1.kv_offload.tiering.fs.manager:FileSystemTierManager.get_finished_jobs",
        "benchmarks.vllm_fs_baseline:CPUCopyWorker._copy",
    ),
}
_MODULE = "benchmarks.profile_disk_ttft"
_ARRIVAL = "Scheduler.add_request"
_FORWARD = "CPUModelRunner.execute_model"
_SCHEDULE = "Scheduler.schedule"
# Set by the profiling child for the engine-core process vLLM spawns: where to leave its events,
# and what to wrap there.
_EVENTS_DIR_ENV = "KVSTRATA_PROFILE_EVENTS_DIR"
_TARGETS_ENV = "KVSTRATA_PROFILE_TARGETS"

_events: list[tuple[str, float, float, int]] = []  # (target, start, end, scheduled tokens or -1)
_events_lock = threading.Lock()
_majflt_at_arrival = [0]  # major page faults of this process when the request arrived
_read_at_arrival = [0]  # bytes this process had read from storage then
# CPU snapshots (label, perf_counter time, pid, CPU seconds by row) at the request's arrival, at
# the model's first step after an idle gap, when a computing step is scheduled and around each
# computing forward; vLLM runs the scheduler and the model in separate processes, so each process
# marks its own edges and the profiling child lines them up by time.
_cpu_marks: list[tuple[str, float, int, dict[str, float]]] = []
_last_forward_end = [0.0]  # a forward after an idle gap is the first step of a new request


def _comm(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return "?"


def _cpu_snapshot() -> dict[str, float]:
    """CPU seconds so far: this process's threads (Python name, else the kernel's, numbered
    suffixes folded so a pool is one row) and every other process. Per-thread and per-process
    CPU clocks (``clock_gettime`` on ``(~id << 3) | 6`` and ``| 2``) count in nanoseconds, where
    /proc's tick counters only resolve 10 ms."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    me = os.getpid()
    own = _comm("/proc/self/comm")
    out: dict[str, float] = {}
    for entry in os.listdir("/proc/self/task"):
        tid = int(entry)
        try:
            cpu = time.clock_gettime((~tid << 3) | 6)
        except OSError:
            continue
        name = names.get(tid) or _comm(f"/proc/self/task/{tid}/comm")
        label = f"{own}[{me}] thread " + re.sub(r"[_-]\d+$", "", name)
        out[label] = out.get(label, 0.0) + cpu
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            cpu = time.clock_gettime((~int(entry) << 3) | 2)
        except OSError:
            continue
        out[f"process {_comm(f'/proc/{entry}/comm')}[{entry}]"] = cpu
    return out


def _mark_cpu(label: str) -> None:
    t = time.perf_counter()
    _cpu_marks.append((label, t, os.getpid(), _cpu_snapshot()))


def _read_bytes() -> int:
    """Bytes this process caused to be fetched from storage (reads and page faults)."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))
    except (OSError, StopIteration):
        return 0


def _wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    forward, arrival = name == _FORWARD, name == _ARRIVAL

    if name == _SCHEDULE:
        return _wrap_schedule(fn)

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        if arrival:
            _majflt_at_arrival[0] = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
            _read_at_arrival[0] = _read_bytes()
            _mark_cpu("arrival")
        # For the forward: how many tokens it computes (0 = a step with nothing scheduled).
        tokens = getattr(args[1], "total_num_scheduled_tokens", -1) \
            if forward and len(args) > 1 else -1
        if forward and time.perf_counter() - _last_forward_end[0] > 0.05:
            _mark_cpu("step")
        if tokens > 0:
            _mark_cpu("forward_start")
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            t1 = time.perf_counter()
            if tokens > 0:
                _mark_cpu("forward_end")
            if forward:
                _last_forward_end[0] = time.perf_counter()
            with _events_lock:
                _events.append((name, t0, t1, tokens))

    return timed


def _wrap_schedule(fn: Callable[..., Any]) -> Callable[..., Any]:

    @functools.wraps(fn)
    def scheduled(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        t1 = time.perf_counter()
        if getattr(out, "total_num_scheduled_tokens", 0) > 0:
            _mark_cpu("compute_scheduled")
        with _events_lock:
            _events.append((_SCHEDULE, t0, t1, -1))
        return out

    return scheduled


def install(targets: tuple[str, ...]) -> list[str]:
    """Wrap each importable target; returns the ones installed."""
    done = []
    for target in targets:
        module_name, _, qual = target.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        owner: Any = module
        *path, attr = qual.split(".")
        for part in path:
            owner = getattr(owner, part, None)
        if owner is None or not hasattr(owner, attr):
            continue
        setattr(owner, attr, _wrap(qual, getattr(owner, attr)))
        done.append(qual)
    return done


def _dump_events(out_dir: Path) -> None:
    """This process's events and fault counters, for the profiling child to merge."""
    with _events_lock:
        events = list(_events)
    if not events:
        return
    majflt = resource.getrusage(resource.RUSAGE_SELF).ru_majflt - _majflt_at_arrival[0]
    read = _read_bytes() - _read_at_arrival[0]
    tmp = out_dir / f".{os.getpid()}.json"
    tmp.write_text(json.dumps({"events": events, "major_faults": majflt,
                               "storage_read_bytes": read, "cpu_marks": _cpu_marks}))
    tmp.rename(out_dir / f"{os.getpid()}.json")


def _install_in_engine_core() -> None:
    """In the engine-core process: wrap the targets, and dump the events when it shuts down
    (``EngineCore.shutdown`` runs on vLLM's clean exit; atexit covers the rest)."""
    import atexit

    out_dir = Path(os.environ[_EVENTS_DIR_ENV])
    install(tuple(json.loads(os.environ[_TARGETS_ENV])))
    dumped = [False]

    def dump_once() -> None:
        if not dumped[0]:
            dumped[0] = True
            _dump_events(out_dir)

    from vllm.v1.engine.core import EngineCore

    shutdown = EngineCore.shutdown

    def shutdown_and_dump(self: Any, *args: Any, **kwargs: Any) -> Any:
        dump_once()
        return shutdown(self, *args, **kwargs)

    EngineCore.shutdown = shutdown_and_dump  # type: ignore[method-assign]
    atexit.register(dump_once)


def _merge_engine_core_events(out_dir: Path) -> dict[str, int]:
    """Add the engine-core process's events to this process's; its fault counters."""
    totals = {"major_faults": 0, "storage_read_bytes": 0}
    for path in sorted(out_dir.glob("[0-9]*.json")):
        data = json.loads(path.read_text())
        with _events_lock:
            _events.extend(tuple(e) for e in data["events"])
        for k in totals:
            totals[k] += int(data[k])
        _cpu_marks.extend(tuple(m) for m in data.get("cpu_marks", ()))
    return totals


def _request_calls(ttft_s: float) -> tuple[float, list[tuple[str, float, float, int]]]:
    """The request's arrival time and the wrapped calls that started between it and its first
    token (none without an arrival)."""
    with _events_lock:
        events = list(_events)
    arrivals = [e for e in events if e[0] == _ARRIVAL]
    if not arrivals:
        return 0.0, []
    t0 = arrivals[-1][1]
    return t0, [e for e in events if e[0] != _ARRIVAL and t0 <= e[1] <= t0 + ttft_s]


def summarise(ttft_s: float) -> dict[str, Any]:
    """Per target, the calls that started between the request's arrival and its first token."""
    t0, calls = _request_calls(ttft_s)
    out: dict[str, Any] = {}
    for name, s, e, tokens in calls:
        row = out.setdefault(name, {"calls": 0, "busy_s": 0.0, "first_s": s - t0,
                                    "last_end_s": 0.0})
        row["calls"] += 1
        row["busy_s"] += e - s
        # Per-chunk readers: the first call (cold caches, lazy opens) and the slowest one.
        if row["calls"] == 1:
            row["first_call_s"] = e - s
        row["max_call_s"] = max(row.get("max_call_s", 0.0), e - s)
        row["last_end_s"] = max(row["last_end_s"], e - t0)
        if tokens >= 0:
            key = "compute" if tokens > 0 else "empty"
            row[f"{key}_steps"] = row.get(f"{key}_steps", 0) + 1
            row[f"{key}_s"] = row.get(f"{key}_s", 0.0) + (e - s)
            if tokens > 0:  # few: list them (start, seconds, tokens computed)
                row.setdefault("compute_detail", []).append(
                    [round(s - t0, 4), round(e - s, 4), tokens])
    return {k: {kk: round(v, 4) if isinstance(v, float) else v for kk, v in row.items()}
            for k, row in sorted(out.items(), key=lambda kv: kv[1]["first_s"])}


def window_events(ttft_s: float) -> list[list[Any]]:
    """Every wrapped call that started between the request's arrival and its first token, in
    start order: ``[target, start_s, seconds]`` relative to the arrival (the hand-offs between
    processes and threads, which the per-target summary folds away)."""
    t0, calls = _request_calls(ttft_s)
    return [[name, round(s - t0, 5), round(e - s, 5)]
            for name, s, e, _ in sorted(calls, key=lambda c: c[1])]


def cpu_breakdown(min_s: float = 0.002) -> dict[str, Any]:
    """CPU seconds used while the load ran (the request's arrival to its first computing forward)
    and during that forward: per thread of each vLLM process that marked its edges, and per other
    process on the machine, largest first."""
    arrivals = [m for m in _cpu_marks if m[0] == "arrival"]
    if not arrivals:
        return {}
    t0 = arrivals[-1][1]
    marks = sorted(_cpu_marks, key=lambda m: m[1])
    later = [m for m in marks if m[1] >= t0 - 0.01]
    reporting = {m[2] for m in later}

    def first(pid: int, labels: tuple[str, ...], after: float) -> Any:
        return next((m for m in later if m[2] == pid and m[0] in labels and m[1] >= after), None)

    windows: dict[str, dict[str, float]] = {"load": {}, "forward": {}}
    for pid in sorted(reporting):
        fwd = first(pid, ("compute_scheduled", "forward_start"), t0)
        start = first(pid, ("arrival", "step"), t0 - 0.01)
        if start is None or fwd is not None and start[1] > fwd[1]:
            # vLLM sends the model process no empty steps: its last mark before the arrival
            # (it idles from there, so the window only grows by idle time).
            start = next((m for m in reversed(marks) if m[2] == pid and m[1] <= t0), None)
        end = first(pid, ("forward_end",), t0)
        spans = {"load": (start, fwd), "forward": (fwd, end)}
        for window, (a, b) in spans.items():
            if a is None or b is None:
                continue
            for row, cpu in b[3].items():
                if row.startswith("process ") and row not in a[3]:
                    continue  # started inside the window: its CPU before it is unknown
                # Other processes once (from the process that saw the arrival), never those
                # that report their own threads.
                if row.startswith("process ") and (
                        a[0] != "arrival" and window == "load" or
                        int(row.rsplit("[", 1)[1][:-1]) in reporting):
                    continue
                windows[window][row] = cpu - a[3].get(row, 0.0)
    out: dict[str, Any] = {}
    for window, used in windows.items():
        rows = sorted(((k, v) for k, v in used.items() if v >= min_s), key=lambda kv: -kv[1])
        if rows:
            out[window] = {"all_s": round(sum(max(v, 0.0) for v in used.values()), 4),
                           **{k: round(v, 4) for k, v in rows}}
    return out


def _child(job_file: Path, out_file: Path) -> int:
    job = json.loads(job_file.read_text())
    targets = COMMON_TARGETS + SYSTEM_TARGETS[job["system"]]
    multiprocess = bool(job["engine"].get("multiprocess"))
    # As run_job will set it, before the wrapped modules import vLLM.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
    installed = install(targets)
    with tempfile.TemporaryDirectory(prefix="kvstrata-profile-events-") as events_dir:
        os.environ[_EVENTS_DIR_ENV] = events_dir
        os.environ[_TARGETS_ENV] = json.dumps(targets)
        result = run_job(job)  # shuts the engine down: the engine core has left its events
        engine_core = _merge_engine_core_events(Path(events_dir))
    if multiprocess and not any(e[0] == _ARRIVAL for e in _events):
        raise RuntimeError("the engine-core process left no profile events")
    # Pages read from disk by faults since the request arrived (code or data the page-cache drop
    # evicted), up to the end of the request: a restart cost that is not the KV tier's. With the
    # multiprocess engine, the engine core's arrival marks the start of both processes' counts.
    majflt = resource.getrusage(resource.RUSAGE_SELF).ru_majflt - _majflt_at_arrival[0]
    read = _read_bytes() - _read_at_arrival[0]
    if multiprocess:
        majflt, read = engine_core["major_faults"], engine_core["storage_read_bytes"]
    step = next(s for s in result["steps"] if s.get("name") == "disk")
    ttft_s = float(step["outputs"][0]["ttft_s"])
    out_file.write_text(json.dumps({
        "ttft_s": ttft_s, "multiprocess": multiprocess,
        "cached_tokens": step["outputs"][0]["num_cached_tokens"],
        "page_cache_dropped": any(s["op"] == "drop_page_cache" and s.get("ok")
                                  for s in result["steps"]),
        "major_faults": majflt, "storage_read_bytes": read, "token_ids": step["outputs"][0]["token_ids"],
        "installed": installed, "cpu_s": cpu_breakdown(), "timeline": summarise(ttft_s),
        "events": window_events(ttft_s)}))
    return 0


def profile(system: str, args: argparse.Namespace, store: Path) -> dict[str, Any]:
    """Store the prompt in one process, then profile its disk-served first token in another."""
    from benchmarks.bench_vs_vllm import vllm_fs_contender
    from kvstrata.bench.e2e import kvstrata_contender
    from kvstrata.tools.corpus import chat_prompt
    from kvstrata.tools.models import prepare_smollm2, smollm2_prompt_limit
    from kvstrata.tools.ttft import BYPASS_KVSTRATA

    # The profiling child (python -m) and the engine processes import benchmarks.* by name.
    export_repo_root()
    model = prepare_smollm2(args.model_cache)
    n = min(args.prompt_tokens, smollm2_prompt_limit(args.max_tokens))
    at_n = argparse.Namespace(**{**vars(args), "prompt_tokens": n})
    contender = (kvstrata_contender if system == "kvstrata" else vllm_fs_contender)(model, at_n)
    opts = asdict(contender.options(store))
    prompt = chat_prompt(model, n).token_ids
    gen = {"op": "generate", "prompts": [prompt], "max_tokens": args.max_tokens}
    first = run_job_subprocess({"engine": opts, "steps": [{**gen, "name": "cold"}]},
                               timeout_s=900.0)
    drop = [] if args.no_drop_caches else [{"op": "drop_page_cache"}]
    # As in ttft.measure: the prompt under another salt, the connector bypassed, so one-time
    # kernel setup and the code the page-cache drop would evict are not in the timeline.
    warm = [] if args.no_warmup else [{**gen, "name": "warmup", "max_tokens": 2,
                                       "cache_salt": "kvstrata-profile-warmup",
                                       "kv_transfer_params": BYPASS_KVSTRATA}]
    job = {"system": system, "engine": opts, "steps": [*warm, *drop, {**gen, "name": "disk"}]}
    with tempfile.TemporaryDirectory(prefix="kvstrata-profile-") as tmp:
        job_file, out_file, log = (Path(tmp) / n for n in ("job.json", "out.json", "log"))
        job_file.write_text(json.dumps(job))
        with open(log, "wb") as f:
            rc = subprocess.call([sys.executable, "-m", _MODULE, "--child", str(job_file),
                                  str(out_file)], stdout=f, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, env=child_env(), timeout=900)
        if rc != 0 or not out_file.exists():
            raise JobError(f"profile child exited with {rc}", log.read_text()[-4000:])
        res = json.loads(out_file.read_text())
    cold = first["steps"][0]["outputs"][0]
    res["outputs_identical"] = res.pop("token_ids") == cold["token_ids"]
    events = res.pop("events")
    if args.events:
        res["events"] = events
    return {"system": system, "prompt_tokens": len(prompt), "cold_ttft_s": cold["ttft_s"], **res}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return _child(Path(argv[1]), Path(argv[2]))
    from benchmarks.bench_vs_vllm import add_arguments

    parser = argparse.ArgumentParser(prog="python -m benchmarks.profile_disk_ttft",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--system", choices=sorted(SYSTEM_TARGETS), action="append",
                        help="system(s) to profile (default: both)")
    parser.add_argument("--prompt-tokens", type=int, default=8192)
    parser.add_argument("--events", action="store_true",
                        help="also list every wrapped call of the request, in start order")
    add_arguments(parser)
    args = parser.parse_args(argv)
    out = []
    with tempfile.TemporaryDirectory(prefix="kvstrata-profile-stores-") as tmp:
        for system in args.system or sorted(SYSTEM_TARGETS):
            out.append(profile(system, args, Path(tmp) / system))
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__mp_main__" and os.environ.get(_EVENTS_DIR_ENV):
    # vLLM spawned its engine-core process from the profiling child: this is that process.
    _install_in_engine_core()

if __name__ == "__main__":
    sys.exit(main())

"""Jobs: a real vLLM engine with kvstrata (``engine``) run through a list of steps, in this
process or as a fresh one.

The unit of work is a *job*: engine options plus a list of steps (generate, reset the prefix
cache, drop the page cache, hand-offs between engines). :func:`run_job` executes one in this
process; :func:`run_job_subprocess` executes it in a new Python process, which is how callers get
*real* restarts: a store reopened by a process that has never seen it, with no state left over in
memory.

Child protocol (``python -m kvstrata.tools.jobs JOB RESULT PROGRESS``): the job and the result are
JSON files, progress is a JSON-lines file the parent may poll. vLLM's own logging goes to the
child's stdout/stderr, which the parent sends to a log file and shows only on failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from kvstrata.tools import job_forkserver
from kvstrata.tools.engine import (
    EngineOptions,
    ProgressFn,
    build_llm,
    drop_page_cache,
    generate,
    metrics_delta,
    metrics_snapshot,
    shutdown_llm,
    store_summary,
    thread_cpu_seconds,
)
from kvstrata.tools.job_forkserver import ForkedJob

if TYPE_CHECKING:
    from vllm import LLM

def run_job(job: dict[str, Any], progress: ProgressFn | None = None) -> dict[str, Any]:
    """Run a job in this process. Steps:

    * ``{"op": "generate", "name": ..., "prompts": [[ids]...], "max_tokens": n,
      "cache_salt": s (or one per prompt), "ignore_eos": b, "kv_transfer_params": {...},
      "logprobs": k}`` (all but prompts optional)
    * ``{"op": "reset_prefix_cache"}`` (vLLM's device prefix cache only; kvstrata keeps its tiers)
    * ``{"op": "drop_page_cache", "required": b}``: its ``ok`` says whether the page cache was
      dropped; ``required`` makes a failure to drop it an error (a run that claims cold reads)
    * ``{"op": "sleep", "seconds": s}``
    * ``{"op": "wait_warm_start", "timeout_s": t}``: until kvstrata's warm start (if any) has
      promoted what it will (an engine core in this process only)
    * ``{"op": "wait_disk_entries", "path": store, "at_least": n, "timeout_s": t}``: until the
      store at ``path`` holds at least ``n`` records (what the write-behind of an engine core in
      another process has written by then), read from the store itself
    * ``{"op": "signal", "path": p}`` (creates the file ``p``) and
      ``{"op": "wait_for", "path": p, "timeout_s": t}`` (until ``p`` exists): hand-offs between
      engines running at the same time, e.g. two replicas on one store

    Returns ``{"import_s", "engine_start_s", "steps": [...], "shutdown_s"}``; each generate step
    reports its completions and the metric deltas it caused.
    """
    say = progress or (lambda _msg: None)
    opts = EngineOptions.from_dict(job["engine"])
    t0 = time.perf_counter()
    say("importing vLLM")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if opts.multiprocess else "0"
    import vllm  # noqa: F401  (timed separately from the engine start)

    t1 = time.perf_counter()
    say("starting the engine")
    llm = build_llm(opts)
    t2 = time.perf_counter()
    result: dict[str, Any] = {"import_s": t1 - t0, "engine_start_s": t2 - t1, "steps": []}
    try:
        for step in job.get("steps", []):
            result["steps"].append(_run_step(llm, step, say))
    finally:
        say("shutting down")
        t3 = time.perf_counter()
        shutdown_llm(llm)
        result["shutdown_s"] = time.perf_counter() - t3
    return result


def _run_step(llm: LLM, step: dict[str, Any], say: ProgressFn) -> dict[str, Any]:
    op = step["op"]
    name = step.get("name", op)
    if op == "generate":
        prompts = step["prompts"]
        say(f"{name}: {len(prompts)} prompt(s), {sum(map(len, prompts))} tokens")
        before = metrics_snapshot(llm)
        cpu = thread_cpu_seconds()
        t = time.perf_counter()
        outs = generate(llm, prompts, int(step.get("max_tokens", 16)),
                        cache_salt=step.get("cache_salt"),
                        ignore_eos=bool(step.get("ignore_eos", True)),
                        kv_transfer_params=step.get("kv_transfer_params"),
                        logprobs=step.get("logprobs"))
        wall = time.perf_counter() - t
        cpu_after = thread_cpu_seconds()
        return {"op": op, "name": name, "wall_s": wall,
                "outputs": [asdict(o) for o in outs],
                "metrics": metrics_delta(before, metrics_snapshot(llm)),
                "thread_cpu_s": {k: round(v - cpu.get(k, 0.0), 3) for k, v in cpu_after.items()
                                 if v - cpu.get(k, 0.0) > 0}}
    if op == "reset_prefix_cache":
        return {"op": op, "name": name, "ok": bool(llm.reset_prefix_cache())}
    if op == "drop_page_cache":
        dropped = drop_page_cache()
        if step.get("required") and not dropped:
            raise PermissionError("could not drop the page cache (/proc/sys/vm/drop_caches needs root); "
                                  "this run's reads would come from memory, not the device")
        return {"op": op, "name": name, "ok": dropped}
    if op == "sleep":
        time.sleep(float(step["seconds"]))
        return {"op": op, "name": name}
    if op == "wait_warm_start":
        timeout_s = float(step.get("timeout_s", 300.0))
        say(f"{name}: waiting for the warm start")
        if not _strata_scheduler(llm).hierarchy.wait_warm_start(timeout_s):
            raise TimeoutError(f"the warm start did not end within {timeout_s:.0f} s")
        return {"op": op, "name": name}
    if op == "wait_disk_entries":
        path, want = step["path"], int(step["at_least"])
        timeout_s = float(step.get("timeout_s", 300.0))
        say(f"{name}: waiting for {want} records in {path}")
        deadline = time.monotonic() + timeout_s
        while (have := store_summary(path).get("entries", 0)) < want:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{path} held {have} records after {timeout_s:.0f} s, "
                                   f"not the {want} expected")
            time.sleep(0.05)
        return {"op": op, "name": name, "entries": have}
    if op == "signal":
        Path(step["path"]).touch()
        return {"op": op, "name": name}
    if op == "wait_for":
        path, timeout_s = Path(step["path"]), float(step.get("timeout_s", 300.0))
        say(f"{name}: waiting for {path}")
        deadline = time.monotonic() + timeout_s
        while not path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{path} did not appear within {timeout_s:.0f} s")
            time.sleep(0.05)
        return {"op": op, "name": name}
    raise ValueError(f"unknown job step {op!r}")


def _strata_scheduler(llm: LLM) -> Any:
    """kvstrata's scheduler side in this process's engine core (``multiprocess`` False)."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    if core is None:
        raise ValueError("this step needs the engine core in this process (multiprocess: false)")
    connector = core.scheduler.get_kv_connector()
    if connector is None:
        raise ValueError("this engine runs without kvstrata")
    return connector.scheduler


class JobError(RuntimeError):
    """A subprocess job failed; ``log_tail`` holds the end of its output."""

    def __init__(self, message: str, log_tail: str = "", returncode: int | None = None) -> None:
        super().__init__(f"{message}\n--- last lines of the engine log ---\n{log_tail}"
                         if log_tail else message)
        self.log_tail = log_tail
        self.returncode = returncode  # negative: the engine was killed by that signal


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of an engine subprocess.

    PYTHONHASHSEED is removed: vLLM's sha256 block hashes are seeded with it when it is set, and
    a parent that set it for itself must not make a child's keys differ from a later user's.
    """
    env = dict(os.environ)
    env.pop("PYTHONHASHSEED", None)
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if extra:
        env.update(extra)
    return env


def run_job_subprocess(
    job: dict[str, Any],
    *,
    timeout_s: float = 600.0,
    progress: ProgressFn | None = None,
    env: dict[str, str] | None = None,
    log_path: Path | None = None,
) -> dict[str, Any]:
    """Run ``job`` in a fresh Python process (a real restart) and return its result.

    ``progress`` receives the child's progress messages while it runs. Raises :class:`JobError`
    with the tail of the engine log if the child fails or times out.
    """
    return run_jobs_subprocess([job], timeout_s=timeout_s, progress=progress, env=env,
                               log_path=log_path)[0]


def run_jobs_subprocess(
    jobs: Sequence[dict[str, Any]],
    *,
    timeout_s: float = 600.0,
    progress: ProgressFn | None = None,
    env: dict[str, str] | None = None,
    log_path: Path | None = None,
) -> list[dict[str, Any]]:
    """Run several jobs one after another in one fresh process (one engine at a time).

    Each engine is shut down before the next starts, so they may share a store; only the
    Python/vLLM import is paid once. Use separate calls where a restart is the point.
    """
    with tempfile.TemporaryDirectory(prefix="kvstrata-job-") as tmp:
        tmpdir = Path(tmp)
        job_file, result_file, progress_file = (tmpdir / n for n in
                                                ("job.json", "result.json", "progress.jsonl"))
        job_file.write_text(json.dumps({"jobs": list(jobs)}))
        progress_file.touch()
        log_file = log_path or tmpdir / "engine.log"
        argv = [str(job_file), str(result_file), str(progress_file)]
        with open(log_file, "wb") as log:
            proc = _start_child(argv, log, child_env(env))
            try:
                _follow(proc, progress_file, progress, timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                raise JobError(f"engine job timed out after {timeout_s:.0f} s",
                               _tail(log_file)) from None
            except BaseException:
                proc.kill()
                proc.wait()
                raise
        if proc.returncode != 0 or not result_file.exists():
            raise JobError(f"engine job exited with status {proc.returncode}", _tail(log_file),
                           returncode=proc.returncode)
        return json.loads(result_file.read_text())


def _start_child(argv: list[str], log: IO[bytes], env: dict[str, str]) -> subprocess.Popen[bytes] | ForkedJob:
    """The child running ``_child_main(argv)``: forked from the job server where this process
    enabled it (tools/job_forkserver.py), else a new interpreter."""
    ctx = job_forkserver.context_for(env)
    if ctx is not None:
        return ForkedJob(ctx, job_forkserver.run_in_child, (_child_main, argv, log.name, env))
    cmd = [sys.executable, "-m", "kvstrata.tools.jobs", *argv]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)


def _follow(proc: subprocess.Popen[bytes] | ForkedJob, progress_file: Path, progress: ProgressFn | None,
            timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    offset = 0
    while True:
        try:
            proc.wait(timeout=0.2)
            done = True
        except subprocess.TimeoutExpired:
            done = False
        if progress is not None:
            with open(progress_file, "rb") as f:
                f.seek(offset)
                chunk = f.read()
            # Only whole lines: the child may be in the middle of writing one.
            end = chunk.rfind(b"\n") + 1
            offset += end
            for line in chunk[:end].splitlines():
                with contextlib.suppress(ValueError):
                    progress(json.loads(line)["msg"])
        if done:
            return
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired(proc.args, timeout_s)


def _tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _child_main(argv: list[str]) -> int:
    job_file, result_file, progress_file = (Path(a) for a in argv)
    jobs = json.loads(job_file.read_text())["jobs"]
    lock = threading.Lock()

    def say(msg: str) -> None:
        with lock, open(progress_file, "a") as f:
            f.write(json.dumps({"t": time.time(), "msg": msg}) + "\n")

    results = [run_job(job, say) for job in jobs]
    tmp = result_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(results))
    tmp.rename(result_file)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 4:
        print("usage: python -m kvstrata.tools.jobs JOB.json RESULT.json PROGRESS.jsonl",
              file=sys.stderr)
        sys.exit(2)
    sys.exit(_child_main(sys.argv[1:]))

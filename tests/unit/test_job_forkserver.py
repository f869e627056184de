"""Engine jobs forked from the job server (kvstrata/tools/job_forkserver.py, enabled for the
suite by tests/conftest.py): each a new process of its own, its output in its log, its exit
status and a kill reported as a spawned job's, in its own environment."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvstrata.tools import job_forkserver
from kvstrata.tools.jobs import child_env


def report_and_exit(argv: list[str]) -> int:
    """A job's body: says where it runs, then exits with ``argv[0]``."""
    print(f"pid={os.getpid()} ppid={os.getppid()} mark={os.environ.get('KVSTRATA_TEST_MARK')} "
          f"vllm_imported={'vllm' in sys.modules}", flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    return int(argv[0])


def sleep_forever(argv: list[str]) -> int:
    Path(argv[0]).touch()
    time.sleep(600)
    return 0


def _job_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """A job's environment: the server's (the suite's ``child_env()`` once vLLM was imported; an
    engine built in this process since may have set more variables in it)."""
    env = job_forkserver.server_env()
    assert env is not None, "the suite enables the job server (tests/conftest.py)"
    return {**env, **(extra or {})}


def _start(target: Callable[[list[str]], int], argv: list[str], log: Path,
           env: dict[str, str]) -> job_forkserver.ForkedJob:
    ctx = job_forkserver.context_for(env)
    assert ctx is not None, "the suite enables the job server (tests/conftest.py)"
    log.write_bytes(b"")
    return job_forkserver.ForkedJob(ctx, job_forkserver.run_in_child, (target, argv, str(log), env))


def test_a_forked_job_is_a_new_process_with_its_log_status_and_environment(tmp_path: Path) -> None:
    env = _job_env({"KVSTRATA_TEST_MARK": "first"})
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    jobs = [_start(report_and_exit, ["3"], logs[0], env),
            _start(report_and_exit, ["0"], logs[1], {**env, "KVSTRATA_TEST_MARK": "second"})]
    assert [j.wait(120) for j in jobs] == [3, 0]
    assert [j.returncode for j in jobs] == [3, 0]
    lines = [log.read_text().splitlines() for log in logs]
    fields = [dict(kv.split("=") for kv in out[0].split()) for out in lines]
    # Two processes, neither this one nor the one that forked them, vLLM already imported.
    pids = {f["pid"] for f in fields}
    assert len(pids) == 2 and str(os.getpid()) not in pids
    assert all(f["ppid"] != str(os.getpid()) for f in fields)
    assert [f["mark"] for f in fields] == ["first", "second"]
    assert all(f["vllm_imported"] == "True" for f in fields)
    assert all(out[1] == "to stderr" for out in lines)


def test_a_forked_job_that_runs_too_long_is_killed(tmp_path: Path) -> None:
    started = tmp_path / "started"
    job = _start(sleep_forever, [str(started)], tmp_path / "job.log", _job_env())
    deadline = time.monotonic() + 120
    while not started.exists():
        assert time.monotonic() < deadline, "the job never started"
        time.sleep(0.05)
    with pytest.raises(subprocess.TimeoutExpired):
        job.wait(0.2)
    assert job.returncode is None
    job.kill()
    assert job.wait(30) == -signal.SIGKILL


def test_a_job_whose_environment_vllm_would_read_otherwise_is_spawned() -> None:
    env = _job_env()
    assert job_forkserver.context_for(env) is not None
    assert job_forkserver.context_for({**env, "KVSTRATA_ANYTHING": "1", "PYTEST_X": "y"}) is not None
    other = "ERROR" if env.get("VLLM_LOGGING_LEVEL") != "ERROR" else "INFO"
    assert job_forkserver.context_for({**env, "VLLM_LOGGING_LEVEL": other}) is None


def test_the_server_runs_in_the_suites_environment_whatever_the_first_job_sets() -> None:
    # A fresh process (this one's server may be running). A test that sets a variable vLLM
    # reads for its own engine (tests/e2e/test_multiprocess.py) and runs its worker's first job
    # must not make every later job of that worker differ from the server's environment (and
    # spawn); nor may vLLM's import, which sets variables, make the suite's own jobs differ.
    code = (
        "from kvstrata.tools import job_forkserver\n"
        "from kvstrata.tools.jobs import child_env\n"
        "job_forkserver.enable(child_env)\n"
        "env = job_forkserver.server_env()\n"
        "assert job_forkserver.context_for({**env, 'VLLM_CPU_OMP_THREADS_BIND': '0|1'}) is None\n"
        "assert job_forkserver.server_env() == env\n"
        "import vllm.entrypoints.llm\n"
        "assert child_env() == env, set(child_env().items()) ^ set(env.items())\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=child_env())
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]

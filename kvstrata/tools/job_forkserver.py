"""Engine jobs forked from a server that imported vLLM once (multiprocessing's forkserver).

A fresh interpreter spends about 11 s importing torch and vLLM before its engine starts (on the
2-core machines CI runs on). The test suite runs about a hundred engine jobs, each in a new
process so that a restart is real: forking each of them from a server process that has imported
vLLM, and has never built an engine, opened a store or started a thread of kvstrata's, keeps
that (a new process, nothing of an earlier job in its memory) and saves the import. ``enable()``
turns it on for this process (tests/conftest.py does); ``kvstrata`` commands keep spawning fresh
interpreters, whose start-up their timings include.

vLLM reads a few environment variables when it is imported (its logging set-up): the server is
started in the environment ``enable()`` is given (the suite's ``child_env()``), and a job whose
environment differs from that one in anything but kvstrata's and pytest's own variables is
spawned the usual way instead (a test that sets such a variable for its engine must not make
the server, and so every later job of its worker, start in its environment).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import multiprocessing
import os
import subprocess
import threading
from collections.abc import Callable, Iterator
from multiprocessing.context import ForkServerContext
from multiprocessing.process import BaseProcess
from typing import Any

# Imported by the server before it forks a job: what every engine job imports first.
PRELOAD = ["vllm", "vllm.entrypoints.llm", "kvstrata.tools.jobs"]
# Variables a job may set differently from the server: read when kvstrata or pytest run, never
# when vLLM or torch are imported.
_PER_JOB_PREFIXES = ("KVSTRATA_", "PYTEST_")

_lock = threading.Lock()
_context: ForkServerContext | None = None
_server_env: dict[str, str] | None = None


def enable(environment: Callable[[], dict[str, str]]) -> None:
    """Fork this process's later engine jobs whose environment is ``environment()``'s (but for
    kvstrata's and pytest's variables) from the server, started in it at the first such job.

    The server's imports are made here first: vLLM sets variables when it is imported
    (TORCHINDUCTOR_CACHE_DIR and others; its OpenCV import LD_LIBRARY_PATH), which every later
    job's environment, taken from this process's, then carries too."""
    global _server_env
    for module in PRELOAD:
        importlib.import_module(module)
    env = environment()
    with _lock:
        _server_env = env  # enabled from now on


def _comparable(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if not k.startswith(_PER_JOB_PREFIXES)}


@contextlib.contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def context_for(env: dict[str, str]) -> ForkServerContext | None:
    """The forkserver context to start a job with environment ``env`` in, or None where jobs
    are spawned (not enabled, or ``env`` differs from the server's where vLLM's import reads it)."""
    global _context
    with _lock:
        if _server_env is None or _comparable(env) != _comparable(_server_env):
            return None
        if _context is None:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(PRELOAD)
            # The server inherits this process's environment when it is started.
            from multiprocessing import forkserver

            with _environment(_server_env):
                forkserver.ensure_running()
            _context = ctx
        return _context


def server_env() -> dict[str, str] | None:
    """The environment the server runs in (given to ``enable()``), or None if not enabled."""
    with _lock:
        return None if _server_env is None else dict(_server_env)


class ForkedJob:
    """A job's process forked by the server; ``wait``/``kill``/``returncode`` as a Popen's."""

    def __init__(self, ctx: ForkServerContext, target: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.args = args
        self._proc: BaseProcess = ctx.Process(target=target, args=args, daemon=False)
        self._proc.start()

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(str(self.args), timeout or 0.0)
        return self._proc.exitcode

    def kill(self) -> None:
        if self._proc.exitcode is None:
            self._proc.kill()


def run_in_child(main: Callable[[list[str]], int], argv: list[str], log_file: str,
                 env: dict[str, str]) -> None:
    """The forked job's body: output to ``log_file`` (as a spawned job's), the job's own
    environment, ``main(argv)``, then the exit handlers a normal interpreter exit would run."""
    fd = os.open(log_file, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    try:
        code = main(argv)
    finally:
        atexit._run_exitfuncs()  # multiprocessing ends its children with os._exit
    if code:
        raise SystemExit(code)

"""Shared test set-up: make the integration harness and the repository's ``benchmarks`` package
importable (it is not installed with kvstrata), the ``redis_server`` and ``tmpfs`` fixtures, and
the lines the session prints at its end, from this process or from pytest-xdist's workers."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstrata.tools.redis_local import RedisServer

sys.path.insert(0, str(Path(__file__).parent / "integration"))
sys.path.insert(0, str(Path(__file__).parent))  # redis_server.py, session_summary.py
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import session_summary  # noqa: E402 (found through the path above)

from kvstrata.tools import job_forkserver  # noqa: E402
from kvstrata.tools.jobs import child_env  # noqa: E402

# Engine jobs fork from a server that imported vLLM once instead of importing it again each
# (kvstrata/tools/job_forkserver.py): still a new process for every job. The server's
# environment is the suite's, whatever a test sets for its own engine.
job_forkserver.enable(child_env)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A real Redis server on 127.0.0.1 at a free port, for one test (kvstrata/tools/redis_local.py)."""
    server = RedisServer(tmp_path / "redis")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """Small file systems of a test's own: ``tmpfs("12m")`` mounts a tmpfs of that size and
    returns its mount point (unmounted after the test, if the test did not). Needs root and a
    working ``mount -t tmpfs``; the test is skipped otherwise."""
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root")
        mnt = tmp_path / f"tmpfs{len(mounted)}"
        mnt.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip() or done.returncode}")
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in mounted:
        if os.path.ismount(mnt) and subprocess.run(["umount", str(mnt)], check=False).returncode:
            subprocess.run(["umount", "-l", str(mnt)], check=False)  # still busy: detach it


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: a worker finished
def pytest_testnodedown(node: Any, error: object) -> None:
    session_summary.add(node.config, getattr(node, "workeroutput", {}).get(session_summary.WORKER_OUTPUT_KEY, []))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    session_summary.write(config, terminalreporter)

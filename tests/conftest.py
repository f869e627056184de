"""Shared test set-up: make the integration harness and the repository's ``benchmarks`` package
importable (it is not installed with kvstrata), the ``redis_server`` fixture, and the lines the
session prints at its end, from this process or from pytest-xdist's workers."""

from __future__ import annotations

import sys
from collections.abc import Iterator
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


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A real Redis server on 127.0.0.1 at a free port, for one test (kvstrata/tools/redis_local.py)."""
    server = RedisServer(tmp_path / "redis")
    try:
        yield server
    finally:
        server.stop()


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: a worker finished
def pytest_testnodedown(node: Any, error: object) -> None:
    session_summary.add(node.config, getattr(node, "workeroutput", {}).get(session_summary.WORKER_OUTPUT_KEY, []))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    session_summary.write(config, terminalreporter)

"""Shared test set-up: make the integration harness and the repository's ``benchmarks`` package
importable (it is not installed with kvstrata), and the ``redis_server`` fixture."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstrata.tools.redis_local import RedisServer

sys.path.insert(0, str(Path(__file__).parent / "integration"))
sys.path.insert(0, str(Path(__file__).parent))  # redis_server.py
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A real Redis server on 127.0.0.1 at a free port, for one test (kvstrata/tools/redis_local.py)."""
    server = RedisServer(tmp_path / "redis")
    try:
        yield server
    finally:
        server.stop()

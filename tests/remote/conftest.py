"""Fixture: one real 3-node Redis cluster per module (``redis_cluster``), on 127.0.0.1 at free
ports (tests/redis_server.py); the single server per test (``redis_server``) is tests/conftest.py's."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from redis_server import RedisCluster


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    cluster = RedisCluster(tmp_path_factory.mktemp("cluster"))
    try:
        yield cluster
    finally:
        cluster.stop()

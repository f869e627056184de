"""Real Redis (or Valkey) servers for the tests: the Debian ``redis-server`` binary on 127.0.0.1
at a free port, started, stopped (SIGSTOP), resumed, killed and restarted by the test
(``kvstrata.tools.redis_local.RedisServer``, which ``kvstrata bench remote`` runs too). A 3-node
cluster is made with ``redis-cli --cluster create``. Nothing here fakes a server.

``scripts/env.sh`` installs the binary when it is missing (CI runs as root on a fresh machine);
a machine without it fails these tests with the command that installs it.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from kvstrata.tools.redis_local import START_TIMEOUT_S, RedisServer, cli_binary, free_port

__all__ = ["RedisCluster", "RedisServer", "free_port"]


class RedisCluster:
    """Three masters, no replicas, made into one cluster; ``url`` is a ``redis+cluster://``."""

    def __init__(self, workdir: Path, nodes: int = 3) -> None:
        self.servers: list[RedisServer] = []
        try:
            for i in range(nodes):
                port = free_port(below=55536)
                self.servers.append(RedisServer(
                    workdir / f"node{i}", "--cluster-enabled", "yes",
                    "--cluster-config-file", f"nodes-{port}.conf", "--cluster-node-timeout", "2000",
                    port=port))
            hosts = [f"127.0.0.1:{s.port}" for s in self.servers]
            subprocess.run([cli_binary(), "--cluster", "create", *hosts, "--cluster-replicas", "0",
                            "--cluster-yes"], check=True, capture_output=True, timeout=60)
            self._wait_ok()
        except BaseException:
            self.stop()
            raise

    def _wait_ok(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if all(str(s.client().cluster("info").get("cluster_state")) == "ok" for s in self.servers):
                return
            time.sleep(0.1)
        raise RuntimeError("the redis cluster did not reach cluster_state:ok")

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in self.servers)

    def stop(self) -> None:
        for s in self.servers:
            s.stop()

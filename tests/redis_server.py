"""Real Redis (or Valkey) servers for the tests: the Debian ``redis-server`` binary on 127.0.0.1
at a free port, started, stopped (SIGSTOP), resumed, killed and restarted by the test. A 3-node
cluster is made with ``redis-cli --cluster create``. Nothing here fakes a server.

``scripts/env.sh`` installs the binary when it is missing (CI runs as root on a fresh machine);
a machine without it fails these tests with the command that installs it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis

SERVER_ARGS = ("--save", "", "--appendonly", "no", "--maxmemory", "64mb",
               "--maxmemory-policy", "allkeys-lru")
START_TIMEOUT_S = 15.0


def server_binary() -> str:
    for name in ("valkey-server", "redis-server"):
        path = shutil.which(name)
        if path:
            return path
    raise RuntimeError("no redis-server or valkey-server on PATH: run `bash scripts/env.sh` "
                       "(as root it installs the Debian package redis-server)")


def cli_binary() -> str:
    for name in ("valkey-cli", "redis-cli"):
        path = shutil.which(name)
        if path:
            return path
    raise RuntimeError("no redis-cli or valkey-cli on PATH: run `bash scripts/env.sh`")


def free_port(below: int = 65536) -> int:
    """A free TCP port on 127.0.0.1 below ``below`` (a cluster node needs its port + 10000 too)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < below:
            return port


class RedisServer:
    """One server process; ``url`` is what kvstrata's ``remote_url`` takes."""

    def __init__(self, workdir: Path, *extra: str, port: int | None = None) -> None:
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def start(self) -> None:
        args = [server_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.workdir), *SERVER_ARGS, *self.extra]
        log = open(self.workdir / "server.log", "ab")  # noqa: SIM115 (kept for the process' life)
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                if self.client().ping():
                    return
            except redis.RedisError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis server on port {self.port} did not start:\n"
                                   + (self.workdir / "server.log").read_text()[-2000:])
            time.sleep(0.05)

    def pause(self) -> None:
        """SIGSTOP: the server hangs (connections stay open, nothing answers)."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)  # a stopped process dies only once resumed
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def restart(self) -> None:
        """Kill and start again on the same port: empty (no persistence), new connections."""
        self.kill()
        self.start()

    def stop(self) -> None:
        self.kill()


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

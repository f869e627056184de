"""A throwaway Redis (or Valkey) server on 127.0.0.1, and a plain redis-py client of one.

``kvstrata bench remote`` starts one when no ``--remote-url`` is given, and the tests run the
shared tier against these (tests/redis_server.py adds a cluster). The server is the distribution's
``valkey-server`` or ``redis-server`` binary (``scripts/env.sh`` installs the Debian package when
it is missing and it runs as root), started without persistence and with ``allkeys-lru``
eviction, as an operator would run a cache: nothing here fakes a server.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import redis

START_TIMEOUT_S = 15.0


class RedisUnavailable(RuntimeError):
    """No server binary, or a server that did not start (the message says which and why)."""


def server_binary() -> str:
    for name in ("valkey-server", "redis-server"):
        path = shutil.which(name)
        if path:
            return path
    raise RedisUnavailable("no redis-server or valkey-server on PATH: run `bash scripts/env.sh` "
                           "(as root it installs the Debian package redis-server)")


def cli_binary() -> str:
    for name in ("valkey-cli", "redis-cli"):
        path = shutil.which(name)
        if path:
            return path
    raise RedisUnavailable("no redis-cli or valkey-cli on PATH: run `bash scripts/env.sh`")


def free_port(below: int = 65536) -> int:
    """A free TCP port on 127.0.0.1 below ``below`` (a cluster node needs its port + 10000 too)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port < below:
            return port


class RedisServer:
    """One server process; ``url`` is what kvstrata's ``remote_url`` takes. ``pause`` (SIGSTOP),
    ``resume``, ``kill`` and ``restart`` are the failures the tests put the tier through."""

    def __init__(self, workdir: Path, *extra: str, port: int | None = None, maxmemory_mb: int = 64) -> None:
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.args = ("--save", "", "--appendonly", "no", "--maxmemory", f"{maxmemory_mb}mb",
                     "--maxmemory-policy", "allkeys-lru", *extra)
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def start(self) -> None:
        args = [server_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.workdir), *self.args]
        log_path = self.workdir / "server.log"
        with open(log_path, "ab") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        client = self.client()
        try:
            while True:
                try:
                    if client.ping():
                        return
                except redis.RedisError:
                    pass
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.kill()
                    raise RedisUnavailable(f"{args[0]} did not start on port {self.port}:\n"
                                           + log_path.read_text(errors="replace")[-2000:])
                time.sleep(0.05)
        finally:
            client.close()

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


def plain_client(url: str) -> redis.Redis:
    """A synchronous redis-py client of the single server ``url`` names (no kvstrata code in
    between: the baseline the benchmarks compare with)."""
    from kvstrata.remote_address import parse_remote_url

    address = parse_remote_url(url)
    if address.cluster:
        raise ValueError("a plain client needs a single server, not a cluster URL")
    host, port = address.nodes[0]
    return redis.Redis(host=host, port=port, db=address.db, username=address.username,
                       password=address.password, ssl=address.tls, socket_timeout=30)


def server_figures(client: redis.Redis) -> dict[str, Any]:
    info = client.info()
    return {k: info.get(k) for k in ("redis_version", "valkey_version", "used_memory",
                                     "maxmemory", "maxmemory_policy", "evicted_keys",
                                     "io_threads_active") if k in info}


def strlens(client: redis.Redis, keys: list[bytes]) -> list[int]:
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.strlen(key)
    return list(pipe.execute()) if keys else []


def value_bytes(client: redis.Redis, pattern: bytes) -> tuple[int, int, int]:
    """(keys, sum of value lengths, sum of MEMORY USAGE) of the keys matching ``pattern``."""
    keys = list(client.scan_iter(match=pattern, count=1000))
    if not keys:
        return 0, 0, 0
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.memory_usage(key, samples=0)
    usage = pipe.execute()
    return len(keys), sum(int(n or 0) for n in strlens(client, keys)), sum(int(n or 0) for n in usage)

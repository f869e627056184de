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

import redis

from kvstrata.tools.redis_local import START_TIMEOUT_S, RedisServer, cli_binary, free_port

# The timeouts of a store whose calls are meant to succeed. A loaded 2-core CI machine can leave
# the tier's event-loop thread unscheduled for over a second: with a 1 s connect timeout a round
# trip to a healthy server on 127.0.0.1 once stored 0 of 3 values ("Timeout connecting to
# server"). Tests about timeouts and outages set their own, tight ones.
PATIENT_TIMEOUTS: dict[str, float] = dict(connect_timeout_s=5.0, timeout_s=5.0, write_timeout_s=5.0)

__all__ = ["PATIENT_TIMEOUTS", "PasswordRedisServer", "RedisCluster", "RedisServer", "TLSRedisServer",
           "free_port", "make_ca"]


def make_ca(workdir: Path, name: str) -> tuple[Path, Path, Path]:
    """A throwaway CA and a server certificate it signed for 127.0.0.1/localhost, made with the
    ``openssl`` command: (CA certificate, server certificate, server key)."""
    workdir.mkdir(parents=True, exist_ok=True)
    ca_key, ca, key, csr, cert = (workdir / f"{name}-{s}" for s in
                                  ("ca.key", "ca.pem", "server.key", "server.csr", "server.pem"))
    ext = workdir / f"{name}-ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key), "-out", str(ca),
            "-days", "2", "-subj", f"/CN={name} test CA")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr),
            "-subj", "/CN=localhost")
    openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
            "-out", str(cert), "-days", "2", "-extfile", str(ext))
    return ca, cert, key


class TLSRedisServer(RedisServer):
    """A server that speaks TLS only (``--port 0 --tls-port``), its certificate signed by the
    CA ``make_ca`` made; ``url`` is a ``rediss://``."""

    def __init__(self, workdir: Path, *extra: str) -> None:
        self.ca, cert, key = make_ca(workdir / "pki", "kvstrata")
        port = free_port()
        super().__init__(workdir, "--port", "0", "--tls-port", str(port), "--tls-cert-file", str(cert),
                         "--tls-key-file", str(key), "--tls-ca-cert-file", str(self.ca),
                         "--tls-auth-clients", "no", *extra, port=port)

    @property
    def url(self) -> str:
        return f"rediss://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5, ssl=True,
                           ssl_ca_certs=str(self.ca))


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


class PasswordRedisServer(RedisServer):
    """A server with ``requirepass ADMIN_PASSWORD`` (the default user's) and an ACL user
    ``kvstrata`` (``USER_PASSWORD``) allowed only the commands the shared tier sends, and only
    on keys ``kvstrata:*``."""

    ADMIN_PASSWORD = "admin-pw-0123456789"
    USER_PASSWORD = "kv-user-pw-9876543210"
    USER_COMMANDS = ("+get", "+set", "+exists", "+del", "+touch", "+ping", "+info",
                     "+client|setname")

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir, "--requirepass", self.ADMIN_PASSWORD)
        with self.client() as admin:
            admin.acl_setuser("kvstrata", enabled=True, passwords=[f"+{self.USER_PASSWORD}"],
                              keys=["kvstrata:*"], commands=list(self.USER_COMMANDS))

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5, password=self.ADMIN_PASSWORD)

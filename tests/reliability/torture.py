"""What the reliability tests share: self-describing records, the soak factor, the tally printed
at the end of the run, and running the child script and the ``kvstrata`` CLI as subprocesses.

A record's key says how long its value is, and the value is a pure function of the key, so any
process can tell, for any key it reads, whether the bytes it got are the ones written for it.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from kvstrata.tiers.disk import DiskStore
    from kvstrata.tiers.hierarchy import Hierarchy
    from kvstrata.tiers.host import HostSlab

HERE = Path(__file__).resolve().parent
CHILD = HERE / "torture_child.py"


def _repo() -> Path:
    """The tree whose kvstrata the tests import: subprocesses must run the same code."""
    spec = importlib.util.find_spec("kvstrata")
    assert spec is not None and spec.origin is not None, "kvstrata is not importable"
    return Path(spec.origin).resolve().parents[1]


REPO = _repo()

SOAK = max(1, int(os.environ.get("KVSTRATA_RELIABILITY_SOAK", "1") or 1))
BASE_SEED = int(os.environ.get("KVSTRATA_RELIABILITY_SEED", "20260601"))
NS_BYTES = 16
KEY_BYTES = 52  # namespace 16 + value length 4 + serial 28 + group 4
NS_WRITERS = b"kill-mid-put-ns!"  # the records of the killed and concurrent writers
HIER_NS = [b"rank0-namespace!", b"rank1-namespace!"]
SHARD = 32 << 10  # bytes per shard of a chunk in the Hierarchy tests
HOST_SLOTS = 16
KILL_BUDGET = 4 << 20  # small: the killed writers evict


def trials(n: int) -> int:
    """``n`` trials, times the soak factor (``KVSTRATA_RELIABILITY_SOAK``)."""
    return n * SOAK


def seed_for(test: str, trial: int) -> int:
    digest = hashlib.blake2b(f"{BASE_SEED}:{test}:{trial}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big")


# ---- records -----------------------------------------------------------------------------------


def make_key(ns: bytes, serial: int, nbytes: int, group: int = 0) -> bytes:
    assert len(ns) == NS_BYTES and nbytes % 2 == 0
    return ns + nbytes.to_bytes(4, "big") + serial.to_bytes(28, "big") + group.to_bytes(4, "big")


def describe_key(key: bytes) -> str:
    ns, serial = key[:NS_BYTES], key[NS_BYTES + 4 : -4]
    return (f"{ns.decode(errors='replace')!r}/{value_len(key)} B/serial "
            f"{serial.hex().lstrip('0') or '0'}/group {int.from_bytes(key[-4:], 'big')}")


def value_len(key: bytes) -> int:
    return int.from_bytes(key[NS_BYTES : NS_BYTES + 4], "big")


def writers_key(i: int) -> bytes:
    """Record ``i`` of the concurrent writers test (4 or 16 KiB, groups 0-2)."""
    return make_key(NS_WRITERS, i, [4096, 16384][i % 2], i % 3)


def chunk_key(serial: int) -> bytes:
    """A Hierarchy chunk key whose store keys (a namespace + it) name SHARD-byte values."""
    return make_key(HIER_NS[0], serial, SHARD)[NS_BYTES:]


def hierarchy(store: Path, slab: Path, **disk_kw: Any) -> tuple[Hierarchy, HostSlab, DiskStore]:
    """A Hierarchy with two shards (TP 2) of one group over a fresh slab and the store."""
    from kvstrata.tiers.disk import DiskStore
    from kvstrata.tiers.hierarchy import Hierarchy
    from kvstrata.tiers.host import HostPool, HostSlab

    host = HostSlab(slab, SHARD * len(HIER_NS), HOST_SLOTS)
    disk = DiskStore(store, budget_bytes=KILL_BUDGET, **disk_kw)
    # The write-behind may pin the whole host tier here (an engine's pins half of it): a store
    # then waits until a slot's chunk was written, so each chunk the killed writer announced
    # past HOST_SLOTS proves one committed write (test_kill_mid_put).
    h = Hierarchy(
        HostPool(host), disk, namespaces=HIER_NS, group_shard_bytes=[SHARD],
        group_dtypes=["bfloat16"], max_write_pinned_bytes=host.nbytes,
    )
    return h, host, disk


def expected(key: bytes) -> bytes:
    """The value written under ``key``: bf16-like KV (compressible exponent bytes, random
    mantissas), a pure function of the key."""
    seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
    x = np.random.default_rng(seed).standard_normal(value_len(key) // 2, dtype=np.float32)
    return (x.view(np.uint32) >> 16).astype(np.uint16).tobytes()


# ---- the tally printed by conftest.py ----------------------------------------------------------


@dataclass
class Tally:
    trials: int = 0
    served: int = 0  # reads that returned the bytes written for the key
    detected: int = 0  # reads that missed, or a damage reported as a clear error
    wrong: int = 0  # reads that returned other bytes: must never happen
    crashed: int = 0  # trials with a traceback, an unexpected exit status or a signal

    def line(self, name: str) -> str:
        return (
            f"{name}: trials {self.trials} served {self.served} detected {self.detected} "
            f"wrong {self.wrong} crashed {self.crashed}"
        )


TALLIES: dict[str, Tally] = {}


def tally(name: str) -> Tally:
    return TALLIES.setdefault(name, Tally())


# ---- subprocesses ------------------------------------------------------------------------------


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env["PYTHONFAULTHANDLER"] = "1"  # a segfault prints the Python stack of every thread
    return env


class Child:
    """The child script in a subprocess: its stdout line by line (with timeouts), its stderr
    in a file (a chatty child never blocks on a full pipe)."""

    def __init__(self, *args: str) -> None:
        self._err = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            [sys.executable, str(CHILD), *args], stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=self._err, text=True, cwd=REPO, env=child_env(),
        )
        self.lines = Lines(self.proc)

    def next(self, timeout: float = 60) -> str:
        """The next line; AssertionError when the child ended or stayed silent."""
        try:
            line = self.lines.next(timeout)
        except queue.Empty:
            raise AssertionError(f"child silent for {timeout}s: {self.stderr()}") from None
        assert line is not None, f"child ended (exit status {self.proc.wait()}): {self.stderr()}"
        return line

    def kill(self) -> list[str]:
        """SIGKILL it; returns the lines it printed that were not read yet."""
        self.proc.kill()
        self.proc.wait()
        rest = []
        while (line := self.lines.next(timeout=60)) is not None:
            rest.append(line)
        return rest

    def stderr(self) -> str:
        self._err.seek(0)
        return last_lines(self._err.read(), 12)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.kill()
        self._err.close()


def run_child(*args: str, stdin: str = "", timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(CHILD), *args],
        input=stdin,
        capture_output=True,
        text=True,
        cwd=REPO,
        env=child_env(),
        timeout=timeout,
        check=False,
    )


class Lines:
    """A child's stdout lines, read on a thread so that waiting on them can time out."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._thread = threading.Thread(target=self._pump, args=(proc,), daemon=True)
        self._thread.start()

    def _pump(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.endswith("\n"):  # a line cut short by a SIGKILL was never acted on
                self._queue.put(line[:-1])
        self._queue.put(None)

    def next(self, timeout: float) -> str | None:
        """The next line; None at end of output. Raises queue.Empty on timeout."""
        return self._queue.get(timeout=timeout)


@dataclass
class CliRun:
    argv: list[str]
    rc: int
    out: str
    err: str

    @property
    def report(self) -> dict[str, Any]:
        try:
            parsed = json.loads(self.out)
        except ValueError:
            return {}
        return parsed if isinstance(parsed, dict) else {}

    @property
    def clean_error(self) -> bool:
        """Exit 2 with one line naming the problem: how a tool refuses a store it cannot read."""
        lines = self.err.strip().splitlines()
        return (
            self.rc == 2 and len(lines) == 1 and lines[0].startswith("kvstrata ")
            and "Traceback" not in self.err
        )

    def crash(self, allowed: set[int]) -> str | None:
        """Why this run counts as a crash (None when it does not): a traceback, a signal, or
        an exit status other than ``allowed`` and a clean error."""
        if self.rc < 0:
            return f"killed by signal {-self.rc}"
        if "Traceback" in self.err or "Fatal Python error" in self.err:
            return "traceback: " + last_lines(self.err)
        if self.rc in allowed or self.clean_error:
            return None
        return f"exit status {self.rc}: {last_lines(self.err)}"

    @property
    def command(self) -> str:
        """``kvstrata`` and its arguments, store paths left out."""
        return " ".join(["kvstrata", *(a for a in self.argv if not a.startswith("/"))])

    def describe(self) -> str:
        report = self.report
        if report.get("status"):  # verify's answer: the first problem it lists
            bad = report.get("bad") or [{}]
            detail = (f"{report['status']}; {report.get('bad_count')} bad, e.g. "
                      f"{bad[0].get('problem')} for {bad[0].get('key', '')[:32]}..")
        else:
            detail = last_lines(self.err) or self.out[-300:]
        return f"`{self.command}` -> {self.rc}: {detail}"


def cli(*argv: str, timeout: float = 60) -> CliRun:
    """``python -m kvstrata.tools.cli ARGV`` in a subprocess (a crash cannot take pytest down)."""
    cmd = [sys.executable, "-m", "kvstrata.tools.cli", *argv]
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, cwd=REPO, env=child_env(), timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return CliRun(list(argv), -9, "", f"hung: no answer after {timeout}s")
    return CliRun(list(argv), proc.returncode, proc.stdout, proc.stderr)


def last_lines(text: str, n: int = 3) -> str:
    return " | ".join(text.strip().splitlines()[-n:])


# ---- the probe child ---------------------------------------------------------------------------


def probe_job(
    job_id: str, path: Path, written: Sequence[bytes], *, suspects: Sequence[bytes] = (),
    budget: int = 1 << 40, fresh: int = 0, fresh_first: int = 0,
) -> dict[str, Any]:
    """A job for :func:`run_probes`: ``written`` keys hold their :func:`expected` value;
    ``suspects`` were never written (keys a damage may have made up): serving one is wrong.
    The probe puts ``fresh`` new records (serials from ``fresh_first``) with ``budget``."""
    return {
        "id": job_id, "dir": str(path), "keys": [k.hex() for k in written],
        "suspects": [k.hex() for k in suspects], "budget": budget, "fresh": fresh,
        "fresh_first": fresh_first,
    }


def run_probes(jobs: list[dict[str, Any]], timeout: float = 60) -> dict[str, dict[str, Any]]:
    """Run the jobs in as few child processes as possible; returns each job's report.

    A job during which the child died or hung gets a report with ``crash`` set (the child's
    last stderr lines); the jobs after it run in a new child.
    """
    results: dict[str, dict[str, Any]] = {}
    pending = list(jobs)
    while pending:
        with tempfile.TemporaryFile("w+") as err:
            proc = subprocess.Popen(
                [sys.executable, str(CHILD), "probe"], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=err, text=True, cwd=REPO, env=child_env(),
            )
            assert proc.stdin is not None
            with contextlib.suppress(BrokenPipeError):  # it died at once: told below
                proc.stdin.write(json.dumps(pending))
                proc.stdin.close()
            lines = Lines(proc)
            current: str | None = None
            why = ""
            while True:
                try:
                    line = lines.next(timeout)
                except queue.Empty:
                    proc.kill()
                    why = f"hung: no progress for {timeout}s"
                    break
                if line is None:
                    break
                if line.startswith("BEGIN "):
                    current = line[len("BEGIN ") :]
                elif line.startswith("RESULT "):
                    report = json.loads(line[len("RESULT ") :])
                    results[report["id"]] = report
                    current = None
            rc = proc.wait()
            err.seek(0)
            stderr = err.read()
        pending = [job for job in pending if job["id"] not in results]
        if not pending:
            break
        victim = current if current is not None else pending[0]["id"]
        why = why or (f"killed by signal {-rc}" if rc < 0 else f"exit status {rc}")
        results[victim] = {"id": victim, "crash": f"{why}: {last_lines(stderr, 12)}"}
        pending = [job for job in pending if job["id"] != victim]
    return results


def probe_failures(report: dict[str, Any]) -> list[str]:
    """What in a probe report breaks the contract: wrong bytes, an exception, a crash."""
    problems = []
    if report.get("crash"):
        problems.append(f"crashed ({report['crash']})")
    if report.get("wrong"):
        keys = sorted(set(report["wrong"]))
        unwritten = report.get("wrong_unwritten", 0)
        problems.append(
            f"WRONG bytes served by {len(report['wrong'])} read(s) of {len(keys)} key(s), e.g. "
            f"{describe_key(bytes.fromhex(keys[0]))}"
            + (f" ({unwritten} of the reads for keys never written: made up by the damage)" if unwritten else "")
        )
    if report.get("errors"):
        problems.append(f"raised: {report['errors'][:3]}")
    return problems


def crashed(report: dict[str, Any]) -> bool:
    return bool(report.get("crash") or report.get("errors"))

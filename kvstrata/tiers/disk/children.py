"""A pool of child processes that do a disk tier's CPU-bound work off the engine-core process's
GIL: its reads (``disk/readers.py``) and the encoding of its writes (``disk/encoders.py``).

The tiers run in vLLM's engine-core process, whose own Python threads (the step loop, vLLM's I/O
threads) hold the GIL most of the time on a busy server; a tier thread's C calls release it and
wait up to the switch interval to get it back, several times a chunk: beside one busy thread a
read thread keeps a third of its speed, a child process doing the same work 0.92x
(docs/BENCHMARKS.md, "The tiers' threads beside a busy Python thread"). The host slab is shared
memory, so only keys and places in it cross the pipes, and a few words per chunk come back.

Each child runs ``python -m <module> FD`` (so no main module of vLLM is imported again) with one
end of a socket pair; its setup (the auth key among it) goes over the pipe, never on a command
line. :meth:`ChildPool.run` hands an idle child one job and reports each of its answers as it
arrives, in order. A child that dies (killed, out of memory) makes the pool unavailable; its
callers then do the work in their own threads. A child exits when its pipe closes: its parent
closed the pool or died.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

POLL_S = 0.5  # how often a waiting caller checks that its child is still alive
START_TIMEOUT_S = 60.0  # a child opens what it needs within this, or the pool fails
CLOSE_TIMEOUT_S = 10.0


class ProcessesUnavailable(RuntimeError):
    """The pool's processes cannot work (one died, or the pool is closed)."""


class ChildPool:
    """``processes`` children running ``module``'s :func:`serve` loop (see the module docstring);
    ``what`` names their work in messages ("read", "encode")."""

    def __init__(self, module: str, setup: dict[str, Any], *, processes: int, what: str) -> None:
        if processes < 1:
            raise ValueError(f"a pool of {what} processes needs at least one")
        self.what = what
        self._idle: queue.SimpleQueue[tuple[subprocess.Popen[bytes], Connection]] = queue.SimpleQueue()
        self._children: list[tuple[subprocess.Popen[bytes], Connection]] = []
        self._lock = threading.Lock()
        self.available = True
        try:
            for _ in range(processes):
                self._children.append(_spawn(module, setup))
            for proc, conn in self._children:  # each opened what it needs
                if not conn.poll(START_TIMEOUT_S):
                    raise ProcessesUnavailable(f"a {what} process did not start within {START_TIMEOUT_S:g} s")
                started = conn.recv()
                if started != "ready":
                    raise ProcessesUnavailable(f"a {what} process could not start: {started}")
                self._idle.put((proc, conn))
        except BaseException:
            self.close()
            raise

    def run(self, job: Any, answers: int, answer: Callable[[int, Any], None]) -> None:
        """Send ``job`` to an idle child and call ``answer(i, outcome)`` for each of the
        ``answers`` outcomes it sends back, in order. Raises ProcessesUnavailable when the pool
        cannot work; the items not answered by then were not done, or only in part, and no
        process writes for them any more. An exception ``answer`` raises is raised once the
        child answered everything (it is not called for the rest): until then the child may
        still write into memory the caller would otherwise hand out again."""
        if not answers:
            return
        while True:  # a child, unless the pool stops meanwhile (then none may come back)
            if not self.available:
                raise ProcessesUnavailable(f"the {self.what} processes are closed or gone")
            try:
                proc, conn = self._idle.get(timeout=POLL_S)
                break
            except queue.Empty:
                continue
        healthy = False
        failed: BaseException | None = None
        try:
            conn.send(job)
            for i in range(answers):
                while not conn.poll(POLL_S):
                    if proc.poll() is not None:
                        raise EOFError(f"{self.what} process {proc.pid} exited with {proc.returncode}")
                outcome = conn.recv()
                if failed is None:
                    try:
                        answer(i, outcome)
                    except BaseException as exc:  # noqa: BLE001 - raised once the child is done
                        failed = exc
            healthy = True
        except (EOFError, OSError) as exc:
            self.available = False
            log.warning("kvstrata: a disk %s process failed (%s); working in the engine's threads "
                        "from now on", self.what, exc)
            _stopped(proc)  # a child whose pipe was closed under it writes nothing after this
            raise ProcessesUnavailable(str(exc)) from None
        finally:
            if healthy:
                self._idle.put((proc, conn))
        if failed is not None:
            raise failed

    def close(self) -> None:
        """Stop every child (each finishes the job it has, then sees its pipe close)."""
        with self._lock:
            self.available = False
            children, self._children = self._children, []
        for _, conn in children:
            conn.close()
        for proc, _ in children:
            _stopped(proc)


def _spawn(module: str, setup: dict[str, Any]) -> tuple[subprocess.Popen[bytes], Connection]:
    mine, theirs = socket.socketpair()
    # The child imports this very kvstrata, wherever the engine found it.
    package_root = str(Path(__file__).resolve().parents[3])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (package_root, os.environ.get("PYTHONPATH")) if p)}
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", module, str(theirs.fileno())],
            pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, close_fds=True, env=env)
    except BaseException:
        mine.close()
        raise
    finally:
        theirs.close()
    conn = Connection(mine.detach())
    conn.send(setup)  # the auth key goes over the pipe, never on a command line
    return proc, conn


def _stopped(proc: subprocess.Popen[bytes]) -> None:
    """Wait for a child whose pipe is closed (it exits at its next send or receive), killing it
    if it does not within CLOSE_TIMEOUT_S."""
    try:
        proc.wait(CLOSE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


Handler = Callable[[Any, Callable[[Any], None]], None]


def serve(conn: Connection, start: Callable[[dict[str, Any]], tuple[Handler, Callable[[], None]]]) -> None:
    """A child's loop: ``start(setup)`` opens what it needs and gives ``(handle, close)``;
    ``handle(job, send)`` sends each of the job's answers. Runs until the pipe closes."""
    # Stopped by its pipe closing, not by the terminal's Ctrl-C (the engine handles that).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    setup = conn.recv()
    try:
        handle, close = start(setup)
    except Exception as exc:  # told to the parent, which fails the pool with it
        conn.send(f"{type(exc).__name__}: {exc}")
        return
    conn.send("ready")
    try:
        while True:
            handle(conn.recv(), conn.send)
    except (EOFError, OSError):  # the pipe closed: the parent closed the pool or died
        return
    finally:
        close()

"""Disk reads in processes of their own: a record's LMDB read, MAC check, decode and checksum,
straight into a slot of the host slab, off the engine-core process's GIL.

The tiers run in vLLM's engine-core process, whose own Python threads (the step loop, vLLM's I/O
threads) hold the GIL most of the time on a busy server; a read thread's C calls release it and
wait up to the switch interval to get it back, several times a chunk: beside one busy thread a
read thread keeps a third of its speed, a child process doing the same reads 0.92x
(docs/BENCHMARKS.md, "The tiers' threads beside a busy Python thread"). LMDB lets several
processes read one store, and the host slab is shared memory, so only the chunk's key and its
place in the slab cross the pipe, and one word per chunk comes back.

``DiskReaders`` runs ``processes`` children (``python -m kvstrata.tiers.disk.read_process``, so
no main module of vLLM is imported again), each with its own read-only view of the store and the
slab. ``read_many`` hands a child a batch and reports each outcome as it arrives, in order (a
streamed load copies a chunk as soon as it landed). A child that dies (killed, out of memory)
makes the pool unavailable; the caller then reads in its own threads. A child exits when its
pipe closes: its parent closed the pool or died.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvstrata.auth import ValueAuth

log = logging.getLogger(__name__)

# One chunk shard to read: (store key, slab slot, offset in the slot, bytes).
Item = tuple[bytes, int, int, int]
# What a read gave: ("ok", bytes written | None for no such record | the record's problem),
# ("size", why the slot is too small), ("error", a store-level failure, e.g. LMDB's).
Outcome = tuple[str, Any]
POLL_S = 0.5  # how often a waiting caller checks that its child is still alive
START_TIMEOUT_S = 60.0  # a child opens the store and the slab within this, or the pool fails
CLOSE_TIMEOUT_S = 10.0


class ReadersUnavailable(RuntimeError):
    """The read processes cannot read (one died, or the pool is closed)."""


class DiskReaders:
    """Child processes reading a store's records into a host slab (see the module docstring)."""

    def __init__(self, store_path: str | Path, slab_path: str | Path, slot_bytes: int, num_slots: int, *,
                 processes: int, auth: ValueAuth | None = None, map_size: int = 1 << 40) -> None:
        if processes < 1:
            raise ValueError("DiskReaders needs at least one process")
        self._idle: queue.SimpleQueue[tuple[subprocess.Popen[bytes], Connection]] = queue.SimpleQueue()
        self._children: list[tuple[subprocess.Popen[bytes], Connection]] = []
        self._lock = threading.Lock()
        self.available = True
        setup = {"store_path": str(store_path), "slab_path": str(slab_path), "slot_bytes": slot_bytes,
                 "num_slots": num_slots, "map_size": map_size, "auth": auth}
        try:
            for _ in range(processes):
                self._children.append(self._spawn(setup))
            for proc, conn in self._children:  # each opened the store and the slab
                if not conn.poll(START_TIMEOUT_S):
                    raise ReadersUnavailable(f"a read process did not start within {START_TIMEOUT_S:g} s")
                started = conn.recv()
                if started != "ready":
                    raise ReadersUnavailable(f"a read process could not start: {started}")
                self._idle.put((proc, conn))
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _spawn(setup: dict[str, Any]) -> tuple[subprocess.Popen[bytes], Connection]:
        mine, theirs = socket.socketpair()
        # The child imports this very kvstrata, wherever the engine found it.
        package_root = str(Path(__file__).resolve().parents[3])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (package_root, os.environ.get("PYTHONPATH")) if p)}
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kvstrata.tiers.disk.read_process", str(theirs.fileno())],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, close_fds=True, env=env)
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        conn = Connection(mine.detach())
        conn.send(setup)  # the auth key goes over the pipe, never on a command line
        return proc, conn

    def read_many(self, items: Sequence[Item], answer: Callable[[int, Outcome], None]) -> None:
        """Read every item into the slab, calling ``answer(i, outcome)`` for each in order as it
        lands. Raises ReadersUnavailable when the pool cannot read; the items not answered by
        then were not read, or only in part (their slots hold garbage), and no process writes
        into them any more. An exception ``answer`` raises is raised once the child read every
        item (it is not answered for the rest)."""
        if not items:
            return
        while True:  # a child, unless the pool stops meanwhile (then none may come back)
            if not self.available:
                raise ReadersUnavailable("the read processes are closed or gone")
            try:
                proc, conn = self._idle.get(timeout=POLL_S)
                break
            except queue.Empty:
                continue
        healthy = False
        failed: BaseException | None = None
        try:
            conn.send(list(items))
            for i in range(len(items)):
                while not conn.poll(POLL_S):
                    if proc.poll() is not None:
                        raise EOFError(f"read process {proc.pid} exited with {proc.returncode}")
                outcome = conn.recv()
                if failed is None:
                    try:
                        answer(i, outcome)
                    except BaseException as exc:  # noqa: BLE001 - raised once the child is done
                        failed = exc
            # Only now, every answer in: until then the child may still write into the slots of
            # the items left, which the caller may hand out again once this raised.
            healthy = True
        except (EOFError, OSError) as exc:
            self.available = False
            log.warning("kvstrata: a disk read process failed (%s); reading in the engine's "
                        "threads from now on", exc)
            _stopped(proc)  # a child whose pipe was closed under it writes nothing after this
            raise ReadersUnavailable(str(exc)) from None
        finally:
            if healthy:
                self._idle.put((proc, conn))
        if failed is not None:
            raise failed

    def close(self) -> None:
        """Stop every child (each finishes the batch it has, then sees its pipe close)."""
        with self._lock:
            self.available = False
            children, self._children = self._children, []
        for _, conn in children:
            conn.close()
        for proc, _ in children:
            _stopped(proc)


def _stopped(proc: subprocess.Popen[bytes]) -> None:
    """Wait for a child whose pipe is closed (it exits at its next send or receive), killing it
    if it does not within CLOSE_TIMEOUT_S."""
    try:
        proc.wait(CLOSE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()

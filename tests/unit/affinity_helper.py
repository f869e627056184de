"""Threads started from a thread bound to one CPU, as in a vLLM CPU worker (its main thread is
OpenMP thread 0, bound to one core, and every thread it starts inherits that): run code there,
and read which CPUs this process's threads may run on."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

T = TypeVar("T")

# The CPUs of the test process (its main thread is not bound to fewer).
PROCESS_CPUS = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset()

needs_two_cpus = pytest.mark.skipif(
    not sys.platform.startswith("linux") or len(PROCESS_CPUS) < 2,
    reason="needs Linux thread affinity and two CPUs or more")


def on_one_cpu(fn: Callable[[], T]) -> T:
    """``fn()`` in a new thread bound to one CPU (the lowest of the process's); its result."""
    out: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            os.sched_setaffinity(0, {min(PROCESS_CPUS)})
            out.append(fn())
        except BaseException as exc:  # handed to the caller
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return out[0]


def thread_cpus(comm_prefix: str) -> dict[int, frozenset[int]]:
    """The CPUs each of this process's threads whose kernel name starts with ``comm_prefix``
    may run on, by thread id."""
    out: dict[int, frozenset[int]] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            if (task / "comm").read_text().strip().startswith(comm_prefix):
                out[int(task.name)] = frozenset(os.sched_getaffinity(int(task.name)))
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread ended meanwhile
    return out

"""Background threads: their kernel names (what `top -H` and the benchmarks' per-thread CPU
figures show) and their priority."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import pytest
from affinity_helper import PROCESS_CPUS, needs_two_cpus, on_one_cpu

from kvstrata.tiers.priority import (
    background_thread,
    kernel_thread_name,
    thread_policy,
    widen_this_thread,
)

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="kernel thread names are Linux's")


def _comm() -> str:
    return Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()


@pytest.mark.parametrize(("name", "expected"), [
    ("kvstrata-io", "kvs-io"),
    ("kvstrata-read-disk_1", "kvs-read-disk_1"),  # fits: the pool index stays
    ("kvstrata-write-disk_0", "kvs-write-disk"),  # would not fit: the index goes first
    ("kvstrata-urgent-remote_3", "kvs-urgent-remo"),  # still too long: clipped
    ("Thread-7", "Thread-7"),
])
def test_kernel_names_keep_what_tells_threads_apart(name: str, expected: str) -> None:
    assert kernel_thread_name(name) == expected
    assert len(kernel_thread_name(name).encode()) <= 15


@linux_only
def test_pool_threads_carry_their_names_and_priority_into_the_kernel() -> None:
    with ThreadPoolExecutor(1, thread_name_prefix="kvstrata-write-disk",
                            initializer=partial(background_thread, True)) as pool:
        comm, policy = pool.submit(lambda: (_comm(), thread_policy())).result()
    assert comm == "kvs-write-disk"
    if hasattr(os, "SCHED_IDLE") and policy is not None:
        assert policy == os.SCHED_IDLE
    with ThreadPoolExecutor(1, thread_name_prefix="kvstrata-read-disk",
                            initializer=partial(background_thread, False)) as pool:
        comm, policy = pool.submit(lambda: (_comm(), thread_policy())).result()
    assert comm == "kvs-read-disk_0"
    if policy is not None:
        assert policy == os.SCHED_OTHER


@linux_only
@pytest.mark.parametrize("initializer", ["background_thread", "worker_thread"])
def test_a_pool_thread_shows_its_name_only_once_its_priority_and_cpus_are_set(
        initializer: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tools and tests find kvstrata's threads by kernel name (`top -H`, /proc): one that shows
    its name already has its priority (write threads) or its CPUs (copy threads). A test that
    read a copy thread's CPUs while a second pool thread was still starting found it on one
    core."""
    from kvstrata.tiers import priority

    seen: list[str] = []  # the thread's kernel name when its setup ran

    def noting_the_name(setup):
        def run():
            seen.append(_comm())
            return setup()
        return run

    for setup in ("lower_this_thread", "widen_this_thread"):
        monkeypatch.setattr(priority, setup, noting_the_name(getattr(priority, setup)))
    init = partial(priority.background_thread, True) if initializer == "background_thread" else priority.worker_thread
    with ThreadPoolExecutor(1, thread_name_prefix="kvstrata-copy", initializer=init) as pool:
        name = pool.submit(_comm).result()
    assert name == "kvs-copy_0"
    assert seen and name not in seen, seen  # named after its setup


# ---- placement: threads of a CPU worker off the one OpenMP core they inherit ---------------------

@needs_two_cpus
def test_a_thread_started_on_one_core_is_widened_to_the_process_cpus() -> None:
    def widen() -> tuple[frozenset[int], frozenset[int] | None, frozenset[int]]:
        before = frozenset(os.sched_getaffinity(0))
        return before, widen_this_thread(), frozenset(os.sched_getaffinity(0))

    before, widened, after = on_one_cpu(widen)
    assert len(before) == 1
    assert widened == after == PROCESS_CPUS


@needs_two_cpus
def test_a_thread_on_every_cpu_of_the_process_is_left_alone() -> None:
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(widen_this_thread).result() is None
        assert pool.submit(lambda: frozenset(os.sched_getaffinity(0))).result() == PROCESS_CPUS


# A process whose every thread is bound, as a vLLM CPU worker: its main thread (OpenMP thread 0)
# to the first of its two CPUs, another thread (OpenMP thread 1) to the second. A thread the
# main thread starts inherits the first alone; widened, it gets both, never a CPU the process's
# threads were not given.
_WORKER_LIKE = """
import json, os, sys, threading
from kvstrata.tiers.priority import widen_this_thread
first, second = sorted(os.sched_getaffinity(0))[:2]
os.sched_setaffinity(0, {first})
bound, stop = threading.Event(), threading.Event()
def omp_thread_1():
    os.sched_setaffinity(0, {second})
    bound.set()
    stop.wait()
threading.Thread(target=omp_thread_1).start()
bound.wait()
out = {}
def kvstrata_thread():
    out["inherited"] = sorted(os.sched_getaffinity(0))
    out["widened"] = sorted(widen_this_thread() or [])
    out["now"] = sorted(os.sched_getaffinity(0))
t = threading.Thread(target=kvstrata_thread)
t.start()
t.join()
stop.set()
out["cpus"] = [first, second]
print(json.dumps(out))
"""


@needs_two_cpus
def test_a_worker_thread_is_widened_to_the_cores_its_process_was_given_and_no_others() -> None:
    proc = subprocess.run([sys.executable, "-c", _WORKER_LIKE], capture_output=True, text=True, timeout=60,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    first, second = out["cpus"]
    assert out["inherited"] == [first]
    assert out["widened"] == out["now"] == [first, second]

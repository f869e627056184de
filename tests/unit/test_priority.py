"""Background threads: their kernel names (what `top -H` and the benchmarks' per-thread CPU
figures show) and their priority."""

from __future__ import annotations

import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import pytest

from kvstrata.tiers.priority import background_thread, kernel_thread_name, thread_policy

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

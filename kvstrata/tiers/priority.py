"""Background work yields to serving: the threads that write chunks down to the lower tiers
(compression, LMDB puts, syncs) run at idle CPU priority, so they use the cores only when the
engine (the model on CPU, the scheduler, tokenizer and sampler on GPU servers) leaves them idle.
Reads keep normal priority: a request waits on them.

Each background thread also carries its name into the kernel (``name_this_thread``), so `top -H`,
`ps -L` and the benchmarks' per-thread CPU figures tell kvstrata's threads apart from the engine's
(Python 3.11 leaves every thread with the process's name).

Linux schedules threads, not processes: ``sched_setscheduler(0, SCHED_IDLE)`` from a thread
changes that thread alone. Elsewhere (or where it is refused) the thread's nice value is raised
instead, and where that fails too it runs as it was: lowering priority is best effort.

Threads started in a vLLM CPU worker inherit its main thread's CPU affinity, which vLLM narrows
to the one core of OpenMP thread 0 (``OMP_PROC_BIND``): a pool of copy threads spread over
"several cores" would all run on that core while the others idle (docs/BENCHMARKS.md, "Where the
gap to the fs tier comes from"). ``widen_this_thread`` lets such a thread run on every core the
worker's threads were given; kvstrata's worker threads copy while the forward waits for them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import re
import sys
import threading

logger = logging.getLogger(__name__)

_logged = threading.Event()

# Linux keeps 15 bytes of a thread's name (TASK_COMM_LEN 16 with the NUL).
_COMM_LEN = 15
_PR_SET_NAME = 15
_libc: ctypes.CDLL | None = None


def kernel_thread_name(name: str) -> str:
    """The name the kernel shows for a thread called ``name``: "kvstrata-" shortened to "kvs-",
    and a thread pool's ``_N`` suffix dropped where the name would not fit otherwise, so the
    part that tells threads apart survives the 15-byte limit."""
    if name.startswith("kvstrata-"):
        name = "kvs-" + name[len("kvstrata-"):]
    if len(name.encode()) > _COMM_LEN:
        name = re.sub(r"_\d+$", "", name)
    return name.encode()[:_COMM_LEN].decode(errors="ignore")


def name_this_thread(name: str | None = None) -> None:
    """Give the calling thread's kernel name ``name`` (default: its Python name); best effort,
    Linux only."""
    global _libc
    if not sys.platform.startswith("linux"):
        return
    try:
        if _libc is None:
            _libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        comm = kernel_thread_name(name or threading.current_thread().name)
        _libc.prctl(_PR_SET_NAME, ctypes.c_char_p(comm.encode()), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def background_thread(idle: bool) -> None:
    """Thread-pool initializer: give the thread idle priority if ``idle``, then name it (a
    thread that shows its name in `top -H` or /proc has its priority already)."""
    if idle:
        lower_this_thread()
    name_this_thread()


def lower_this_thread() -> str:
    """Give the calling thread idle priority; returns what was applied ("idle", "nice", "none")."""
    policy = getattr(os, "SCHED_IDLE", None)
    if policy is not None and hasattr(os, "sched_setscheduler"):
        try:
            os.sched_setscheduler(0, policy, os.sched_param(0))
            return "idle"
        except OSError:
            pass
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        return "nice"
    except (OSError, AttributeError) as exc:
        if not _logged.is_set():
            _logged.set()
            logger.info("kvstrata: cannot lower the priority of background threads: %s", exc)
        return "none"


def thread_policy(native_id: int | None = None) -> int | None:
    """The scheduling policy of a thread (this one by default), where the platform says."""
    if not hasattr(os, "sched_getscheduler"):
        return None
    try:
        return os.sched_getscheduler(native_id or 0)
    except OSError:
        return None


def process_cpus() -> frozenset[int] | None:
    """The CPUs any thread of this process may run on: in a vLLM CPU worker, the cores its OpenMP
    threads were bound to one by one (those vLLM gave this worker, within any ``taskset`` or
    cpuset). None where the platform cannot tell."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    cpus: set[int] = set()
    for tid in tasks:
        try:
            cpus.update(os.sched_getaffinity(int(tid)))
        except (OSError, ValueError):
            continue  # ended meanwhile
    return frozenset(cpus) or None


def widen_this_thread() -> frozenset[int] | None:
    """Let the calling thread run on every CPU of :func:`process_cpus` where it may run on fewer
    (see the module docstring); returns them, or None where it stays as it was. Best effort,
    like the priorities."""
    cpus = process_cpus()
    try:
        if cpus is None or not frozenset(os.sched_getaffinity(0)) < cpus:
            return None
        os.sched_setaffinity(0, cpus)
    except OSError:
        return None
    return cpus


def worker_thread() -> None:
    """Thread-pool initializer for threads in the engine's worker process: widen the thread off
    the OpenMP core it inherited, then name it (a thread that shows its name has its CPUs)."""
    widen_this_thread()
    name_this_thread()

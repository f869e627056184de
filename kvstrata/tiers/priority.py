"""Background work yields to serving: the threads that write chunks down to the lower tiers
(compression, LMDB puts, syncs) run at idle CPU priority, so they use the cores only when the
engine (the model on CPU, the scheduler, tokenizer and sampler on GPU servers) leaves them idle.
Reads keep normal priority: a request waits on them.

Linux schedules threads, not processes: ``sched_setscheduler(0, SCHED_IDLE)`` from a thread
changes that thread alone. Elsewhere (or where it is refused) the thread's nice value is raised
instead, and where that fails too it runs as it was: lowering priority is best effort.
"""

from __future__ import annotations

import logging
import os
import threading

logger = logging.getLogger(__name__)

_logged = threading.Event()


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

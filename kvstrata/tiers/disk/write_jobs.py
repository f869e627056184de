"""What the store hands its writer (``writer.py``): puts (``PutJob``, each with a future that
says whether it was written) and calls to run on the writer thread (``CallJob``); and
``when_committed``, which waits for a put call's futures without a thread of its own, and
``now_us``, the store's clock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstrata.tiers import codec

if TYPE_CHECKING:
    from kvstrata.tiers.disk.children import ChildPool


@dataclass(slots=True)
class PutJob:
    key: bytes
    frame: bytes | memoryview  # a memoryview into a frame slab: disk/encoders.py
    info: codec.FrameInfo
    tick: int
    future: Future[bool]
    mac: bytes = b""  # the value MAC (kvstrata.auth) of a store with an auth key
    place: tuple[int, int, int] | None = None  # (slot, offset, bytes) of the frame in a frame slab
    put_pool: ChildPool | None = None  # the put process that maps that frame slab


@dataclass(slots=True)
class CallJob:
    fn: Callable[[], Any]
    future: Future[Any]


def when_committed(present: int, futures: list[Future[bool]], done: Callable[[int], None]) -> None:
    """``done(present + the puts among futures that were written)`` once every put's future is
    done (committed or dropped): on the thread that finishes the last, here when there is none."""
    if not futures:
        done(present)
        return
    lock = threading.Lock()
    left = len(futures)

    def one_done(_fut: Future[bool]) -> None:
        nonlocal left
        with lock:
            left -= 1
            if left:
                return
        done(present + sum(1 for fut in futures if fut.result()))

    for fut in futures:
        fut.add_done_callback(one_done)


def now_us() -> int:
    return time.time_ns() // 1000

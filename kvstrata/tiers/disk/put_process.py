"""The disk tier's put process (``writer.py``, "The put process"): opens the store for writing
(without a session of its own: its parent's store has the store open) and maps the write
processes' frame slab, then runs each batch of put transactions its parent's writer thread
sends, with the same ``Putter`` as the writer thread, and answers once per batch with what each
transaction committed. Run as ``python -m kvstrata.tiers.disk.put_process FD``, FD one end of a
socket pair (``disk/children.py``).

A job: ``(epoch, ticks, quarantined, transactions)``: the access ticks not written yet, as
changes to the copy it keeps (``ticks.py``, ``AccessTicks.changes``), and the quarantined keys
(for eviction), and per transaction its puts as ``(key, frame slot, offset, length, tick, MAC)``
in the frame slab. The answer: per transaction ``("ok", txnid, outcomes,
added, removed, newly quarantined, reserve cap)`` or ``("failed", exception)``.
"""

from __future__ import annotations

import pickle
import sys
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from kvstrata.tiers import codec
from kvstrata.tiers.disk.children import Handler, serve

# One put: (store key, frame slot, offset in it, bytes, access tick, MAC).
PutItem = tuple[bytes, int, int, int, int, bytes]


@dataclass(slots=True)
class _Put:
    key: bytes
    frame: bytes | memoryview
    info: codec.FrameInfo
    tick: int
    mac: bytes


def start(setup: dict[str, Any]) -> tuple[Handler, Callable[[], None]]:
    """Open the store and map the frame slab; the handler of a batch of transactions, and the
    close."""
    import lmdb

    from kvstrata.tiers.disk.env import StoreEnv
    from kvstrata.tiers.disk.putter import Putter
    from kvstrata.tiers.disk.reserve import FsReserve
    from kvstrata.tiers.disk.write_jobs import now_us
    from kvstrata.tiers.host.slab import HostSlab
    from kvstrata.tiers.priority import lower_this_thread, name_this_thread

    if setup["idle"]:  # as the writer thread it works for (tiers/priority.py)
        lower_this_thread()
    name_this_thread("kvs-put")
    frames = HostSlab(setup["frames_path"], setup["frame_slot_bytes"], setup["frame_slots"], create=False)
    try:
        env = StoreEnv(Path(setup["store_path"]), map_size=setup["map_size"], create=False,
                       readonly=False, session=False)
    except BaseException:
        frames.close()
        raise
    ticks: dict[bytes, int] = {}
    ticks_epoch: list[int | None] = [None]
    quarantined: set[bytes] = set()
    newly: list[tuple[bytes, str]] = []

    def quarantine(key: bytes, why: str) -> None:
        quarantined.add(key)
        newly.append((key, why))

    putter = Putter(env.handles, FsReserve(env.path, setup["reserve_bytes"]),
                    budget_bytes=setup["budget_bytes"], evict_slack=setup["evict_slack"],
                    max_age_us=setup["max_age_us"], clock_us=now_us, touched=lambda: ticks,
                    quarantined=quarantined, quarantine=quarantine)

    def one(items: list[PutItem]) -> tuple[Any, ...]:
        jobs = []
        for key, slot, offset, length, tick, mac in items:
            frame = frames.view(slot, offset, length)
            jobs.append(_Put(key, frame, codec.frame_info(frame), tick, mac))
        txnid = -1

        def body(txn: lmdb.Transaction) -> tuple[list[Any], Any]:
            nonlocal txnid
            putter.start()
            newly.clear()
            txnid = txn.id()
            return putter.batch(txn, jobs)

        try:
            outcomes, totals = env.txn(body, write=True)
        except (lmdb.Error, OSError) as exc:  # full map or disk: the parent stops admitting
            return ("failed", _sendable(exc))
        putter.committed_totals = (txnid, totals)
        return ("ok", txnid, [(o.written, o.evicted, o.evicted_bytes, o.reason, o.froze) for o in outcomes],
                putter.added, putter.removed, list(newly), putter.reserve.cap)

    def handle(job: tuple[int, dict[bytes, int], set[bytes], list[list[PutItem]]],
               send: Callable[[Any], None]) -> None:
        epoch, changed_ticks, quarantine_now, txns = job
        if epoch != ticks_epoch[0]:  # the writer wrote the older ones
            ticks.clear()
            ticks_epoch[0] = epoch
        ticks.update(changed_ticks)
        quarantined.clear()
        quarantined.update(quarantine_now)
        send([one(items) for items in txns])

    def close() -> None:
        env.close()
        frames.close()

    return handle, close


def _sendable(exc: BaseException) -> BaseException:
    """``exc``, or what it says if it cannot cross the pipe."""
    try:
        pickle.dumps(exc)
        return exc
    except Exception:  # noqa: BLE001 - any pickling failure
        return RuntimeError(f"{type(exc).__name__}: {exc}")


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])), start)

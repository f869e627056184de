"""Framing a disk tier's writes in processes of their own (``disk/children.py``): a chunk's byte
planes, zstd, checksum and MAC, off the engine-core process's GIL (beside one busy Python thread
an encode thread keeps a third of its speed, docs/BENCHMARKS.md, "The tiers' threads beside a
busy Python thread").

A child reads the chunk from the host slab (shared memory) and writes its frame into a slot of
a *frame slab*, a second shared-memory slab made for the pool; only keys, places and the MAC
cross the pipe. The store's writer then puts the frame straight from the frame slab, in its
thread or in the put process (``put_process.py``, started here with ``put_setup``: it maps the
frame slab too) to which it hands runs of put transactions: LMDB has one writer at a time per
store, and an encoder committing itself would also leave the writer's index mirror behind. A
frame slot stays taken until the puts framed into it committed (or were dropped); callers wait
for a free one, so the pool holds back as many puts as it has frame slots.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import tempfile
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstrata.tiers.disk.children import POLL_S, ChildPool, ProcessesUnavailable
from kvstrata.tiers.disk.write_jobs import when_committed
from kvstrata.tiers.host.slab import HostSlab

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from kvstrata.auth import ValueAuth
    from kvstrata.tiers.codec import Mode

# One chunk shard to frame: (store key, slab slot, offset in the slot, bytes, dtype).
EncodeItem = tuple[bytes, int, int, int, str]
# A frame in the frame slab and its MAC (b"" without an auth key), or None: frame it yourself.
Framed = tuple[memoryview, bytes] | None
ALIGN = 64  # frames start on cache lines
FRAME_SLOTS_PER_PROCESS = 2  # one being put while the next is framed


class DiskEncoders(ChildPool):
    """Child processes framing chunks of a host slab into a frame slab (module docstring)."""

    def __init__(self, slab_path: str | Path, slot_bytes: int, num_slots: int, *, processes: int,
                 frame_slot_bytes: int, auth: ValueAuth | None = None, level: int = 1,
                 mode: Mode = "auto", idle: bool = False, frames_dir: str | Path | None = None,
                 put_setup: dict[str, Any] | None = None) -> None:
        if frames_dir is None:  # shared memory, as the host slab's
            frames_dir = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, frames_path = tempfile.mkstemp(prefix="kvstrata-frames-", suffix=".slab", dir=frames_dir)
        os.close(fd)
        self.frames: HostSlab | None = None
        self.put_pool: ChildPool | None = None  # the put process, with ``put_setup``
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        try:
            self.frames = HostSlab(frames_path, frame_slot_bytes, FRAME_SLOTS_PER_PROCESS * processes)
            setup = {"slab_path": str(slab_path), "slot_bytes": slot_bytes, "num_slots": num_slots,
                     "frames_path": frames_path, "frame_slot_bytes": frame_slot_bytes,
                     "frame_slots": self.frames.num_slots, "auth": auth, "level": level,
                     "mode": mode, "idle": idle}
            super().__init__("kvstrata.tiers.disk.encode_process", setup, processes=processes,
                             what="encode")
            if put_setup is not None:
                frames = {key: setup[key] for key in ("frames_path", "frame_slot_bytes", "frame_slots")}
                try:
                    self.put_pool = ChildPool("kvstrata.tiers.disk.put_process", {**put_setup, **frames},
                                              processes=1, what="put")
                except (ProcessesUnavailable, OSError) as exc:  # the writer thread puts them
                    log.warning("kvstrata: the disk put process could not start (%s); putting in "
                                "the writer thread", exc)
                except BaseException:
                    super().close()
                    raise
        except BaseException:
            if self.frames is not None:
                self.frames.close()
            raise
        finally:
            # Every process has it mapped (or failed): nothing is left behind when all exit.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(frames_path)
        for i in range(self.frames.num_slots):
            self._free.put(i)

    def frame_many(self, items: Sequence[EncodeItem]) -> FrameBatch:
        """Frame every item into one frame slot: per item its frame and MAC, or None where the
        caller must frame it itself (the slot's frames did not fit, the child failed on it, or
        the pool stopped: then every item not framed yet). Hand the batch's puts to
        :meth:`FrameBatch.release_after`. Raises ProcessesUnavailable, holding no slot, when the
        pool cannot frame anything."""
        frames = self.frames
        assert frames is not None
        while True:
            if not self.available:
                raise ProcessesUnavailable("the encode processes are closed or gone")
            try:
                slot = self._free.get(timeout=POLL_S)
                break
            except queue.Empty:
                continue
        batch = FrameBatch(self, slot, [None] * len(items), [None] * len(items))

        def answer(i: int, outcome: tuple) -> None:
            if outcome[0] == "ok":
                _, offset, length, mac = outcome
                batch.framed[i] = (frames.view(slot, offset, length), mac)
                batch.places[i] = (slot, offset, length)

        try:
            self.run((slot, list(items)), len(items), answer)
        except ProcessesUnavailable:
            pass  # what was framed stands; the caller frames the rest
        return batch

    def release(self, slot: int) -> None:
        """Frame slot ``slot`` is free again (``FrameBatch.release_after``)."""
        self._free.put(slot)

    def close(self) -> None:
        """Stop the children; frames handed out stay readable until their views are gone."""
        if self.put_pool is not None:
            self.put_pool.close()
        super().close()
        if self.frames is not None:
            self.frames.close()


@dataclass(slots=True)
class FrameBatch:
    """What :meth:`DiskEncoders.frame_many` framed into frame slot ``slot``."""

    pool: DiskEncoders
    slot: int
    framed: list[Framed]
    places: list[tuple[int, int, int] | None]  # (slot, offset, bytes) of each frame framed

    def release_after(self, puts: list[Future[bool]]) -> None:
        """Free the slot once these puts of its frames are done (committed or dropped: the
        writer no longer reads them); at once without any."""
        when_committed(0, puts, self._release)

    def _release(self, _stored: int) -> None:
        self.pool.release(self.slot)

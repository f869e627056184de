"""A store's child processes over host slabs: read processes that read chunks straight into one
slab (``readers.py``) and write processes that frame chunks out of one (``encoders.py``), each
pool started for the slab a hierarchy gave it, and started again for another one.

The store decides what to do with what they answer (``store.py``); this module only keeps the
pools and says how far they got, so that the store's own threads can do the rest when a pool
cannot (closed, a child gone, not started).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstrata.tiers.disk.children import ProcessesUnavailable
from kvstrata.tiers.disk.encoders import DiskEncoders, EncodeItem, FrameBatch
from kvstrata.tiers.disk.readers import DiskReaders, Item, Outcome

if TYPE_CHECKING:
    from kvstrata.auth import ValueAuth
    from kvstrata.tiers.codec import Mode
    from kvstrata.tiers.host import HostSlab


class SlabProcesses:
    """The read and write process pools of the store at ``store_path`` (see the module
    docstring). ``auth``, ``map_size``, ``level`` and ``codec_mode`` are the store's own."""

    def __init__(self, store_path: Path, *, auth: ValueAuth | None, map_size: int, level: int,
                 codec_mode: Mode) -> None:
        self.store_path = store_path
        self._auth = auth
        self._map_size = map_size
        self._level = level
        self._codec_mode = codec_mode
        self.readers: DiskReaders | None = None
        self.read_slab: HostSlab | None = None
        self.encoders: DiskEncoders | None = None
        self.write_slab: HostSlab | None = None

    def use_readers(self, slab: HostSlab, processes: int) -> None:
        """Read into ``slab`` in ``processes`` processes (0: none). Raises ProcessesUnavailable
        when they cannot start."""
        if self.readers is not None and (slab is not self.read_slab or processes <= 0):
            self.readers.close()  # started for another slab, or no longer wanted
            self.readers = None
        self.read_slab = slab
        if processes > 0 and self.readers is None:
            self.readers = DiskReaders(self.store_path, slab.path, slab.slot_bytes, slab.num_slots,
                                       processes=processes, auth=self._auth, map_size=self._map_size)

    def use_encoders(self, slab: HostSlab, processes: int, *, idle: bool,
                     put_rules: dict[str, Any] | None = None) -> None:
        """Frame out of ``slab`` in ``processes`` processes (0: none), at idle CPU priority if
        ``idle``; with ``put_rules`` (``Writer.put_rules``) a put process too
        (``encoders.put_pool``). Raises ProcessesUnavailable when they cannot start."""
        if self.encoders is not None and (slab is not self.write_slab or processes <= 0):
            self.encoders.close()  # started for another slab, or no longer wanted
            self.encoders = None
        self.write_slab = slab
        if processes > 0 and self.encoders is None:
            # A frame slot holds the frames of one put call: at most a slot of the slab, plus
            # each shard's frame header and plane table.
            self.encoders = DiskEncoders(
                slab.path, slab.slot_bytes, slab.num_slots, processes=processes,
                frame_slot_bytes=slab.slot_bytes + (64 << 10), auth=self._auth, level=self._level,
                mode=self._codec_mode, idle=idle,
                put_setup=None if put_rules is None else
                {**put_rules, "store_path": str(self.store_path), "map_size": self._map_size})

    def read_many(self, slab: HostSlab, items: Sequence[Item], answer: Callable[[int, Outcome], None]) -> int:
        """Read ``items`` into ``slab`` in the read processes, ``answer(i, outcome)`` for each in
        order; how many were answered (all of them, or those before the processes failed, or
        none: no processes, or processes that map another slab). What a dying process half wrote
        is read again by whoever reads the rest."""
        readers = self.readers
        if readers is None or not readers.available or not items or slab is not self.read_slab:
            return 0
        done = 0

        def counted(i: int, outcome: Outcome) -> None:
            nonlocal done
            done = i + 1
            answer(i, outcome)

        try:
            readers.read_many(items, counted)
        except ProcessesUnavailable:
            return done
        return len(items)

    def frame_many(self, slab: HostSlab, items: Sequence[EncodeItem]) -> FrameBatch | None:
        """The write processes' frames of ``items`` of ``slab`` (``DiskEncoders.frame_many``), or
        None when there are none to frame them (or they map another slab)."""
        encoders = self.encoders
        if encoders is None or not encoders.available or not items or slab is not self.write_slab:
            return None
        try:
            return encoders.frame_many(items)
        except ProcessesUnavailable:
            return None

    def close(self) -> None:
        """Stop both pools; frames handed out stay readable (the writer still puts them)."""
        if self.readers is not None:
            self.readers.close()
        if self.encoders is not None:
            self.encoders.close()

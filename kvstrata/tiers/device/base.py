"""What every device stager shares: slab geometry, group discovery, validation, the public API.

Host shard layout for group ``g`` (DESIGN.md "Units"): ``[layer of g][block j of the chunk][page_g]``
at ``slot * slot_bytes + shard_index * shard_bytes``. A backend only decides how validated jobs are
copied and when they complete (``_run``, ``wait``, ``close``; ``mark_compute`` where copies are
queued on a device).
"""

from __future__ import annotations

import logging
from abc import ABCMeta, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar, Literal, NotRequired, TypedDict

import torch

from kvstrata.tiers.device.layout import NULL_BLOCK, LayerPages, Transfer, group_pages, kv_device
from kvstrata.tiers.host import HostSlab

logger = logging.getLogger(__name__)

Direction = Literal["store", "load"]


class StagerGeometry(TypedDict):
    """The keyword arguments every backend takes (see ``DeviceStager``)."""

    num_blocks: int
    blocks_per_chunk: int
    shard_bytes: int
    shard_index: NotRequired[int]
    group_page_bytes: NotRequired[Sequence[int] | None]


class _PicksBackend(ABCMeta):
    # ``DeviceStager(...)`` was the one concrete class before the backends were split; calling the
    # base still builds the right backend, so code written against it keeps working. Subclasses
    # construct normally.
    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls is DeviceStager:
            from kvstrata.tiers.device import make_stager  # the factory imports every backend

            return make_stager(*args, **kwargs)
        return super().__call__(*args, **kwargs)


class DeviceStager(metaclass=_PicksBackend):
    """Moves block pages between device KV tensors and host slab slots.

    Build one with ``make_stager`` (or ``DeviceStager(...)``, which calls it): it picks the backend
    by the KV tensors' device.

    Args:
        kv_caches: ``register_kv_caches``'s dict, layer name -> tensor.
        group_layers: per group, its layer names in config order (the host shard order).
        host: the slab (or a ``[num_slots, slot_bytes]`` uint8/int8 CPU tensor).
        num_blocks: manager blocks (``kv_cache_config.num_blocks``); kernel-split views are
            regrouped to it.
        blocks_per_chunk: blocks per chunk (``bpc``).
        shard_bytes: bytes of one rank's shard in a slot; this rank's shard starts at
            ``shard_index * shard_bytes``.
        group_page_bytes: optional unpadded page size per group, checked against the tensors.

    Jobs are reported once each by ``poll`` as ``(job_id, ok)``; a job with a bad transfer fails
    without raising (the engine must survive a bad job).
    """

    #: True when copies run on the calling thread (CPU): ``load_now`` works and nothing is queued
    #: on a stream, so callers may copy a chunk as soon as it lands.
    copies_on_host: ClassVar[bool]

    def __init__(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        group_layers: Sequence[Sequence[str]],
        host: HostSlab | torch.Tensor,
        *,
        num_blocks: int,
        blocks_per_chunk: int,
        shard_bytes: int,
        shard_index: int = 0,
        group_page_bytes: Sequence[int] | None = None,
    ) -> None:
        self.device = kv_device(kv_caches)
        self.num_blocks = num_blocks
        self.bpc = blocks_per_chunk

        host_t = host.tensor if isinstance(host, HostSlab) else host
        if host_t.dim() != 2 or host_t.element_size() != 1 or host_t.device.type != "cpu":
            raise ValueError("host must be a CPU [num_slots, slot_bytes] byte tensor or a HostSlab")
        self.num_slots, self.slot_bytes = int(host_t.shape[0]), int(host_t.shape[1])
        self._host_flat = host_t.reshape(-1).view(torch.int8)
        self._host_ptr = self._host_flat.data_ptr()
        self._shard_offset = shard_index * shard_bytes
        if (shard_index + 1) * shard_bytes > self.slot_bytes:
            raise ValueError(
                f"shard {shard_index} of {shard_bytes} bytes does not fit a {self.slot_bytes}-byte slot"
            )

        self._layers: list[list[LayerPages]] = []
        self._host: list[torch.Tensor] = []
        self.group_page_bytes: list[int] = []
        self.group_shard_bytes: list[int] = []
        # Groups this stager cannot serve (no layers, mixed page sizes, too big for a shard) ->
        # why. vLLM hands every group; jobs touching one of these fail instead of the engine.
        self.group_errors: dict[int, str] = {}
        for g, names in enumerate(group_layers):
            try:
                layers, page = group_pages(g, names, kv_caches, num_blocks, group_page_bytes)
                gsb = len(layers) * blocks_per_chunk * page
                if gsb > shard_bytes:
                    raise ValueError(
                        f"group {g} needs {gsb} bytes per shard, shard has {shard_bytes}"
                    )
            except ValueError as exc:
                self.group_errors[g] = str(exc)
                logger.warning("kvstrata: KV group %d cannot be staged: %s", g, exc)
                layers, page, gsb = [], 0, 0
            self._layers.append(layers)
            self.group_page_bytes.append(page)
            self.group_shard_bytes.append(gsb)
            # [slot, layer, block in chunk, page byte] view of this rank's shard for group g.
            self._host.append(
                self._host_flat.as_strided(
                    (self.num_slots, len(layers), blocks_per_chunk, page),
                    (self.slot_bytes, blocks_per_chunk * page, page, 1),
                    shard_index * shard_bytes,
                )
            )
        if len(self.group_errors) == len(group_layers):
            raise ValueError(f"no KV cache group can be staged: {self.group_errors}")

        self._results: list[tuple[int, bool]] = []
        self.bytes_stored = 0
        self.bytes_loaded = 0

    # ---- public API --------------------------------------------------------------------------

    def store(self, job_id: int, transfers: Iterable[Transfer], *, after: Any = None) -> None:
        """Copy device pages into host slots (device -> host).

        ``after``: a ``mark_compute()`` taken after the forward that wrote these pages; the copies
        are ordered after it (default: after everything the compute stream has queued now).
        """
        self._submit("store", job_id, [Transfer(*t) for t in transfers], after)

    def load(self, job_id: int, transfers: Iterable[Transfer]) -> None:
        """Copy host slots into device pages (host -> device). The job completes by ``poll``;
        nothing else waits for it (the scheduler runs the request once it is reported)."""
        self._submit("load", job_id, [Transfer(*t) for t in transfers])

    def mark_compute(self) -> Any:
        """A marker of the compute stream's work so far, for ``store(after=)``; None where
        copies run on the calling thread (CPU: the forward is done when it returns)."""
        return None

    def load_now(self, t: Transfer) -> None:
        """CPU devices: copy one host slot into its device pages on the calling thread (a
        streamed load's chunk that just landed). Raises IndexError for a bad transfer."""
        raise RuntimeError("load_now is for CPU devices; accelerators use load()")

    def hold_copies(self) -> None:
        """The engine thread is about to launch a forward: jobs not yet started wait until
        ``release_copies`` (accelerators; a no-op where copies run on the calling thread)."""

    def release_copies(self) -> None:
        """The forward is launched: held copies go out."""

    @property
    def copies_held(self) -> bool:
        """Whether jobs not yet started are being held now (``hold_copies``)."""
        return False

    def poll(self) -> list[tuple[int, bool]]:
        """Jobs finished since the last poll, as ``(job_id, ok)``; never blocks."""
        out, self._results = self._results, []
        return out

    @abstractmethod
    def wait(self, job_ids: Iterable[int]) -> None:
        """Block until these jobs have finished (fences block reuse); ``poll`` still reports them."""

    @property
    @abstractmethod
    def pending(self) -> int:
        """Jobs submitted and not yet finished."""

    @abstractmethod
    def close(self) -> None:
        """Wait for in-flight copies (their buffers must outlive them) and release resources."""

    # ---- job plumbing ------------------------------------------------------------------------

    @abstractmethod
    def _run(
        self, direction: Direction, job_id: int, transfers: list[Transfer], after: Any = None
    ) -> None:
        """Copy a validated job; its ``(job_id, ok)`` reaches ``_results`` now or by ``poll``."""

    def _submit(
        self, direction: Direction, job_id: int, transfers: list[Transfer], after: Any = None
    ) -> None:
        # Every transfer is checked before any copy: no address is formed from an unchecked id,
        # and a bad job touches nothing.
        try:
            for t in transfers:
                self._check(t)
        except IndexError as exc:
            logger.error("kvstrata: bad %s job %d: %s", direction, job_id, exc)
            self._results.append((job_id, False))
            return
        self._run(direction, job_id, transfers, after)

    def _check(self, t: Transfer) -> None:
        if not 0 <= t.group < len(self._layers):
            raise IndexError(f"group {t.group} out of range")
        if t.group in self.group_errors:
            raise IndexError(f"group {t.group} cannot be staged: {self.group_errors[t.group]}")
        if not 0 <= t.slot < self.num_slots:
            raise IndexError(f"slot {t.slot} out of range")
        if t.first_block < 0 or t.first_block + len(t.block_ids) > self.bpc:
            raise IndexError(
                f"blocks {t.first_block}+{len(t.block_ids)} exceed a {self.bpc}-block chunk"
            )
        for bid in t.block_ids:
            if not 0 <= int(bid) < self.num_blocks:
                raise IndexError(f"block id {bid} out of range")

    def _zero_positions(self, group: int, slot: int, positions: Iterable[int]) -> None:
        """Stores: chunk positions of null blocks get deterministic (zero) bytes in the slot."""
        for j in positions:
            self._host[group][slot][:, j].zero_()

    def _transfer_bytes(self, t: Transfer) -> int:
        real = sum(1 for b in t.block_ids if int(b) != NULL_BLOCK)
        return real * len(self._layers[t.group]) * self.group_page_bytes[t.group]

    def _count(self, direction: Direction, nbytes: int) -> None:
        if direction == "store":
            self.bytes_stored += nbytes
        else:
            self.bytes_loaded += nbytes

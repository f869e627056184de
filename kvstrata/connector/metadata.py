"""What travels between the scheduler-side and worker-side connectors each step.

Kept small and picklable: vLLM ships the scheduler's metadata to every worker inside
``SchedulerOutput`` and the workers' metadata back inside ``KVConnectorOutput``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


class ChunkCopy(NamedTuple):
    """One chunk of one group: GPU blocks <-> one host slot.

    ``first_block`` is the index within the chunk of ``block_ids[0]``: a load that starts inside a
    chunk (its first blocks are already in the GPU prefix cache) copies only the chunk's tail.
    ``ticket`` (loads only): 0 when the slot holds the chunk now; otherwise the worker waits for
    the slot's landing board to show it (streamed load, ``tiers/landing.py``); -1 fails the load.

    A named tuple rather than a dataclass: a 32k-token prompt's load has hundreds, built on the
    scheduler's path and pickled to every worker each step (about 2.5x faster to build, 2x to
    pickle and 4.5x to unpickle; docs/BENCHMARKS.md, "Promotions launched after the step's
    scheduling").
    """

    group: int
    slot: int
    first_block: int
    block_ids: tuple[int, ...]
    ticket: int = 0


@dataclass(slots=True)
class TransferJob:
    """``sync`` (loads only): copied before this step's forward, which computes the request; a
    failure is reported as block ids, never in ``finished_recving`` (vLLM runs the request).
    ``partial`` (loads only): a piece of a load brought in pieces other than its last; its
    result goes to the scheduler only, and the request is reported with the last piece."""

    job_id: int
    req_id: str
    is_store: bool
    copies: list[ChunkCopy]
    sync: bool = False
    partial: bool = False

    @property
    def block_ids(self) -> list[int]:
        return [b for c in self.copies for b in c.block_ids]


@dataclass
class StrataMetadata(KVConnectorMetadata):
    """Scheduler -> workers, one per step."""

    loads: list[TransferJob] = field(default_factory=list)
    stores: list[TransferJob] = field(default_factory=list)
    # Store jobs whose GPU blocks are re-allocated this step: workers finish them before the
    # forward (and before block zeroing) in ``handle_preemptions``.
    flush: set[int] = field(default_factory=set)


@dataclass
class StrataWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers -> scheduler: jobs finished since the last step, summed over workers."""

    completed: dict[int, int] = field(default_factory=dict)
    failed: dict[int, int] = field(default_factory=dict)
    bytes_loaded: int = 0
    bytes_stored: int = 0
    load_seconds: float = 0.0
    store_seconds: float = 0.0

    def aggregate(self, other: KVConnectorWorkerMetadata) -> StrataWorkerMetadata:
        assert isinstance(other, StrataWorkerMetadata)
        completed = dict(self.completed)
        for job, n in other.completed.items():
            completed[job] = completed.get(job, 0) + n
        failed = dict(self.failed)
        for job, n in other.failed.items():
            failed[job] = failed.get(job, 0) + n
        return StrataWorkerMetadata(
            completed=completed,
            failed=failed,
            bytes_loaded=self.bytes_loaded + other.bytes_loaded,
            bytes_stored=self.bytes_stored + other.bytes_stored,
            load_seconds=self.load_seconds + other.load_seconds,
            store_seconds=self.store_seconds + other.store_seconds,
        )

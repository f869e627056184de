"""Connector statistics through vLLM's connector-stats hooks and Prometheus metrics.

``StrataStats.data`` is a flat dict of counters (summed when aggregated) plus a few observation lists
(latencies), so it survives vLLM's serialisation between the engine core and the logger process.
Tier gauges (bytes and chunks per tier) are snapshots: the newest one wins.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

if TYPE_CHECKING:
    from prometheus_client import Counter, Gauge, Histogram
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric, PromMetricT

COUNTERS = {
    "lookups": "Prefix lookups answered by kvstrata",
    "lookup_deferrals": "Lookups deferred while a disk->host promotion or store was in flight",
    "hit_tokens": "Tokens served from kvstrata (all tiers)",
    "hit_tokens_host": "Tokens served from the host tier",
    "hit_tokens_disk": "Tokens served after promotion from the disk tier",
    "hit_tokens_remote": "Tokens served after promotion from the shared (Redis/Valkey) tier",
    "load_jobs": "Load jobs (device <- host)",
    "tail_extensions": "Loads ending in a stored prompt's tail that a longer prompt starts with "
                       "(a multi-turn follow-up served inside the block its previous prompt ended in)",
    "streamed_loads": "Load jobs sent before all their chunks landed from disk (stream_loads)",
    "sync_loads": "Load jobs copied before the forward of the step that computes their request (sync_loads)",
    "pieced_loads": "Loads larger than the host tier's room, promoted and copied a piece at a time "
                    "instead of computing what did not fit",
    "load_pieces": "Load jobs after the first of loads brought in pieces",
    "pieced_loads_given_up": "Loads in pieces ended (recomputed) after waiting host_room_wait_s for "
                             "room for their next piece",
    "store_jobs": "Store jobs (device -> host)",
    "bytes_loaded": "Bytes copied host -> device",
    "bytes_stored": "Bytes copied device -> host",
    "load_seconds": "Seconds load jobs took: a synchronous one until the forward could start "
                    "(chunks still landing from disk included), others until reported done",
    "store_seconds": "Seconds spent in device -> host copies",
    "allocation_failures": "Stores refused: no free host slot for even the start of their offer",
    "stores_cut": "Stores of the start of an offer the host tier had no room for in whole "
                  "(the rest is offered again in later steps)",
    "late_tail_stores": "Prompt tails stored while their request decoded, the host tier having had "
                        "no room in the step that completed the prompt",
    "load_failures": "Load jobs that failed (request recomputed)",
    "store_failures": "Store jobs that failed",
}
# Cumulative tier figures from the hierarchy (snapshots, not summed).
GAUGES = (
    "host_chunks", "host_bytes", "disk_entries", "disk_raw_bytes", "disk_stored_bytes",
    "disk_evictions", "disk_admission_drops", "disk_errors", "disk_corrupt", "disk_forged",
    # 1 while the disk tier keeps its size because its file system is down to disk_reserve.
    "disk_reserve_capped",
    "promotions", "warm_promotions", "writes_behind",
    # Chunks a lower tier held that lookups found no host slot to promote: computed instead
    # (no_room: loads not streamed), or asked for again while their request waited for room (host_room_wait_s).
    "promotions_no_room", "promotion_room_waits",
    # ... or answered as hits and promoted in a later piece of their request's load.
    "promotions_queued",
    # Chunks pinned in the host tier for requests whose lookup waited, until they loaded them.
    "waiting_holds",
    # Chunks promoted and evicted before any load used them: disk reads for nothing (a host
    # tier too small for what waiting requests want).
    "promotions_unused",
    # Disk writes run on normal-priority threads to catch up, and the share of what the disk
    # was given that requests came back for (tiers/hierarchy/reuse.py).
    "disk_writes_urgent", "disk_write_reuse",
    # The shared tier: whether it answers now, bytes moved, values served, and what went wrong
    # (errors: failed or refused calls; unavailable_skips: calls not made while it was down;
    # writes_dropped: writes that did not reach it, its backlog full or the server away; a
    # failed one is sent again once the server answers, and a clean shutdown writes them all).
    "remote_available", "remote_read_bytes", "remote_written_bytes", "remote_hits",
    "remote_errors", "remote_unavailable_skips", "remote_corrupt", "remote_writes_dropped",
    # Values refused because their MAC was missing or wrong (auth keys; docs/SECURITY.md).
    "remote_forged",
)
_OBS = "lookup_delay_s"


@dataclass
class StrataStats(KVConnectorStats):
    def __post_init__(self) -> None:
        for name in COUNTERS:
            self.data.setdefault(name, 0)
        self.data.setdefault(_OBS, [])

    def __getattr__(self, name: str) -> Any:
        if name in COUNTERS:
            return self.data[name]
        raise AttributeError(name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in COUNTERS:
            self.data[name] = value
        elif name == "tiers":
            for key in GAUGES:
                if isinstance(value, dict) and key in value:
                    self.data[key] = value[key]
        else:
            super().__setattr__(name, value)

    def observe_lookup_delay(self, seconds: float) -> None:
        self.data[_OBS].append(seconds)

    def record_transfers(self, meta: Any) -> None:
        self.data["bytes_loaded"] += meta.bytes_loaded
        self.data["bytes_stored"] += meta.bytes_stored
        self.data["load_seconds"] += meta.load_seconds
        self.data["store_seconds"] += meta.store_seconds

    def reset(self) -> None:
        self.data = {}
        self.__post_init__()

    def aggregate(self, other: KVConnectorStats) -> StrataStats:
        for key, value in other.data.items():
            if key in COUNTERS:
                self.data[key] = self.data.get(key, 0) + value
            elif key == _OBS:
                self.data[_OBS] = [*self.data.get(_OBS, []), *value]
            else:
                self.data[key] = value
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: v for k, v in self.data.items() if k != _OBS}
        delays = sorted(self.data.get(_OBS, []))
        if delays:
            out["lookup_delay_p50_ms"] = round(1e3 * delays[len(delays) // 2], 3)
            out["lookup_delay_max_ms"] = round(1e3 * delays[-1], 3)
        return out

    def is_empty(self) -> bool:
        # A tier snapshot is news even on a step where no counter moved (a decode-only step):
        # dropped, the gauges would show an old state (a server gone) until traffic came back.
        return (not any(self.data.get(k) for k in COUNTERS) and not self.data.get(_OBS)
                and not any(k in self.data for k in GAUGES))


class StrataPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvstrata_*`` counters and gauges, one series per engine."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        # vLLM types each of the three as any metric class; each is the one its name says.
        counter_cls = cast("type[Counter]", self._counter_cls)
        gauge_cls = cast("type[Gauge]", self._gauge_cls)
        histogram_cls = cast("type[Histogram]", self._histogram_cls)
        self._counters = {
            name: self._per_engine(counter_cls(
                name=f"vllm:kvstrata_{name}", documentation=doc, labelnames=labelnames))
            for name, doc in COUNTERS.items()
        }
        self._gauges = {
            name: self._per_engine(gauge_cls(
                name=f"vllm:kvstrata_{name}", documentation=f"kvstrata tier figure {name}",
                labelnames=labelnames, multiprocess_mode="mostrecent"))
            for name in GAUGES
        }
        self._lookup_delay = self._per_engine(histogram_cls(
            name="vllm:kvstrata_lookup_delay_seconds",
            documentation="Time from a request's first kvstrata lookup to its answer",
            labelnames=labelnames,
            buckets=[0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0],
        ))

    def _per_engine(self, metric: Any) -> dict[int, Any]:
        return {idx: metric.labels(*values) for idx, values in self.per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            if name in self._counters and value:
                self._counters[name][engine_idx].inc(value)
            elif name in self._gauges:
                self._gauges[name][engine_idx].set(value)
        for seconds in transfer_stats_data.get(_OBS, ()):
            self._lookup_delay[engine_idx].observe(seconds)

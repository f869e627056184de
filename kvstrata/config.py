"""kvstrata's connector options (``kv_connector_extra_config``), validated at start-up.

Every key has a sensible default except none: a user may pass ``{}`` and get the embedded default
store. An unknown key or a bad value is an error that names the key, so a typo never silently falls
back to a default.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from kvstrata import config_values as values
from kvstrata import fsmode
from kvstrata.config_values import ConfigError
from kvstrata.remote_address import parse_remote_url

DEFAULT_STORE_ENV = "KVSTRATA_STORE"
DEFAULT_HOST_BYTES = 1 << 30
DEFAULT_DISK_BYTES = 64 << 30
DEFAULT_DISK_RESERVE = 1 << 30
MAX_AUTO_IO_THREADS = 4
MAX_AUTO_WRITE_THREADS = 4
AUTO_CHUNK_TOKENS = 64  # the least tokens per chunk blocks_per_chunk "auto" aims for

def default_store_path() -> Path:
    """The embedded default store: ``$KVSTRATA_STORE`` or ``~/.cache/kvstrata/store``."""
    env = os.environ.get(DEFAULT_STORE_ENV)
    if env:
        try:
            return values.expand_path(env)
        except ValueError as exc:
            raise ConfigError(f"${DEFAULT_STORE_ENV}: {exc}") from None
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "kvstrata" / "store"


@dataclass(frozen=True)
class StrataConfig:
    """All options. Field names are the ``kv_connector_extra_config`` keys."""

    store_path: Path = field(default_factory=default_store_path)
    host_bytes: int = DEFAULT_HOST_BYTES
    disk_bytes: int = DEFAULT_DISK_BYTES
    # Free space the disk tier leaves on its file system, a size or a share of the file system
    # ("5%"): once a write would take the file system below it, the store stops growing and makes
    # room by evicting its least recently used chunks, whatever disk_bytes allows (a full file
    # system fails every program on it). 0: none.
    disk_reserve: int | str = DEFAULT_DISK_RESERVE
    disk: bool = True
    # vLLM blocks per stored chunk. "auto": chunks of at least AUTO_CHUNK_TOKENS tokens where
    # every offloaded group is plain full attention (a GPU's 16-token blocks: 4), one block
    # otherwise (connector/plan.py): per-chunk bookkeeping on the scheduler's side is what a
    # step pays for, and 16-token chunks cost 3x as much per step as 64-token ones
    # (docs/BENCHMARKS.md, "The scheduler's side at GPU scale").
    blocks_per_chunk: int | Literal["auto"] = "auto"
    codec: Literal["auto", "raw"] = "auto"
    zstd_level: int = 1
    admission: int = 1
    eviction: Literal["lru", "arc"] = "lru"
    prefetch_concurrency: int = 4
    # Disk -> host read threads (LMDB get + decompress), in the engine-core process beside vLLM's
    # step loop and its workers. "auto": one per core this process may use, at most
    # MAX_AUTO_IO_THREADS. More threads than cores lost on a 2-core machine: a 4096-token disk
    # load (32 records) finished decoding in 0.085-0.134 s with 2 threads, 0.112-0.179 s with 4
    # and 0.139-0.164 s with 8, alternating runs of benchmarks/profile_disk_ttft.py.
    io_threads: int | str = "auto"
    # Host -> disk (and shared tier) write threads per lower tier (compression, then the tier's
    # own writer). One thread compresses 0.3-1 GB/s of bf16 KV per core (storage-facts 3.3;
    # docs/BENCHMARKS.md), less than a GPU prefills: the rest is postponed and, once the host
    # tier evicts it, never written. "auto": on CPU engines 1 (the forward keeps every core
    # busy; writes take what it leaves), on accelerators one per core this process may use, at
    # most MAX_AUTO_WRITE_THREADS (docs/BENCHMARKS.md, "Write-behind throughput").
    write_threads: int | str = "auto"
    # Processes reading the disk tier's promotions straight into the host slab (LMDB read,
    # decode, checksum), off the engine-core process's GIL: beside a busy Python thread a read
    # thread keeps a third of its speed, a process 0.92x (docs/BENCHMARKS.md, "The tiers'
    # threads beside a busy Python thread"). 0: the io_threads read in this process. "auto": 0
    # on CPU engines (the forward keeps the cores; the engine core's thread mostly waits for
    # it), one per read thread on accelerators, whose engine core keeps a thread busy.
    read_processes: int | str = "auto"
    # Processes framing the disk tier's writes (byte planes, zstd, checksum, MAC) from the host
    # slab into a frame slab of their own, off the engine-core process's GIL; the store's LMDB
    # writer thread puts the frames (docs/BENCHMARKS.md, "Writes framed in processes"). 0: the
    # write threads frame. "auto": 0 on CPU engines, one per write thread on accelerators.
    write_processes: int | str = "auto"
    max_disk_write_backlog_bytes: int = 512 << 20
    offload_prompt_only: bool = True
    max_age_s: float | None = None
    host_shm_dir: Path | None = None
    # Answer a disk hit before its chunks are read and hand them to the device as they land
    # (tiers/landing.py). A chunk that then fails to decode fails the load, which vLLM
    # recomputes only under kv_load_failure_policy="recompute": "auto" streams exactly then.
    stream_loads: bool | str = "auto"
    # Load a hit in the step that computes its request, before that step's forward, instead of
    # asynchronously: an asynchronous load is copied after one forward and reported in its
    # output, so the request computes a step or two later (two under vLLM's async scheduling),
    # which under load is most of a disk or host hit's time to first token. "auto": on CPU
    # engines, where the copy is a memcpy on the engine's thread either way (a streamed disk
    # hit's chunks are waited for there too: the forward would share the cores with their
    # decompression); accelerators keep asynchronous loads so a forward never waits for a copy
    # (true makes it wait for host-tier hits, never for the disk). Only with one
    # KV cache group: vLLM can recover from a failed synchronous load only by block ids, which
    # it cannot map with several groups (docs/SEMANTICS.md §1.6).
    sync_loads: bool | str = "auto"
    # A request whose prefix a lower tier holds, but which the host tier has no room to promote
    # (every slot held by stores, loads and writes behind), waits for room up to this long from
    # its first lookup, instead of computing what did not fit. 0: never waits. "auto": 1 s on
    # CPU engines, where a follow-up otherwise recomputed up to 2,000 tokens of its context,
    # seconds of prefill (docs/BENCHMARKS.md, "Waiting for host-tier room"); 0.1 s on
    # accelerators, whose prefill is cheaper than a long wait (not measured there yet).
    host_room_wait_s: float | str = "auto"
    # Python's GIL switch interval in the engine-core process, where kvstrata's read threads run
    # beside vLLM's busy step loop: the default 5 ms makes each of their GIL hand-backs wait up to
    # that long (decoding 32 cached records took 210 ms instead of 61 ms next to one busy Python
    # thread; 82 ms at 0.5 ms). Only ever lowered; null leaves it alone. No cost while kvstrata's
    # threads are idle: a switch is forced only when another thread waits for the GIL.
    python_switch_interval_s: float | None = 0.0005
    # With vLLM's KV cache events on: publish each stored chunk with its block hashes, parent,
    # token ids and block size (vLLM's OffloadingConnector option of the same name), so routers
    # that hash tokens their own way can index kvstrata's tiers. Keeps a snapshot of each chunk's
    # tokens while the chunk is in a tier.
    self_describing_kv_events: bool = False
    # After a restart, promote the chunks used most recently into the host tier in the
    # background, up to this many bytes of it (free slots only), so the first requests after a
    # restart are served at host-tier speed instead of reading the disk. 0 (off) by default:
    # the reads compete with serving while it runs.
    warm_start_bytes: int = 0
    # Writing chunks down to the lower tiers (compression, LMDB puts, syncs). "auto" on a CPU
    # engine: at idle CPU priority (tiers/priority.py), so it takes only cores the forward
    # leaves idle, until the write-behind falls behind (chunks postponed, half its host-slot
    # budget held); then also on normal-priority threads, since an engine that keeps every core
    # busy (vLLM on CPU under load) gives idle threads no CPU and the host tier would evict what
    # the disk never got (docs/BENCHMARKS.md, "The write-behind held the host tier", "Catching
    # up without waiting for reuse"). "auto" on an accelerator (CUDA, XPU): normal priority;
    # the forward does not run on the cores, and an idle thread that other processes keep off a
    # busy host while it holds the GIL stalls the engine's thread (docs/BENCHMARKS.md,
    # "Idle-priority writes on a saturated host"). "idle": always idle (a CPU-bound engine
    # whose workload never comes back for what it stored saves the catch-up's cost, 6-10 % of
    # its time here; one that does loses chunks); "normal": never lowered.
    background_priority: Literal["auto", "idle", "normal"] = "auto"
    # A clean shutdown writes what the write-behind has not written yet (deferred chunks, and
    # those dropped or failed while the host tier still holds them), so a restart finds
    # them; it waits at most this long, then abandons the rest (logged). null: no bound.
    shutdown_write_timeout_s: float | None = 60.0
    # The shared tier (tiers/remote): a Redis/Valkey server or cluster every engine of a
    # deployment reads and writes, behind the host tier and the local disk (if any). None: off.
    remote_url: str | None = None
    # Connect and per-reply timeouts: a remote call ends within about their sum; after a failure
    # the tier is skipped (misses) until a probe every remote_probe_interval_s finds it again.
    remote_connect_timeout_s: float = 0.2
    remote_timeout_s: float = 0.25
    # Writes (one chunk each, behind serving) may take longer: a large chunk over a slow link,
    # a server pausing for its own snapshot fork. Only a write slower than this opens the
    # breaker (tiers/remote/store.py).
    remote_write_timeout_s: float = 2.0
    remote_probe_interval_s: float = 1.0
    remote_max_connections: int = 16
    # Offers (stores, host hits) before a chunk is written to the shared tier ("all" = 1).
    remote_admission: int = 1
    # Bytes of writes to the shared tier in flight; writes beyond are dropped and counted
    # (a slow server never holds more host slots than this, nor delays serving). Room for a
    # few long prompts at once: a 4096-token SmolLM2 prompt is 94 MB of KV, and a chunk dropped
    # ends what other engines can use of its prompt.
    remote_write_backlog_bytes: int = 256 << 20
    # Expire shared values after this long; null leaves eviction to the server's maxmemory policy.
    remote_ttl_s: float | None = None
    # Security (docs/SECURITY.md). The mode a new store directory is created with (its files get
    # the same bits without execute): owner-only by default; e.g. "0750" shares it with a group.
    # An existing store keeps its modes.
    store_mode: int = fsmode.DEFAULT_DIR_MODE
    # Secrets are never options themselves (vLLM logs this config): these name files holding
    # them, or the environment gives them (kvstrata.auth). The disk tier's value MAC key
    # ($KVSTRATA_AUTH_KEY), the shared tier's ($KVSTRATA_REMOTE_AUTH_KEY), the shared tier's
    # password ($KVSTRATA_REMOTE_PASSWORD), and the CA bundle a rediss:// server's certificate
    # must chain to (default: the system's).
    auth_key_file: Path | None = None
    remote_auth_key_file: Path | None = None
    remote_password_file: Path | None = None
    remote_tls_ca_file: Path | None = None

    def resolve_disk_reserve(self, store_path: Path) -> int:
        """``disk_reserve`` in bytes; a share is of the file system ``store_path`` is (or will
        be) on. A file system that cannot be examined gets no reserve from a share."""
        if isinstance(self.disk_reserve, int):
            return self.disk_reserve
        share = values.reserve_share(self.disk_reserve)
        path = store_path
        while not path.exists() and path != path.parent:
            path = path.parent
        try:
            total = shutil.disk_usage(path).total
        except OSError:
            return 0
        return int(share * total / 100)

    def resolve_io_threads(self) -> int:
        """The number of disk read threads (``io_threads``, "auto" resolved here)."""
        if self.io_threads == "auto":
            return max(1, min(MAX_AUTO_IO_THREADS, usable_cpus()))
        return int(self.io_threads)

    def resolve_write_threads(self, device_type: str) -> int:
        """Write threads per lower tier for an engine on ``device_type`` (``write_threads``)."""
        if self.write_threads == "auto":
            return 1 if device_type == "cpu" else max(1, min(MAX_AUTO_WRITE_THREADS, usable_cpus()))
        return int(self.write_threads)

    def resolve_read_processes(self, device_type: str) -> int:
        """Disk read processes for an engine on ``device_type`` (``read_processes``)."""
        if self.read_processes == "auto":
            return 0 if device_type == "cpu" else self.resolve_io_threads()
        return int(self.read_processes)

    def resolve_write_processes(self, device_type: str) -> int:
        """Disk write (framing) processes for an engine on ``device_type`` (``write_processes``)."""
        if self.write_processes == "auto":
            return 0 if device_type == "cpu" else self.resolve_write_threads(device_type)
        return int(self.write_processes)

    def resolve_sync_loads(self, device_type: str, num_kv_cache_groups: int) -> bool:
        """Whether hits are loaded in the step that computes them (``sync_loads``)."""
        if num_kv_cache_groups != 1:
            return False
        if self.sync_loads == "auto":
            return device_type == "cpu"
        return bool(self.sync_loads)

    def resolve_host_room_wait_s(self, device_type: str) -> float:
        """Seconds a lookup may wait for host-tier room (``host_room_wait_s``)."""
        if self.host_room_wait_s == "auto":
            return 1.0 if device_type == "cpu" else 0.1
        return float(self.host_room_wait_s)

    def resolve_background_priority(self, device_type: str) -> Literal["auto", "idle", "normal"]:
        """``background_priority`` for an engine on ``device_type``: "auto" is "normal" off CPU."""
        if self.background_priority == "auto" and device_type != "cpu":
            return "normal"
        return self.background_priority

    def resolve_stream_loads(self, kv_load_failure_policy: str) -> bool:
        """Whether loads stream under vLLM's ``kv_load_failure_policy``."""
        if self.stream_loads == "auto":
            return kv_load_failure_policy == "recompute"
        if self.stream_loads and kv_load_failure_policy != "recompute":
            raise ConfigError(
                "kvstrata option 'stream_loads': true needs vLLM's kv_load_failure_policy "
                f"'recompute' (it is {kv_load_failure_policy!r}): a chunk found corrupt after its "
                "load began would end the request with an error instead of recomputing it"
            )
        return bool(self.stream_loads)

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> StrataConfig:
        if extra is None:
            extra = {}
        if not isinstance(extra, Mapping):
            raise ConfigError(
                "kvstrata's kv_connector_extra_config must be a mapping of options, "
                f"got {type(extra).__name__} {values.shown(extra)}"
            )
        extra = dict(extra)
        known = {f.name for f in fields(cls)}
        # vLLM's own OffloadingConnector keys are not ours; say so rather than ignore them.
        unknown = sorted((k for k in extra if k not in known), key=str)
        if unknown:
            raise ConfigError(
                f"unknown kvstrata option(s) {unknown}; known options: {sorted(known)}"
            )
        kwargs: dict[str, Any] = {}
        for key, value in extra.items():
            kwargs[key] = _VALIDATORS[key](key, value)
        cfg = cls(**kwargs)
        if cfg.remote_timeout_s + cfg.remote_connect_timeout_s > 10:
            raise ConfigError(
                "kvstrata options 'remote_connect_timeout_s' + 'remote_timeout_s' exceed 10 s: "
                "a remote call that slow would stall serving; the shared tier is best effort"
            )
        if cfg.remote_url is not None and cfg.remote_password_file is not None and (
                parse_remote_url(cfg.remote_url).password is not None) and (
                not parse_remote_url(cfg.remote_url).password_only):
            raise ConfigError(
                "kvstrata options 'remote_url' and 'remote_password_file' both give a password: "
                "keep it in the file only (vLLM logs remote_url with the rest of this config)")
        if cfg.remote_tls_ca_file is not None and cfg.remote_url is not None and (
                not parse_remote_url(cfg.remote_url).tls):
            raise ConfigError(
                "kvstrata option 'remote_tls_ca_file' is set but 'remote_url' is not a TLS URL "
                "(rediss://, valkeys://, rediss+cluster://)")
        if cfg.warm_start_bytes > cfg.host_bytes:
            raise ConfigError(
                f"kvstrata option 'warm_start_bytes' ({cfg.warm_start_bytes} bytes) exceeds "
                f"'host_bytes' ({cfg.host_bytes} bytes): the warm start fills the host tier"
            )
        return cfg


def usable_cpus() -> int:
    """Cores this process may run on (its affinity mask, e.g. a container's cpuset)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


_VALIDATORS = {
    "store_path": values.as_path,
    "host_bytes": lambda k, v: values.min_size(k, v, 1 << 20),
    "disk_bytes": lambda k, v: values.min_size(k, v, 1 << 20),
    "disk_reserve": values.disk_reserve,
    "disk": values.as_bool,
    "blocks_per_chunk": values.auto_or(values.int_range(1, 4096)),
    "codec": values.choice("auto", "raw"),
    "zstd_level": values.int_range(1, 22),
    "admission": values.admission,
    "eviction": values.choice("lru", "arc"),
    "prefetch_concurrency": values.int_range(1, 256),
    "io_threads": values.auto_or(values.int_range(1, 64)),
    "write_threads": values.auto_or(values.int_range(1, 64)),
    "read_processes": values.auto_or(values.int_range(0, 64)),
    "write_processes": values.auto_or(values.int_range(0, 64)),
    "max_disk_write_backlog_bytes": lambda k, v: values.min_size(k, v, 1 << 20),
    "offload_prompt_only": values.as_bool,
    "max_age_s": values.optional_seconds,
    "host_shm_dir": values.optional_path,
    "stream_loads": values.auto_or(values.as_bool),
    "sync_loads": values.auto_or(values.as_bool),
    "host_room_wait_s": values.auto_or(values.non_negative_seconds),
    "python_switch_interval_s": values.optional_seconds,
    "self_describing_kv_events": values.as_bool,
    "warm_start_bytes": values.parse_size,
    "background_priority": values.choice("auto", "idle", "normal"),
    "shutdown_write_timeout_s": values.optional_seconds,
    "remote_url": values.remote_url,
    "remote_connect_timeout_s": values.positive_seconds,
    "remote_timeout_s": values.positive_seconds,
    "remote_write_timeout_s": values.positive_seconds,
    "remote_probe_interval_s": values.positive_seconds,
    "remote_max_connections": values.int_range(1, 1024),
    "remote_admission": values.admission,
    "remote_write_backlog_bytes": lambda k, v: values.min_size(k, v, 1 << 20),
    "remote_ttl_s": values.optional_seconds,
    "store_mode": values.dir_mode,
    "auth_key_file": values.optional_file,
    "remote_auth_key_file": values.optional_file,
    "remote_password_file": values.optional_file,
    "remote_tls_ca_file": values.optional_file,
}

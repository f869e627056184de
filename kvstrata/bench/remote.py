"""``kvstrata bench remote``: the shared tier (Redis / Valkey) against a plain GET, and its first
token against the local disk tier.

Two parts, each measured side by side in one run (alternating, so a noisy neighbour affects both):

1. **Load rate.** A ``--tokens`` prompt's worth of SmolLM2-shaped chunks of realistic synthetic bf16
   KV (``bench_disk.synthetic_kv``) is written through :class:`~kvstrata.tiers.remote.RemoteStore`
   (kvstrata's frames) and, as raw bytes under other keys, with a plain redis-py SET. Then, per
   repetition: the store reads every chunk into a host-sized buffer the way the hierarchy's
   promoter does (``get_many_into`` per chunk, on ``--threads`` reader threads like its read pool)
   against one pipelined redis-py GET of all the raw values. ``remote_load_vs_raw_get`` is the
   ratio of the rates (MB/s of raw KV), ``bytes_vs_raw`` what the server holds for kvstrata over
   the raw KV bytes. ``remote_load_mac_vs_no_mac``: the same load through a store with an auth
   key (every value's MAC checked before it is decoded; docs/SECURITY.md), its rate over the
   rate without one.
2. **First token** (skipped with ``--quick``). SmolLM2 on vLLM (multiprocess engine, as ``bench
   e2e``): one process computes the prompt with the remote tier and a local store (filling both),
   then per round, in alternating order, a fresh engine with an empty local store and an empty
   host tier serves the prompt from the remote tier (and then recomputes it under another cache
   salt with kvstrata bypassed: the cold figure), and a fresh engine without the remote tier
   serves it from the filled disk store, page cache dropped. A ratio is reported only when its
   runs were served from the tier it names (kvstrata's per-tier hit counters).

The benchmark starts its own ``redis-server`` (no persistence, ``allkeys-lru``) unless
``--remote-url`` names one; it uses only keys under ``kvstrata:`` and ``kvstrata-bench:``, and
deletes its benchmark keys at the end. Not a timed test: timings only go to the JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from kvstrata.bench.disk import entropy_bound, synthetic_kv
from kvstrata.bench.remote_ttft import first_token
from kvstrata.tools.redis_local import (
    RedisServer,
    RedisUnavailable,
    plain_client,
    server_figures,
    value_bytes,
)

MB = 1e6
DEFAULT_TOKENS = 4096
QUICK_TOKENS = 512
# SmolLM2-135M (the model of ``bench e2e``): 30 layers x 3 KV heads x head size 64, bf16, K and V;
# vLLM's CPU block of 128 tokens is one chunk (blocks_per_chunk 1).
SMOLLM2_LAYERS, SMOLLM2_KV_HEADS, SMOLLM2_HEAD_SIZE = 30, 3, 64
BLOCK_TOKENS = 128
TOKEN_BYTES = SMOLLM2_LAYERS * 2 * SMOLLM2_KV_HEADS * SMOLLM2_HEAD_SIZE * 2  # 23040
RAW_PREFIX = b"kvstrata-bench:raw:"
GOALS = {"remote_load_vs_raw_get": (">=", 0.8), "bytes_vs_raw": ("<=", 0.7),
         "remote_load_mac_vs_no_mac": (">=", 0.9),
         "remote_ttft_vs_disk_ttft": ("<=", 1.3), "remote_ttft_vs_cold": ("<=", 0.1)}
GOAL_MIN_TOKENS = 4096  # the TTFT goals are stated for 4096-token prompts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, default=None,
                        help=f"prompt length in tokens (default {DEFAULT_TOKENS}; {QUICK_TOKENS} "
                             "with --quick)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="engine rounds (remote and disk, alternating); TTFTs are medians "
                             "(default %(default)s)")
    parser.add_argument("--load-repeats", type=int, default=None,
                        help="load-rate repetitions, alternating kvstrata and the plain GET "
                             "(default 9; 3 with --quick)")
    parser.add_argument("--remote-url", default=None,
                        help="use this Redis/Valkey server (redis://host:port/db) instead of "
                             "starting a redis-server")
    parser.add_argument("--maxmemory-mb", type=int, default=1024,
                        help="maxmemory of the redis-server the bench starts (default %(default)s)")
    parser.add_argument("--codec", choices=("auto", "raw"), default="auto",
                        help="kvstrata codec, remote and disk (default %(default)s)")
    parser.add_argument("--level", type=int, default=1, help="zstd level (default 1)")
    parser.add_argument("--threads", type=int, default=None,
                        help="reader threads of the load-rate part (default: the hierarchy's "
                             "read threads on this machine, io_threads 'auto')")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic KV")
    parser.add_argument("--quick", action="store_true",
                        help="a small, fast run for smoke tests: the load-rate part only, "
                             f"{QUICK_TOKENS} tokens, no engine")
    parser.add_argument("--no-engine", action="store_true",
                        help="skip the first-token part (no vLLM, no model)")
    engine = parser.add_argument_group("first-token part (as bench e2e)")
    engine.add_argument("--max-tokens", type=int, default=16,
                        help="tokens generated per request (default %(default)s)")
    engine.add_argument("--model-cache", type=Path, default=None,
                        help="where the dequantised model is cached (as bench e2e)")
    engine.add_argument("--host-bytes", default="512MiB", help="kvstrata host tier (default %(default)s)")
    engine.add_argument("--kv-cache-bytes", default="512MiB",
                        help="vLLM's own KV cache (default %(default)s)")
    engine.add_argument("--no-drop-caches", action="store_true",
                        help="do not drop the OS page cache before the served requests")
    engine.add_argument("--store", type=Path, default=None,
                        help="parent directory for the local stores (default: a temporary "
                             "directory, removed afterwards)")


@contextlib.contextmanager
def remote_server(args: argparse.Namespace) -> Iterator[tuple[str, str]]:
    """(url, how): ``--remote-url``, or a redis-server started here (no persistence,
    ``allkeys-lru``), stopped afterwards."""
    from kvstrata.remote_address import parse_remote_url
    from kvstrata.tools.cli import CLIError

    if args.remote_url:
        if parse_remote_url(args.remote_url).cluster:
            raise CLIError("--remote-url: the plain-GET baseline needs a single server, not a cluster URL")
        yield args.remote_url, "given (--remote-url)"
        return
    workdir = Path(tempfile.mkdtemp(prefix="kvstrata-bench-redis-"))
    try:
        try:
            server = RedisServer(workdir, maxmemory_mb=args.maxmemory_mb)
        except RedisUnavailable as exc:
            raise CLIError(f"{exc} (or pass --remote-url)") from None
        try:
            yield server.url, f"started by the bench (maxmemory {args.maxmemory_mb}mb, allkeys-lru, no persistence)"
        finally:
            server.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Part 1: load rate, kvstrata's remote -> host path vs a plain pipelined GET


def _mbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / MB, 1) if seconds > 0 else 0.0


def load_rate(url: str, args: argparse.Namespace, tokens: int, repeats: int) -> dict[str, Any]:
    from kvstrata.auth import ValueAuth
    from kvstrata.config import StrataConfig
    from kvstrata.tiers.remote import RemoteStore

    chunk_bytes = BLOCK_TOKENS * TOKEN_BYTES
    n_chunks = max(1, -(-tokens // BLOCK_TOKENS))
    total = n_chunks * chunk_bytes
    data = synthetic_kv(total, chunk_bytes, args.seed)
    flat = data.view(np.uint8)
    chunks = [flat[i * chunk_bytes:(i + 1) * chunk_bytes].data for i in range(n_chunks)]
    # store keys: 16-byte namespace + 32-byte block hash + 4-byte group, like the connector's
    ns = os.urandom(16)  # a run of its own: nothing of an earlier run (or engine) is read
    keys = [ns + i.to_bytes(32, "big") + (0).to_bytes(4, "big") for i in range(n_chunks)]
    mac_ns = os.urandom(16)  # the same chunks, written and read with an auth key
    mac_keys = [mac_ns + k[16:] for k in keys]
    raw_keys = [RAW_PREFIX + ns.hex().encode() + b":%d" % i for i in range(n_chunks)]
    threads = args.threads or StrataConfig().resolve_io_threads()

    plain = plain_client(url)
    # Timeouts far above the serving defaults: a busy 2-core machine must not turn into misses.
    store = RemoteStore(url, codec=args.codec, level=args.level, connect_timeout_s=5.0,
                        timeout_s=30.0, write_timeout_s=30.0, max_connections=max(16, threads))
    mac_store = RemoteStore(url, codec=args.codec, level=args.level, connect_timeout_s=5.0,
                            timeout_s=30.0, write_timeout_s=30.0, max_connections=max(16, threads),
                            auth=ValueAuth(os.urandom(32)))
    sink = np.empty(total, dtype=np.uint8)
    outs = [sink[i * chunk_bytes:(i + 1) * chunk_bytes].data for i in range(n_chunks)]
    pool = ThreadPoolExecutor(threads, thread_name_prefix="bench-remote-read")
    clients: list[Any] = []
    try:
        t = time.perf_counter()
        for i in range(0, n_chunks, 4):  # batches of 4, as bench disk stores them
            stored = store.put_many([(k, c, "bfloat16") for k, c in
                                     zip(keys[i:i + 4], chunks[i:i + 4], strict=True)])
            if stored != len(keys[i:i + 4]):
                raise RuntimeError(f"the server stored {stored} of {len(keys[i:i + 4])} chunks: "
                                   f"{store.stats()}")
        put_s = time.perf_counter() - t
        for i in range(0, n_chunks, 4):
            if mac_store.put_many([(k, c, "bfloat16") for k, c in
                                   zip(mac_keys[i:i + 4], chunks[i:i + 4], strict=True)]) != len(mac_keys[i:i + 4]):
                raise RuntimeError(f"the server did not store every authenticated chunk: {mac_store.stats()}")
        pipe = plain.pipeline(transaction=False)
        for k, c in zip(raw_keys, chunks, strict=True):
            pipe.set(k, c)
        pipe.execute()
        nkeys, strlen_sum, mem_sum = value_bytes(plain, b"kvstrata:" + ns.hex().encode() + b":*")
        raw_nkeys, raw_strlen, raw_mem = value_bytes(plain, RAW_PREFIX + ns.hex().encode() + b":*")

        def load_through(st: Any, ks: list[bytes]) -> Callable[[], tuple[float, bool]]:
            """A timed load of every chunk through ``st`` (keys ``ks``), checked byte for byte."""
            def run() -> tuple[float, bool]:
                sink.fill(1)  # a touched destination, like the host slab
                t0 = time.perf_counter()
                got = list(pool.map(lambda i: st.get_many_into([(ks[i], outs[i])])[0],
                                    range(n_chunks)))
                s = time.perf_counter() - t0
                return s, all(g == chunk_bytes for g in got) and bool(np.array_equal(sink, flat))
            return run

        kvstrata_load = load_through(store, keys)
        kvstrata_mac_load = load_through(mac_store, mac_keys)

        def plain_get() -> tuple[float, bool]:
            t0 = time.perf_counter()
            p = plain.pipeline(transaction=False)
            for k in raw_keys:
                p.get(k)
            values = p.execute()
            s = time.perf_counter() - t0
            return s, all(v is not None and v == c for v, c in zip(values, chunks, strict=True))

        local = threading.local()

        def raw_get_one(i: int) -> bytes | None:
            c = getattr(local, "client", None)
            if c is None:
                c = local.client = plain_client(url)
                clients.append(c)
            value = c.get(raw_keys[i])
            assert value is None or isinstance(value, bytes)  # a plain client does not decode
            return value

        def plain_get_threads() -> tuple[float, bool]:
            t0 = time.perf_counter()
            values = list(pool.map(raw_get_one, range(n_chunks)))
            s = time.perf_counter() - t0
            return s, all(v is not None and v == c for v, c in zip(values, chunks, strict=True))

        contenders = [("kvstrata", kvstrata_load), ("raw", plain_get), ("raw_threads", plain_get_threads),
                      ("kvstrata_mac", kvstrata_mac_load)]
        for _, fn in contenders:  # warm every path (connections, thread-local zstd contexts)
            fn()
        rounds = []
        for r in range(repeats):
            rr: dict[str, Any] = {}
            for name, fn in contenders[r % 4:] + contenders[:r % 4]:  # each goes first in turn
                s, ok = fn()
                rr[f"{name}_s"], rr[f"{name}_ok"] = s, ok
            rr["ratio"] = rr["raw_s"] / rr["kvstrata_s"]
            rr["ratio_threads"] = rr["raw_threads_s"] / rr["kvstrata_s"]
            rr["ratio_mac"] = rr["kvstrata_s"] / rr["kvstrata_mac_s"]
            rounds.append(rr)
        stats = store.stats()
        server = server_figures(plain)
    finally:
        pool.shutdown()
        for c in clients:
            c.close()
        with contextlib.suppress(Exception):
            store.delete_many(keys)
        with contextlib.suppress(Exception):
            mac_store.delete_many(mac_keys)
        mac_store.close()
        with contextlib.suppress(Exception):
            plain.delete(*raw_keys)
        store.close()
        plain.close()
    kv_s = statistics.median(r["kvstrata_s"] for r in rounds)
    raw_s = statistics.median(r["raw_s"] for r in rounds)
    raw_threads_s = statistics.median(r["raw_threads_s"] for r in rounds)
    return {
        "remote_load_vs_raw_get": round(statistics.median(r["ratio"] for r in rounds), 3),
        "remote_load_MBps": _mbps(total, kv_s),
        "raw_get_MBps": _mbps(total, raw_s),
        "remote_load_mac_vs_no_mac": round(statistics.median(r["ratio_mac"] for r in rounds), 3),
        "remote_load_mac_MBps": _mbps(total, statistics.median(r["kvstrata_mac_s"] for r in rounds)),
        "bytes_vs_raw": round(stats["put_bytes"] / stats["put_raw_bytes"], 4),
        "load": {
            # A stronger plain baseline than the one pipeline: a GET per chunk on the same
            # threads, each with a connection of its own (not a goal; for reading the ratio).
            "remote_load_vs_raw_get_threads": round(statistics.median(r["ratio_threads"] for r in rounds), 3),
            "raw_get_threads_MBps": _mbps(total, raw_threads_s),
            "verified": all(r["kvstrata_ok"] and r["raw_ok"] and r["raw_threads_ok"] and r["kvstrata_mac_ok"]
                            for r in rounds)
            and nkeys == n_chunks,
            "tokens": tokens, "chunks": n_chunks, "chunk_bytes": chunk_bytes, "raw_bytes": total,
            "stored_bytes": stats["put_bytes"], "server_value_bytes": strlen_sum,
            "server_memory_usage_vs_raw": round(mem_sum / raw_mem, 4) if raw_mem else None,
            "raw_values_bytes": raw_strlen if raw_nkeys == n_chunks else None,
            "entropy_bound_ratio": round(entropy_bound(data), 4),
            "put_MBps": _mbps(total, put_s),
            "threads": threads, "repeats": repeats, "codec": args.codec, "level": args.level,
            "path": "RemoteStore.get_many_into per chunk on a thread pool (the promoter's read); "
                    "baseline (raw): one redis-py pipeline of GETs of the raw bytes (sync client, "
                    "hiredis), no copy; raw_threads: a plain GET per chunk on the same threads",
            "data": "synthetic bf16 (bench_disk.synthetic_kv: lognormal channel scales, channel "
                    "means, 2% outliers, K/V alternating), SmolLM2-135M chunk geometry",
            "rounds": [{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}
                       for r in rounds],
            "server": server,
        },
    }


def _goals(out: dict[str, Any], tokens: int) -> dict[str, Any]:
    goals: dict[str, Any] = {}
    for key, (op, bound) in GOALS.items():
        value = out.get(key)
        applies = not key.startswith("remote_ttft") or tokens >= GOAL_MIN_TOKENS
        met = None if value is None or not applies else (value >= bound if op == ">=" else value <= bound)
        goals[f"{key}{op}{bound}"] = met
    return goals


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvstrata.tools.cli import CLIError

    tokens = args.tokens or (QUICK_TOKENS if args.quick else DEFAULT_TOKENS)
    repeats = args.load_repeats or (3 if args.quick else 9)
    if tokens < 1 or args.rounds < 1 or repeats < 1:
        raise CLIError("--tokens, --rounds and --load-repeats must be at least 1")
    engine = not (args.quick or args.no_engine)

    def say(msg: str) -> None:
        print(f"bench remote: {msg}", file=sys.stderr, flush=True)

    loadavg_before = os.getloadavg()[0]
    with remote_server(args) as (url, how):
        say(f"load rate: {tokens} tokens of synthetic KV, {repeats} alternating repetitions")
        out = load_rate(url, args, tokens, repeats)
        if engine:
            out.update(first_token(url, args, tokens, say))
        else:
            out["first_token"] = "skipped (--quick)" if args.quick else "skipped (--no-engine)"
        out["server"] = {"how": how, **out["load"].pop("server")}
    out.update(
        tokens=tokens, codec=args.codec, quick=bool(args.quick),
        cpu_count=os.cpu_count(),
        loadavg_1m={"before": round(loadavg_before, 2), "after": round(os.getloadavg()[0], 2)},
    )
    out["goals"] = _goals(out, tokens)
    ok = out["load"]["verified"] and (not engine or out.get("remote_ttft_vs_disk_ttft") is not None)
    if not ok:
        out["_exit_code"] = 1
    # the headline figures first
    head = ("remote_load_vs_raw_get", "bytes_vs_raw", "remote_load_mac_vs_no_mac", "remote_ttft_vs_disk_ttft",
            "remote_ttft_vs_cold")
    return {**{k: out[k] for k in head if k in out}, **{k: v for k, v in out.items() if k not in head}}

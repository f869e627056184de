"""``kvstrata inspect DIR``: what a store holds, from its index alone (payloads are not read).

Reports the format version and shutdown state, every namespace (fingerprint) with what it
describes and its chunk counts per KV-cache group, bytes raw and stored, the compression ratio,
how long ago chunks were last used (a histogram with the cumulative bytes a budget would keep,
newest first), use of the disk budget, and how much of the file ``kvstrata compact`` would give
back. The store keeps one timestamp per chunk (stored or last read, whichever is later), so the
age of a chunk and its last access are the same measure.

Read-only and safe while servers use the store.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstrata.config import DEFAULT_DISK_BYTES
from kvstrata.tiers import records as rec
from kvstrata.tiers.disk import DiskStore
from kvstrata.tools import support as ts

# (label, upper bound in seconds since last access)
AGE_BUCKETS: tuple[tuple[str, float], ...] = (
    ("<1m", 60),
    ("<10m", 600),
    ("<1h", 3600),
    ("<6h", 6 * 3600),
    ("<1d", 86400),
    ("<7d", 7 * 86400),
    ("<30d", 30 * 86400),
    (">=30d", float("inf")),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", type=Path, metavar="DIR", help="store directory")
    parser.add_argument(
        "--budget",
        type=ts.size_arg,
        default=None,
        metavar="BYTES",
        help="the disk budget the store runs under, e.g. 64GiB (default: the connector's "
        f"default, {DEFAULT_DISK_BYTES >> 30} GiB)",
    )


@dataclass
class _NsStats:
    chunks: int = 0
    raw_bytes: int = 0
    stored_bytes: int = 0
    groups: Counter[int] = field(default_factory=Counter)
    dtypes: Counter[str] = field(default_factory=Counter)


@dataclass
class _Scan:
    namespaces: dict[bytes, _NsStats] = field(default_factory=dict)
    ages: list[list[int]] = field(default_factory=lambda: [[0, 0] for _ in AGE_BUCKETS])
    unreadable: int = 0
    oldest_tick: int | None = None
    newest_tick: int | None = None


def _bucket(age_s: float) -> int:
    for i, (_, upper) in enumerate(AGE_BUCKETS):
        if age_s < upper:
            return i
    return len(AGE_BUCKETS) - 1


def _scan(store: DiskStore, now_us: int, damage: list[str]) -> _Scan:
    out = _Scan()
    with ts.progress(int(store.stats()["entries"]), "reading the index") as bar:
        for batch in store.scan("index", damage=damage):
            for key, value in batch:
                found = rec.decode_index(value)
                if found is None:
                    out.unreadable += 1
                    continue
                ns = out.namespaces.setdefault(key[: rec.NAMESPACE_BYTES], _NsStats())
                ns.chunks += 1
                ns.raw_bytes += found.raw_len
                ns.stored_bytes += found.stored_len
                ns.groups[found.group] += 1
                ns.dtypes[found.dtype] += 1
                slot = out.ages[_bucket(max(0, now_us - found.tick) / 1e6)]
                slot[0] += 1
                slot[1] += found.stored_len
                out.oldest_tick = found.tick if out.oldest_tick is None else min(out.oldest_tick, found.tick)
                out.newest_tick = found.tick if out.newest_tick is None else max(out.newest_tick, found.tick)
            bar.update(len(batch))
    return out


def _file_census(store: DiskStore) -> dict[str, int]:
    """File size, the bytes its live pages take, and the difference (free pages)."""
    live = store.read(rec.live_bytes)
    try:
        file_bytes = (store.path / rec.DATA_FILE).stat().st_size
    except OSError:
        file_bytes = 0
    return {"file_bytes": file_bytes, "live_bytes": live, "reclaimable_bytes": max(0, file_bytes - live)}


def _store_state(txn: Any, h: rec.Handles) -> dict[str, Any]:
    """Format, shutdown marker, namespaces and whether the running totals agree with the index,
    read in one transaction (so that a live writer cannot make them disagree)."""
    totals = rec.read_totals(txn, h)
    registered, bad_namespaces = rec.namespaces(txn, h)
    return {
        "format": txn.get(rec.META_FORMAT, db=h.meta),
        "clean": txn.get(rec.META_CLEAN, db=h.meta),
        "totals_readable": totals is not None,
        "totals_consistent": totals is not None and totals == rec.recount(txn, h)[0],
        "registered": registered,
        "bad_namespaces": bad_namespaces,
    }


def _namespace_row(ns: bytes, info: dict[str, Any] | None, st: _NsStats) -> dict[str, Any]:
    info = info or {}
    return {
        "fingerprint": ns.hex(),
        "registered": bool(info),
        "model": info.get("model"),
        "dtype": info.get("dtype"),
        "kv_cache_dtype": info.get("kv_cache_dtype"),
        "layout": info.get("kv_cache_layout"),
        "block_size": info.get("block_size"),
        "blocks_per_chunk": info.get("blocks_per_chunk"),
        "tp_rank": info.get("tp_rank"),
        "tp_size": info.get("tp_size"),
        "chunks": st.chunks,
        "chunks_per_group": {str(g): n for g, n in sorted(st.groups.items())},
        "chunk_dtypes": dict(st.dtypes),
        "raw_bytes": st.raw_bytes,
        "stored_bytes": st.stored_bytes,
        "compression_ratio": round(st.raw_bytes / st.stored_bytes, 4) if st.stored_bytes else None,
        "info": info,
    }


def inspect_store(path: Path, budget_bytes: int | None) -> dict[str, Any]:
    store = ts.open_store(path, readonly=True)
    damage: list[str] = []  # what could not be read (LMDB's own pages damaged)
    try:
        now_us = time.time_ns() // 1000
        try:
            state = store.read(_store_state)
        except rec.LMDB_DAMAGE as exc:
            damage.append(f"the totals cannot be recounted ({exc})")
            state = {"format": None, "clean": None, "totals_readable": False, "totals_consistent": False,
                     "registered": {}, "bad_namespaces": []}
        scan = _scan(store, now_us, damage)
        try:
            census = _file_census(store)
        except rec.LMDB_DAMAGE as exc:
            damage.append(f"the databases' pages cannot be counted ({exc})")
            census = {"file_bytes": 0, "live_bytes": 0, "reclaimable_bytes": 0}
    finally:
        store.close()
    fmt, clean, registered = state["format"], state["clean"], state["registered"]
    chunks = sum(s.chunks for s in scan.namespaces.values())
    raw = sum(s.raw_bytes for s in scan.namespaces.values())
    stored = sum(s.stored_bytes for s in scan.namespaces.values())
    budget = budget_bytes if budget_bytes is not None else DEFAULT_DISK_BYTES
    rows = [
        _namespace_row(ns, registered.get(ns), scan.namespaces.get(ns, _NsStats()))
        for ns in sorted(set(registered) | set(scan.namespaces))
    ]
    histogram = []
    cumulative = 0
    for (label, _), (n, nbytes) in zip(AGE_BUCKETS, scan.ages, strict=True):
        cumulative += nbytes
        histogram.append(
            {"last_access": label, "chunks": n, "stored_bytes": nbytes, "cumulative_stored_bytes": cumulative}
        )
    return {
        "path": str(path),
        "format_version": int(fmt) if fmt and bytes(fmt).isdigit() else (bytes(fmt).decode(errors="replace") if fmt else None),
        "clean_shutdown": None if clean is None else clean == b"1",
        **census,
        "chunks": chunks,
        "raw_bytes": raw,
        "stored_bytes": stored,
        "compression_ratio": round(raw / stored, 4) if stored else None,
        "budget_bytes": budget,
        "budget_assumed": budget_bytes is None,
        "budget_use": round(stored / budget, 6) if budget else None,
        "totals_readable": state["totals_readable"],
        "totals_consistent": state["totals_consistent"],
        "unreadable_index_records": scan.unreadable,
        "unreadable_namespace_entries": [ns.hex() for ns in state["bad_namespaces"]],
        "structure_damage": damage,
        "oldest_access_age_s": None if scan.oldest_tick is None else round((now_us - scan.oldest_tick) / 1e6, 3),
        "newest_access_age_s": None if scan.newest_tick is None else round((now_us - scan.newest_tick) / 1e6, 3),
        "namespaces": rows,
        "age_histogram": histogram,
    }


def _describe(ns: dict[str, Any]) -> str:
    parts = [
        f"{label} {ns[name]}"
        for label, name in (
            ("dtype", "dtype"),
            ("kv", "kv_cache_dtype"),
            ("layout", "layout"),
            ("block", "block_size"),
            ("blocks/chunk", "blocks_per_chunk"),
        )
        if ns[name] is not None
    ]
    if ns["tp_rank"] is not None:
        parts.append(f"tp rank {ns['tp_rank']}" + (f"/{ns['tp_size']}" if ns["tp_size"] else ""))
    return f"{ns['model'] or '(unnamed model)'}" + (f" ({', '.join(parts)})" if parts else "")


def _print_report(r: dict[str, Any]) -> None:
    hb = ts.human_bytes
    state = {True: "closed cleanly", False: "open, or not closed cleanly", None: "never closed"}
    print(f"store       {r['path']} (format {r['format_version']}, {state[r['clean_shutdown']]})")
    print(
        f"file        {hb(r['file_bytes'])} on disk, {hb(r['live_bytes'])} in use, "
        f"{hb(r['reclaimable_bytes'])} reclaimable by `kvstrata compact`"
    )
    ratio = f"{r['compression_ratio']:.2f}x" if r["compression_ratio"] else "n/a"
    print(f"chunks      {r['chunks']}: {hb(r['raw_bytes'])} raw, {hb(r['stored_bytes'])} stored, ratio {ratio}")
    assumed = " (the connector's default budget; pass --budget)" if r["budget_assumed"] else ""
    print(f"budget      {hb(r['stored_bytes'])} of {hb(r['budget_bytes'])} ({100 * r['budget_use']:.1f}%){assumed}")
    if not r["totals_readable"]:
        print("totals      the store's running totals are unreadable: `kvstrata verify --repair` rewrites them")
    elif not r["totals_consistent"]:
        print("totals      the store's running totals differ from its index: run `kvstrata verify`")
    for what in r["structure_damage"]:
        print(f"damaged     {what}: run `kvstrata verify --repair` (it rebuilds the store)")
    if r["unreadable_namespace_entries"]:
        print(f"damaged     {len(r['unreadable_namespace_entries'])} unreadable namespace entries: "
              "run `kvstrata verify --repair`")
    if r["unreadable_index_records"]:
        print(f"damaged     {r['unreadable_index_records']} unreadable index records: run `kvstrata verify`")
    print("namespaces")
    if not r["namespaces"]:
        print("  (none)")
    for ns in r["namespaces"]:
        desc = _describe(ns) if ns["registered"] else "(not registered: no description)"
        groups = ", ".join(f"group {g}: {n}" for g, n in ns["chunks_per_group"].items()) or "no chunks"
        nratio = f"{ns['compression_ratio']:.2f}x" if ns["compression_ratio"] else "n/a"
        print(f"  {ns['fingerprint']}  {desc}")
        print(
            f"  {'':32}  {ns['chunks']} chunks ({groups}), {hb(ns['raw_bytes'])} raw, "
            f"{hb(ns['stored_bytes'])} stored, {nratio}"
        )
    print("last access  chunks      stored  newest-first cumulative")
    for row in r["age_histogram"]:
        print(
            f"  {row['last_access']:>6}  {row['chunks']:>9}  {hb(row['stored_bytes']):>10}  "
            f"{hb(row['cumulative_stored_bytes']):>10}"
        )


def run(args: argparse.Namespace) -> dict[str, Any] | int:
    report = inspect_store(args.dir, args.budget)
    if args.json:
        return report
    _print_report(report)
    return 0

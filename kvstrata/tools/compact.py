"""``kvstrata compact DIR [--budget BYTES] [--max-age AGE] [--no-rewrite]``.

Evicts by the retention policy (least recently used first, down to the budget; and everything
idle longer than ``--max-age``), then rewrites the LMDB file compacted so the disk space really
comes back (see ``kvstrata.compaction.rewrite``).

Against running servers: eviction alone (``--no-rewrite``) is safe while they run. The rewrite
needs the store to itself, so compact checks first and refuses, changing nothing, when another
process has the store open; if one opens it while compact evicts, the rewrite is refused with
the evictions done and reported. A server that starts during the rewrite waits for it.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvstrata.compaction import rewrite
from kvstrata.compaction.evict import EvictionResult, evict
from kvstrata.tiers.retention import RetentionPolicy
from kvstrata.tools import support as ts
from kvstrata.tools.cli import CLIError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", type=Path, metavar="DIR", help="store directory")
    parser.add_argument(
        "--budget", type=ts.size_arg, default=None, metavar="BYTES", help="evict down to this many stored bytes, e.g. 4GiB"
    )
    parser.add_argument(
        "--max-age",
        type=ts.duration_arg,
        default=None,
        metavar="AGE",
        help="also evict chunks not used for this long, e.g. 7d, 12h, 90m",
    )
    parser.add_argument(
        "--no-rewrite",
        action="store_true",
        help="only evict (safe while a server runs); do not rewrite the file",
    )


def _evict(path: Path, policy: RetentionPolicy) -> tuple[EvictionResult, int]:
    store = ts.open_store(path, readonly=False)
    try:
        store.wait_recovery()  # an unclean store verifies itself first; evict what survives
        with ts.progress(None, "evicting") as bar:
            result = evict(store, policy, on_deleted=bar.update)
        store.sync()
        entries = int(store.stats()["entries"])
    finally:
        store.close()
    return result, entries


def run(args: argparse.Namespace) -> dict[str, Any]:
    path: Path = args.dir
    ts.check_store_dir(path)
    policy = RetentionPolicy(budget_bytes=args.budget, max_age_s=args.max_age)
    reason = rewrite.read_only_reason(path)
    if reason is not None:
        raise CLIError(f"{reason}: compact cannot change it; nothing was changed")
    try:
        busy = not args.no_rewrite and rewrite.is_busy(path)
    except rewrite.RewriteError as exc:
        raise CLIError(f"{exc}; nothing was changed") from None
    if busy:
        # Refuse before changing anything: the rewrite could not run anyway.
        raise CLIError(rewrite.busy_message(path))
    file_before = (path / "data.mdb").stat().st_size
    result, entries = _evict(path, policy)
    report: dict[str, Any] = {
        "path": str(path),
        "budget_bytes": args.budget,
        "max_age_s": args.max_age,
        "evicted": result.evicted,
        "freed_stored_bytes": result.freed_bytes,
        "stored_bytes": result.stored_bytes_after,
        "chunks": entries,
        "file_bytes_before": file_before,
    }
    if args.no_rewrite:
        report["file_bytes_after"] = (path / "data.mdb").stat().st_size
        report["rewritten"] = False
        return report
    try:
        with rewrite.exclusive(path):
            done = rewrite.rewrite_locked(path)
    except rewrite.StoreBusyError:
        raise CLIError(
            f"evicted {result.evicted} chunks ({result.freed_bytes} stored bytes), but another "
            f"process opened {path} meanwhile, so the file was not rewritten; run compact again "
            "once it has closed the store"
        ) from None
    except rewrite.RewriteError as exc:
        raise CLIError(
            f"evicted {result.evicted} chunks ({result.freed_bytes} stored bytes; they are gone), "
            f"but the file could not be rewritten to give the space back: {exc}") from None
    report["file_bytes_after"] = done.file_bytes_after
    report["reclaimed_file_bytes"] = done.reclaimed_bytes
    report["shrink_ratio"] = round(file_before / done.file_bytes_after, 3) if done.file_bytes_after else None
    report["rewritten"] = True
    return report


"""``kvstrata purge DIR --fingerprint F``: remove one namespace's chunks (one model/layout/rank).

``F`` is the namespace's hex fingerprint as ``kvstrata inspect`` shows it, or a unique prefix of
it. The chunks are deleted in batches of short write transactions (safe while servers run; a
server still storing into that namespace will of course add chunks again), then the namespace's
registration is removed. The file keeps its size until ``kvstrata compact``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvstrata.tiers import records as rec
from kvstrata.tools import support as ts

_DELETE_BATCH = 256


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", type=Path, metavar="DIR", help="store directory")
    parser.add_argument(
        "--fingerprint", required=True, metavar="F", help="namespace hex (a unique prefix is enough)"
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    store = ts.open_store(args.dir, readonly=False)
    try:
        ns = ts.resolve_fingerprint(args.fingerprint, ts.store_namespaces(store))
        info = store.namespaces().get(ns)
        before = store.stats()
        removed = 0
        with ts.progress(None, "purging") as bar:
            # Collect a batch, then delete it: deleting under an open scan would skip keys.
            for batch in store.scan("index", prefix=ns, values=False):
                keys = [key for key, _ in batch]
                for i in range(0, len(keys), _DELETE_BATCH):
                    removed += store.delete_many(keys[i : i + _DELETE_BATCH])
                    bar.update(min(_DELETE_BATCH, len(keys) - i))
        unregistered = store.write(lambda txn, h: rec.unregister_namespace(txn, h, ns))
        store.sync()
        after = store.stats()
    finally:
        store.close()
    return {
        "path": str(args.dir),
        "fingerprint": ns.hex(),
        "model": (info or {}).get("model"),
        "chunks_removed": removed,
        "stored_bytes_freed": int(before["stored_bytes"]) - int(after["stored_bytes"]),
        "raw_bytes_freed": int(before["raw_bytes"]) - int(after["raw_bytes"]),
        "unregistered": unregistered,
        "chunks_left": int(after["entries"]),
    }

"""Shared-tier writes over a slow link: one chunk-sized value written to a real Redis server with
each write deadline, then whether the tier is still available for lookups.

The link is the loopback shaped with ``tc qdisc ... tbf`` (needs root and iproute2; the qdisc is
removed at the end, also on failure), or left as it is with ``--rate none``. The chunk size is
what a model's KV makes of it: a 70B model (80 layers, 8 KV heads of 128, bf16) holds 320 KiB per
token, so a 128-token chunk is 40 MiB. Each configuration gets a fresh ``RemoteStore`` with the
connector's default lookup timeouts; ``write_timeout_s`` equal to ``timeout_s`` is the single
deadline every call had before writes got their own.

    sudo .venv/bin/python -m benchmarks.remote_slow_link --rate 1gbit --mib 40
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvstrata.tiers.remote import RemoteStore
from kvstrata.tools.redis_local import RedisServer

NAMESPACE = b"slow-link-bench!"  # 16 bytes, as connector.keys makes them
LOOKUP_TIMEOUT_S = 0.25  # the connector's remote_timeout_s default


def _key(i: int) -> bytes:
    return NAMESPACE + i.to_bytes(36, "big")


def _shape(rate: str | None) -> bool:
    if rate is None:
        return False
    subprocess.run(["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", rate,
                    "burst", "256kb", "latency", "100ms"], check=True)
    return True


def _unshape() -> None:
    subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], check=False)


def measure(server: RedisServer, value: np.ndarray, write_timeouts: list[float]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i, write_timeout in enumerate(write_timeouts):
        store = RemoteStore(server.url, timeout_s=LOOKUP_TIMEOUT_S, write_timeout_s=write_timeout,
                            codec="raw")
        try:
            store.put_many([(_key(1000 + i), value[:1024], "bfloat16")])  # connections open
            t = time.perf_counter()
            stored = store.put_many([(_key(i), value, "bfloat16")])
            took = time.perf_counter() - t
            stats = store.stats()
            out[f"write_timeout_{write_timeout:g}s"] = {
                "stored": stored, "seconds": round(took, 3),
                "tier_available_after": bool(store.available),
                "unavailable": stats["unavailable"], "last_error": stats["last_error"],
            }
        finally:
            store.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", default="1gbit",
                    help="tc tbf rate of the loopback (e.g. 1gbit, 500mbit), or 'none' to leave it")
    ap.add_argument("--mib", type=float, default=40.0, help="value size in MiB (one chunk)")
    ap.add_argument("--write-timeouts", type=float, nargs="+", default=[LOOKUP_TIMEOUT_S, 2.0],
                    help="write_timeout_s values to compare (the first: the old single deadline)")
    args = ap.parse_args(argv)
    rate = None if args.rate == "none" else args.rate
    elems = int(args.mib * (1 << 20)) // 2
    rng = np.random.default_rng(0)
    value = (rng.standard_normal(elems).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    with tempfile.TemporaryDirectory(prefix="kvstrata-slow-link-") as tmp:
        server = RedisServer(Path(tmp), maxmemory_mb=max(64, int(4 * args.mib)))
        try:
            shaped = _shape(rate)
            try:
                results = measure(server, value, args.write_timeouts)
            finally:
                if shaped:
                    _unshape()
        finally:
            server.stop()
    print(json.dumps({"rate": args.rate, "value_mib": args.mib, "lookup_timeout_s": LOOKUP_TIMEOUT_S,
                      "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

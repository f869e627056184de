"""Child process of the reliability tests (run as a script; the parent reads its stdout).

Modes:
  probe                            read every job of a JSON list on stdin: open the store, read
                                   every key, contains_many, stats, iter_index, puts, close;
                                   prints "BEGIN id" then "RESULT {json}" per job
  kill-disk DIR FIRST SEED         put batches of records into a DiskStore until killed
  kill-hier DIR SLAB FIRST SEED    the same through a Hierarchy (host tier + write-behind)
  writer DIR FIRST COUNT SEED BUDGET   put records FIRST..FIRST+COUNT-1 in a seeded order
  reader DIR FIRST COUNT SECONDS   read those records until all were seen or time is up
  fill DIR                         put records until the file system is full, then check
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torture as t  # noqa: E402

from kvstrata.tiers.disk import DiskStore, StoreFormatError, StoreUnavailableError  # noqa: E402

T = TypeVar("T")
NS_FRESH = b"fresh-records-ns"
KILL_SIZES = [2 << 10, 16 << 10, 64 << 10, 512 << 10]  # 512 KiB frames get a transaction each
KILL_WEIGHTS = [0.3, 0.35, 0.3, 0.05]


def say(line: str) -> None:
    print(line, flush=True)


def read(store: DiskStore, key: bytes, slack: int = 4096) -> bytes | None:
    """The value of ``key`` (a longer one too); a made-up key may claim any length."""
    out = bytearray(min(t.value_len(key), 1 << 20) + slack)
    n = store.get_into(key, out)
    return None if n is None else bytes(out[:n])


# ---- probe -------------------------------------------------------------------------------------


class Probe:
    """One job: a server's use of a (possibly damaged) store through DiskStore's public
    methods; a call that raises is noted (and the probe goes on)."""

    def __init__(self, job: dict[str, Any]) -> None:
        self.job = job
        self.written = {bytes.fromhex(k) for k in job["keys"]}
        self.suspects = [bytes.fromhex(k) for k in job["suspects"]]
        self.report: dict[str, Any] = {
            "id": job["id"], "open": None, "served": 0, "detected": 0, "wrong": [],
            "errors": [], "admitted": None, "first_served": 0, "lost": [], "fresh_served": 0,
            "wrong_unwritten": 0,
        }

    def attempt(self, what: str, fn: Callable[[], T]) -> T | None:
        try:
            return fn()
        except Exception as exc:
            traceback.print_exc()
            self.report["errors"].append(f"{what}: {type(exc).__name__}: {exc}"[:300])
            return None

    def check(self, store: DiskStore, key: bytes) -> bool:
        """Read ``key`` and classify the answer; True when it was served correctly."""
        got = self.attempt(f"get_into({key.hex()[:16]}..)", lambda: read(store, key))
        if got is None:
            self.report["detected"] += 1
        elif key in self.written and got == t.expected(key):
            self.report["served"] += 1
            return True
        else:
            self.report["wrong"].append(key.hex())
            self.report["wrong_unwritten"] += key not in self.written
        return False

    def run(self) -> dict[str, Any]:
        job, report = self.job, self.report
        try:
            store = DiskStore(job["dir"], budget_bytes=job["budget"], create=False)
        except (StoreFormatError, StoreUnavailableError) as exc:
            report["open"] = f"{type(exc).__name__}: {exc}"[:300]
            report["detected"] = len(self.written)
            return report
        except Exception as exc:
            traceback.print_exc()
            report["errors"].append(f"DiskStore(): {type(exc).__name__}: {exc}"[:300])
            return report
        keys = sorted(self.written) + [k for k in self.suspects if k not in self.written]
        if self.attempt("wait_recovery", lambda: store.wait_recovery(30)) is False:
            report["errors"].append("wait_recovery: the verification did not end in 30 s")
        served = [key for key in keys if self.check(store, key)]
        report["first_served"] = len(served)
        found = self.attempt("contains_many", lambda: store.contains_many(keys))
        if found is not None and (len(found) != len(keys) or not all(isinstance(f, bool) for f in found)):
            report["errors"].append(f"contains_many answered {found!r:.200}")
        self.attempt("stats", store.stats)
        self.attempt("iter_index", lambda: list(store.iter_index()))
        first = job["fresh_first"]
        fresh = [t.make_key(NS_FRESH, i, 8192) for i in range(first, first + job["fresh"])]
        report["admitted"] = self.attempt(
            "put_many", lambda: store.put_many([(k, t.expected(k), "bfloat16") for k in fresh])
        )
        self.written.update(fresh)
        # Evictions and the writer's drops ran in between; without them nothing may be lost.
        report["lost"] = [key.hex() for key in served if not self.check(store, key)]
        for key in [k for k in keys if k not in set(served)]:
            self.check(store, key)
        report["fresh_served"] = sum(self.check(store, key) for key in fresh)
        self.attempt("stats", store.stats)
        self.attempt("close", store.close)
        return report


def probe() -> None:
    for job in json.loads(sys.stdin.read()):
        say(f"BEGIN {job['id']}")
        say("RESULT " + json.dumps(Probe(job).run()))


# ---- killed writers ----------------------------------------------------------------------------


def kill_key(serial: int, rng: np.random.Generator) -> bytes:
    nbytes = int(rng.choice(KILL_SIZES, p=KILL_WEIGHTS))
    return t.make_key(t.NS_WRITERS, serial, nbytes, serial % 2)


def kill_disk(path: str, first: int, seed: int) -> None:
    """Batches of new records (and some already written), deletes and reads, until killed.
    Prints "batch KEY..." (hex) before each put: no key it did not print was ever written; a
    batch printed before another one was committed. Prints "delete KEY..." before a delete."""
    rng = np.random.default_rng(seed)
    store = DiskStore(path, budget_bytes=t.KILL_BUDGET, sync_interval_s=0.02, touch_flush_interval_s=0.05)
    say("open")
    serial = first
    written: list[bytes] = []
    while True:
        n = int(rng.integers(1, 9))
        keys = [kill_key(serial + j, rng) for j in range(n)]
        if written and rng.random() < 0.3:
            keys += [written[int(i)] for i in rng.integers(0, len(written), 2)]
        serial += n
        say("batch " + " ".join(k.hex() for k in keys[:n]))
        store.put_many([(k, t.expected(k), "bfloat16") for k in keys])
        written += keys[:n]
        if rng.random() < 0.15:
            gone = [written[int(i)] for i in rng.integers(0, len(written), 2)]
            say("delete " + " ".join(k.hex() for k in gone))
            store.delete_many(gone)
        if rng.random() < 0.3:
            read(store, written[int(rng.integers(0, len(written)))])


def kill_hier(path: str, slab_path: str, first: int, seed: int) -> None:
    """Store chunks into the host tier and let write-behind put them on disk, until killed."""
    rng = np.random.default_rng(seed)
    h, slab, _ = t.hierarchy(Path(path), Path(slab_path), sync_interval_s=0.02)
    say("open")
    serial = first
    while True:
        n = int(rng.integers(1, 5))
        keys = [t.chunk_key(serial + j) for j in range(n)]
        slots = h.prepare_store(keys)
        if slots is None:  # every slot is still being written: let write-behind catch up
            time.sleep(0.002)
            continue
        serial += n
        say("batch " + " ".join(k.hex() for k in keys))
        for key, slot in slots.items():
            for r, ns in enumerate(t.HIER_NS):
                value = np.frombuffer(t.expected(ns + key), dtype=np.uint8)
                slab.array[slot, r * t.SHARD : (r + 1) * t.SHARD] = value
        h.complete_store(list(slots))


# ---- several processes, full file system ------------------------------------------------------


def writer(path: str, first: int, count: int, seed: int, budget: int) -> None:
    rng = np.random.default_rng(seed)
    keys = [t.writers_key(i) for i in range(first, first + count)]
    rng.shuffle(keys)  # type: ignore[arg-type]
    store = DiskStore(path, budget_bytes=budget, sync_interval_s=0.05)
    stored = 0
    for i in range(0, len(keys), 3):
        batch = keys[i : i + 3]
        stored += store.put_many([(k, t.expected(k), "bfloat16") for k in batch])
    store.close()
    say(json.dumps({"stored": stored}))


def reader(path: str, first: int, count: int, seconds: float) -> None:
    keys = [t.writers_key(i) for i in range(first, first + count)]
    store = DiskStore(path, budget_bytes=1 << 40, create=False, readonly=True)
    seen: set[bytes] = set()
    reads = 0
    wrong: list[str] = []
    deadline = time.monotonic() + seconds
    while len(seen) < len(keys) and time.monotonic() < deadline:
        for key in keys:
            got = read(store, key)
            reads += 1
            if got is None:
                continue
            if got != t.expected(key):
                wrong.append(key.hex())
            seen.add(key)
    store.close()
    say(json.dumps({"reads": reads, "seen": len(seen), "wrong": wrong}))


def fill(path: str) -> None:
    """Put 256 KiB records one at a time until several in a row are dropped (the file system is
    full), read back what was admitted, delete every other one, put smaller records (they fit
    in the pages freed), read back again."""
    store = DiskStore(path, budget_bytes=1 << 40, map_size=1 << 30, full_retry_s=0.0)
    admitted: list[bytes] = []
    raised: list[str] = []

    def put(key: bytes) -> int:
        try:
            return store.put_many([(key, t.expected(key), "bfloat16")])
        except Exception as exc:  # put_many must never raise
            traceback.print_exc()
            raised.append(f"{type(exc).__name__}: {exc}")
            return 0

    serial = drops_in_a_row = 0
    while drops_in_a_row < 4 and serial < 400:
        key = t.make_key(t.NS_WRITERS, serial, 256 << 10)
        serial += 1
        if put(key):
            admitted.append(key)
            drops_in_a_row = 0
        else:
            drops_in_a_row += 1
    full_stats = store.stats()
    wrong = [k.hex() for k in admitted if read(store, k) != t.expected(k)]
    deleted = admitted[::2]
    store.delete_many(deleted)
    kept = [k for k in admitted if k not in set(deleted)]
    again = [t.make_key(t.NS_WRITERS, serial + i, 64 << 10) for i in range(len(deleted))]
    readmitted = [k for k in again if put(k)]
    wrong += [k.hex() for k in kept + readmitted if read(store, k) != t.expected(k)]
    store.close()
    say(json.dumps({
        "admitted": len(admitted), "dropped": serial - len(admitted), "raised": raised,
        "full_events": full_stats["full_events"], "admission_drops": full_stats["admission_drops"],
        "wrong": wrong, "readmitted": len(readmitted),
        "present": [k.hex() for k in kept + readmitted], "deleted": [k.hex() for k in deleted],
    }))


def main() -> None:
    mode, *args = sys.argv[1:]
    if mode == "probe":
        probe()
    elif mode == "kill-disk":
        kill_disk(args[0], int(args[1]), int(args[2]))
    elif mode == "kill-hier":
        kill_hier(args[0], args[1], int(args[2]), int(args[3]))
    elif mode == "writer":
        writer(args[0], int(args[1]), int(args[2]), int(args[3]), int(args[4]))
    elif mode == "reader":
        reader(args[0], int(args[1]), int(args[2]), float(args[3]))
    elif mode == "fill":
        fill(args[0])
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()

"""SIGKILL a writer at a random moment, reopen the store, read every key it ever tried to write.

The child prints the keys of each batch before putting it, so the parent knows every key that
may be on disk. Each round kills a new writer on the same store (whose budget makes it evict),
so later rounds start from a store an earlier kill left behind. Required after every kill: the
reopened store knows it was not closed cleanly, its verification ends, no read returns bytes
other than those written for the key, the index names only keys that were written, and the
totals match the index; and what was committed before the kill is served: the disk writer's last
batch that a later one followed (less what it deleted since), and the chunks the hierarchy's
write-behind must have written to reuse their host slots. At the end ``kvstrata verify`` says
sound.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torture as t

from kvstrata.presence import Presence
from kvstrata.tiers.disk import DiskStore

if TYPE_CHECKING:
    from kvstrata.tiers.hierarchy import Hierarchy
    from kvstrata.tiers.host import HostSlab


def kill_writer(mode: str, args: list[str], seed: int) -> list[list[bytes]]:
    """Start a writer child, let it put a random number of batches, wait a random moment and
    SIGKILL it; returns the batches it announced ("batch KEY KEY..."), in order, and its
    deletes ("delete KEY..."), each as ``[b"batch"|b"delete", *keys]``."""
    rng = np.random.default_rng(seed)
    child = t.Child(mode, *args, str(seed))
    try:
        assert child.next() == "open"
        lines = [child.next() for _ in range(int(rng.integers(1, 25)))]
        time.sleep(float(rng.uniform(0, 0.03)))  # where the kill lands; decides no outcome
        lines += child.kill()
    finally:
        child.close()
    return [[word.encode(), *map(bytes.fromhex, keys)] for word, *keys in map(str.split, lines)
            if word in ("batch", "delete")]


def announced(log: list[list[bytes]]) -> set[bytes]:
    """Every key a writer may have written."""
    return {k for kind, *keys in log if kind == b"batch" for k in keys}


def committed_last(log: list[list[bytes]]) -> set[bytes]:
    """The keys of the last batch another one followed (its put returned, committed), less
    those deleted after it; none when the puts after it could have evicted it (the budget)."""
    batches = [i for i, (kind, *_) in enumerate(log) if kind == b"batch"]
    if len(batches) < 2:
        return set()
    last = batches[-2]
    after = {k for kind, *keys in log[last:] if kind == b"batch" for k in keys}
    if sum(map(t.value_len, after)) > t.KILL_BUDGET // 2:
        return set()
    deleted = {k for kind, *keys in log[last:] if kind == b"delete" for k in keys}
    return set(log[last][1:]) - deleted


def read(store: DiskStore, key: bytes) -> bytes | None:
    out = bytearray(t.value_len(key))
    n = store.get_into(key, out)
    return None if n is None else bytes(out[:n])


def check_reopened(store: DiskStore, written: set[bytes], tal: t.Tally) -> list[str]:
    """The checks after a kill, on a freshly opened store; returns what broke."""
    problems = []
    if not store.unclean_shutdown:
        problems.append("the store did not notice that its writer was killed")
    if not store.wait_recovery(60):
        problems.append("the verification after the unclean shutdown did not end in 60 s")
    for key in sorted(written):
        got = read(store, key)
        if got is None:
            tal.detected += 1
        elif got == t.expected(key):
            tal.served += 1
        else:
            tal.wrong += 1
            problems.append(f"WRONG bytes served for {t.describe_key(key)}")
    index = dict(store.iter_index())
    unknown = [k for k in index if k not in written]
    if unknown:
        problems.append(f"{len(unknown)} indexed keys were never written, e.g. {t.describe_key(unknown[0])}")
    stats = store.stats()
    counted = (len(index), sum(r.stored_len for r in index.values()))
    if (stats["entries"], stats["stored_bytes"]) != counted:
        problems.append(f"totals {stats['entries']}/{stats['stored_bytes']} != index {counted}")
    return problems


def verify_sound(path: Path) -> list[str]:
    run = t.cli("verify", "--json", str(path))
    return [] if run.rc == 0 and run.report.get("status") == "sound" else [f"at the end: {run.describe()}"]


def test_kill_disk_writer_mid_put_then_reopen(tmp_path: Path) -> None:
    path = tmp_path / "store"
    tal = t.tally("kill mid-put (DiskStore)")
    written: set[bytes] = set()
    failures = []
    required = 0
    for round_ in range(t.trials(4)):
        seed = t.seed_for("kill-disk", round_)
        log = kill_writer("kill-disk", [str(path), str(round_ * 1_000_000)], seed)
        written.update(announced(log))
        store = DiskStore(path, budget_bytes=t.KILL_BUDGET, create=False)
        try:
            problems = check_reopened(store, written, tal)
            must = committed_last(log)
            required += len(must)
            lost = [k for k in must if read(store, k) != t.expected(k)]
            problems += [f"a committed record was lost: {t.describe_key(k)}" for k in lost]
        finally:
            store.close()
        tal.trials += 1
        failures += [f"round {round_} seed={seed}: {p}" for p in problems]
    failures += verify_sound(path)
    assert not failures, "\n".join(failures)
    assert required > 0, "no round's kill came after a committed batch: the seeds test nothing"


def test_kill_hierarchy_writer_mid_write_behind_then_reopen(tmp_path: Path) -> None:
    """The same through a Hierarchy: chunks stored into the host tier, written to disk by its
    write-behind, killed; a fresh Hierarchy (new slab) promotes them back from disk."""
    path = tmp_path / "store"
    tal = t.tally("kill mid-put (Hierarchy write-behind)")
    chunks: set[bytes] = set()
    failures = []
    required = 0
    for round_ in range(t.trials(3)):
        seed = t.seed_for("kill-hier", round_)
        slab = tmp_path / f"writer-{round_}.slab"
        mine = announced(kill_writer("kill-hier", [str(path), str(slab), str(round_ * 1_000_000)], seed))
        chunks.update(mine)
        # A chunk got a host slot only once the slot's last chunk was written to disk (write
        # backpressure "defer"): past HOST_SLOTS, each chunk announced is one written (and
        # committed) before the kill. The disk's budget holds the newest 8 of them.
        must = min(max(0, len(mine) - t.HOST_SLOTS), 8)
        required += must
        h, host, disk = t.hierarchy(path, tmp_path / f"reader-{round_}.slab", create=False)
        try:
            problems = check_reopened(disk, {ns + k for k in chunks for ns in t.HIER_NS}, t.Tally())
            served = tal.served
            problems += check_promoted(h, host, sorted(mine), tal)
            problems += check_promoted(h, host, sorted(chunks - mine), tal)
            if tal.served - served < must:
                problems.append(f"{tal.served - served} of this round's chunks served, at least {must} "
                                "were committed before the kill")
        finally:
            h.close()
            disk.close()
            host.close()
        tal.trials += 1
        failures += [f"round {round_} seed={seed}: {p}" for p in problems]
    failures += verify_sound(path)
    assert not failures, "\n".join(failures)
    assert required > 0, "no round's kill came after a committed write: the seeds test nothing"


def check_promoted(h: Hierarchy, host: HostSlab, chunks: list[bytes], tal: t.Tally) -> list[str]:
    """Look every chunk up, let its promotion land, load it and compare both shards."""
    problems = []
    for i in range(0, len(chunks), t.HOST_SLOTS // 2):
        batch = chunks[i : i + t.HOST_SLOTS // 2]
        h.lookup_many(batch)
        if not h.wait_promotions(batch, 60):
            problems.append("promotions did not land within 60 s")
        states = h.lookup_many(batch)
        hits = [k for k, s in zip(batch, states, strict=True) if s == Presence.HIT]
        if Presence.PENDING in states:
            problems.append(f"{states.count(Presence.PENDING)} chunks still pending after their promotion")
        tal.detected += states.count(Presence.MISS)
        for key, slot in zip(hits, h.prepare_load(hits), strict=True):
            row = host.array[slot]
            shards = [bytes(row[r * t.SHARD : (r + 1) * t.SHARD]) for r in range(len(t.HIER_NS))]
            if shards == [t.expected(ns + key) for ns in t.HIER_NS]:
                tal.served += 1
            else:
                tal.wrong += 1
                problems.append(f"WRONG bytes loaded for chunk {t.describe_key(t.HIER_NS[0] + key)}")
        h.complete_load(hits)
        h.reset()
    return problems

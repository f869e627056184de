"""HostSlab (shared, pre-touched memory) and HostPool (index, refcounts, LRU/ARC eviction)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from kvstrata.tiers.host import HostPool, HostSlab, default_slab_path, sweep_stale_slabs


def _key(i: int, group: int = 0) -> bytes:
    return i.to_bytes(32, "big") + group.to_bytes(4, "big")


# ---- HostSlab ----------------------------------------------------------------------------------


def test_slab_views_share_memory(tmp_path):
    with HostSlab(tmp_path / "s.slab", 4096, 3) as slab:
        assert slab.array.shape == (3, 4096) and slab.nbytes == 3 * 4096
        slab.slot(1)[:4] = [1, 2, 3, 4]
        assert slab.tensor[1, :4].tolist() == [1, 2, 3, 4]
        slab.tensor[2, 10] = 7
        assert bytes(slab.view(2, 10, 1)) == b"\x07"
        slab.view(0, 4090, 6)[:] = b"abcdef"
        assert bytes(slab.array[0, 4090:]) == b"abcdef"
        with pytest.raises(IndexError):
            slab.view(0, 4090, 7)


_CHILD = """
import sys
from kvstrata.tiers.host import HostSlab
slab = HostSlab(sys.argv[1], 8192, 2, create=False)
assert slab.array[0, 0] == 42  # sees the parent's bytes
slab.array[1, :] = 9
slab.close()
"""


def test_slab_is_shared_between_processes(tmp_path):
    path = str(tmp_path / "shared.slab")
    slab = HostSlab(path, 8192, 2)
    slab.array[0, 0] = 42
    # A separate interpreter, as vLLM's worker process would be (only numpy is imported).
    subprocess.run([sys.executable, "-c", _CHILD, path], check=True, timeout=60)
    assert (slab.array[1] == 9).all()
    # A second open in this process with create=True keeps the contents.
    again = HostSlab(path, 8192, 2, create=True)
    assert again.array[0, 0] == 42
    again.close()
    slab.close()
    slab.unlink()
    slab.unlink()  # idempotent


def test_slab_open_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        HostSlab(tmp_path / "missing", 4096, 1, create=False)
    HostSlab(tmp_path / "a", 4096, 2).close()
    with pytest.raises(ValueError, match="expected"):
        HostSlab(tmp_path / "a", 4096, 3, create=False)
    # create=True re-sizes a leftover of another geometry.
    slab = HostSlab(tmp_path / "a", 4096, 3)
    assert slab.array.shape == (3, 4096)
    slab.close()
    with pytest.raises(ValueError):
        HostSlab(tmp_path / "b", 0, 1)


def test_default_path_and_pin_on_cpu():
    assert default_slab_path("x").endswith("kvstrata-x.slab")
    slab = HostSlab.for_name(f"test-{id(object())}", 4096, 2)
    try:
        assert slab.path.startswith("/dev/shm/") or not os.path.isdir("/dev/shm")
        if not torch.cuda.is_available():
            assert slab.pin() is False and not slab.pinned
    finally:
        slab.close()
        slab.unlink()


def test_pin_pieces_end_on_slot_and_page_boundaries():
    """No slot's copy spans two registrations, and no two registrations share a page."""
    from kvstrata.tiers.host.slab import PAGE, register_pieces

    slot = 3 * PAGE + PAGE // 8  # not a page multiple: a piece is a whole number of 8 slots
    pieces = register_pieces(1 << 20, 50 * slot, slot, limit=10 * slot)
    assert sum(n for _, n in pieces) == 50 * slot and len(pieces) > 1
    for start, size in pieces[:-1]:
        end = start + size - (1 << 20)
        assert end % slot == 0 and end % PAGE == 0
        assert size <= 10 * slot
    big = register_pieces(0, 4 * slot, slot, limit=1)  # the limit below one unit: one unit each
    assert all(n % slot == 0 for _, n in big)


def test_failed_cuda_registration_clears_the_error_and_rolls_back(tmp_path, monkeypatch):
    """A failed cudaHostRegister leaves CUDA's last error set; left there, the next kernel launch
    check raises it. The slab registers through vLLM's helper, which clears it, and unregisters
    the pieces it had registered."""
    from vllm.v1.kv_offload.cpu import host_register as vllm_register

    import kvstrata.tiers.host.slab as slab_mod

    calls: list[str] = []

    class FakeCudart:
        def cudaHostRegister(self, ptr, size, flags=0):
            calls.append("register")
            return 0 if calls.count("register") == 1 else 1  # the second piece fails

        def cudaGetLastError(self):
            calls.append("get_last_error")
            return 0

        def cudaHostUnregister(self, ptr):
            calls.append("unregister")
            return 0

    monkeypatch.setattr(vllm_register, "_load_cudart", lambda: FakeCudart())
    monkeypatch.setattr(vllm_register.current_platform, "is_cuda_alike", lambda: True)
    monkeypatch.setattr(slab_mod, "REGISTER_PIECE_BYTES", 2 * 4096, raising=False)
    with HostSlab(tmp_path / "p.slab", 4096, 4) as slab:
        assert slab.pin() is False and not slab.pinned
    assert calls == ["register", "register", "get_last_error", "unregister"]


def test_close_with_outstanding_views(tmp_path):
    slab = HostSlab(tmp_path / "v", 4096, 1)
    view = slab.slot(0)
    view[0] = 5
    slab.close()  # must not raise although a view is alive
    assert view[0] == 5


# ---- HostPool ----------------------------------------------------------------------------------


@pytest.fixture(params=["lru", "arc"])
def policy(request) -> str:
    return request.param


def _fill(pool: HostPool, keys: list[bytes]) -> list[int]:
    slots = pool.allocate(keys)
    assert slots is not None
    for key in keys:
        pool.mark_ready(key)
        pool.release(key)
    return slots


def test_budget_to_slots():
    assert HostPool.slots_for_budget(10 << 20, 3 << 20) == 3
    assert HostPool.slots_for_budget(1, 4096) == 1


def test_allocate_is_all_or_nothing_and_slots_are_distinct(policy):
    pool = HostPool(num_slots=4, policy=policy)
    slots = pool.allocate([_key(i) for i in range(3)])
    assert sorted(slots) == [0, 1, 2]
    # Not ready and referenced: none of them may be evicted.
    assert pool.allocate([_key(10), _key(11)]) is None
    assert len(pool) == 3 and pool.free_slots == 1
    assert pool.lookup_many([_key(0), _key(9)]) == [HostPool.NOT_READY, HostPool.ABSENT]
    with pytest.raises(KeyError):
        pool.allocate([_key(0)])
    with pytest.raises(ValueError):
        pool.allocate([_key(20), _key(20)])


def test_room_is_what_an_allocation_could_take(policy):
    """Free slots and idle chunks (evictable) are room; referenced ones are not."""
    pool = HostPool(num_slots=4, policy=policy)
    assert pool.room == 4
    pool.allocate([_key(0), _key(1)])  # not ready, the writer's reference
    assert pool.room == 2
    pool.mark_ready(_key(0))
    pool.release(_key(0))  # ready and idle: evictable
    assert pool.room == 3
    assert pool.allocate([_key(2), _key(3), _key(4)]) is not None  # takes exactly that room
    assert pool.room == 0 and pool.allocate([_key(5)]) is None


def test_referenced_chunks_are_never_evicted(policy):
    pool = HostPool(num_slots=3, policy=policy)
    keys = [_key(i) for i in range(3)]
    slots = _fill(pool, keys)
    pool.acquire(keys[0])  # e.g. an in-flight load
    pool.acquire(keys[1])  # e.g. an in-flight disk write
    new = pool.allocate([_key(7)])
    assert new == [slots[2]]  # the only idle one went
    assert keys[2] not in pool
    assert pool.allocate([_key(8)]) is None  # everything else is in use
    pool.release(keys[0])
    assert pool.allocate([_key(8)]) == [slots[0]]
    assert keys[1] in pool and pool.refs(keys[1]) == 1


def test_protected_keys_are_not_evicted(policy):
    pool = HostPool(num_slots=2, policy=policy)
    a, b = _key(1), _key(2)
    _fill(pool, [a, b])
    assert pool.allocate([_key(3)], protected={a, b}) is None
    assert pool.allocate([_key(3)], protected={a}) is not None
    assert a in pool and b not in pool


def test_spare_keys_are_evicted_only_where_the_others_are_too_few(policy):
    """Chunks the disk has not got yet (``spare``) go after every other idle chunk, whatever
    the policy's order (here they are the least recently used), and among themselves in it."""
    evicted: list[bytes] = []
    pool = HostPool(num_slots=5, policy=policy, on_evict=evicted.extend)
    spare = [_key(0), _key(1), _key(2)]
    clean = [_key(3), _key(4)]
    _fill(pool, spare + clean)
    assert pool.allocate([_key(10)], spare=set(spare)) is not None
    assert evicted == [clean[0]]
    assert pool.allocate([_key(11), _key(12)], spare=set(spare)) is not None
    assert evicted == [clean[0], clean[1], spare[0]]
    # Protected beats spare: none is evicted then, and too few is no allocation at all.
    assert pool.allocate([_key(13)], protected=set(spare), spare=set(spare)) is None
    assert pool.allocate([_key(13), _key(14), _key(15)], spare=set(spare)) is None
    assert len(evicted) == 3


def test_room_without_kept_chunks(policy):
    pool = HostPool(num_slots=4, policy=policy)
    _fill(pool, [_key(0), _key(1)])
    pool.allocate([_key(2)])  # referenced: not room anyway
    assert pool.room == 3
    assert pool.room_without([_key(0)]) == 2
    assert pool.room_without([_key(0), _key(2), _key(9)]) == 2  # a referenced or absent key changes nothing
    assert pool.allocate([_key(3), _key(4)], protected={_key(0)}) is not None
    assert pool.room_without([_key(0)]) == 0


def test_lru_order_follows_touches():
    evicted: list[bytes] = []
    pool = HostPool(num_slots=3, policy="lru", on_evict=evicted.extend)
    keys = [_key(i) for i in range(3)]
    _fill(pool, keys)
    pool.lookup_many([keys[0]])  # touch: keys[1] is now least recently used
    _fill(pool, [_key(10)])
    assert evicted == [keys[1]]
    pool.touch(keys[2])
    _fill(pool, [_key(11)])
    assert evicted == [keys[1], keys[0]]
    assert pool.evictions == 2

def test_a_lookup_touches_only_its_ready_chunks():
    evicted: list[bytes] = []
    pool = HostPool(num_slots=4, policy="lru", on_evict=evicted.extend)
    ready = [_key(i) for i in range(3)]
    _fill(pool, ready)
    landing = _key(7)
    assert pool.allocate([landing]) is not None  # not ready: a store or promotion in flight
    # A lookup of the pool's last-used chunk, one it lacks and one landing touches only the
    # first: ready[1] and ready[2] stay the least recently used, in their order.
    states = pool.lookup_many([ready[0], _key(9), landing])
    assert states == [HostPool.READY, HostPool.ABSENT, HostPool.NOT_READY]
    pool.lookup_many([ready[2], ready[1]], touch=False)  # records nothing
    pool.mark_ready(landing)
    pool.release(landing)
    _fill(pool, [_key(10), _key(11)])
    assert evicted == [ready[1], ready[2]]



@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_one_allocation_evicts_its_victims_in_one_call(policy: str):
    calls: list[list[bytes]] = []
    pool = HostPool(num_slots=4, policy=policy, on_evict=calls.append)
    keys = [_key(i) for i in range(4)]
    slots = _fill(pool, keys)
    pool.acquire(keys[1])  # pinned: never a victim
    fresh = [_key(10 + i) for i in range(3)]
    new_slots = pool.allocate(fresh)
    assert new_slots is not None and len(calls) == 1
    assert sorted(calls[0]) == sorted([keys[0], keys[2], keys[3]])
    assert sorted(new_slots) == sorted(slots[i] for i in (0, 2, 3))  # their slots, reused
    assert pool.evictions == 3 and keys[1] in pool and not any(k in pool for k in calls[0])
    pool.release(keys[1])
    for k in fresh:
        pool.mark_ready(k)
        pool.release(k)
    assert pool.evict_idle() == 4 and sorted(calls[1]) == sorted([keys[1], *fresh]) and len(calls) == 2


def test_arc_keeps_frequent_chunks_against_a_scan():
    pool = HostPool(num_slots=4, policy="arc")
    hot = [_key(i) for i in range(2)]
    _fill(pool, hot)
    for _ in range(2):
        pool.lookup_many(hot)  # second access: hot chunks move to T2
    for i in range(100, 120):  # a one-pass scan of cold chunks
        _fill(pool, [_key(i)])
    assert all(k in pool for k in hot), "ARC must not let a scan flush frequent chunks"

    lru = HostPool(num_slots=4, policy="lru")
    _fill(lru, hot)
    lru.lookup_many(hot)
    for i in range(100, 120):
        _fill(lru, [_key(i)])
    assert not any(k in lru for k in hot)  # the contrast that makes the ARC test meaningful


def test_arc_ghost_hit_grows_recency_target():
    pool = HostPool(num_slots=2, policy="arc")
    a, b, c = _key(1), _key(2), _key(3)
    _fill(pool, [a, b])
    _fill(pool, [c])  # evicts a from T1 into ghost list B1
    assert a not in pool
    p_before = pool._policy.p  # type: ignore[union-attr]
    _fill(pool, [a])  # B1 ghost hit
    assert pool._policy.p > p_before  # type: ignore[union-attr]


def test_discard_release_and_reset(policy):
    pool = HostPool(num_slots=3, policy=policy)
    k = [_key(i) for i in range(3)]
    pool.allocate(k[:1])
    assert pool.discard(k[0]) and not pool.discard(k[0])
    assert pool.free_slots == 3
    _fill(pool, k)
    pool.acquire(k[1])
    with pytest.raises(RuntimeError):
        pool.release(k[0])
    with pytest.raises(KeyError):
        pool.acquire(_key(99))
    assert pool.evict_idle() == 2
    assert list(pool.keys()) == [k[1]]
    stats = pool.stats()
    assert stats["used"] == 1 and stats["referenced"] == 1 and stats["policy"] == policy


def test_no_slot_is_ever_handed_out_twice(policy):
    rng = np.random.default_rng(0)
    pool = HostPool(num_slots=16, policy=policy)
    owner: dict[int, bytes] = {}
    held: dict[bytes, int] = {}
    for step in range(3000):
        key = _key(int(rng.integers(0, 64)))
        op = rng.integers(0, 4)
        if op == 0 and key not in pool:
            slots = pool.allocate([key])
            if slots is not None:
                # The slot must not belong to a live entry.
                prev = owner.get(slots[0])
                assert prev is None or prev not in pool
                owner[slots[0]] = key
                pool.mark_ready(key)
                pool.release(key)
        elif op == 1 and pool.is_ready(key):
            pool.acquire(key)
            held[key] = held.get(key, 0) + 1
        elif op == 2 and held.get(key):
            pool.release(key)
            held[key] -= 1
        elif op == 3:
            pool.lookup_many([key])
        for k, n in held.items():
            if n:
                assert k in pool, f"step {step}: a referenced chunk was evicted"
    assert len(pool) + pool.free_slots == 16
    stats = pool.stats()
    assert stats["referenced"] == sum(1 for n in held.values() if n)
    assert stats["not_ready"] == 0


def _age(path, seconds: float = 3600.0) -> None:
    old = os.stat(path).st_mtime - seconds
    os.utime(path, (old, old))


def test_sweep_removes_only_slabs_whose_processes_are_gone(tmp_path):
    # A slab whose engine was SIGKILLed: its file stays, nobody holds it.
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; from kvstrata.tiers.host import HostSlab; "
         f"s = HostSlab({str(tmp_path / 'kvstrata-dead-pp0.slab')!r}, 4096, 64); "
         "print('ready', flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "ready"
    dead = tmp_path / "kvstrata-dead-pp0.slab"
    _age(dead)
    assert sweep_stale_slabs(tmp_path) == []  # still held by its (live) process
    holder.kill()
    holder.wait()
    live = HostSlab(tmp_path / "kvstrata-live-pp0.slab", 4096, 16)  # held by this process
    young = tmp_path / "kvstrata-young-pp0.slab"
    young.write_bytes(b"\0" * 4096)  # unlocked but just created: an engine about to lock it
    other = tmp_path / "something-else.slab"
    other.write_bytes(b"x")
    for p in (live.path, other):
        _age(p)
    removed = sweep_stale_slabs(tmp_path)
    assert [os.path.basename(p) for p, _ in removed] == ["kvstrata-dead-pp0.slab"]
    assert removed[0][1] >= 64 * 4096  # its memory was reserved (fallocate), now freed
    assert not dead.exists() and young.exists() and other.exists()
    assert os.path.exists(live.path) and live.array.shape == (16, 4096)
    live.close()
    assert [os.path.basename(p) for p, _ in sweep_stale_slabs(tmp_path)] == ["kvstrata-live-pp0.slab"]
    assert sweep_stale_slabs(tmp_path / "missing") == []

"""Host tier: one shared slab of fixed-size chunk slots and the index that hands them out.

``HostSlab`` is memory only: a file-backed shared mmap (``/dev/shm`` when present) that the
scheduler process (index, disk I/O) and the worker processes (device staging) map at the same
time, so a chunk copied in by a worker is readable by the scheduler's write-behind without another
copy. ``HostPool`` is the scheduler-side index over the slab's slots: key -> slot, reference counts
and an eviction policy. It never allocates buffers: slots are preallocated, a store only picks one.

The pool is not thread-safe on its own; ``Hierarchy`` serialises access with its lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import stat
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence, Set
from typing import TYPE_CHECKING, Literal

import numpy as np

if TYPE_CHECKING:
    import torch

PAGE = mmap.PAGESIZE
# madvise(MADV_POPULATE_WRITE) (Linux 5.14+): fault every page in writable without touching the
# bytes, so opening a slab another process already filled does not clobber it. Python 3.11's
# mmap module does not export the constant.
_MADV_POPULATE_WRITE = 23
# cudaHostRegister is called in pieces (as vLLM does) because very large single registrations
# have been seen to fail on some drivers.
_REGISTER_PIECE = 64 << 30


_fence_lock = threading.Lock()


def board_fence() -> None:
    """A full memory barrier around the landing board (``HostSlab.landed``).

    The scheduler process fences between a slot's last byte and the board store that publishes
    it; a worker fences between reading the board and reading the slot. x86-64 keeps stores and
    loads in order anyway; AArch64 does not, and the board is plain shared memory. Taking and
    dropping a lock orders memory on the platforms CPython runs on (glibc's semaphore and mutex
    paths use sequentially consistent atomics); vLLM's shared-memory queue fences the same way.
    """
    with _fence_lock:
        pass


def default_slab_path(name: str) -> str:
    """``/dev/shm/kvstrata-<name>.slab``, or the temp dir where there is no /dev/shm."""
    root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(root, f"kvstrata-{name}.slab")


class HostSlab:
    """``num_slots * slot_bytes`` bytes of shared, pre-touched host memory.

    ``create=True`` creates the backing file or opens an existing one of the right size (so both
    processes may pass it; an existing file of another size is a leftover and is re-sized);
    ``create=False`` only opens and fails when the file is missing or of another size.

    Every process with the slab open holds a shared ``flock`` on it until :meth:`close`, so
    :func:`sweep_stale_slabs` can tell a slab whose processes all died (SIGKILL, OOM) from a live
    one and give its memory back.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        slot_bytes: int,
        num_slots: int,
        *,
        create: bool = True,
    ) -> None:
        if slot_bytes <= 0 or num_slots <= 0:
            raise ValueError(
                f"slot_bytes and num_slots must be > 0 (got {slot_bytes}, {num_slots})"
            )
        self.path = os.fspath(path)
        self.slot_bytes = int(slot_bytes)
        self.num_slots = int(num_slots)
        self.nbytes = self.slot_bytes * self.num_slots
        # After the slots, one int64 per slot: the landing board of streamed loads (see
        # ``landed``), on its own pages so pinning and the slot views never cover it.
        board_bytes = -(-self.num_slots * 8 // PAGE) * PAGE
        self.file_bytes = self.nbytes + board_bytes
        self._registered: list[int] = []
        self._tensor: torch.Tensor | None = None

        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        try:
            fd = os.open(self.path, flags, 0o600)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"host slab {self.path} does not exist (create=False)"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # "in use" for sweep_stale_slabs, until close()
            size = os.fstat(fd).st_size
            fresh = size != self.file_bytes
            if fresh:
                if not create and size != 0:
                    raise ValueError(
                        f"host slab {self.path} holds {size} bytes, expected "
                        f"{self.num_slots} x {self.slot_bytes} = {self.nbytes} and a "
                        f"{self.file_bytes - self.nbytes}-byte landing board"
                    )
                os.ftruncate(fd, self.file_bytes)
            try:
                # Reserve the memory now: on tmpfs an over-committed slab would otherwise SIGBUS
                # at first touch of a page, in the middle of a transfer.
                os.posix_fallocate(fd, 0, self.file_bytes)
            except OSError as exc:
                raise MemoryError(
                    f"cannot reserve {self.file_bytes} bytes for host slab {self.path}: {exc}"
                ) from exc
            self._mmap = mmap.mmap(fd, self.file_bytes, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            raise
        self._fd: int | None = fd
        self.array = np.frombuffer(self._mmap, dtype=np.uint8, count=self.nbytes).reshape(
            self.num_slots, self.slot_bytes
        )
        # Per slot, the last promotion that finished in it: ``ticket << 1 | failed``. Written by
        # the scheduler process once the slot's bytes are final, read by workers that were
        # handed a load before the data landed (``Hierarchy.prepare_streamed_load``). Aligned
        # int64 stores and loads are single accesses on x86-64 and AArch64; both sides order
        # them against the slot's bytes with ``board_fence``.
        self.landed = np.frombuffer(
            self._mmap, dtype=np.int64, count=self.num_slots, offset=self.nbytes
        )
        self._pretouch(fresh)

    @classmethod
    def for_name(
        cls, name: str, slot_bytes: int, num_slots: int, *, create: bool = True
    ) -> HostSlab:
        """The slab at :func:`default_slab_path` ``(name)``."""
        return cls(default_slab_path(name), slot_bytes, num_slots, create=create)

    def _pretouch(self, fresh: bool) -> None:
        # Fault every page in up front: a first touch costs a page fault (3-8x slower copies,
        # docs/STORAGE.md §2), which must not land on the transfer path.
        try:
            self._mmap.madvise(_MADV_POPULATE_WRITE)
            return
        except (OSError, ValueError):
            pass
        flat = self.array.reshape(-1)
        if fresh:
            flat[::PAGE] = 0  # new file: its bytes are zero anyway
        else:
            int(flat[::PAGE].sum())  # shared contents: read-touch only

    # ---- views -------------------------------------------------------------------------------

    def slot(self, index: int) -> np.ndarray:
        """Writable uint8 view of one slot."""
        return self.array[index]

    def view(self, index: int, offset: int, length: int) -> memoryview:
        """Writable view of ``length`` bytes at ``offset`` in slot ``index``."""
        if offset < 0 or length < 0 or offset + length > self.slot_bytes:
            raise IndexError(
                f"[{offset}, {offset + length}) is outside a {self.slot_bytes}-byte slot"
            )
        return memoryview(self.array[index, offset : offset + length])

    @property
    def tensor(self) -> torch.Tensor:
        """uint8 ``[num_slots, slot_bytes]`` torch view of the slab (no copy)."""
        if self._tensor is None:
            import torch

            self._tensor = torch.frombuffer(
                self._mmap, dtype=torch.uint8, count=self.nbytes
            ).view(self.num_slots, self.slot_bytes)
        return self._tensor

    @property
    def data_ptr(self) -> int:
        return int(self.array.ctypes.data)

    # ---- pinning -----------------------------------------------------------------------------

    @property
    def pinned(self) -> bool:
        return bool(self._registered)

    def pin(self) -> bool:
        """Page-lock the slab for DMA (cudaHostRegister / XPU host register).

        Returns True when the slab is now pinned. A no-op returning False on CPU-only builds, or
        when registration fails: transfers still work on pageable memory, only slower.
        """
        if self._registered:
            return True
        try:
            import torch
        except ImportError:
            return False
        base = self.data_ptr
        pieces = [
            (base + off, min(_REGISTER_PIECE, self.nbytes - off))
            for off in range(0, self.nbytes, _REGISTER_PIECE)
        ]
        if torch.cuda.is_available():
            cudart = torch.cuda.cudart()
            for ptr, size in pieces:
                if int(cudart.cudaHostRegister(ptr, size, 0)) != 0:
                    self.unpin()
                    return False
                self._registered.append(ptr)
            return True
        xpu_register = getattr(getattr(torch.ops, "_C", None), "xpu_host_register", None)
        if hasattr(torch, "xpu") and torch.xpu.is_available() and xpu_register is not None:
            for ptr, size in pieces:
                if not xpu_register(ptr, size):
                    self.unpin()
                    return False
                self._registered.append(ptr)
            return True
        return False

    def unpin(self) -> None:
        if not self._registered:
            return
        import torch

        if torch.cuda.is_available():
            cudart = torch.cuda.cudart()
            for ptr in self._registered:
                cudart.cudaHostUnregister(ptr)
        else:
            unregister = getattr(getattr(torch.ops, "_C", None), "xpu_host_unregister", None)
            if unregister is not None:
                for ptr in self._registered:
                    unregister(ptr)
        self._registered.clear()

    # ---- lifetime ----------------------------------------------------------------------------

    def close(self) -> None:
        """Unpin and unmap. Views handed out earlier keep the mapping alive until they die."""
        self.unpin()
        self._tensor = None
        self.array = np.empty((0, self.slot_bytes), dtype=np.uint8)
        self.landed = np.zeros(0, dtype=np.int64)
        try:
            self._mmap.close()
        except BufferError:
            pass  # outstanding views; the mapping goes away with the last of them
        if self._fd is not None:
            os.close(self._fd)  # drops this process's "in use" lock
            self._fd = None

    def unlink(self) -> None:
        """Remove the backing file (mappings stay valid until closed)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def __enter__(self) -> HostSlab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def sweep_stale_slabs(directory: str | os.PathLike[str] | None = None, *,
                      min_age_s: float = 60.0) -> list[tuple[str, int]]:
    """Remove ``kvstrata-*.slab`` files in ``directory`` (default: where
    :func:`default_slab_path` puts them) that no process has open: what engines killed without a
    clean shutdown leave behind, each holding its whole host tier in memory. Returns the
    ``(path, bytes)`` removed.

    A slab is in use while any process holds its shared lock (:class:`HostSlab`); one that can
    be locked exclusively is unlinked under that lock. Files younger than ``min_age_s`` are left
    alone: a starting engine creates its slab a moment before it locks it.
    """
    root = os.path.dirname(default_slab_path("x")) if directory is None else os.fspath(directory)
    removed: list[tuple[str, int]] = []
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return removed
    now = time.time()
    for name in names:
        if not (name.startswith("kvstrata-") and name.endswith(".slab")):
            continue
        path = os.path.join(root, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or now - st.st_mtime < min_age_s:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live engine has it open
            # Still the same file (not replaced while we looked)? Then nobody uses it.
            with contextlib.suppress(FileNotFoundError):
                if os.stat(path).st_ino == st.st_ino:
                    os.unlink(path)
                    removed.append((path, st.st_blocks * 512))
        finally:
            os.close(fd)
    return removed


# ---- index -------------------------------------------------------------------------------------


class _Entry:
    __slots__ = ("slot", "refs", "ready")

    def __init__(self, slot: int) -> None:
        self.slot = slot
        self.refs = 1  # the writer (store or promotion) holds the first reference
        self.ready = False


def _evictable(entry: _Entry) -> bool:
    return entry.ready and entry.refs == 0


class _LRU:
    """Least recently used first. ``entries`` is ordered LRU -> MRU."""

    def __init__(self, capacity: int) -> None:
        self.entries: OrderedDict[bytes, _Entry] = OrderedDict()
        # Bound builtins rather than methods: lookups call these once per key.
        self.get: Callable[[bytes], _Entry | None] = self.entries.get
        self.touch: Callable[[bytes], None] = self.entries.move_to_end

    def insert(self, key: bytes, entry: _Entry) -> None:
        self.entries[key] = entry

    def remove(self, key: bytes) -> _Entry | None:
        return self.entries.pop(key, None)

    def victims(self, n: int, protected: Set[bytes]) -> list[bytes] | None:
        out: list[bytes] = []
        if n <= 0:
            return out
        for key, entry in self.entries.items():
            if _evictable(entry) and key not in protected:
                out.append(key)
                if len(out) == n:
                    return out
        return None

    def clear(self) -> None:
        self.entries.clear()

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self):
        return iter(self.entries.items())


class _ARC:
    """Adaptive Replacement Cache (Megiddo & Modha), with pinned entries skipped.

    T1 holds chunks touched once since insertion, T2 those touched again; B1/B2 remember keys
    recently evicted from each, and a ghost hit moves the T1 target ``p`` toward the list that
    would have kept it.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.p = 0.0
        self.t1: OrderedDict[bytes, _Entry] = OrderedDict()
        self.t2: OrderedDict[bytes, _Entry] = OrderedDict()
        self.b1: OrderedDict[bytes, None] = OrderedDict()
        self.b2: OrderedDict[bytes, None] = OrderedDict()

    def get(self, key: bytes) -> _Entry | None:
        entry = self.t1.get(key)
        return entry if entry is not None else self.t2.get(key)

    def insert(self, key: bytes, entry: _Entry) -> None:
        if key in self.b1:
            self.p = min(self.p + max(1.0, len(self.b2) / len(self.b1)), float(self.capacity))
            del self.b1[key]
        elif key in self.b2:
            self.p = max(self.p - max(1.0, len(self.b1) / len(self.b2)), 0.0)
            del self.b2[key]
        self.t1[key] = entry

    def touch(self, key: bytes) -> None:
        entry = self.t1.pop(key, None)
        if entry is not None:
            self.t2[key] = entry
        elif key in self.t2:
            self.t2.move_to_end(key)

    def remove(self, key: bytes) -> _Entry | None:
        entry = self.t1.pop(key, None)
        return entry if entry is not None else self.t2.pop(key, None)

    def victims(self, n: int, protected: Set[bytes]) -> list[bytes] | None:
        out: list[bytes] = []
        if n <= 0:
            return out
        t1 = ((k, e) for k, e in self.t1.items() if _evictable(e) and k not in protected)
        t2 = ((k, e) for k, e in self.t2.items() if _evictable(e) and k not in protected)
        t1_size = len(self.t1)
        for _ in range(n):
            first, second = (t1, t2) if t1_size >= max(1, int(self.p)) else (t2, t1)
            picked = next(first, None) or next(second, None)
            if picked is None:
                return None
            if picked[0] in self.t1:
                t1_size -= 1
            out.append(picked[0])
        return out

    def evicted(self, key: bytes, from_t1: bool) -> None:
        ghosts = self.b1 if from_t1 else self.b2
        ghosts[key] = None
        while len(self.b1) + len(self.b2) > self.capacity:
            (self.b1 if len(self.b1) > len(self.b2) else self.b2).popitem(last=False)

    def clear(self) -> None:
        for d in (self.t1, self.t2, self.b1, self.b2):
            d.clear()
        self.p = 0.0

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def __iter__(self):
        yield from self.t1.items()
        yield from self.t2.items()


class HostPool:
    """Index over a slab's slots: key -> slot, with reference counts and LRU/ARC eviction.

    Life of an entry: ``allocate`` (not ready, one reference held by the writer) -> ``mark_ready``
    + ``release`` (the data is in the slot) -> ``acquire``/``release`` around every reader
    (device load, disk write-behind) -> eviction once ready and unreferenced. An entry with
    references, or not ready, is never evicted, so its slot is never handed out again while a
    transfer uses it. ``discard`` drops an entry whose write failed.
    """

    # lookup_many states
    ABSENT = 0
    READY = 1
    NOT_READY = 2

    def __init__(
        self,
        slab: HostSlab | None = None,
        policy: Literal["lru", "arc"] = "lru",
        *,
        num_slots: int | None = None,
        on_evict: Callable[[bytes], None] | None = None,
    ) -> None:
        if num_slots is None:
            if slab is None:
                raise ValueError("HostPool needs a slab or num_slots")
            num_slots = slab.num_slots
        if policy not in ("lru", "arc"):
            raise ValueError(f"unknown eviction policy {policy!r} (expected 'lru' or 'arc')")
        self.slab = slab
        self.num_slots = num_slots
        self.policy_name = policy
        self._policy: _LRU | _ARC = _LRU(num_slots) if policy == "lru" else _ARC(num_slots)
        # Stack of free slots, lowest first out: a fresh pool fills the slab front to back.
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self.on_evict = on_evict
        self.evictions = 0
        self._referenced = 0  # entries with refs > 0 (kept incrementally for stats())
        self._not_ready = 0

    @staticmethod
    def slots_for_budget(budget_bytes: int, slot_bytes: int) -> int:
        """How many whole slots fit in a byte budget (at least one)."""
        if slot_bytes <= 0:
            raise ValueError("slot_bytes must be > 0")
        return max(1, int(budget_bytes) // int(slot_bytes))

    # ---- queries -------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._policy)

    def __contains__(self, key: bytes) -> bool:
        return self._policy.get(key) is not None

    def lookup_many(self, keys: Sequence[bytes], touch: bool = True) -> list[int]:
        """ABSENT / READY / NOT_READY per key; ``touch`` records an access on READY ones."""
        get = self._policy.get
        entries = [get(key) for key in keys]
        out = [0 if e is None else 1 if e.ready else 2 for e in entries]
        if touch:
            touch_fn = self._policy.touch
            for key, state in zip(keys, out, strict=True):
                if state == 1:
                    touch_fn(key)
        return out

    def get(self, key: bytes) -> tuple[int, bool] | None:
        """``(slot, ready)`` or None; does not count as an access."""
        entry = self._policy.get(key)
        return None if entry is None else (entry.slot, entry.ready)

    def is_ready(self, key: bytes) -> bool:
        entry = self._policy.get(key)
        return entry is not None and entry.ready

    def refs(self, key: bytes) -> int:
        entry = self._policy.get(key)
        return 0 if entry is None else entry.refs

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def keys(self) -> list[bytes]:
        return [key for key, _ in self._policy]

    # ---- updates -------------------------------------------------------------------------------

    def touch(self, key: bytes) -> None:
        """Record an access (a lookup hit or a load)."""
        if self._policy.get(key) is not None:
            self._policy.touch(key)

    def allocate(
        self, keys: Sequence[bytes], protected: Set[bytes] = frozenset()
    ) -> list[int] | None:
        """Slots for absent ``keys``, all or none; evicts idle chunks not in ``protected``.

        The new entries are not ready and hold one reference each (the writer's).
        """
        for key in keys:
            if self._policy.get(key) is not None:
                raise KeyError(f"chunk {key.hex()} is already in the host pool")
        if len(set(keys)) != len(keys):
            raise ValueError("duplicate keys in one allocation")
        need = len(keys) - len(self._free)
        if need > 0:
            victims = self._policy.victims(need, protected)
            if victims is None:
                return None
            for key in victims:
                self._evict(key)
        slots = []
        for key in keys:
            entry = _Entry(self._free.pop())
            self._policy.insert(key, entry)
            slots.append(entry.slot)
        self._referenced += len(keys)
        self._not_ready += len(keys)
        return slots

    def mark_ready(self, key: bytes) -> None:
        entry = self._entry(key)
        if not entry.ready:
            entry.ready = True
            self._not_ready -= 1

    def acquire(self, key: bytes) -> int:
        """Take a reference; returns the slot."""
        entry = self._entry(key)
        if entry.refs == 0:
            self._referenced += 1
        entry.refs += 1
        return entry.slot

    def release(self, key: bytes) -> None:
        entry = self._entry(key)
        if entry.refs <= 0:
            raise RuntimeError(f"chunk {key.hex()} released more often than acquired")
        entry.refs -= 1
        if entry.refs == 0:
            self._referenced -= 1

    def discard(self, key: bytes) -> bool:
        """Drop an entry whatever its state (a failed write); its slot becomes free."""
        entry = self._policy.remove(key)
        if entry is None:
            return False
        self._referenced -= entry.refs > 0
        self._not_ready -= not entry.ready
        self._free.append(entry.slot)
        return True

    def evict_idle(self) -> int:
        """Evict every ready, unreferenced entry (prefix-cache reset). Returns how many."""
        victims = [key for key, entry in self._policy if _evictable(entry)]
        for key in victims:
            self._evict(key)
        return len(victims)

    def _evict(self, key: bytes) -> None:
        policy = self._policy
        from_t1 = isinstance(policy, _ARC) and key in policy.t1
        entry = policy.remove(key)
        assert entry is not None and _evictable(entry)
        if isinstance(policy, _ARC):
            policy.evicted(key, from_t1)
        self._free.append(entry.slot)
        self.evictions += 1
        if self.on_evict is not None:
            self.on_evict(key)

    def _entry(self, key: bytes) -> _Entry:
        entry = self._policy.get(key)
        if entry is None:
            raise KeyError(f"chunk {key.hex()} is not in the host pool")
        return entry

    def stats(self) -> dict[str, int | str]:
        """O(1): the connector may ask every step."""
        return {
            "policy": self.policy_name,
            "slots": self.num_slots,
            "used": len(self._policy),
            "free": len(self._free),
            "referenced": self._referenced,
            "not_ready": self._not_ready,
            "evictions": self.evictions,
        }

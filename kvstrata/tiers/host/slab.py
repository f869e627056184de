"""The host slab: one shared, file-backed mmap of fixed-size chunk slots, plus its landing board.

``HostSlab`` is memory only: a file-backed shared mmap (``/dev/shm`` when present) that the
scheduler process (index, disk I/O) and the worker processes (device staging) map at the same
time, so a chunk copied in by a worker is readable by the scheduler's write-behind without another
copy. It pre-touches its pages and can pin them for DMA. ``board_fence`` orders the landing board
against the slots' bytes; ``sweep_stale_slabs`` removes the slabs of engines that died.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import mmap
import os
import stat
import tempfile
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

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
REGISTER_PIECE_BYTES = 64 << 30


def register_pieces(base: int, nbytes: int, slot_bytes: int, limit: int = REGISTER_PIECE_BYTES) -> list[tuple[int, int]]:
    """``(address, size)`` pieces covering ``nbytes`` at ``base`` (page aligned) for host
    registration: each at most ``limit`` bytes unless one unit is larger, every boundary on a
    slot boundary (one slot's copy never spans two registrations) and on a page boundary (the
    driver registers whole pages; two pieces sharing a page would overlap)."""
    unit = math.lcm(slot_bytes, PAGE)
    piece = max(1, limit // unit) * unit
    return [(base + off, min(piece, nbytes - off)) for off in range(0, nbytes, piece)]


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
        self._unregister: Callable[[int], None] | None = None
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
                if create and size == 0:  # created here: leave nothing behind
                    with contextlib.suppress(OSError):
                        os.unlink(self.path)
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
        return self.array[index, offset : offset + length].data

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

    def pin(self, register: Callable[[int, int], bool] | None = None,
            unregister: Callable[[int], None] | None = None) -> bool:
        """Page-lock the slab for DMA, in ``register_pieces``.

        Registers through vLLM's own helpers (``vllm/v1/kv_offload/cpu/host_register.py``):
        cudaHostRegister on CUDA/ROCm, which clears CUDA's last error after a failure (left set,
        the next kernel launch check would raise an unrelated error), and XPU's host register.
        Returns True when the slab is now pinned; False (nothing left registered) on CPU-only
        builds, without vLLM, or when registration fails. ``register``/``unregister`` replace
        the helpers (tests).
        """
        if self._registered:
            return True
        if register is None or unregister is None:
            try:
                from vllm.v1.kv_offload.cpu.host_register import host_register, host_unregister
            except ImportError:
                return False
            register, unregister = host_register, host_unregister
        self._unregister = unregister
        for ptr, size in register_pieces(
            self.data_ptr, self.nbytes, self.slot_bytes, REGISTER_PIECE_BYTES
        ):
            if not register(ptr, size):
                self.unpin()
                return False
            self._registered.append(ptr)
        return True

    def unpin(self) -> None:
        registered, self._registered = self._registered, []
        for ptr in reversed(registered):
            if self._unregister is not None:
                self._unregister(ptr)

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

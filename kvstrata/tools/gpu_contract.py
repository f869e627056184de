"""The stream contract of ``StreamStager`` on a real CUDA/XPU device (``gpu_check``'s
``stream_contract`` section), on synthetic vLLM-shaped KV: it needs torch and vLLM's compiled
copy op, not vLLM's layout machinery the ``cuda`` tests build their caches with.

Each check is one rule of docs/DESIGN.md "tiers/device/" (the CI double,
``tests/unit/test_device_stream.py``, checks the same rules with completion under the test's
control):

* ``round_trip_pinned`` / ``round_trip_unpinned``: a store then a load (a whole chunk and a
  partial one with a null block) brings back the stored pages bit for bit and writes nothing
  else, through a pinned slab and through a pageable one (copy threads);
* ``load_does_not_wait_for_later_compute``: a load completes while the compute stream is busy
  with work queued after it; a store waits for its ``mark_compute`` event, not for later work;
* ``jobs_in_flight_hold_no_device_memory``: eight stores queued behind a busy stream allocate
  no device memory.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable
from typing import Any

# About a second of GPU clock: far longer than the copies of a few pages.
BUSY_CYCLES = 2_000_000_000
BPC = 4


class _Rig:
    """Synthetic KV on the device, a slab in /dev/shm, and a ``StreamStager`` between them; a
    context manager that closes both."""

    def __init__(self, device: str, *, pin: bool, slots: int = 16) -> None:
        from kvstrata.tiers.device import StreamStager, make_stager
        from kvstrata.tiers.host import HostSlab, default_slab_path
        from kvstrata.tools.synthetic_kv import synthetic_kv

        self.kv = synthetic_kv(layers=8, kv_heads=4, block_tokens=16, head_size=64,
                               blocks_per_chunk=BPC, chunks=8, device=device)
        name = f"gpu-contract-{os.getpid()}-{time.monotonic_ns()}"
        self.slab = HostSlab(default_slab_path(name), self.kv.shard_bytes, slots)
        self.slab.unlink()
        try:
            stager = make_stager(self.kv.caches, [list(self.kv.caches)], self.slab,
                                 num_blocks=self.kv.num_blocks, blocks_per_chunk=BPC,
                                 shard_bytes=self.kv.shard_bytes, pin=pin)
            assert isinstance(stager, StreamStager), type(stager).__name__
            self.stager = stager
        except BaseException:
            self.slab.close()
            raise

    def pages(self, ids: list[int]) -> Any:
        kv = self.kv
        return kv.raw.view(len(kv.caches), kv.num_blocks, kv.page)[:, ids].clone()

    def __enter__(self) -> _Rig:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stager.close()
        self.slab.close()


def _round_trip(device: str, pin: bool) -> dict[str, Any]:
    import torch

    from kvstrata.tiers.device import Transfer

    with _Rig(device, pin=pin) as rig:
        st = rig.stager
        src, dst = [[5, 1, 8, 2], [9, 0, 11]], [[20, 21, 22, 23], [30, 0, 31]]
        want = [rig.pages([b for b in s if b]) for s in src]
        st.store(1, [Transfer(0, 0, 0, src[0]), Transfer(0, 1, 0, src[1])])
        st.wait([1])
        before = rig.kv.raw.clone()
        st.load(2, [Transfer(0, 0, 0, dst[0]), Transfer(0, 1, 0, dst[1])])
        st.wait([2])
        assert sorted(st.poll()) == [(1, True), (2, True)], "a job failed"
        assert st.host_pinned == pin, f"slab pinned: {st.host_pinned}, asked for {pin}"
        for w, d in zip(want, dst, strict=True):
            assert torch.equal(rig.pages([b for b in d if b]), w), "loaded pages differ"
        moved = {b for d in dst for b in d if b}
        others = [b for b in range(rig.kv.num_blocks) if b not in moved]
        n = (len(rig.kv.caches), rig.kv.num_blocks, rig.kv.page)
        assert torch.equal(before.view(n)[:, others], rig.kv.raw.view(n)[:, others]), \
            "a load wrote outside its pages"
        return {"slab_pinned": bool(st.host_pinned)}


def _overlap(device: str) -> dict[str, Any]:
    import torch

    from kvstrata.tiers.device import Transfer

    mod = getattr(torch, device)
    with _Rig(device, pin=True) as rig:
        st = rig.stager
        st.store(1, [Transfer(0, 0, 0, [5, 6, 7, 8])])
        st.wait([1])
        st.load(2, [Transfer(0, 0, 0, [20, 21, 22, 23])])
        compute = mod.current_stream()
        torch.cuda._sleep(BUSY_CYCLES)  # the next forward
        st.wait([2])
        assert not compute.query(), "the load waited for compute queued after it"
        torch.cuda._sleep(1000)
        mark = st.mark_compute()
        torch.cuda._sleep(BUSY_CYCLES)  # the step's sampling and the next forward
        st.store(3, [Transfer(0, 1, 0, [9, 10])], after=mark)
        st.wait([3])
        assert not compute.query(), "the store waited for work queued after its forward"
        assert sorted(st.poll()) == [(1, True), (2, True), (3, True)], "a job failed"
        assert torch.equal(rig.pages([20, 21, 22, 23]), rig.pages([5, 6, 7, 8])), "wrong pages"
        mod.synchronize()
        return {"slab_pinned": bool(st.host_pinned)}


def _no_device_memory(device: str) -> dict[str, Any]:
    import torch

    from kvstrata.tiers.device import Transfer

    mod = getattr(torch, device)
    with _Rig(device, pin=True) as rig:
        st = rig.stager
        mod.synchronize()
        before = mod.memory_allocated()
        torch.cuda._sleep(BUSY_CYCLES)  # keeps every store below in flight
        mark = st.mark_compute()
        for job in range(8):
            st.store(job, [Transfer(0, job, 0, [4 * job + 1 + i for i in range(4)])], after=mark)
        assert st.pending == 8, f"{st.pending} jobs in flight, expected 8"
        held = mod.memory_allocated() - before
        assert held == 0, f"jobs in flight hold {held} bytes of device memory"
        st.wait(range(8))
        assert [ok for _, ok in st.poll()] == [True] * 8, "a job failed"
        return {}


def check(device: str) -> dict[str, Any]:
    """Every check, each reported on its own (one failing does not stop the next)."""
    checks: dict[str, Callable[[], dict[str, Any]]] = {
        "round_trip_pinned": lambda: _round_trip(device, True),
        "round_trip_unpinned": lambda: _round_trip(device, False),
    }
    if device == "cuda":  # torch.cuda._sleep keeps the compute stream busy; XPU has no such op
        checks["load_does_not_wait_for_later_compute"] = lambda: _overlap(device)
        checks["jobs_in_flight_hold_no_device_memory"] = lambda: _no_device_memory(device)
    out: dict[str, Any] = {}
    for name, fn in checks.items():
        t0 = time.perf_counter()
        try:
            out[name] = {"ok": True, **fn()}
        except Exception as exc:
            out[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                         "tail": traceback.format_exc()[-1200:]}
        out[name]["seconds"] = round(time.perf_counter() - t0, 2)
    out["status"] = "ok" if all(v["ok"] for v in out.values()) else "failed"
    return out

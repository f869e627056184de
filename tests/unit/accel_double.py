"""A controlled accelerator for CI: streams and events whose completion the test drives.

``FakeDevice`` implements ``kvstrata.tiers.device.CopyDevice`` (and the ``torch.cuda`` names
``Stream``/``Event``/``current_stream``/``stream`` an earlier ``StreamStager`` used), over CPU
tensors standing in for device memory. Like a real device:

* work queued on a stream runs later, in stream order, when the test runs that stream
  (``run``); streams are independent, so jobs of different streams complete in any order the
  test picks; a ``wait_event`` blocks its stream until the event's latest record (at the time of
  the wait) has run;
* a copy reads its descriptors and its source bytes when it runs, not when it was queued (a
  descriptor buffer reused too early copies the wrong bytes), and every address it touches must
  lie in memory the test registered (``memory``), else the copy raises ``DeviceFault``;
* ``Event.synchronize`` is the only host wait: it runs every stream until the event completes
  and is counted (``host_syncs``) on the engine (main) thread; a copy thread's wait (pacing its
  calls) lets the device run on by itself and is counted in ``paced_waits``;
* a copy from or to unpinned host memory (``host_pinned=False``) blocks its caller on a real
  device: the double counts such calls made on the engine (main) thread
  (``engine_thread_blocks``), and every copy call made there (``engine_thread_copies``);
  ``call_sizes`` lists the descriptors of each call, ``most_calls_queued`` the most calls
  pending on one stream;
* ``fail_next_copy = k`` makes the next ``copy_batch`` queue only its first ``k`` copies and then
  raise, as a driver error after part of a job was issued; ``fail_query`` makes events' ``query``
  and ``synchronize`` raise (a device error).

The stager issues jobs from copy threads: ``before_run`` (set to ``StreamStager.wait_issued``)
runs before the test runs streams, so the jobs submitted so far are queued first.

Test-side work on the compute stream (a forward writing blocks, sampling) is queued with
``kernel``. ``created_streams`` lists the streams the code under test created, in order.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


class DeviceFault(AssertionError):
    """A copy touched memory outside the registered ranges."""


class _Mark:
    """One record of an event: done once the stream reached it."""

    def __init__(self) -> None:
        self.done = False


class FakeEvent:
    def __init__(self, dev: FakeDevice) -> None:
        self.dev = dev
        self.mark: _Mark | None = None

    def record(self, stream: FakeStream | None = None) -> None:
        stream = stream or self.dev.current_stream()
        with self.dev.lock:
            self.mark = _Mark()
            stream.ops.append(("record", self.mark))

    def query(self) -> bool:
        if self.dev.fail_query:
            raise RuntimeError("fake device error")
        return self.mark is None or self.mark.done

    def synchronize(self) -> None:
        if self.dev.fail_query:
            raise RuntimeError("fake device error")
        if threading.current_thread() is not threading.main_thread():
            # A copy thread pacing its calls: the device runs on while it sleeps.
            with self.dev.lock:
                self.dev.paced_waits += 1
                self.dev.run_streams()
            assert self.query(), "event never completes (its stream waits on work never queued)"
            return
        if self.dev.before_run is not None:
            self.dev.before_run()  # outside the lock: the jobs being issued need it
        with self.dev.lock:
            self.dev.host_syncs += 1
            self.dev.run()
            assert self.query(), "event never completes (its stream waits on work never queued)"


class FakeStream:
    def __init__(self, dev: FakeDevice, name: str) -> None:
        self.dev = dev
        self.name = name
        self.ops: deque[tuple[str, Any]] = deque()

    def wait_event(self, event: FakeEvent) -> None:
        with self.dev.lock:
            if event.mark is not None:
                self.ops.append(("wait", event.mark))

    def wait_stream(self, other: FakeStream) -> None:
        event = FakeEvent(self.dev)
        event.record(other)
        self.wait_event(event)

    def waits(self) -> int:
        """Waits queued on this stream and not yet run."""
        return sum(1 for kind, _ in self.ops if kind == "wait")

    def step(self) -> bool:
        """Run the op at the head if it can run now."""
        kind, arg = self.ops[0]
        if kind == "wait" and not arg.done:
            return False
        self.ops.popleft()
        if kind == "record":
            arg.done = True
        elif kind == "kernel":
            arg()
        elif kind == "copy":
            self.dev.execute_copy(*arg)
        return True


@dataclass
class _Range:
    start: int
    end: int


class FakeDevice:
    """See the module docstring. ``device_memory``/``host_memory``: the tensors copies may touch
    (the KV allocation, the slab)."""

    kind = "fake"

    def __init__(
        self,
        device_memory: list[torch.Tensor],
        host_memory: list[torch.Tensor],
        *,
        host_pinned: bool = True,
    ) -> None:
        self.lock = threading.RLock()
        self.compute = FakeStream(self, "compute")
        self.created_streams: list[FakeStream] = []
        self._local = threading.local()
        self.memory = [self._range(t) for t in [*device_memory, *host_memory]]
        self.host_pinned = host_pinned
        self.fail_next_copy: int | None = None
        self.fail_query = False
        self.host_syncs = 0
        self.engine_thread_blocks = 0  # copies from pageable memory issued on the engine thread
        self.engine_thread_copies = 0  # copy ops called on the engine thread at all
        self.copies_run = 0
        self.bytes_copied = 0
        self.descriptor_buffers_made = 0
        self.call_sizes: list[int] = []  # descriptors per copy_batch call
        self.most_calls_queued = 0  # copy calls pending on one stream, at most
        self.paced_waits = 0  # event waits of copy threads keeping calls ahead of the device
        self.blocking_events_made = 0
        # Called before the test runs streams: the stager issues jobs from its copy threads, so
        # a test waits for them to be queued (``StreamStager.wait_issued``) before running them.
        self.before_run: Callable[[], None] | None = None

    @staticmethod
    def _range(t: torch.Tensor) -> _Range:
        start = t.untyped_storage().data_ptr()
        return _Range(start, start + t.untyped_storage().nbytes())

    # ---- CopyDevice --------------------------------------------------------------------------

    def new_stream(self) -> FakeStream:
        stream = FakeStream(self, f"s{len(self.created_streams)}")
        self.created_streams.append(stream)
        return stream

    def new_event(self, blocking: bool = False) -> FakeEvent:
        self.blocking_events_made += blocking
        return FakeEvent(self)

    def current_stream(self, device: Any = None) -> FakeStream:
        return getattr(self._local, "stream", None) or self.compute

    @contextlib.contextmanager
    def use_stream(self, stream: FakeStream) -> Iterator[FakeStream]:
        before = getattr(self._local, "stream", None)
        self._local.stream = stream
        try:
            yield stream
        finally:
            self._local.stream = before

    def descriptor_buffer(self, n: int) -> torch.Tensor:
        self.descriptor_buffers_made += 1
        return torch.from_numpy(np.zeros(n, np.int64))

    def copy_batch(
        self, src: torch.Tensor, dst: torch.Tensor, sizes: torch.Tensor, *, src_order_any: bool
    ) -> None:
        with self.lock:
            stream = self.current_stream()
            assert stream is not self.compute, "copies must run on a dedicated stream"
            self.call_sizes.append(len(sizes))
            queued = 1 + sum(op[0] == "copy" for op in stream.ops)
            self.most_calls_queued = max(self.most_calls_queued, queued)
            n = len(sizes)
            if threading.current_thread() is threading.main_thread():
                self.engine_thread_copies += 1
                if not self.host_pinned:
                    self.engine_thread_blocks += 1
            fail, self.fail_next_copy = self.fail_next_copy, None
            stream.ops.append(("copy", (src, dst, sizes, n if fail is None else fail)))
            if fail is not None:
                raise RuntimeError("injected copy failure after part of the job was queued")

    # torch.cuda's names, so code written against that module runs on the double too.
    Stream = property(lambda self: lambda device=None: self.new_stream())
    Event = property(lambda self: lambda *a, **k: self.new_event())

    def stream(self, s: FakeStream) -> contextlib.AbstractContextManager[FakeStream]:
        return self.use_stream(s)

    # ---- test control ------------------------------------------------------------------------

    def kernel(self, fn: Callable[[], None], stream: FakeStream | None = None) -> None:
        """Queue test work (a forward writing blocks, sampling) on ``stream`` (compute)."""
        with self.lock:
            (stream or self.compute).ops.append(("kernel", fn))

    def run(self, *streams: FakeStream, ops: int | None = None) -> int:
        """Run ``streams`` (default: all) until none can progress, or ``ops`` ops; returns the
        ops run."""
        if self.before_run is not None:
            self.before_run()
        return self.run_streams(*streams, ops=ops)

    def run_streams(self, *streams: FakeStream, ops: int | None = None) -> int:
        """``run`` without waiting for jobs still being issued (what the device does on its own
        while a copy thread waits for it)."""
        with self.lock:
            chosen = list(streams) or [self.compute, *self.created_streams]
            done = 0
            progress = True
            while progress and (ops is None or done < ops):
                progress = False
                for s in chosen:
                    if s.ops and (ops is None or done < ops) and s.step():
                        done += 1
                        progress = True
            return done

    def idle(self) -> bool:
        if self.before_run is not None:
            self.before_run()
        return not any(s.ops for s in [self.compute, *self.created_streams])

    # ---- copies ------------------------------------------------------------------------------

    def _inside(self, ranges: list[_Range], ptr: int, size: int) -> bool:
        return any(r.start <= ptr and ptr + size <= r.end for r in ranges)

    def execute_copy(self, src: torch.Tensor, dst: torch.Tensor, sizes: torch.Tensor, n: int) -> None:
        # Descriptors are read now, when the copy runs (see the module docstring).
        for a, b, size in list(zip(src.tolist(), dst.tolist(), sizes.tolist(), strict=True))[:n]:
            if not (self._inside(self.memory, a, size) and self._inside(self.memory, b, size)):
                raise DeviceFault(f"copy {a:#x} -> {b:#x} ({size} bytes) outside registered memory")
            ctypes.memmove(b, a, size)
            self.copies_run += 1
            self.bytes_copied += size

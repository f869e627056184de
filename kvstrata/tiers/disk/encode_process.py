"""A disk encode process (``disk/encoders.py``): maps the host slab and the frame slab, then
frames each batch of chunks its parent sends into the frame slot it names, answering each
chunk's place and MAC as it is framed, until its pipe closes (the parent closed the pool or
died). Run as ``python -m kvstrata.tiers.disk.encode_process FD``, FD one end of a socket
pair."""

from __future__ import annotations

import sys
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from kvstrata.tiers.disk.children import Handler, serve


def start(setup: dict[str, Any]) -> tuple[Handler, Callable[[], None]]:
    """Map both slabs; the handler of a batch of chunks to frame, and the close."""
    from kvstrata.tiers import codec
    from kvstrata.tiers.disk.encoders import ALIGN
    from kvstrata.tiers.host.slab import HostSlab
    from kvstrata.tiers.priority import lower_this_thread, name_this_thread

    if setup["idle"]:  # the write threads it works for yield to serving (tiers/priority.py)
        lower_this_thread()
    name_this_thread("kvs-encode")
    auth = setup["auth"]
    level, mode = setup["level"], setup["mode"]
    slab = HostSlab(setup["slab_path"], setup["slot_bytes"], setup["num_slots"], create=False)
    try:
        frames = HostSlab(setup["frames_path"], setup["frame_slot_bytes"], setup["frame_slots"], create=False)
    except BaseException:
        slab.close()
        raise
    room = frames.slot_bytes

    def handle(job: tuple[int, list[tuple[bytes, int, int, int, str]]], send: Callable[[Any], None]) -> None:
        frame_slot, items = job
        at = 0
        for key, slot, offset, length, dtype in items:
            try:
                frame = codec.encode(slab.view(slot, offset, length), dtype, key=key, level=level, mode=mode)
            except Exception as exc:  # noqa: BLE001 - the parent frames it itself and says why
                send(("error", f"{type(exc).__name__}: {exc}"))
                continue
            n = len(frame)
            if at + n > room:
                send(("room", n))
                continue
            frames.view(frame_slot, at, n)[:] = frame
            send(("ok", at, n, b"" if auth is None else auth.tag(key, frame)))
            at += -(-n // ALIGN) * ALIGN

    def close() -> None:
        frames.close()
        slab.close()

    return handle, close


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])), start)

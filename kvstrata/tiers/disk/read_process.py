"""A disk read process (``disk/readers.py``): opens the store read-only and the host slab, then
reads each batch its parent sends into the slab, answering each chunk as it lands, until its
pipe closes (the parent closed the pool or died). Run as ``python -m
kvstrata.tiers.disk.read_process FD``, FD one end of a socket pair."""

from __future__ import annotations

import signal
import sys
from multiprocessing.connection import Connection


def serve(conn: Connection) -> None:
    """The child: open the store read-only and the slab, then read batches until the pipe closes."""
    from kvstrata.tiers.disk.store import DiskStore
    from kvstrata.tiers.host.slab import HostSlab

    # Stopped by its pipe closing, not by the terminal's Ctrl-C (the engine handles that).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    setup = conn.recv()
    try:
        store = DiskStore(setup["store_path"], budget_bytes=1, readonly=True, create=False,
                          map_size=setup["map_size"], auth=setup["auth"])
        slab = HostSlab(setup["slab_path"], setup["slot_bytes"], setup["num_slots"], create=False)
    except Exception as exc:  # told to the parent, which fails the pool with it
        conn.send(f"{type(exc).__name__}: {exc}")
        return
    conn.send("ready")
    try:
        while True:
            items = conn.recv()
            for key, slot, offset, length in items:
                conn.send(store.read_outcome(key, slab.view(slot, offset, length)))
    except (EOFError, OSError):  # the pipe closed: the parent closed the pool or died
        return
    finally:
        slab.close()
        store.close()


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])))

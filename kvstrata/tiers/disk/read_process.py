"""A disk read process (``disk/readers.py``): opens the store read-only and the host slab, then
reads each batch its parent sends into the slab, answering each chunk as it lands, until its
pipe closes (the parent closed the pool or died). Run as ``python -m
kvstrata.tiers.disk.read_process FD``, FD one end of a socket pair."""

from __future__ import annotations

import sys
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from kvstrata.tiers.disk.children import Handler, serve


def start(setup: dict[str, Any]) -> tuple[Handler, Callable[[], None]]:
    """Open the store read-only and the slab; the handler of a batch of reads, and the close."""
    from kvstrata.tiers.disk.store import DiskStore
    from kvstrata.tiers.host.slab import HostSlab

    store = DiskStore(setup["store_path"], budget_bytes=1, readonly=True, create=False,
                      map_size=setup["map_size"], auth=setup["auth"])
    try:
        slab = HostSlab(setup["slab_path"], setup["slot_bytes"], setup["num_slots"], create=False)
    except BaseException:
        store.close()
        raise

    def handle(items: list[tuple[bytes, int, int, int]], send: Callable[[Any], None]) -> None:
        for key, slot, offset, length in items:
            send(store.read_outcome(key, slab.view(slot, offset, length)))

    def close() -> None:
        slab.close()
        store.close()

    return handle, close


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])), start)

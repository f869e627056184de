"""Host tier: one shared slab of fixed-size chunk slots and the index that hands them out.

``slab`` holds the memory: ``HostSlab``, a file-backed shared mmap that the scheduler process and
the worker processes map at the same time, its landing board's ``board_fence``, and
``sweep_stale_slabs`` for slabs whose engines died. ``pool`` holds ``HostPool``, the
scheduler-side index over the slab's slots (key -> slot, reference counts, eviction), and
``policy`` its replacement policies (LRU, ARC).
"""

from kvstrata.tiers.host.pool import HostPool
from kvstrata.tiers.host.slab import (
    PAGE,
    HostSlab,
    board_fence,
    default_slab_path,
    sweep_stale_slabs,
)

__all__ = [
    "PAGE",
    "HostPool",
    "HostSlab",
    "board_fence",
    "default_slab_path",
    "sweep_stale_slabs",
]

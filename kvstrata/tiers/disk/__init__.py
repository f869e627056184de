"""The disk tier: a compressed, checksummed, crash-aware LMDB store of KV chunks.

``DiskStore`` (``store``) is the façade; ``env`` opens a store directory and runs transactions,
``writer`` owns every write (``write_jobs``: what it is handed; ``putter``: what a transaction
of puts does; ``ticks``: access ticks; ``syncer``: durability), ``recovery`` verifies a store
after an unclean shutdown, ``damage`` handles what reads find damaged, ``views`` shows the store
without changing it (index, scans, page census, namespaces, totals); ``slab_processes`` keeps
the child processes that read into and frame (and put) out of the host slab. What one
transaction reads and writes is the record layer, ``kvstrata.tiers.records``.
"""

from kvstrata.tiers.codec import CorruptRecord
from kvstrata.tiers.disk.env import StoreFormatError, StoreUnavailableError
from kvstrata.tiers.disk.store import DiskStore
from kvstrata.tiers.records import FORMAT_VERSION, IndexRecord

__all__ = [
    "FORMAT_VERSION",
    "CorruptRecord",
    "DiskStore",
    "IndexRecord",
    "StoreFormatError",
    "StoreUnavailableError",
]

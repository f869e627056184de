"""Keeping a store inside its budget, sound and portable.

* ``policy``: the retention policy (byte budget, least recently used by access tick, optional
  maximum age), the one implementation behind both the disk tier's online eviction and
  ``kvstrata compact``;
* ``evict``: applying it to an open store; ``rewrite``: the compacting copy that gives freed
  LMDB pages back to the file system, under an exclusive lock;
* ``checks``, ``archive``: record soundness and the portable archive format;
* ``storeaccess``, ``toolsupport``: what the store tools share.

Importing this package imports only ``policy`` (stdlib only): ``kvstrata.tiers.disk`` imports it.
"""

from kvstrata.compaction.policy import RetentionPolicy, select_lru_victims, select_victims

__all__ = ["RetentionPolicy", "select_lru_victims", "select_victims"]

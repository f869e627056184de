"""Keeping a store inside its budget and portable.

* ``evict``: applying the retention policy (``kvstrata.tiers.retention``: byte budget, least
  recently used by access tick, optional maximum age, the rule the disk tier also evicts by) to
  an open store;
* ``rewrite``: the compacting copy that gives freed LMDB pages back to the file system, under an
  exclusive lock;
* ``archive``: the portable archive format of ``kvstrata export`` / ``import``.

Records are read, checked and changed through the record layer, ``kvstrata.tiers.records``.
"""

"""Fixtures of tests/unit: ``env``, the factory of host slabs, disk stores and hierarchies the
Hierarchy tests (test_hierarchy_*.py) build on."""

from __future__ import annotations

import pytest
from hierarchy_helpers import DTYPES, GROUP_BYTES, NS, SHARD

from kvstrata.tiers.disk import DiskStore
from kvstrata.tiers.hierarchy import Hierarchy
from kvstrata.tiers.host import HostPool, HostSlab


@pytest.fixture
def env(tmp_path):
    """Factory for slabs, stores and hierarchies; closes everything it made."""
    made: list = []

    class Env:
        db_path = tmp_path / "db"

        def slab(self, slots: int = 16) -> HostSlab:
            s = HostSlab(tmp_path / f"slab{len(made)}", SHARD * len(NS), slots)
            made.append(s)
            return s

        def disk(self) -> DiskStore:
            d = DiskStore(self.db_path, budget_bytes=1 << 30)
            made.append(d)
            return d

        def hier(self, disk, slots: int = 16, policy: str = "lru", **kw) -> Hierarchy:
            slab = self.slab(slots)
            h = Hierarchy(
                HostPool(slab, policy),
                disk,
                namespaces=NS,
                group_shard_bytes=GROUP_BYTES,
                group_dtypes=DTYPES,
                **kw,
            )
            made.append(h)
            return h

    yield Env()
    for obj in reversed(made):
        obj.close()

"""The tier hierarchy: host slots over lower tiers (``hierarchy.Hierarchy``), and its parts:
``shared`` (the lock, chunk states, tier links, the I/O pipeline), ``write_behind``,
``promoter`` and ``background`` (warm start, disk announcement)."""

from kvstrata.tiers.hierarchy.hierarchy import Hierarchy
from kvstrata.tiers.hierarchy.shared import TIER_HOST, TierLink, chunk_group

TIER_DISK = "disk"  # DiskStore's tier name

__all__ = ["TIER_DISK", "TIER_HOST", "Hierarchy", "TierLink", "chunk_group"]

"""The tier hierarchy: host slots over lower tiers (``hierarchy.Hierarchy``), and its parts:
``shared`` (the lock, chunk states, tier links, the I/O pipeline), ``lookup``, ``pins`` (the
host slots of stores, loads and waiting requests' holds), ``write_behind``, ``promoter`` and
``background`` (warm start, disk announcement)."""

from kvstrata.tiers.hierarchy.hierarchy import Hierarchy
from kvstrata.tiers.hierarchy.shared import (
    DEFAULT_WRITE_INFLIGHT_BYTES,
    TIER_HOST,
    PromotionBudget,
    TierLink,
    chunk_group,
)

TIER_DISK = "disk"  # DiskStore's tier name
TIER_REMOTE = "remote"  # RemoteStore's tier name

__all__ = ["DEFAULT_WRITE_INFLIGHT_BYTES", "TIER_DISK", "TIER_HOST", "TIER_REMOTE", "Hierarchy", "PromotionBudget", "TierLink", "chunk_group"]

"""The shared tier on Redis / Valkey (``RemoteStore``); see ``store``."""

from kvstrata.remote_address import RemoteAddress, RemoteURLError, parse_remote_url
from kvstrata.tiers.remote.store import KEY_PREFIX, RemoteStore, remote_key

__all__ = ["KEY_PREFIX", "RemoteAddress", "RemoteStore", "RemoteURLError", "parse_remote_url", "remote_key"]

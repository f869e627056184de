"""kvstrata's vLLM KV connector.

Load it with ``kv_connector="StrataConnector"``, ``kv_connector_module_path="kvstrata.connector"``.
Importing this package imports vLLM; the pure semantics live in ``kvstrata.connector.semantics``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["StrataConnector"]


def __getattr__(name: str) -> Any:
    # Lazy: ``kvstrata.connector.semantics`` and ``.config`` must stay importable without vLLM.
    if name == "StrataConnector":
        from kvstrata.connector.connector import StrataConnector

        return StrataConnector
    raise AttributeError(name)

"""kvstrata's vLLM KV connector.

Load it with ``kv_connector="StrataConnector"``, ``kv_connector_module_path="kvstrata.connector"``.
Importing this package imports vLLM; what must stay importable without it lives outside it (the
semantics in ``kvstrata.semantics``, the options in ``kvstrata.config``).
"""

from kvstrata.connector.connector import StrataConnector

__all__ = ["StrataConnector"]

"""Shared test set-up: make the integration harness and the repository's ``benchmarks`` package
importable (it is not installed with kvstrata), and register markers."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "integration"))
sys.path.insert(0, str(Path(__file__).parent))  # redis_server.py
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

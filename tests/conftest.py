"""Shared test set-up: make the integration harness importable and register markers."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "integration"))

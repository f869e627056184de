"""What the benchmark scripts share about their environment.

They are not part of the installed ``kvstrata`` package: they import as ``benchmarks.*`` from the
repository root. The processes they start (vLLM engine subprocesses, the processes vLLM spawns,
the profiler's child) import some of them by name too (``spec_module_path``, ``python -m``), so
:func:`export_repo_root` puts the repository root on ``PYTHONPATH`` for every child.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def export_repo_root() -> None:
    """Make ``benchmarks.*`` importable in every process started from this one from now on."""
    root = str(REPO_ROOT)
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([root, *parts])

"""The reliability (torture) tests: counts printed at the end of the run.

``KVSTRATA_RELIABILITY_SOAK=N`` multiplies every trial count (a longer soak);
``KVSTRATA_RELIABILITY_SEED=S`` changes the seeds (each failure names its own seed).
"""

from __future__ import annotations

import pytest
import torture


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not torture.TALLIES:
        return
    terminalreporter.section(
        f"kvstrata reliability (soak x{torture.SOAK}, seed {torture.BASE_SEED})"
    )
    for name, tally in torture.TALLIES.items():
        terminalreporter.write_line(tally.line(name))

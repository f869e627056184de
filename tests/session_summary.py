"""Lines the test session prints at its end, gathered from wherever the tests ran: this process,
or pytest-xdist's workers (each hands its lines to the controller when it finishes)."""

from __future__ import annotations

import pytest

# The equivalence tests' counts (tests/e2e/equivalence.py COUNTS), one line per round.
EQUIVALENCE_COUNTS = pytest.StashKey[list[str]]()
WORKER_OUTPUT_KEY = "kvstrata_equivalence_counts"
TITLE = "kvstrata: served vs recomputed (first-token logprobs, greedy tokens)"


def add(config: pytest.Config, lines: list[str]) -> None:
    config.stash.setdefault(EQUIVALENCE_COUNTS, []).extend(lines)


def write(config: pytest.Config, reporter: pytest.TerminalReporter) -> None:
    lines = config.stash.get(EQUIVALENCE_COUNTS, [])
    if lines:
        reporter.section(TITLE)
        for line in lines:
            reporter.write_line(line)

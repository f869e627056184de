"""End-to-end fixtures: each model's scenario (its engine processes) runs once per session, for
every test module that asks for it; the equivalence counts are printed at the end."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from e2e_harness import CASES, Scenario
from equivalence import COUNTS


@pytest.fixture(scope="session")
def scenarios(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Scenario]:
    made: dict[str, Scenario] = {}

    def get(name: str) -> Scenario:
        if name not in made:
            made[name] = Scenario(CASES[name], tmp_path_factory.mktemp(name))
        return made[name]

    return get


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if COUNTS:
        terminalreporter.section("kvstrata: served vs recomputed (first-token logprobs, greedy tokens)")
        for line in COUNTS:
            terminalreporter.write_line(line)

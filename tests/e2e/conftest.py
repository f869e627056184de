"""End-to-end fixtures: each model's scenario (its engine processes) runs once per session; the
equivalence counts are printed at the end.

Under pytest-xdist (scripts/test.sh runs a worker per core, ``--dist loadfile``) a session is one
worker's and a module runs on one worker: the tests of the scenarios all live in
test_equivalence.py, so no scenario runs twice. Each worker hands its counts to the controller,
which prints them (tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from e2e_harness import CASES, Scenario
from equivalence import COUNTS
from session_summary import WORKER_OUTPUT_KEY, add

SCENARIO_MODULE = "test_equivalence.py"


@pytest.fixture(scope="session")
def scenarios(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Scenario]:
    made: dict[str, Scenario] = {}

    def get(name: str) -> Scenario:
        if name not in made:
            made[name] = Scenario(CASES[name], tmp_path_factory.mktemp(name))
        return made[name]

    return get


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # A scenario's test elsewhere would run the scenario's engines again on another worker.
    for item in items:
        if "scenarios" in getattr(item, "fixturenames", ()) and Path(item.path).name != SCENARIO_MODULE:
            raise pytest.UsageError(f"{item.nodeid}: the tests of the scenarios live in "
                                    f"tests/e2e/{SCENARIO_MODULE} (one module: one xdist worker)")


def pytest_sessionfinish(session: pytest.Session) -> None:
    # A worker's counts travel to the controller (tests/conftest.py prints them); without
    # workers this session prints its own.
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput[WORKER_OUTPUT_KEY] = list(COUNTS)
    else:
        add(session.config, COUNTS)

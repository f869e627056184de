"""Fixtures of the connector tests under vLLM 0.32.0's real Scheduler
(test_connector_scheduler_*.py here): the model directory, and ``runners``, which makes harness
Runners under vLLM's plain Scheduler, its AsyncScheduler, and the accelerator double.

These live in this directory's conftest rather than tests/integration's: test_sync_loads.py and
test_connector_security.py there define fixtures of the same names (``runners`` another one)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from strata_harness import G, Runner, write_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("model"))


# Every scenario under vLLM's plain Scheduler and under its AsyncScheduler (the default on GPUs:
# each step is planned before the previous step's output is seen).
# "accel": the async scheduler with the workers on the accelerator double (StreamStager: stores
# deferred to the next step, loads completed by event).
@pytest.fixture(params=["sched", "async-sched", "accel"])
def runners(model_dir: Path, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator:
    made: list[Runner] = []

    def make(groups: list[G], store: Path | None = None, **kw) -> Runner:
        kw.setdefault("async_scheduling", request.param != "sched")
        kw.setdefault("accel", make.accel)
        r = Runner(groups, model_dir, store or tmp_path / "store", **kw)
        made.append(r)
        return r

    make.accel = request.param == "accel"  # type: ignore[attr-defined]
    yield make
    for r in made:
        r.close()

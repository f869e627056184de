#!/usr/bin/env bash
# The test command: creates the environment if needed, lints and type-checks, then runs the whole
# suite (unit, integration against vLLM's real Scheduler, end-to-end on a real vLLM engine on CPU).
# Extra arguments go to pytest, e.g. `scripts/test.sh -m "not slow"` for the fast tests only.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/env.sh
.venv/bin/ruff check kvstrata tests benchmarks
.venv/bin/mypy  # kvstrata/, configured in pyproject.toml
# One worker per core, at most 4 (pytest-xdist): an engine test keeps about one core busy. A
# module runs on one worker, so its fixtures (engines, a store, a Redis server) are set up once.
# The slowest tests are listed at the end: the suite must stay under 20 minutes on 2 cores.
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 \
  --numprocesses auto --maxprocesses 4 --dist loadfile "$@"

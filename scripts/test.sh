#!/usr/bin/env bash
# The test command: creates the environment if needed, lints, then runs the whole suite
# (unit, integration against vLLM's real Scheduler, end-to-end on a real vLLM engine on CPU).
# Extra arguments go to pytest, e.g. `scripts/test.sh -m "not slow"` for the fast tests only.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/env.sh
# The shared tier's tests run real Redis servers (tests/redis_server.py): the Debian package,
# installed here when missing (CI runs as root on a fresh machine).
if ! command -v redis-server >/dev/null 2>&1 && ! command -v valkey-server >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "kvstrata: installing redis-server for the shared tier's tests" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q --no-install-recommends redis-server >/dev/null 2>&1 ||
      { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends redis-server >/dev/null; }
  else
    echo "kvstrata: redis-server is missing and this is not root: install it (apt-get install" \
         "redis-server) or the shared tier's tests fail" >&2
  fi
fi
.venv/bin/ruff check kvstrata tests benchmarks
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"

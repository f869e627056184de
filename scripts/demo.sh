#!/usr/bin/env bash
# The main job: creates the environment if needed, then runs `kvstrata demo` (a real vLLM engine
# with kvstrata, cold -> host tier -> process restart -> disk tier, on the embedded default store).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/env.sh
exec .venv/bin/kvstrata demo "$@"

#!/usr/bin/env bash
# Set up, build the tiny policy if it is missing, and run the default asynchronous RL job on CPU.
# Extra arguments go to `asyncrl train` (e.g. --rollout.max_staleness 0).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh none
. .venv/bin/activate
exec asyncrl train --run.overwrite true "$@"

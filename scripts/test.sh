#!/usr/bin/env bash
# Set up, lint (ruff, line length 110) and run the tests (unit tests + short real end-to-end runs).
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python -m ruff check .
exec python -m pytest -q -ra --durations=10 "$@"

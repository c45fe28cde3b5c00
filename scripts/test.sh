#!/usr/bin/env bash
# Set up, lint (ruff, line length 110) and run the tests (unit tests + short real end-to-end runs).
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# the dashboard's browser test (tests/test_dashboard.py): Chromium and its driver from the distribution
if ! command -v chromedriver >/dev/null && command -v apt-get >/dev/null; then
  echo "test: installing chromium and chromium-driver (apt) ..."
  sudo=$([ "$(id -u)" = 0 ] || echo sudo)
  install="$sudo apt-get install -y -q --no-install-recommends chromium chromium-driver"
  $install >/dev/null 2>&1 || { $sudo apt-get update -q >/dev/null 2>&1 && $install >/dev/null 2>&1; } \
    || echo "test: could not install chromium: the browser test will be skipped"
fi
. .venv/bin/activate
python -m ruff check .
# two workers (pytest-xdist): the end-to-end tests wait on processes, ports and deadlines much of their time;
# the tiny policies are built once for both (tests/conftest.py). loadgroup's scheduler (no test is grouped):
# from fresh clones pytest took 17 min 36 s and 18 min 6 s with it, 18 min 40 s with xdist's default
exec python -m pytest -q -ra --durations=10 -n 2 --dist loadgroup "$@"

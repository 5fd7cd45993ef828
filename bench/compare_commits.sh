#!/usr/bin/env bash
# One commit of jaxtrain against another: start-up, report() and recovery, interleaved.
#
#   bench/compare_commits.sh [A [B]] [--repeats 3] [--workers 4] [--short] [--keep] [--help]
#
# A (old) defaults to HEAD's merge base with main (HEAD~1 on main), B (new) to HEAD. Builds each
# commit in build/compare/<short sha>/ with a copy of this checkout's .venv (reused for the same
# commit), runs bench/compare_trial.py's step and failure trials old, new, old, new, and prints
# new/old per figure with its spread and a verdict (bench/compare_commits.py; bench/README.md).
# Exits 0 when everything ran, whatever the ratios; 1 when a build or a trial failed.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [[ ! -x $root/.venv/bin/python ]]; then
  echo "compare_commits: $root/.venv/bin/python is missing: make the checkout's .venv first" \
    "(scripts/setup.sh); every build starts from a copy of it" >&2
  exit 1
fi
exec "$root/.venv/bin/python" "$root/bench/compare_commits.py" "$@"

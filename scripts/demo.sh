#!/usr/bin/env bash
# Sets everything up, then runs the seed's linear-regression program on 4 worker processes.
# Its ScalingConfig asks for a v6e 4x4 TPU slice; JAXTRAIN_SIMULATE=1 runs those 4 workers as
# local CPU processes with a real jax.distributed job between them.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export JAXTRAIN_SIMULATE=1
exec .venv/bin/python examples/linear_regression.py

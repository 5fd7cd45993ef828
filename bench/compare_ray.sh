#!/usr/bin/env bash
# jaxtrain against Ray Train V2 and bare processes, plus the controller's scale simulation.
#
#   bench/compare_ray.sh [options of bench/compare_ray.py]     # from the repository root
#
# Needs the project's .venv (scripts/setup.sh), where jaxtrain is installed. Makes, once,
# bench/.venv-ray with Ray from PyPI (bench/requirements-ray.txt; never a dependency of jaxtrain),
# builds the scale benchmark in build/bench, then runs bench/compare_ray.py in bench/.venv-ray.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=bench/.venv-ray
stamp="$venv/.requirements"
if ! cmp -s bench/requirements-ray.txt "$stamp" 2>/dev/null; then
  echo "compare_ray: installing bench/requirements-ray.txt into $venv" >&2
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q -r bench/requirements-ray.txt
  cp bench/requirements-ray.txt "$stamp"
fi

if [[ " $* " != *" --skip-scale "* ]]; then
  echo "compare_ray: building build/bench/bench/scale_controller" >&2
  cmake -S . -B build/bench -G Ninja -DCMAKE_BUILD_TYPE=Release -DJAXTRAIN_BUILD_BENCH=ON > /dev/null
  ninja --quiet -C build/bench scale_controller  # the compiler's errors show, not its progress
fi

exec "$venv/bin/python" bench/compare_ray.py "$@"

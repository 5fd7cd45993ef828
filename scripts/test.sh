#!/usr/bin/env bash
# Sets everything up, then runs every test: lint, the C++ unit tests under AddressSanitizer and
# UndefinedBehaviorSanitizer (CTest), a short fuzz run of the control protocol (libFuzzer), and the
# Python and end-to-end tests with real JAX workers (pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh

echo "test: lint"
clang-format --dry-run -Werror $(git ls-files 'src/*.cc' 'src/*.h')
# examples/ hold the seed's programs verbatim (imports aside), so they are not linted.
.venv/bin/ruff check python tests bench

echo "test: C++ unit tests (ASan + UBSan)"
cmake -S . -B build/test-sanitize -G Ninja -DCMAKE_BUILD_TYPE=Debug \
  -DJAXTRAIN_BUILD_TESTS=ON -DJAXTRAIN_SANITIZE=ON >/dev/null
ninja -C build/test-sanitize
ctest --test-dir build/test-sanitize --output-on-failure -j2

echo "test: fuzz the control protocol (short run; scripts/fuzz.sh 600 for a long one)"
./scripts/fuzz.sh

echo "test: Python and end-to-end tests"
.venv/bin/python -m pytest tests

#!/usr/bin/env bash
# Sets everything up, then runs every test: lint, the C++ unit tests under AddressSanitizer and
# UndefinedBehaviorSanitizer, then under ThreadSanitizer (CTest), a short fuzz run of the control
# protocol (libFuzzer), and the Python and end-to-end tests with real JAX workers (pytest), on real Slurm and Kubernetes clusters
# that the tests start on this machine.
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

echo "test: C++ unit tests (TSan: any data race fails its test)"
cmake -S . -B build/test-tsan -G Ninja -DCMAKE_BUILD_TYPE=Debug \
  -DJAXTRAIN_BUILD_TESTS=ON -DJAXTRAIN_SANITIZE_THREAD=ON >/dev/null
ninja -C build/test-tsan
ctest --test-dir build/test-tsan --output-on-failure -j2

echo "test: fuzz the control protocol and the secure channel (short run; scripts/fuzz.sh 600 for a long one)"
./scripts/fuzz.sh

echo "test: the Kubernetes test cluster's binaries (built from the Go module proxy once per version:"
echo "      about 15 minutes on a fresh 2-core machine, then cached; scripts/kubernetes/build.sh)"
./scripts/kubernetes/build.sh >/dev/null

echo "test: the GCS emulator of the gs:// tests (fake-gcs-server from the Go module proxy: about"
echo "      2 minutes on a fresh 2-core machine, then cached; scripts/stores/fake-gcs-server.sh)"
./scripts/stores/fake-gcs-server.sh >/dev/null

echo "test: Python and end-to-end tests (real Slurm and Kubernetes clusters on this machine)"
export JAXTRAIN_REQUIRE_SLURM=1 JAXTRAIN_REQUIRE_KUBERNETES=1 JAXTRAIN_REQUIRE_GCS=1 JAXTRAIN_REQUIRE_SSH=1 \
       JAXTRAIN_REQUIRE_PROMETHEUS=1 JAXTRAIN_REQUIRE_BROWSER=1
.venv/bin/python -m pytest tests

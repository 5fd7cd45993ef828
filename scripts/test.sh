#!/usr/bin/env bash
# Sets everything up, then runs every test: lint, the C++ unit tests under AddressSanitizer and
# UndefinedBehaviorSanitizer, then under ThreadSanitizer (CTest), a short fuzz run of the control
# protocol (libFuzzer), and the Python and end-to-end tests with real JAX workers (pytest), on real Slurm and Kubernetes clusters
# that the tests start on this machine.
set -euo pipefail
cd "$(dirname "$0")/.."
# Each stage's time is printed when it ends, and all of them at the end: where a run's time goes.
timings=() stage_name="" stage_start=$SECONDS
stage() {
  [[ -z $stage_name ]] || timings+=("$(printf '%6d s  %s' $((SECONDS - stage_start)) "$stage_name")")
  stage_name=$1 stage_start=$SECONDS
  [[ -z $1 ]] || echo "test: $1"
}
stage "setup"
./scripts/setup.sh

stage "lint"
clang-format --dry-run -Werror $(git ls-files 'src/*.cc' 'src/*.h')
# examples/ hold the seed's programs verbatim (imports aside), so they are not linted.
.venv/bin/ruff check python tests bench

stage "C++ unit tests (ASan + UBSan)"
cmake -S . -B build/test-sanitize -G Ninja -DCMAKE_BUILD_TYPE=Debug \
  -DJAXTRAIN_BUILD_TESTS=ON -DJAXTRAIN_SANITIZE=ON >/dev/null
ninja -C build/test-sanitize
ctest --test-dir build/test-sanitize --output-on-failure -j2

stage "C++ unit tests (TSan: any data race fails its test)"
cmake -S . -B build/test-tsan -G Ninja -DCMAKE_BUILD_TYPE=Debug \
  -DJAXTRAIN_BUILD_TESTS=ON -DJAXTRAIN_SANITIZE_THREAD=ON >/dev/null
ninja -C build/test-tsan
ctest --test-dir build/test-tsan --output-on-failure -j2

stage "fuzz the control protocol and the secure channel"
echo "      (a short run; scripts/fuzz.sh 600 for a long one)"
./scripts/fuzz.sh

stage "the Kubernetes test cluster's binaries"
echo "      (built from the Go module proxy once per version: about 20 minutes on a fresh 2-core machine, Kueue included, then cached; scripts/kubernetes/build.sh)"
./scripts/kubernetes/build.sh >/dev/null

stage "the GCS emulator of the gs:// tests"
echo "      (fake-gcs-server from the Go module proxy: about 2 minutes on a fresh 2-core machine, then cached; scripts/stores/fake-gcs-server.sh)"
./scripts/stores/fake-gcs-server.sh >/dev/null

stage "Python and end-to-end tests (real Slurm and Kubernetes clusters on this machine)"
export JAXTRAIN_REQUIRE_SLURM=1 JAXTRAIN_REQUIRE_KUBERNETES=1 JAXTRAIN_REQUIRE_GCS=1 JAXTRAIN_REQUIRE_SSH=1 \
       JAXTRAIN_REQUIRE_PROMETHEUS=1 JAXTRAIN_REQUIRE_BROWSER=1
# --durations: the slowest tests, so that a suite growing past its time is seen where it grows.
.venv/bin/python -m pytest tests --durations=25
stage ""
echo "test: every stage passed; seconds per stage:"
printf '%s\n' "${timings[@]}"
printf '%6d s  in all\n' "$SECONDS"

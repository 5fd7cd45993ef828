#!/usr/bin/env bash
# Sets everything up, then runs the tests.
#
#   ./scripts/test.sh           every test (CI runs this): lint; the C++ unit tests under
#                               AddressSanitizer and UndefinedBehaviorSanitizer, then under
#                               ThreadSanitizer (CTest); a short fuzz run of the control protocol
#                               (libFuzzer); every benchmark compiled and the cheap ones run briefly;
#                               the Python and end-to-end tests with real JAX workers (pytest), on
#                               real Slurm and Kubernetes clusters, ssh hosts, an S3 server and a
#                               GCS emulator that the tests start on this machine
#   ./scripts/test.sh --quick   the inner loop: lint, the C++ unit tests under ASan/UBSan, and the
#                               Python tests that need no cluster, ssh host or GCS emulator
#
# Every stage runs even when one before it failed (a failed setup aside: nothing runs without
# it); the summary gives each stage's result and time, and the exit status is 1 if any failed.
# C++ objects are cached by ccache across builds and checkouts, so a sanitizer build after a
# small change recompiles only what changed. The Python tests run in two processes side by side:
# the clusters' tests in one, the others in the other (docs/testing.md).
set -uo pipefail
cd "$(dirname "$0")/.."

quick=0
case "${1:-}" in
  "") ;;
  --quick) quick=1 ;;
  -h | --help) sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) echo "test.sh: unknown option '$1' (allowed: --quick, --help)" >&2; exit 2 ;;
esac

summary=() failed=0
# stage NAME COMMAND...: runs COMMAND, and records whether it passed and how long it took.
stage() {
  local name=$1 start=$SECONDS rc
  shift
  echo "test: $name"
  "$@"
  rc=$?
  if ((rc == 0)); then
    summary+=("$(printf '%6d s  passed  %s' $((SECONDS - start)) "$name")")
  else
    summary+=("$(printf '%6d s  FAILED  %s (exit status %d)' $((SECONDS - start)) "$name" "$rc")")
    failed=1
  fi
  return "$rc"
}

finish() {
  echo
  echo "test: seconds per stage:"
  printf '%s\n' "${summary[@]}"
  printf '%6d s  in all\n' "$SECONDS"
  if ((failed)); then
    echo "test: FAILED (the stages marked above)"
    exit 1
  fi
  echo "test: every stage passed"
  exit 0
}

if command -v ccache >/dev/null; then
  # A fresh checkout elsewhere (CI's clone) hits the objects of this one: paths are made relative
  # to the checkout, and the working directory is left out of the debug builds' hashes.
  export CMAKE_CXX_COMPILER_LAUNCHER=ccache CCACHE_BASEDIR=$PWD CCACHE_NOHASHDIR=true
fi

lint() {
  clang-format --dry-run -Werror $(git ls-files 'src/*.cc' 'src/*.h' 'bench/*.cc') &&
    # examples/ hold the seed's programs verbatim (imports aside), so they are not linted.
    .venv/bin/ruff check python tests bench
}

# unit_tests DIR CMAKE_OPTION: the C++ unit tests built in DIR with that sanitizer.
unit_tests() {
  cmake -S . -B "$1" -G Ninja -DCMAKE_BUILD_TYPE=Debug -DJAXTRAIN_BUILD_TESTS=ON "-D$2=ON" \
    >/dev/null &&
    ninja -C "$1" &&
    ctest --test-dir "$1" --output-on-failure -j2
}

# Every benchmark is compiled, so that none rots unseen; the cheap ones run for a few seconds.
benchmarks() {
  cmake -S . -B build/bench -G Ninja -DCMAKE_BUILD_TYPE=Release -DJAXTRAIN_BUILD_BENCH=ON \
    >/dev/null &&
    ninja -C build/bench scale_controller &&
    .venv/bin/python -m py_compile bench/*.py &&
    build/bench/bench/scale_controller --ranks 256,512 --reports 20000 &&
    .venv/bin/python bench/startup_and_report.py --workers 2 --repeats 1 --warmup 0 --reports 500
}

# The full suite's tests in two pytest processes side by side: the tests of the test clusters (in
# one process, which starts each cluster once) and every other test. Their lines are prefixed
# with the process's name; each ends with its own summary and slowest tests. (pytest-xdist cannot
# keep a group of tests on one worker under pytest 9: its loadgroup suffix no longer reaches the
# node ids, so the clusters' tests would be spread over workers that each start the cluster.)
# The pytest stage: three processes side by side, each cluster in one of them only (conftest.py's
# markers): the Kubernetes tests, the ssh hosts' and Slurm's, and everything else. Most of a
# cluster test's time is spent waiting on the cluster, so they overlap well.
pytest_all() {
  local pids=() rc=0 pid
  # --durations: the slowest tests, so that a suite growing past its time is seen where it grows.
  pytest_part "[kubernetes]" "cluster and kubernetes" &
  pids+=($!)
  pytest_part "[hosts]     " "cluster and not kubernetes" &
  pids+=($!)
  pytest_part "[local]     " "not cluster" &
  pids+=($!)
  for pid in "${pids[@]}"; do
    wait "$pid" || rc=1
  done
  return "$rc"
}

pytest_part() {  # PREFIX MARKERS
  .venv/bin/python -m pytest tests -p no:cacheprovider -m "$2" --durations=15 2>&1 |
    sed -u "s/^/$1 /"
  return "${PIPESTATUS[0]}"
}

stage "setup" ./scripts/setup.sh || finish
stage "lint" lint
stage "C++ unit tests (ASan + UBSan)" unit_tests build/test-sanitize JAXTRAIN_SANITIZE

if ((quick)); then
  stage "Python and local end-to-end tests (no clusters)" \
    .venv/bin/python -m pytest tests -p no:cacheprovider -n 2 -m "not cluster and not emulator" \
    --durations=15
  finish
fi

stage "C++ unit tests (TSan: any data race fails its test)" \
  unit_tests build/test-tsan JAXTRAIN_SANITIZE_THREAD
echo "      (a short fuzz run; scripts/fuzz.sh 600 for a long one)"
stage "fuzz the control protocol and the secure channel" ./scripts/fuzz.sh
stage "benchmarks compiled, the cheap ones run" benchmarks

echo "      (built from the Go module proxy once per version: about 20 minutes on a fresh 2-core machine, Kueue included, then cached; scripts/kubernetes/build.sh)"
stage "the Kubernetes test cluster's binaries" bash -c './scripts/kubernetes/build.sh >/dev/null'
echo "      (fake-gcs-server from the Go module proxy: about 2 minutes on a fresh 2-core machine, then cached; scripts/stores/fake-gcs-server.sh)"
stage "the GCS emulator of the gs:// tests" bash -c './scripts/stores/fake-gcs-server.sh >/dev/null'

export JAXTRAIN_REQUIRE_SLURM=1 JAXTRAIN_REQUIRE_KUBERNETES=1 JAXTRAIN_REQUIRE_GCS=1 JAXTRAIN_REQUIRE_SSH=1 \
       JAXTRAIN_REQUIRE_PROMETHEUS=1 JAXTRAIN_REQUIRE_BROWSER=1
stage "Python and end-to-end tests (real Slurm and Kubernetes clusters on this machine)" pytest_all
finish

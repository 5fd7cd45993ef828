#!/usr/bin/env bash
# Runs chosen tests again and again with every core kept busy by a CPU hog, as on a shared runner
# or beside a compile: a test that passes alone and fails here waits on time, not on events.
#
#   scripts/flaky.sh TEST... [N]       each TEST N times (default 10) under load
#
# A TEST is a pytest node id or path (tests/test_ssh.py::test_x, tests/test_cli.py, -k and -m
# expressions are not taken) or a C++ test by its CTest name (FakeSshTest.TheSshOfAHost...), run
# from the ASan build of scripts/test.sh (build/test-sanitize, built here if it is missing).
# Prints each round's result and, at the end, how many rounds failed; exit status 1 if any did.
# JAXTRAIN_FLAKY_HOGS sets how many busy processes run beside the tests (default: one per core).
set -uo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; }
if (($# == 0)) || [[ $1 == -h || $1 == --help ]]; then usage; exit 2; fi
rounds=10
if (($# > 1)) && [[ ${!#} =~ ^[0-9]+$ ]]; then
  rounds=${!#}
  set -- "${@:1:$#-1}"
fi
((rounds >= 1)) || { echo "flaky.sh: N must be at least 1, not $rounds" >&2; exit 2; }

py=() cxx=()
for t in "$@"; do
  if [[ $t == tests/* || $t == *.py* || $t == *::* ]]; then py+=("$t"); else cxx+=("$t"); fi
done

if ((${#cxx[@]})) && [[ ! -f build/test-sanitize/CTestTestfile.cmake ]]; then
  echo "flaky.sh: building the C++ tests (build/test-sanitize)"
  cmake -S . -B build/test-sanitize -G Ninja -DCMAKE_BUILD_TYPE=Debug -DJAXTRAIN_BUILD_TESTS=ON \
    -DJAXTRAIN_SANITIZE=ON >/dev/null && ninja -C build/test-sanitize >/dev/null || exit 1
elif ((${#cxx[@]})); then
  ninja -C build/test-sanitize >/dev/null || exit 1
fi
# CTest takes one regular expression: the names, each matched whole.
cxx_regex=""
for t in "${cxx[@]}"; do cxx_regex+="${cxx_regex:+|}^${t//./\\.}\$"; done

hogs=()
end_hogs() { ((${#hogs[@]})) && kill "${hogs[@]}" 2>/dev/null; wait 2>/dev/null; }
trap end_hogs EXIT
for _ in $(seq "${JAXTRAIN_FLAKY_HOGS:-$(nproc)}"); do
  nice -n 0 bash -c 'while :; do :; done' &
  hogs+=($!)
done
echo "flaky.sh: ${#hogs[@]} busy processes beside the tests; $rounds rounds"

failures=0
for round in $(seq "$rounds"); do
  ok=1
  if ((${#py[@]})); then
    .venv/bin/python -m pytest -q -p no:cacheprovider -x "${py[@]}" >"/tmp/flaky-$$.log" 2>&1 ||
      { ok=0; tail -n 40 "/tmp/flaky-$$.log"; }
  fi
  if [[ -n $cxx_regex ]]; then
    ctest --test-dir build/test-sanitize -R "$cxx_regex" --output-on-failure >"/tmp/flaky-$$.log" 2>&1 ||
      { ok=0; tail -n 40 "/tmp/flaky-$$.log"; }
    grep -q "No tests were found" "/tmp/flaky-$$.log" && { echo "flaky.sh: no C++ test matches ${cxx[*]}" >&2; exit 2; }
  fi
  if ((ok)); then echo "round $round/$rounds: passed"; else echo "round $round/$rounds: FAILED"; failures=$((failures + 1)); fi
done
rm -f "/tmp/flaky-$$.log"
echo "flaky.sh: $failures of $rounds rounds failed"
((failures == 0))

#!/usr/bin/env bash
# Fuzzes the control protocol's frame decoder, handshake and worker messages and the secure channel
# (src/wire/fuzz) with libFuzzer under AddressSanitizer and UndefinedBehaviorSanitizer, each fuzzer
# for SECONDS, starting from a fresh copy of the checked-in seed corpus in build/fuzz/corpus-<name>
# (the source tree is never written).
# Prints one summary line per fuzzer and exits non-zero if any input crashed one.
#
#   scripts/fuzz.sh          short run, 10 s per fuzzer (the one scripts/test.sh runs)
#   scripts/fuzz.sh 600      long run, 10 min per fuzzer
#
# A crash leaves its input in build/fuzz/artifacts/<name>/ and the fuzzer's report in
# build/fuzz/<name>.log. Replay it with build/fuzz/src/wire/fuzz/<name>_fuzzer <input>; once it is
# fixed, add the input to src/wire/fuzz/corpus/<name>/ so every later run replays it.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${1:-10}
if [[ ! $seconds =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: scripts/fuzz.sh [seconds per fuzzer, default 10]" >&2
  exit 2
fi

# clang-14 is Debian bookworm's clang; libclang-rt-14-dev holds libFuzzer and the sanitizers.
APT_PACKAGES=(clang libclang-rt-14-dev cmake ninja-build pkg-config nlohmann-json3-dev
              libsodium-dev)
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "fuzz: installing Debian packages: ${missing[*]}"
  SUDO=""
  [[ $(id -u) -eq 0 ]] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
    "${missing[@]}"
fi

# Quiet unless the build fails.
build() {
  CC=clang CXX=clang++ cmake -S . -B build/fuzz -G Ninja -DJAXTRAIN_FUZZ=ON \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo &&
    ninja -C build/fuzz channel_fuzzer frame_decoder_fuzzer handshake_fuzzer messages_fuzzer
}
if ! out=$(build 2>&1); then
  echo "$out" >&2
  echo "fuzz: building the fuzzers failed" >&2
  exit 1
fi

failed=0
for name in channel frame_decoder handshake messages; do
  corpus=build/fuzz/corpus-$name
  artifacts=build/fuzz/artifacts/$name
  log=build/fuzz/$name.log
  rm -rf "$corpus" "$artifacts"
  mkdir -p "$corpus" "$artifacts"
  cp -R "src/wire/fuzz/corpus/$name/." "$corpus/"
  seeds=$(find "$corpus" -type f | wc -l)

  start=$(date +%s)
  rc=0
  "build/fuzz/src/wire/fuzz/${name}_fuzzer" -max_total_time="$seconds" -max_len=4096 \
    -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 -artifact_prefix="$artifacts/" \
    "$corpus" >"$log" 2>&1 || rc=$?
  elapsed=$(($(date +%s) - start))

  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
  if [[ -z $execs ]]; then  # no final stats after a crash: the last progress line's count
    execs=$(grep -oE '^#[0-9]+' "$log" | tail -n 1 | tr -d '#' || true)
  fi
  inputs=$(find "$corpus" -type f | wc -l)
  crash=$(find "$artifacts" -type f | head -n 1)
  if ((rc != 0)) || [[ -n $crash ]]; then
    failed=1
    crashes="1 (exit $rc, input ${crash:-none saved}, report $log)"
  else
    crashes=0
  fi
  echo "fuzz: ${name}_fuzzer: ${execs:-?} executions in ${elapsed} s," \
    "corpus ${seeds} -> ${inputs} inputs, crashes: ${crashes}"
  if ((rc != 0)); then
    grep -E '^(==[0-9]+==ERROR|SUMMARY|.*fuzz invariant failed)' "$log" | head -n 5 >&2 || true
  fi
done
exit "$failed"

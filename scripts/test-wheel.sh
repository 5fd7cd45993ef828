#!/usr/bin/env bash
# Tests one wheel the way a user meets it: a fresh virtual environment of PYTHON whose PATH has no
# compiler on it, `pip install "WHEEL[jax]"` from binary packages only (jax and optax from the
# package index), then, from a folder outside the source tree:
#   - jaxtrain._core imports, from the wheel's module of the file name its tag promises PYTHON
#     (scripts/wheels/check-module-name: _core.abi3.so in the cp312-abi3 wheel);
#   - `jaxtrain --version` names the wheel's version;
#   - the seed's JaxTrainer program (examples/linear_regression.py) trains on its 4 workers
#     (its v6e 4x4 slice simulated on CPU);
#   - `jaxtrain run -n 2` runs the seed's plain JAX script, and a script whose psum across the
#     2 processes of one real jax.distributed job is 0 + 1.
#
#   scripts/test-wheel.sh PYTHON WHEEL
set -euo pipefail
cd "$(dirname "$0")/.."
(($# == 2)) || { echo "usage: scripts/test-wheel.sh PYTHON WHEEL" >&2; exit 2; }
python=$1
wheel=$(realpath "$2")
src=$PWD
version=$(basename "$wheel" | cut -d- -f2)

work=$(mktemp -d "${TMPDIR:-/tmp}/jaxtrain-wheel.XXXXXX")
trap 'rm -rf "$work"' EXIT
say() { echo "test-wheel [$(basename "$wheel")]: $*"; }
fail() { echo "test-wheel [$(basename "$wheel")]: FAILED: $*" >&2; exit 1; }

module=$(scripts/wheels/check-module-name "$python" "$wheel") || fail "its module is not the one its tag names"
"$python" -m venv "$work/venv"
# Only the virtual environment and a shell are on PATH: no cc, c++, gcc, clang, zig or cmake.
mkdir "$work/bin" "$work/home" "$work/run"
for tool in bash sh env; do ln -s "$(command -v "$tool")" "$work/bin/$tool"; done
user_path=$work/venv/bin:$work/bin
# A step that hangs fails the test after 10 minutes (exit status 124), not the whole build.
user() {
  timeout --kill-after=10 600 env -u PYTHONPATH -u VIRTUAL_ENV -u CC -u CXX PATH="$user_path" "$@"
}
for compiler in cc c++ gcc g++ clang clang++ zig cmake; do
  if (PATH=$user_path && command -v "$compiler" >/dev/null); then
    fail "$compiler is on the test's PATH"
  fi
done

start=$SECONDS
user pip install -q --only-binary :all: "$wheel[jax]" || fail "pip install ${wheel##*/}[jax]"
say "installed with jax $(user python -c 'import jax; print(jax.__version__)') in $((SECONDS - start)) s"

cp "$src/examples/linear_regression.py" "$src/examples/plain_jax_script.py" \
   "$src/tests/helpers/cli_psum_script.py" "$work/run/"
cd "$work/run"
in_run() { user env HOME="$work/home" "$@"; }  # runs land in $work/home/jaxtrain_results

interpreter=$(in_run python -V)
core=$(in_run python -c 'import jaxtrain._core as c; print(c.__file__)' 2>&1) ||
  fail "$interpreter cannot import jaxtrain._core: $core"
[[ $core == "$work/venv/"* ]] || fail "jaxtrain._core came from $core, not the wheel"
[[ ${core##*/} == "$module" ]] || fail "jaxtrain._core is $core, not the wheel's $module"
say "$interpreter imports jaxtrain._core from $module"
got=$(in_run jaxtrain --version 2>&1) || fail "jaxtrain --version: $got"
[[ $got == "jaxtrain $version" ]] || fail "jaxtrain --version said '$got', not 'jaxtrain $version'"

start=$SECONDS
out=$(in_run env JAXTRAIN_SIMULATE=1 python linear_regression.py 2>&1) || fail "linear_regression.py: $out"
grep -q "Training finished. Final loss:" <<<"$out" || fail "linear_regression.py printed: $out"
say "the seed's JaxTrainer program on 4 workers: $(grep 'Final loss' <<<"$out") ($((SECONDS - start)) s)"

start=$SECONDS
out=$(in_run jaxtrain run -n 2 --no-status-line plain_jax_script.py 2>&1) || fail "jaxtrain run -n 2 plain_jax_script.py: $out"
grep -q "Training finished." <<<"$out" || fail "jaxtrain run -n 2 plain_jax_script.py printed: $out"
out=$(in_run jaxtrain run -n 2 --no-status-line cli_psum_script.py 2>&1) || fail "jaxtrain run -n 2 cli_psum_script.py: $out"
grep -q "psum=1 process_count=2" <<<"$out" || fail "jaxtrain run -n 2 cli_psum_script.py printed: $out"
say "jaxtrain run -n 2 on the plain script and the psum script ($((SECONDS - start)) s)"
say "passed"

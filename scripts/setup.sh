#!/usr/bin/env bash
# Installs everything jaxtrain needs on a fresh Debian machine and builds it into .venv:
# the Debian packages that are missing, a virtual environment with requirements-dev.txt, and the
# jaxtrain package itself (C++ engine + Python API). Safe to run again; it redoes only what changed.
set -euo pipefail
cd "$(dirname "$0")/.."

# prometheus: the metrics endpoint scraped for real (tests/test_metrics.py); chromium,
# chromium-driver: the dashboard's browser test (tests/test_dashboard.py); iptables: a test host's
# slow, lossy link (tests/link_impair.py, for tests/test_ssh.py and tests/test_slurm.py); ccache:
# every C++ build (the module, the sanitizer builds of scripts/test.sh) compiles only what changed,
# also in another checkout of the same sources.
APT_PACKAGES=(build-essential cmake ninja-build pkg-config git libgtest-dev nlohmann-json3-dev
              libsodium-dev clang-format tcsh prometheus chromium chromium-driver iptables ccache)
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import venv, ensurepip' >/dev/null 2>&1; then
  missing+=(python3-venv)
fi
if ((${#missing[@]})); then
  echo "setup: installing Debian packages: ${missing[*]}"
  SUDO=""
  [[ $(id -u) -eq 0 ]] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

if [[ ! -x .venv/bin/python ]]; then
  echo "setup: creating .venv with $("$PYTHON" --version)"
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.requirements-installed
if [[ ! -f $stamp ]] || ! cmp -s requirements-dev.txt "$stamp"; then
  echo "setup: installing Python packages (requirements-dev.txt)"
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q -r requirements-dev.txt
  cp requirements-dev.txt "$stamp"
fi

echo "setup: building and installing jaxtrain"
# CMake takes the compiler launcher from the environment on a first configure.
export CMAKE_CXX_COMPILER_LAUNCHER=ccache CCACHE_BASEDIR=$PWD CCACHE_NOHASHDIR=true
.venv/bin/pip install -q --no-build-isolation --no-deps .

#!/usr/bin/env bash
# Sets up, builds the Kubernetes test cluster's binaries (cached; about 15 minutes the first time
# on 2 cores) and runs the Kubernetes tests only: a real control plane, kubelet and JobSet
# controller on this machine (docs/kubernetes.md). scripts/test.sh runs them with everything else.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
./scripts/kubernetes/build.sh >/dev/null
JAXTRAIN_REQUIRE_KUBERNETES=1 .venv/bin/python -m pytest tests/test_kubernetes.py \
    tests/test_kubernetes_elastic.py "$@"

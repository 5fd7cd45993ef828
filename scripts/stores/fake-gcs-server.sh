#!/usr/bin/env bash
# Builds fake-gcs-server, the GCS emulator behind the tests' gs:// storage (tests/gcs_server.py),
# from the Go module proxy, once per version.
#
#   scripts/stores/fake-gcs-server.sh        prints the path of the binary
#
# The binary is cached in $JAXTRAIN_GCS_CACHE (default ~/.cache/jaxtrain/fake-gcs-server) under its
# version, as <cache>/<version>/fake-gcs-server; a second call returns at once. A cold build takes
# about 2 minutes on 2 cores (docs/architecture.md, "Object stores in the tests").
set -euo pipefail

VERSION=v1.56.1
cache=${JAXTRAIN_GCS_CACHE:-$HOME/.cache/jaxtrain/fake-gcs-server}
out=$cache/$VERSION
bin=$out/fake-gcs-server
if [[ -x $bin ]]; then echo "$bin"; exit 0; fi

command -v go >/dev/null || {
  echo "fake-gcs-server.sh: Go is needed to build fake-gcs-server $VERSION (apt-get install golang, or go.dev)" >&2
  exit 1
}
start=$SECONDS
echo "[fake-gcs-server build] $VERSION from the Go module proxy ..." >&2
mkdir -p "$out"
# `go install pkg@version` builds the module with its own go.mod (its replace directives, if any,
# would refuse this; fake-gcs-server has none). GOBIN makes it write straight into the cache; the
# temporary name is renamed last, so an interrupted build leaves no binary that looks complete.
tmp=$(mktemp -d "$out/.build.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
GOFLAGS=-buildvcs=false GOBIN=$tmp nice -n 19 \
  go install -trimpath -ldflags "-s -w" "github.com/fsouza/fake-gcs-server@$VERSION"
mv "$tmp/fake-gcs-server" "$bin"
echo "[fake-gcs-server build] done in $((SECONDS - start)) s: $bin" >&2
echo "$bin"

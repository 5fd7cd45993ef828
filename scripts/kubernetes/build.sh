#!/usr/bin/env bash
# Builds the binaries of the Kubernetes test cluster from the Go module proxy, once per version set:
# etcd, kube-apiserver, kube-scheduler, kube-controller-manager, kubelet, kube-proxy and kubectl (one
# multi-call binary), the JobSet controller with its CRDs, the Kueue controller with its CRDs and
# webhook manifests, CoreDNS and the pod sandbox's pause.
#
#   scripts/kubernetes/build.sh        prints the directory holding the binaries
#
# The result is cached in $JAXTRAIN_K8S_CACHE (default ~/.cache/jaxtrain/kubernetes) under a key made
# of the versions below and of how each part is built (the functions below, the sources in go/);
# Kueue has a key of its own, so that a change to it rebuilds Kueue alone. A second call returns at
# once. A cold build takes about 15 minutes on 2 cores for Kubernetes, etcd, JobSet and CoreDNS,
# and about 5 minutes more for Kueue (514 CPU-seconds from empty Go caches: it compiles its own
# k8s.io/* and controller-runtime versions); it needs ~10 GB of disk for Go's
# caches (see docs/kubernetes.md).
set -euo pipefail

K8S=v1.37.2 STAGING=v0.37.2 ETCD=v3.7.3 JOBSET=v0.12.0 COREDNS=v1.15.0 KUEUE=v0.17.0
here=$(cd "$(dirname "$0")" && pwd)
cache=${JAXTRAIN_K8S_CACHE:-$HOME/.cache/jaxtrain/kubernetes}

work=$cache/work
export GOFLAGS=-buildvcs=false
nice_=(nice -n 19)
step() { local start=$SECONDS; echo "[kubernetes build] $1 ..." >&2; shift; "$@"; echo "[kubernetes build]   done in $((SECONDS - start)) s" >&2; }

# k8s.io/kubernetes cannot be built as a dependency without pinning each of its staging modules.
k8s_module() {
  mkdir -p "$work/k8s/cmd/k8s-all"
  cp "$here/go/k8s-all/main.go" "$work/k8s/cmd/k8s-all/main.go"
  {
    printf 'module jaxtrain.test/k8s\n\ngo 1.26.0\n\nrequire k8s.io/kubernetes %s\n\nreplace (\n' "$K8S"
    for m in api apiextensions-apiserver apimachinery apiserver cli-runtime client-go cloud-provider \
      cluster-bootstrap code-generator component-base component-helpers controller-manager cri-api \
      cri-client cri-streaming csi-translation-lib dynamic-resource-allocation endpointslice externaljwt \
      kms kube-aggregator kube-controller-manager kube-proxy kube-scheduler kubectl kubelet metrics \
      mount-utils pod-security-admission streaming; do
      printf '\tk8s.io/%s => k8s.io/%s %s\n' "$m" "$m" "$STAGING"
    done
    printf ')\n'
  } > "$work/k8s/go.mod"
  (cd "$work/k8s" && "${nice_[@]}" go mod tidy)
}
k8s_binary() {
  local ld="-s -w -X k8s.io/component-base/version.gitVersion=$K8S -X k8s.io/component-base/version.gitMajor=1"
  ld+=" -X k8s.io/component-base/version.gitMinor=$(cut -d. -f2 <<<"$K8S") -X k8s.io/component-base/version.gitTreeState=clean"
  (cd "$work/k8s" && "${nice_[@]}" go build -trimpath -ldflags "$ld" -o "$out/k8s-all" ./cmd/k8s-all)
  for n in kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy kubectl; do
    ln -sf k8s-all "$out/$n"
  done
}
# etcd's server module carries replace directives of its own: same wrapper.
etcd_binary() {
  mkdir -p "$work/etcd"
  {
    printf 'module jaxtrain.test/etcd\n\ngo 1.26.0\n\nrequire go.etcd.io/etcd/server/v3 %s\n\nreplace (\n' "$ETCD"
    for m in api/v3 client/pkg/v3 client/v3 pkg/v3; do printf '\tgo.etcd.io/etcd/%s => go.etcd.io/etcd/%s %s\n' "$m" "$m" "$ETCD"; done
    printf ')\n'
  } > "$work/etcd/go.mod"
  printf '//go:build tools\n\npackage tools\n\nimport _ "go.etcd.io/etcd/server/v3"\n' > "$work/etcd/tools.go"
  (cd "$work/etcd" && "${nice_[@]}" go mod tidy && "${nice_[@]}" go build -trimpath -ldflags "-s -w" -o "$out/etcd" go.etcd.io/etcd/server/v3)
}
# The proxy serves JobSet only by explicit version; its main package is the module root.
jobset_binary() {
  (cd "$work" && go mod download "sigs.k8s.io/jobset@$JOBSET")
  local src
  src=$(go env GOMODCACHE)/sigs.k8s.io/jobset@$JOBSET
  rm -rf "$work/jobset" && cp -r "$src" "$work/jobset" && chmod -R u+w "$work/jobset"
  (cd "$work/jobset" && "${nice_[@]}" go build -trimpath -ldflags "-s -w" -o "$out/jobset-controller" .)
  cp "$work/jobset/config/components/crd/bases/jobset.x-k8s.io_jobsets.yaml" "$out/jobset-crds.yaml"
}
# Kueue as JobSet: by explicit version, its main package is cmd/kueue; its CRDs and its webhooks'
# manifest (cluster.sh points them at the controller on the node: webhooks.py) are YAML in the
# module source.
kueue_binary() {
  (cd "$work" && go mod download "sigs.k8s.io/kueue@$KUEUE")
  local src
  src=$(go env GOMODCACHE)/sigs.k8s.io/kueue@$KUEUE
  rm -rf "$work/kueue" && cp -r "$src" "$work/kueue" && chmod -R u+w "$work/kueue"
  (cd "$work/kueue" && "${nice_[@]}" go build -trimpath -ldflags "-s -w" -o "$kueue_out/kueue-controller" ./cmd/kueue)
  cat "$work/kueue/config/components/crd/bases/"*.yaml >"$kueue_out/kueue-crds.yaml"
  cp "$work/kueue/config/components/webhook/manifests.yaml" "$kueue_out/kueue-webhooks.yaml"
}
coredns_binary() {
  mkdir -p "$work/coredns" && cp "$here/go/coredns/main.go" "$work/coredns/main.go"
  printf 'module jaxtrain.test/coredns\n\ngo 1.26.0\n\nrequire github.com/coredns/coredns %s\n' "$COREDNS" > "$work/coredns/go.mod"
  (cd "$work/coredns" && "${nice_[@]}" go mod tidy && "${nice_[@]}" go build -trimpath -ldflags "-s -w" -o "$out/coredns" .)
}
pause_binary() {
  mkdir -p "$work/pause" && cp "$here/go/pause/main.go" "$work/pause/main.go"
  printf 'module jaxtrain.test/pause\n\ngo 1.26\n' > "$work/pause/go.mod"
  (cd "$work/pause" && CGO_ENABLED=0 "${nice_[@]}" go build -ldflags "-s -w" -o "$out/pause" .)
}

parts() { declare -f "$@"; cat "$here"/go/*/main.go; }
key="k8s-$K8S.etcd-$ETCD.jobset-$JOBSET.coredns-$COREDNS.$(parts k8s_module k8s_binary etcd_binary \
  jobset_binary coredns_binary pause_binary | sha256sum | cut -c1-12)"
out=$cache/$key
kueue_out=$cache/kueue-$KUEUE.$(parts kueue_binary | sha256sum | cut -c1-12)
if [[ ! -f $out/.complete || ! -f $kueue_out/.complete ]]; then
  command -v go >/dev/null || { echo "build.sh: Go is needed (apt-get install golang, or go.dev)" >&2; exit 1; }
  mkdir -p "$work"
  # One build at a time (a test run and a benchmark, say): a second waits, then finds it done.
  exec {lock}>"$cache/.build.lock"
  flock -n "$lock" || { echo "[kubernetes build] waiting for the build under way" >&2; flock "$lock"; }
  total=$SECONDS
  if [[ ! -f $out/.complete ]]; then
    mkdir -p "$out"
    step "Kubernetes $K8S: resolving modules" k8s_module
    step "Kubernetes $K8S: building (the long part, ~10 min cold)" k8s_binary
    step "etcd $ETCD" etcd_binary
    step "JobSet $JOBSET" jobset_binary
    step "CoreDNS $COREDNS" coredns_binary
    step "pause" pause_binary
    touch "$out/.complete"
  fi
  if [[ ! -f $kueue_out/.complete ]]; then
    mkdir -p "$kueue_out"
    step "Kueue $KUEUE (~5 min cold)" kueue_binary
    touch "$kueue_out/.complete"
  fi
  echo "[kubernetes build] all binaries in $out after $((SECONDS - total)) s" >&2
fi
# One directory for cluster.sh: Kueue's files are links into its own.
for f in kueue-controller kueue-crds.yaml kueue-webhooks.yaml; do
  [[ $(readlink "$out/$f" 2>/dev/null) == "$kueue_out/$f" ]] || ln -sfn "$kueue_out/$f" "$out/$f"
done
echo "$out"

#!/usr/bin/env bash
# A real one-node Kubernetes cluster on this machine, for jaxtrain's tests: etcd, kube-apiserver,
# kube-scheduler, kube-controller-manager, kubelet with containerd and runc (Debian's), the CNI
# bridge, kube-proxy, CoreDNS, the JobSet controller and Kueue with their webhooks, all built by
# build.sh. Kueue manages JobSets and Jobs that carry its queue-name label; the tests make the
# ResourceFlavors, ClusterQueues and LocalQueues they need.
# Everything runs inside one private network and mount namespace (held by a `sleep infinity`), so
# the host's network, routes, iptables and mounts are never touched and no packet leaves.
#
#   cluster.sh start          build (cached) and start everything; prints the admin kubeconfig
#   cluster.sh stop           stop everything; leaves no process, mount or cgroup behind
#   cluster.sh clean          stop and wipe the cluster's state (binaries and images stay cached)
#   cluster.sh exec CMD...    run CMD in the cluster's network namespace (on the node's network)
#   cluster.sh kubectl ARGS   kubectl as the cluster's admin
#   cluster.sh image          (re)build and import the worker image from .venv
#   cluster.sh node2 start    add a second node (node2) to the running cluster
#   cluster.sh node2 stop     take it away again (its pods, its Node object)
#
# State: $JAXTRAIN_K8S_STATE (default /tmp/jaxtrain-k8s). The node's address is 10.250.0.2; pods
# get 10.244.0.0/24; the API server is https://10.250.0.2:6443 inside the namespace.
# node2 is a host of its own, as far as the cluster can tell: its own network namespace (10.250.0.3,
# pods 10.244.1.0/24, a veth link to node1's namespace, which routes between them), its own
# mount namespace, containerd, runc state, images, kubelet and pod cgroups (/node2).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
S=${JAXTRAIN_K8S_STATE:-/tmp/jaxtrain-k8s}
NODE_IP=10.250.0.2
POD_CIDR=10.244.0.0/24
SERVICE_CIDR=10.96.0.0/16
RUN=$S/run LOGS=$S/logs PKI=$S/pki ETC=$S/etc VAR=$S/var
CTR_SOCK=$RUN/containerd/containerd.sock
WORKER_IMAGE=docker.io/jaxtrain/worker:test
NICE=(nice -n 10)
# Kernel-wide values kubelet sets; inside the mount namespaces it sees files of $S/sysctl instead.
SYSCTLS=(vm/overcommit_memory=1 vm/panic_on_oom=0 kernel/panic=10 kernel/panic_on_oops=1)
# Paths containerd, the CNI plugins and kubelet insist on; inside the namespace they are bind
# mounts of directories under $S.
# Kueue reads its metrics server's certificate from a fixed path, without a flag to change it.
NS_DIRS=(/run/containerd /run/netns /var/lib/cni /var/lib/kubelet /var/log/pods /var/log/containers
         /etc/kueue/metrics/certs)

log() { echo "[kubernetes] $*" >&2; }
holder() { local p; p=$(cat "$RUN/holder.pid" 2>/dev/null) && kill -0 "$p" 2>/dev/null && echo "$p"; }
in_ns() { nsenter -t "$(holder)" -m -n "$@"; }
alive() { local p; p=$(cat "$RUN/$1.pid" 2>/dev/null) && kill -0 "$p" 2>/dev/null; }
# shellcheck source=../lib/cluster_lock.sh
source "$here/../lib/cluster_lock.sh"
kc() { in_ns "$BIN/kubectl" --kubeconfig "$PKI/admin.kubeconfig" "$@"; }

daemon() {  # name command...: started in the namespace, its output in logs/name.log
  local name=$1; shift
  alive "$name" && return 0
  nsenter -t "$(holder)" -m -n "${NICE[@]}" "$@" >>"$LOGS/$name.log" 2>&1 </dev/null &
  echo $! >"$RUN/$name.pid"
}

wait_for() {  # what timeout command...
  local what=$1 timeout=$2 start=$SECONDS; shift 2
  until "$@" >/dev/null 2>&1; do
    if ((SECONDS - start > timeout)); then
      log "$what did not come up within ${timeout} s; see $LOGS"
      return 1
    fi
    sleep 0.3
  done
}

need_packages() {
  local missing=() p
  for p in containerd runc containernetworking-plugins socat busybox-static iptables conntrack openssl; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
  done
  if ((${#missing[@]})); then
    log "installing Debian packages: ${missing[*]}"
    local sudo=""; [[ $(id -u) -eq 0 ]] || sudo=sudo
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
}

pki() {
  [[ -f $PKI/ca.crt ]] && return 0
  mkdir -p "$PKI" && cd "$PKI"
  openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 3650 -subj /CN=jaxtrain-test-ca 2>/dev/null
  openssl genrsa -out sa.key 2048 2>/dev/null && openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
  cert() {  # name CN O SANs (SANs make it a server certificate too)
    openssl req -newkey rsa:2048 -nodes -keyout "$1.key" -out "$1.csr" -subj "/CN=$2${3:+/O=$3}" 2>/dev/null
    {
      echo "basicConstraints=CA:FALSE"
      echo "keyUsage=digitalSignature,keyEncipherment"
      if [[ -n ${4:-} ]]; then echo "extendedKeyUsage=serverAuth,clientAuth"; echo "subjectAltName=$4"
      else echo "extendedKeyUsage=clientAuth"; fi
    } >"$1.ext"
    openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -out "$1.crt" -days 3650 -extfile "$1.ext" 2>/dev/null
    rm -f "$1.csr" "$1.ext"
  }
  cert apiserver kube-apiserver "" "DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,IP:127.0.0.1,IP:$NODE_IP,IP:10.96.0.1"
  cert admin admin system:masters
  cert apiserver-kubelet-client kube-apiserver-kubelet-client system:masters
  cert kubelet system:node:node1 system:nodes "DNS:node1,DNS:localhost,IP:127.0.0.1,IP:$NODE_IP"
  cert webhook jobset-webhook "" "DNS:localhost,IP:127.0.0.1"
  kubeconfig() {  # name cert server
    cat >"$PKI/$1.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters: [{name: local, cluster: {certificate-authority: $PKI/ca.crt, server: "$3"}}]
users: [{name: $2, user: {client-certificate: $PKI/$2.crt, client-key: $PKI/$2.key}}]
contexts: [{name: local, context: {cluster: local, user: $2}}]
current-context: local
EOF
  }
  kubeconfig admin admin "https://$NODE_IP:6443"
  kubeconfig kubelet kubelet "https://$NODE_IP:6443"
  cd - >/dev/null
}

configs() {
  mkdir -p "$ETC/cni" "$S/jobset-certs" "$S/kueue-certs" "$S/root/etc/kueue/metrics/certs"
  local d
  for d in "$S/jobset-certs" "$S/kueue-certs" "$S/root/etc/kueue/metrics/certs"; do
    cp "$PKI/webhook.crt" "$d/tls.crt"; cp "$PKI/webhook.key" "$d/tls.key"
  done
  cat >"$ETC/containerd.toml" <<EOF
version = 2
root = "$VAR/containerd"
state = "$RUN/containerd"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.internal.v1.tracing"]
[grpc]
  address = "$CTR_SOCK"
[ttrpc]
  address = "$CTR_SOCK.ttrpc"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "registry.k8s.io/pause:3.10"
  # Sandboxes here may lack CAP_SYS_RESOURCE, which negative oom_score_adj values need.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "$RUN/runc"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$ETC/cni"
EOF
  cat >"$ETC/cni/10-bridge.conflist" <<EOF
{"cniVersion": "0.4.0", "name": "pods", "plugins": [{"type": "bridge", "bridge": "cni0",
  "isGateway": true, "ipMasq": false, "hairpinMode": true,
  "ipam": {"type": "host-local", "ranges": [[{"subnet": "$POD_CIDR", "gateway": "10.244.0.1"}]],
           "routes": [{"dst": "0.0.0.0/0"}], "dataDir": "$VAR/cni-ipam"}}]}
EOF
  echo "nameserver $NODE_IP" >"$ETC/resolv.conf"
  cat >"$ETC/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
containerRuntimeEndpoint: unix://$CTR_SOCK
address: $NODE_IP
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
tlsCertFile: $PKI/kubelet.crt
tlsPrivateKeyFile: $PKI/kubelet.key
authentication: {anonymous: {enabled: false}, webhook: {enabled: true}, x509: {clientCAFile: $PKI/ca.crt}}
authorization: {mode: Webhook}
clusterDomain: cluster.local
clusterDNS: [$NODE_IP]
resolvConf: $ETC/resolv.conf
failSwapOn: false
serializeImagePulls: false
evictionHard: {memory.available: "200Mi", nodefs.available: "1%", imagefs.available: "1%", nodefs.inodesFree: "1%"}
imageGCHighThresholdPercent: 100
maxPods: 110
syncFrequency: 5s
fileCheckFrequency: 20s
nodeStatusUpdateFrequency: 5s
EOF
  cat >"$ETC/Corefile" <<EOF
.:53 {
    errors
    health 127.0.0.1:8080
    ready 127.0.0.1:8181
    kubernetes cluster.local in-addr.arpa ip6.arpa {
        kubeconfig $PKI/admin.kubeconfig
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
        ttl 5
    }
    cache 5
}
EOF
  cat >"$ETC/jobset.yaml" <<EOF
apiVersion: config.jobset.x-k8s.io/v1alpha1
kind: Configuration
leaderElection: {leaderElect: false}
internalCertManagement: {enable: false}
webhook: {port: 9443, host: 127.0.0.1, certDir: $S/jobset-certs}
metrics: {bindAddress: "0"}
health: {healthProbeBindAddress: "127.0.0.1:8081"}
EOF
  python3 "$here/webhooks.py" "$PKI/ca.crt" "$ETC/jobset-webhooks.json"
  # Kueue with the certificates made here (not its internal cert management, which wants an
  # in-cluster Service), its webhooks on 127.0.0.1:9444, and the integrations the tests use.
  cat >"$ETC/kueue.yaml" <<EOF
apiVersion: config.kueue.x-k8s.io/v1beta2
kind: Configuration
leaderElection: {leaderElect: false}
internalCertManagement: {enable: false}
webhook: {port: 9444, host: 127.0.0.1, certDir: $S/kueue-certs}
metrics: {bindAddress: "0"}
health: {healthProbeBindAddress: "127.0.0.1:8083"}
integrations: {frameworks: ["batch/job", "jobset.x-k8s.io/jobset"]}
EOF
  "$repo/.venv/bin/python" "$here/webhooks.py" --kueue "$PKI/ca.crt" "$BIN/kueue-webhooks.yaml" \
    "$ETC/kueue-webhooks.json"
}

namespaces() {
  holder >/dev/null && return 0
  unshare --mount --net --propagation private sleep infinity </dev/null >/dev/null 2>&1 &
  echo $! >"$RUN/holder.pid"
  wait_for "the namespace holder" 10 test -e "/proc/$(cat "$RUN/holder.pid")/ns/net"
  : >"$RUN/made-dirs"
  local d part made
  for d in "${NS_DIRS[@]}"; do
    made=""
    for part in ${d//\// }; do  # each directory made here is removed at stop, deepest first
      made+="/$part"
      [[ -d $made ]] || { mkdir "$made"; echo "$made" >>"$RUN/made-dirs"; }
    done
    mkdir -p "$S/root$d"
    in_ns mount --bind "$S/root$d" "$d"
  done
  in_ns ip link set lo up
  # The node's address, on a veth pair that stays inside the namespace (no dummy driver needed).
  in_ns ip link add node0 type veth peer name node0-peer
  in_ns ip link set node0-peer up
  in_ns ip addr add "$NODE_IP/32" dev node0
  in_ns ip link set node0 up
  in_ns sysctl -qw net.ipv4.ip_forward=1
  # kubelet sets these kernel-wide values; inside the mount namespace it sees files instead.
  mkdir -p "$S/sysctl"
  local kv f
  for kv in "${SYSCTLS[@]}"; do
    f=${kv%=*}; echo "${kv#*=}" >"$S/sysctl/${f//\//_}"
    in_ns mount --bind "$S/sysctl/${f//\//_}" "/proc/sys/$f"
  done
}

import_images() {
  local images=$S/images
  mkdir -p "$images"
  python3 "$here/image.py" pause "$BIN/pause" "$images/pause.tar"
  in_ns ctr -a "$CTR_SOCK" -n k8s.io images import "$images/pause.tar" >/dev/null
  worker_image
}

worker_image() {
  local images=$S/images
  mkdir -p "$images"
  log "building the worker image from $repo/.venv"
  "$repo/.venv/bin/python" "$here/image.py" worker "$repo/.venv" "$images/worker.tar" \
    "${JAXTRAIN_K8S_CACHE:-$HOME/.cache/jaxtrain/kubernetes}/images"
  in_ns ctr -a "$CTR_SOCK" -n k8s.io images import "$images/worker.tar" >/dev/null
  rm -f "$images/worker.tar"
  log "imported $WORKER_IMAGE"
}

# --- node2: a second node, added to a running cluster -----------------------------------------
N2=$S/node2
NODE2_IP=10.250.0.3
NODE2_POD_CIDR=10.244.1.0/24
CTR2_SOCK=$N2/run/containerd/containerd.sock
node2_holder() { local p; p=$(cat "$N2/run/holder.pid" 2>/dev/null) && kill -0 "$p" 2>/dev/null && echo "$p"; }
in_n2() { nsenter -t "$(node2_holder)" -m -n "$@"; }

# The roots of the cgroup hierarchies: one per controller (v1), or the unified one (v2).
cgroup_roots() {
  if [[ -f /sys/fs/cgroup/cgroup.controllers ]]; then echo /sys/fs/cgroup
  else local c; for c in /sys/fs/cgroup/*/; do [[ -f $c/cgroup.procs ]] && echo "${c%/}"; done; fi
}

node2_configs() {
  mkdir -p "$N2/run" "$N2/var" "$N2/etc/cni" "$N2/logs"
  if [[ ! -f $PKI/kubelet2.crt ]]; then
    (cd "$PKI" &&
     openssl req -newkey rsa:2048 -nodes -keyout kubelet2.key -out kubelet2.csr -subj "/CN=system:node:node2/O=system:nodes" 2>/dev/null &&
     printf '%s\n' basicConstraints=CA:FALSE keyUsage=digitalSignature,keyEncipherment \
       extendedKeyUsage=serverAuth,clientAuth "subjectAltName=DNS:node2,DNS:localhost,IP:127.0.0.1,IP:$NODE2_IP" >kubelet2.ext &&
     openssl x509 -req -in kubelet2.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out kubelet2.crt -days 3650 -extfile kubelet2.ext 2>/dev/null &&
     rm -f kubelet2.csr kubelet2.ext)
  fi
  sed -e "s|$PKI/kubelet.crt|$PKI/kubelet2.crt|" -e "s|$PKI/kubelet.key|$PKI/kubelet2.key|" \
      "$PKI/kubelet.kubeconfig" >"$N2/etc/kubelet.kubeconfig"
  sed -e "s|$VAR/containerd|$N2/var/containerd|" -e "s|$RUN/containerd|$N2/run/containerd|" \
      -e "s|$RUN/runc|$N2/run/runc|" -e "s|$ETC/cni|$N2/etc/cni|" "$ETC/containerd.toml" >"$N2/etc/containerd.toml"
  sed -e "s|$POD_CIDR|$NODE2_POD_CIDR|" -e "s|10.244.0.1|10.244.1.1|" -e "s|$VAR/cni-ipam|$N2/var/cni-ipam|" \
      "$ETC/cni/10-bridge.conflist" >"$N2/etc/cni/10-bridge.conflist"
  # Its pods in cgroups of its own: a kubelet removes the pod cgroups it does not know under its
  # root, which would be node1's under a shared one.
  sed -e "s|address: $NODE_IP|address: $NODE2_IP|" -e "s|$PKI/kubelet.crt|$PKI/kubelet2.crt|" \
      -e "s|$CTR_SOCK|$CTR2_SOCK|" \
      -e "s|$PKI/kubelet.key|$PKI/kubelet2.key|" "$ETC/kubelet.yaml" >"$N2/etc/kubelet.yaml"
  echo "cgroupRoot: /node2" >>"$N2/etc/kubelet.yaml"
}

node2_namespaces() {
  node2_holder >/dev/null && return 0
  unshare --mount --net --propagation private sleep infinity </dev/null >/dev/null 2>&1 &
  echo $! >"$N2/run/holder.pid"
  wait_for "node2's namespace holder" 10 test -e "/proc/$(cat "$N2/run/holder.pid")/ns/net"
  local d
  for d in "${NS_DIRS[@]}"; do
    mkdir -p "$N2/root$d"
    in_n2 mount --bind "$N2/root$d" "$d"
  done
  local f
  for f in "${SYSCTLS[@]}"; do f=${f%=*}; in_n2 mount --bind "$S/sysctl/${f//\//_}" "/proc/sys/$f"; done
  in_n2 ip link set lo up
  # One link between the two nodes' namespaces; node1 routes node2's pods, node2 everything else.
  ip link add to-node2 netns "$(holder)" type veth peer name eth0 netns "$(node2_holder)"
  in_ns ip link set to-node2 up
  in_ns ip route add "$NODE2_IP/32" dev to-node2
  in_ns ip route add "$NODE2_POD_CIDR" via "$NODE2_IP"
  in_n2 ip addr add "$NODE2_IP/32" dev eth0
  in_n2 ip link set eth0 up
  in_n2 ip route add "$NODE_IP/32" dev eth0
  in_n2 ip route add default via "$NODE_IP" dev eth0
  in_n2 sysctl -qw net.ipv4.ip_forward=1
  local c
  for c in $(cgroup_roots); do [[ -d $c/node2 ]] || mkdir "$c/node2" 2>/dev/null || true; done
  # cgroup v1's cpuset: a new cgroup has no CPUs or memory nodes until given its parent's.
  if [[ -f /sys/fs/cgroup/cpuset/cpuset.cpus && ! -s /sys/fs/cgroup/cpuset/node2/cpuset.cpus ]]; then
    cat /sys/fs/cgroup/cpuset/cpuset.cpus >/sys/fs/cgroup/cpuset/node2/cpuset.cpus
    cat /sys/fs/cgroup/cpuset/cpuset.mems >/sys/fs/cgroup/cpuset/node2/cpuset.mems
  fi
}

node2_daemon() {  # name command...: started in node2's namespaces, its output in node2/logs/name.log
  local name=$1; shift
  local p; p=$(cat "$N2/run/$name.pid" 2>/dev/null) && kill -0 "$p" 2>/dev/null && return 0
  nsenter -t "$(node2_holder)" -m -n "${NICE[@]}" "$@" >>"$N2/logs/$name.log" 2>&1 </dev/null &
  echo $! >"$N2/run/$name.pid"
}

node2_start() {
  holder >/dev/null || { log "the cluster is not running (cluster.sh start)"; return 1; }
  local began=$SECONDS
  node2_configs
  node2_namespaces
  node2_daemon containerd containerd --config "$N2/etc/containerd.toml"
  wait_for "node2's containerd" 30 in_n2 ctr -a "$CTR2_SOCK" version
  python3 "$here/image.py" pause "$BIN/pause" "$S/images/pause.tar"
  in_n2 ctr -a "$CTR2_SOCK" -n k8s.io images import "$S/images/pause.tar" >/dev/null
  "$repo/.venv/bin/python" "$here/image.py" worker "$repo/.venv" "$S/images/worker.tar" \
    "${JAXTRAIN_K8S_CACHE:-$HOME/.cache/jaxtrain/kubernetes}/images"
  in_n2 ctr -a "$CTR2_SOCK" -n k8s.io images import "$S/images/worker.tar" >/dev/null
  rm -f "$S/images/worker.tar"
  node2_daemon kubelet "$BIN/kubelet" --config="$N2/etc/kubelet.yaml" \
    --kubeconfig="$N2/etc/kubelet.kubeconfig" --root-dir="$N2/var/kubelet" \
    --hostname-override=node2 --node-ip=$NODE2_IP --v=1
  wait_for "node2" 120 node_ready node2
  # A new node is tainted not-ready until the node lifecycle controller has seen it Ready.
  wait_for "node2 to take pods" 60 node_untainted node2
  log "node2 up in $((SECONDS - began)) s"
}

node2_stop() {
  stop_one kubelet 15 "$N2/run"
  if node2_holder >/dev/null; then
    local shims n
    shims=$(end_tasks in_n2 "$CTR2_SOCK")
    stop_one containerd 10 "$N2/run"
    for n in $shims; do kill -9 "$n" 2>/dev/null || true; done
    kill "$(node2_holder)" 2>/dev/null || true
  fi
  rm -f "$N2/run/holder.pid"
  # Its Node object (kubectl is at hand only when the cluster's binaries are; start removes a stale
  # one otherwise).
  if [[ -n ${BIN:-} ]] && holder >/dev/null; then
    kc delete node node2 --ignore-not-found --wait=false >/dev/null 2>&1 || true
  fi
  local c
  for c in $(cgroup_roots); do
    [[ -d $c/node2 ]] && find "$c/node2" -depth -type d -exec rmdir {} \; 2>/dev/null || true
  done
}

node_untainted() { [[ -z $(kc get node "$1" -o 'jsonpath={.spec.taints}') ]]; }

node_ready() {  # [name]
  kc get node "${1:-node1}" -o 'jsonpath={.status.conditions[?(@.type=="Ready")].status}' | grep -q True
}


start() {
  local began=$SECONDS
  need_packages
  BIN=$("$here/build.sh")
  mkdir -p "$RUN" "$LOGS" "$VAR"
  pki
  configs
  namespaces
  daemon etcd "$BIN/etcd" --name node1 --data-dir "$VAR/etcd" --listen-client-urls http://127.0.0.1:2379 \
    --advertise-client-urls http://127.0.0.1:2379 --listen-peer-urls http://127.0.0.1:2380 \
    --initial-advertise-peer-urls http://127.0.0.1:2380 --initial-cluster node1=http://127.0.0.1:2380 \
    --unsafe-no-fsync --log-level warn
  wait_for etcd 60 in_ns curl -sf http://127.0.0.1:2379/health
  daemon kube-apiserver "$BIN/kube-apiserver" --etcd-servers=http://127.0.0.1:2379 \
    --advertise-address=$NODE_IP --secure-port=6443 --tls-cert-file="$PKI/apiserver.crt" \
    --tls-private-key-file="$PKI/apiserver.key" --client-ca-file="$PKI/ca.crt" \
    --service-account-key-file="$PKI/sa.pub" --service-account-signing-key-file="$PKI/sa.key" \
    --service-account-issuer=https://kubernetes.default.svc.cluster.local \
    --service-cluster-ip-range=$SERVICE_CIDR --authorization-mode=Node,RBAC \
    --kubelet-client-certificate="$PKI/apiserver-kubelet-client.crt" \
    --kubelet-client-key="$PKI/apiserver-kubelet-client.key" --kubelet-certificate-authority="$PKI/ca.crt" \
    --kubelet-preferred-address-types=InternalIP --profiling=false --v=1
  wait_for kube-apiserver 180 in_ns curl -sf --cacert "$PKI/ca.crt" --cert "$PKI/admin.crt" --key "$PKI/admin.key" "https://$NODE_IP:6443/readyz"
  local common=(--kubeconfig="$PKI/admin.kubeconfig" --authentication-kubeconfig="$PKI/admin.kubeconfig"
                --authorization-kubeconfig="$PKI/admin.kubeconfig" --leader-elect=false --bind-address=127.0.0.1 --v=1)
  daemon kube-scheduler "$BIN/kube-scheduler" "${common[@]}"
  daemon kube-controller-manager "$BIN/kube-controller-manager" "${common[@]}" \
    --service-account-private-key-file="$PKI/sa.key" --root-ca-file="$PKI/ca.crt" --use-service-account-credentials=true
  daemon containerd containerd --config "$ETC/containerd.toml"
  wait_for containerd 30 in_ns ctr -a "$CTR_SOCK" version
  import_images
  daemon kubelet "$BIN/kubelet" --config="$ETC/kubelet.yaml" --kubeconfig="$PKI/kubelet.kubeconfig" \
    --root-dir="$VAR/kubelet" --hostname-override=node1 --node-ip=$NODE_IP --v=1
  wait_for "the node" 120 node_ready node1
  node2_holder >/dev/null || kc delete node node2 --ignore-not-found --wait=false >/dev/null
  in_ns sysctl -qw net.bridge.bridge-nf-call-iptables=1 2>/dev/null || true
  daemon kube-proxy "$BIN/kube-proxy" --kubeconfig="$PKI/admin.kubeconfig" --hostname-override=node1 \
    --proxy-mode=iptables --cluster-cidr=$POD_CIDR --conntrack-max-per-core=0 \
    --metrics-bind-address=127.0.0.1:10249 --healthz-bind-address=127.0.0.1:10256 --v=1
  daemon coredns "$BIN/coredns" -conf "$ETC/Corefile"
  kc apply --server-side -f "$BIN/jobset-crds.yaml" >/dev/null
  wait_for "the JobSet CRD" 60 kc wait --for=condition=Established crd/jobsets.jobset.x-k8s.io --timeout=5s
  daemon jobset "$BIN/jobset-controller" --config="$ETC/jobset.yaml" --kubeconfig="$PKI/admin.kubeconfig" --zap-log-level=info
  wait_for "the JobSet webhook" 60 in_ns curl -sf http://127.0.0.1:8081/readyz
  kc apply -f "$ETC/jobset-webhooks.json" >/dev/null
  kc apply --server-side -f "$BIN/kueue-crds.yaml" >/dev/null
  local crd
  for crd in clusterqueues localqueues workloads resourceflavors workloadpriorityclasses; do
    wait_for "Kueue's CRDs" 60 kc wait --for=condition=Established "crd/$crd.kueue.x-k8s.io" --timeout=5s
  done
  kc create namespace kueue-system >/dev/null 2>&1 || true
  # The visibility API (an aggregated API server) is not needed and would want an APIService.
  daemon kueue "$BIN/kueue-controller" --config="$ETC/kueue.yaml" --kubeconfig="$PKI/admin.kubeconfig" \
    --feature-gates=VisibilityOnDemand=false --zap-log-level=info
  wait_for "the Kueue webhook" 120 in_ns curl -sf http://127.0.0.1:8083/readyz
  kc apply -f "$ETC/kueue-webhooks.json" >/dev/null
  wait_for kube-proxy 60 in_ns curl -sf http://127.0.0.1:10256/healthz
  wait_for coredns 60 in_ns curl -sf http://127.0.0.1:8181/ready
  log "cluster up in $((SECONDS - began)) s; admin kubeconfig: $PKI/admin.kubeconfig (inside the namespace)"
}

stop_one() {  # name timeout [run directory]: SIGTERM, then SIGKILL
  local dir=${3:-$RUN}
  local p; p=$(cat "$dir/$1.pid" 2>/dev/null) || return 0
  if kill -0 "$p" 2>/dev/null; then
    kill "$p" 2>/dev/null || true
    local t=$SECONDS
    while kill -0 "$p" 2>/dev/null; do
      ((SECONDS - t > $2)) && { kill -9 "$p" 2>/dev/null || true; break; }
      sleep 0.2
    done
  fi
  rm -f "$dir/$1.pid"
}

end_tasks() {  # in-namespace-command socket: SIGKILLs every container task; prints their shims
  local id
  for id in $("$1" ctr -a "$2" -n k8s.io tasks ls -q 2>/dev/null); do
    "$1" ctr -a "$2" -n k8s.io tasks kill -s SIGKILL "$id" >/dev/null 2>&1 || true
  done
  pgrep -f -- "containerd-shim-runc-v2 -namespace k8s.io .*-address $2" || true
}

stop() {
  node2_stop
  local n
  for n in kueue jobset coredns kube-proxy kubelet kube-controller-manager kube-scheduler; do stop_one $n 15; done
  stop_one kube-apiserver 20
  stop_one etcd 10
  if holder >/dev/null; then
    local shims
    shims=$(end_tasks in_ns "$CTR_SOCK")
    stop_one containerd 10
    for n in $shims; do kill -9 "$n" 2>/dev/null || true; done
    kill "$(holder)" 2>/dev/null || true
    rm -f "$RUN/holder.pid"
  fi
  # Empty pod cgroups kubelet made (cgroup v1 has one tree per controller).
  local c
  for c in /sys/fs/cgroup/*/kubepods; do
    [[ -d $c ]] && find "$c" -depth -type d -exec rmdir {} \; 2>/dev/null || true
  done
  if [[ -f $RUN/made-dirs ]]; then
    while read -r d; do rmdir "$d" 2>/dev/null || true; done < <(tac "$RUN/made-dirs")
    rm -f "$RUN/made-dirs"
  fi
}

case ${1:-} in
  start | stop | clean | node2) cluster_lock_check "$S.lock" "the Kubernetes test cluster" ;;
esac
case ${1:-} in
  start) start ;;
  stop) stop ;;
  clean) stop; rm -rf "$S" ;;
  exec) shift; nsenter -t "$(holder)" -n "$@" ;;
  kubectl) shift; BIN=$("$here/build.sh"); kc "$@" ;;
  image) BIN=$("$here/build.sh"); worker_image ;;
  node2)
    BIN=$("$here/build.sh")
    case ${2:-} in start) node2_start ;; stop) node2_stop ;; *) echo "usage: $0 node2 start|stop" >&2; exit 2 ;; esac ;;
  *) sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac

# Test hosts as network namespaces on this machine, for the test clusters (scripts/slurm_cluster.sh,
# scripts/ssh_hosts.sh). Sourced, not run. Needs root.
#
# A test host is a network namespace joined to a bridge in the root namespace by a veth pair
# ("eth0" inside), with its own address and its own /etc/hosts (`ip netns exec` bind-mounts
# /etc/netns/<ns>/hosts over /etc/hosts), so that Gloo finds the address its hostname resolves
# to. Addresses must be in 198.18.0.0/15 (reserved for benchmark testing); the namespaces have no
# route beyond the bridge, so no traffic leaves the machine.
#
# A host's daemon (sshd, slurmd) is started by netns_host_start in new UTS and mount namespaces of
# its own, which every process it starts inherits: its hostname, and private tmpfs's on what a
# real host keeps on its own disks and memory and jaxtrain writes host-locally by default:
#   /dev/shm (host memory: jaxtrain's in-memory checkpoints), /tmp and /var/tmp (tempfile's
#   directories: the workers' checkpoint directories before they are reported), and
#   ~/.cache (the home of the user the host serves: jaxtrain's staging copies of remote runs).
# What stays shared is what a real cluster shares by installation: the rest of the filesystem
# (the checkout and its virtual environment, and the Python it runs on, e.g. under ~/.pyenv: the
# "image"; so ~ itself, but for ~/.cache), and the directories named in KEEP, bind-mounted back
# over the private ones (the cluster's state directory under /var/tmp: the daemons' configs and
# the directory that stands for an NFS mount). The tmpfs's live only in the host's mount namespace: they go when its last
# process does (netns_host_del), leaving nothing on this machine.
NETNS_LIB=$(realpath "${BASH_SOURCE[0]}")

# netns_bridge_up BRIDGE ADDR PREFIX: the bridge, with the root namespace's address on it.
netns_bridge_up() {
  ip link add "$1" type bridge
  ip addr add "$2/$3" dev "$1"
  ip link set "$1" up
}

# netns_host_add NS VETH ADDR PREFIX BRIDGE HOSTS: a namespace NS at ADDR on BRIDGE; HOSTS is the
# text of its /etc/hosts.
netns_host_add() {
  local ns=$1 veth=$2 addr=$3 prefix=$4 bridge=$5 hosts=$6
  ip netns add "$ns"
  ip link add "$veth" type veth peer name eth0 netns "$ns"
  ip link set "$veth" master "$bridge" up
  ip -n "$ns" addr add "$addr/$prefix" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" link set lo up
  mkdir -p "/etc/netns/$ns"
  printf '%s\n' "$hosts" >"/etc/netns/$ns/hosts"
}

# netns_host_start NS HOSTNAME KEEP COMMAND...: starts COMMAND (a daemon that forks into the
# background) on host NS, with HOSTNAME and the host's own filesystems (above); KEEP is a
# ':'-separated list of directories left shared (those under /tmp, /var/tmp or ~/.cache are
# bound back: the test clusters' state, a checkout under /tmp; none may be under /dev/shm).
netns_host_start() {
  local ns=$1 name=$2 keep=$3
  shift 3
  # shellcheck disable=SC2016  # expanded by the inner bash
  ip netns exec "$ns" unshare --uts --mount --propagation private \
    bash -c 'set -euo pipefail; source "$1"; netns_private_fs "$2" "$3" "$4"; shift 4; exec "$@"' \
    netns-host "$NETNS_LIB" "$ns" "$name" "$keep" "$@"
}

# The private directories of a host (see above), in the order they are mounted.
netns_private_dirs() {
  local home
  home=$(getent passwd "$(id -un)" | cut -d: -f6)
  printf '%s\n' /dev/shm /tmp /var/tmp "$home/.cache"
}

# netns_private_fs NS HOSTNAME KEEP: run in the host's new UTS and mount namespaces (private
# propagation: nothing mounted here reaches this machine), by netns_host_start.
netns_private_fs() {
  local ns=$1 name=$2 keep=$3 dirs stage k d i
  hostname "$name"
  mapfile -t dirs < <(netns_private_dirs)
  local -a listed=() kept=()
  IFS=: read -ra listed <<<"$keep"
  for k in "${listed[@]}"; do  # only what a private directory would hide needs keeping
    for d in "${dirs[@]:1}"; do
      if [[ $k == "$d" || $k == "$d"/* ]]; then kept+=("$k") && break; fi
    done
  done
  # /dev/shm first: the directories to keep wait there, bound, while the others are covered.
  mount -t tmpfs -o mode=1777,size=2g "$ns-shm" /dev/shm
  stage=/dev/shm/.netns-keep
  for i in "${!kept[@]}"; do
    mkdir -p "$stage/$i"
    mount --rbind "${kept[$i]}" "$stage/$i"
  done
  mount -t tmpfs -o mode=1777,size=2g "$ns-tmp" "${dirs[1]}"
  mount -t tmpfs -o mode=1777,size=2g "$ns-vartmp" "${dirs[2]}"
  mkdir -p "${dirs[3]}"
  mount -t tmpfs -o "mode=0755,size=2g,uid=$(id -u),gid=$(id -g)" "$ns-cache" "${dirs[3]}"
  for i in "${!kept[@]}"; do
    k=${kept[$i]}
    mkdir -p "$k"
    mount --move "$stage/$i" "$k"
    rmdir "$stage/$i"
  done
  rm -rf "$stage"
}

# netns_host_mounts NS: the mounts of host NS's own filesystems still present in any process
# of this machine, as "pid source mountpoint"; none once the host is deleted.
netns_host_mounts() {
  grep -H -E "^$1-(shm|tmp|vartmp|cache) " /proc/[0-9]*/mounts 2>/dev/null |
    sed -E 's|^/proc/([0-9]+)/mounts:([^ ]+) ([^ ]+) .*|\1 \2 \3|' | sort -u -k2,3 || true
}

# netns_host_del NS VETH: kills whatever still runs in NS, deletes it, its veth and its hosts file.
netns_host_del() {
  local ns=$1 veth=$2
  if ip netns list | grep -qw "$ns"; then
    for pid in $(ip netns pids "$ns"); do kill -9 "$pid" 2>/dev/null || true; done
    ip netns del "$ns"
  fi
  # The host's tmpfs's go with the last process of its mount namespace.
  local left=""
  for _ in $(seq 50); do
    left=$(netns_host_mounts "$ns")
    [[ -z $left ]] && break
    sleep 0.1
  done
  if [[ -n $left ]]; then
    echo "netns: filesystems of host $ns still mounted (pid source mountpoint):" >&2
    echo "$left" >&2
  fi
  ip link del "$veth" 2>/dev/null || true
  rm -rf "/etc/netns/$ns"
}

netns_bridge_del() { ip link del "$1" 2>/dev/null || true; }

pid_alive() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

# stop_pidfile FILE: SIGTERM to the process FILE names, SIGKILL after 5 s.
stop_pidfile() {
  local f=$1
  pid_alive "$f" || return 0
  local pid
  pid=$(cat "$f")
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 50); do
    kill -0 "$pid" 2>/dev/null || return 0
    sleep 0.1
  done
  kill -9 "$pid" 2>/dev/null || true
}

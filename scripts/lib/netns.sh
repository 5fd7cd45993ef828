# Test hosts as network namespaces on this machine, for the test clusters (scripts/slurm_cluster.sh,
# scripts/ssh_hosts.sh). Sourced, not run. Needs root.
#
# A test host is a network namespace joined to a bridge in the root namespace by a veth pair
# ("eth0" inside), with its own address and its own /etc/hosts (`ip netns exec` bind-mounts
# /etc/netns/<ns>/hosts over /etc/hosts), so that Gloo finds the address its hostname resolves
# to. Addresses must be in 198.18.0.0/15 (reserved for benchmark testing); the namespaces have no
# route beyond the bridge, so no traffic leaves the machine.

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

# netns_host_del NS VETH: kills whatever still runs in NS, deletes it, its veth and its hosts file.
netns_host_del() {
  local ns=$1 veth=$2
  if ip netns list | grep -qw "$ns"; then
    for pid in $(ip netns pids "$ns"); do kill -9 "$pid" 2>/dev/null || true; done
    ip netns del "$ns"
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

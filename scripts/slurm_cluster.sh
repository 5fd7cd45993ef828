#!/usr/bin/env bash
# A real multi-node Slurm cluster on this one machine, for jaxtrain's Slurm tests.
#
#   scripts/slurm_cluster.sh start    install slurm-wlm and munge if missing, start the cluster
#   scripts/slurm_cluster.sh stop     stop every daemon, delete the namespaces (the nodes' own
#                                     filesystems with them) and the bridge
#   scripts/slurm_cluster.sh status   exit 0 when the cluster is up (prints sinfo)
#   scripts/slurm_cluster.sh env      print the variables a client needs (SLURM_CONF=...)
#
# Each node is its own host: a network namespace joined to a bridge by a veth pair, with its own
# address (198.18.0.1N; the bridge, where slurmctld and the driver live, is 198.18.0.1), its own
# hostname (a UTS namespace), its own /etc/hosts (so that Gloo finds its address), and its own
# /dev/shm, /tmp, /var/tmp and ~/.cache (root's, the home of the user that runs the tests):
# empty tmpfs's in its mount namespace, seen by no other node and not by the driver, where
# jaxtrain keeps its host-local files (in-memory checkpoints, temporary directories, staging
# copies and caches). A task's HOME is the one srun passes on from the driver: a driver whose
# HOME is elsewhere has no private ~/.cache on the nodes.
#
# Shared, as a real cluster shares them by installation, is the rest of this machine's
# filesystems: the checkout, its virtual environment and the Python it runs on (the "image", at
# the same path on every node); munged's socket under /run; and $STATE, kept visible over the
# private /var/tmp: slurm.conf, slurmd's spool, pid and log files, and $STATE/shared, which
# stands for an NFS mount. A path on a local filesystem counts as node-local by its filesystem
# type, as jaxtrain judges it on a real cluster. scripts/lib/netns.sh says how.
#
# Addresses are in 198.18.0.0/15 (reserved for benchmark testing); the namespaces have no route
# beyond the bridge, so no traffic leaves the machine. Needs root. `start` is idempotent: a
# running cluster is left as it is, a half-started one is stopped first.
set -euo pipefail
# shellcheck source=lib/netns.sh
source "$(dirname "$0")/lib/netns.sh"
# shellcheck source=lib/cluster_lock.sh
source "$(dirname "$0")/lib/cluster_lock.sh"

NODES=${JAXTRAIN_SLURM_TEST_NODES:-2}
CPUS_PER_NODE=${JAXTRAIN_SLURM_TEST_CPUS:-2}
STATE=${JAXTRAIN_SLURM_TEST_STATE:-/var/tmp/jaxtrain-slurm}
REPO=$(realpath "$(dirname "$0")/..")
BRIDGE=jtslurm0
BRIDGE_ADDR=198.18.0.1
PREFIX=24
CONF=$STATE/etc/slurm.conf

node_name() { echo "node$1"; }
node_ns() { echo "jtslurm-node$1"; }
node_addr() { echo "198.18.0.$((10 + $1))"; }
node_veth() { echo "jtslurm-v$1"; }

say() { echo "slurm_cluster: $*" >&2; }

need_root() {
  if [[ $(id -u) -ne 0 ]]; then
    say "must run as root (network namespaces, slurmd)"
    exit 77
  fi
}

install_packages() {
  local missing=()
  for p in slurm-wlm munge iproute2; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
  done
  if ((${#missing[@]})); then
    say "installing Debian packages: ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" \
      >/dev/null
  fi
}

start_munge() {
  if munge -n </dev/null >/dev/null 2>&1; then return; fi
  if [[ ! -s /etc/munge/munge.key ]]; then
    say "creating /etc/munge/munge.key"
    install -d -o munge -g munge -m 0700 /etc/munge
    head -c 1024 /dev/urandom >/etc/munge/munge.key
    chown munge:munge /etc/munge/munge.key
    chmod 0400 /etc/munge/munge.key
  fi
  install -d -o munge -g munge -m 0755 /run/munge
  runuser -u munge -- /usr/sbin/munged
  touch "$STATE/started-munged"  # stop ends only a munged that start started
  for _ in $(seq 50); do
    munge -n </dev/null >/dev/null 2>&1 && return
    sleep 0.1
  done
  say "munged did not start"
  exit 1
}

write_config() {
  mkdir -p "$STATE"/{etc,log,run,spool,ctld,shared}
  local host
  host=$(hostname)
  cat >"$CONF" <<EOF
# Written by scripts/slurm_cluster.sh; the cluster is started and stopped by it.
ClusterName=jaxtrain-test
SlurmctldHost=${host}(${BRIDGE_ADDR})
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SlurmdParameters=config_overrides
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
SlurmctldPort=6817
SlurmdPort=6818
# Short timeouts: a lost node is noticed in seconds, a cancelled step is killed quickly.
SlurmdTimeout=10
KillWait=5
# A step whose processes outlive SIGKILL for this long drains its node ("Kill task failed"),
# and every later test then waits for a node that never comes back. On a loaded 2-core machine
# a requeued step's JAX processes took ~70 s to be gone (Slurm's default: 60 s).
UnkillableStepTimeout=180
InactiveLimit=0
MinJobAge=30
EOF
  for i in $(seq "$NODES"); do
    echo "NodeName=$(node_name "$i") NodeAddr=$(node_addr "$i") CPUs=$CPUS_PER_NODE" \
      "RealMemory=2000 State=UNKNOWN" >>"$CONF"
  done
  echo "PartitionName=jaxtrain Nodes=ALL Default=YES MaxTime=INFINITE State=UP" >>"$CONF"
  cat >"$STATE/etc/cgroup.conf" <<EOF
CgroupPlugin=cgroup/v1
CgroupMountpoint=/sys/fs/cgroup
IgnoreSystemd=yes
EOF
}

setup_network() {
  netns_bridge_up "$BRIDGE" "$BRIDGE_ADDR" "$PREFIX"
  local hosts="127.0.0.1 localhost"$'\n'"$BRIDGE_ADDR $(hostname)"
  for i in $(seq "$NODES"); do hosts+=$'\n'"$(node_addr "$i") $(node_name "$i")"; done
  for i in $(seq "$NODES"); do
    netns_host_add "$(node_ns "$i")" "$(node_veth "$i")" "$(node_addr "$i")" "$PREFIX" "$BRIDGE" \
      "$hosts"
  done
}

start_daemons() {
  slurmctld -f "$CONF" -c
  for i in $(seq "$NODES"); do
    # The node's own name and filesystems (scripts/lib/netns.sh); slurmd keeps them alive, and
    # every task it starts inherits them.
    netns_host_start "$(node_ns "$i")" "$(node_name "$i")" "$STATE:$REPO" \
      slurmd -f "$CONF" -N "$(node_name "$i")"
  done
}

wait_idle() {
  for _ in $(seq 150); do
    local states
    states=$(SLURM_CONF=$CONF sinfo -h -N -o '%t' 2>/dev/null | sort -u | tr '\n' ' ')
    if [[ $states == "idle " ]] &&
      [[ $(SLURM_CONF=$CONF sinfo -h -N -o '%N' | wc -l) -eq $NODES ]]; then
      return 0
    fi
    sleep 0.2
  done
  say "the nodes did not become idle; sinfo says:"
  SLURM_CONF=$CONF sinfo -N >&2 || true
  tail -n 20 "$STATE"/log/*.log >&2 || true
  return 1
}

is_up() {
  pid_alive "$STATE/run/slurmctld.pid" || return 1
  for i in $(seq "$NODES"); do
    pid_alive "$STATE/run/slurmd-$(node_name "$i").pid" || return 1
  done
  [[ $(SLURM_CONF=$CONF sinfo -h -N -o '%t' 2>/dev/null | grep -cE '^(idle|alloc|mix)') -eq $NODES ]]
}

cmd_stop() {
  need_root
  for i in $(seq "$NODES"); do
    stop_pidfile "$STATE/run/slurmd-$(node_name "$i").pid"
    # Whatever still runs on the node (steps' tasks, slurmstepd) goes with it.
    netns_host_del "$(node_ns "$i")" "$(node_veth "$i")"
  done
  stop_pidfile "$STATE/run/slurmctld.pid"
  netns_bridge_del "$BRIDGE"
  if [[ -f $STATE/started-munged ]]; then
    local munged_pid
    munged_pid=$(cat /run/munge/munged.pid 2>/dev/null || true)
    [[ -n $munged_pid ]] && kill "$munged_pid" 2>/dev/null || true
  fi
  rm -rf "$STATE"
  say "stopped"
}

cmd_start() {
  need_root
  if [[ -f $CONF ]] && is_up; then
    say "already running"
    return 0
  fi
  install_packages
  cmd_stop >/dev/null 2>&1 || true
  mkdir -p "$STATE"
  start_munge
  write_config
  setup_network
  start_daemons
  wait_idle
  say "up: $NODES nodes, SLURM_CONF=$CONF, shared directory $STATE/shared"
}

case "${1:-}" in
  start | stop) cluster_lock_check "$STATE.lock" "the Slurm test cluster" ;;
esac
case "${1:-}" in
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) is_up && SLURM_CONF=$CONF sinfo -N ;;
  env) echo "SLURM_CONF=$CONF" ;;
  *)
    echo "usage: $0 start|stop|status|env" >&2
    exit 2
    ;;
esac

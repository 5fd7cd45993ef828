# A test cluster belongs to the test run that started it. Sourced, not run (scripts/ssh_hosts.sh,
# scripts/slurm_cluster.sh, scripts/kubernetes/cluster.sh).
#
# A test session (tests/cluster_lock.py) holds an flock on <state>.lock from before its cluster's
# `start` to after its `stop`, and hands the locked descriptor to each command that changes the
# cluster in JAXTRAIN_TEST_CLUSTER_LOCK_FD. Such a command from anywhere else (a second test run,
# a developer's shell) finds the lock held and refuses, naming the holder, instead of pulling the
# cluster from under a running suite. Nothing holds the lock between commands run by hand.

# cluster_lock_check LOCKFILE WHAT: returns when this command may change the cluster; otherwise
# says who holds it and exits 1. The handed-down descriptor is closed here, so that no daemon the
# command starts keeps the lock after its test session.
cluster_lock_check() {
  local lock=$1 what=$2 fd=${JAXTRAIN_TEST_CLUSTER_LOCK_FD:-}
  if [[ $fd =~ ^[0-9]+$ && -e /proc/self/fd/$fd ]] &&
     [[ $(readlink -f "/proc/self/fd/$fd") == "$(readlink -f "$lock")" ]]; then
    eval "exec $fd>&-"
    return 0  # the session holding the lock asked for this
  fi
  mkdir -p "$(dirname "$lock")"
  if ! flock -n "$lock" true; then
    echo "$what: in use by the test run of pid $(cat "$lock" 2>/dev/null || echo '?') (it holds" \
         "$lock); not touching it. It is stopped when that run ends." >&2
    exit 1
  fi
}

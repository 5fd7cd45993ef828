#!/usr/bin/env bash
# Test hosts reachable over real OpenSSH on this one machine, for jaxtrain's ssh launcher tests.
#
#   scripts/ssh_hosts.sh start    install openssh-server if missing, make the hosts, start sshd
#   scripts/ssh_hosts.sh stop     stop every sshd, delete the namespaces (the hosts' own
#                                 filesystems with them), the bridge and the keys
#   scripts/ssh_hosts.sh status   exit 0 when every sshd is up
#   scripts/ssh_hosts.sh env      print what a client needs (JAXTRAIN_SSH_COMMAND=...)
#
# Each host is a network namespace (scripts/lib/netns.sh) with its own address (198.19.13.1N; the
# bridge, where the driver lives, is 198.19.13.1), hostname (host1, host2, ...: a UTS namespace)
# and /etc/hosts. Hosts 1..SSHD_HOSTS run Debian's sshd on port 22; the others run none (a host
# that refuses ssh).
#
# Each sshd host has its own /dev/shm, /tmp, /var/tmp and ~/.cache (root's: the user ssh logs in
# as): empty tmpfs's in its mount namespace, seen by no other host and not by the driver, where
# jaxtrain keeps its host-local files (in-memory checkpoints, temporary directories, staging
# copies and caches). Shared, as a real cluster shares them by installation, is the rest of this
# machine's filesystems: the checkout, its virtual environment and the Python it runs on (the
# "image", at the same path on every host). And $STATE, kept visible over the private /var/tmp:
# the sshd configs and keys, and $STATE/shared, which stands for an NFS mount: the only directory
# that every host and the driver share for writing. scripts/lib/netns.sh says how.
#
# Keys are made fresh by every `start`, in $STATE, never anywhere else: a client key (the only
# one sshd accepts), one host key per host, and $STATE/ssh_config, which names the hosts
# (host1 -> 198.19.13.11, ...), the key and the known_hosts file. The alias "stranger" is host2
# with a known_hosts file that lacks its key. Needs root. `start` stops a half-started set first.
set -euo pipefail
# shellcheck source=lib/netns.sh
source "$(dirname "$0")/lib/netns.sh"
# shellcheck source=lib/cluster_lock.sh
source "$(dirname "$0")/lib/cluster_lock.sh"

HOSTS=${JAXTRAIN_SSH_TEST_HOSTS:-3}
SSHD_HOSTS=${JAXTRAIN_SSH_TEST_SSHD_HOSTS:-2}
STATE=${JAXTRAIN_SSH_TEST_STATE:-/var/tmp/jaxtrain-ssh}
REPO=$(realpath "$(dirname "$0")/..")
BRIDGE=jtssh0
BRIDGE_ADDR=198.19.13.1
PREFIX=24

host_name() { echo "host$1"; }
host_ns() { echo "jtssh-host$1"; }
host_addr() { echo "198.19.13.$((10 + $1))"; }
host_veth() { echo "jtssh-v$1"; }

say() { echo "ssh_hosts: $*" >&2; }

need_root() {
  if [[ $(id -u) -ne 0 ]]; then
    say "must run as root (network namespaces, sshd)"
    exit 77
  fi
}

install_packages() {
  local missing=()
  for p in openssh-server openssh-client iproute2; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
  done
  if ((${#missing[@]})); then
    say "installing Debian packages: ${missing[*]}"
    apt-get update -qq
    # The package's own sshd service must not start on this machine's addresses.
    local policy=/usr/sbin/policy-rc.d made_policy=""
    if [[ ! -e $policy ]]; then
      printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy" && made_policy=1
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" \
      >/dev/null
    # As the function's last command, a bare `[[ ]] && rm` would return 1 where the machine had
    # its own policy (Docker images do) and end the script under `set -e`.
    if [[ -n $made_policy ]]; then rm -f "$policy"; fi
  fi
}

make_keys() {
  mkdir -p "$STATE"/{run,log,shared}
  ssh-keygen -q -t ed25519 -N "" -C "jaxtrain-test-client" -f "$STATE/id_ed25519"
  cp "$STATE/id_ed25519.pub" "$STATE/authorized_keys"
  : >"$STATE/known_hosts"
  : >"$STATE/known_hosts_empty"
  for i in $(seq "$HOSTS"); do
    ssh-keygen -q -t ed25519 -N "" -C "$(host_name "$i")" -f "$STATE/host$i.key"
    echo "$(host_name "$i"),$(host_addr "$i") $(cut -d' ' -f1,2 "$STATE/host$i.key.pub")" \
      >>"$STATE/known_hosts"
  done
  {
    echo "# Written by scripts/ssh_hosts.sh for the test hosts; deleted by its stop."
    echo "Host stranger"
    echo "  HostName $(host_addr 2)"
    echo "  UserKnownHostsFile $STATE/known_hosts_empty"
    for i in $(seq "$HOSTS"); do
      echo "Host $(host_name "$i")"
      echo "  HostName $(host_addr "$i")"
    done
    echo "Host *"
    echo "  User root"
    echo "  IdentityFile $STATE/id_ed25519"
    echo "  IdentitiesOnly yes"
    echo "  UserKnownHostsFile $STATE/known_hosts"
    echo "  GlobalKnownHostsFile /dev/null"
    echo "  StrictHostKeyChecking yes"
    echo "  ConnectTimeout 5"
  } >"$STATE/ssh_config"
}

write_sshd_config() {
  local i=$1
  cat >"$STATE/sshd_config_$i" <<CONF
# Written by scripts/ssh_hosts.sh for test host $(host_name "$i").
ListenAddress $(host_addr "$i"):22
HostKey $STATE/host$i.key
PidFile $STATE/run/sshd-$i.pid
AuthorizedKeysFile $STATE/authorized_keys
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PrintMotd no
ClientAliveInterval 5
ClientAliveCountMax 3
CONF
}

setup_network() {
  netns_bridge_up "$BRIDGE" "$BRIDGE_ADDR" "$PREFIX"
  local hosts="127.0.0.1 localhost"$'\n'"$BRIDGE_ADDR $(hostname)"
  for i in $(seq "$HOSTS"); do hosts+=$'\n'"$(host_addr "$i") $(host_name "$i")"; done
  for i in $(seq "$HOSTS"); do
    netns_host_add "$(host_ns "$i")" "$(host_veth "$i")" "$(host_addr "$i")" "$PREFIX" "$BRIDGE" \
      "$hosts"
  done
}

start_sshd() {
  mkdir -p /run/sshd  # sshd's privilege separation directory
  for i in $(seq "$SSHD_HOSTS"); do
    write_sshd_config "$i"
    # The host's own name and filesystems (scripts/lib/netns.sh); sshd keeps them alive, and
    # every session inherits them.
    netns_host_start "$(host_ns "$i")" "$(host_name "$i")" "$STATE:$REPO" \
      /usr/sbin/sshd -f "$STATE/sshd_config_$i" -E "$STATE/log/sshd-$i.log"
  done
  for i in $(seq "$SSHD_HOSTS"); do
    local up=""
    for _ in $(seq 100); do
      if ssh -F "$STATE/ssh_config" -o BatchMode=yes "$(host_name "$i")" true 2>/dev/null; then
        up=1
        break
      fi
      sleep 0.1
    done
    if [[ -z $up ]]; then
      say "sshd on $(host_name "$i") does not answer:"
      cat "$STATE/log/sshd-$i.log" >&2 || true
      return 1
    fi
  done
}

is_up() {
  [[ -f $STATE/ssh_config ]] || return 1
  for i in $(seq "$SSHD_HOSTS"); do
    pid_alive "$STATE/run/sshd-$i.pid" || return 1
  done
}

cmd_stop() {
  need_root
  for i in $(seq "$HOSTS"); do
    stop_pidfile "$STATE/run/sshd-$i.pid"
    # Whatever still runs on the host (sessions, workers) goes with it.
    netns_host_del "$(host_ns "$i")" "$(host_veth "$i")"
  done
  netns_bridge_del "$BRIDGE"
  rm -rf "$STATE"
  say "stopped"
}

cmd_start() {
  need_root
  if is_up; then
    say "already running"
    return 0
  fi
  install_packages
  cmd_stop >/dev/null 2>&1 || true
  make_keys
  setup_network
  start_sshd
  say "up: $HOSTS hosts, sshd on $SSHD_HOSTS; $(cmd_env)"
}

cmd_env() { echo "JAXTRAIN_SSH_COMMAND=ssh -F $STATE/ssh_config"; }

case "${1:-}" in
  start | stop) cluster_lock_check "$STATE.lock" "the ssh test hosts" ;;
esac
case "${1:-}" in
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) is_up ;;
  env) cmd_env ;;
  *)
    echo "usage: $0 start|stop|status|env" >&2
    exit 2
    ;;
esac

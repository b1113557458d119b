#!/usr/bin/env bash
# A real SLURM cluster on this one machine, for tests and trials of launch/slurm.sbatch:
# Debian's slurm-wlm (slurmctld, one slurmd per node name, munge) with slurmdbd on MariaDB, so that
# sacct works.  Every daemon listens on 127.0.0.1 only.  Idempotent: what runs already is kept.
#
#   scripts/setup_slurm.sh            # install (apt-get, as root) when missing, configure, start
#   scripts/setup_slurm.sh --stop     # stop the daemons it started (munge and MariaDB stay up)
#
# Environment: SLURM_SETUP_NODES (2), SLURM_SETUP_CPUS (4 CPUs per node), SLURM_SETUP_GPUS (8
# stand-in GPUs per node, empty files with no device behind them: they make `#SBATCH
# --gpus-per-node` schedulable and set SLURM_GPUS_PER_NODE/ON_NODE; the ranks run on CPUs),
# SLURM_SETUP_PORT (6817: slurmctld; slurmdbd +2; the slurmds +4 onwards).  Nodes are n1..nN, all
# on this host.  Without root, a cluster this script set up and that is up counts as ready.
# Exit status: 0 ready; 3 skipped, with one line `setup_slurm.sh: skipped: <why>` (not root, no
# apt-get, a slurm.conf of another origin); 1 failed (the line names the daemon and its log).
set -euo pipefail

NODES="${SLURM_SETUP_NODES:-2}"
CPUS="${SLURM_SETUP_CPUS:-4}"
GPUS="${SLURM_SETUP_GPUS:-8}"
PORT="${SLURM_SETUP_PORT:-6817}"
ETC=/etc/slurm
STATE=/var/lib/megazero-slurm
LOGS=/var/log/slurm
MARK="# written by megazero scripts/setup_slurm.sh"
PACKAGES=(slurm-wlm slurmctld slurmd slurm-client slurmdbd munge mariadb-server)

say() { echo "setup_slurm.sh: $*"; }
skip() { say "skipped: $*"; exit 3; }
fail() { say "failed: $*" >&2; exit 1; }
running() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
stop_pidfile() {  # the daemon named by a pid file, and wait for it to go
  if running "$1"; then
    local pid; pid="$(cat "$1")"
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$1"  # a stale one makes Debian's slurmctld prerm call scancel on a controller that is gone
}
nodes_up() {  # every node answers and can run jobs: idle, mixed, allocated (no '*': not responding)
  states="$(sinfo -h -N -o '%T' 2>/dev/null | sort -u | tr '\n' ' ')"
  [ -n "$states" ] || return 1
  for st in $states; do
    case "$st" in idle|mixed|allocated|completing) ;; *) return 1 ;; esac
  done
}
stop_all() {
  for n in $(seq "$NODES"); do stop_pidfile "/run/slurmd-n$n.pid"; done
  stop_pidfile /run/slurmctld.pid
  stop_pidfile /run/slurmdbd.pid
}

case "${1:-}" in
  --stop) [ "$(id -u)" = 0 ] || skip "not root"; stop_all; say "stopped"; exit 0 ;;
  "") ;;
  *) echo "usage: setup_slurm.sh [--stop]" >&2; exit 2 ;;
esac
case "$NODES$CPUS$GPUS$PORT" in
  *[!0-9]*) fail "SLURM_SETUP_NODES, SLURM_SETUP_CPUS, SLURM_SETUP_GPUS and SLURM_SETUP_PORT must be whole numbers" ;;
esac

if [ "$(id -u)" != 0 ]; then
  if grep -qF "$MARK" "$ETC/slurm.conf" 2>/dev/null && nodes_up; then say "ready (already up; not root)"; exit 0; fi
  skip "not root: installing and starting slurmctld/slurmd/munge needs root"
fi
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null \
   || ! command -v slurmdbd >/dev/null || ! command -v munged >/dev/null || ! command -v mariadbd >/dev/null; then
  command -v apt-get >/dev/null || skip "slurm-wlm is not installed and there is no apt-get to install it"
  say "installing ${PACKAGES[*]} (apt-get)"
  export DEBIAN_FRONTEND=noninteractive
  if ! apt-get install -y -q --no-install-recommends "${PACKAGES[@]}" >"/tmp/setup_slurm_apt.log" 2>&1; then
    apt-get update -q >>"/tmp/setup_slurm_apt.log" 2>&1 || true
    apt-get install -y -q --no-install-recommends "${PACKAGES[@]}" >>"/tmp/setup_slurm_apt.log" 2>&1 \
      || skip "apt-get install ${PACKAGES[*]} failed (log: /tmp/setup_slurm_apt.log)"
  fi
fi
if [ -f "$ETC/slurm.conf" ] && ! grep -qF "$MARK" "$ETC/slurm.conf"; then
  skip "$ETC/slurm.conf exists and was not written by this script; not touching a site's cluster"
fi

host="$(hostname -s)"
# slurmdbd and srun bind to the address this host's name resolves to (NoInAddrAny): it must be loopback
addr="$(getent ahostsv4 "$host" 2>/dev/null || true)"
addr="${addr%%[[:space:]]*}"
case "$addr" in
  127.*) ;;
  *) skip "this host's name ($host) resolves to '${addr:-nothing}', not to a loopback address: the daemons would listen there (a line '127.0.1.1 $host' in /etc/hosts fixes it)" ;;
esac
last=$((NODES))
mkdir -p "$ETC" "$STATE/ctld" "$LOGS" /var/spool/slurmd
chown slurm:slurm "$STATE/ctld" "$LOGS"
new="$(mktemp -d)"
cat >"$new/slurm.conf" <<EOF
$MARK: a cluster of $NODES nodes on this host
ClusterName=megazero
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$PORT
SlurmUser=slurm
AuthType=auth/munge
CredType=cred/munge
# a requeued job waits cred_expire seconds before it may start again (120 by default)
AuthInfo=cred_expire=20
# bind to the configured addresses (127.0.0.1), never to all interfaces
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
SrunPortRange=$((PORT + 100))-$((PORT + 400))
StateSaveLocation=$STATE/ctld
SlurmctldPidFile=/run/slurmctld.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdPidFile=/run/slurmd-%n.pid
SlurmdSpoolDir=/var/spool/slurmd/%n
SlurmdLogFile=$LOGS/slurmd-%n.log
# no cgroups here: processes are tracked through /proc, tasks are not bound
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
# the node sizes below are declared, not detected
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
MinJobAge=600
KillWait=30
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$((PORT + 2))
JobCompType=jobcomp/none
NodeName=n[1-$last] NodeHostname=$host NodeAddr=127.0.0.1 Port=$((PORT + 4))-$((PORT + 3 + NODES)) CPUs=$CPUS Gres=gpu:$GPUS State=UNKNOWN
PartitionName=debug Nodes=n[1-$last] Default=YES MaxTime=INFINITE State=UP
EOF
# GPU GRES needs a File per device: empty files stand in (no device behind them)
mkdir -p "$STATE/gpus"
for i in $(seq 0 $((GPUS - 1))); do : >"$STATE/gpus/gpu$i"; done
cat >"$new/gres.conf" <<EOF
$MARK
Name=gpu File=$STATE/gpus/gpu[0-$((GPUS - 1))]
EOF
cat >"$new/slurmdbd.conf" <<EOF
$MARK
DbdHost=$host
DbdAddr=127.0.0.1
DbdPort=$((PORT + 2))
# bind to this host's address (not documented for slurmdbd in 22.05, but read: see the check below)
CommunicationParameters=NoInAddrAny
SlurmUser=slurm
PidFile=/run/slurmdbd.pid
LogFile=$LOGS/slurmdbd.log
# MariaDB through its Unix socket, the OS user slurm authenticated by unix_socket: no password
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StorageLoc=slurm_acct_db
EOF
changed=0
for f in slurm.conf gres.conf slurmdbd.conf; do
  if ! cmp -s "$new/$f" "$ETC/$f"; then cp "$new/$f" "$ETC/$f"; changed=1; fi
done
rm -rf "$new"
chmod 644 "$ETC/slurm.conf" "$ETC/gres.conf"
chown slurm:slurm "$ETC/slurmdbd.conf"
chmod 600 "$ETC/slurmdbd.conf"
if [ "$changed" = 1 ]; then say "configuration written to $ETC; restarting what runs"; stop_all; fi

# the node names resolve to this host, as a cluster's node names resolve to its nodes
for n in $(seq "$NODES"); do
  getent hosts "n$n" >/dev/null || echo "127.0.0.1 n$n  $MARK" >>/etc/hosts
done

# munge: the credentials of every SLURM message
if ! (munge -n | unmunge) >/dev/null 2>&1; then
  [ -f /etc/munge/munge.key ] || runuser -u munge -- mungekey --create >/dev/null
  mkdir -p /run/munge && chown munge:munge /run/munge
  runuser -u munge -- /usr/sbin/munged || fail "munged did not start (/var/log/munge/munged.log)"
  for _ in $(seq 50); do (munge -n | unmunge) >/dev/null 2>&1 && break; sleep 0.1; done
fi

# MariaDB for slurmdbd (Debian's default bind-address is 127.0.0.1)
if ! mysqladmin ping >/dev/null 2>&1; then
  /etc/init.d/mariadb start >/tmp/setup_slurm_mariadb.log 2>&1 || fail "MariaDB did not start (/tmp/setup_slurm_mariadb.log)"
fi
mysql -e "CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED VIA unix_socket;
          GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';" || fail "could not create MariaDB's user slurm"

if ! running /run/slurmdbd.pid; then
  slurmdbd || fail "slurmdbd did not start ($LOGS/slurmdbd.log)"
fi
for _ in $(seq 100); do sacctmgr -n list cluster >/dev/null 2>&1 && break; sleep 0.2; done
if ! sacctmgr -n -P list cluster format=cluster 2>/dev/null | grep -qx megazero; then
  sacctmgr -i add cluster megazero >/dev/null || fail "sacctmgr could not add the cluster ($LOGS/slurmdbd.log)"
fi
if ! running /run/slurmctld.pid; then
  slurmctld || fail "slurmctld did not start ($LOGS/slurmctld.log)"
fi
for n in $(seq "$NODES"); do
  if ! running "/run/slurmd-n$n.pid"; then
    slurmd -N "n$n" || fail "slurmd -N n$n did not start ($LOGS/slurmd-n$n.log)"
  fi
done

for _ in $(seq 150); do
  nodes_up && break
  if [[ "$states" =~ (down|drain|inval) ]]; then  # left so by an earlier run: ReturnToService=2 does the rest
    scontrol update nodename="n[1-$last]" state=resume >/dev/null 2>&1 || true
  fi
  sleep 0.2
done
nodes_up || fail "nodes not up (states: $states; $LOGS/slurmctld.log, $LOGS/slurmd-n1.log)"
# every daemon of the cluster listens on loopback only (LISTEN sockets in /proc/net/tcp)
ports=" $PORT $((PORT + 2)) $(seq -s ' ' $((PORT + 4)) $((PORT + 3 + NODES))) "
while read -r _ local _ st _; do
  [ "$st" = 0A ] || continue
  p=$((16#${local#*:}))
  [[ "$ports" == *" $p "* ]] || continue
  if [ "${local:6:2}" != 7F ]; then
    stop_all
    fail "port $p listened on ${local%%:*} (hex), not on loopback; the daemons are stopped"
  fi
done < <(tail -n +2 /proc/net/tcp)
say "ready: cluster megazero, nodes n[1-$last] ($CPUS CPUs, $GPUS stand-in GPUs each) on 127.0.0.1, slurmctld :$PORT, slurmdbd :$((PORT + 2))"

#!/usr/bin/env bash
# A real one-node Slurm cluster on 127.0.0.1, for the `slurm` tests and for trying the
# launchers without a cluster: Debian's Slurm, munge, and slurmdbd over a private MariaDB
# (real `sacct`, which submitit polls: without accounting a cancelled job is waited on
# forever). Needs root and Debian's packages; no systemd. Idempotent.
#
#   scripts/slurm/local_cluster.sh start    # about 15 s the first time (installs), 1 s after
#   scripts/slurm/local_cluster.sh stop
#
# State, logs and pid files live in $CIUIC_SLURM_DIR (default /tmp/ciuic-slurm). It
# writes /etc/slurm and /etc/munge, and uses ports 6817-6819 and 3306.
set -euo pipefail
state=${CIUIC_SLURM_DIR:-/tmp/ciuic-slurm}
node=$(hostname -s)
pidfiles=("$state/slurmd.pid" "$state/slurmctld.pid" "$state/slurmdbd.pid" "$state/db/mariadbd.pid" /run/munge/munged.pid)

say() { echo "[local-slurm $(date +%T)] $*"; }
running() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
until_ok() {  # until_ok SECONDS COMMAND...: retry a command every 0.2 s
  local deadline=$((SECONDS + $1)); shift
  until "$@" >/dev/null 2>&1; do
    if [ $SECONDS -ge $deadline ]; then say "gave up waiting for: $*"; tail -n 20 "$state"/log/*.log 2>/dev/null; return 1; fi
    sleep 0.2
  done
}
stop_pid() {
  running "$1" || return 0
  local pid; pid=$(cat "$1"); kill "$pid"
  for _ in $(seq 75); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.2; done
  kill -9 "$pid" 2>/dev/null || true
}

stop() { for f in "${pidfiles[@]}"; do stop_pid "$f"; done; say "stopped"; }

install_packages() {
  local wanted="munge slurmctld slurmd slurm-client slurmdbd mariadb-server" missing=""
  for p in $wanted; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing="$missing $p"; done
  [ -z "$missing" ] && return 0
  say "installing$missing"
  # Package scripts must not start the services: we start them ourselves, without systemd.
  local own_policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; own_policy=1; fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing >/dev/null
  if [ $own_policy = 1 ]; then rm -f /usr/sbin/policy-rc.d; fi
}

write_slurm_conf() {
  local mem_mb conf
  mem_mb=$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)  # under the real size, or the node is drained
  conf=$(mktemp)
  cat >"$conf" <<EOF
ClusterName=ciuic
SlurmctldHost=$node(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$state/ctld
SlurmdSpoolDir=$state/spool
SlurmctldPidFile=$state/slurmctld.pid
SlurmdPidFile=$state/slurmd.pid
SlurmctldLogFile=$state/log/slurmctld.log
SlurmdLogFile=$state/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MinJobAge=3600
KillWait=5
MailProg=/bin/true
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
JobAcctGatherType=jobacct_gather/linux
NodeName=$node NodeAddr=127.0.0.1 CPUs=$(nproc) RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP
EOF
  if ! cmp -s "$conf" /etc/slurm/slurm.conf; then
    say "writing /etc/slurm/slurm.conf"
    install -m 644 "$conf" /etc/slurm/slurm.conf
    stop_pid "$state/slurmd.pid"; stop_pid "$state/slurmctld.pid"  # they read it at start only
  fi
  rm -f "$conf"
}

start_munge() {
  if [ ! -s /etc/munge/munge.key ]; then
    mungekey --create --keyfile=/etc/munge/munge.key
    chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key
  fi
  mkdir -p /run/munge; chown munge:munge /run/munge
  if ! (munge -n </dev/null | unmunge) >/dev/null 2>&1; then
    say "starting munged"; runuser -u munge -- /usr/sbin/munged
    until_ok 10 sh -c 'munge -n </dev/null | unmunge'
  fi
}

start_accounting() {
  local socket="$state/db/mysql.sock"
  mkdir -p "$state/db"; chown mysql:mysql "$state/db"
  if ! mariadb-admin --socket="$socket" ping >/dev/null 2>&1; then
    [ -d "$state/db/data/mysql" ] || mariadb-install-db --user=mysql --datadir="$state/db/data" --skip-test-db >"$state/log/mariadb-install.log" 2>&1
    say "starting mariadbd"
    setsid /usr/sbin/mariadbd --no-defaults --user=mysql --datadir="$state/db/data" --socket="$socket" \
      --bind-address=127.0.0.1 --port=3306 --pid-file="$state/db/mariadbd.pid" --skip-name-resolve \
      --innodb-buffer-pool-size=128M >>"$state/log/mariadbd.log" 2>&1 </dev/null &
    until_ok 60 mariadb-admin --socket="$socket" ping
    mariadb --socket="$socket" -u root -e "CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm';
      GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1'; FLUSH PRIVILEGES;"
  fi
  cat >/etc/slurm/slurmdbd.conf <<EOF
AuthType=auth/munge
DbdAddr=127.0.0.1
DbdHost=localhost
SlurmUser=root
LogFile=$state/log/slurmdbd.log
PidFile=$state/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=3306
StorageUser=slurm
StoragePass=slurm
EOF
  chmod 600 /etc/slurm/slurmdbd.conf
  running "$state/slurmdbd.pid" || { say "starting slurmdbd"; /usr/sbin/slurmdbd; }
  until_ok 60 sacctmgr -n list cluster
  sacctmgr -n -P list cluster format=cluster | grep -qx ciuic || sacctmgr -i add cluster ciuic >/dev/null
}

start() {
  install_packages
  mkdir -p "$state"/{ctld,spool,log}
  write_slurm_conf
  start_munge
  start_accounting
  running "$state/slurmctld.pid" || { say "starting slurmctld"; /usr/sbin/slurmctld; }
  until_ok 30 scontrol ping
  running "$state/slurmd.pid" || { say "starting slurmd"; /usr/sbin/slurmd; }
  node_up() { sinfo -h -n "$node" -o %T | grep -qE '^(idle|mixed|allocated|completing)$'; }
  if ! until_ok 30 node_up; then scontrol update nodename="$node" state=resume || true; until_ok 15 node_up; fi
  say "ready"; sinfo
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac

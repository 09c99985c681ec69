#!/usr/bin/env bash
# A real one-node Slurm cluster on 127.0.0.1, for the `slurm` tests and for trying the
# launchers without a cluster: Debian's Slurm, munge, and slurmdbd over a private MariaDB
# (real `sacct`, which submitit polls: without accounting a cancelled job is waited on
# forever). Needs root and Debian's packages; no systemd. Idempotent.
#
#   scripts/slurm/local_cluster.sh start    # about 15 s the first time (installs), 1 s after
#   scripts/slurm/local_cluster.sh stop     # stops the two-node cluster too
#
# Two nodes: after `scripts/cluster/netns_cluster.sh up`, `start-netns` runs a second cluster
# (ciuicnet) with one slurmd per emulated host (host0, host1, ...; slurmctld on host0);
# Slurm's commands for it run on host0: `netns_cluster.sh exec 0 srun -N 2 ...`. It restarts
# any of its daemons that is gone (`netns_cluster.sh kill N` kills a host's slurmd too);
# `stop-netns` stops it alone. The one-node cluster and it can run side by side.
#
# State, logs and pid files live in $CIUIC_SLURM_DIR (default /tmp/ciuic-slurm). It
# writes /etc/slurm and /etc/munge (start-netns: /etc/netns/ciuic-host*/slurm), and uses
# ports 6817-6819 and 3306 (start-netns: the same ports inside the hosts' namespaces).
set -euo pipefail
state=${CIUIC_SLURM_DIR:-/tmp/ciuic-slurm}
node=$(hostname -s)
socket="$state/db/mysql.sock"
pidfiles=("$state/slurmd.pid" "$state/slurmctld.pid" "$state/slurmdbd.pid" "$state/db/mariadbd.pid" /run/munge/munged.pid)

say() { echo "[local-slurm $(date +%T)] $*"; }
running() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
until_ok() {  # until_ok SECONDS COMMAND...: retry a command every 0.2 s
  local deadline=$((SECONDS + $1)); shift
  until "$@" >/dev/null 2>&1; do
    if [ $SECONDS -ge $deadline ]; then say "gave up waiting for: $*"; tail -n 20 "$state"/log/*.log "$state"/netns/log/*.log 2>/dev/null; return 1; fi
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

# Memory a node offers Slurm: under the real size, or the node is drained.
node_mem_mb() { awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo; }

# slurm.conf up to its node lines, the same for both clusters but for their names and places.
# slurm_conf_common CLUSTER CTLD_NAME CTLD_ADDR STATE_DIR [PER_NODE]: PER_NODE (%n) gives each
# slurmd of a machine its own spool folder, pid and log file.
slurm_conf_common() {
  local per_node_dir=${5:+/$5} per_node_file=${5:+-$5}
  cat <<EOF
ClusterName=$1
SlurmctldHost=$2($3)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$4/ctld
SlurmdSpoolDir=$4/spool$per_node_dir
SlurmctldPidFile=$4/slurmctld.pid
SlurmdPidFile=$4/slurmd$per_node_file.pid
SlurmctldLogFile=$4/log/slurmctld.log
SlurmdLogFile=$4/log/slurmd$per_node_file.log
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
AccountingStorageHost=$3
JobAcctGatherType=jobacct_gather/linux
EOF
}

write_slurm_conf() {
  local conf
  conf=$(mktemp)
  {
    slurm_conf_common ciuic "$node" 127.0.0.1 "$state"
    echo "NodeName=$node NodeAddr=127.0.0.1 CPUs=$(nproc) RealMemory=$(node_mem_mb) State=UNKNOWN"
    echo "PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP"
  } >"$conf"
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

start_mariadb() {
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
}

start_accounting() {
  start_mariadb
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

# --- Two (or more) nodes: one slurmd per emulated host of scripts/cluster/netns_cluster.sh ---
# Each host is a network namespace with its own address and hostname, and `ip netns exec`
# bind-mounts /etc/netns/ciuic-hostN/* over /etc: so each host gets its own /etc/slurm, and
# slurmd, srun and sbatch run there as on a real node. slurmctld and slurmdbd run on host0
# (the hosts cannot reach this machine's own namespace); munge and MariaDB are shared through
# their Unix sockets, which the filesystem carries across namespaces.
cluster=$(dirname "$(readlink -f "$0")")/../cluster/netns_cluster.sh
ns_state=$state/netns

on_host() { "$cluster" exec "$@"; }
ns_hosts() { ip netns list 2>/dev/null | awk '{print $1}' | grep -c '^ciuic-host[0-9]*$' || true; }
# A daemon left in the namespace of a host that `netns_cluster.sh down` removed is stopped.
running_on() {  # running_on HOST PIDFILE
  running "$2" || return 1
  [ "$(ip netns identify "$(cat "$2")" 2>/dev/null)" = "ciuic-host$1" ] && return 0
  stop_pid "$2"; return 1
}
ns_pidfiles() { echo "$ns_state"/slurmd-host*.pid "$ns_state/slurmctld.pid" "$ns_state/slurmdbd.pid"; }

write_netns_conf() {  # $1 number of hosts; the same slurm.conf on every host, slurmdbd.conf on host0
  local n=$1 i mem_mb conf changed=0
  mem_mb=$(node_mem_mb)
  conf=$(mktemp)
  slurm_conf_common ciuicnet host0 "$("$cluster" addr 0)" "$ns_state" %n >"$conf"
  for ((i = 0; i < n; i++)); do
    echo "NodeName=host$i NodeAddr=$("$cluster" addr "$i") CPUs=$(nproc) RealMemory=$mem_mb State=UNKNOWN" >>"$conf"
  done
  echo "PartitionName=debug Nodes=host[0-$((n - 1))] Default=YES MaxTime=INFINITE State=UP" >>"$conf"
  for ((i = 0; i < n; i++)); do
    mkdir -p "/etc/netns/ciuic-host$i/slurm" "$ns_state/spool/host$i"
    cmp -s "$conf" "/etc/netns/ciuic-host$i/slurm/slurm.conf" && continue
    install -m 644 "$conf" "/etc/netns/ciuic-host$i/slurm/slurm.conf"; changed=1
  done
  rm -f "$conf"
  # `ip netns exec` mounts a fresh /sys, without the cgroup mounts, and slurmd 22.05 then
  # fails to start ("No filesystem mounted on /sys/fs/cgroup"): naming the plugin skips
  # that probe, and with proctrack/linuxproc and task/none no cgroup is ever used.
  for ((i = 0; i < n; i++)); do echo "CgroupPlugin=cgroup/v1" >"/etc/netns/ciuic-host$i/slurm/cgroup.conf"; done
  if [ $changed = 1 ]; then
    say "wrote /etc/netns/ciuic-host*/slurm/slurm.conf ($n nodes)"
    for f in $(ns_pidfiles); do [[ $f == */slurmdbd.pid ]] || stop_pid "$f"; done  # read at start only
  fi
  # Over MariaDB's socket (slurmdbd's client library reads MYSQL_UNIX_PORT), into a database
  # of its own: one slurmdbd per database.
  install -m 600 /dev/stdin /etc/netns/ciuic-host0/slurm/slurmdbd.conf <<EOF
AuthType=auth/munge
DbdAddr=$("$cluster" addr 0)
DbdHost=host0
SlurmUser=root
LogFile=$ns_state/log/slurmdbd.log
PidFile=$ns_state/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageLoc=slurm_netns_acct_db
StorageUser=slurm
StoragePass=slurm
EOF
}

start_netns() {
  local n i; n=$(ns_hosts)
  if [ "$n" -lt 2 ]; then
    echo "local_cluster: start-netns needs the emulated hosts: run scripts/cluster/netns_cluster.sh up first (found $n hosts)" >&2
    exit 2
  fi
  install_packages
  mkdir -p "$ns_state"/{ctld,spool,log} "$state/log"
  write_netns_conf "$n"
  start_munge
  start_mariadb
  mariadb --socket="$socket" -u root -e "CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurm';
    GRANT ALL ON slurm_netns_acct_db.* TO 'slurm'@'localhost'; FLUSH PRIVILEGES;"
  running_on 0 "$ns_state/slurmdbd.pid" || { say "starting slurmdbd on host0"; MYSQL_UNIX_PORT=$socket on_host 0 /usr/sbin/slurmdbd; }
  until_ok 60 on_host 0 sacctmgr -n list cluster
  on_host 0 sacctmgr -n -P list cluster format=cluster | grep -qx ciuicnet || on_host 0 sacctmgr -i add cluster ciuicnet >/dev/null
  running_on 0 "$ns_state/slurmctld.pid" || { say "starting slurmctld on host0"; on_host 0 /usr/sbin/slurmctld; }
  until_ok 30 on_host 0 scontrol ping
  for ((i = 0; i < n; i++)); do
    running_on "$i" "$ns_state/slurmd-host$i.pid" || { say "starting slurmd on host$i"; on_host "$i" /usr/sbin/slurmd; }
  done
  all_up() { [ "$(on_host 0 sinfo -h -N -o %T | grep -cE '^(idle|mixed|allocated|completing)$')" = "$n" ]; }
  if ! until_ok 30 all_up; then on_host 0 scontrol update nodename="host[0-$((n - 1))]" state=resume || true; until_ok 15 all_up; fi
  say "ready: $n nodes; Slurm's commands run on host0: $cluster exec 0 sbatch|srun|squeue ..."
  on_host 0 sinfo -N
}

stop_netns() { for f in $(ns_pidfiles); do stop_pid "$f"; done; }

case "${1:-}" in
  start) start ;;
  stop) stop_netns; stop ;;
  start-netns) start_netns ;;
  stop-netns) stop_netns; say "stopped the nodes on the emulated hosts" ;;
  *) echo "usage: $0 start|stop|start-netns|stop-netns" >&2; exit 2 ;;
esac

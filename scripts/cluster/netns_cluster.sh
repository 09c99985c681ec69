#!/usr/bin/env bash
# Emulated hosts on one machine, to rehearse a multi-node job: each host is a network
# namespace with its own address, hostname and /etc/hosts, on one rate-limited link.
#
#   scripts/cluster/netns_cluster.sh up            # HOSTS=2 hosts, LINK_MBIT=0 (unlimited)
#   scripts/cluster/netns_cluster.sh addr 1        # host 1's address
#   scripts/cluster/netns_cluster.sh exec 1 CMD... # CMD on host 1, with the caller's environment
#   scripts/cluster/netns_cluster.sh status        # the hosts, addresses and link limits
#   scripts/cluster/netns_cluster.sh kill 1        # host 1 dies: SIGKILL every process on it
#   scripts/cluster/netns_cluster.sh link 1 down   # host 1's link goes down (up: back)
#   scripts/cluster/netns_cluster.sh down          # remove everything `up` made
#
# Layout: a "switch" namespace (ciuic-sw) holds a bridge; host N is the namespace
# ciuic-hostN, joined to the bridge by a veth pair, with eth0 = 10.77.0.(N+1)/24 and
# loopback up. Nothing is added to the machine's own namespace: the addresses exist
# only inside these namespaces. With LINK_MBIT=R each host's eth0 sends at most R Mbit/s
# (tc tbf), and LATENCY_MS=L queues at most L ms of traffic (tbf's latency: a bound on
# queueing, not an added delay; netem is not available here).
#
# A host behaves like a real one for torchrun and gloo: `exec` runs the command in a
# new UTS namespace whose hostname is hostN, and `ip netns exec` bind-mounts
# /etc/netns/ciuic-hostN/hosts over /etc/hosts, where hostN resolves to its own address.
# So `torchrun --rdzv-endpoint=host0:PORT ...` works unchanged on every host.
#
# `up` is idempotent (an existing cluster of the same shape is kept; another shape is
# rebuilt); it needs root and iproute2 and says so when either is missing.
set -euo pipefail

PREFIX=ciuic
SWITCH=$PREFIX-sw
SUBNET=10.77.0
HOSTS=${HOSTS:-2}
LINK_MBIT=${LINK_MBIT:-0}
LATENCY_MS=${LATENCY_MS:-50}

die() { echo "netns_cluster: $*" >&2; exit 2; }

require() {
    [[ $(id -u) == 0 ]] || die "needs root (network namespaces); run it with sudo"
    command -v ip >/dev/null || die "needs iproute2's 'ip' (apt-get install iproute2)"
    if [[ $LINK_MBIT != 0 ]]; then command -v tc >/dev/null || die "LINK_MBIT needs 'tc' (iproute2)"; fi
    command -v unshare >/dev/null || die "needs 'unshare' (util-linux)"
}

host() { echo "$PREFIX-host$1"; }
addr() { echo "$SUBNET.$(($1 + 1))"; }

existing_hosts() { ip netns list 2>/dev/null | awk '{print $1}' | grep -c "^$PREFIX-host[0-9]*$" || true; }

hosts_file() {
    local i
    echo "127.0.0.1 localhost"
    for ((i = 0; i < $1; i++)); do echo "$(addr "$i") host$i"; done
}

limit() {  # $1 host index: rate-limit its eth0, or remove a limit
    local ns; ns=$(host "$1")
    ip netns exec "$ns" tc qdisc del dev eth0 root 2>/dev/null || true
    if [[ $LINK_MBIT != 0 ]]; then
        # burst: at least one MTU and ~1 ms at the rate, as tbf needs.
        local burst=$((LINK_MBIT * 1000 / 8 > 1600 ? LINK_MBIT * 1000 / 8 : 1600))
        ip netns exec "$ns" tc qdisc add dev eth0 root tbf rate "${LINK_MBIT}mbit" burst "$burst" latency "${LATENCY_MS}ms"
    fi
}

up() {
    require
    local i have; have=$(existing_hosts)
    if [[ $have == "$HOSTS" ]] && ip netns list | grep -q "^$SWITCH\b"; then
        for ((i = 0; i < HOSTS; i++)); do limit "$i"; done
        echo "netns_cluster: $HOSTS hosts already up (link ${LINK_MBIT:-0} Mbit/s, 0 = unlimited)"
        return
    fi
    [[ $have == 0 ]] || down
    ip netns add "$SWITCH"
    ip -n "$SWITCH" link add br0 type bridge
    ip -n "$SWITCH" link set br0 up
    ip -n "$SWITCH" link set lo up
    for ((i = 0; i < HOSTS; i++)); do
        local ns; ns=$(host "$i")
        ip netns add "$ns"
        ip link add "$PREFIX-h$i" netns "$ns" type veth peer name "port$i" netns "$SWITCH"
        ip -n "$ns" link set "$PREFIX-h$i" name eth0
        ip -n "$ns" addr add "$(addr "$i")/24" dev eth0
        ip -n "$ns" link set lo up
        ip -n "$ns" link set eth0 up
        ip -n "$SWITCH" link set "port$i" master br0 up
        mkdir -p "/etc/netns/$ns"
        hosts_file "$HOSTS" > "/etc/netns/$ns/hosts"
        echo "host$i" > "/etc/netns/$ns/hostname"
        limit "$i"
    done
    echo "netns_cluster: $HOSTS hosts up: $(for ((i = 0; i < HOSTS; i++)); do printf 'host%d=%s ' "$i" "$(addr "$i")"; done)(link ${LINK_MBIT} Mbit/s, 0 = unlimited)"
}

down() {
    [[ $(id -u) == 0 ]] || die "needs root (network namespaces); run it with sudo"
    for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^$PREFIX-" || true); do
        ip netns del "$ns"
        rm -rf "/etc/netns/$ns"
    done
    echo "netns_cluster: down"
}

exec_on() {  # $1 host index, then the command
    local i=$1; shift
    [[ $# -gt 0 ]] || die "exec needs a command: exec N CMD..."
    ip netns list | grep -q "^$(host "$i")\b" || die "no host $i (is the cluster up? HOSTS=$(existing_hosts))"
    # A UTS namespace of its own, so the host has its own hostname, as a real one does.
    exec ip netns exec "$(host "$i")" unshare --uts -- sh -c 'hostname "$0" && exec "$@"' "host$i" "$@"
}

kill_host() {  # every process in the host's namespace, as if the machine lost power
    local pids; pids=$(ip netns pids "$(host "$1")")
    [[ -z $pids ]] || kill -9 $pids
    echo "netns_cluster: host$1 killed (${pids:-no processes})" | tr '\n' ' '; echo
}

status() {
    local i n; n=$(existing_hosts)
    [[ $n != 0 ]] || { echo "netns_cluster: down"; return 1; }
    for ((i = 0; i < n; i++)); do
        echo "host$i $(addr "$i") $(ip netns exec "$(host "$i")" tc qdisc show dev eth0 | head -1)"
    done
}

case "${1:-}" in
    up) up ;;
    down) down ;;
    addr) [[ ${2:-} =~ ^[0-9]+$ ]] || die "addr needs a host number: addr N"; addr "$2" ;;
    exec) [[ ${2:-} =~ ^[0-9]+$ ]] || die "exec needs a host number: exec N CMD..."; shift; exec_on "$@" ;;
    status) status ;;
    kill) [[ ${2:-} =~ ^[0-9]+$ ]] || die "kill needs a host number: kill N"; kill_host "$2" ;;
    link) [[ ${2:-} =~ ^[0-9]+$ && ${3:-} =~ ^(up|down)$ ]] || die "link needs a host number and up|down"
          ip -n "$(host "$2")" link set eth0 "$3" ;;
    *) die "usage: $0 up|down|status|addr N|exec N CMD...|kill N|link N up|down (HOSTS=$HOSTS LINK_MBIT=$LINK_MBIT LATENCY_MS=$LATENCY_MS)" ;;
esac

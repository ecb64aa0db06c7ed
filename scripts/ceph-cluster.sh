#!/bin/bash
# A one-node Ceph cluster in one directory, for the RBD tests: a monitor
# (mon.a), a manager (mgr.x) and one OSD (osd.0, BlueStore on a sparse
# file), from Debian's packages (ceph-mon ceph-mgr ceph-osd ceph-common).
# Userspace only: no systemd, no LVM or ceph-volume, no kernel rbd module,
# nothing in /etc/ceph or /var/lib/ceph.
#
#   scripts/ceph-cluster.sh start DIR    set up and start the cluster in DIR
#                                        (created), wait until it is healthy
#                                        and an RBD image can be created
#   scripts/ceph-cluster.sh stop DIR     stop the daemons started in DIR, by
#                                        their PIDs, and remove DIR
#   scripts/ceph-cluster.sh status DIR   health, the daemons' RSS, DIR's size
#
# Both start and stop are idempotent: start on a running cluster only
# prints its paths; start over a dead or half-made one stops it first;
# stop on a missing DIR does nothing.
#
# What a client needs, printed by start:
#   DIR/ceph.conf   mon host, and "keyring = DIR/keyring" for clients
#   DIR/keyring     client.admin's key (cephx)
# so that  rbd -c DIR/ceph.conf ls  and QEMU's
#   rbd:rbd/IMAGE:conf=DIR/ceph.conf
#   -blockdev driver=rbd,pool=rbd,image=IMAGE,conf=DIR/ceph.conf,user=admin
# need nothing else.  The pool "rbd" exists (application rbd, rbd pool
# init) with one image, rbd/probe (64 MiB), made to prove the cluster works.
#
# The monitor listens on 127.0.0.1, msgr v2 only, on a free port; the OSD
# and manager on 127.0.0.1 too.  Pools have one replica (osd pool default
# size = 1, mon allow pool size one) and their warning is off.  The OSD's
# memory target is 1 GiB (the daemons together stay well below; see
# status), its block file is a 10 GiB sparse file that holds only what is
# written.
#
# Authentication is cephx: start generates the keys (mon., client.admin,
# mgr.x, osd.0).  DIR must be on a filesystem with O_DIRECT (BlueStore
# opens its block file so): not tmpfs.
#
# DIR/pids lists "NAME PID" of each daemon started; stop kills exactly
# those (SIGTERM, then SIGKILL after 20 s), and only if the process still
# runs with DIR/ceph.conf on its command line; it removes DIR only if
# DIR/ceph.conf is one of this script's.  Logs: DIR/log/, with how long
# each step of start waited in DIR/log/start.log.
#
# Measured on a 2-core VM (Debian 12, Ceph 16.2.15, the other core busy):
# start 16.5 to 17.6 s (osd.0 up 5 to 6 s of it), stop 1.1 to 1.3 s; at
# rest after rbd bench, RSS 670 MiB (mgr.x 300, osd.0 325, mon.a 42) and
# 260 MiB on disk (the block file 220 MiB of its 10 GiB).
set -uo pipefail

die() { echo "ceph-cluster: error: $*" >&2; exit 1; }
say() { echo "ceph-cluster: $*"; }

[ $# -eq 2 ] || die "usage: $0 start|stop|status DIR"
cmd=$1
dir=$(realpath -m "$2")
conf=$dir/ceph.conf
keyring=$dir/keyring
marker="# A one-node test cluster: scripts/ceph-cluster.sh"
# How long each wait may take, in tenths of a second
WAIT=${CEPH_CLUSTER_WAIT:-1200}

ceph_() { timeout 30 ceph -c "$conf" "$@"; }

# alive NAME PID: the process runs, and is the daemon started with our conf
alive()
{
    [ -r "/proc/$2/cmdline" ] && tr '\0' ' ' < "/proc/$2/cmdline" | grep -q -F -- "$conf"
}

# all_alive: every daemon in DIR/pids runs (and there are three)
all_alive()
{
    local name pid n=0
    [ -f "$dir/pids" ] || return 1
    while read -r name pid; do
        alive "$name" "$pid" || return 1
        n=$((n + 1))
    done < "$dir/pids"
    [ $n -eq 3 ]
}

# term PID...: SIGTERM, then SIGKILL for what still runs after 20 s
term()
{
    local pids=() pid i left
    for pid; do
        alive - "$pid" && kill -TERM "$pid" 2>/dev/null && pids+=("$pid")
    done
    for ((i = 0; i < 200 && ${#pids[@]} > 0; i++)); do
        sleep 0.1
        left=()
        for pid in "${pids[@]}"; do
            alive - "$pid" && left+=("$pid")
        done
        pids=("${left[@]}")
    done
    for pid in "${pids[@]}"; do
        say "PID $pid did not stop on SIGTERM in 20 s: SIGKILL"
        kill -KILL "$pid" 2>/dev/null
    done
}

stop()
{
    [ -d "$dir" ] || return 0
    # Only a directory that this script made: never rm -rf anything else
    if ! head -n 1 "$conf" 2>/dev/null | grep -q -F "$marker"; then
        rmdir "$dir" 2> /dev/null || die "$dir is not a cluster's directory (no $conf of this script's): left alone"
        return 0
    fi
    if [ -f "$dir/pids" ]; then
        # The OSD first, while the monitor can still acknowledge its
        # going down (else it waits osd_mon_shutdown_timeout, 5 s)
        # shellcheck disable=SC2046 # (PIDs, one word each)
        term $(awk '$1 == "osd.0" { print $2 }' "$dir/pids")
        # shellcheck disable=SC2046
        term $(awk '$1 != "osd.0" { print $2 }' "$dir/pids")
    fi
    rm -rf "$dir"
}

# wait_for WHAT COMMAND...: run COMMAND every 0.5 s until it succeeds;
# how long it took goes to DIR/log/start.log
wait_for()
{
    local what=$1 i t=$SECONDS
    shift
    for ((i = 0; i < WAIT; i += 5)); do
        if "$@" > /dev/null 2>&1; then
            echo "$(date +%T) waited $((SECONDS - t)) s for $what" >> "$dir/log/start.log"
            return 0
        fi
        all_alive_so_far || break
        sleep 0.5
    done
    say "timed out waiting for $what; the logs' last lines:"
    tail -n 5 "$dir"/log/*.log >&2
    stop
    die "the cluster in $dir did not start"
}

# all_alive_so_far: every daemon started up to now still runs
all_alive_so_far()
{
    local name pid
    while read -r name pid; do
        alive "$name" "$pid" || { say "$name (PID $pid) exited"; return 1; }
    done < "$dir/pids"
}

# daemon NAME COMMAND...: start COMMAND in the foreground (-f), in the
# background of this script, in its own session; record its PID
daemon()
{
    local name=$1
    shift
    setsid "$@" -f -c "$conf" < /dev/null > "$dir/log/$name.out" 2>&1 &
    echo "$name $!" >> "$dir/pids"
}

healthy()
{
    # HEALTH_OK, nothing else: the warnings this cluster would give by
    # design (one replica, insecure global_id reclaim, disk space) are off
    ceph_ health | grep -q '^HEALTH_OK'
}

# clean: every PG is active+clean ("9 pgs: 9 active+clean; ...")
clean()
{
    ceph_ pg stat | grep -q -E '^([0-9]+) pgs: \1 active\+clean;'
}

start()
{
    local t0=$SECONDS fsid port

    if [ -f "$conf" ] && all_alive && healthy; then
        say "already running in $dir"
        say "conf $conf"
        say "keyring $keyring"
        return 0
    fi
    stop
    for b in ceph-mon ceph-mgr ceph-osd ceph ceph-authtool monmaptool rbd; do
        command -v $b > /dev/null ||
            die "$b is missing (Debian packages ceph-mon ceph-mgr ceph-osd ceph-common)"
    done
    mkdir -p "$dir"/{mon.a,mgr.x,osd.0,log,run} || die "cannot create $dir"
    : > "$dir/pids"

    fsid=$(cat /proc/sys/kernel/random/uuid)
    port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    cat > "$conf" <<EOF
$marker
[global]
fsid = $fsid
mon host = [v2:127.0.0.1:$port]
public addr = 127.0.0.1
cluster addr = 127.0.0.1
ms bind msgr1 = false
ms bind ipv6 = false
auth cluster required = cephx
auth service required = cephx
auth client required = cephx
auth allow insecure global id reclaim = false
keyring = $keyring
run dir = $dir/run
crash dir = $dir/crash
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
osd crush chooseleaf type = 0
mon allow pool size one = true
mon allow pool delete = true
mon warn on pool no redundancy = false
mon data avail warn = 2
mon data avail crit = 1
mgr initial modules = iostat

[mon]
admin socket = $dir/run/\$name.asok
log file = $dir/log/\$name.log
pid file = $dir/run/\$name.pid
mon data = $dir/\$name
keyring = $dir/\$name/keyring

[mgr]
admin socket = $dir/run/\$name.asok
log file = $dir/log/\$name.log
pid file = $dir/run/\$name.pid
mgr data = $dir/\$name
keyring = $dir/\$name/keyring

[osd]
admin socket = $dir/run/\$name.asok
log file = $dir/log/\$name.log
pid file = $dir/run/\$name.pid
osd data = $dir/\$name
keyring = $dir/\$name/keyring
osd objectstore = bluestore
# the block file is osd data/block (bluestore block path empty: a path set
# to that same file would make bluestore link it to itself)
bluestore block create = true
bluestore block size = 10G
osd memory target = 1G
osd max object name len = 256
EOF

    # Keys: mon. and client.admin (all caps) go to the monitor at mkfs; the
    # manager's and the OSD's are registered once it runs
    ceph-authtool --create-keyring "$keyring" --gen-key -n client.admin \
        --cap mon 'allow *' --cap osd 'allow *' --cap mgr 'allow *' --cap mds 'allow *' \
        > /dev/null || die "ceph-authtool failed"
    ceph-authtool --create-keyring "$dir/mon.keyring" --gen-key -n mon. --cap mon 'allow *' \
        > /dev/null || die "ceph-authtool failed"
    ceph-authtool "$dir/mon.keyring" --import-keyring "$keyring" > /dev/null ||
        die "ceph-authtool failed"
    monmaptool --create --fsid "$fsid" --addv a "[v2:127.0.0.1:$port]" \
        "$dir/monmap" > /dev/null || die "monmaptool failed"
    ceph-mon --mkfs -i a -c "$conf" --monmap "$dir/monmap" --keyring "$dir/mon.keyring" \
        > "$dir/log/mkfs-mon.out" 2>&1 || { cat "$dir/log/mkfs-mon.out"; die "ceph-mon --mkfs failed"; }
    rm -f "$dir/monmap" "$dir/mon.keyring"

    daemon mon.a ceph-mon -i a
    wait_for "the monitor" ceph_ mon stat

    ceph_ auth get-or-create mgr.x mon 'allow profile mgr' osd 'allow *' mds 'allow *' \
        -o "$dir/mgr.x/keyring" > /dev/null 2>&1 || die "cannot create mgr.x's key"
    daemon mgr.x ceph-mgr -i x

    local uuid key
    uuid=$(cat /proc/sys/kernel/random/uuid)
    key=$(ceph-authtool --gen-print-key) || die "ceph-authtool failed"
    ceph-authtool --create-keyring "$dir/osd.0/keyring" -n osd.0 --add-key "$key" \
        > /dev/null || die "ceph-authtool failed"
    echo "{\"cephx_secret\": \"$key\"}" > "$dir/osd.0/secret.json"
    [ "$(ceph_ osd new "$uuid" -i "$dir/osd.0/secret.json" 2>/dev/null)" = 0 ] ||
        { stop; die "ceph osd new did not give osd.0"; }
    rm -f "$dir/osd.0/secret.json"
    ceph-osd -i 0 -c "$conf" --mkfs --osd-uuid "$uuid" > "$dir/log/mkfs-osd.out" 2>&1 ||
        { cat "$dir/log/mkfs-osd.out"; stop; die "ceph-osd --mkfs failed"; }
    daemon osd.0 ceph-osd -i 0

    wait_for "osd.0 up" sh -c "ceph -c '$conf' osd dump 2>/dev/null | grep -q '^osd.0 up *in'"
    ceph_ osd pool create rbd 8 8 > /dev/null 2>&1 || { stop; die "cannot create pool rbd"; }
    wait_for "pool rbd" timeout 60 rbd -c "$conf" pool init rbd
    # The manager's devicehealth module makes a pool of its own when the
    # manager becomes active: wait for it, then for every PG to be clean
    wait_for "the manager" sh -c "ceph -c '$conf' osd pool ls 2>/dev/null | grep -q device_health_metrics"
    wait_for "active+clean PGs" clean
    wait_for "HEALTH_OK" healthy
    wait_for "rbd create" timeout 60 rbd -c "$conf" create rbd/probe --size 64M

    say "started in $dir in $((SECONDS - t0)) s (mon.a at v2:127.0.0.1:$port, mgr.x, osd.0)"
    say "conf $conf"
    say "keyring $keyring"
}

status()
{
    local name pid rss total=0
    [ -f "$conf" ] || die "no cluster in $dir"
    ceph_ health
    while read -r name pid; do
        if alive "$name" "$pid"; then
            rss=$(awk '/^VmRSS/ { print $2 }' "/proc/$pid/status")
            total=$((total + rss))
            say "$name PID $pid RSS $((rss / 1024)) MiB"
        else
            say "$name PID $pid not running"
        fi
    done < "$dir/pids"
    say "RSS of the daemons: $((total / 1024)) MiB"
    say "disk used by $dir: $(du -sm "$dir" | cut -f1) MiB" \
        "(osd.0/block: $(du -m "$dir/osd.0/block" | cut -f1) MiB of $(( $(stat -c %s "$dir/osd.0/block") >> 20)) MiB)"
}

case $cmd in
start) start ;;
stop) stop ;;
status) status ;;
*) die "usage: $0 start|stop|status DIR" ;;
esac

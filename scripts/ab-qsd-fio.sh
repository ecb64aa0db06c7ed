#!/bin/bash
# Two qemu-storage-daemon binaries in alternation under one fio write job,
# each on its own copy of an extree image (the same writes go to both):
#
#   scripts/ab-qsd-fio.sh DIR ROUNDS FIO_ARGS...
#
# DIR holds qsd-before, qsd-after and qemu-img (binaries; qemu-img-before
# and qemu-img-after instead where a format change keeps the older one from
# opening the newer's image) and img-before, img-after (copies of one image).  Each run starts a fresh server (cold node cache),
# runs fio's nbd engine (random 4 KiB writes, depth 16, fsync at the end)
# with FIO_ARGS and the round's seed, and prints "round N VARIANT IOPS";
# the order of the two alternates every round.  XT_OPTS: driver options
# appended to the extree blockdev (e.g. ",cache-size=64M").  XT_BITMAP=1:
# before each run, a new enabled bitmap "ab" (64 KiB granules) replaces
# the last one, so that every run's writes meet clean granules.
# XT_FRESH=SIZE: a new empty image of SIZE before each run (the database
# case).  SEED:
# the first round's seed (default 501).
set -euo pipefail
d=${1:?usage: ab-qsd-fio.sh DIR ROUNDS FIO_ARGS...}
rounds=${2:?usage: ab-qsd-fio.sh DIR ROUNDS FIO_ARGS...}
shift 2
for r in $(seq 1 "$rounds"); do
    order="before after"
    [ $((r % 2)) = 0 ] && order="after before"
    for v in $order; do
        sock=$d/qsd-$v.sock
        rm -f "$sock"
        # qemu-img-before/-after where the two differ in format
        img=$d/qemu-img
        [ -x "$d/qemu-img-$v" ] && img=$d/qemu-img-$v
        if [ -n "${XT_FRESH:-}" ]; then
            rm -f "$d/img-$v"
            "$img" create -q -f extree "$d/img-$v" "$XT_FRESH"
        fi
        if [ "${XT_BITMAP:-0}" = 1 ]; then
            "$img" bitmap --remove "$d/img-$v" ab 2>/dev/null || true
            "$img" bitmap --add -g 65536 "$d/img-$v" ab
        fi
        "$d/qsd-$v" --blockdev "driver=file,node-name=file,filename=$d/img-$v,cache.direct=on,aio=native" \
            --blockdev "driver=extree,node-name=fmt,file=file${XT_OPTS:-}" \
            --nbd-server "addr.type=unix,addr.path=$sock" \
            --export type=nbd,id=exp,node-name=fmt,name=fmt,writable=on \
            2> "$d/qsd-$v.err" &
        pid=$!
        while [ ! -S "$sock" ]; do
            kill -0 "$pid" || { cat "$d/qsd-$v.err" >&2; exit 1; }
            sleep 0.1
        done
        iops=$(fio --name=ab --ioengine=nbd --uri="nbd+unix:///fmt?socket=$sock" \
                   --rw=randwrite --bs=4k --iodepth=16 --end_fsync=1 \
                   --randrepeat=0 --randseed=$((${SEED:-501} - 1 + r)) --output-format=json \
                   "$@" 2>/dev/null |
               python3 -c 'import json, sys
t = sys.stdin.read()
j = json.loads(t[t.index("{"):])["jobs"][0]
print(round(j["write"]["total_ios"] / (j["job_runtime"] / 1000)))')
        kill "$pid"
        wait "$pid" || true
        echo "round $r $v $iops"
    done
done

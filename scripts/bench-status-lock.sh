#!/bin/bash
# Whole-command timing of block status through two builds (issue 17
# point 2): `qemu-img map --output=json` and `nbdinfo --map` through
# `qemu-nbd -r` of one image, warm, the builds alternating, REPS each.
# Prints one line per run and the medians; the NBD server's CPU time for
# each map comes from /proc/PID/stat (utime + stime) before and after.
#
#   scripts/bench-status-lock.sh IMAGE DIR_A DIR_B [REPS]
#
# DIR_A and DIR_B each hold a qemu-img and a qemu-nbd.
set -euo pipefail
img=$1 a=$2 b=$3 reps=${4:-5}
tmp=$(mktemp -d)
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; rm -rf "$tmp"' EXIT
tck=$(getconf CLK_TCK)

cpu() { awk '{ print $14 + $15 }' "/proc/$1/stat"; }

for d in "$a" "$b"; do
    n=$(basename "$d")
    "$d/qemu-nbd" -r -t -f extree -k "$tmp/$n.sock" "$img" &
    pids+=($!)
    echo "$n $!" >> "$tmp/pids"
done
for d in "$a" "$b"; do
    while [ ! -S "$tmp/$(basename "$d").sock" ]; do sleep 0.1; done
done
# warm the page cache and both servers' node caches
for d in "$a" "$b"; do
    "$d/qemu-img" map --output=json "$img" > /dev/null
    nbdinfo --map "nbd+unix:///?socket=$tmp/$(basename "$d").sock" > /dev/null
done
for ((i = 1; i <= reps; i++)); do
    for d in "$a" "$b"; do
        n=$(basename "$d")
        /usr/bin/time -f "%e %U %S" -o "$tmp/t" \
            "$d/qemu-img" map --output=json "$img" > /dev/null
        read -r wall usr sys < "$tmp/t"
        echo "map $n $wall cpu $(echo "$usr + $sys" | bc)" | tee -a "$tmp/res"
        pid=$(awk -v n="$n" '$1 == n { print $2 }' "$tmp/pids")
        c0=$(cpu "$pid")
        s=$(date +%s.%N)
        nbdinfo --map "nbd+unix:///?socket=$tmp/$n.sock" > /dev/null
        e=$(date +%s.%N)
        c1=$(cpu "$pid")
        echo "nbdinfo $n $(echo "$e - $s" | bc) server-cpu $(echo "scale=2; ($c1 - $c0) / $tck" | bc)" | tee -a "$tmp/res"
    done
done
echo "medians (wall s, then CPU s: qemu-img's own, or the NBD server's):"
for what in map nbdinfo; do
    for d in "$a" "$b"; do
        n=$(basename "$d")
        med=$(awk -v w="$what" -v n="$n" '$1 == w && $2 == n { print $3 }' "$tmp/res" | sort -n | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }')
        extra=" $(awk -v w="$what" -v n="$n" '$1 == w && $2 == n { print $5 }' "$tmp/res" | sort -n | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }')"
        echo "$what $n $med$extra"
    done
done

#!/bin/bash
# A short demo of extree beside qcow2, for a newcomer: write the same
# fragmented pattern (4 KiB of data every 64 KiB, in shuffled order, as a
# guest writing at random would) into an extree image (4 KiB blocks, the
# default), a qcow2 image with 4 KiB clusters (the same granularity) and a
# qcow2 image with 64 KiB clusters (qcow2's default); check that all three
# hold the same guest content; show each image's space on the host, what
# qemu-img map reports and how long it takes; convert to and from raw and
# between extree and qcow2, comparing every round trip.  Under a minute on
# 2 cores.
#
# Environment: QEMU_BUILD, the directory of qemu-img and qemu-io (default
# build/qemu); DEMO_DIR, the scratch directory (default build/demo; only the
# demo's own files in it are replaced); DEMO_EXTENTS, the number of 4 KiB
# runs (default 32768: 2 GiB virtual, 128 MiB of data, 2.5 GiB of host
# space at most, 2 GiB of it the qcow2 64 KiB image);
# DEMO_MAP_RUNS, the timed runs of qemu-img map per image (default 5).
# The three images stay in the scratch directory; the copies made by the
# round trips are removed once compared.
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
q=${QEMU_BUILD:-$top/build/qemu}
dir=${DEMO_DIR:-$top/build/demo}
n=${DEMO_EXTENTS:-32768}
runs=${DEMO_MAP_RUNS:-5}
die() { echo "demo: error: $*" >&2; exit 1; }
for t in qemu-img qemu-io; do
    [ -x "$q/$t" ] || die "$q/$t is missing: run make"
done
[[ $n =~ ^[1-9][0-9]*$ ]] || die "DEMO_EXTENTS must be a positive number"
[[ $runs =~ ^[1-9][0-9]*$ ]] || die "DEMO_MAP_RUNS must be a positive number"
size=$(( n * 64 / 1024 + 64 ))M   # a little more than the pattern spans
mkdir -p "$dir"
rm -f -- "$dir"/demo.* "$dir"/back.* "$dir"/conv-* "$dir"/map.* \
    "$dir"/x2q.* "$dir"/q2x.* "$dir"/pattern.*

# The qcow2 image with 64 KiB clusters takes 64 KiB of host space per run,
# the others and the round trips' copies 4 KiB each, at most four at once.
need=$(( n * (64 + 4 * 5) + 256 * 1024 ))   # KiB
avail=$(df -Pk "$dir" | awk 'NR == 2 { print $4 }')
[ "$avail" -ge "$need" ] ||
    die "$dir has $(( avail / 1024 )) MiB free, the demo needs $(( need / 1024 )) MiB" \
        "(set DEMO_EXTENTS lower, or DEMO_DIR)"

# The images: name, format, creation options (none: the format's default).
names=(qcow2-4k qcow2-64k)
declare -A fmt=([qcow2-4k]=qcow2 [qcow2-64k]=qcow2 [extree]=extree)
declare -A opts=([qcow2-4k]=cluster_size=4096 [qcow2-64k]="" [extree]="")
declare -A label=([qcow2-4k]="qcow2, 4 KiB clusters" \
    [qcow2-64k]="qcow2, 64 KiB clusters" [extree]="extree, 4 KiB blocks")
if "$q/qemu-img" --help | grep -q -w extree; then
    names=(extree qcow2-4k qcow2-64k)
else
    echo "demo: note: this QEMU build has no extree driver yet; showing qcow2 only"
fi
o() { [ -n "${opts[$1]}" ] && echo "-o ${opts[$1]}"; true; }

TIMEFORMAT=%R
secs() { { time "$@" > /dev/null 2>&1; } 2>&1; }
# Bytes as KiB, MiB or GiB.
human() { awk -v b="$1" 'BEGIN { if (b >= 2^30) printf "%.1f GiB", b / 2^30;
                                 else if (b >= 2^20) printf "%.0f MiB", b / 2^20;
                                 else printf "%.0f KiB", b / 2^10 }'; }
# The median of the times of $runs runs of a command (warm: it ran before).
median() {
    local i ts=()
    for (( i = 0; i < runs; i++ )); do ts+=("$(secs "$@")"); done
    printf '%s\n' "${ts[@]}" | sort -n | sed -n "$(( (runs + 1) / 2 ))p"
}

# The write pattern, shuffled with a fixed seed so every image gets the same.
python3 - "$n" > "$dir/pattern.qemu-io" <<'PY'
import random, sys
n = int(sys.argv[1])
offs = list(range(n))
random.Random(1).shuffle(offs)
for i in offs:
    print(f"write -q -P {i % 251 + 1} {i * 65536} 4096")
PY

declare -A t_write t_map t_info t_to t_from entries data disk
for v in "${names[@]}"; do
    f=${fmt[$v]}
    img=$dir/demo.$v
    # shellcheck disable=SC2046
    "$q/qemu-img" create -q -f "$f" $(o "$v") "$img" "$size"
    # One qemu-io process for all the writes, with a writeback cache as a
    # guest has by default: it flushes once, when it closes the image.
    t_write[$v]=$(secs sh -c "'$q/qemu-io' -t writeback -f $f '$img' < '$dir/pattern.qemu-io'")
    echo
    echo "=== qemu-img info ($v)"
    "$q/qemu-img" info -f "$f" "$img"
    t_info[$v]=$(secs "$q/qemu-img" info -f "$f" "$img")
    disk[$v]=$(du -B1 "$img" | cut -f1)
    "$q/qemu-img" map --output=json -f "$f" "$img" > "$dir/map.$v.json"
    t_map[$v]=$(median "$q/qemu-img" map --output=json -f "$f" "$img")
    # qemu-img map --output=json prints one entry a line.
    em=$(awk '/"start"/ { n++ } /"data": true/ { match($0, /"length": [0-9]+/);
              d += substr($0, RSTART + 10, RLENGTH - 10) } END { printf "%d %.0f\n", n, d }' \
         "$dir/map.$v.json")
    entries[$v]=${em% *} data[$v]=${em#* }
    echo "=== qemu-img map --output=json ($v): ${entries[$v]} entries, first 4:"
    head -n 4 "$dir/map.$v.json"
    if [ "$v" != "${names[0]}" ]; then
        "$q/qemu-img" compare -q -f "${fmt[${names[0]}]}" -F "$f" \
            "$dir/demo.${names[0]}" "$img" ||
            die "$v: the guest content differs from ${names[0]}'s"
        echo "=== guest content of $v and ${names[0]}: identical"
    fi
    # The raw round trip of the qcow2 64 KiB image would only test qcow2
    # again, reading and writing 16 times the 4 KiB image's bytes.
    if [ "$v" = qcow2-64k ]; then
        t_to[$v]=- t_from[$v]=-
        continue
    fi
    t_to[$v]=$(secs "$q/qemu-img" convert -f "$f" -O raw "$img" "$dir/conv-from-$v.raw")
    # shellcheck disable=SC2046
    t_from[$v]=$(secs "$q/qemu-img" convert -f raw -O "$f" $(o "$v") \
        "$dir/conv-from-$v.raw" "$dir/back.$v")
    "$q/qemu-img" compare -q -f "$f" -F "$f" "$img" "$dir/back.$v" ||
        die "$v: image converted to raw and back differs"
    echo "=== convert $v -> raw -> $v: identical"
    rm -f "$dir/conv-from-$v.raw" "$dir/back.$v"
done

if [ "${names[0]}" = extree ]; then
    echo
    # Through the qcow2 image of the same granularity: through 64 KiB
    # clusters, the same check reads and writes 16 times the bytes.
    TIMEFORMAT="=== convert extree -> qcow2 (4 KiB clusters): %R s"
    time "$q/qemu-img" convert -f extree -O qcow2 -o cluster_size=4096 \
        "$dir/demo.extree" "$dir/x2q.qcow2"
    TIMEFORMAT="=== convert qcow2 (4 KiB clusters) -> extree: %R s"
    time "$q/qemu-img" convert -f qcow2 -O extree "$dir/x2q.qcow2" "$dir/q2x.extree"
    TIMEFORMAT=%R
    "$q/qemu-img" compare -q "$dir/demo.extree" "$dir/q2x.extree" ||
        die "extree -> qcow2 -> extree differs"
    echo "=== convert extree -> qcow2 -> extree: identical"
    rm -f "$dir/x2q.qcow2" "$dir/q2x.extree"
fi

echo
echo "=== the same $(human $(( n * 4096 ))) in each image: $n runs of 4 KiB," \
    "one every 64 KiB"
echo "    over $(human $(( n * 65536 ))), written in random order"
printf '%-24s %11s %15s %12s %10s\n' image "disk size" "map says data" \
    "map entries" "map time"
for v in "${names[@]}"; do
    printf '%-24s %11s %15s %12s %8s s\n' "${label[$v]}" "$(human "${disk[$v]}")" \
        "$(human "${data[$v]}")" "${entries[$v]}" "${t_map[$v]}"
done
echo "disk size: bytes allocated on the host (du, qemu-img info's \"disk size\");"
echo "map: qemu-img map --output=json, the median time of $runs warm runs."
echo
if [ "${names[0]}" = extree ]; then
    awk -v x="${t_map[extree]}" -v q4="${t_map[qcow2-4k]}" \
        -v d64="${disk[qcow2-64k]}" -v dx="${disk[extree]}" \
        -v m64="$(human "${data[qcow2-64k]}")" -v w="$(human $(( n * 4096 )))" '
    BEGIN {
        if (x <= 0) x = 0.001   # below the resolution of the timing
        printf "extree and qcow2 with 4 KiB clusters store and map exactly the"
        printf " 4 KiB runs written, and extree maps them %.1f times as fast;", q4 / x
        printf " qcow2 with its default 64 KiB clusters stores and maps a whole"
        printf " cluster for each run, so its map is shorter but reports %s of data", m64
        printf " where %s was written, and the image takes %.0f times the space.\n", w, d64 / dx
    }' | fold -s -w 78
fi

echo
echo "=== other steps (seconds, one run each)"
printf '%-24s %8s %8s %8s %10s\n' image write info "to raw" "from raw"
for v in "${names[@]}"; do
    printf '%-24s %8s %8s %8s %10s\n' "${label[$v]}" "${t_write[$v]}" \
        "${t_info[$v]}" "${t_to[$v]}" "${t_from[$v]}"
done

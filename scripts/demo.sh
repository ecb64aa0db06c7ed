#!/bin/bash
# A short demo of extree beside qcow2: create an image, write a fragmented
# pattern (4 KiB of data every 64 KiB, written in shuffled order), show
# qemu-img info and map, convert to and from qcow2, and time each step for
# both formats.  Uses build/qemu; scratch files under build/demo.
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
q=$top/build/qemu
dir=$top/build/demo
n=${DEMO_EXTENTS:-16384}
size=$(( n * 64 / 1024 + 64 ))M   # a little more than the pattern spans

die() { echo "demo: error: $*" >&2; exit 1; }
[ -x "$q/qemu-img" ] || die "build/qemu/qemu-img is missing: run make"
rm -rf "$dir"; mkdir -p "$dir"

fmts=(qcow2)
if "$q/qemu-img" --help | grep -q -w extree; then
    fmts=(extree qcow2)
else
    echo "demo: note: this QEMU build has no extree driver yet; showing qcow2 only"
fi

TIMEFORMAT=%R
secs() { { time "$@" > /dev/null 2>&1; } 2>&1; }

# The write pattern, shuffled with a fixed seed so both formats get the same.
python3 - "$n" > "$dir/pattern.qemu-io" <<'PY'
import random, sys
n = int(sys.argv[1])
offs = list(range(n))
random.Random(1).shuffle(offs)
for i in offs:
    print(f"write -q -P {i % 251 + 1} {i * 65536} 4096")
PY

declare -A t_write t_map t_info t_to t_from entries
for f in "${fmts[@]}"; do
    img=$dir/demo.$f
    "$q/qemu-img" create -q -f "$f" "$img" "$size"
    t_write[$f]=$(secs sh -c "'$q/qemu-io' -f $f '$img' < '$dir/pattern.qemu-io'")
    echo
    echo "=== qemu-img info ($f)"
    "$q/qemu-img" info "$img"
    t_info[$f]=$(secs "$q/qemu-img" info "$img")
    t_map[$f]=$(secs "$q/qemu-img" map --output=json "$img")
    "$q/qemu-img" map --output=json "$img" > "$dir/map.$f.json"
    entries[$f]=$(grep -c '"start"' "$dir/map.$f.json")
    echo "=== qemu-img map --output=json ($f): ${entries[$f]} entries, first 4:"
    head -n 4 "$dir/map.$f.json"
    t_to[$f]=$(secs "$q/qemu-img" convert -f "$f" -O raw "$img" "$dir/conv-from-$f.raw")
    t_from[$f]=$(secs "$q/qemu-img" convert -f raw -O "$f" "$dir/conv-from-$f.raw" "$dir/back.$f")
    "$q/qemu-img" compare -q -f "$f" -F "$f" "$img" "$dir/back.$f" ||
        die "$f: image converted to raw and back differs"
    echo "=== convert $f -> raw -> $f: identical"
done

if [ "${fmts[0]}" = extree ]; then
    TIMEFORMAT="extree -> qcow2: %R s"
    time "$q/qemu-img" convert -f extree -O qcow2 "$dir/demo.extree" "$dir/x2q.qcow2"
    TIMEFORMAT="qcow2 -> extree: %R s"
    time "$q/qemu-img" convert -f qcow2 -O extree "$dir/x2q.qcow2" "$dir/q2x.extree"
    TIMEFORMAT=%R
    "$q/qemu-img" compare -q "$dir/demo.extree" "$dir/q2x.extree" ||
        die "extree -> qcow2 -> extree differs"
    echo "=== convert extree -> qcow2 -> extree: identical"
fi

echo
echo "=== timings (seconds, one run each; $n data extents of 4 KiB, every 64 KiB)"
printf '%-8s %10s %8s %8s %8s %10s %10s\n' format write info map entries "to raw" "from raw"
for f in "${fmts[@]}"; do
    printf '%-8s %10s %8s %8s %8s %10s %10s\n' "$f" "${t_write[$f]}" "${t_info[$f]}" \
        "${t_map[$f]}" "${entries[$f]}" "${t_to[$f]}" "${t_from[$f]}"
done

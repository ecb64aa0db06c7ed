#!/bin/bash
# The nbdkit plugin under ThreadSanitizer: builds the plugin with
# -fsanitize=thread in build/tsan, serves a new image with nbdkit (libtsan
# preloaded: nbdkit itself is not instrumented) and runs, at the same time,
# fio random reads and writes (two jobs, depth 16), fio random trims, fio
# writes of zero buffers, and in a loop nbdinfo --map, nbdcopy of the
# export and NBD write zeroes with and without may-trim (nbdsh), with a
# commit every second.  Any report fails the script (exit status 1).
# With "bitmap", the image has an enabled persistent bitmap: the writes
# then mark it and the first one to each granule goes to new space.
#
#   scripts/nbdkit-tsan.sh [SECONDS [bitmap]]        default 20
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
secs=${1:-20}
bitmap=${2:-}
bld=$top/build/tsan
dir=$(mktemp -d)
cleanup() {
    kill -9 $(jobs -p) 2>/dev/null || true
    wait 2>/dev/null || true
    if ls "$dir"/tsan* >/dev/null 2>&1; then
        cat "$dir"/tsan*
        echo "nbdkit-tsan: ThreadSanitizer reported the above"
    fi
    rm -rf "$dir"
}
trap cleanup EXIT

if [ ! -f "$bld/build.ninja" ]; then
    meson setup "$bld" -Db_sanitize=thread -Db_lundef=false -Dnbdkit=enabled >/dev/null
fi
meson compile -C "$bld" nbdkit-extree-plugin >/dev/null
libtsan=$(gcc -print-file-name=libtsan.so)

"$top/build/qemu/qemu-img" create -q -f extree "$dir/t.extree" 256M
if [ "$bitmap" = bitmap ]; then
    "$top/build/qemu/qemu-img" bitmap --add "$dir/t.extree" b0
fi
sock=$dir/s.sock
uri="nbd+unix:///?socket=$sock"
LD_PRELOAD=$libtsan TSAN_OPTIONS="halt_on_error=0 log_path=$dir/tsan" \
    nbdkit -f -U "$sock" "$bld/nbdkit/nbdkit-extree-plugin.so" \
    file="$dir/t.extree" commit-interval=1 > "$dir/nbdkit.log" 2>&1 &
server=$!
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done

fio_run() {
    fio --ioengine=nbd --uri="$uri" --size=256M --time_based --runtime="$secs" \
        --output=/dev/null "$@"
}
fio_run --name=rw --rw=randrw --bs=4k --iodepth=16 --numjobs=2 &
fio_run --name=trim --rw=randtrim --bs=64k --iodepth=4 &
fio_run --name=zero --rw=randwrite --bs=16k --iodepth=4 --zero_buffers &
end=$((SECONDS + secs))
while [ $SECONDS -lt $end ]; do
    nbdinfo --map "$uri" > /dev/null
    nbdcopy "$uri" null:
    /usr/bin/python3 -m nbd -u "$uri" -c "h.zero(64 << 20, 32 << 20)" -c "h.zero(1 << 20, 3 << 20, nbd.CMD_FLAG_NO_HOLE)" -c "h.flush()"
done
wait $(jobs -p | grep -v "^$server$")
kill "$server"
wait "$server" || true

if ls "$dir"/tsan* >/dev/null 2>&1; then
    exit 1          # cleanup prints them
fi
"$top/build/qemu/qemu-img" check -q "$dir/t.extree"
if [ "$bitmap" = bitmap ]; then
    "$top/build/qemu/qemu-img" info "$dir/t.extree" | grep -q "name: b0"
fi
echo "nbdkit-tsan: no ThreadSanitizer report in $secs s; qemu-img check clean"

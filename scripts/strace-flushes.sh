#!/bin/bash
# Count the server's fdatasync and pwrite64 calls against the guest flushes
# of bench-bitmaps.py's flush job (fio --fsync=16, 10,000 random 4 KiB
# writes over 64 GiB), issue 47 point 4:
#
#   scripts/strace-flushes.sh IMAGE [DRIVER-OPTS [SEED]]
#
# e.g. scripts/strace-flushes.sh W.extree ,mark-log=off 12.  aio=threads,
# so that a FUA write is a write and an fdatasync (with aio=native it is
# one io_submit).  Use a new SEED for each run on the same image: offsets
# already written since the bitmap's clear no longer need a mark.
# FMT=qcow2: the same for another format's image (default extree);
# QSD=PATH: another qemu-storage-daemon binary.
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
img=$1 opts=${2:-} seed=${3:-7}
tmp=$(mktemp -d)
sock=$tmp/qsd.sock
strace -f -c -o "$tmp/strace" -e trace=fdatasync,pwrite64,pwritev \
    "${QSD:-$top/build/qemu/storage-daemon/qemu-storage-daemon}" \
    --blockdev "driver=file,node-name=file,filename=$img,cache.direct=on,aio=threads" \
    --blockdev "driver=${FMT:-extree},node-name=fmt,file=file$opts" \
    --nbd-server "addr.type=unix,addr.path=$sock" \
    --export type=nbd,id=exp,node-name=fmt,name=fmt,writable=on &
spid=$!
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
fio --name=flush --ioengine=nbd --uri="nbd+unix:///fmt?socket=$sock" \
    --rw=randwrite --bs=4k --iodepth=16 --randrepeat=0 --randseed="$seed" \
    --size=64g --blockalign=64k --io_size=40000k --fsync=16 \
    --output-format=json --output="$tmp/fio.json" >/dev/null 2>&1
kill -TERM "$(pgrep -P $spid)"
wait $spid || true
python3 - "$tmp/fio.json" <<'PY'
import json, sys
s = open(sys.argv[1]).read()
j = json.loads(s[s.index("{"):])["jobs"][0]
print("writes", j["write"]["total_ios"], "guest flushes", j["sync"]["total_ios"])
PY
grep -E "fdatasync|pwrite" "$tmp/strace"
rm -rf "$tmp"

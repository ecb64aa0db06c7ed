#!/bin/bash
# Boot a real system from a compressed image (issue 34): the Debian 12
# disk of scripts/bench-compress.py (--image; docs/compression.rst says how
# it is built) converted with -c to extree and to qcow2 (zstd both), and
# the raw image itself, each booted with the kernel and initramfs the
# image holds (read out with debugfs) to systemd's poweroff target under
# TCG (FIELD-NOTES: no KVM for Linux guests here).  A boot passes when
# the serial console shows systemd reaching "System Power Off" and the
# kernel powering down, and qemu-img check of the image afterwards is
# clean (raw has no check).  Each boot runs on a fresh copy of the converted image (a boot
# writes: the journal, systemd's state); formats alternate, RUNS rounds,
# median wall time of each.
#
#   scripts/bench-compress-boot.sh [IMAGE]     (RUNS=3 by default)
#
# Not part of make check (the image is built by hand, and a boot takes
# about a minute of TCG).
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
img=${1:-/var/tmp/xt-bench/debian.raw}
runs=${RUNS:-3}
work=/var/tmp/xt-bench/boot
qemu=$top/build/qemu/qemu-system-x86_64
qimg=$top/build/qemu/qemu-img
die() { echo "bench-compress-boot: $*" >&2; exit 1; }

[ -f "$img" ] || die "$img not found (docs/compression.rst: build it first)"
command -v debugfs >/dev/null || die "debugfs not found (e2fsprogs)"
mkdir -p "$work"

# The newest kernel of the image, and its initramfs
kver=$(debugfs -R "ls -p /boot" "$img" 2>/dev/null |
       awk -F/ '$6 ~ /^vmlinuz-/ { print substr($6, 9) }' | sort -V | tail -n 1)
[ -n "$kver" ] || die "no /boot/vmlinuz-* in $img"
debugfs -R "dump /boot/vmlinuz-$kver $work/vmlinuz" "$img" 2>/dev/null
debugfs -R "dump /boot/initrd.img-$kver $work/initrd" "$img" 2>/dev/null
[ -s "$work/vmlinuz" ] && [ -s "$work/initrd" ] || die "could not read the kernel $kver"

"$qimg" convert -c -f raw -O extree "$img" "$work/debian.extree"
"$qimg" convert -c -f raw -O qcow2 -o compression_type=zstd "$img" "$work/debian.qcow2"
echo "kernel $kver; compressed: extree $(du -m "$work/debian.extree" | cut -f1) MiB," \
     "qcow2 $(du -m "$work/debian.qcow2" | cut -f1) MiB"

# boot FMT FILE: prints the wall time in seconds, or fails
boot() {
    local fmt=$1 src=$2 copy=$work/boot-copy log=$work/boot-$1.log start end
    cp --sparse=always "$src" "$copy"
    start=$(date +%s.%N)
    timeout 600 "$qemu" -accel tcg -m 1024 -smp 1 -nographic -no-reboot \
        -nodefaults -serial "file:$log" \
        -kernel "$work/vmlinuz" -initrd "$work/initrd" \
        -append "root=/dev/vda rw console=ttyS0 systemd.unit=poweroff.target" \
        -drive "file=$copy,format=$fmt,if=virtio,cache=writeback" \
        >/dev/null 2>&1 || die "$fmt: qemu failed (log $log)"
    end=$(date +%s.%N)
    grep -q "System Power Off" "$log" && grep -q "reboot: Power down" "$log" ||
        die "$fmt: no clean power-off on the console (log $log)"
    if [ "$fmt" != raw ]; then
        "$qimg" check -f "$fmt" "$copy" >/dev/null || die "$fmt: check failed after the boot"
    fi
    rm -f "$copy"
    echo "$end - $start" | bc
}

declare -A times
fmts=(extree qcow2 raw)
for ((r = 1; r <= runs; r++)); do
    order=("${fmts[@]}")
    if ((r % 2 == 0)); then
        order=(raw qcow2 extree)
    fi
    for f in "${order[@]}"; do
        case $f in
        extree) t=$(boot extree "$work/debian.extree") ;;
        qcow2) t=$(boot qcow2 "$work/debian.qcow2") ;;
        raw) t=$(boot raw "$img") ;;
        esac
        times[$f]="${times[$f]:-} $t"
        echo "round $r: $f booted and powered off in $t s"
    done
done
for f in "${fmts[@]}"; do
    # shellcheck disable=SC2086
    med=$(printf '%s\n' ${times[$f]} | sort -n | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }')
    echo "$f: median $med s of$(printf ' %.1f' ${times[$f]})"
done
rm -f "$work/debian.extree" "$work/debian.qcow2"

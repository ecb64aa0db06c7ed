#!/bin/bash
# Build the small Linux guest that the guest iotests boot (extree-guest,
# extree-guest-kill): Debian 12's kernel (linux-image-*-amd64) and a busybox
# initramfs (busybox-static) whose /init is tests/guest/init.  The two
# packages are fetched once with `apt-get download` into the download cache
# that scripts/firmware.sh uses; nothing else is downloaded.
#
#   scripts/build-guest.sh [OUT_DIR]       default build/guest
#
# OUT_DIR gets vmlinux (the uncompressed kernel, booted through PVH),
# initrd.img and modules.txt (the modules in the initramfs, in load order).  Idempotent: it only repacks the initramfs
# when /init or the packer changed.
set -euo pipefail

top=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$top/build/guest}
cache=${EXTREE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/extree}
die() { echo "build-guest: error: $*" >&2; exit 1; }

# Drivers for the disks the tests attach (virtio-blk, virtio-scsi, AHCI)
# and the file system; their dependencies are found by the packer.
modules=(virtio_pci virtio_blk virtio_scsi sd_mod ahci ext4 crc32c_generic)

mkdir -p "$out" "$cache/deb"
log=$out/apt-download.log

# download PATTERN PACKAGE: the newest cached .deb matching PATTERN, or
# PACKAGE fetched with apt-get download.  apt-get's output is shown only on
# failure.
download() {
    local deb
    deb=$(ls -1 "$cache"/deb/$1 2>/dev/null | sort -V | tail -n 1 || true)
    if [ -z "$deb" ]; then
        if ! (cd "$cache/deb" && apt-get download -qq "$2") >"$log" 2>&1; then
            grep -v unsandboxed "$log" >&2 || true
            die "cannot download $2 (apt-get download): run scripts/setup-host.sh"
        fi
        deb=$(ls -1 "$cache"/deb/$1 2>/dev/null | sort -V | tail -n 1 || true)
        [ -n "$deb" ] || die "apt-get download $2 left no $1 in $cache/deb"
    fi
    echo "$deb"
}

stamp=$out/.packages
if [ ! -f "$out/vmlinux" ] || [ ! -f "$stamp" ] || [ ! -d "$out/kernel" ] ||
   [ ! -f "$out/busybox" ] || [ "$(tail -n 1 "$stamp")" != "${modules[*]}" ]; then
    # linux-image-amd64 is a metapackage: the kernel is the package it
    # depends on (linux-image-6.1.0-N-amd64 on Debian 12)
    kpkg=$(ls -1 "$cache"/deb/linux-image-[0-9]*-amd64_*_amd64.deb 2>/dev/null |
           sort -V | tail -n 1 || true)
    if [ -z "$kpkg" ]; then
        kname=$(apt-cache depends linux-image-amd64 2>/dev/null |
                sed -n 's/^ *Depends: \(linux-image-[0-9].*-amd64\)$/\1/p' | head -n 1)
        [ -n "$kname" ] || die "apt-cache knows no linux-image-amd64: run scripts/setup-host.sh"
        kpkg=$(download "${kname}_*_amd64.deb" "$kname")
    fi
    bpkg=$(download 'busybox-static_*_amd64.deb' busybox-static)

    echo "build-guest: unpacking $(basename "$kpkg") and $(basename "$bpkg")"
    rm -rf "$out/kernel.tmp" "$out/busybox.tmp"
    mkdir -p "$out/kernel.tmp" "$out/busybox.tmp"
    # only the kernel and the module tree (the .deb holds nothing else of use)
    dpkg-deb --fsys-tarfile "$kpkg" |
        tar -x -C "$out/kernel.tmp" --wildcards './boot/vmlinuz-*' './lib/modules/*' ||
        die "cannot unpack $kpkg"
    dpkg-deb -x "$bpkg" "$out/busybox.tmp" || die "cannot unpack $bpkg"
    rm -rf "$out/kernel"
    mv "$out/kernel.tmp" "$out/kernel"
    # The ELF kernel inside the bzImage (Debian's is xz-compressed): QEMU
    # boots it through PVH (pvh.bin), which spares the guest's decompressor
    # about 4 s of TCG every boot
    python3 - "$out"/kernel/boot/vmlinuz-* "$out/vmlinux.tmp" <<'PY' ||
import lzma, sys
data = open(sys.argv[1], 'rb').read()
start = data.find(b'\xfd7zXZ\x00')
if start < 0:
    sys.exit('no xz stream in ' + sys.argv[1])
elf = lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(data[start:])
if elf[:4] != b'\x7fELF':
    sys.exit('the xz stream of %s is not an ELF kernel' % sys.argv[1])
open(sys.argv[2], 'wb').write(elf)
PY
        die "cannot extract vmlinux from the kernel package"
    mv "$out/vmlinux.tmp" "$out/vmlinux"
    cp "$out/busybox.tmp/bin/busybox" "$out/busybox"
    rm -rf "$out/busybox.tmp" "$out/initrd.img"
    moddir=$(ls -d "$out"/kernel/lib/modules/*/ | head -n 1)
    python3 "$top/scripts/guest-initramfs.py" "$out/initrd.img" "$top/tests/guest/init" \
        "$out/busybox" "$moddir" "${modules[@]}" > "$out/modules.txt" ||
        die "cannot pack the initramfs"
    # keep only the modules the initramfs holds (400 MB less); repacking
    # resolves the same set from them
    find "$moddir" -name '*.ko' |
        awk -v keep="$(cat "$out/modules.txt")" '
            BEGIN { n = split(keep, k, " "); for (i = 1; i <= n; i++) want[k[i] ".ko"] = 1 }
            { b = $0; sub(/.*\//, "", b); if (!(b in want)) print }' |
        xargs -r rm -f
    printf '%s\n%s\n%s\n' "$(basename "$kpkg")" "$(basename "$bpkg")" "${modules[*]}" > "$stamp"
fi

init=$top/tests/guest/init
packer=$top/scripts/guest-initramfs.py
if [ ! -f "$out/initrd.img" ] || [ "$init" -nt "$out/initrd.img" ] ||
   [ "$packer" -nt "$out/initrd.img" ] || [ "$0" -nt "$out/initrd.img" ]; then
    moddir=$(ls -d "$out"/kernel/lib/modules/*/ | head -n 1)
    python3 "$packer" "$out/initrd.img" "$init" "$out/busybox" "$moddir" \
        "${modules[@]}" > "$out/modules.txt" || die "cannot pack the initramfs"
    echo "build-guest: $out/initrd.img ($(wc -w < "$out/modules.txt") modules," \
         "$(( $(stat -c %s "$out/initrd.img") / 1024 )) KiB)"
fi

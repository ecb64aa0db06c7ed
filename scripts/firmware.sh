#!/bin/bash
# Provide the x86 firmware that qemu-system-x86_64 loads when run from the
# build tree: SeaBIOS and iPXE from Debian's packages, and the x86 option ROMs
# (kvmvapic.bin, linuxboot*.bin, multiboot*.bin, pvh.bin) from Debian 13's
# qemu-system-data package of the same QEMU version (architecture all).
# Debian's QEMU tree has no prebuilt blobs, and building the option ROMs needs
# an i386 cross-compiler this machine lacks.
#
#   scripts/firmware.sh BUILD_DIR
set -euo pipefail

top=$(cd "$(dirname "$0")/.." && pwd)
blddir=${1:?usage: firmware.sh QEMU_BUILD_DIR}
cache=${EXTREE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/extree}
die() { echo "firmware: error: $*" >&2; exit 1; }

dst=$blddir/qemu-bundle/usr/local/share/qemu
mkdir -p "$dst"

[ -f /usr/share/seabios/bios-256k.bin ] ||
    die "SeaBIOS is missing: apt-get install seabios (scripts/setup-host.sh does)"
[ -d /usr/lib/ipxe/qemu ] ||
    die "iPXE ROMs are missing: apt-get install ipxe-qemu (scripts/setup-host.sh does)"
for f in /usr/share/seabios/*.bin /usr/lib/ipxe/qemu/*.rom; do
    ln -sfn "$f" "$dst/$(basename "$f")"
done

# Option ROMs from qemu-system-data.
rom_dir=$cache/qemu-system-data
if [ ! -f "$rom_dir/usr/share/qemu/kvmvapic.bin" ]; then
    mkdir -p "$cache/deb"
    deb=$(ls -1 "$cache"/deb/qemu-system-data_*10.0.*_all.deb 2>/dev/null | sort -V | tail -n 1 || true)
    if [ -z "$deb" ]; then
        ver=$(head -n 1 "$top"/build/src/qemu-10.0/debian/changelog 2>/dev/null |
              sed -n 's/^qemu (\(.*\)).*/\1/p')
        # apt-get's own status decides; its output is shown only on failure
        # (a grep filter's status would fail the step when nothing is left).
        if ! (cd "$cache/deb" &&
              { { [ -n "$ver" ] && apt-get download -qq "qemu-system-data=$ver"; } ||
                apt-get download -qq qemu-system-data/trixie; } >"$cache/apt-download.log" 2>&1); then
            grep -v unsandboxed "$cache/apt-download.log" >&2 || true
            die "cannot download Debian 13's qemu-system-data (x86 option ROMs): run scripts/setup-host.sh"
        fi
        deb=$(ls -1 "$cache"/deb/qemu-system-data_*_all.deb | sort -V | tail -n 1)
    fi
    rm -rf "$rom_dir.tmp"
    dpkg-deb -x "$deb" "$rom_dir.tmp" || die "cannot unpack $deb"
    rm -rf "$rom_dir"
    mv "$rom_dir.tmp" "$rom_dir"
fi
for f in kvmvapic.bin linuxboot.bin linuxboot_dma.bin multiboot.bin multiboot_dma.bin \
         pvh.bin qboot.rom; do
    [ -f "$rom_dir/usr/share/qemu/$f" ] || die "$f missing from qemu-system-data"
    ln -sfn "$rom_dir/usr/share/qemu/$f" "$dst/$f"
done

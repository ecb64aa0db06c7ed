#!/bin/bash
# Fetch Debian 13's QEMU 10.0.x source, graft extree into it, configure and
# build the tools and the x86_64 emulator, and provide the firmware.
#
#   scripts/build-qemu.sh            everything (idempotent, incremental)
#
# Environment:
#   QEMU_SRC=/path/to/qemu-10.0   graft into this existing tree instead of
#                                 unpacking Debian's source package
#   EXTREE_CACHE=DIR              where downloaded source packages are kept
#                                 (default ~/.cache/extree)
#   EXTREE_JOBS=N                 parallel build jobs (default: nproc)
#
# Outputs (fixed paths): build/qemu/{qemu-img,qemu-io,qemu-nbd,
# qemu-system-x86_64,storage-daemon/qemu-storage-daemon,
# tests/qemu-iotests/check}, build/qemu-version.txt, and
# build/qemu/qemu-img-stock (qemu-img without extree's patches to
# qemu-img.c, see scripts/build-qemu-img-stock.sh),
# build/qemu/nbdkit-extree-plugin.so (the nbdkit plugin, when built)
set -euo pipefail

top=$(cd "$(dirname "$0")/.." && pwd)
cd "$top"

die() { echo "build-qemu: error: $*" >&2; exit 1; }
say() { echo "build-qemu: $*"; }

cache=${EXTREE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/extree}
blddir=$top/build/qemu
jobs=${EXTREE_JOBS:-$(nproc)}

# --- 1. Source ---------------------------------------------------------------
fetch_source() {
    local dsc ver
    mkdir -p "$cache/deb"
    dsc=$(ls -1 "$cache"/deb/qemu_10.0.*.dsc 2>/dev/null | sort -V | tail -n 1 || true)
    if [ -z "$dsc" ]; then
        command -v apt-get >/dev/null || die "apt-get not found: this needs Debian"
        ver=$(apt-cache showsrc qemu 2>/dev/null | awk '/^Version: 1:10\.0\./ { print $2 }' |
              sort -V | tail -n 1)
        [ -n "$ver" ] || die "Debian 13's qemu 10.0.x source package not found by apt-cache showsrc qemu: run scripts/setup-host.sh (it adds a deb-src entry for trixie and runs apt-get update)"
        # stderr: this function's stdout is the .dsc path its caller captures
        say "downloading source package qemu $ver" >&2
        # apt-get's own status decides; its output is shown only on failure
        # (a grep filter's status would fail the step when nothing is left).
        if ! (cd "$cache/deb" &&
              apt-get source --download-only -qq "qemu=$ver" >"$cache/apt-source.log" 2>&1); then
            grep -v 'unsandboxed' "$cache/apt-source.log" >&2 || true
            die "apt-get source qemu=$ver failed: check the network and the deb-src entry"
        fi
        dsc=$(ls -1 "$cache"/deb/qemu_10.0.*.dsc | sort -V | tail -n 1)
    fi
    echo "$dsc"
}

unpack_source() {
    local dsc=$1 dst=$2 ver
    ver=$(awk '/^Version:/ { print $2; exit }' "$dsc")
    if [ -f "$dst/.extree-unpacked" ] && [ "$(cat "$dst/.extree-unpacked")" = "$ver" ]; then
        return 0
    fi
    command -v dpkg-source >/dev/null || die "dpkg-source not found: apt-get install dpkg-dev (scripts/setup-host.sh does)"
    rm -rf "$dst" "$dst.tmp"
    mkdir -p "$(dirname "$dst")"
    say "unpacking $(basename "$dsc") (dpkg-source applies Debian's patches)"
    dpkg-source --no-check -x "$dsc" "$dst.tmp" >/dev/null ||
        die "dpkg-source -x $dsc failed"
    echo "$ver" > "$dst.tmp/.extree-unpacked"
    mv "$dst.tmp" "$dst"
}

if [ -n "${QEMU_SRC:-}" ]; then
    src=$(cd "$QEMU_SRC" 2>/dev/null && pwd) || die "QEMU_SRC=$QEMU_SRC is not a directory"
    [ -f "$src/VERSION" ] && [ -f "$src/block/meson.build" ] ||
        die "QEMU_SRC=$src does not look like a QEMU source tree (no VERSION or block/meson.build)"
    case "$(cat "$src/VERSION")" in
        10.0.*) ;;
        *) die "QEMU_SRC=$src is QEMU $(cat "$src/VERSION"); extree's patches are for 10.0.x" ;;
    esac
    debver="(user tree)"
else
    dsc=$(fetch_source)
    src=$top/build/src/qemu-10.0
    unpack_source "$dsc" "$src"
    debver=$(cat "$src/.extree-unpacked")
fi
qver=$(cat "$src/VERSION")
mkdir -p "$top/build"
echo "QEMU $qver, Debian source package $debver, tree $src" > "$top/build/qemu-version.txt"
say "QEMU $qver (Debian $debver) in $src"

# --- 2. Graft ----------------------------------------------------------------
"$top/scripts/graft.sh" "$src"

# --- 3. Configure ------------------------------------------------------------
# With the network block drivers extree is tested over (iSCSI, Ceph RBD),
# built as loadable modules as Debian builds them (qemu-block-extra): a
# binary loads librbd or libiscsi only when an rbd: or iscsi:// image is
# opened, instead of paying their start-up in every command (issue 50).
cfg_args=(--target-list=x86_64-softmmu --disable-docs --disable-user --enable-tools
          --enable-kvm --disable-download --disable-install-blobs --disable-werror
          --enable-libiscsi --enable-rbd --enable-zstd --enable-modules
          --python=/usr/bin/python3)
need_cfg=1
if [ -f "$blddir/build.ninja" ] && [ -f "$blddir/.extree-configured" ] &&
   [ "$(cat "$blddir/.extree-configured")" = "$src ${cfg_args[*]}" ]; then
    need_cfg=0
fi
# ccache through its compiler links: QEMU's configure records plain "cc".
if [ -d /usr/lib/ccache ]; then
    export PATH=/usr/lib/ccache:$PATH
    # Paths under the checkout are hashed relative to it, so that another
    # clone (CI's) hits the same cache entries.
    export CCACHE_BASEDIR=$top CCACHE_NOHASHDIR=true
else
    say "warning: ccache not installed, rebuilds will be slower"
fi
if [ $need_cfg = 1 ]; then
    for dep in ninja pkg-config flex bison; do
        command -v $dep >/dev/null || die "build dependency '$dep' is missing: run scripts/setup-host.sh"
    done
    mver=$(meson --version 2>/dev/null || echo 0)
    dpkg --compare-versions "$mver" ge 1.5 ||
        die "meson >= 1.5 needed, found '$mver': run scripts/setup-host.sh (installs it from bookworm-backports)"
    rm -rf "$blddir"
    mkdir -p "$blddir"
    say "configuring in $blddir"
    if ! (cd "$blddir" && "$src/configure" "${cfg_args[@]}") > "$top/build/qemu-configure.log" 2>&1; then
        tail -n 20 "$top/build/qemu-configure.log" >&2
        die "QEMU's configure failed (log: build/qemu-configure.log); a missing library usually means: run scripts/setup-host.sh"
    fi
    echo "$src ${cfg_args[*]}" > "$blddir/.extree-configured"
fi

# --- 4. Build ----------------------------------------------------------------
# "modules": the block drivers for RBD and iSCSI (and the emulator's
# optional parts), loaded from qemu-bundle/usr/local/lib/x86_64-linux-gnu/qemu
targets=(qemu-img qemu-io qemu-nbd storage-daemon/qemu-storage-daemon qemu-system-x86_64
         modules)
say "building ${targets[*]} with $jobs jobs"
if ! ninja -C "$blddir" -j "$jobs" "${targets[@]}" > "$top/build/qemu-build.log" 2>&1; then
    grep -E -B2 -A8 'error|FAILED' "$top/build/qemu-build.log" | head -n 60 >&2
    die "QEMU build failed (log: build/qemu-build.log)"
fi
tail -n 1 "$top/build/qemu-build.log"
# A binary looks for its modules in qemu-bundle beside it: the storage
# daemon's lives one directory down
ln -sfn ../qemu-bundle "$blddir/storage-daemon/qemu-bundle"

# qemu-img without the patches to qemu-img.c, linked with the same objects,
# for the tests that compare the two (extree-map-stock).
"$top/scripts/build-qemu-img-stock.sh" "$src" "$blddir" ||
    die "building build/qemu/qemu-img-stock failed"

# --- 5. Firmware -------------------------------------------------------------
"$top/scripts/firmware.sh" "$blddir"

# --- 6. The nbdkit plugin, built by the core's meson (run as its `qemu`
# target, which sets MESON_BUILD_ROOT), next to the QEMU binaries
plugin=${MESON_BUILD_ROOT:-$top/build/core}/nbdkit/nbdkit-extree-plugin.so
if [ -f "$plugin" ]; then
    cp -p "$plugin" "$blddir/nbdkit-extree-plugin.so.tmp"
    mv -f "$blddir/nbdkit-extree-plugin.so.tmp" "$blddir/nbdkit-extree-plugin.so"
fi

for f in qemu-img qemu-img-stock qemu-io qemu-nbd storage-daemon/qemu-storage-daemon \
         qemu-system-x86_64 tests/qemu-iotests/check; do
    [ -x "$blddir/$f" ] || die "expected output $blddir/$f is missing"
done
say "done: $(cat "$top/build/qemu-version.txt")"

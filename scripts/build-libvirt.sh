#!/bin/bash
# Build libvirt 11.3 from Debian's source package with patches/libvirt/series
# (extree as a disk format), only what the tests need: the QEMU driver,
# libvirtd, virsh, the secrets driver and the dir/fs storage backends.
#
#   scripts/build-libvirt.sh           build (or reuse) and install
#   scripts/build-libvirt.sh --check   run libvirt's unit tests that cover
#                                      what the patches touch even when the
#                                      installed copy is reused (they run
#                                      anyway before a new copy is installed)
#
# Environment:
#   EXTREE_CACHE=DIR   downloaded source packages and the installed copies
#                      (default ~/.cache/extree)
#   EXTREE_JOBS=N      parallel build jobs (default: nproc)
#
# The installed copy is keyed by the hash of the series, the patches and
# this script's meson options: $EXTREE_CACHE/libvirt/KEY (its prefix;
# libvirt compiles its paths in).  A clean clone on the same
# machine finds it there and builds nothing.  Otherwise the source is
# unpacked into build/src/libvirt-11.3.0 and built in build/libvirt
# (incrementally, with ccache).
#
# Output: build/libvirt-inst, a link to the installed copy (sbin/libvirtd,
# bin/virsh); build/libvirt-version.txt.
set -euo pipefail

top=$(cd "$(dirname "$0")/.." && pwd)
cd "$top"

die() { echo "build-libvirt: error: $*" >&2; exit 1; }
say() { echo "build-libvirt: $*"; }

check=0
case "${1:-}" in
--check) check=1 ;;
"") ;;
*) die "usage: build-libvirt.sh [--check]" ;;
esac

cache=${EXTREE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/extree}
jobs=${EXTREE_JOBS:-$(nproc)}
upstream=11.3.0
src=$top/build/src/libvirt-$upstream
blddir=$top/build/libvirt
series=$top/patches/libvirt/series
mkdir -p "$top/build"

# --- 0. Build dependencies -----------------------------------------------------
# The subset of libvirt's Build-Depends (apt-cache showsrc libvirt) that this
# configuration needs; the rest of its list is for drivers, backends and docs
# that are not built.  Installed without recommends, from Debian 12.
deps=(libxml2-dev libxml2-utils xsltproc libgnutls28-dev libtirpc-dev libjson-c-dev
      libreadline-dev libcap-ng-dev libnl-3-dev libnl-route-3-dev libglib2.0-dev
      libattr1-dev perl python3 pkg-config ninja-build meson ccache dpkg-dev
      util-linux git patch xz-utils)
missing=()
for p in "${deps[@]}"; do
    dpkg-query -W -f '${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    SUDO=
    [ "$(id -u)" -eq 0 ] || SUDO="sudo -n"
    say "installing ${#missing[@]} build dependencies: ${missing[*]}"
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        "${missing[@]}" > "$top/build/libvirt-apt.log" 2>&1 ||
        { tail -n 20 "$top/build/libvirt-apt.log" >&2; die "apt-get install failed"; }
fi

# --- 1. What to build, and whether it is already built -----------------------------
# meson options: the QEMU driver and what its tests use, nothing else.
# qemu_datadir/qemu_moddir are fixed so that the prefix (which changes with
# the key) only reaches the few files that include configmake.h.
meson_opts=(
    --buildtype=debugoptimized
    -Ddocs=disabled -Dtests=enabled -Dexpensive_tests=disabled -Dnls=disabled
    -Ddriver_qemu=enabled -Ddriver_libvirtd=enabled -Ddriver_remote=enabled
    -Ddriver_secrets=enabled
    -Ddriver_bhyve=disabled -Ddriver_esx=disabled -Ddriver_hyperv=disabled
    -Ddriver_interface=disabled -Ddriver_libxl=disabled -Ddriver_lxc=disabled
    -Ddriver_ch=disabled -Ddriver_network=disabled -Ddriver_openvz=disabled
    -Ddriver_test=disabled -Ddriver_vbox=disabled -Ddriver_vmware=disabled
    -Ddriver_vz=disabled
    -Dstorage_dir=enabled -Dstorage_fs=enabled
    -Dstorage_disk=disabled -Dstorage_gluster=disabled -Dstorage_iscsi=disabled
    -Dstorage_iscsi_direct=disabled -Dstorage_lvm=disabled -Dstorage_mpath=disabled
    -Dstorage_rbd=disabled -Dstorage_scsi=disabled -Dstorage_vstorage=disabled
    -Dstorage_zfs=disabled
    -Dapparmor=disabled -Dsecdriver_apparmor=disabled -Dapparmor_profiles=disabled
    -Dselinux=disabled -Dsecdriver_selinux=disabled
    -Dpolkit=disabled -Dsasl=disabled -Dlibssh=disabled -Dlibssh2=disabled
    -Dwireshark_dissector=disabled -Dglusterfs=disabled -Dlibiscsi=disabled
    -Dnetcf=disabled -Dnumactl=disabled -Dsanlock=disabled -Dfirewalld=disabled
    -Dfirewalld_zone=disabled -Dhost_validate=disabled -Dlogin_shell=disabled
    -Dnss=disabled -Dnbdkit=disabled -Dssh_proxy=disabled -Dsysctl_config=disabled
    -Duserfaultfd_sysctl=disabled -Dbash_completion=disabled -Ddtrace=disabled
    -Daudit=disabled -Dcurl=disabled -Dopenwsman=disabled
    -Dinit_script=none -Dqemu_user=root -Dqemu_group=root
    -Dgit_werror=disabled -Dno_git=true -Drpath=enabled
    -Dqemu_datadir=/usr/share/qemu -Dqemu_moddir=/usr/lib/x86_64-linux-gnu/qemu
)
[ -f "$series" ] || die "$series is missing"
mapfile -t patches < <(grep -v -E '^\s*(#|$)' "$series")
key=$( { echo "libvirt $upstream, state directories under the prefix"; printf '%s\n' "${meson_opts[@]}"; cat "$series";
         for p in "${patches[@]}"; do cat "$top/patches/libvirt/$p"; done; } |
       sha256sum | cut -c1-12)
# short: QEMU's monitor socket goes under the prefix
inst=$cache/libvirt/$key
# QEMU's monitor socket goes under the prefix; a UNIX socket path has at
# most 107 bytes
sock_tail=/var/lib/libvirt/qemu/domain-99-probe/monitor.sock
if [ $(( ${#inst} + ${#sock_tail} )) -gt 107 ]; then
    say "warning: $inst is too long for QEMU monitor sockets under it: set EXTREE_CACHE to a shorter directory" >&2
fi

link_inst() {
    # a link this script made, or nothing (not a directory: ln would
    # put the link inside it)
    [ -L "$top/build/libvirt-inst" ] || rm -rf "$top/build/libvirt-inst"
    ln -sfn "$inst" "$top/build/libvirt-inst"
    echo "libvirt $upstream ($(cat "$inst/.extree-debver")), patches/libvirt key $key, installed in $inst" \
        > "$top/build/libvirt-version.txt"
}

if [ -f "$inst/.extree-complete" ] && [ $check = 0 ]; then
    link_inst
    say "up to date: $inst"
    exit 0
fi

# --- 2. Source -----------------------------------------------------------------
# Debian 13's libvirt source package (11.3.0-3+deb13uN).  Fetched with
# apt-get source --download-only; the archive may lack the .dsc of the
# newest point release while it has its tarballs, so the tarballs are
# checked against the Checksums-Sha256 of apt-cache showsrc instead and
# unpacked the way dpkg-source would (orig, then debian/, then its patches).
fetch_source() {
    local ver orig deb
    mkdir -p "$cache/deb"
    ver=$(apt-cache showsrc libvirt 2>/dev/null | awk '/^Version: 11\.3\.0-/ { print $2 }' |
          sort -V | tail -n 1)
    [ -n "$ver" ] || die "Debian 13's libvirt 11.3.0 source package not found by apt-cache showsrc libvirt: run scripts/setup-host.sh (deb-src for trixie)"
    orig=libvirt_$upstream.orig.tar.xz
    deb=libvirt_$ver.debian.tar.xz
    if [ ! -f "$cache/deb/$orig" ] || [ ! -f "$cache/deb/$deb" ]; then
        say "downloading source package libvirt $ver" >&2
        (cd "$cache/deb" && apt-get source --download-only -qq "libvirt=$ver" \
            > "$cache/apt-source-libvirt.log" 2>&1) || true
    fi
    for f in "$orig" "$deb"; do
        [ -f "$cache/deb/$f" ] ||
            { grep -v unsandboxed "$cache/apt-source-libvirt.log" >&2 || true
              die "apt-get source libvirt=$ver did not fetch $f"; }
        # the stanza of that version (showsrc lists every one it knows)
        want=$(apt-cache showsrc libvirt 2>/dev/null |
               awk -v f="$f" -v v="$ver" '
                   /^Package:/ { ok = 0 } /^Version:/ { ok = ($2 == v) }
                   /^Checksums-Sha256:/ { s = 1; next } /^[A-Za-z-]+:/ { s = 0 }
                   ok && s && $3 == f { print $1; exit }')
        [ -n "$want" ] || die "no checksum for $f in apt-cache showsrc libvirt ($ver)"
        have=$(sha256sum "$cache/deb/$f" | cut -d' ' -f1)
        [ "$have" = "$want" ] || die "$cache/deb/$f: sha256 $have, the archive says $want"
    done
    echo "$ver"
}

unpack_source() {
    local ver=$1 p
    if [ -f "$src/.extree-unpacked" ] &&
       [ "$(cat "$src/.extree-unpacked")" = "$ver $key" ]; then
        return 0
    fi
    say "unpacking libvirt $ver and applying patches/libvirt/series"
    rm -rf "$src" "$src.tmp"
    mkdir -p "$src.tmp"
    tar -C "$src.tmp" --strip-components=1 --no-same-owner \
        -xf "$cache/deb/libvirt_$upstream.orig.tar.xz"
    tar -C "$src.tmp" --no-same-owner -xf "$cache/deb/libvirt_$ver.debian.tar.xz"
    if [ -f "$src.tmp/debian/patches/series" ]; then
        while read -r p; do
            case "$p" in ''|'#'*) continue ;; esac
            patch -d "$src.tmp" -p1 -s -f < "$src.tmp/debian/patches/${p%% *}" > /dev/null ||
                die "Debian's patch $p does not apply"
        done < "$src.tmp/debian/patches/series"
    fi
    # The tree is a git repository with Debian's source as its first
    # commit and one commit per patch (git am: the series has binary test
    # images): edit, commit, then git format-patch into patches/libvirt.
    local git=(git -C "$src.tmp" -c user.name=build-libvirt -c user.email=build-libvirt@localhost)
    "${git[@]}" init -q
    printf '%s\n' .extree-debver .extree-unpacked >> "$src.tmp/.git/info/exclude"
    "${git[@]}" add -A
    "${git[@]}" commit -q -m "libvirt $ver (Debian's source package, its patches applied)"
    for p in "${patches[@]}"; do
        "${git[@]}" am -q --committer-date-is-author-date "$top/patches/libvirt/$p" ||
            die "patches/libvirt/$p does not apply to libvirt $ver"
    done
    echo "$ver" > "$src.tmp/.extree-debver"
    echo "$ver $key" > "$src.tmp/.extree-unpacked"
    mv "$src.tmp" "$src"
}

debver=$(fetch_source)
unpack_source "$debver"

# --- 3. Configure and build ----------------------------------------------------------
if [ -d /usr/lib/ccache ]; then
    export PATH=/usr/lib/ccache:$PATH CCACHE_BASEDIR=$top CCACHE_NOHASHDIR=true
fi
cfg="$src $inst runstatedir=$inst/var/run ${meson_opts[*]}"
if [ ! -f "$blddir/build.ninja" ] || [ "$(cat "$blddir/.extree-configured" 2>/dev/null)" != "$cfg" ]; then
    say "configuring in $blddir"
    if [ -f "$blddir/build.ninja" ]; then
        setup=(meson setup --reconfigure)
    else
        rm -rf "$blddir"
        setup=(meson setup)
    fi
    # runstatedir defaults to /run whatever the prefix: keep it under the
    # prefix with the other state directories
    if ! "${setup[@]}" "$blddir" "$src" --prefix="$inst" -Drunstatedir="$inst/var/run" \
            "${meson_opts[@]}" \
            > "$top/build/libvirt-configure.log" 2>&1; then
        tail -n 20 "$top/build/libvirt-configure.log" >&2
        die "libvirt's meson setup failed (log: build/libvirt-configure.log)"
    fi
    echo "$cfg" > "$blddir/.extree-configured"
fi
say "building with $jobs jobs"
if ! ninja -C "$blddir" -j "$jobs" > "$top/build/libvirt-build.log" 2>&1; then
    grep -E -B2 -A8 'error|FAILED' "$top/build/libvirt-build.log" | head -n 60 >&2
    die "libvirt build failed (log: build/libvirt-build.log)"
fi

# --- 4. Unit tests: before a new copy is installed, and with --check --------------------
if [ $check = 1 ] || [ ! -f "$inst/.extree-complete" ]; then
    say "unit tests"
    # Not qemuxmlconftest: its firmware cases expect the firmware
    # descriptors under /usr/share/qemu, which it mocks only for a /usr
    # prefix (102 firmware cases fail with this prefix; with --prefix=/usr
    # all 5244 cases pass, the series included)
    tests=(virstoragetest qemublocktest qemucapabilitiestest qemucaps2xmltest
           storagevolxml2argvtest storagevolxml2xmltest storagepoolxml2xmltest
           storagepoolcapstest genericxml2xmltest qemudomaincheckpointxml2xmltest
           qemudomainsnapshotxml2xmltest virschematest)
    meson test -C "$blddir" --no-rebuild --print-errorlogs "${tests[@]}" ||
        die "libvirt unit tests failed (log: build/libvirt/meson-logs/testlog.txt)"
fi

# --- 5. Install -----------------------------------------------------------------------
if [ ! -f "$inst/.extree-complete" ]; then
    say "installing into $inst"
    rm -rf "$inst"
    if ! meson install -C "$blddir" --no-rebuild > "$top/build/libvirt-install.log" 2>&1; then
        tail -n 20 "$top/build/libvirt-install.log" >&2
        die "meson install failed (log: build/libvirt-install.log)"
    fi
    # the privileged daemon's directories: tests mount private ones on these
    mkdir -p "$inst/etc/libvirt" "$inst/var/lib/libvirt" "$inst/var/run/libvirt" \
             "$inst/var/cache/libvirt" "$inst/var/log/libvirt"
    echo "$debver" > "$inst/.extree-debver"
    touch "$inst/.extree-complete"
fi
link_inst
for f in sbin/libvirtd bin/virsh; do
    [ -x "$inst/$f" ] || die "expected output $inst/$f is missing"
done
say "done: $(cat "$top/build/libvirt-version.txt")"

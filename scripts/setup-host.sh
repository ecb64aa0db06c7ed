#!/bin/bash
# Install what building and testing extree needs on Debian 12, as root or
# through sudo.  Idempotent: a second run changes nothing.
#
# What it adds to apt's configuration (and nothing else):
#   /etc/apt/sources.list.d/extree.sources   deb-src for trixie (QEMU's source),
#                                            deb for trixie and bookworm-backports
#   /etc/apt/preferences.d/extree            pins trixie to -1 (never installed;
#                                            only downloaded) and backports to 100
# The URIs are copied from the system's own debian.sources entry, so this
# file names no host.
set -euo pipefail

die() { echo "setup-host: $*" >&2; exit 1; }

# apt's own output (one line per package unpacked) goes to a log; the
# terminal gets one line per step, and the log's tail if a step fails
log=$(cd "$(dirname "$0")/.." && pwd)/build/setup-host.log
mkdir -p "$(dirname "$log")"
quiet() {
    if ! "$@" >> "$log" 2>&1; then
        tail -n 20 "$log" >&2
        return 1
    fi
}

SUDO=
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
        SUDO="sudo -n"
    else
        die "need root to install packages: run as root, or give this user password-less sudo"
    fi
fi

[ -r /etc/os-release ] && . /etc/os-release
if [ "${VERSION_CODENAME:-}" != bookworm ]; then
    echo "setup-host: warning: written for Debian 12 (bookworm), this is ${PRETTY_NAME:-unknown}" >&2
fi

# The main Debian archive URI, from the system's own sources.
main_uri() {
    local f
    for f in /etc/apt/sources.list.d/debian.sources; do
        [ -r "$f" ] || continue
        awk 'BEGIN { RS = ""; FS = "\n" }
             /Suites:[^\n]*bookworm( |$|\n)/ && !/security/ {
                 for (i = 1; i <= NF; i++)
                     if ($i ~ /^URIs:/) { sub(/^URIs:[ \t]*/, "", $i); split($i, u, " "); print u[1]; exit }
             }' "$f"
    done
    if [ -r /etc/apt/sources.list ]; then
        awk '$1 == "deb" && $3 == "bookworm" { print $2; exit }' /etc/apt/sources.list
    fi
}

uri=$(main_uri | head -n 1)
[ -n "$uri" ] || die "cannot find the Debian archive URI in /etc/apt/sources.list.d/debian.sources or /etc/apt/sources.list"

src_file=/etc/apt/sources.list.d/extree.sources
pref_file=/etc/apt/preferences.d/extree
want_src="# Added by extree's scripts/setup-host.sh
Types: deb deb-src
URIs: $uri
Suites: trixie
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: $uri
Suites: bookworm-backports
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg"
want_pref="# Added by extree's scripts/setup-host.sh: trixie is only for
# 'apt-get source qemu' and 'apt-get download qemu-system-data'.
Package: *
Pin: release n=trixie
Pin-Priority: -1

Package: *
Pin: release n=bookworm-backports
Pin-Priority: 100"

changed=0
if [ "$(cat "$src_file" 2>/dev/null)" != "$want_src" ]; then
    echo "setup-host: writing $src_file (deb-src trixie, deb trixie, deb bookworm-backports)"
    echo "$want_src" | $SUDO tee "$src_file" >/dev/null
    changed=1
fi
if [ "$(cat "$pref_file" 2>/dev/null)" != "$want_pref" ]; then
    echo "setup-host: writing $pref_file (trixie pinned to -1, backports to 100)"
    echo "$want_pref" | $SUDO tee "$pref_file" >/dev/null
    changed=1
fi

stamp=/var/lib/apt/lists/.extree-updated
if [ $changed = 1 ] || [ ! -e "$stamp" ] ||
   ! apt-cache showsrc qemu 2>/dev/null | grep -q '^Version: 1:10\.0'; then
    echo "setup-host: apt-get update (log: $log)"
    quiet $SUDO apt-get update -qq || die "apt-get update failed: check the network and /etc/apt/sources.list.d"
    $SUDO touch "$stamp"
fi

pkgs=(
    build-essential pkg-config ccache ninja-build flex bison dpkg-dev
    python3 python3-venv python3-pycotap
    libglib2.0-dev libpixman-1-dev zlib1g-dev libzstd-dev libaio-dev liburing-dev
    libslirp-dev libfdt-dev libcap-ng-dev libattr1-dev
    seabios ipxe-qemu
    socat file bc xz-utils e2fsprogs
    btrfs-progs xfsprogs
    clang-16 libclang-rt-16-dev llvm-16
    libnbd-bin python3-libnbd nbdkit nbdkit-plugin-dev fio strace
    libiscsi-dev tgt
)
missing=()
for p in "${pkgs[@]}"; do
    dpkg-query -W -f '${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "setup-host: installing ${#missing[@]} packages (log: $log)"
    quiet $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" ||
        die "apt-get install failed for: ${missing[*]}"
fi

# Debian's own QEMU, libguestfs and a kernel for its appliance: the nbdkit
# plugin's tests use a distribution's binaries, not this project's
# (qemu-block-extra: its rbd, iscsi, ... modules).  Ceph's daemons and
# librbd: QEMU's rbd driver, and the one-node cluster of extree-rbd
# (scripts/ceph-cluster.sh).  virtnbdbackup 1.9.15 and its Python modules
# (python3-libvirt, -libnbd, -lxml, ...): the iotest extree-virtnbdbackup
# runs a patched copy of it (patches/virtnbdbackup) against the private
# libvirtd of scripts/build-libvirt.sh.  Without recommends (qemu-system-x86
# would pull in a desktop's worth, ceph-mgr half of Python's,
# python3-libvirt Debian's own libvirt daemon).
stock=(qemu-utils qemu-block-extra qemu-system-x86 libguestfs-tools linux-image-amd64
       ceph-mon ceph-osd ceph-mgr ceph-common librbd-dev virtnbdbackup)
missing=()
for p in "${stock[@]}"; do
    dpkg-query -W -f '${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "setup-host: installing ${#missing[@]} packages without recommends (log: $log)"
    quiet $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" ||
        die "apt-get install failed for: ${missing[*]}"
fi

# meson >= 1.5 from bookworm-backports (bookworm has 1.0).
mver=$(dpkg-query -W -f '${Version}' meson 2>/dev/null || true)
if [ -z "$mver" ] || dpkg --compare-versions "$mver" lt 1.5; then
    echo "setup-host: installing meson from bookworm-backports (log: $log)"
    quiet $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -t bookworm-backports meson ||
        die "cannot install meson >= 1.5 from bookworm-backports"
fi
exit 0

#!/bin/bash
# make bench: extree against qcow2 (64 KiB and 4 KiB clusters) and raw sparse
# files on btrfs, XFS and ext4, all through one snapshot of build/qemu's
# qemu-img and qemu-io (issue 5).  Needs root: it makes btrfs, XFS and ext4
# filesystems on loop devices over sparse files under --dir, mounts them under
# DIR/mnt/{btrfs,xfs,ext4} (and DIR/mnt/btrfs-lzo, mounted compress=lzo, for
# S3L), and always unmounts them and detaches its loop devices on exit.
#
#   scripts/bench.sh [--scale full|quick|1/N] [--runs N] [--scenarios LIST]
#                    [--formats LIST] [--measures LIST] [--dir DIR] ...
#
# --scale quick divides the scenario sizes by 64 (a few minutes); full (the
# default) is the published benchmark.  Results: DIR/results/<scale>/*.csv;
# then scripts/bench-report.py copies them to docs/performance/<scale>/, draws
# the plots and rewrites docs/performance.rst.  See --help.
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
orig_args=("$@")

usage() {
    cat <<EOF
usage: scripts/bench.sh [options]            (or: make bench BENCH_ARGS="...")
  --scale S          full (default), quick (sizes / 64) or 1/N
  --runs N           repetitions; each is one cold and one warm run (default 5)
  --scenarios LIST   comma-separated from S1 S2 S3 S3L S4 SCALE (every map
                     scaling size) or SCALE-<N>, e.g. SCALE-1e4 (default: all)
  --formats LIST     from extree qcow2-64k qcow2-4k raw-btrfs raw-xfs raw-ext4
                     (default: all; extree is skipped, with the reason in the
                     results, while build/qemu/qemu-img has no extree driver)
  --measures LIST    from map map-stock nbdmap alloc open qmap seekhole
                     convert-raw convert-null bench-read-d1 bench-read-d32
                     bench-read-d1-cache8m bench-read-d32-cache8m
                     bench-write-d1 bench-write-d32 callgrind snapshot
                     bitmaps regress
                     (default: each scenario's set, snapshot, bitmaps and
                     regress)
  --dir DIR          scratch directory for the filesystem images, mounts and
                     results (default: build/bench)
  --image-fs FS      filesystem holding the qcow2 and extree images (xfs)
  --bench-secs S     target length of one qemu-img bench run (full 5, quick 0.3)
  --max-image-gib G  skip an image needing more host space than this (32)
  --keep             keep the filesystem images under DIR/fs after the run
  --no-report        do not run scripts/bench-report.py afterwards
  --append           add to the results of earlier runs at this scale
                     instead of starting afresh: rows of the scenarios
                     measured now replace theirs, the others stay (a full
                     run can be made in parts, e.g. --scenarios SCALE)
EOF
}

die() { echo "bench: error: $*" >&2; exit 1; }

scale=full runs=5 scenarios=all formats=all measures='' dir=$top/build/bench
image_fs=xfs bench_secs='' max_gib=32 keep=0 report=1 append=0
while [ $# -gt 0 ]; do
    case $1 in
        --scale) scale=${2:?}; shift 2 ;;
        --runs) runs=${2:?}; shift 2 ;;
        --scenarios) scenarios=${2:?}; shift 2 ;;
        --formats) formats=${2:?}; shift 2 ;;
        --measures) measures=${2:?}; shift 2 ;;
        --dir) dir=${2:?}; shift 2 ;;
        --image-fs) image_fs=${2:?}; shift 2 ;;
        --bench-secs) bench_secs=${2:?}; shift 2 ;;
        --max-image-gib) max_gib=${2:?}; shift 2 ;;
        --keep) keep=1; shift ;;
        --no-report) report=0; shift ;;
        --append) append=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) usage >&2; die "unknown option $1" ;;
    esac
done
case $scale in full|quick|1/[0-9]*) ;; *) die "--scale: want full, quick or 1/N" ;; esac
[[ $runs =~ ^[1-9][0-9]*$ ]] || die "--runs: want a positive number"
case $image_fs in btrfs|xfs|ext4) ;; *) die "--image-fs: want btrfs, xfs or ext4" ;; esac

if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
        exec sudo -n "$0" "${orig_args[@]}"
    fi
    die "needs root (loop devices, mounts, drop_caches): run as root or with password-less sudo"
fi

if [ ! -x "$top/build/qemu/qemu-img" ] || [ ! -x "$top/build/qemu/qemu-io" ]; then
    die "build/qemu/qemu-img or qemu-io is missing: run make first"
fi

# What the run needs from Debian; installed if missing.
py=/usr/bin/python3
need=()
for c in mkfs.btrfs:btrfs-progs mkfs.xfs:xfsprogs xfs_io:xfsprogs \
         mkfs.ext4:e2fsprogs valgrind:valgrind callgrind_annotate:valgrind \
         losetup:mount fstrim:util-linux /usr/bin/time:time $py:python3 \
         fio:fio nbdinfo:libnbd-bin; do
    command -v "${c%%:*}" >/dev/null || need+=("${c#*:}")
done
if [ "$report" = 1 ] && ! $py -c 'import matplotlib' 2>/dev/null; then
    need+=(python3-matplotlib)
fi
if [ ${#need[@]} -gt 0 ]; then
    mapfile -t need < <(printf '%s\n' "${need[@]}" | sort -u)
    echo "bench: installing Debian packages: ${need[*]} (tools and plots the benchmark uses)"
    apt-get install -y --no-install-recommends "${need[@]}" >/dev/null ||
        die "apt-get install ${need[*]} failed"
fi

# The filesystems: sparse backing files, sized so that no scenario fills
# them (the host's free space is checked separately, before every image).
fss=(btrfs xfs ext4)
case ",$scenarios," in
    ,all,|*,S3L,*) case ",$formats," in ,all,|*,raw-btrfs,*) fss+=(btrfs-lzo) ;; esac ;;
esac
if [ "$scale" = full ]; then
    declare -A fs_size=([btrfs]=96G [xfs]=160G [ext4]=96G [btrfs-lzo]=48G)
else
    declare -A fs_size=([btrfs]=16G [xfs]=24G [ext4]=16G [btrfs-lzo]=8G)
fi
mkdir -p "$dir/fs" "$dir/mnt"
dir=$(cd "$dir" && pwd)
avail_g=$(( $(df --output=avail -k "$dir" | tail -n 1) / 1024 / 1024 ))
if [ "$scale" = full ] && [ "$avail_g" -lt 40 ]; then
    echo "bench: warning: only $avail_g GiB free under $dir; a full run wants about 30 GiB" \
         "(images that do not fit are skipped, with the reason in the results)" >&2
fi

loops=() mounts=()
cleanup() {
    local rc=$? m l i
    set +e
    for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do
        m=${mounts[i]}
        for _ in 1 2 3 4 5; do
            umount "$m" 2>/dev/null && break
            sleep 1
        done
        if mountpoint -q "$m"; then
            echo "bench: warning: $m is busy; detaching it lazily" >&2
            umount -l "$m"
        fi
    done
    for l in "${loops[@]}"; do
        losetup -d "$l" 2>/dev/null || echo "bench: warning: could not detach $l" >&2
    done
    if [ "$keep" = 0 ]; then
        for f in "${fss[@]}"; do rm -f "$dir/fs/$f.img"; done
    fi
    [ ${#loops[@]} -gt 0 ] && echo "bench: unmounted ${mounts[*]}; detached ${loops[*]}"
    exit $rc
}
child='' interrupted=0
# Signals go to the measuring python too (it runs its commands in their own
# process groups and kills them); then the EXIT trap unmounts and detaches.
on_signal() {
    interrupted=$1
    [ -n "$child" ] && kill -TERM "$child" 2>/dev/null
    return 0
}
trap cleanup EXIT
trap 'on_signal 130' INT
trap 'on_signal 143' TERM HUP

# Loop devices left attached to our backing files by a run that was killed.
for f in "${fss[@]}"; do
    img=$dir/fs/$f.img
    [ -e "$img" ] || continue
    for l in $(losetup -j "$img" -O NAME -n 2>/dev/null); do
        for m in $(findmnt -rn -S "$l" -o TARGET); do umount "$m" || umount -l "$m"; done
        losetup -d "$l" && echo "bench: detached $l, left over from an earlier run"
    done
done

for f in "${fss[@]}"; do
    img=$dir/fs/$f.img mnt=$dir/mnt/$f
    rm -f "$img"
    truncate -s "${fs_size[$f]}" "$img"
    l=$(losetup -f --show "$img")
    loops+=("$l")
    opts=()
    case $f in
        btrfs|btrfs-lzo) mkfs.btrfs -f -q "$l" > "$dir/fs/$f.mkfs.log" 2>&1 ;;
        xfs) mkfs.xfs -f -q "$l" > "$dir/fs/$f.mkfs.log" 2>&1 ;;
        ext4) mkfs.ext4 -q -F -E lazy_itable_init=1,nodiscard "$l" > "$dir/fs/$f.mkfs.log" 2>&1 ;;
    esac || die "mkfs on $l for $f failed: $(tail -n 3 "$dir/fs/$f.mkfs.log")"
    case $f in
        btrfs-lzo) opts=(-o compress=lzo) ;;
        ext4) opts=(-o noinit_itable) ;;
    esac
    mkdir -p "$mnt"
    mountpoint -q "$mnt" && die "$mnt is already mounted"
    mount "${opts[@]}" "$l" "$mnt"
    mounts+=("$mnt")
    echo "bench: $f on $l (sparse ${fs_size[$f]}) at $mnt"
done

cmdline="scripts/bench.sh${orig_args[*]:+ ${orig_args[*]}}"
pyargs=(--top "$top" --dir "$dir" --scale "$scale" --runs "$runs"
        --scenarios "$scenarios" --formats "$formats" --image-fs "$image_fs"
        --max-image-gib "$max_gib" --cmdline "$cmdline")
# snapshot and bitmaps are bench-snapshot.py's and bench-bitmaps.py's,
# below; the rest are bench.py's
py_measures=$(echo ",$measures," |
              sed 's/,snapshot,/,/g; s/,bitmaps,/,/g; s/,regress,/,/g;
                   s/^,//; s/,$//')
[ -n "$py_measures" ] && pyargs+=(--measures "$py_measures")
[ -n "$bench_secs" ] && pyargs+=(--bench-secs "$bench_secs")
[ "$append" = 1 ] && pyargs+=(--append)
if [ -z "$measures" ] || [ -n "$py_measures" ]; then
    $py "$top/scripts/bench.py" "${pyargs[@]}" &
    child=$!
    rc=0
    while :; do
        wait "$child" || rc=$?
        kill -0 "$child" 2>/dev/null || break   # wait was cut short by a signal
    done
    child=
    [ "$interrupted" != 0 ] && exit "$interrupted"
    [ "$rc" = 0 ] || die "scripts/bench.py failed (exit $rc); partial results in $dir/results"
fi

# Internal snapshots (issue 21): qemu-img snapshot -c/-a/-d and the writes
# after one, extree against qcow2, on the S1 and S2 layouts, on the file
# system that holds the other measures' qcow2 and extree images
# (scripts/bench-snapshot.py)
if [ -z "$measures" ] || [[ ",$measures," == *,snapshot,* ]]; then
    $py "$top/scripts/bench-snapshot.py" --scale "$scale" --runs "$runs" \
        --dir "$dir/mnt/$image_fs/snapshot" --max-image-gib "$max_gib" \
        --results "$dir/results/${scale//\//-}" ||
        die "scripts/bench-snapshot.py failed"
fi

# Persistent dirty bitmaps (issue 32): open with bitmaps, the NBD map of
# one, writes with one enabled, their space; extree against qcow2 on S2
# (scripts/bench-bitmaps.py, results also in docs/bitmaps.rst)
if [ -z "$measures" ] || [[ ",$measures," == *,bitmaps,* ]]; then
    $py "$top/scripts/bench-bitmaps.py" --scale "$scale" --runs "$runs" \
        --dir "$dir/mnt/$image_fs/bitmaps" \
        --out "$dir/results/${scale//\//-}/bitmaps.csv" ||
        die "scripts/bench-bitmaps.py failed"
fi

# Whole-command costs that regressed once (issue 50): start-up against
# Debian's qemu-img, snapshot -c and -d and the first write of a session at
# 65,536 and 1,048,576 extents (scripts/bench-regress.py)
if [ -z "$measures" ] || [[ ",$measures," == *,regress,* ]]; then
    $py "$top/scripts/bench-regress.py" --scale "$scale" --runs "$runs" \
        --dir "$dir/mnt/$image_fs/regress" \
        --out "$dir/results/${scale//\//-}/regress.csv" ||
        die "scripts/bench-regress.py failed"
fi

if [ "$report" = 1 ]; then
    $py "$top/scripts/bench-report.py" --top "$top" \
        --results "$dir/results/${scale//\//-}"
fi

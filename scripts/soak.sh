#!/bin/bash
# Soak runs of extree's reliability iotests with new seeds and larger
# counts than the test command uses:
#
#   extree-concurrency  NBD clients and virtio-blk queues in four iothreads
#                       against a byte model (make check: 240,000
#                       operations, seed 1)
#   extree-kill         SIGKILL of an NBD-serving qemu-storage-daemon under
#                       load, check and flushed data (make check: 50 kills)
#   extree-crash        power-cut states replayed from a blklogwrites log,
#                       check and data of the last flush (make check: 3
#                       seeds)
#
# Usage: scripts/soak.sh [OPTIONS]
#   --rounds N       rounds; each runs every selected test once with the
#                    next seed (default 1)
#   --seed S         first seed (default: a random one, printed)
#   --ops N          extree-concurrency: operations per round
#                    (default 1000000)
#   --size MIB       extree-concurrency: image size (default 256)
#   --kills N        extree-kill: kills per round (default 500)
#   --crash-seeds N  extree-crash: seeds per round (default 20)
#   --only LIST      comma-separated subset of concurrency,kill,crash
#
# Needs a built tree (make, or make check).  Each test runs through QEMU's
# ./check with a private scratch directory; the figures of every run go to
# build/soak/stats, the output of a failed one is kept under build/soak/.
# The last line is "soak: N runs, N failed"; exit status 1 if any failed.
# A failed run names its seed and the command that runs it again.
set -uo pipefail

top=$(cd "$(dirname "$0")/.." && pwd)
iot=$top/build/qemu/tests/qemu-iotests
out=$top/build/soak

rounds=1 seed= ops=1000000 size=256 kills=500 crash_seeds=20
only=concurrency,kill,crash
usage() { sed -n '/^# Usage/,/^# Needs/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 2; }
while [ $# -gt 0 ]; do
    case $1 in
    --rounds) rounds=$2; shift ;;
    --seed) seed=$2; shift ;;
    --ops) ops=$2; shift ;;
    --size) size=$2; shift ;;
    --kills) kills=$2; shift ;;
    --crash-seeds) crash_seeds=$2; shift ;;
    --only) only=$2; shift ;;
    -h|--help) usage ;;
    *) echo "soak: unknown option $1" >&2; usage ;;
    esac
    shift
done
for n in "$rounds" "$ops" "$size" "$kills" "$crash_seeds" ${seed:+"$seed"}; do
    [[ $n =~ ^[0-9]+$ ]] || { echo "soak: not a number: $n" >&2; exit 2; }
done
[ -x "$iot/check" ] || { echo "soak: build/qemu is not built: run make first" >&2; exit 2; }
[ -n "$seed" ] || seed=$(( (RANDOM << 15 | RANDOM) % 1000000 + 2 ))

mkdir -p "$out"
scratch=$(mktemp -d "$out/scratch.XXXXXX")
trap 'rm -rf "$scratch"' EXIT
echo "soak: seeds from $seed, $rounds round(s) of: $only"
echo "soak: $(date -u +%FT%TZ) seeds from $seed, $rounds round(s) of $only" >> "$out/stats"

runs=0 failed=0
# run TEST OK_PATTERN ENV...: one ./check run, judged by its output (a
# seed other than 1 changes the output, so ./check's own verdict is not
# the one that counts)
run() {
    local test=$1 ok=$2; shift 2
    local t0=$SECONDS res bad="$scratch/extree-file-$test/$test.out.bad"
    runs=$((runs + 1))
    (cd "$iot" && env TEST_DIR="$scratch" EXTREE_STATS="$out/stats" "$@" \
        nice -n 5 ./check -extree "$test") > "$scratch/check.log" 2>&1
    if grep -q -E "^$test +pass" <(tr '\r' '\n' < "$scratch/check.log"); then
        res=ok
    elif [ -f "$bad" ] && grep -q -E "$ok" "$bad" &&
         ! grep -q -E 'FAILED|Traceback|FEW|[1-9][0-9]* (bad states|states with wrong)' "$bad"; then
        res=ok
    else
        res=FAILED
    fi
    echo "soak: $test $* : $res ($((SECONDS - t0)) s)"
    if [ $res != ok ]; then
        failed=$((failed + 1))
        local keep
        keep="$out/failed-$test-$(date -u +%Y%m%dT%H%M%S)"
        mkdir -p "$keep"
        cp "$scratch/check.log" "$keep/"
        [ -f "$bad" ] && cp "$bad" "$keep/"
        cp "$scratch/extree-file-$test/"*FAILED* "$keep/" 2>/dev/null
        echo "soak:   output kept in ${keep#"$top"/}; again: (cd build/qemu/tests/qemu-iotests && $* ./check -extree $test)"
        sed 's/^/soak:   | /' "${bad:-/dev/null}" 2>/dev/null | head -20
    fi
    rm -rf "${scratch:?}/extree-file-$test"
}

for ((r = 0; r < rounds; r++)); do
    s=$((seed + r))
    case ,$only, in *,concurrency,*)
        run extree-concurrency 'operations in all' \
            EXTREE_CONC_SEED=$s EXTREE_CONC_OPS=$ops EXTREE_CONC_SIZE=$size ;;
    esac
    case ,$only, in *,kill,*)
        run extree-kill 'then stopped under load' \
            EXTREE_KILL_SEED=$s EXTREE_KILL_ROUNDS=$kills ;;
    esac
    case ,$only, in *,crash,*)
        a=$((s * crash_seeds)) b=$((s * crash_seeds + crash_seeds - 1))
        run extree-crash '0 bad states, 0 states with wrong data' \
            EXTREE_CRASH_SEEDS=$a-$b ;;
    esac
done
echo "soak: $runs runs, $failed failed"
echo "soak: $runs runs, $failed failed" >> "$out/stats"
[ $failed -eq 0 ]

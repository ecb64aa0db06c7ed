#!/bin/bash
# Fuzz the extree core with libFuzzer (tests/fuzz/fuzz-core, clang-16,
# ASan + UBSan) for N executions, then report executions, coverage and
# crashes.  Not part of `make check`: the corpus it leaves can be merged
# into tests/fuzz/corpus, which `make check` replays.
#
#   scripts/fuzz.sh [-n EXECUTIONS] [-t SECONDS] [--merge] [-- LIBFUZZER-ARGS]
#
#   -n N       executions in all (default 10000000)
#   -t S       stop after S seconds even if fewer executions ran
#   --fast     without ASan/UBSan (build/fuzz-fast): several times the
#              executions per second; the oracle still checks every
#              answer, and crashes it finds are replayed under the
#              sanitizers by `make check` once saved into tests/fuzz/fixed
#   --merge    afterwards, replace tests/fuzz/corpus by the fewest inputs
#              (smallest first) that reach every edge it and the working
#              corpus reach (libFuzzer -merge=1 -use_counters=0)
#
# libFuzzer stops at the first crash or oracle violation; this script
# saves the input (build/fuzz/artifacts/) and goes on with the executions
# left, so one run reports every crash it finds.  Known violations can be
# let pass with EXTREE_FUZZ_TOLERATE (tests/fuzz/fuzz-core.c).
#
# Working corpus: build/fuzz/corpus (kept between runs), seeded from
# tests/fuzz/seeds and tests/fuzz/corpus.  Runs at nice 10, one process.
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
cd "$top"

runs=10000000
max_time=0
merge=false
fast=false
while [ $# -gt 0 ]; do
    case "$1" in
    -n) runs=$2; shift 2 ;;
    -t) max_time=$2; shift 2 ;;
    --merge) merge=true; shift ;;
    --fast) fast=true; shift ;;
    --) shift; break ;;
    *) echo "usage: $0 [-n EXECUTIONS] [-t SECONDS] [--fast] [--merge]" \
            "[-- LIBFUZZER-ARGS]" >&2
       exit 2 ;;
    esac
done

if $fast; then
    build=build/fuzz-fast
    sanitize=none
else
    build=build/fuzz
    sanitize=address,undefined
fi
if [ ! -f $build/build.ninja ]; then
    CC=clang-16 meson setup $build -Dfuzz=true -Dbuildtype=debugoptimized \
        -Db_sanitize=$sanitize -Db_lundef=false >/dev/null
fi
nice -n 10 meson compile -C $build tests/fuzz/fuzz-core >/dev/null

fuzzer=$build/tests/fuzz/fuzz-core
work=$build/corpus
artifacts=$build/artifacts
log=$build/fuzz.log
# The fast build starts from what the sanitized campaigns found
if [ ! -d $work ] && [ -d build/fuzz/corpus ] && $fast; then
    cp -r build/fuzz/corpus $work
fi
mkdir -p $work $artifacts
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}

# Inputs are images up to 560 KiB (sparse once mutated) with the
# mutator's edit records; crossing two images over would only destroy
# both.  The entropic schedule costs a third of the time with the many
# features of this target: the plain one runs half as many inputs again.
args=(-max_len=1048576 -cross_over=0 -entropic=0 -print_final_stats=1
      -artifact_prefix=$artifacts/ "$@")

: > $log
done_runs=0
start=$(date +%s)
segments=0
while [ $done_runs -lt $runs ]; do
    left=$((runs - done_runs))
    targs=()
    if [ "$max_time" -gt 0 ]; then
        t=$((max_time - ($(date +%s) - start)))
        [ $t -le 0 ] && break
        targs=(-max_total_time=$t)
    fi
    segments=$((segments + 1))
    echo "== segment $segments: up to $left executions" >> $log
    set +e
    nice -n 10 $fuzzer "${args[@]}" "${targs[@]}" -runs=$left \
        $work tests/fuzz/seeds tests/fuzz/corpus > $build/segment.log 2>&1
    rc=$?
    set -e
    cat $build/segment.log >> $log
    n=$(grep -a '^stat::number_of_executed_units:' $build/segment.log |
        tail -1 | awk '{print $2}')
    done_runs=$((done_runs + ${n:-0}))
    # 0: all executions ran (or the time is up); else a crash was saved.
    # A crash while loading the corpus would only come back: stop.
    if [ $rc -eq 0 ] || ! grep -a -q -P '\tINITED ' $build/segment.log; then
        break
    fi
done
wall=$(($(date +%s) - start))

# The last status line has libFuzzer's coverage: cov = edges and
# counters of the core hit, ft = features (edges with hit-count buckets)
last=$(grep -a -E '^#[0-9]+[[:space:]]+(pulse|NEW|REDUCE|DONE|INITED)' $log | tail -1 || true)
cov=$(sed -n 's/.* cov: \([0-9]*\).*/\1/p' <<< "$last")
ft=$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<< "$last")
crashes=$(grep -a -c '^artifact_prefix=.*Test unit written to' $log || true)

echo "executions: $done_runs in $wall s ($((done_runs / (wall > 0 ? wall : 1))) exec/s), $segments segment(s)"
echo "coverage: cov $cov, ft $ft"
echo "corpus: $(ls $work | wc -l) inputs, $(du -sh $work | cut -f1) in $work"
echo "crashes and oracle violations: $crashes"
grep -a -E '^(extree fuzz oracle violation|SUMMARY:|==[0-9]+==ERROR)' $log |
    sort | uniq -c || true
grep -a 'Test unit written to' $log | sed 's/.*written to /  input: /' || true
echo "log: $log"

# Edges, not hit counts: the corpus stays a few MB (167 inputs, 7 MB,
# for 4847 edges after the first campaign); named reproducers live in
# tests/fuzz/fixed, which this leaves alone.  Inputs that crash in the
# merge stay out: merge with the tolerances of the replay in `make
# check` (tests/fuzz/meson.build), not a campaign's wider ones, or the
# replay fails on inputs of the known classes that it does not tolerate.
if $merge; then
    new=$build/corpus.merged
    rm -rf $new
    mkdir -p $new tests/fuzz/corpus
    nice -n 10 $fuzzer -merge=1 -use_counters=0 "${args[@]}" $new \
        tests/fuzz/corpus $work > $build/merge.log 2>&1
    rm -rf tests/fuzz/corpus
    mv $new tests/fuzz/corpus
    echo "merged: tests/fuzz/corpus has $(ls tests/fuzz/corpus | wc -l)" \
         "inputs, $(du -sh tests/fuzz/corpus | cut -f1)"
fi
[ "$crashes" -eq 0 ]

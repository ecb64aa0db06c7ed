#!/bin/bash
# Run QEMU's generic iotests (and, for extree, the project's own iotests)
# against build/qemu for each format given, and summarize.
#
#   scripts/run-iotests.sh [FORMAT...]        default: qcow2 raw, and extree
#                                             once the driver is built
# Results: build/iotests/FORMAT.results ("TEST RESULT" per line) and the
# full log build/iotests/FORMAT.log.  An expected failure is a test listed
# for that format in tests/qemu-iotests/known-failures with its reason.
# Exit status 1 if any test failed unexpectedly.
set -uo pipefail

top=$(cd "$(dirname "$0")/.." && pwd)
blddir=$top/build/qemu
out=$top/build/iotests
die() { echo "run-iotests: error: $*" >&2; exit 2; }

[ -x "$blddir/tests/qemu-iotests/check" ] ||
    die "build/qemu is not built: run scripts/build-qemu.sh (or make check)"
src=$(awk '{ print $NF }' "$top/build/qemu-version.txt")
iot=$src/tests/qemu-iotests

fmts=("$@")
if [ ${#fmts[@]} -eq 0 ]; then
    fmts=(qcow2 raw)
    "$blddir/qemu-img" --help | grep -q -w extree && fmts+=(extree)
fi

mapfile -t generic < <("$top/scripts/iotests-list.py" "$iot")
mkdir -p "$out"

known() {
    grep -q -E "^$1[[:space:]]+$2[[:space:]]" "$top/tests/qemu-iotests/known-failures" 2>/dev/null
}

# QEMU's internal snapshot tests all say "_supported_fmt qcow2", though
# these six test nothing qcow2-specific (savevm/loadvm with -drive,
# -blockdev, filters, backing files and NBD; snapshots of a running VM;
# qemu-img snapshot and info): run them against extree too, unchanged but
# for that line, with their own expected output.  Left out, being about
# qcow2 itself: 014 (compressed clusters), 029 (pokes qcow2 header fields),
# 058 (converts to qcow2 and reads the result as the format under test).
QEMU_SNAPSHOT_TESTS="007 015 068 201 267 286"
# QEMU's tests of LUKS-encrypted qcow2 images (issue 36), the same way:
# extree takes qcow2's encrypt.* options, so these run unchanged but for
# the supported formats and, in 293 and 295, the test's choice of the
# "encrypt." prefix and "format": "luks", which extree makes as qcow2
# does.  188: I/O, a wrong password, has_zero_init with
# preallocation=metadata; 189: an encrypted overlay with its own key over
# an encrypted backing file; 198: qemu-img commit between two such images,
# then qemu-img info's "encrypt:" details of both; 293: key slots with
# qemu-img amend; 295: key slots with x-blockdev-amend.  198 deletes
# qcow2's own format-specific lines from qemu-img info; its copy deletes
# extree's the same way, and qcow2's "compression type", which its
# expected output loses.  Left out, being about qcow2 itself: 087 (legacy
# AES, whose refusal message the output prints), 134 and 158 (legacy AES
# only), 206 (qcow2's blockdev-create options), 263 (legacy AES,
# cluster_size), 284 (qcow2 cluster sizes and refcounts), 178 (qemu-img
# measure's qcow2 numbers), tests/qcow2-encryption (qcow2.py on the header
# extension); 296 and the rest say luks only.
QEMU_LUKS_TESTS="188 189 198 293 295"
# QEMU's test of compressed writes into other formats (issue 34): 055's
# backups with compress=true (drive-backup and blockdev-backup; complete,
# cancel, pause) run against qcow2 and vmdk targets; its copy adds extree
# targets the way vmdk's class does, and runs every other 055 test with
# extree as the source format.  Left out, being about qcow2 itself: 013,
# 023, 122, 214, 287 (qcow2's compressed clusters, its compression_type
# header field, convert -c's cluster handling).
QEMU_COMPRESS_TESTS="055"
# QEMU's tests of persistent dirty bitmaps (issue 32) that pass with
# extree as they are, but for the supported formats and the format's name
# in the QMP commands they log: 165 (bitmaps stored and loaded across
# reopen, with writes between), 194 (bitmaps migrated with storage),
# 254 (bitmaps and block-commit), 257 (backup in every sync and bitmap
# mode, with failures), 304 (qemu-img measure with bitmaps),
# backup-discard-source (a backup whose source discards, with a bitmap).
# Others name qcow2 in their commands or log job progress in qcow2's
# clusters (260); see docs/bitmaps.rst.
QEMU_BITMAP_TESTS="165 194 254 257 304 tests/backup-discard-source"
qemu_extree_tests() {
    local t
    for t in $QEMU_COMPRESS_TESTS; do
        sed -e "s/supported_fmts=\['raw', 'qcow2'\],/supported_fmts=['raw', 'qcow2', 'extree'],/" \
            -e "/^if __name__ == '__main__':\$/i class TestCompressedToExtree(TestCompressedToQcow2):\n    target_fmt = {'type': 'extree', 'args': (), 'drive-opts': ''}\n\n" \
            "$iot/$t" > "$iot/tests/extree-qemu-$t"
        chmod +x "$iot/tests/extree-qemu-$t"
        # six more tests: the extree target's complete, cancel and pause
        sed -e "1s/QA output created by $t/QA output created by extree-qemu-$t/" \
            -e 's/^\(\.\.*\)$/\1....../' \
            -e 's/^Ran \([0-9]*\) tests$/echo "Ran $((\1 + 6)) tests"/e' \
            "$iot/$t.out" > "$iot/tests/extree-qemu-$t.out"
    done
    for t in $QEMU_BITMAP_TESTS; do
        local n=${t#tests/}
        sed -e "s/supported_fmts=\['qcow2'\(, 'qed', 'raw'\)\?\]/supported_fmts=['qcow2'\1, 'extree']/" \
            "$iot/$t" > "$iot/tests/extree-qemu-$n"
        chmod +x "$iot/tests/extree-qemu-$n"
        sed -e "1s/QA output created by $n/QA output created by extree-qemu-$n/" \
            -e 's/"\(driver\|format\)": "qcow2"/"\1": "extree"/g' \
            "$iot/$t.out" > "$iot/tests/extree-qemu-$n.out"
    done
    for t in $QEMU_SNAPSHOT_TESTS $QEMU_LUKS_TESTS; do
        sed -e 's/^_supported_fmt qcow2\( \|$\)/_supported_fmt qcow2 extree\1/' \
            -e 's|^\. \./common|. ../common|' \
            -e 's/^if \[ "\$IMGFMT" = "qcow2" \] ; then$/if [ "$IMGFMT" = "qcow2" ] || [ "$IMGFMT" = "extree" ] ; then/' \
            -e "s/supported_fmts = \['qcow2', 'luks'\]/supported_fmts = ['qcow2', 'extree', 'luks']/" \
            -e 's/iotests\.imgfmt == "qcow2"/iotests.imgfmt in ("qcow2", "extree")/' \
            -e "s|-e '/extended l2:/ D'|& -e '/^    \\\\(compression type\\\\\|tree depth\\\\\|host end\\\\\|block size\\\\\|node size\\\\\|generation\\\\\|extent count\\\\\|free bytes\\\\):/ D'|" \
            "$iot/$t" > "$iot/tests/extree-qemu-$t"
        chmod +x "$iot/tests/extree-qemu-$t"
        sed -e "1s/QA output created by $t/QA output created by extree-qemu-$t/" \
            -e '/^    compression type: COMPRESSION_TYPE$/d' \
            "$iot/$t.out" > "$iot/tests/extree-qemu-$t.out"
    done
}

total_fail=0
for fmt in "${fmts[@]}"; do
    tests=("${generic[@]}")
    if [ "$fmt" = extree ]; then
        qemu_extree_tests
        mapfile -t own < <(cd "$iot" && ls tests/ 2>/dev/null | grep '^extree' | grep -v -E '\.(out|rc)$|\.out\.')
        tests+=("${own[@]}")
    fi
    echo "iotests -$fmt: ${#tests[@]} tests"
    (cd "$blddir/tests/qemu-iotests" && ./check -$fmt "${tests[@]}") > "$out/$fmt.log" 2>&1
    tr '\r' '\n' < "$out/$fmt.log" |
        awk '$2 == "pass" || $2 == "fail" { print $1, $2 }
             $2 == "not" && $3 == "run" { print $1, "notrun" }' | sort -u -k1,1 > "$out/$fmt.results"
    pass=0 fail=0 xfail=0 notrun=0 unexpected=()
    while read -r t r; do
        case $r in
        pass) pass=$((pass + 1)) ;;
        notrun) notrun=$((notrun + 1)) ;;
        fail)
            if known "$fmt" "$t"; then
                xfail=$((xfail + 1))
            else
                fail=$((fail + 1)); unexpected+=("$t")
            fi ;;
        esac
    done < "$out/$fmt.results"
    # A generic test that passes with qcow2 must pass with every format
    # unless known-failures says why not.
    if [ "$fmt" != qcow2 ]; then
        while read -r t r; do
            [ "$r" = pass ] || continue
            got=$(awk -v t="$t" '$1 == t { print $2 }' "$out/$fmt.results")
            if [ "$got" = notrun ] && ! known "$fmt" "$t"; then
                notrun=$((notrun - 1)); fail=$((fail + 1))
                unexpected+=("$t(not run, passes with qcow2)")
            fi
        done < <(grep -v '^#' "$top/tests/qemu-iotests/baseline-qcow2")
    fi
    missing=$(( ${#tests[@]} - pass - fail - xfail - notrun ))
    echo "iotests -$fmt: $pass passed, $fail failed, $xfail expected failures, $notrun not run${missing:+, $missing without result}"
    if [ ${#unexpected[@]} -gt 0 ]; then
        echo "iotests -$fmt: unexpected failures: ${unexpected[*]} (see build/iotests/$fmt.log)"
    fi
    echo "$fmt $pass $fail $xfail $notrun" >> "$out/summary"
    total_fail=$((total_fail + fail + (missing > 0 ? missing : 0)))
done
[ $total_fail -eq 0 ]

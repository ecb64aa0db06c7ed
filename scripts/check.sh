#!/bin/bash
# The whole test suite on a built tree: unit tests of the core (meson test,
# with the fuzz corpus replayed), the same again under AddressSanitizer and
# UndefinedBehaviorSanitizer, and the iotests (generic ones with qcow2, raw
# and extree, plus extree's own).  Ends with one line "N passed, N failed,
# N skipped" counting every test case that ran: unit test cases (TAP), in
# both builds, and iotests.
set -uo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
cd "$top"

rc=0
meson test -C build/core --suite unit --print-errorlogs || rc=1
read -r unit_pass unit_fail unit_skip < <(scripts/unit-summary.py build/core/meson-logs/testlog.json)

# The unit tests again, built with gcc's ASan and UBSan in a second build
# directory (the core only: QEMU is not rebuilt).  Any report fails the
# program that made it: UBSan stops at the first error, LeakSanitizer
# fails the exit.  test-model, the seeded model-based test, is the core's
# differential test; fuzz-corpus replays tests/fuzz/{seeds,corpus}.
san=build/core-san
if [ ! -f $san/build.ninja ]; then
    meson setup $san -Db_sanitize=address,undefined -Db_lundef=false >/dev/null
fi
rm -f $san/meson-logs/testlog.json
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
    meson test -C $san --suite unit --print-errorlogs || rc=1
# no log (setup or build failed): one failure
read -r san_pass san_fail san_skip < <(scripts/unit-summary.py $san/meson-logs/testlog.json 2>/dev/null || echo 0 1 0)

# The driver's files call downwards too (the core's are a unit test)
python3 scripts/check-layers.py build/qemu/libblock.a.p || rc=1

# The small Linux guest that the guest iotests boot (extree-guest,
# extree-guest-kill): downloaded and packed once, into build/guest.  The
# tests would build it too; here its messages are not in a test's output.
rm -f build/iotests/summary build/iotests/guest.log
scripts/build-guest.sh || rc=1
# libvirt 11.3 with patches/libvirt (issue 48): built, unit-tested and
# installed once into ~/.cache/extree/libvirt/KEY, then reused in under a
# second; the iotest extree-libvirt runs with the other extree iotests
scripts/build-libvirt.sh || rc=1
scripts/run-iotests.sh || rc=1

io_pass=0 io_fail=0 io_xfail=0 io_notrun=0
while read -r fmt p f x n; do
    io_pass=$((io_pass + p)); io_fail=$((io_fail + f))
    io_xfail=$((io_xfail + x)); io_notrun=$((io_notrun + n))
done < build/iotests/summary

echo
echo "unit tests: $unit_pass passed, $unit_fail failed, $unit_skip skipped"
echo "unit tests under ASan/UBSan: $san_pass passed, $san_fail failed, $san_skip skipped"
# The guest tests' accelerator (KVM if a trial boot works, else TCG)
if [ -f build/iotests/guest.log ]; then
    echo "guest iotests: $(grep -h -o 'accelerator .*)' build/iotests/guest.log | sort -u | paste -sd ' ')"
fi
echo "iotests: $io_pass passed, $io_fail failed, $io_notrun not run, $io_xfail expected failures (tests/qemu-iotests/known-failures)"
echo "$((unit_pass + san_pass + io_pass)) passed, $((unit_fail + san_fail + io_fail)) failed, $((unit_skip + san_skip + io_notrun + io_xfail)) skipped"
if [ $rc -ne 0 ] || [ $((unit_fail + san_fail + io_fail)) -ne 0 ]; then
    exit 1
fi

#!/bin/bash
# The whole test suite on a built tree: unit tests of the core (meson test)
# and the iotests (generic ones with qcow2, raw and extree, plus extree's
# own).  Ends with one line "N passed, N failed, N skipped" counting every
# test case that ran: unit test cases (TAP) and iotests.
set -uo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
cd "$top"

rc=0
meson test -C build/core --suite unit --print-errorlogs || rc=1
read -r unit_pass unit_fail unit_skip < <(scripts/unit-summary.py build/core/meson-logs/testlog.json)

rm -f build/iotests/summary
scripts/run-iotests.sh || rc=1

io_pass=0 io_fail=0 io_xfail=0 io_notrun=0
while read -r fmt p f x n; do
    io_pass=$((io_pass + p)); io_fail=$((io_fail + f))
    io_xfail=$((io_xfail + x)); io_notrun=$((io_notrun + n))
done < build/iotests/summary

echo
echo "unit tests: $unit_pass passed, $unit_fail failed, $unit_skip skipped"
echo "iotests: $io_pass passed, $io_fail failed, $io_notrun not run, $io_xfail expected failures (tests/qemu-iotests/known-failures)"
echo "$((unit_pass + io_pass)) passed, $((unit_fail + io_fail)) failed, $((unit_skip + io_notrun + io_xfail)) skipped"
if [ $rc -ne 0 ] || [ $((unit_fail + io_fail)) -ne 0 ]; then
    exit 1
fi

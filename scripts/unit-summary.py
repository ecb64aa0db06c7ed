#!/usr/bin/env python3
"""Count the unit test cases of a meson test run from its testlog.json:
TAP 'ok' / 'not ok' lines of each program; a program that failed without a
'not ok' line (crash, bail out, timeout) counts as one failed case.
Prints "PASSED FAILED SKIPPED"."""

import json
import re
import sys

passed = failed = skipped = 0
with open(sys.argv[1], encoding='utf-8') as f:
    for line in f:
        t = json.loads(line)
        out = t.get('stdout') or ''
        ok = len(re.findall(r'^ok \d+(?! .*# ?SKIP)', out, re.M))
        skip = len(re.findall(r'^ok \d+ .*# ?SKIP', out, re.M))
        bad = len(re.findall(r'^not ok \d+', out, re.M))
        if t.get('result') not in ('OK', 'SKIP', 'EXPECTEDFAIL') and bad == 0:
            bad = 1
            print(f"unit: {t.get('name')}: {t.get('result')}", file=sys.stderr)
        passed += ok
        failed += bad
        skipped += skip
print(passed, failed, skipped)

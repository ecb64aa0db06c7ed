#!/usr/bin/env python3
"""List QEMU's generic iotests: bash tests marked `_supported_fmt generic`
and Python tests that accept any format (supported_fmts absent or holding
'generic').  Usage: iotests-list.py QEMU_SOURCE/tests/qemu-iotests"""

import os
import re
import sys


def is_test(path):
    name = os.path.basename(path)
    return (os.path.isfile(path) and not name.endswith('.out')
            and not name.endswith('.py') and '.' not in name
            and os.access(path, os.X_OK))


def generic(path):
    with open(path, encoding='utf-8', errors='replace') as f:
        text = f.read()
    first = text.split('\n', 1)[0]
    if 'python' in first:
        m = re.search(r'supported_fmts\s*=\s*\[([^\]]*)\]', text)
        return m is None or m.group(1).strip() == '' or "'generic'" in m.group(1)
    m = re.search(r'^_supported_fmt\s+(.*)$', text, re.M)
    return m is not None and 'generic' in m.group(1).split()


def main():
    root = sys.argv[1]
    names = sorted(os.listdir(root))
    out = [n for n in names if re.fullmatch(r'\d{3}', n)
           and is_test(os.path.join(root, n)) and generic(os.path.join(root, n))]
    tdir = os.path.join(root, 'tests')
    out += [n for n in sorted(os.listdir(tdir))
            if not n.startswith('extree') and is_test(os.path.join(tdir, n))
            and generic(os.path.join(tdir, n))]
    print('\n'.join(out))


main()

#!/usr/bin/env python3
# Pack the guest's initramfs (scripts/build-guest.sh): /init, a static
# busybox, and the kernel modules asked for with everything they depend on,
# listed in load order in /modules.  Dependencies come from each module's
# .modinfo section ("depends="), so no depmod or cpio is needed on the host.
#
#   guest-initramfs.py OUT.img INIT BUSYBOX MODULES_DIR MODULE...
#
# Copyright (c) 2026 The extree authors
#
# SPDX-License-Identifier: GPL-2.0-or-later

import gzip
import os
import stat
import struct
import sys


def modinfo(path):
    """The key=value strings of an ELF64 module's .modinfo section."""
    with open(path, 'rb') as f:
        data = f.read()
    if data[:4] != b'\x7fELF' or data[4] != 2:
        raise SystemExit(f'{path}: not an ELF64 module')
    shoff, = struct.unpack_from('<Q', data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from('<HHH', data, 0x3a)

    def section(i):
        name, _, _, _, off, size = struct.unpack_from('<IIQQQQ', data,
                                                      shoff + i * shentsize)
        return name, off, size

    _, stroff, _ = section(shstrndx)
    for i in range(shnum):
        name, off, size = section(i)
        end = data.index(b'\0', stroff + name)
        if data[stroff + name:end] == b'.modinfo':
            return [s.decode() for s in data[off:off + size].split(b'\0') if s]
    return []


def resolve(moddir, wanted):
    """Module paths (relative to moddir) in an order insmod accepts."""
    paths = {}
    for root, _, files in os.walk(moddir):
        for f in files:
            if f.endswith('.ko'):
                name = f[:-3].replace('-', '_')
                paths[name] = os.path.relpath(os.path.join(root, f), moddir)
    order = []
    done = set()

    def visit(name, stack):
        name = name.replace('-', '_')
        if name in done:
            return
        if name in stack:
            raise SystemExit(f'module dependency loop: {stack}')
        if name not in paths:
            raise SystemExit(f'module {name} not found under {moddir}')
        for kv in modinfo(os.path.join(moddir, paths[name])):
            if kv.startswith('depends='):
                for dep in filter(None, kv[len('depends='):].split(',')):
                    visit(dep, stack + [name])
        done.add(name)
        order.append(paths[name])

    for w in wanted:
        visit(w, [])
    return order


class Cpio:
    """A newc archive, written by hand so that device nodes need no root."""

    def __init__(self):
        self.out = bytearray()
        self.ino = 1

    def add(self, name, mode, data=b'', rdev=(0, 0)):
        fields = [self.ino, mode, 0, 0, 1, 0, len(data), 0, 0,
                  rdev[0], rdev[1], len(name) + 1, 0]
        self.ino += 1
        hdr = b'070701' + b''.join(b'%08X' % v for v in fields)
        self.out += hdr + name.encode() + b'\0'
        self.out += b'\0' * (-len(self.out) % 4)
        self.out += data
        self.out += b'\0' * (-len(self.out) % 4)

    def dir(self, name):
        self.add(name, stat.S_IFDIR | 0o755)

    def file(self, name, data, perm=0o644):
        self.add(name, stat.S_IFREG | perm, data)

    def finish(self):
        self.add('TRAILER!!!', 0)
        return bytes(self.out)


def main():
    if len(sys.argv) < 6:
        raise SystemExit('usage: guest-initramfs.py OUT INIT BUSYBOX MODDIR MODULE...')
    out, init, busybox, moddir = sys.argv[1:5]
    mods = resolve(moddir, sys.argv[5:])
    c = Cpio()
    for d in ('bin', 'dev', 'proc', 'sys', 'mnt', 'tmp', 'lib', 'lib/modules'):
        c.dir(d)
    c.add('dev/console', stat.S_IFCHR | 0o600, rdev=(5, 1))
    with open(init, 'rb') as f:
        c.file('init', f.read(), 0o755)
    with open(busybox, 'rb') as f:
        c.file('bin/busybox', f.read(), 0o755)
    c.add('bin/sh', stat.S_IFLNK | 0o777, b'busybox')
    listing = []
    for m in mods:
        base = os.path.basename(m)
        with open(os.path.join(moddir, m), 'rb') as f:
            c.file('lib/modules/' + base, f.read())
        listing.append(base)
    c.file('modules', ('\n'.join(listing) + '\n').encode())
    tmp = out + '.tmp'
    # mtime 0: the same inputs give the same bytes
    with open(tmp, 'wb') as raw, \
            gzip.GzipFile(fileobj=raw, mode='wb', compresslevel=6, mtime=0) as f:
        f.write(c.finish())
    os.replace(tmp, out)
    print(' '.join(m[:-3] for m in listing))


if __name__ == '__main__':
    main()

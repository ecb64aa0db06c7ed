# Persistent dirty bitmaps for the crash iotests (extree-bitmap-kill,
# extree-bitmap-crash): what qemu-img info says of an image's bitmaps,
# their dirty ranges as an NBD client sees them (qemu-nbd -B NAME, the
# "qemu:dirty-bitmap:NAME" meta context, python3-libnbd), and the
# incremental backup that copies the dirty ranges onto the previous backup.
#
# Ranges are lists of (start, end) byte offsets, sorted and merged.
#
# Copyright (c) 2026 The extree authors
#
# SPDX-License-Identifier: GPL-2.0-or-later

import json
import os
import subprocess
import time

import nbd

import iotests
from iotests import qemu_img

KiB = 1024

# the bitmaps of the tests: B enabled (tracks every write), D disabled
# (its dirty set must never change)
B, D = 'B', 'D'
B_GRAN, D_GRAN = 64 * KiB, 128 * KiB


class BitmapError(Exception):
    """range: the guest range (start, end) at fault, if there is one"""

    def __init__(self, msg, rng=None):
        super().__init__(msg)
        self.range = rng


class Refused(BitmapError):
    """qemu-nbd refused bitmaps that qemu-img info shows consistent"""


def info(args):
    """{name: (granularity, sorted flags)} of the image's persistent
    bitmaps as qemu-img info --output=json lists them (format-specific
    data, as qcow2 has it)"""
    res = qemu_img('info', '--output=json', *args, check=False)
    if res.returncode != 0:
        raise BitmapError('qemu-img info: ' + res.stdout.strip())
    try:
        # warnings come before the JSON
        data = json.loads(res.stdout[res.stdout.index('{'):])
    except ValueError:
        raise BitmapError('qemu-img info: ' + res.stdout.strip())  # pylint: disable=raise-missing-from
    data = data.get('format-specific', {}).get('data', {})
    return {b['name']: (b['granularity'], sorted(b.get('flags', [])))
            for b in data.get('bitmaps', [])}


def describe(bitmaps):
    """'B: 65536 auto; D: 131072 (no flags)'"""
    return '; '.join(f'{n}: {g} {" ".join(f) if f else "(no flags)"}'
                     for n, (g, f) in sorted(bitmaps.items()))


def expect_consistent(args):
    """None if B is enabled and D disabled, both with their granularity
    and neither in use; else what info says"""
    got = info(args)
    want = {B: (B_GRAN, ['auto']), D: (D_GRAN, [])}
    return None if got == want else describe(got)


def run(*args):
    """(exit code, output) of qemu-img with these arguments"""
    res = qemu_img(*args, check=False)
    return res.returncode, res.stdout.strip()


def merge(ranges):
    out = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        elif a < b:
            out.append((a, b))
    return out


def granules(ranges, gran, size):
    """the ranges rounded out to gran: every granule they touch"""
    return merge((a // gran * gran, min(-(-b // gran) * gran, size))
                 for a, b in ranges)


def total(ranges):
    return sum(b - a for a, b in ranges)


def outside(ranges, allowed):
    """the first part of ranges not within allowed (both merged), or
    None"""
    j = 0
    for a, b in ranges:
        while a < b:
            while j < len(allowed) and allowed[j][1] <= a:
                j += 1
            if j == len(allowed) or allowed[j][0] > a:
                end = b if j == len(allowed) else min(b, allowed[j][0])
                return a, end
            a = allowed[j][1]
    return None


def changed(old, new, gran):
    """the granules where two contents differ"""
    out = []
    for a in range(0, len(new), gran):
        if old[a:a + gran] != new[a:a + gran]:
            out.append((a, min(a + gran, len(new))))
    return merge(out)


class Pull:
    """qemu-nbd -r serving one image with its bitmaps exposed, and a libnbd
    client connected with their meta contexts; close() ends both.  If
    qemu-nbd refuses, error holds what it said."""

    def __init__(self, img_args, sock, pidfile, names=(B, D)):
        self.names = names
        self.h = None
        self.error = None
        for f in (sock, pidfile):
            if os.path.exists(f):
                os.remove(f)
        args = list(iotests.qemu_nbd_args) + ['-r', '-k', sock,
                                              '--pid-file', pidfile]
        for n in names:
            args += ['-B', n]
        # pylint: disable=consider-using-with
        self.p = subprocess.Popen(args + list(img_args),
                                  stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT,
                                  universal_newlines=True)
        deadline = time.monotonic() + 30
        # written once the export is up
        while not os.path.exists(pidfile):
            if self.p.poll() is not None or time.monotonic() > deadline:
                if self.p.poll() is None:
                    self.p.kill()
                self.error = self.p.communicate()[0].strip()
                if not self.error:
                    self.error = f'qemu-nbd exited with {self.p.returncode}'
                return
            time.sleep(0.005)
        self.h = nbd.NBD()
        for n in names:
            self.h.add_meta_context('qemu:dirty-bitmap:' + n)
        self.h.connect_unix(sock)
        self.size = self.h.get_size()

    def dirty(self):
        """{name: dirty ranges} over the whole export"""
        got = {n: [] for n in self.names}
        off = 0
        while off < self.size:
            ends = {}

            def cb(ctx, start, entries, err):
                n = ctx.split(':', 2)[2] if ctx.startswith(
                    'qemu:dirty-bitmap:') else None
                if n not in got or n in ends:
                    return 0
                pos = start
                for i in range(0, len(entries), 2):
                    ln, flags = entries[i], entries[i + 1]
                    ln = min(ln, self.size - pos)
                    if flags & 1:
                        got[n].append((pos, pos + ln))
                    pos += ln
                ends[n] = pos
                return 0
            self.h.block_status(min(self.size - off, 1 << 30), off, cb)
            if set(ends) != set(self.names):
                raise BitmapError('block status at %#x: no answer for %s' %
                                  (off, sorted(set(self.names) - set(ends))))
            # every context answered from off; go on from the shortest
            nxt = min(ends.values())
            if nxt <= off:
                raise BitmapError(f'block status at {off:#x}: empty answer')
            off = nxt
            for n in self.names:
                got[n] = [(a, min(b, off)) for a, b in got[n]
                          if a < off]
        return {n: merge(r) for n, r in got.items()}

    def pread(self, off, n):
        return self.h.pread(n, off)

    def close(self):
        if self.h is not None:
            self.h.shutdown()
            self.h = None
        if self.p.poll() is None:
            # without -t, qemu-nbd ends when its client leaves
            try:
                self.p.wait(30)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
                raise BitmapError('qemu-nbd did not exit')  # pylint: disable=raise-missing-from
        out = self.p.communicate()[0].strip()
        if self.p.returncode != 0 or out:
            raise BitmapError(f'qemu-nbd exited with {self.p.returncode}: '
                              + out)


def pull_backup(backup, pull, ranges, chunk=4 * 1024 * KiB):
    """copy ranges from the export onto backup (a bytearray)"""
    for a, b in ranges:
        for x in range(a, b, chunk):
            n = min(chunk, b - x)
            backup[x:x + n] = pull.pread(x, n)


def first_diff(a, b):
    """'bytes X..Y' where two contents of the same size first differ"""
    if a == b:
        return None
    if len(a) != len(b):
        return f'sizes {len(a)} and {len(b)}'
    step = 65536
    i = next(x for x in range(0, len(a), step)
             if a[x:x + step] != b[x:x + step])
    while a[i] == b[i]:
        i += 1
    j = i
    while j < len(a) and a[j] != b[j]:
        j += 1
    return f'bytes {i:#x}..{j:#x}'


def setup(args, rng, content):
    """add B (enabled) and D (disabled) to the image (args: -f FMT
    PATH); data written with B enabled makes D's dirty set (merged from
    B), and B is cleared.  Returns the content and D's dirty ranges."""
    size = len(content)
    qemu_img('bitmap', '--add', '-g', str(B_GRAN), *args, B)
    data = bytearray(content)
    cmds = []
    written = []
    for _ in range(6):
        n = rng.randrange(1, size // 32 // 512) * 512
        off = rng.randrange(0, (size - n) // 512) * 512
        v = rng.randrange(1, 255)
        cmds += ['-c', f'write -q -P {v} {off} {n}']
        data[off:off + n] = bytes([v]) * n
        written.append((off, off + n))
    res = iotests.qemu_io(*args[:-1], *cmds, args[-1], check=False)
    if res.returncode != 0 or res.stdout.strip():
        raise BitmapError('qemu-io: ' + res.stdout.strip())
    qemu_img('bitmap', '--add', '--disable', '-g', str(D_GRAN), *args, D)
    qemu_img('bitmap', '--merge', B, *args, D)
    qemu_img('bitmap', '--clear', *args, B)
    d = granules(merge(written), D_GRAN, size)
    return bytes(data), d


def lost(args, sock, pidfile, why, check=True):
    """what a backup tool meets when the bitmaps are in use (why: what
    qemu-img info says): lines; check: with what qemu-img check says"""
    facts = [f'qemu-img info: {why}']
    for n in (B, D):
        pull = Pull(args, sock, pidfile, names=(n,))
        if pull.error is None:
            pull.close()
        facts.append(f'qemu-nbd -B {n}: ' + (pull.error or 'served'))
    rc, out = run('bitmap', '--clear', *args, B)
    facts.append(f'qemu-img bitmap --clear {B}: exit {rc}: {out}')
    if check:
        rc, out = run('check', *args)
        facts.append(f'qemu-img check: exit {rc}: {out.splitlines()[0]}')
    return facts


def verify(args, sock, pidfile, backup, actual, requests, d):
    """the bitmaps of a consistent image (args) whose content is actual:
    the incremental backup (backup, the content when B was cleared, plus
    the ranges B marks read over NBD) must equal actual, B must mark every
    granule that differs and none that no request (ranges) touched, and D
    must be d.  Returns figures; raises BitmapError."""
    size = len(actual)
    pull = Pull(args, sock, pidfile)
    if pull.error:
        raise Refused('qemu-img info shows the bitmaps consistent, but '
                      + pull.error)
    try:
        dirty = pull.dirty()
        copy = bytearray(backup)
        pull_backup(copy, pull, dirty[B])
    finally:
        pull.close()
    diff = changed(backup, actual, B_GRAN)
    missing = outside(diff, dirty[B])
    if missing:
        raise BitmapError(f'B does not mark {missing[0]:#x}..'
                          f'{missing[1]:#x}, which changed since the clear '
                          f'(B marks {fmt_ranges(dirty[B])})', missing)
    why = first_diff(bytes(copy), actual)
    if why:
        raise BitmapError('the backup through B differs from the image: '
                          + why)
    touched = granules(requests, B_GRAN, size)
    extra = outside(dirty[B], touched)
    if extra:
        raise BitmapError(f'B marks {extra[0]:#x}..{extra[1]:#x}, where no '
                          'request wrote since the clear', extra)
    if dirty[D] != d:
        raise BitmapError(f'D changed: {fmt_ranges(dirty[D])}, was '
                          f'{fmt_ranges(d)}')
    return {'written': total(requests), 'touched': total(touched),
            'changed': total(diff), 'dirty': total(dirty[B])}


def fmt_ranges(ranges, limit=4):
    s = ', '.join(f'{a:#x}..{b:#x}' for a, b in ranges[:limit])
    return s + (f' (+{len(ranges) - limit} more)' if len(ranges) > limit
                else '')


def intersect(a, b):
    """the ranges in both (each merged)"""
    out = []
    i = j = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


class Record:
    """What a bitmap cleared or added at a moment T must mark (the QMP
    rounds of extree-bitmap-race): the granules whose content cannot be
    explained by a content possible at T.  base is the content after the
    requests acknowledged before the command was sent; alts are (start,
    end, data, or None for zeroes) of the requests in flight at any moment
    between its sending and its reply, whose data may or may not have
    been there at T.  A byte explained holds its base value or the value
    of one of those requests; a granule with a byte unexplained changed
    after T, and every bitmap that holds this record must mark it.
    Requests acknowledged before T need not be marked, and nothing issued
    only before T may be required."""

    def __init__(self, base, alts=(), what=''):
        self.base = base
        self.alts = list(alts)
        self.what = what            # how it came, for a failure message

    def _explained(self, actual, g0, g1, alts):
        cuts = sorted({g0, g1} | {max(g0, min(g1, x)) for a in alts
                                  for x in a[:2]})
        base = self.base
        for s, e in zip(cuts, cuts[1:]):
            act = actual[s:e]
            if act == base[s:e]:
                continue
            cover = [a for a in alts if a[0] <= s and e <= a[1]]
            vals = [bytes(e - s) if d is None else d[s - a0:e - a0]
                    for a0, _, d in cover]
            if any(act == v for v in vals):
                continue
            # a mix (requests that landed in part, or one over another):
            # byte by byte, rarely
            for i, x in enumerate(act):
                if x != base[s + i] and all(x != v[i] for v in vals):
                    return False
        return True

    def required(self, actual, gran):
        """the granules (merged ranges) this record requires in actual"""
        size = len(actual)
        out = []
        for g0 in range(0, size, gran):
            g1 = min(g0 + gran, size)
            if actual[g0:g1] == self.base[g0:g1]:
                continue
            alts = [a for a in self.alts if a[0] < g1 and g0 < a[1]]
            if alts and self._explained(actual, g0, g1, alts):
                continue
            if out and out[-1][1] == g0:
                out[-1] = (out[-1][0], g1)
            else:
                out.append((g0, g1))
        return out


def requirement(candidates, actual, gran):
    """what a bitmap must mark in actual when the image may hold any of
    several candidates (a command not known to be stored when the
    process died), each a list of records whose requirements add up (a
    merge): the granules every candidate requires"""
    req = None
    for spec in candidates:
        got = merge(r for rec in spec for r in rec.required(actual, gran))
        req = got if req is None else intersect(req, got)
    return req or []

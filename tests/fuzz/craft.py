#!/usr/bin/env python3
# Craft fuzz inputs by hand: a seed image, edits recorded in the input's
# trailer the way the mutator records them (tests/fuzz/fuzz-input.h),
# checksums fixed.  For reproducers of oracle violations
# (tests/fuzz/crashes), which the fuzzer would take long to hit.
#
#   tests/fuzz/craft.py RECIPE SEED OUT [OPS_SEED]
#
# Recipes (issue 38):
#   snap-gen      snap_generation 1 in both superblock slots (point 1)
#   snap-root     the first snapshot's root loses its last item (point 2)
#   snap-root-child-gen  the first snapshot's root names its first child
#                 with a generation above its own (snap-root-valid)
#   snap-root-leaf  the first snapshot's entry names one of its tree's
#                 leaves as root, generation and level matched (point 2)
#   past-vsize    the last item of the live tree's last leaf moved past
#                 the virtual size (point 3)
#   snap-past-vsize  the same in the last leaf of the first snapshot
#
# Recipes (issue 49, the checker's classes F and H; not oracle violations:
# they drive check and its repair over the damage, under the sanitizers)
#   payload-bit   a byte of the live tree's first compressed payload flipped
#   payload-len   that item's payload length one off (its blocks the same)
#   chunk-on-data the first bitmap's first chunk pointed at the live tree's
#                 first DATA block, chunk checksums, count and directory
#                 checksum made to match
#
# Recipes (issue 47, the mark log; SEED: seeds/mark-log-512.img, whose chain
# holds three records)
#   log-lie       record 1's range moved past the virtual size, checksum
#                 made right (a record that lies: damage, open refuses)
#   log-tear      a byte of record 1 flipped (a torn record: the chain ends
#                 before it, record 0 alone is replayed)
#   log-swap      records 0 and 1 swapped (each in the other's slot: the
#                 chain is empty)
#   log-stale     record 0's generation one lower (a stale record: nothing
#                 replayed)
#
# Recipes (issue 47, map records; SEED: seeds/map-log-512.img, whose chain
# holds a mark record and three map records of one entry each)
#   map-tear      a byte of record 2's data flipped (its write never became
#                 durable: the chain ends before record 2)
#   map-lie       record 2's entry pointed at the live tree's first DATA
#                 block, its data checksum and the record's made right (a
#                 record that lies: damage, a writer's open refuses)
#   map-swap      map records 1 and 2 swapped (the chain ends at slot 1)
#
# Recipes (issue 47, a corrupt mark's log lag; SEED:
# seeds/map-log-corrupt-512.img, map-log-512's image marked corrupt: its
# superblock's log_lag is 1; map-tear, map-lie and map-swap apply too)
#   lag-two       log_lag 2 (a chain of generation G - 1: none, nothing
#                 replayed)
#   lag-no-bit    log lag bit cleared, log_lag kept (a bad superblock: the
#                 other slot is opened)
#   reseed        SEED is an input: write it with another OPS_SEED (which
#                 drives the target's choices: the snapshot reverted to,
#                 the writes)
#
# Copyright (c) 2026 The extree authors
#
# SPDX-License-Identifier: GPL-2.0-or-later
import struct
import sys

POLY = 0x82F63B78
TABLE = []
for i in range(256):
    c = i
    for _ in range(8):
        c = (c >> 1) ^ (POLY if c & 1 else 0)
    TABLE.append(c)


def crc32c(data, crc=0):
    crc ^= 0xFFFFFFFF
    for b in data:
        crc = (crc >> 8) ^ TABLE[(crc ^ b) & 0xFF]
    return crc ^ 0xFFFFFFFF


SB = 4096
NODE_MAGIC = 0x444E5458
SNAP_HDR = 64
ENTRY = 512


def ld(buf, off, w=8):
    return int.from_bytes(buf[off:off + w], 'little')


class Image:
    def __init__(self, data):
        self.orig = bytes(data)
        self.img = bytearray(data)
        self.recs = []
        gens = [ld(self.img, s * SB + 24) for s in range(2)]
        self.slot = 0 if gens[0] >= gens[1] else 1
        sb = self.slot * SB
        self.vsize = ld(self.img, sb + 56)
        self.ns = ld(self.img, sb + 68, 4)
        self.root = ld(self.img, sb + 80)
        self.table = ld(self.img, sb + 184)
        self.count = ld(self.img, sb + 192, 4)

    def edit(self, off, new):
        self.recs.append((off, bytes(self.img[off:off + len(new)])))
        self.img[off:off + len(new)] = new

    def put(self, off, v, w=8):
        self.edit(off, v.to_bytes(w, 'little'))

    def fix_sb(self, slot):
        b = bytearray(self.img[slot * SB:(slot + 1) * SB])
        b[16:20] = b'\0\0\0\0'
        self.put(slot * SB + 16, crc32c(b), 4)

    def fix_node(self, bytenr):
        self.put(bytenr, crc32c(self.img[bytenr + 4:bytenr + self.ns]), 4)

    def fix_table(self):
        t, used = self.table, SNAP_HDR + self.count * ENTRY
        b = bytearray(self.img[t:t + used])
        b[4:8] = b'\0\0\0\0'
        self.put(t + 4, crc32c(b), 4)

    def entry(self, i):
        return self.table + SNAP_HDR + i * ENTRY

    def node(self, bytenr):
        n = self.img
        return dict(level=n[bytenr + 28], nritems=ld(n, bytenr + 32, 4),
                    gen=ld(n, bytenr + 16))

    def last_leaf(self, root):
        b = root
        while self.node(b)['level']:
            nr = self.node(b)['nritems']
            b = ld(self.img, b + 64 + (nr - 1) * 32 + 8)
        return b

    def leaves(self, root):
        if self.node(root)['level'] == 0:
            return [root]
        out = []
        for i in range(self.node(root)['nritems']):
            out += self.leaves(ld(self.img, root + 64 + i * 32 + 8))
        return out

    def first_item(self, typ):
        """The live tree's first item of type typ: (leaf, item offset)"""
        for leaf in self.leaves(self.root):
            for i in range(self.node(leaf)['nritems']):
                it = leaf + 64 + i * 32
                if ld(self.img, it + 24, 4) == typ:
                    return leaf, it
        sys.exit('no item of type %d' % typ)

    def sparse(self):
        """The image as fuzz-input.h's sparse runs of non-zero sectors"""
        img, n = bytes(self.img), len(self.img)
        out = bytearray(struct.pack('<QQ', 0x45535241505346, n))
        zero = bytes(512)
        s = 0
        while s < n:
            if img[s:s + 512] == zero[:min(512, n - s)]:
                s += 512
                continue
            e = s + 512
            while e < n and img[e:e + 512] != zero[:min(512, n - e)]:
                e += 512
            e = min(e, n)
            out += struct.pack('<QI', s, e - s) + img[s:e]
            s = e
        return out

    def write(self, path, ops_seed):
        out = self.sparse()
        tlen = 24
        for off, orig in self.recs:
            out += struct.pack('<QI', off, len(orig)) + orig
            tlen += 12 + len(orig)
        out += struct.pack('<QIIII', ops_seed, crc32c(self.orig),
                           len(self.recs), tlen, 0x5A465458)
        open(path, 'wb').write(out)


def main():
    recipe, seed, out = sys.argv[1:4]
    ops_seed = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    if recipe == 'reseed':
        # another ops seed for an input: the target's random choices
        d = bytearray(open(seed, 'rb').read())
        d[-24:-16] = ops_seed.to_bytes(8, 'little')
        open(out, 'wb').write(d)
        return
    im = Image(open(seed, 'rb').read())
    if recipe == 'snap-gen':
        for s in range(2):
            im.put(s * SB + 200, 1)
            im.fix_sb(s)
    elif recipe == 'snap-root':
        root = ld(im.img, im.entry(0))
        nr = im.node(root)['nritems']
        im.put(root + 32, nr - 1, 4)
        im.edit(root + 64 + (nr - 1) * 32, bytes(32))
        im.fix_node(root)
    elif recipe == 'snap-root-child-gen':
        root = ld(im.img, im.entry(0))
        im.put(root + 64 + 16, im.node(root)['gen'] + 6)
        im.fix_node(root)
    elif recipe == 'snap-root-leaf':
        e = im.entry(0)
        leaf = im.last_leaf(ld(im.img, e))
        im.put(e, leaf)
        im.put(e + 8, im.node(leaf)['gen'])
        im.put(e + 16, 0, 1)
        im.fix_table()
    elif recipe in ('past-vsize', 'snap-past-vsize'):
        if recipe == 'past-vsize':
            root, vsize = im.root, im.vsize
        else:
            root, vsize = ld(im.img, im.entry(0)), ld(im.img, im.entry(0) + 32)
        leaf = im.last_leaf(root)
        nr = im.node(leaf)['nritems']
        # the last DATA item
        for i in range(nr - 1, -1, -1):
            it = leaf + 64 + i * 32
            if ld(im.img, it + 24, 4) == 1:
                break
        im.put(it, vsize + 64 * 1024 + ld(im.img, it) % 4096)
        # later items (if any) moved with it, in order
        for k in range(i + 1, nr):
            it2 = leaf + 64 + k * 32
            im.put(it2, vsize + 128 * 1024 + k * 4096)
        im.fix_node(leaf)
    elif recipe == 'payload-bit':
        leaf, it = im.first_item(5)
        host = ld(im.img, it + 16)
        im.put(host + 8, im.img[host + 8] ^ 0x10, 1)
    elif recipe == 'payload-len':
        leaf, it = im.first_item(5)
        flags = ld(im.img, it + 28, 4)
        c = flags & 0xFFFFFF
        n = c - 1 if (c - 1 + 511) // 512 == (c + 511) // 512 else c + 1
        im.put(it + 28, (flags & ~0xFFFFFF) | n, 4)
        im.fix_node(leaf)
    elif recipe == 'chunk-on-data':
        sb = im.slot * SB
        d, dlen = ld(im.img, sb + 240), ld(im.img, sb + 248, 4)
        nch = ld(im.img, d + 64 + 16, 4)
        tab = d + 64 + 24 + (ld(im.img, d + 64, 2) + 7) // 8 * 8
        bs = ld(im.img, sb + 64, 4)
        im.put(tab, ld(im.img, im.first_item(1)[1] + 16))
        count = 0
        for c in range(nch):
            off = ld(im.img, tab + c * 16)
            if off:
                blk = bytes(im.img[off:off + bs])
                count += sum(bin(b).count('1') for b in blk)
                im.put(tab + c * 16 + 8, crc32c(blk), 4)
        im.put(d + 64 + 8, count)
        b = bytearray(im.img[d:d + dlen])
        b[4:8] = b'\0\0\0\0'
        im.put(d + 4, crc32c(b), 4)
    elif recipe in ('log-lie', 'log-tear', 'log-swap', 'log-stale'):
        sb = im.slot * SB
        log = ld(im.img, sb + 256)
        rec = [log + i * 4096 for i in range(3)]

        def fix_rec(r):
            b = bytearray(im.img[r:r + 4096])
            b[24:28] = b'\0\0\0\0'
            im.put(r + 24, crc32c(b), 4)
        if recipe == 'log-lie':
            im.put(rec[1] + 32, im.vsize)
            fix_rec(rec[1])
        elif recipe == 'log-tear':
            im.put(rec[1] + 40, im.img[rec[1] + 40] ^ 1, 1)
        elif recipe == 'log-swap':
            a, b = bytes(im.img[rec[0]:rec[0] + 4096]), \
                bytes(im.img[rec[1]:rec[1] + 4096])
            im.edit(rec[0], b)
            im.edit(rec[1], a)
        else:
            im.put(rec[0] + 8, ld(im.img, rec[0] + 8) - 1)
            fix_rec(rec[0])
    elif recipe in ('map-tear', 'map-lie', 'map-swap'):
        sb = im.slot * SB
        log, bs = ld(im.img, sb + 256), ld(im.img, sb + 64, 4)
        rec = [log + i * 4096 for i in range(4)]
        if [ld(im.img, r + 28, 4) for r in rec] != [0, 1, 1, 1]:
            sys.exit('SEED has no chain of a mark and three map records')
        host = ld(im.img, rec[2] + 40)
        if recipe == 'map-tear':
            im.put(host + 7, im.img[host + 7] ^ 1, 1)
        elif recipe == 'map-lie':
            used = ld(im.img, im.first_item(1)[1] + 16)
            im.put(rec[2] + 40, used)
            im.put(rec[2] + 56, crc32c(im.img[used:used + bs]), 4)
            b = bytearray(im.img[rec[2]:rec[2] + 4096])
            b[24:28] = b'\0\0\0\0'
            im.put(rec[2] + 24, crc32c(b), 4)
        else:
            a, b = bytes(im.img[rec[1]:rec[1] + 4096]), \
                bytes(im.img[rec[2]:rec[2] + 4096])
            im.edit(rec[1], b)
            im.edit(rec[2], a)
    elif recipe in ('lag-two', 'lag-no-bit'):
        sb = im.slot * SB
        if ld(im.img, sb + 268, 4) != 1:
            sys.exit('SEED has no log lag')
        if recipe == 'lag-two':
            im.put(sb + 268, 2, 4)
        else:
            im.put(sb + 32, ld(im.img, sb + 32) & ~(1 << 7))
        im.fix_sb(im.slot)
    else:
        sys.exit('unknown recipe ' + recipe)
    im.write(out, ops_seed)


if __name__ == '__main__':
    main()

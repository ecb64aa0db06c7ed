#!/usr/bin/env python3
#
# Look into and damage extree images, for the extree iotests
# (docs/interop/extree.rst describes the layout).
#
#   xtpoke.py IMAGE info               superblock slot, generation, nodes
#   xtpoke.py IMAGE nodes              every node: tree, level, offset
#   xtpoke.py IMAGE incompat MASK      set incompatible feature bits in
#                                      both superblocks (checksums fixed)
#   xtpoke.py IMAGE leak BLOCKS        raise host_end by BLOCKS blocks in
#                                      the newest superblock: leaked space
#   xtpoke.py IMAGE DAMAGE             one of the damages below
#   xtpoke.py IMAGE wrong-child        in the lowest interior node, item 0
#                                      points at item 1's child (offset and
#                                      generation): one node, two parents
#   xtpoke.py IMAGE generation N       generation N in both superblocks
#   xtpoke.py IMAGE extent-count N     extent_count N in the newest one
#   xtpoke.py IMAGE host-end N         host_end N in the newest one
#   xtpoke.py IMAGE backing-junk       a non-zero byte after the backing
#                                      file name in the newest one
#   xtpoke.py IMAGE crypt-header-length N  crypt_header_length N in both
#                                      superblocks (encrypted images)
#   Images with snapshots (entry 0 of the snapshot table is "the snapshot"):
#   xtpoke.py IMAGE snap-generation N  snap_generation N in both superblocks
#   xtpoke.py IMAGE snap-root-drop     the snapshot's root loses its last
#                                      item
#   xtpoke.py IMAGE snap-root-leaf     the snapshot's entry names the second
#                                      child of its root (a leaf), with the
#                                      leaf's generation and level 0
#   xtpoke.py IMAGE item-past-size K   the last item of the live tree's last
#                                      leaf moved to guest offset K
#   xtpoke.py IMAGE refs-up            the first REFS count raised by one
#   xtpoke.py IMAGE refs-drop HOST     the REFS item covering host offset
#                                      HOST removed: its blocks count 1
#   xtpoke.py IMAGE host-of GUEST      the host offset the live tree maps
#                                      guest offset GUEST to (DATA)
#   Images with a mark log (spec: Mark log):
#   xtpoke.py IMAGE mark-log           its records of the chain the newest
#                                      superblock replays, one line each
#                                      (map records: their guest ranges)
#   xtpoke.py IMAGE mark-log-lie START LEN  a record of that chain (the
#                                      next slot) marking [START, +LEN),
#                                      checksum valid
#   xtpoke.py IMAGE mark-log-tear SEQ  a byte of record SEQ flipped
#   (checksums are recomputed: only semantic validation can catch these)
#
# Copyright (c) 2026 The extree authors
#
# SPDX-License-Identifier: GPL-2.0-or-later

import struct
import sys

SB_SIZE = 4096
HDR = 64
LEAF_ITEM = 32
PTR_ITEM = 32


def crc32c(data):
    """CRC-32C (Castagnoli), reflected, init and final xor ~0"""
    table = crc32c.table
    if table is None:
        table = []
        for i in range(256):
            c = i
            for _ in range(8):
                c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
            table.append(c)
        crc32c.table = table
    crc = 0xffffffff
    for b in data:
        crc = table[(crc ^ b) & 0xff] ^ (crc >> 8)
    return crc ^ 0xffffffff


crc32c.table = None


class Image:
    def __init__(self, path):
        self.f = open(path, 'r+b')
        self.slots = {}
        for slot in (0, 1):
            b = self.read(slot * SB_SIZE, SB_SIZE)
            if len(b) == SB_SIZE and b[:8] == b'EXTREE\r\n':
                gen = struct.unpack_from('<Q', b, 24)[0]
                self.slots[slot] = (gen, b)
        self.slot = max(self.slots, key=lambda s: self.slots[s][0])
        sb = self.slots[self.slot][1]
        self.gen = self.slots[self.slot][0]
        self.block_size, self.node_size = struct.unpack_from('<II', sb, 64)
        self.host_end = struct.unpack_from('<Q', sb, 72)[0]
        self.roots = {'extent': struct.unpack_from('<QQB', sb, 80),
                      'free': struct.unpack_from('<QQB', sb, 104),
                      'refs': struct.unpack_from('<QQB', sb, 160)}
        self.snap_table, self.snap_count = struct.unpack_from('<QI', sb, 184)

    def read(self, off, n):
        self.f.seek(off)
        return self.f.read(n)

    def write(self, off, data):
        self.f.seek(off)
        self.f.write(data)

    def nodes(self, tree):
        """(offset, level, nritems) of every node of @tree, root first"""
        out = []
        todo = [self.roots[tree][0]]
        while todo:
            off = todo.pop(0)
            b = self.read(off, self.node_size)
            level = b[28]
            nr = struct.unpack_from('<I', b, 32)[0]
            out.append((off, level, nr))
            if level:
                for i in range(nr):
                    todo.append(struct.unpack_from('<Q', b,
                                                   HDR + PTR_ITEM * i + 8)[0])
        return out

    def fix_node_csum(self, off):
        b = self.read(off, self.node_size)
        self.write(off, struct.pack('<I', crc32c(b[4:])))

    def rewrite_snap_entry(self, i, change):
        """Entry @i of the snapshot table changed, table checksum fixed"""
        n = 64 + 512 * self.snap_count
        b = bytearray(self.read(self.snap_table, n))
        e = bytearray(b[64 + 512 * i:64 + 512 * (i + 1)])
        change(e)
        b[64 + 512 * i:64 + 512 * (i + 1)] = e
        struct.pack_into('<I', b, 4, 0)
        struct.pack_into('<I', b, 4, crc32c(bytes(b)))
        self.write(self.snap_table, bytes(b))

    def snap_root(self, i):
        e = self.read(self.snap_table + 64 + 512 * i, 24)
        return struct.unpack_from('<QQB', e, 0)

    def rewrite_super(self, slot, change):
        b = bytearray(self.slots[slot][1])
        change(b)
        struct.pack_into('<I', b, 16, 0)
        struct.pack_into('<I', b, 16, crc32c(bytes(b)))
        self.write(slot * SB_SIZE, bytes(b))


def main():
    img = Image(sys.argv[1])
    what = sys.argv[2]
    ext = img.nodes('extent')
    free = img.nodes('free')
    leaves = [n for n in ext if n[1] == 0]
    interior = [n for n in ext if n[1] > 0]

    if what == 'info':
        print('superblock slot %d, generation %d, %d extent tree nodes '
              '(%d levels), %d free tree nodes' %
              (img.slot, img.gen, len(ext), ext[0][1] + 1, len(free)))
    elif what == 'nodes':
        for tree, nodes in (('extent', ext), ('free', free)):
            for off, level, nr in nodes:
                print('%s level %d items %d at 0x%x' % (tree, level, nr, off))
    elif what == 'incompat':
        mask = int(sys.argv[3], 0)
        for slot in img.slots:
            img.rewrite_super(slot, lambda b: struct.pack_into(
                '<Q', b, 32, struct.unpack_from('<Q', b, 32)[0] | mask))
        print('incompatible features |= 0x%x' % mask)
    elif what in ('mark-log', 'mark-log-lie', 'mark-log-tear'):
        sb = img.slots[img.slot][1]
        log_off, log_len, lag = struct.unpack_from('<QII', sb, 256)
        # the chain of generation + 1, or older by the log lag (bit 7)
        cgen = img.gen + 1 - lag
        chain = []
        for seq in range(log_len // 4096):
            r = img.read(log_off + seq * 4096, 4096)
            magic, gen, rseq, count, csum = struct.unpack_from('<QQIII', r)
            body = r[:24] + b'\0' * 4 + r[28:]
            if (magic != 0x474f4c4b52414d58 or gen != cgen or
                    rseq != seq or csum != crc32c(body)):
                break
            kind = struct.unpack_from('<I', r, 28)[0]
            if kind == 1:
                # a map record: guest, host, length, data checksum
                chain.append(('map', [struct.unpack_from('<QQQI', r,
                                                         32 + 32 * i)
                                      for i in range(count)]))
            else:
                chain.append(('marks', [struct.unpack_from('<QQ', r,
                                                           32 + 16 * i)
                                        for i in range(count)]))
        if what == 'mark-log':
            if lag:
                print('log lag: %d' % lag)
            print('mark log: %d records' % len(chain))
            for seq, (kind, items) in enumerate(chain):
                if kind == 'map':
                    print('record %d: map %s' % (seq, ' '.join(
                        '0x%x+0x%x' % (g, n) for g, _, n, _ in items)))
                else:
                    print('record %d: %s' % (seq, ' '.join(
                        '0x%x+0x%x' % rg for rg in items)))
        elif what == 'mark-log-lie':
            seq = len(chain)
            r = bytearray(4096)
            struct.pack_into('<QQII', r, 0, 0x474f4c4b52414d58, cgen, seq,
                             1)
            struct.pack_into('<QQ', r, 32, int(sys.argv[3], 0),
                             int(sys.argv[4], 0))
            struct.pack_into('<I', r, 24, crc32c(bytes(r)))
            img.write(log_off + seq * 4096, bytes(r))
            print('mark log record %d: 0x%x+0x%x' %
                  (seq, int(sys.argv[3], 0), int(sys.argv[4], 0)))
        else:
            seq = int(sys.argv[3])
            off = log_off + seq * 4096 + 40
            b = img.read(off, 1)[0]
            img.write(off, bytes([b ^ 1]))
            print('mark log record %d: torn' % seq)
    elif what == 'leak':
        n = int(sys.argv[3]) * img.block_size
        img.rewrite_super(img.slot, lambda b: struct.pack_into(
            '<Q', b, 72, img.host_end + n))
        print('host_end 0x%x -> 0x%x' % (img.host_end, img.host_end + n))
    elif what == 'super-field':
        # newest slot: a field out of range, checksum valid
        img.rewrite_super(img.slot, lambda b: struct.pack_into('<I', b, 64,
                                                               3000))
        print('superblock slot %d: block_size 3000' % img.slot)
    elif what == 'super-csum':
        # newest slot: bad checksum
        img.write(img.slot * SB_SIZE + 200, b'\xff' * 8)
        print('superblock slot %d: checksum' % img.slot)
    elif what == 'super-torn':
        # the other slot, as a commit torn while writing it leaves it
        img.write((1 - img.slot) * SB_SIZE + 200, b'\xff' * 8)
        print('superblock slot %d: torn' % (1 - img.slot))
    elif what == 'super-both':
        for slot in (0, 1):
            img.write(slot * SB_SIZE + 200, b'\xff' * 8)
        print('both superblocks: checksum')
    elif what == 'leaf-csum':
        off = leaves[-1][0]
        img.write(off + HDR + 8, b'\x55' * 4)       # an item length
        print('extent tree leaf: checksum')
    elif what == 'leaf-bytenr':
        off = leaves[-1][0]
        bytenr = struct.unpack('<Q', img.read(off + 8, 8))[0]
        img.write(off + 8, struct.pack('<Q', bytenr + img.node_size))
        img.fix_node_csum(off)
        print('extent tree leaf: bytenr')
    elif what == 'leaf-item':
        # two items overlap, checksum valid
        off = leaves[-1][0]
        length = struct.unpack('<Q', img.read(off + HDR + 8, 8))[0]
        img.write(off + HDR + 8, struct.pack('<Q', length + 16 *
                                             img.block_size))
        img.fix_node_csum(off)
        print('extent tree leaf: overlapping items')
    elif what == 'free-node':
        off = free[0][0]
        img.write(off + 40, b'\x01')                # covered by the checksum
        print('free tree node: checksum')
    elif what == 'child-ptr':
        off = interior[0][0]
        at = off + HDR + PTR_ITEM * 1 + 8           # child of item 1
        child = struct.unpack('<Q', img.read(at, 8))[0]
        img.write(at, struct.pack('<Q', child + img.block_size))
        img.fix_node_csum(off)
        print('interior node: child pointer')
    elif what == 'child-gen':
        off = interior[0][0]
        at = off + HDR + PTR_ITEM * 1 + 16          # child_generation
        gen = struct.unpack('<Q', img.read(at, 8))[0]
        img.write(at, struct.pack('<Q', gen - 1))
        img.fix_node_csum(off)
        print('interior node: child generation')
    elif what == 'child-bytes':
        off = interior[0][0]
        at = off + HDR + PTR_ITEM * 1 + 24          # child_bytes
        nbytes = struct.unpack('<Q', img.read(at, 8))[0]
        img.write(at, struct.pack('<Q', nbytes - img.block_size))
        img.fix_node_csum(off)
        print('interior node: child_bytes')
    elif what == 'wrong-child':
        off = [n for n in interior if n[1] == 1][0][0]
        item1 = img.read(off + HDR + PTR_ITEM + 8, 16)
        img.write(off + HDR + 8, item1)         # child, child_generation
        img.fix_node_csum(off)
        print('interior node: item 0 points at item 1\'s child')
    elif what == 'generation':
        gen = int(sys.argv[3], 0)
        for slot in img.slots:
            img.rewrite_super(slot, lambda b: struct.pack_into('<Q', b, 24,
                                                               gen))
        print('both superblocks: generation %d' % gen)
    elif what == 'extent-count':
        n = int(sys.argv[3], 0)
        img.rewrite_super(img.slot, lambda b: struct.pack_into('<Q', b, 128,
                                                               n))
        print('superblock slot %d: extent_count %d' % (img.slot, n))
    elif what == 'host-end':
        n = int(sys.argv[3], 0)
        img.rewrite_super(img.slot, lambda b: struct.pack_into('<Q', b, 72,
                                                               n))
        print('superblock slot %d: host_end 0x%x' % (img.slot, n))
    elif what == 'backing-junk':
        sb = img.slots[img.slot][1]
        flen = struct.unpack_from('<H', sb, 144)[0]
        img.rewrite_super(img.slot, lambda b: b.__setitem__(2048 + flen + 1,
                                                            0x41))
        print('superblock slot %d: junk after the backing file name' %
              img.slot)
    elif what == 'snap-generation':
        gen = int(sys.argv[3], 0)
        for slot in img.slots:
            img.rewrite_super(slot, lambda b: struct.pack_into('<Q', b, 200,
                                                               gen))
        print('both superblocks: snap_generation %d' % gen)
    elif what == 'crypt-header-length':
        n = int(sys.argv[3], 0)
        for slot in img.slots:
            img.rewrite_super(slot, lambda b: struct.pack_into('<Q', b, 224,
                                                               n))
        print('both superblocks: crypt_header_length %d' % n)
    elif what == 'snap-root-drop':
        off = img.snap_root(0)[0]
        b = bytearray(img.read(off, img.node_size))
        nr = struct.unpack_from('<I', b, 32)[0]
        isz = PTR_ITEM if b[28] else LEAF_ITEM
        b[HDR + isz * (nr - 1):HDR + isz * nr] = bytes(isz)
        struct.pack_into('<I', b, 32, nr - 1)
        img.write(off, bytes(b))
        img.fix_node_csum(off)
        print('snapshot root: %d items, was %d' % (nr - 1, nr))
    elif what == 'snap-root-leaf':
        off = img.snap_root(0)[0]
        b = img.read(off, img.node_size)
        assert b[28] == 1
        child, gen = struct.unpack_from('<QQ', b, HDR + PTR_ITEM + 8)

        def point(e):
            struct.pack_into('<QQB', e, 0, child, gen, 0)
        img.rewrite_snap_entry(0, point)
        print('snapshot entry: root is a leaf of its tree')
    elif what == 'item-past-size':
        key = int(sys.argv[3], 0)
        off = leaves[-1][0]
        nr = leaves[-1][2]
        img.write(off + HDR + LEAF_ITEM * (nr - 1), struct.pack('<Q', key))
        img.fix_node_csum(off)
        print('last extent item moved to 0x%x' % key)
    elif what == 'refs-up':
        off = img.roots['refs'][0]
        b = img.read(off, img.node_size)
        assert b[28] == 0
        count = struct.unpack_from('<Q', b, HDR + 16)[0]
        img.write(off + HDR + 16, struct.pack('<Q', count + 1))
        img.fix_node_csum(off)
        print('reference count %d -> %d' % (count, count + 1))
    elif what == 'refs-drop':
        host = int(sys.argv[3], 0)
        off = img.roots['refs'][0]
        b = bytearray(img.read(off, img.node_size))
        assert b[28] == 0
        nr = struct.unpack_from('<I', b, 32)[0]
        for i in range(nr):
            key, length = struct.unpack_from('<QQ', b, HDR + LEAF_ITEM * i)
            if key <= host < key + length:
                break
        else:
            sys.exit('xtpoke.py: no REFS item covers 0x%x' % host)
        b[HDR + LEAF_ITEM * i:HDR + LEAF_ITEM * (nr - 1)] = \
            b[HDR + LEAF_ITEM * (i + 1):HDR + LEAF_ITEM * nr]
        b[HDR + LEAF_ITEM * (nr - 1):HDR + LEAF_ITEM * nr] = bytes(LEAF_ITEM)
        struct.pack_into('<I', b, 32, nr - 1)
        img.write(off, bytes(b))
        img.fix_node_csum(off)
        print('REFS item removed: its blocks count 1')
    elif what == 'host-of':
        guest = int(sys.argv[3], 0)
        off = img.roots['extent'][0]
        while True:
            b = img.read(off, img.node_size)
            nr = struct.unpack_from('<I', b, 32)[0]
            if b[28] == 0:
                break
            child = None
            for i in range(nr):
                key, c = struct.unpack_from('<QQ', b, HDR + PTR_ITEM * i)
                if key <= guest:
                    child = c
            off = child
        for i in range(nr):
            key, length, host = struct.unpack_from('<QQQ', b,
                                                   HDR + LEAF_ITEM * i)
            if key <= guest < key + length:
                print('0x%x' % (host + guest - key))
                break
        else:
            sys.exit('xtpoke.py: guest 0x%x is not mapped' % guest)
    else:
        sys.exit('xtpoke.py: unknown request ' + what)
    img.f.close()


main()

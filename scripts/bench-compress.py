#!/usr/bin/python3
"""Compressed images of a real system disk: extree against qcow2 (issue 34).

The source is a raw disk image of an installed Debian 12 system (--image,
by default /var/tmp/xt-bench/debian.raw: a 4 GiB ext4 filesystem, no
partition table, filled by debootstrap; see the issue for how it is built).
Every variant is made from it with qemu-img convert -f raw:

  qcow2-zlib    -c -O qcow2  -o compression_type=zlib
  qcow2-zstd    -c -O qcow2  -o compression_type=zstd
  extree-zstd   -c -O extree -o compression_type=zstd
  extree-zlib   -c -O extree -o compression_type=zlib
  qcow2         -O qcow2  (uncompressed, default options)
  extree        -O extree (uncompressed, default options)

--formats picks the compressed variants; the uncompressed conversion of each
driver among them is added unless --no-uncompressed, so that map (and the
rest) of a compressed image can be set against the same data uncompressed.

Measures, each a whole qemu-img command (open, work, close) timed by wall
clock, with the CPU time (user + system) of the command beside it:

  convert   qemu-img convert [-c] -f raw -O FMT [-o ...] SRC DST
  file      the image's length (st_size) and the host space it takes
            (st_blocks * 512), after the convert; the ratio is the space
            against the bytes the source maps as data
  map       qemu-img map --output=json -f FMT DST > /dev/null
  read      qemu-img convert -f FMT -O raw DST OUT: reads and decompresses
            the whole image into a fresh raw file in --dir (deleted after),
            or with --read-to null into QEMU's null-co driver
            (convert -n --target-image-opts driver=null-co), which takes
            the host file system's writes out of the time

In each of --runs rounds every variant is converted afresh, then mapped,
then read; the variants alternate (the order reversed every other round).
After the first convert of each variant, qemu-img compare against the
source and qemu-img check (untimed) must pass.  Medians are printed as a
markdown table with the range, and written as CSV to --out (default
docs/performance/full/compress.csv).

The page cache is not dropped: the source is read once before the first
round so that every convert reads it from memory, `sync` runs (untimed)
after each round's converts and after each read, and the images are small
enough to stay cached, so map and read measure the format's work, not the
disk.  A variant the given qemu-img cannot make (an unknown format or
option, e.g. extree before it supports -c) is reported with qemu-img's
error in its row, and the others go on.

    scripts/bench-compress.py [--qemu-img PATH] [--image PATH] [--runs 5]
        [--formats qcow2-zlib,qcow2-zstd,extree-zstd,extree-zlib]
        [--no-uncompressed] [--read-to file|null] [--dir DIR] [--out FILE]
        [--keep]

Python 3 stdlib only; the default --qemu-img is build/qemu/qemu-img.
"""

import argparse
import csv
import json
import os
import resource
import statistics
import subprocess
import sys
import time

TOP = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QIMG = os.path.join(TOP, 'build', 'qemu', 'qemu-img')
IMAGE = '/var/tmp/xt-bench/debian.raw'
DIR = '/var/tmp/xt-bench/work'
OUT = os.path.join(TOP, 'docs', 'performance', 'full', 'compress.csv')
MiB = 1 << 20

# name -> (driver, compression_type or None for uncompressed)
COMPRESSED = {
    'qcow2-zlib': ('qcow2', 'zlib'),
    'qcow2-zstd': ('qcow2', 'zstd'),
    'extree-zstd': ('extree', 'zstd'),
    'extree-zlib': ('extree', 'zlib'),
}
TIMED = ('convert', 'map', 'read')


def log(msg):
    print(msg, file=sys.stderr, flush=True)


class Variant:
    def __init__(self, name, driver, ctype, a):
        self.name = name
        self.driver = driver
        self.ctype = ctype
        self.img = os.path.join(a.dir, 'compress.' + name)
        self.times = {m: [] for m in TIMED}
        self.cpu = {m: [] for m in TIMED}
        self.file_bytes = []
        self.alloc_bytes = []
        self.map_entries = None
        self.error = None

    @property
    def compressed(self):
        return self.ctype is not None

    def convert_cmd(self, a):
        cmd = [a.qemu_img, 'convert']
        if self.compressed:
            cmd.append('-c')
        cmd += ['-f', 'raw', '-O', self.driver]
        if self.compressed:
            cmd += ['-o', 'compression_type=' + self.ctype]
        return cmd + [a.image, self.img]

    def fail(self, what, cmd, out):
        lines = [l.strip() for l in out.strip().splitlines() if l.strip()]
        self.error = '%s failed: %s' % (what, ' / '.join(lines[-3:]) or
                                       'exit status only')
        log('%s: %s\n  (%s)' % (self.name, self.error, ' '.join(cmd)))


def timed(cmd, stdout=subprocess.DEVNULL):
    """(wall seconds, CPU seconds, exit status, stderr) of one command"""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    p = subprocess.run(cmd, stdout=stdout, stderr=subprocess.PIPE,
                       text=True)
    wall = time.monotonic() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return wall, cpu, p.returncode, p.stderr


def untimed(cmd):
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True)
    return p.returncode, p.stdout


def data_bytes(a, fmt, img):
    """Bytes that qemu-img map shows as data, and the number of entries"""
    rc, out = untimed([a.qemu_img, 'map', '--output=json', '-f', fmt, img])
    if rc:
        return None, out
    m = json.loads(out)
    return sum(e['length'] for e in m if e['data']), len(m)


def warm(path):
    """Read the data of a sparse file once (SEEK_DATA / SEEK_HOLE)"""
    size = os.path.getsize(path)
    with open(path, 'rb', buffering=0) as f:
        fd = f.fileno()
        pos = 0
        while pos < size:
            try:
                pos = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError:
                break
            end = os.lseek(fd, pos, os.SEEK_HOLE)
            os.lseek(fd, pos, os.SEEK_SET)
            while pos < end:
                n = len(os.read(fd, min(16 * MiB, end - pos)))
                if not n:
                    break
                pos += n


def do_convert(v, a, first):
    if os.path.exists(v.img):
        os.unlink(v.img)
    cmd = v.convert_cmd(a)
    wall, cpu, rc, err = timed(cmd)
    if rc:
        v.fail('convert', cmd, err)
        return
    st = os.stat(v.img)
    v.times['convert'].append(wall)
    v.cpu['convert'].append(cpu)
    v.file_bytes.append(st.st_size)
    v.alloc_bytes.append(st.st_blocks * 512)
    if not first:
        return
    # The first image of each variant must hold the source's data
    cmd = [a.qemu_img, 'compare', '-f', 'raw', '-F', v.driver, a.image,
           v.img]
    rc, out = untimed(cmd)
    if rc:
        v.fail('compare with the source', cmd, out)
        return
    cmd = [a.qemu_img, 'check', '-f', v.driver, v.img]
    rc, out = untimed(cmd)
    if rc:
        v.fail('check', cmd, out)
        return
    _, n = data_bytes(a, v.driver, v.img)
    v.map_entries = n


def do_map(v, a):
    cmd = [a.qemu_img, 'map', '--output=json', '-f', v.driver, v.img]
    wall, cpu, rc, err = timed(cmd)
    if rc:
        v.fail('map', cmd, err)
        return
    v.times['map'].append(wall)
    v.cpu['map'].append(cpu)


def do_read(v, a):
    out = os.path.join(a.dir, 'read.raw')
    if a.read_to == 'null':
        cmd = [a.qemu_img, 'convert', '-n', '-f', v.driver, v.img,
               '--target-image-opts',
               'driver=null-co,size=%d' % a.virtual_size]
    else:
        if os.path.exists(out):
            os.unlink(out)
        cmd = [a.qemu_img, 'convert', '-f', v.driver, '-O', 'raw', v.img,
               out]
    wall, cpu, rc, err = timed(cmd)
    if os.path.exists(out):
        os.unlink(out)
    subprocess.run(['sync'])
    if rc:
        v.fail('read', cmd, err)
        return
    v.times['read'].append(wall)
    v.cpu['read'].append(cpu)


def cell(vals, fmt='%.2f'):
    if not vals:
        return '–'
    med = statistics.median(vals)
    if len(vals) == 1 or min(vals) == max(vals):
        return fmt % med
    return (fmt + ' (' + fmt + '–' + fmt + ')') % (med, min(vals), max(vals))


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument('--qemu-img', default=QIMG)
    ap.add_argument('--image', default=IMAGE)
    ap.add_argument('--runs', type=int, default=5)
    ap.add_argument('--formats', default=','.join(COMPRESSED))
    ap.add_argument('--no-uncompressed', action='store_true')
    ap.add_argument('--read-to', choices=('file', 'null'), default='file')
    ap.add_argument('--dir', default=DIR)
    ap.add_argument('--out', default=OUT)
    ap.add_argument('--keep', action='store_true', help='keep the images')
    a = ap.parse_args()
    if a.runs < 1:
        sys.exit('bench-compress: --runs must be at least 1')
    if not os.access(a.qemu_img, os.X_OK):
        sys.exit('bench-compress: %s is not an executable qemu-img'
                 % a.qemu_img)
    if not os.path.isfile(a.image):
        sys.exit('bench-compress: no source image %s' % a.image)
    names = [f for f in a.formats.split(',') if f]
    bad = [f for f in names if f not in COMPRESSED]
    if bad or not names:
        sys.exit('bench-compress: --formats takes %s (not %s)' % (
            ','.join(COMPRESSED), ','.join(bad) or 'nothing'))
    os.makedirs(a.dir, exist_ok=True)
    a.virtual_size = os.path.getsize(a.image)
    src_data, src_entries = data_bytes(a, 'raw', a.image)
    if src_data is None:
        sys.exit('bench-compress: qemu-img map of %s failed:\n%s' % (
            a.image, src_entries))
    version = untimed([a.qemu_img, '--version'])[1].splitlines()[0]
    log('%s; source %s: %d MiB virtual, %d MiB of data' % (
        version, a.image, a.virtual_size // MiB, src_data // MiB))

    variants = [Variant(n, *COMPRESSED[n], a) for n in names]
    if not a.no_uncompressed:
        for drv in dict.fromkeys(COMPRESSED[n][0] for n in names):
            variants.append(Variant(drv, drv, None, a))

    warm(a.image)
    t0 = time.monotonic()
    for r in range(a.runs):
        order = variants if r % 2 == 0 else variants[::-1]
        for v in order:
            if not v.error:
                do_convert(v, a, r == 0)
        subprocess.run(['sync'])
        for v in order:
            if not v.error:
                do_map(v, a)
        for v in order:
            if not v.error:
                do_read(v, a)
        log('round %d of %d done (%.0f s)' % (r + 1, a.runs,
                                             time.monotonic() - t0))
    if not a.keep:
        for v in variants:
            if os.path.exists(v.img):
                os.unlink(v.img)

    print('%s, source %s (%d MiB virtual, %d MiB of data), median of %d '
          'alternating runs (range), page cache not dropped, read into %s\n'
          % (version, os.path.basename(a.image), a.virtual_size // MiB,
             src_data // MiB, a.runs,
             'a raw file' if a.read_to == 'file' else 'null-co'))
    print('| format | -c | convert s | CPU s | file MiB | host MiB | '
          'host/data | map s | map entries | read s | CPU s |')
    print('|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|')
    rows = []
    for v in variants:
        common = {'format': v.name, 'driver': v.driver,
                  'compression_type': v.ctype or '',
                  'compressed': 'yes' if v.compressed else 'no'}

        def row(measure, unit, vals, cpu=None, fmt='%.3f'):
            rows.append(dict(common, measure=measure, unit=unit,
                             n=len(vals),
                             median=fmt % statistics.median(vals)
                             if vals else '',
                             min=fmt % min(vals) if vals else '',
                             max=fmt % max(vals) if vals else '',
                             cpu_s_median='%.3f' % statistics.median(cpu)
                             if cpu else '',
                             note=v.error or ''))

        for m in TIMED:
            row(m, 's', v.times[m], v.cpu[m])
        row('file_bytes', 'bytes', v.file_bytes, fmt='%d')
        row('host_bytes', 'bytes', v.alloc_bytes, fmt='%d')
        row('host_per_data', 'ratio',
            [b / src_data for b in v.alloc_bytes], fmt='%.4f')
        row('map_entries', 'count',
            [v.map_entries] if v.map_entries is not None else [], fmt='%d')
        mib = [b / MiB for b in v.file_bytes]
        host = [b / MiB for b in v.alloc_bytes]
        ratio = ('%.3f' % (statistics.median(v.alloc_bytes) / src_data)
                 if v.alloc_bytes else '–')
        print('| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |' % (
            v.name, 'yes' if v.compressed else 'no',
            cell(v.times['convert']), cell(v.cpu['convert']),
            cell(mib, '%.1f'), cell(host, '%.1f'), ratio,
            cell(v.times['map'], '%.3f'),
            v.map_entries if v.map_entries is not None else '–',
            cell(v.times['read']), cell(v.cpu['read'])))
    errors = [v for v in variants if v.error]
    if errors:
        print()
        for v in errors:
            print('- %s: %s' % (v.name, v.error))
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, 'w', newline='') as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    log('results: %s' % a.out)
    return 0


if __name__ == '__main__':
    sys.exit(main())

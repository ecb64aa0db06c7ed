#!/usr/bin/python3
"""LUKS-encrypted extree against LUKS-encrypted qcow2 (issue 36, point 4).

Both images are --size (default 4 GiB), LUKS with the same cipher (default
aes-256-xts, plain64 IVs, sha256, iter-time 10 ms), qcow2 with its default
64 KiB clusters, and both are filled completely first: qemu-img convert of
one raw file of pseudo-random bytes, so every measure reads or overwrites
written, encrypted data.  `qemu-img map` must then show the whole disk as
data, and qemu-img info the requested cipher, for both.

qemu-img bench takes no --object in QEMU 10.0, so it cannot open an
encrypted image; every measure is fio's nbd engine against qemu-nbd
(--object secret, --image-opts, --cache none --aio native unless --cache
writeback), one qemu-nbd per measure, --seconds of I/O after a second of
ramp, at --depth (default 16):

  randread    4 KiB random reads over the whole disk: IOPS
  randwrite   4 KiB random writes over the whole disk (overwrites): IOPS
  seqread     1 MiB sequential reads: MB/s (10^6 bytes a second)
  seqwrite    1 MiB sequential writes (overwrites): MB/s

The formats alternate in each of --runs rounds (the order reversed every
other round); medians are printed as a markdown table with the range and
extree's ratio to qcow2, and written as CSV: --csv, by default
docs/performance/full/crypt.csv at the default --size (the published run)
and DIR/crypt-SIZE.csv otherwise.  At the end qemu-img check must pass on
both images.

    scripts/bench-crypt.py [--runs 5] [--size 4G] [--seconds 10]
        [--depth 16] [--cipher aes-256-xts] [--ivgen plain64]
        [--cache none|writeback] [--dir DIR] [--csv FILE]

Python 3 stdlib, fio and build/qemu.
"""

import argparse
import csv
import json
import os
import random
import statistics
import subprocess
import sys
import time

TOP = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QEMU = os.path.join(TOP, 'build', 'qemu')
QIMG = os.path.join(QEMU, 'qemu-img')
QNBD = os.path.join(QEMU, 'qemu-nbd')
FORMATS = ('extree', 'qcow2')
SECRET = 'secret,id=sec0,data=bench-crypt-passphrase'
MiB = 1 << 20
DEFAULT_SIZE = '4G'

# name -> fio --rw, block size, what is reported
MEASURES = {
    'randread': ('randread', '4k', 'IOPS'),
    'randwrite': ('randwrite', '4k', 'IOPS'),
    'seqread': ('read', '1M', 'MB/s'),
    'seqwrite': ('write', '1M', 'MB/s'),
}


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def run(cmd, **kw):
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, **kw)
    if r.returncode:
        sys.exit('bench-crypt: %s failed (exit %d):\n%s' % (
            ' '.join(cmd), r.returncode, r.stdout[-2000:]))
    return r.stdout


def parse_size(s):
    units = {'K': 1 << 10, 'M': 1 << 20, 'G': 1 << 30, 'T': 1 << 40}
    s = s.strip().upper().rstrip('B').rstrip('I')
    if s and s[-1] in units:
        return int(float(s[:-1]) * units[s[-1]])
    return int(s)


def image_opts(fmt, img):
    return 'driver=%s,file.filename=%s,encrypt.key-secret=sec0' % (fmt, img)


def random_source(path, size):
    """A raw file of @size pseudo-random bytes (kept for the next run)"""
    if os.path.exists(path) and os.path.getsize(path) == size:
        return
    log('writing %d MiB of pseudo-random data to %s' % (size // MiB, path))
    rnd = random.Random(36)
    with open(path + '.tmp', 'wb') as f:
        left = size
        while left:
            n = min(left, 16 * MiB)
            f.write(rnd.randbytes(n))
            left -= n
    os.rename(path + '.tmp', path)


def build_image(fmt, img, src, a):
    alg, _, mode = a.cipher.rpartition('-')
    opts = ('encrypt.format=luks,encrypt.key-secret=sec0,'
            'encrypt.iter-time=10,encrypt.cipher-alg=%s,'
            'encrypt.cipher-mode=%s,encrypt.ivgen-alg=%s' % (
                alg, mode, a.ivgen))
    if os.path.exists(img):
        os.unlink(img)
    t0 = time.monotonic()
    run([QIMG, 'convert', '--object', SECRET, '-f', 'raw', '-O', fmt,
         '-o', opts, src, img])
    log('%s: filled by qemu-img convert in %.1f s' % (
        img, time.monotonic() - t0))

    # The same cipher for both, and every byte of the disk data
    info = json.loads(run([QIMG, 'info', '--output=json', '-f', fmt, img]))
    enc = info.get('format-specific', {}).get('data', {}).get('encrypt')
    want = {'format': 'luks', 'cipher-alg': alg, 'cipher-mode': mode,
            'ivgen-alg': a.ivgen}
    if not enc or any(enc.get(k) != v for k, v in want.items()):
        sys.exit('bench-crypt: %s: qemu-img info shows encrypt %r, want %r'
                 % (img, enc, want))
    m = json.loads(run([QIMG, 'map', '--output=json', '--object', SECRET,
                        '--image-opts', image_opts(fmt, img)]))
    data = sum(e['length'] for e in m if e['data'])
    if data != a.bytes:
        sys.exit('bench-crypt: %s: %d of %d bytes map as data after the '
                 'fill' % (img, data, a.bytes))


class Server:
    """qemu-nbd serving one encrypted image on a Unix socket"""

    def __init__(self, fmt, img, sock, cache):
        self.sock = sock
        self.cmd = [QNBD, '--object', SECRET, '--image-opts',
                    image_opts(fmt, img), '-k', sock, '--shared=16',
                    '--persistent', '--cache=' + cache]
        if cache == 'none':
            self.cmd.append('--aio=native')
        self.proc = None

    def __enter__(self):
        if os.path.exists(self.sock):
            os.unlink(self.sock)
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        for _ in range(400):
            if os.path.exists(self.sock):
                return self
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.proc.kill()
        sys.exit('bench-crypt: qemu-nbd did not start: %s\n%s' % (
            ' '.join(self.cmd), self.proc.communicate()[1]))

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait()

    @property
    def uri(self):
        return 'nbd+unix:///?socket=' + self.sock


def bench(fmt, img, measure, a):
    rw, bs, _ = MEASURES[measure]
    sock = os.path.join(a.dir, 'nbd.sock')
    with Server(fmt, img, sock, a.cache) as srv:
        cmd = ['fio', '--name=' + measure, '--ioengine=nbd',
               '--uri=' + srv.uri, '--rw=' + rw, '--bs=' + bs,
               '--iodepth=%d' % a.depth, '--size=%d' % a.bytes,
               '--time_based', '--runtime=%d' % a.seconds, '--ramp_time=1',
               '--output-format=json']
        r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        sys.exit('bench-crypt: %s failed: %s' % (' '.join(cmd), r.stderr))
    # the nbd engine may print "fio: connected to NBD server" first
    job = json.loads(r.stdout[r.stdout.index('{'):])['jobs'][0]
    side = job['read' if 'read' in rw else 'write']
    if job.get('error') or side['io_bytes'] == 0:
        sys.exit('bench-crypt: %s: fio did no I/O (error %s)' % (
            ' '.join(cmd), job.get('error')))
    if bs == '4k':
        return side['iops']
    return side['bw_bytes'] / 1e6


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument('--runs', type=int, default=5)
    ap.add_argument('--size', default=DEFAULT_SIZE)
    ap.add_argument('--seconds', type=int, default=10)
    ap.add_argument('--depth', type=int, default=16)
    ap.add_argument('--cipher', default='aes-256-xts')
    ap.add_argument('--ivgen', default='plain64')
    ap.add_argument('--cache', choices=('none', 'writeback'), default='none')
    ap.add_argument('--dir', default=os.path.join(TOP, 'build',
                                                  'bench-crypt'))
    ap.add_argument('--csv')
    a = ap.parse_args()
    a.bytes = parse_size(a.size)
    if a.bytes <= 0 or a.bytes % MiB:
        sys.exit('bench-crypt: --size must be a positive number of MiB')
    if '-' not in a.cipher:
        sys.exit('bench-crypt: --cipher ALG-MODE, e.g. aes-256-xts')
    for p in (QIMG, QNBD):
        if not os.access(p, os.X_OK):
            sys.exit('bench-crypt: %s is not built' % p)
    if 'extree' not in run([QIMG, '--help']).split():
        sys.exit('bench-crypt: %s has no extree driver' % QIMG)
    os.makedirs(a.dir, exist_ok=True)
    sname = a.size.upper()
    if a.csv is None:
        a.csv = (os.path.join(TOP, 'docs', 'performance', 'full',
                              'crypt.csv')
                 if a.bytes == parse_size(DEFAULT_SIZE) else
                 os.path.join(a.dir, 'crypt-%s.csv' % sname))

    src = os.path.join(a.dir, 'random-%s.raw' % sname)
    random_source(src, a.bytes)
    imgs = {f: os.path.join(a.dir, 'crypt.' + f) for f in FORMATS}
    for f in FORMATS:
        build_image(f, imgs[f], src, a)
    run(['sync'])

    res = {(m, f): [] for m in MEASURES for f in FORMATS}
    t0 = time.monotonic()
    for r in range(a.runs):
        order = FORMATS if r % 2 == 0 else FORMATS[::-1]
        for m in MEASURES:
            for f in order:
                res[(m, f)].append(bench(f, imgs[f], m, a))
        log('round %d of %d done (%.0f s)' % (r + 1, a.runs,
                                             time.monotonic() - t0))

    for f in FORMATS:
        out = subprocess.run([QIMG, 'check', '--object', SECRET,
                              '--image-opts', image_opts(f, imgs[f])],
                             stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        if out.returncode:
            sys.exit('bench-crypt: qemu-img check of %s failed after the '
                     'runs:\n%s' % (imgs[f], out.stdout))

    print('%s LUKS (%s, %s), %s images filled with data, fio nbd engine '
          'against qemu-nbd --cache=%s, depth %d, %d s a run, median of %d '
          'alternating runs (range)\n' % (a.cipher, a.ivgen, 'iter-time 10',
                                         sname, a.cache, a.depth, a.seconds,
                                         a.runs))
    print('| measure | extree | qcow2 | extree/qcow2 |')
    print('|---|---:|---:|---:|')
    rows = []
    for m, (_, bs, unit) in MEASURES.items():
        med = {}
        cells = []
        for f in FORMATS:
            v = res[(m, f)]
            med[f] = statistics.median(v)
            cells.append('%.0f (%.0f–%.0f)' % (med[f], min(v), max(v)))
            rows.append({'measure': m, 'format': f, 'unit': unit,
                         'block': bs, 'depth': a.depth, 'n': len(v),
                         'median': '%.1f' % med[f], 'min': '%.1f' % min(v),
                         'max': '%.1f' % max(v), 'size': sname,
                         'cipher': a.cipher + '-' + a.ivgen,
                         'cache': a.cache, 'seconds': a.seconds})
        print('| %s %s %s | %s | %s | %.2f |' % (
            m, bs, unit, cells[0], cells[1], med['extree'] / med['qcow2']))
    os.makedirs(os.path.dirname(os.path.abspath(a.csv)), exist_ok=True)
    with open(a.csv, 'w', newline='') as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    log('results: %s' % a.csv)
    return 0


if __name__ == '__main__':
    sys.exit(main())

#!/usr/bin/python3
"""Time a blockdev-mirror (sync=full) of a fragmented image, by source format
(issue 19 point 4).  Python 3 stdlib only.

The layout: SIZE virtual (default 2 GiB) with a 4 KiB block written every
STRIDE (default 8 KiB: every other block, SIZE / 8 KiB data runs, as many
holes: 262,144 runs at 2 GiB; --size 64 --stride 64 is the full-scale S2
layout, 1,048,576 runs, written in guest order here).  The
raw source is written here (sparse, on the file system of DIR); the extree
and qcow2 (cluster_size=4096) sources are converted from it with qemu-img
convert, so all three hold the same data and holes.

Each run starts build/qemu's qemu-storage-daemon with the source and a
null-co target of the same size, then times over QMP from blockdev-mirror
(sync=full, granularity=4096: a 4 KiB data run is copied alone, not with the
hole beside it) to the job's READY event, and the daemon's CPU time (utime +
stime from /proc) over the same span.  The job walks the source's block
status over the whole image; null-co costs nothing to write, so the figures
are the source's walk and reads.  The formats alternate, RUNS rounds (3),
and the median of each is printed.  Warm: the sources are read once before.

    scripts/bench-mirror.py [--dir DIR] [--size GiB] [--runs N] [--keep]
                            [--only FMT]

BENCH_MIRROR_WRAP="perf record -g -o F" runs the daemon under that command
(its CPU time is then the wrapper's, not the daemon's).
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

TOP = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QEMU = os.path.join(TOP, 'build', 'qemu')
KiB = 1024
GiB = 1024 ** 3


def make_raw(path, size, stride):
    """a 4 KiB block of data every @stride bytes of @size, holes between"""
    with open(path, 'wb') as f:
        f.truncate(size)
        block = bytearray(b'\x5a' * 4096)
        for i in range(size // stride):
            block[0:8] = i.to_bytes(8, 'little')
            f.seek(i * stride)
            f.write(block)


class QMP:
    def __init__(self, path):
        self.sock = socket.socket(socket.AF_UNIX)
        for _ in range(200):
            try:
                self.sock.connect(path)
                break
            except OSError:
                time.sleep(0.05)
        self.f = self.sock.makefile('rw')
        self.events = []
        self.read()                                     # greeting
        self.cmd('qmp_capabilities')

    def read(self):
        line = self.f.readline()
        if not line:
            raise RuntimeError('QMP connection closed')
        return json.loads(line)

    def cmd(self, name, **args):
        self.f.write(json.dumps({'execute': name, 'arguments': args}) + '\n')
        self.f.flush()
        while True:
            m = self.read()
            if 'event' in m:
                self.events.append(m)
            elif 'error' in m:
                raise RuntimeError(f'{name}: {m["error"]}')
            else:
                return m['return']

    def wait_event(self, pred):
        while True:
            for i, e in enumerate(self.events):
                if pred(e):
                    return self.events.pop(i)
            self.events.append(self.read())


def cpu(pid):
    with open(f'/proc/{pid}/stat') as f:
        fields = f.read().rsplit(')', 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf('SC_CLK_TCK')


def run(fmt, img, size, tmp):
    sock = os.path.join(tmp, 'qmp.sock')
    if os.path.exists(sock):
        os.remove(sock)
    wrap = os.environ.get('BENCH_MIRROR_WRAP', '').split()
    p = subprocess.Popen(
        [*wrap, os.path.join(QEMU, 'storage-daemon', 'qemu-storage-daemon'),
         '--blockdev', f'file,node-name=src-file,filename={img}',
         '--blockdev', f'{fmt},node-name=src,file=src-file',
         '--blockdev', f'null-co,node-name=tgt,size={size}',
         '--chardev', f'socket,id=m,path={sock},server=on,wait=off',
         '--monitor', 'chardev=m'])
    try:
        q = QMP(sock)
        c0, t0 = cpu(p.pid), time.monotonic()
        q.cmd('blockdev-mirror', **{'job-id': 'm', 'device': 'src',
                                    'target': 'tgt', 'sync': 'full',
                                    'granularity': 4096})
        q.wait_event(lambda e: e['event'] == 'BLOCK_JOB_READY' or
                     e['event'] == 'BLOCK_JOB_COMPLETED')
        t1, c1 = time.monotonic(), cpu(p.pid)
        q.cmd('block-job-cancel', device='m')
        q.wait_event(lambda e: e['event'] in ('BLOCK_JOB_COMPLETED',
                                              'BLOCK_JOB_CANCELLED'))
        q.cmd('quit')
        p.wait(60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return t1 - t0, c1 - c0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--dir', default=os.path.join(TOP, 'build', 'bench-mirror'))
    ap.add_argument('--size', type=int, default=2, help='GiB (default 2)')
    ap.add_argument('--stride', type=int, default=8,
                    help='KiB from one data block to the next (default 8; '
                         'the S2 layout: --size 64 --stride 64)')
    ap.add_argument('--runs', type=int, default=3)
    ap.add_argument('--keep', action='store_true', help='keep the images')
    ap.add_argument('--only', choices=('extree', 'qcow2', 'raw'),
                    help='time this source format only')
    a = ap.parse_args()
    size = a.size * GiB
    stride = a.stride * KiB
    os.makedirs(a.dir, exist_ok=True)
    imgs = {'raw': os.path.join(a.dir, 'src.raw'),
            'extree': os.path.join(a.dir, 'src.extree'),
            'qcow2': os.path.join(a.dir, 'src.qcow2')}
    stamp = os.path.join(a.dir, 'src.layout')
    layout = f'{size} {stride}'
    if not os.path.exists(stamp) or open(stamp).read() != layout:
        make_raw(imgs['raw'], size, stride)
        with open(stamp, 'w') as f:
            f.write(layout)
        for f in ('extree', 'qcow2'):
            if os.path.exists(imgs[f]):
                os.remove(imgs[f])
    img_tool = os.path.join(QEMU, 'qemu-img')
    for fmt, opts in (('extree', []), ('qcow2', ['-o', 'cluster_size=4096'])):
        if not os.path.exists(imgs[fmt]):
            subprocess.run([img_tool, 'convert', '-f', 'raw', '-O', fmt, *opts,
                            imgs['raw'], imgs[fmt]], check=True)
    for fmt, img in imgs.items():                       # warm the cache
        subprocess.run([img_tool, 'compare', '-f', 'raw', '-F', fmt,
                        imgs['raw'], img], check=True, stdout=subprocess.DEVNULL)
    load = os.getloadavg()[0]
    res = {f: [] for f in imgs}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.runs):
            for fmt in ('extree', 'qcow2', 'raw'):
                if a.only and fmt != a.only:
                    continue
                res[fmt].append(run(fmt, imgs[fmt], size, tmp))
                print(f'round {r + 1} {fmt}: {res[fmt][-1][0]:.2f} s, '
                      f'CPU {res[fmt][-1][1]:.2f} s', file=sys.stderr)
    print(f'blockdev-mirror sync=full granularity=4096 to null-co, '
          f'{a.size} GiB virtual, {size // stride} data runs of 4 KiB '
          f'every {a.stride} KiB, holes between; medians of {a.runs} '
          f'alternating runs '
          f'(load average {load:.1f} at the start, 2 cores)')
    for fmt in ('extree', 'qcow2', 'raw'):
        if not res[fmt]:
            continue
        wall = statistics.median(x[0] for x in res[fmt])
        cpus = statistics.median(x[1] for x in res[fmt])
        runs = ' '.join(f'{x[0]:.2f}' for x in res[fmt])
        print(f'  {fmt:7} {wall:6.2f} s wall  {cpus:6.2f} s CPU  (runs: {runs})')
    if not a.keep:
        for img in list(imgs.values()) + [stamp]:
            os.remove(img)


main()

#!/usr/bin/python3
"""The nbdkit plugin against qemu-nbd and nbdkit's file plugin (issue 35).

Three servers, each serving over a Unix socket:
  plugin      nbdkit + nbdkit-extree-plugin.so, an extree image
  qemu-nbd    build/qemu/qemu-nbd, the same extree image
  file        nbdkit's file plugin, the same content as a raw file

Measures, in alternating rounds (one run of each server per round), medians:
  map         `nbdinfo --map` of the S1 layout (16 GiB, 4 KiB of data every
              128 KiB: 262,144 map entries): the server's CPU time (user +
              system, from /proc/PID/stat around the command) and the
              command's wall time
  randread    fio's nbd engine, 4 KiB random reads at depth 16 for
              --seconds over a fully written 1 GiB image: IOPS
  randwrite   the same with random writes over the written data (in place)

Usage:
  scripts/bench-nbdkit.py [--runs N] [--seconds S] [--scale full|quick|1/N] [--dir DIR]

The images are built once in DIR (default build/bench-nbdkit) from
scripts/bench-images.py's S1 layout (--scale 1/N shrinks it) and from 1 GiB
of random data.  Prints a table and writes DIR/results.json.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

TOP = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QEMU = os.path.join(TOP, 'build', 'qemu')
PLUGIN = os.path.join(QEMU, 'nbdkit-extree-plugin.so')
GiB = 1 << 30
TICK = os.sysconf('SC_CLK_TCK')


def run(cmd, **kw):
    return subprocess.run(cmd, check=True, **kw)


def cpu_seconds(pid):
    with open('/proc/%d/stat' % pid) as f:
        fields = f.read().rsplit(')', 1)[1].split()
    # utime, stime: fields 14 and 15 of stat, 12 and 13 after the name
    return (int(fields[11]) + int(fields[12])) / TICK


class Server:
    def __init__(self, name, sock, cmd):
        self.name, self.sock, self.cmd = name, sock, cmd
        self.proc = None

    def __enter__(self):
        if os.path.exists(self.sock):
            os.unlink(self.sock)
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        for _ in range(200):
            if os.path.exists(self.sock):
                return self
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError('%s did not start: %s' % (self.name, self.cmd))

    def __exit__(self, *a):
        self.proc.terminate()
        self.proc.wait()

    @property
    def uri(self):
        return 'nbd+unix:///?socket=' + self.sock


def servers(d, extree, raw, kind):
    sock = os.path.join(d, kind + '.sock')
    return {
        'plugin': Server('plugin', sock, [
            'nbdkit', '-f', '-U', sock, PLUGIN, 'file=' + extree]),
        'qemu-nbd': Server('qemu-nbd', sock, [
            os.path.join(QEMU, 'qemu-nbd'), '-f', 'extree', '-k', sock,
            '--shared=16', '--persistent', extree]),
        'file': Server('file', sock, [
            'nbdkit', '-f', '-U', sock, 'file', 'file=' + raw]),
    }


def build_images(d, scale):
    s1 = os.path.join(d, 'S1.extree')
    s1raw = os.path.join(d, 'S1.raw')
    if not os.path.exists(s1raw):
        script = run([sys.executable, os.path.join(TOP, 'scripts',
                                                   'bench-images.py'),
                      'script', 'S1', '--scale', scale],
                     capture_output=True).stdout
        info = json.loads(run([sys.executable,
                               os.path.join(TOP, 'scripts',
                                            'bench-images.py'),
                               'info', 'S1', '--scale', scale],
                              capture_output=True).stdout)
        run([os.path.join(QEMU, 'qemu-img'), 'create', '-q', '-f', 'extree',
             s1, str(info['virtual_size'])])
        run([os.path.join(QEMU, 'qemu-io'), '-f', 'extree', s1],
            input=script, stdout=subprocess.DEVNULL)
        run([os.path.join(QEMU, 'qemu-img'), 'convert', '-f', 'extree',
             '-O', 'raw', s1, s1raw + '.tmp'])
        os.rename(s1raw + '.tmp', s1raw)
    full = os.path.join(d, 'full.extree')
    fullraw = os.path.join(d, 'full.raw')
    if not os.path.exists(full):
        run(['dd', 'if=/dev/urandom', 'of=' + fullraw, 'bs=1M', 'count=1024',
             'status=none'])
        run([os.path.join(QEMU, 'qemu-img'), 'convert', '-f', 'raw', '-O',
             'extree', fullraw, full + '.tmp'])
        os.rename(full + '.tmp', full)
    return s1, s1raw, full, fullraw


def bench_map(srv):
    with srv:
        before = cpu_seconds(srv.proc.pid)
        t0 = time.monotonic()
        run(['nbdinfo', '--map', srv.uri], stdout=subprocess.DEVNULL)
        wall = time.monotonic() - t0
        cpu = cpu_seconds(srv.proc.pid) - before
    return {'cpu': cpu, 'wall': wall}


def bench_fio(srv, rw, seconds):
    with srv:
        out = subprocess.run(['fio', '--name=b', '--ioengine=nbd', '--uri=' + srv.uri,
                   '--rw=' + rw, '--bs=4k', '--iodepth=16', '--size=1G',
                   '--time_based', '--runtime=%d' % seconds,
                   '--ramp_time=1', '--output-format=json'],
                  capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError('fio against %s failed: %s' % (srv.name, out.stderr))
    out = out.stdout
    # the nbd engine prints "fio: connected to NBD server" first
    job = json.loads(out[out.index('{'):])['jobs'][0]
    side = 'read' if rw == 'randread' else 'write'
    return {'iops': job[side]['iops']}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--runs', type=int, default=5)
    ap.add_argument('--seconds', type=int, default=10)
    ap.add_argument('--scale', default='full')
    ap.add_argument('--dir', default=os.path.join(TOP, 'build',
                                                  'bench-nbdkit'))
    a = ap.parse_args()
    if not os.path.exists(PLUGIN):
        sys.exit('bench-nbdkit: %s is not built' % PLUGIN)
    os.makedirs(a.dir, exist_ok=True)
    s1, s1raw, full, fullraw = build_images(a.dir, a.scale)

    res = {}
    names = ('plugin', 'qemu-nbd', 'file')
    for r in range(a.runs):
        order = names if r % 2 == 0 else names[::-1]
        for n in order:
            res.setdefault(('map', n), []).append(
                bench_map(servers(a.dir, s1, s1raw, 'map')[n]))
        for rw in ('randread', 'randwrite'):
            for n in order:
                res.setdefault((rw, n), []).append(
                    bench_fio(servers(a.dir, full, fullraw, rw)[n], rw,
                              a.seconds))
        print('round %d of %d done' % (r + 1, a.runs), file=sys.stderr)

    def med(key, field):
        return statistics.median(x[field] for x in res[key])

    print('%-10s %16s %16s %14s %14s' % ('server', 'map CPU (s)',
                                        'map wall (s)', 'randread IOPS',
                                        'randwrite IOPS'))
    table = {}
    for n in names:
        row = {
            'map_cpu': med(('map', n), 'cpu'),
            'map_wall': med(('map', n), 'wall'),
            'randread_iops': med(('randread', n), 'iops'),
            'randwrite_iops': med(('randwrite', n), 'iops'),
        }
        table[n] = row
        print('%-10s %16.3f %16.3f %14.0f %14.0f' % (
            n, row['map_cpu'], row['map_wall'], row['randread_iops'],
            row['randwrite_iops']))
    with open(os.path.join(a.dir, 'results.json'), 'w') as f:
        json.dump({'runs': a.runs, 'seconds': a.seconds, 'scale': a.scale,
                   'medians': table,
                   'all': {'%s/%s' % k: v for k, v in res.items()}}, f,
                  indent=1)


if __name__ == '__main__':
    main()

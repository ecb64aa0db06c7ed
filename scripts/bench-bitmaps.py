#!/usr/bin/python3
"""Persistent dirty bitmaps: extree against qcow2 with 64 KiB and 4 KiB
clusters (issue 32, point 5).  Python 3 stdlib only; uses fio (its nbd
engine) and nbdinfo.

Layout S2 of scripts/bench-images.py: 64 GiB virtual, 4 KiB of data every
64 KiB (1,048,576 extents at full scale; --scale divides the size).  The
data is written once into a sparse raw file and each format's base image
is made from it with qemu-img convert; the bases are kept in --dir and
reused by later runs while qemu-img check passes (--rebuild makes them
anew).  qcow2 with 64 KiB clusters allocates a whole cluster for each
4 KiB extent (qemu fills the rest with fallocate(ZERO_RANGE): 64 GiB of
host space at full scale), so its base is converted in eighths and the
unwritten host extents are punched out after each one: the image is the
same, its host space is what its data takes.

Then, one format after the other, two copies of the base:

  W   8 bitmaps b0..b7 added (qemu-img bitmap --add -g GRAN, enabled,
      empty), then "1% of the image changed": one qemu-io (-t writeback)
      writing 4 KiB at each of 1% of the disk's 4 KiB blocks (167,772 at
      full scale), distinct, uniformly random, in ascending order, the
      same offsets for every format
  N   the same writes without bitmaps

and the measures, each a whole command, --runs rounds (open 3 times as
many, map twice: they are short), what is compared alternating (the order
reversed every other round), medians:

  space  (d) host space and file length of W against N, and the bytes of
         the 8 bitmaps' own structures read from W's metadata: extree's
         directory and chunks, qcow2's directory, bitmap tables and data
         clusters
  open   (a) b4..b7 removed from W (4 bitmaps left); qemu-img info and
         qemu-io -c quit (a read-write open and close) on W against N
  write  (c) fio, nbd engine, against qemu-storage-daemon exporting N
         (file cache.direct=on, aio=native): 4 KiB random writes at depth
         16.  "sparse": --write-ios writes at 64 KiB-aligned offsets of
         the whole disk, S2's data blocks, so every write overwrites an
         allocated block and is the first to its granule; "dense": every
         4 KiB block of guest [0, --dense-mib) once, in random order, the
         range written in full beforehand.  With one enabled bitmap added
         by qemu-img bitmap --add just before the run (freshly cleared)
         and removed after it, against none; end_fsync=1, so the commit
         of the marks is inside the run.  "flush": as sparse, a fifth of
         the writes, a flush after every 16 (fio --fsync=16).  "sync-d1",
         "sync-d16": the database case, a new empty 4 GiB image each run,
         --write-ios / 25 random 4 KiB writes each followed by a flush
         (fio --fsync=1) at depth 1 and 16.  IOPS = writes / fio's
         runtime; "-meta": the bytes the server wrote besides the data
         (its ru_oublock from wait4, its close included), per data byte.
  map    (b) qemu-nbd -r -f FMT -B b0 --persistent W (4 bitmaps), then
         one nbdinfo --map=qemu:dirty-bitmap:b0: the server's user+sys
         CPU time across that call (its threads' /proc/.../schedstat) and
         of the whole server process (open, the map, exit; wait4), and 4
         more maps.  The map is checked against the granules the writes
         touched.  The formats alternate: every W is kept until the end
         (about 5 GiB each at full scale) when the space allows, else
         each format is measured before the next one's W is made.

The binaries are copied first (a rebuild during the run must not change
them).  Results: a CSV (--out; default docs/performance/<scale>/
bitmaps.csv) and the medians printed as a table.

    scripts/bench-bitmaps.py [--scale full|quick|1/N] [--runs N]
        [--formats extree,qcow2-64k,qcow2-4k] [--measures space,map,open,write]
        [--granularity BYTES] [--write-ios N] [--dense-mib N]
        [--dir DIR] [--out FILE] [--qemu BUILDDIR] [--rebuild] [--keep]
"""

import argparse
import csv
import ctypes
import ctypes.util
import importlib.util
import json
import os
import random
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import time

TOP = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location(
    "bench_images", os.path.join(TOP, "scripts", "bench-images.py"))
images = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(images)

FORMATS = images.FORMATS
BIN = {"qemu-img": "qemu-img", "qemu-io": "qemu-io", "qemu-nbd": "qemu-nbd",
       "qsd": os.path.join("storage-daemon", "qemu-storage-daemon")}
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
CHANGE_BYTE = 252           # S2's data bytes are 1..251 (bench-images.py)


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Failed(Exception):
    pass


def run(argv, stdin=None, timeout=3600):
    """Run @argv to its end: (wall s, its output); raises Failed on a
    non-zero exit"""
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, stdin=subprocess.PIPE if stdin else
                         subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    out, _ = p.communicate(stdin, timeout=timeout)
    dt = time.perf_counter() - t0
    if p.returncode != 0:
        raise Failed(f"{' '.join(argv)}: exit {p.returncode}: "
                     f"{out.strip()[-600:]}")
    return dt, out


def run_cpu(argv, timeout=3600):
    """(wall s, user+sys s) of one command, its output thrown away"""
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, ru = os.wait4(p.pid, 0)
    dt = time.perf_counter() - t0
    err = p.stderr.read().decode(errors="replace")
    p.stderr.close()
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0 or err.strip():
        raise Failed(f"{' '.join(argv)}: exit {p.returncode}: "
                     f"{err.strip()[-600:]}")
    return dt, ru.ru_utime + ru.ru_stime


def host_bytes(path):
    return os.stat(path).st_blocks * 512


# --- images -----------------------------------------------------------

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64,
                            ctypes.c_int64]
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 1, 2


def punch_unwritten(path, start):
    """Punch the holes SEEK_HOLE reports from @start on: the file systems
    (ext4, XFS) report unwritten extents as holes, and those are what
    fallocate(ZERO_RANGE) left.  Returns the bytes of the holes (those
    that were holes already included)."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.fsync(fd)
        size = os.fstat(fd).st_size
        pos, total = start, 0
        while pos < size:
            hole = os.lseek(fd, pos, os.SEEK_HOLE)
            if hole >= size:
                break
            try:
                data = os.lseek(fd, hole, os.SEEK_DATA)
            except OSError:
                data = size
            if _libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                               hole, data - hole) != 0:
                e = ctypes.get_errno()
                raise OSError(e, f"fallocate(PUNCH_HOLE) on {path}")
            total += data - hole
            pos = data
        return total
    finally:
        os.close(fd)


def write_raw(path, lay):
    """The layout's data in a sparse raw file, S2's bytes per offset"""
    with open(path, "wb") as f:
        f.truncate(lay.vsize)
        for off, n in sorted(lay.writes):
            f.seek(off)
            f.write(bytes([images.pattern(off)]) * n)


def base_ok(b, fmt, img, lay):
    if not os.path.exists(img) or not os.path.exists(img + ".stamp"):
        return False
    try:
        stamp = json.load(open(img + ".stamp"))
        _, out = run([b["qemu-img"], "info", "--output=json", "-f",
                      FORMATS[fmt][0], img])
        if json.loads(out)["virtual-size"] != lay.vsize or \
                stamp.get("layout") != lay.desc:
            return False
        run([b["qemu-img"], "check", "-q", "-f", FORMATS[fmt][0], img])
    except (Failed, ValueError, KeyError):
        return False
    return not json.loads(out).get("format-specific", {}).get(
        "data", {}).get("bitmaps")


def build_base(b, fmt, img, lay, raw):
    fm, opts = FORMATS[fmt]
    for p in (img, img + ".stamp"):
        if os.path.exists(p):
            os.unlink(p)
    if not os.path.exists(raw):
        log(f"writing {raw} ({lay.data_bytes >> 20} MiB of data)")
        write_raw(raw, lay)
    t0 = time.perf_counter()
    if fmt != "qcow2-64k":
        run([b["qemu-img"], "convert", "-f", "raw", "-O", fm] + opts +
            [raw, img])
    else:
        run([b["qemu-img"], "create", "-q", "-f", fm] + opts +
            [img, str(lay.vsize)])
        part = lay.vsize // 8
        punched = 0
        for k in range(8):
            start = os.stat(img).st_size
            src = (f"driver=raw,offset={k * part},size={part},"
                   f"file.driver=file,file.filename={raw}")
            dst = (f"driver=raw,offset={k * part},size={part},"
                   f"file.driver=qcow2,file.file.driver=file,"
                   f"file.file.filename={img}")
            run([b["qemu-img"], "convert", "-n", "--target-is-zero",
                 "--image-opts", src, "--target-image-opts", dst])
            punched += punch_unwritten(img, max(0, start - 2 * MiB))
        log(f"{fmt}: punched {punched >> 20} MiB of unwritten extents")
    run([b["qemu-img"], "check", "-q", "-f", fm, img])
    with open(img + ".stamp", "w") as f:
        json.dump({"layout": lay.desc, "built": time.strftime("%F %T")}, f)
    log(f"{fmt}: base built in {time.perf_counter() - t0:.1f} s, "
        f"{host_bytes(img) >> 20} MiB host")


def copy(src, dst):
    subprocess.run(["cp", "--sparse=always", src, dst], check=True)


def change_offsets(lay):
    """1% of the disk's 4 KiB blocks, distinct, uniformly random"""
    nblocks = lay.vsize // (4 * KiB)
    rng = random.Random(32)
    return sorted(b * 4 * KiB for b in rng.sample(range(nblocks),
                                                  nblocks // 100))


def qemu_io_script(b, fmt, img, script):
    """One qemu-io running @script, cache=writeback (qemu-io's default,
    writethrough, makes every write a commit for extree)"""
    wall, out = run([b["qemu-io"], "-t", "writeback", "-f", FORMATS[fmt][0],
                     img], stdin=script)
    low = out.lower()
    if "fail" in low or "error" in low:
        raise Failed(f"qemu-io {img}: {out.strip()[-400:]}")
    return wall


def bitmap_cmd(b, fmt, img, op, name, gran=None, opts=""):
    """qemu-img bitmap; @opts: driver options (extree's mark-log=off)"""
    if opts:
        argv = [b["qemu-img"], "bitmap", "--image-opts", op]
        target = f"driver={FORMATS[fmt][0]},{opts},file.filename={img}"
    else:
        argv = [b["qemu-img"], "bitmap", "-f", FORMATS[fmt][0], op]
        target = img
    if gran:
        argv += ["-g", str(gran)]
    run(argv + [target, name])


def check_image(b, fmt, img):
    _, out = run([b["qemu-img"], "check", "-f", FORMATS[fmt][0], img])
    return " ".join(out.split())[:200]


# --- bitmap structures as stored --------------------------------------

def extree_bitmap_bytes(path):
    """Bytes of the directory and chunks of every bitmap of an extree image
    (docs/interop/extree.rst, Persistent dirty bitmaps)"""
    with open(path, "rb") as f:
        best = None
        for slot in (0, 4096):
            f.seek(slot)
            sb = f.read(4096)
            if sb[:8] != b"EXTREE\r\n":
                continue
            gen = struct.unpack_from("<Q", sb, 24)[0]
            if best is None or gen > best[0]:
                best = (gen, sb)
        sb = best[1]
        bsz = struct.unpack_from("<I", sb, 64)[0]
        doff, dlen, count = struct.unpack_from("<QII", sb, 240)
        res = {"count": count, "dir": 0, "tables": 0, "data": 0}
        if not count:
            return res
        res["dir"] = -(-dlen // bsz) * bsz
        f.seek(doff)
        d = f.read(dlen)
        pos, chunks = 64, 0
        for _ in range(count):
            name_len = struct.unpack_from("<H", d, pos)[0]
            nr = struct.unpack_from("<I", d, pos + 16)[0]
            pos += 24 + -(-name_len // 8) * 8
            for c in range(nr):
                if struct.unpack_from("<Q", d, pos + 16 * c)[0]:
                    chunks += 1
            pos += 16 * nr
        res["data"] = chunks * bsz
        return res


def qcow2_bitmap_bytes(path):
    """Bytes of the bitmap directory, bitmap tables and data clusters of a
    qcow2 image (docs/interop/qcow2.txt, Bitmaps extension)"""
    with open(path, "rb") as f:
        h = f.read(4096)
        csize = 1 << struct.unpack_from(">I", h, 20)[0]
        pos = struct.unpack_from(">I", h, 100)[0]
        res = {"count": 0, "dir": 0, "tables": 0, "data": 0}
        while True:
            etype, elen = struct.unpack_from(">II", h, pos)
            if etype == 0:
                return res
            if etype == 0x23852875:
                break
            pos += 8 + -(-elen // 8) * 8
        nb, _, dsize, doff = struct.unpack_from(">IIQQ", h, pos + 8)
        res["count"] = nb
        res["dir"] = -(-dsize // csize) * csize
        f.seek(doff)
        d = f.read(dsize)
        p = 0
        for _ in range(nb):
            toff, tsize, _, _, _, nsize, esize = struct.unpack_from(
                ">QIIBBHI", d, p)
            p += -(-(24 + esize + nsize) // 8) * 8
            res["tables"] += -(-(tsize * 8) // csize) * csize
            f.seek(toff)
            t = f.read(tsize * 8)
            for i in range(tsize):
                e = struct.unpack_from(">Q", t, 8 * i)[0]
                if e & 0x00fffffffffffe00:
                    res["data"] += csize
        return res


def bitmap_bytes(fmt, path):
    return (extree_bitmap_bytes if fmt == "extree" else
            qcow2_bitmap_bytes)(path)


# --- servers ----------------------------------------------------------

def wait_socket(path, proc, timeout=120):
    t_end = time.time() + timeout
    while time.time() < t_end:
        if proc.poll() is not None:
            raise Failed(f"server exited with {proc.returncode} before "
                         f"listening on {path}")
        if os.path.exists(path):
            s = socket.socket(socket.AF_UNIX)
            try:
                s.connect(path)
                return
            except OSError:
                pass
            finally:
                s.close()
        time.sleep(0.01)
    raise Failed(f"no server on {path} after {timeout} s")


def proc_cpu(pid):
    """Seconds process @pid has run on a CPU so far, user and system, the
    sum over its threads of /proc/PID/task/TID/schedstat (nanoseconds;
    /proc/PID/stat counts clock ticks, too coarse for one map)"""
    ns = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                ns += int(f.read().split()[0])
        except FileNotFoundError:
            pass                            # a thread that just ended
    return ns / 1e9


def rm_f(path):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def finish(proc, sock, written=None):
    """SIGTERM to a server, then its user+sys seconds (wait4) and what it
    printed on stderr; @written (a list): gets the bytes the server wrote
    to storage, its whole life (ru_oublock, 512-byte units of the kernel's
    write_bytes accounting, O_DIRECT writes included)"""
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
        _, status, ru = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        cpu = ru.ru_utime + ru.ru_stime
        if written is not None:
            written.append(ru.ru_oublock * 512)
    else:
        cpu = 0.0                           # reaped by poll(): it failed
    err = proc.stderr.read().decode(errors="replace").strip()
    proc.stderr.close()
    rm_f(sock)
    if proc.returncode not in (0, -signal.SIGTERM) or err:
        raise Failed(f"{proc.args[0]} exit {proc.returncode}: {err[-400:]}")
    return cpu


def server_failed(proc, sock, e):
    """@e happened while @proc served: stop it, raise with its stderr"""
    try:
        finish(proc, sock)
    except Failed as f:
        raise Failed(f"{e}; {f}") from None
    raise Failed(str(e)) from None


def dirty_ranges(gran, offsets):
    """Merged [start, end) of the granules @offsets touch (4 KiB writes)"""
    out = []
    for g in sorted({o // gran for o in offsets} |
                    {(o + 4 * KiB - 1) // gran for o in offsets}):
        if out and out[-1][1] == g * gran:
            out[-1][1] += gran
        else:
            out.append([g * gran, (g + 1) * gran])
    return [tuple(r) for r in out]


def map_ranges(text):
    out = []
    for line in text.splitlines():
        f = line.split()
        if len(f) < 3 or f[2] != "1":
            continue
        s, n = int(f[0]), int(f[1])
        if out and out[-1][1] == s:
            out[-1][1] += n
        else:
            out.append([s, s + n])
    return [tuple(r) for r in out]


def nbdinfo_map(sock, out_path):
    with open(out_path, "w") as o:
        r = subprocess.run(["nbdinfo", "--map=qemu:dirty-bitmap:b0",
                            f"nbd+unix:///?socket={sock}"], stdout=o,
                           stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        raise Failed(f"nbdinfo --map: {r.stderr.strip()}")


def map_once(b, a, fmt, img, expect, more=4):
    """One qemu-nbd serving W, one nbdinfo --map of b0, then @more: (server
    CPU across the first map, server CPU of the whole process, client
    wall of the first map, mean server CPU of the @more later ones)"""
    sock = os.path.join(a.dir, "map.sock")
    rm_f(sock)
    out_path = os.path.join(a.dir, f"map.{fmt}.txt")
    p = subprocess.Popen([b["qemu-nbd"], "-r", "--persistent", "-f",
                          FORMATS[fmt][0], "-B", "b0", "--socket", sock, img],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_socket(sock, p)
        c0 = proc_cpu(p.pid)
        t0 = time.perf_counter()
        nbdinfo_map(sock, out_path)
        wall = time.perf_counter() - t0
        c1 = proc_cpu(p.pid)
        got = map_ranges(open(out_path).read())
        for _ in range(more):
            nbdinfo_map(sock, os.devnull)
        c2 = proc_cpu(p.pid)
    except (Failed, OSError, ValueError) as e:
        server_failed(p, sock, e)
    total = finish(p, sock)
    if got != expect:
        raise Failed(f"{fmt}: nbdinfo --map=qemu:dirty-bitmap:b0 lists "
                     f"{len(got)} dirty ranges "
                     f"({sum(e - s for s, e in got)} bytes), the writes "
                     f"touched {len(expect)} "
                     f"({sum(e - s for s, e in expect)} bytes); "
                     f"output kept in {out_path}")
    os.unlink(out_path)
    return c1 - c0, total, wall, (c2 - c1) / more


def fio_once(b, a, fmt, img, job, seed, opts=""):
    """One qemu-storage-daemon exporting @img and one fio run: (IOPS,
    writes, server CPU s, flushes); @opts: driver options"""
    sock = os.path.join(a.dir, "qsd.sock")
    rm_f(sock)
    p = subprocess.Popen(
        [b["qsd"], "--blockdev",
         f"driver=file,node-name=file,filename={img},cache.direct=on,"
         "aio=native",
         "--blockdev", f"driver={FORMATS[fmt][0]},node-name=fmt,file=file"
         + (f",{opts}" if opts else ""),
         "--nbd-server", f"addr.type=unix,addr.path={sock}",
         "--export", "type=nbd,id=exp,node-name=fmt,name=fmt,writable=on"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_socket(sock, p)
        r = subprocess.run(
            ["fio", "--name=bitmaps", "--ioengine=nbd",
             f"--uri=nbd+unix:///fmt?socket={sock}", "--rw=randwrite",
             "--bs=4k", "--iodepth=16", "--end_fsync=1", "--randrepeat=0",
             f"--randseed={seed}", "--output-format=json"] + job,
            capture_output=True, text=True, timeout=1800)
        if r.returncode != 0:
            raise Failed(f"fio against {img}: "
                         f"{(r.stdout + r.stderr)[-600:]}")
    except (Failed, OSError, subprocess.TimeoutExpired) as e:
        server_failed(p, sock, e)
    written = []
    cpu = finish(p, sock, written)
    out = r.stdout
    j = json.loads(out[out.index("{"):])["jobs"][0]
    ios, rt = j["write"]["total_ios"], j["job_runtime"] / 1000
    if j["error"] or not ios:
        raise Failed(f"fio against {img}: error {j['error']}, {ios} writes")
    # what the server wrote besides the data: metadata, records, bitmaps
    meta = max(written[0] - ios * 4 * KiB, 0) / (ios * 4 * KiB)
    return ios / rt, ios, cpu, j.get("sync", {}).get("total_ios", 0), meta


# --- measures ---------------------------------------------------------

class Results:
    def __init__(self):
        self.rows = []

    def add(self, measure, fmt, variant, unit, vals, cpu=None, note=""):
        row = {"measure": measure, "format": fmt, "variant": variant,
               "unit": unit, "n": len(vals), "median": "", "min": "",
               "max": "", "cpu_s_median": "", "note": note}
        if vals:
            fmtv = "{:.0f}" if unit in ("bytes", "IOPS") else "{:.4f}"
            row.update(median=fmtv.format(statistics.median(vals)),
                       min=fmtv.format(min(vals)), max=fmtv.format(max(vals)))
        if cpu:
            row["cpu_s_median"] = f"{statistics.median(cpu):.4f}"
        self.rows.append(row)
        if vals:
            log(f"  {measure} {fmt} {variant}: median {row['median']} {unit}"
                f" (min {row['min']}, max {row['max']}, n {len(vals)})"
                + (f", cpu {row['cpu_s_median']} s" if cpu else "")
                + (f"; {note}" if note else ""))
        else:
            log(f"  {measure} {fmt} {variant}: {note}")


def print_table(rows, fmts):
    """The medians, one line per measure and variant, one column per
    format"""
    keys, cell = [], {}
    for r in rows:
        k = (r["measure"], r["variant"], r["unit"])
        if r["n"] and k not in keys:
            keys.append(k)
        cell[(k, r["format"])] = r["median"]
    w = max([len(f"{m} {v} ({u})") for m, v, u in keys] + [10])
    print(f"{'':<{w}}  " + "  ".join(f"{f:>12}" for f in fmts))
    for k in keys:
        print(f"{k[0] + ' ' + k[1] + ' (' + k[2] + ')':<{w}}  " +
              "  ".join(f"{cell.get((k, f), '-'):>12}" for f in fmts))


def alternate(runs, variants, fn):
    """fn(variant) --runs times each, the order reversed every other
    round: {variant: [result, ...]}"""
    res = {v: [] for v in variants}
    for rep in range(runs):
        for v in (variants if rep % 2 == 0 else variants[::-1]):
            res[v].append(fn(v))
    return res


def ratios(num, den):
    return [x / y for x, y in zip(num, den)]


def measure_space(a, fmt, w, n, res):
    bm = bitmap_bytes(fmt, w)
    tot = bm["dir"] + bm["tables"] + bm["data"]
    res.add("space", fmt, "bitmap-structures", "bytes", [tot],
            note=f"{bm['count']} bitmaps: directory {bm['dir']}, tables "
                 f"{bm['tables']}, data {bm['data']}")
    for label, p in (("with-8", w), ("without", n)):
        res.add("space", fmt, f"host-{label}", "bytes", [host_bytes(p)])
        res.add("space", fmt, f"file-{label}", "bytes",
                [os.stat(p).st_size])
    res.add("space", fmt, "host-difference", "bytes",
            [host_bytes(w) - host_bytes(n)],
            note="host space of W (8 bitmaps) minus N (none), same writes")


def measure_map(b, a, ws, expect, res):
    """(b) on the W images of @ws {format: path}, the formats alternating
    (the order reversed every other round)"""
    for fmt, w in ws.items():
        map_once(b, a, fmt, w, expect)      # warm-up (and the check)
    r = alternate(2 * a.runs, list(ws),
                  lambda fmt: map_once(b, a, fmt, ws[fmt], expect))
    for fmt, vals in r.items():
        res.add("map", fmt, "server-cpu-map", "s", [v[0] for v in vals],
                note="qemu-nbd on-CPU time (user+sys, its threads' "
                     "schedstat) across one nbdinfo --map")
        res.add("map", fmt, "server-cpu-process", "s", [v[1] for v in vals],
                note=f"qemu-nbd user+sys, whole process: open "
                     f"({a.map_bitmaps} bitmaps), the map, exit")
        res.add("map", fmt, "client-wall", "s", [v[2] for v in vals])
        res.add("map", fmt, "server-cpu-later-maps", "s",
                [v[3] for v in vals],
                note="the mean of 4 more maps by the same server")


def measure_open(b, a, fmt, w, n, res):
    fm = FORMATS[fmt][0]
    imgs = {"with-4": w, "without": n}
    cmds = {"info": lambda p: [b["qemu-img"], "info", "-f", fm, p],
            "rw-open": lambda p: [b["qemu-io"], "-f", fm, "-c", "quit", p]}
    for cname, cmd in cmds.items():
        for p in imgs.values():
            run_cpu(cmd(p))                 # warm-up
        r = alternate(3 * a.runs, list(imgs),
                      lambda v: run_cpu(cmd(imgs[v])))
        for v in imgs:
            res.add(f"open-{cname}", fmt, v, "s", [x[0] for x in r[v]],
                    cpu=[x[1] for x in r[v]])
        res.add(f"open-{cname}", fmt, "ratio", "x",
                ratios([x[0] for x in r["with-4"]],
                       [x[0] for x in r["without"]]),
                note="with 4 bitmaps / without, wall, round by round")


def measure_write(b, a, fmt, n, lay, res):
    gran = a.granularity
    sparse = [f"--size={lay.vsize}", f"--blockalign={64 * KiB}"]
    # io_size, not number_ios: fio counts flushes into number_ios
    jobs = {"sparse": sparse + [f"--io_size={a.write_ios * 4 * KiB}"],
            "dense": [f"--size={a.dense_mib * MiB}"],
            "flush": sparse + [f"--io_size={a.write_ios // 5 * 4 * KiB}",
                               "--fsync=16"]}
    # the dense range allocated in full (S2 has 4 KiB of every 64 KiB)
    qemu_io_script(b, fmt, n, f"write -q -P 51 0 {a.dense_mib * MiB}\n")
    os.sync()
    seeds = iter(range(1000, 2000))
    # extree also without its mark log (mark-log=off: the writes a record
    # would let go in place move to new space, as before the log)
    variants = ["bitmap", "none"] + (["nolog"] if fmt == "extree" else [])
    opts = {"nolog": "mark-log=off"}
    for jname, job in jobs.items():
        r = {v: [] for v in variants}
        for rep in range(a.runs):
            # the same offsets in each variant, other ones every round;
            # the variants' order turned every round
            seed = next(seeds)
            k = rep % len(variants)
            for v in variants[k:] + variants[:k]:
                if v != "none":
                    bitmap_cmd(b, fmt, n, "--add", "c", gran,
                               opts.get(v, ""))
                r[v].append(fio_once(b, a, fmt, n, job, seed,
                                     opts.get(v, "")))
                if v != "none":
                    bitmap_cmd(b, fmt, n, "--remove", "c", None,
                               opts.get(v, ""))
        for v in variants:
            note = f"{r[v][0][1]} writes a run"
            if jname == "flush":
                note += (f", about {statistics.median(x[3] for x in r[v]):.0f}"
                         " flushes (fio issues more than one per 16)")
            res.add(f"write-{jname}", fmt, v, "IOPS", [x[0] for x in r[v]],
                    cpu=[x[2] for x in r[v]],
                    note=note + "; cpu: the server's")
            res.add(f"write-{jname}", fmt, v + "-meta", "B/B",
                    [x[4] for x in r[v]],
                    note="bytes the server wrote besides the data, per "
                         "data byte (ru_oublock, the close included)")
        res.add(f"write-{jname}", fmt, "ratio", "x",
                ratios([x[0] for x in r["bitmap"]],
                       [x[0] for x in r["none"]]),
                note="IOPS with one enabled bitmap / none, round by round")
        if "nolog" in r:
            res.add(f"write-{jname}", fmt, "log-ratio", "x",
                    ratios([x[0] for x in r["bitmap"]],
                           [x[0] for x in r["nolog"]]),
                    note="IOPS with the mark log / without, one enabled "
                         "bitmap, round by round")
    log(f"  {fmt}: check after the writes: {check_image(b, fmt, n)}")
    measure_sync(b, a, fmt, res)


def measure_sync(b, a, fmt, res):
    """The database case: a new empty image (4 GiB) each run, random 4 KiB
    writes each followed by a flush (fio --fsync=1) at depth 1 and 16,
    with one enabled bitmap and without"""
    e = os.path.join(a.dir, f"sync.{fmt}")
    n_ios = max(a.write_ios // 25, 200)
    variants = ["bitmap", "none"]
    seeds = iter(range(3000, 4000))
    for depth in (1, 16):
        jname = f"sync-d{depth}"
        job = [f"--size={4 * GiB}", f"--io_size={n_ios * 4 * KiB}",
               "--fsync=1", f"--iodepth={depth}"]
        r = {v: [] for v in variants}
        for rep in range(a.runs):
            seed = next(seeds)
            k = rep % len(variants)
            for v in variants[k:] + variants[:k]:
                rm_f(e)
                run([b["qemu-img"], "create", "-q", "-f", FORMATS[fmt][0]]
                    + FORMATS[fmt][1] + [e, str(4 * GiB)])
                if v != "none":
                    bitmap_cmd(b, fmt, e, "--add", "c", a.granularity)
                # the job's --iodepth comes after fio_once's 16
                r[v].append(fio_once(b, a, fmt, e, job, seed))
        for v in variants:
            res.add(jname, fmt, v, "IOPS", [x[0] for x in r[v]],
                    cpu=[x[2] for x in r[v]],
                    note=f"{r[v][0][1]} writes a run, a flush after each, "
                         f"depth {depth}, empty image; cpu: the server's")
            res.add(jname, fmt, v + "-meta", "B/B", [x[4] for x in r[v]],
                    note="bytes the server wrote besides the data, per "
                         "data byte (ru_oublock, the close included)")
    rm_f(e)


def private_binaries(qemu, d):
    os.makedirs(d, exist_ok=True)
    b = {}
    for k, rel in BIN.items():
        src = os.path.join(qemu, rel)
        dst = os.path.join(d, os.path.basename(rel))
        shutil.copy2(src, dst)
        b[k] = dst
    return b


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", default="full")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--formats", default="extree,qcow2-64k,qcow2-4k")
    ap.add_argument("--measures", default="space,map,open,write")
    ap.add_argument("--granularity", type=int, default=64 * KiB)
    ap.add_argument("--write-ios", type=int, default=None,
                    help="writes of a sparse write run (full: 50000)")
    ap.add_argument("--dense-mib", type=int, default=None,
                    help="the dense write range (full: 256 MiB)")
    ap.add_argument("--dir", default="/var/tmp/xt-bench/bitmaps")
    ap.add_argument("--out", default=None)
    ap.add_argument("--qemu", default=os.path.join(TOP, "build", "qemu"))
    ap.add_argument("--rebuild", action="store_true")
    ap.add_argument("--keep", action="store_true",
                    help="keep the raw source and the W and N copies")
    a = ap.parse_args()
    div = images.parse_scale(a.scale)
    sname = images.scale_name(div).replace("/", "-")
    a.write_ios = a.write_ios or max(500, 50000 // div)
    a.dense_mib = a.dense_mib or max(1, 256 // div)
    a.out = a.out or os.path.join(TOP, "docs", "performance", sname,
                                  "bitmaps.csv")
    fmts = a.formats.split(",")
    measures = set(a.measures.split(","))
    for f in fmts:
        if f not in FORMATS:
            sys.exit(f"bench-bitmaps: unknown format {f}")
    for tool in ("fio", "nbdinfo"):
        if not shutil.which(tool):
            sys.exit(f"bench-bitmaps: {tool} is missing (Debian: "
                     f"{'fio' if tool == 'fio' else 'libnbd-bin'})")
    os.makedirs(a.dir, exist_ok=True)
    a.dir = os.path.abspath(a.dir)
    b = private_binaries(a.qemu, os.path.join(a.dir, "bin"))
    lay = images.layout("S2", div)
    head = subprocess.run(["git", "-C", TOP, "log", "-1", "--format=%h %s"],
                          capture_output=True, text=True).stdout.strip()
    log(f"qemu binaries from {a.qemu} (built "
        f"{time.ctime(os.stat(os.path.join(a.qemu, 'qemu-img')).st_mtime)}"
        f"), checkout at {head or '?'}")
    log(f"S2: {lay.desc}; granularity {a.granularity}; runs {a.runs}")

    raw = os.path.join(a.dir, f"S2-{sname}.raw")
    bases = {}
    for fmt in fmts:
        img = os.path.join(a.dir, f"S2-{sname}.{fmt}")
        if a.rebuild or not base_ok(b, fmt, img, lay):
            build_base(b, fmt, img, lay, raw)
        else:
            log(f"{fmt}: reusing {img}")
        bases[fmt] = img
    if os.path.exists(raw) and not a.keep:
        os.unlink(raw)

    offs = change_offsets(lay)
    script = "".join(f"write -q -P {CHANGE_BYTE} {o} 4k\n" for o in offs)
    expect = dirty_ranges(a.granularity, offs)
    log(f"the change: {len(offs)} writes of 4 KiB, {len(expect)} dirty "
        f"ranges of {a.granularity}-byte granules, "
        f"{sum(e - s for s, e in expect)} bytes")
    res = Results()
    # the map measure alternates the formats when every W can be kept
    # until the end (with one N at a time); else each format's W is
    # measured before the next format's is made
    st = os.statvfs(a.dir)
    keep_w = "map" in measures and \
        1.25 * (sum(host_bytes(p) for p in bases.values()) +
                max(host_bytes(p) for p in bases.values())) + 2 * GiB < \
        st.f_bavail * st.f_frsize
    if "map" in measures and not keep_w:
        log("map: not enough space to keep every W until the end: each "
            "format measured in turn")
    ws = {}
    for fmt in fmts:
        log(f"{fmt}:")
        w = os.path.join(a.dir, f"W.{fmt}")
        n = os.path.join(a.dir, f"N.{fmt}")
        need = 2.3 * host_bytes(bases[fmt])
        st = os.statvfs(a.dir)
        if need > st.f_bavail * st.f_frsize:
            res.add("*", fmt, "*", "", [],
                    note=f"skipped: needs about {need / GiB:.1f} GiB free "
                         f"in {a.dir}")
            continue
        copy(bases[fmt], w)
        copy(bases[fmt], n)
        for i in range(8):
            bitmap_cmd(b, fmt, w, "--add", f"b{i}", a.granularity)
        tw = qemu_io_script(b, fmt, w, script)
        tn = qemu_io_script(b, fmt, n, script)
        res.add("change", fmt, "with-8", "s", [tw],
                note="one qemu-io, the 1% change (not alternated)")
        res.add("change", fmt, "without", "s", [tn])
        log(f"  check W: {check_image(b, fmt, w)}")
        log(f"  check N: {check_image(b, fmt, n)}")
        # gigabytes of dirty page cache from the copies and writes: their
        # writeback would run during the measures
        os.sync()
        if "space" in measures:
            measure_space(a, fmt, w, n, res)
        if "open" in measures or keep_w:
            for i in range(4, 8):
                bitmap_cmd(b, fmt, w, "--remove", f"b{i}")
        a.map_bitmaps = 4 if "open" in measures or keep_w else 8
        if "open" in measures:
            measure_open(b, a, fmt, w, n, res)
        if "map" in measures and not keep_w:
            measure_map(b, a, {fmt: w}, expect, res)
        if keep_w:
            ws[fmt] = w
        elif not a.keep:
            os.unlink(w)
        if "write" in measures:
            measure_write(b, a, fmt, n, lay, res)
        if not a.keep:
            os.unlink(n)
    if ws:
        log("map, the formats alternating:")
        measure_map(b, a, ws, expect, res)
        if not a.keep:
            for w in ws.values():
                os.unlink(w)

    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(res.rows[0]))
        wr.writeheader()
        wr.writerows(res.rows)
    log(f"results: {a.out}")
    print_table(res.rows, fmts)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Failed as e:
        sys.exit(f"bench-bitmaps: {e}")

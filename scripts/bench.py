#!/usr/bin/python3
"""The measuring half of `make bench` (issue 5); scripts/bench.sh mounts the
filesystems and calls this.  python3 stdlib only.

For each scenario: build one image per format with the same qemu-io write
script, record host space, then repeat --runs times, alternating the formats
inside each repetition: every measurement once cold (sync, drop_caches, the
QEMU binaries read back into the page cache, fresh process) and once warm
(immediately after, fresh process).  Random-write benchmarks come last, on the
images themselves, which are then deleted.  All formats use one snapshot of
build/qemu's qemu-img and qemu-io, copied at start.

Writes, under --results: runs.csv (every run), summary.csv (medians and
skips with their reason), images.csv, callgrind.csv, meta.json, logs/.
"""

import argparse
import csv
import datetime
import fcntl
import hashlib
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location(
    "bench_images", os.path.join(HERE, "bench-images.py"))
images = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(images)

KiB, MiB, GiB = images.KiB, images.MiB, images.GiB

ALL_FORMATS = ["extree", "qcow2-64k", "qcow2-4k",
               "raw-btrfs", "raw-xfs", "raw-ext4"]
CONTAINERS = {"extree": ("extree", []),
              "qcow2-64k": ("qcow2", ["-o", "cluster_size=65536"]),
              "qcow2-4k": ("qcow2", ["-o", "cluster_size=4096"])}
RAW_FS = {"raw-btrfs": "btrfs", "raw-xfs": "xfs", "raw-ext4": "ext4"}

READ_MEASURES = ["map", "map-stock", "nbdmap", "alloc", "open", "qmap",
                 "seekhole",
                 "convert-raw", "convert-null"]
# -cache8m: the same with the format's metadata cache at 8 MiB (extree
# cache-size, qcow2 cache-size), smaller than S2's tree: node reads at
# depth 32 must overlap for depth 32 to gain over depth 1 (issue 18)
SMALL_CACHE = "8M"
BENCH_MEASURES = ["bench-read-d1", "bench-read-d32",
                  "bench-read-d1-cache8m", "bench-read-d32-cache8m",
                  "bench-write-d1", "bench-write-d32"]
ALL_MEASURES = READ_MEASURES + BENCH_MEASURES + ["callgrind"]

# What each scenario measures by default (--measures narrows it).
SCENARIO_MEASURES = {
    "S1": ["map", "map-stock", "nbdmap", "alloc", "open", "qmap", "convert-raw", "convert-null",
           "callgrind"] + BENCH_MEASURES,
    "S2": ["map", "map-stock", "nbdmap", "alloc", "open", "qmap", "convert-raw",
           "convert-null"] + BENCH_MEASURES,
    "S3": ["map", "map-stock", "nbdmap", "alloc", "open", "qmap", "seekhole"],
    "S3L": ["map", "seekhole"],
    "S4": ["map", "map-stock", "nbdmap", "alloc", "open", "qmap", "convert-raw", "convert-null"],
    "SCALE": ["map"],
}

CALLGRIND_FUNCS = {"extree": "xt_co_block_status",
                   "qcow2-64k": "qcow2_co_block_status",
                   "qcow2-4k": "qcow2_co_block_status"}

RUN_FIELDS = ["scenario", "format", "host_fs", "measure", "cache", "rep",
              "value", "unit", "wall_s", "cpu_s", "rss_kib", "status", "note"]
SUMMARY_FIELDS = ["scenario", "format", "host_fs", "measure", "cache", "n",
                  "median", "min", "max", "unit", "cpu_s_median",
                  "rss_kib_median", "status", "note"]
IMAGE_FIELDS = ["scenario", "format", "host_fs", "virtual_size", "data_bytes",
                "guest_runs", "host_bytes", "host_extents", "map_entries",
                "map_data_bytes", "build_s", "check", "note"]
CG_FIELDS = ["scenario", "format", "function", "calls", "inclusive_ir",
             "ir_per_call", "total_ir", "map_entries", "total_ir_per_entry"]


def log(msg):
    print(f"bench: {msg}", flush=True)


def fmt_bytes(n):
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


# ---------------------------------------------------------------- processes

class Result:
    def __init__(self, rc, wall, cpu, rss, out, err):
        self.rc, self.wall, self.cpu, self.rss = rc, wall, cpu, rss
        self.out, self.err = out, err


def run(argv, stdin=None, stdout=None, timeout=None, env=None, rss=False):
    """Run argv as a fresh process; wall time from fork to reap, CPU time
    from wait4().  stdout: None to capture (small outputs only), or an open
    file / subprocess.DEVNULL.  rss: run it under /usr/bin/time -f %M for its
    peak RSS (wait4's own figure is useless here: the RSS high-water mark
    survives exec, so every child of this python would show python's)."""
    capture = stdout is None
    rssfile = os.path.join(ARGS.workdir, "rss.tmp")
    if rss:
        argv = [TIME, "-f", "%M", "-o", rssfile] + argv
    outf = open(os.devnull, "w") if stdout is subprocess.DEVNULL else stdout
    tmp_out = None
    if capture:
        tmp_out = open(os.path.join(ARGS.workdir, "out.tmp"), "w+")
        outf = tmp_out
    errf = open(os.path.join(ARGS.workdir, "err.tmp"), "w+")
    t0 = time.perf_counter()
    # its own process group, so that an interrupted run kills all of it
    p = subprocess.Popen(argv, stdin=stdin if stdin is not None
                         else subprocess.DEVNULL, stdout=outf, stderr=errf,
                         env=env or CHILD_ENV, start_new_session=True)

    def kill():
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except OSError:
            pass
    timer = None
    if timeout:
        timer = threading.Timer(timeout, kill)
        timer.daemon = True
        timer.start()
    try:
        _, status, ru = os.wait4(p.pid, 0)
    except BaseException:
        kill()
        os.waitpid(p.pid, 0)
        raise
    finally:
        if timer:
            timer.cancel()
    wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    out = ""
    if capture:
        tmp_out.seek(0)
        out = tmp_out.read()
        tmp_out.close()
    elif stdout is subprocess.DEVNULL:
        outf.close()
    errf.seek(0)
    err = errf.read()
    errf.close()
    peak = ""
    if rss:
        try:
            with open(rssfile) as f:
                peak = int(f.read().split()[-1])
        except (OSError, ValueError, IndexError):
            pass
    return Result(p.returncode, wall, ru.ru_utime + ru.ru_stime,
                  peak, out, err)


def check_call(argv, **kw):
    r = run(argv, **kw)
    if r.rc != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit {r.rc}: "
                           f"{r.err.strip()[-500:]}")
    return r


def drop_caches():
    """Cold: nothing of the image in the page cache, but the programs and
    their libraries are, so that cold measures the image, not exec."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")
    for path in PREWARM:
        try:
            with open(path, "rb") as f:
                while f.read(1 << 20):
                    pass
        except OSError:
            pass


def libraries(binary):
    try:
        out = subprocess.run(["ldd", binary], capture_output=True,
                             text=True).stdout
    except OSError:
        return []
    return re.findall(r"(/\S+\.so[^\s]*)", out)


# ---------------------------------------------------------------- host facts

FS_IOC_FIEMAP = 0xC020660B
FIEMAP_EXTENT_LAST = 0x1


def fiemap_extents(path):
    """Number of extents FIEMAP reports for path (what SEEK_DATA/SEEK_HOLE
    and the host filesystem's extent tree have to walk)."""
    count, start, batch = 0, 0, 1024
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return ""
    try:
        while True:
            hdr = struct.pack("=QQLLLL", start, (1 << 64) - 1 - start,
                              0, 0, batch, 0)
            buf = bytearray(hdr + bytes(56 * batch))
            try:
                fcntl.ioctl(fd, FS_IOC_FIEMAP, buf)
            except OSError:
                return ""
            mapped = struct.unpack_from("=L", buf, 20)[0]
            if mapped == 0:
                break
            count += mapped
            last = 32 + 56 * (mapped - 1)
            logical, _, length = struct.unpack_from("=QQQ", buf, last)
            flags = struct.unpack_from("=L", buf, last + 40)[0]
            if flags & FIEMAP_EXTENT_LAST:
                break
            start = logical + length
    finally:
        os.close(fd)
    return count


def free_bytes(path):
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


# ---------------------------------------------------------------- output

class Out:
    def __init__(self, resdir, now=None):
        """now: the (scenario, measure) pairs measured now; with it, the
        rows earlier runs left in resdir for other pairs are kept
        (--append).  Images of the scenarios measured now are rebuilt."""
        os.makedirs(os.path.join(resdir, "logs"), exist_ok=True)
        self.resdir = resdir
        self.files = {}
        self.runs = []
        self.skips = []    # (scenario, format, measure, reason)
        kept = {}
        if now is not None:
            scen = {sc for sc, _ in now}

            def stale(name, r):
                sc = r["scenario"]
                if name == "images":
                    return sc in scen
                if name == "callgrind":
                    return (sc, "callgrind") in now
                if name == "summary" and r["measure"] in ("*", "verify"):
                    return sc in scen
                return (sc, r["measure"]) in now

            for name in ("runs", "images", "callgrind", "summary"):
                path = os.path.join(resdir, f"{name}.csv")
                rows = []
                if os.path.exists(path):
                    with open(path, newline="") as f:
                        rows = [r for r in csv.DictReader(f)
                                if not stale(name, r)]
                kept[name] = rows
            self.runs = list(kept["runs"])
            self.skips = [(r["scenario"], r["format"], r["measure"],
                           r["note"]) for r in kept["summary"]
                          if r["status"] == "skipped"]
        for name, fields in (("runs", RUN_FIELDS), ("images", IMAGE_FIELDS),
                             ("callgrind", CG_FIELDS)):
            f = open(os.path.join(resdir, f"{name}.csv"), "w", newline="")
            w = csv.DictWriter(f, fieldnames=fields)
            w.writeheader()
            for r in kept.get(name, []):
                w.writerow({k: r.get(k, "") for k in fields})
            f.flush()
            self.files[name] = (f, w)

    def row(self, name, d):
        f, w = self.files[name]
        w.writerow(d)
        f.flush()
        if name == "runs":
            self.runs.append(d)

    def skip(self, scenario, fmt, measure, reason):
        log(f"{scenario} {fmt} {measure}: skipped: {reason}")
        self.skips.append((scenario, fmt, measure, reason))

    def summary(self):
        groups = {}
        for r in self.runs:
            key = (r["scenario"], r["format"], r["host_fs"], r["measure"],
                   r["cache"])
            groups.setdefault(key, []).append(r)
        rows = []
        for key, rs in groups.items():
            ok = [r for r in rs if r["status"] == "ok"]
            d = dict(zip(["scenario", "format", "host_fs", "measure",
                          "cache"], key))
            d["unit"] = rs[0]["unit"]
            d["n"] = len(ok)
            notes = sorted({r["note"] for r in rs if r["note"]})
            d["note"] = "; ".join(notes)[:300]
            if ok:
                vals = [float(r["value"]) for r in ok]
                d["median"] = f"{statistics.median(vals):.6g}"
                d["min"] = f"{min(vals):.6g}"
                d["max"] = f"{max(vals):.6g}"
                cpu = [float(r["cpu_s"]) for r in ok if r["cpu_s"] != ""]
                rss = [float(r["rss_kib"]) for r in ok if r["rss_kib"] != ""]
                d["cpu_s_median"] = f"{statistics.median(cpu):.6g}" \
                    if cpu else ""
                d["rss_kib_median"] = f"{statistics.median(rss):.0f}" \
                    if rss else ""
                d["status"] = "ok" if len(ok) == len(rs) else "partial"
            else:
                d["status"] = "failed"
            rows.append(d)
        for sc, fm, me, reason in self.skips:
            rows.append({"scenario": sc, "format": fm,
                         "host_fs": host_fs(fm, sc) if fm in ALL_FORMATS
                         else "", "measure": me, "cache": "", "n": 0,
                         "status": "skipped", "note": reason})
        with open(os.path.join(self.resdir, "summary.csv"), "w",
                  newline="") as f:
            w = csv.DictWriter(f, fieldnames=SUMMARY_FIELDS)
            w.writeheader()
            for d in rows:
                w.writerow(d)

    def close(self):
        for f, _ in self.files.values():
            f.close()


# ---------------------------------------------------------------- formats

def host_fs(fmt, scenario):
    if fmt in RAW_FS:
        if scenario == "S3L":
            return "btrfs-lzo"
        return RAW_FS[fmt]
    return ARGS.image_fs


def qemu_fmt(fmt):
    return CONTAINERS[fmt][0] if fmt in CONTAINERS else "raw"


def image_path(fmt, scenario):
    ext = qemu_fmt(fmt)
    return os.path.join(ARGS.mnt, host_fs(fmt, scenario),
                        f"{scenario}.{fmt}.{ext}")


def scenario_kind(name):
    return "SCALE" if name.startswith("SCALE-") else name


def measures_for(scenario):
    ms = SCENARIO_MEASURES[scenario_kind(scenario)]
    if ARGS.measures:
        ms = [m for m in ms if m in ARGS.measures]
    return ms


# ---------------------------------------------------------------- building

def qemu_io_errors(text):
    """qemu-io echoes a prompt per stdin line; anything else is an error."""
    rest = text.replace("qemu-io> ", "").strip()
    return rest[:500]


def build(lay, fmt, script):
    """Create and fill the image of fmt; return the image path or None."""
    sc = lay.name
    img = image_path(fmt, sc)
    fsdir = os.path.dirname(img)
    if os.path.exists(img):
        os.unlink(img)
    need = lay.estimate_host_bytes(fmt)
    cap = ARGS.max_image_gib * GiB
    if need > cap:
        OUT.skip(sc, fmt, "*",
                 f"needs about {fmt_bytes(need)} of host space for "
                 f"{fmt_bytes(lay.data_bytes)} of data "
                 f"(over the {ARGS.max_image_gib} GiB cap, --max-image-gib)")
        return None
    avail = min(free_bytes(fsdir), free_bytes(ARGS.dir) - ARGS.reserve)
    if need > avail:
        OUT.skip(sc, fmt, "*",
                 f"needs about {fmt_bytes(need)} of host space, "
                 f"{fmt_bytes(max(avail, 0))} free (after a "
                 f"{fmt_bytes(ARGS.reserve)} reserve)")
        return None
    logf = os.path.join(OUT.resdir, "logs", f"build-{sc}-{fmt}.log")
    t0 = time.perf_counter()
    if lay.tool == "xfs_io":
        # The 2022 btrfs patch's recipe, on the compress=lzo mount.
        (_, end1), (off2, n2) = lay.writes
        check_call([XFS_IO, "-f", "-c",
                    f"pwrite -S 0xab -b 1M 0 {lay.vsize}", img],
                   stdout=subprocess.DEVNULL)
        os.sync()
        check_call([XFS_IO, "-c", f"fpunch {end1} {off2 - end1}", img],
                   stdout=subprocess.DEVNULL)
    else:
        # raw: qemu-img create gives raw files on XFS a 1 MiB extent size
        # hint, which preallocates unwritten extents around every write;
        # extent_size_hint=0 keeps them sparse like on btrfs and ext4
        fm, opts = CONTAINERS.get(fmt, ("raw", ["-o", "extent_size_hint=0"]))
        check_call([QIMG, "create", "-q", "-f", fm] + opts +
                   [img, str(lay.vsize)])
        with open(script) as sin, open(logf, "w") as lout:
            r = run([QIO, "-t", ARGS.build_cache, "-f", fm, img],
                    stdin=sin, stdout=lout, timeout=ARGS.timeout)
        with open(logf) as lf:
            errs = qemu_io_errors(lf.read())
        if r.rc != 0 or errs:
            OUT.skip(sc, fmt, "*", f"building the image failed: qemu-io "
                     f"exit {r.rc}: {errs or r.err.strip()[-300:]}")
            return None
    os.sync()
    build_s = time.perf_counter() - t0
    st = os.stat(img)
    note = []
    check = ""
    if fmt in CONTAINERS:
        r = run([QIMG, "check", "-f", qemu_fmt(fmt), img])
        check = "ok" if r.rc == 0 else f"exit {r.rc}"
        if r.rc != 0:
            note.append("qemu-img check: " + (r.out + r.err).strip()
                        .replace("\n", " ")[-200:])
    # map entries and the data bytes map reports (untimed)
    entries, data = 0, 0
    p = subprocess.Popen([QIMG, "map", "--output=json", "-f", qemu_fmt(fmt),
                          img], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=CHILD_ENV)
    for line in p.stdout:
        if '"start"' in line:
            entries += 1
            if '"data": true' in line:
                m = re.search(r'"length": (\d+)', line)
                data += int(m.group(1))
    err = p.stderr.read()
    if p.wait() != 0:
        note.append(f"qemu-img map exit {p.returncode}: {err.strip()[-200:]}")
    OUT.row("images", {
        "scenario": sc, "format": fmt, "host_fs": host_fs(fmt, sc),
        "virtual_size": lay.vsize, "data_bytes": lay.data_bytes,
        "guest_runs": lay.guest_runs, "host_bytes": st.st_blocks * 512,
        "host_extents": fiemap_extents(img), "map_entries": entries,
        "map_data_bytes": data, "build_s": f"{build_s:.3f}",
        "check": check, "note": "; ".join(note)})
    log(f"{sc} {fmt}: built in {build_s:.1f} s, "
        f"{fmt_bytes(st.st_blocks * 512)} on {host_fs(fmt, sc)}, "
        f"{entries} map entries")
    return img


def verify(lay, imgs):
    """extree must hold the same data as the raw file on XFS."""
    if "extree" not in imgs or "raw-xfs" not in imgs:
        return
    r = run([QIMG, "compare", "-f", "extree", "-F", "raw",
             imgs["extree"], imgs["raw-xfs"]], timeout=ARGS.timeout)
    if r.rc != 0:
        msg = (r.out + r.err).strip().replace("\n", " ")[-300:]
        log(f"{lay.name}: WARNING: extree differs from raw-xfs: {msg}")
        OUT.skip(lay.name, "extree", "verify",
                 f"qemu-img compare against raw-xfs: exit {r.rc}: {msg}")


# ---------------------------------------------------------------- measures

def bench_step(vsize):
    """qemu-img bench goes offset += step modulo the image size: with step a
    prime number of 4 KiB blocks near 0.618 of the image (but at most
    INT_MAX bytes, qemu-img's limit), coprime with the number of blocks,
    successive requests land far apart and the walk covers every 4 KiB block
    before repeating (a Weyl sequence)."""
    pos = vsize // 4096
    p = max(3, min(int(pos * 0.6180339887), (2**31 - 1) // 4096 - 64))

    def prime(n):
        if n < 2:
            return False
        for d in range(2, int(math.isqrt(n)) + 1):
            if n % d == 0:
                return False
        return True
    while not (prime(p) and math.gcd(p, pos) == 1):
        p += 1
    return p * 4096, pos


def bench_kind(measure):
    """bench-<read|write>-d<depth>[-cache8m]: (rw, depth, small cache)"""
    parts = measure.split("-")
    return parts[1], int(parts[2][1:]), len(parts) > 3


def command(measure, fmt, img, lay, count=None, offset=0):
    """argv and a parser for the value (None: wall time is the value)."""
    qf = qemu_fmt(fmt)
    v = lay.vsize
    if measure == "map":
        return [QIMG, "map", "--output=json", "-f", qf, img]
    if measure == "map-stock":
        # qemu-img without patches/qemu/0004 (map's per-entry costs)
        return [QIMG_STOCK, "map", "--output=json", "-f", qf, img]
    if measure == "nbdmap":
        return [NBDINFO, "--map", NBD_URI]
    if measure == "alloc":
        return [QIO, "-r", "-f", qf, "-c", f"alloc 0 {v}", img]
    if measure == "open":
        return [QIO, "-r", "-f", qf, "-c", "quit", img]
    if measure == "qmap":
        return [QIO, "-r", "-f", qf, "-c", "map", img]
    if measure == "seekhole":
        return [XFS_IO, "-r", "-c", "seek -h 0", img]
    if measure == "convert-raw":
        return [QIMG, "convert", "-f", qf, "-O", "raw", img, CONVERT_TARGET]
    if measure == "convert-null":
        return [QIMG, "convert", "-f", qf, "-n", "--target-is-zero", img,
                "--target-image-opts", f"driver=null-co,size={v}"]
    if measure.startswith("bench-"):
        rw, depth, small = bench_kind(measure)
        step, _ = bench_step(v)
        argv = [QIMG, "bench", "-t", "none", "-i", "native",
                "-d", str(depth), "-c", str(count), "-s", "4096",
                "-S", str(step), "-o", str(offset)]
        if rw == "write":
            argv += ["-w", "--pattern", "165"]
        if small:
            return argv + ["--image-opts", f"driver={qf},file.filename="
                           f"{img},cache-size={SMALL_CACHE}"]
        return argv + ["-f", qf, img]
    raise ValueError(measure)


# qemu-img bench (qemu-img.c, bench_cb) passes the same buffer, qiov[0], to
# every request in flight.  btrfs verifies the checksum of an O_DIRECT read
# in the caller's buffer after the read, so at depth > 1 another read landing
# in that buffer makes it fail with EIO ("csum failed" in dmesg); the data
# on disk is fine.
BTRFS_DEPTH_READS = ("qemu-img bench reads every request in flight into one "
                     "buffer; btrfs checks O_DIRECT read checksums in that "
                     "buffer, so concurrent reads fail with EIO (csum "
                     "failed), a limit of the tool, not of the image")


def applicable(measure, fmt):
    if measure == "map-stock":
        return QIMG_STOCK is not None
    if measure == "nbdmap":
        return NBDINFO is not None
    if measure == "seekhole":
        return fmt in RAW_FS
    if measure == "callgrind":
        return fmt in CALLGRIND_FUNCS
    if measure.endswith("-cache8m"):
        return fmt in CONTAINERS        # raw has no metadata cache
    return True


def measure_once(measure, fmt, img, lay, cache, rep, count=None, offset=0):
    sc = lay.name
    if measure == "convert-raw" and os.path.exists(CONVERT_TARGET):
        os.unlink(CONVERT_TARGET)
    if cache == "cold":
        drop_caches()
    argv = command(measure, fmt, img, lay, count, offset)
    keep_out = measure in ("alloc", "seekhole") or measure.startswith("bench")
    server = nbd_server_start(fmt, img) if measure == "nbdmap" else None
    if server and server.poll() is not None:
        d = {"scenario": sc, "format": fmt, "host_fs": host_fs(fmt, sc),
             "measure": measure, "cache": cache, "rep": rep, "value": "",
             "unit": "s", "wall_s": "", "cpu_s": "", "rss_kib": "",
             "status": "failed", "note": "qemu-storage-daemon did not start"}
        log(f"{sc} {fmt} {measure} {cache}: FAILED: {d['note']}")
        OUT.row("runs", d)
        return None
    cpu0 = proc_cpu(server.pid) if server else 0.0
    r = run(argv, stdout=None if keep_out else subprocess.DEVNULL,
            timeout=ARGS.timeout, rss=True)
    server_cpu = proc_cpu(server.pid) - cpu0 if server else None
    if server:
        nbd_server_stop(server)
    d = {"scenario": sc, "format": fmt, "host_fs": host_fs(fmt, sc),
         "measure": measure, "cache": cache, "rep": rep,
         "value": f"{r.wall:.6f}", "unit": "s", "wall_s": f"{r.wall:.6f}",
         "cpu_s": f"{r.cpu:.6f}", "rss_kib": r.rss, "status": "ok",
         "note": ""}
    if r.rc != 0:
        d["status"] = "failed"
        d["note"] = f"exit {r.rc}: " + r.err.strip().replace("\n", " ")[-200:]
    elif measure == "nbdmap":
        # the client's wall time is the value; the server's own CPU time
        # for the map is what the format costs (the client is the floor)
        d["note"] = f"server cpu {server_cpu:.6f} s"
    elif measure == "alloc":
        m = re.search(r"(\d+)/(\d+) bytes allocated", r.out)
        d["note"] = f"{m.group(1)} bytes allocated" if m else \
            "unparsed: " + r.out.strip()[-100:]
    elif measure == "seekhole":
        m = re.search(r"HOLE\s+(\d+)", r.out)
        d["note"] = f"first hole at {m.group(1)}" if m else \
            "unparsed: " + r.out.strip()[-100:]
    elif measure.startswith("bench"):
        m = re.search(r"Run completed in ([0-9.]+) seconds", r.out)
        if m and float(m.group(1)) > 0:
            secs = float(m.group(1))
            d["value"] = f"{count / secs:.1f}"
            d["unit"] = "iops"
            d["note"] = f"{count} requests"
        else:
            d["status"] = "failed"
            d["note"] = "unparsed: " + r.out.strip()[-100:]
    if measure == "convert-raw" and os.path.exists(CONVERT_TARGET):
        os.unlink(CONVERT_TARGET)
    if d["status"] != "ok":
        log(f"{sc} {fmt} {measure} {cache}: FAILED: {d['note']}")
    OUT.row("runs", d)
    if measure == "nbdmap" and d["status"] == "ok":
        # the server's side of the same run as a measure of its own
        OUT.row("runs", dict(d, measure="nbdmap-server",
                             value=f"{server_cpu:.6f}",
                             cpu_s=f"{server_cpu:.6f}",
                             note="qemu-storage-daemon CPU time for the "
                                  "map, client wall in wall_s"))
    return r


def proc_cpu(pid):
    """User + system CPU seconds of a running process (/proc/PID/stat)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def nbd_server_start(fmt, img):
    """qemu-storage-daemon exporting img read-only over a unix socket, as
    NBD_URI names it; returns the Popen once the socket is there."""
    sock = os.path.join(ARGS.workdir, "nbd.sock")
    if os.path.exists(sock):
        os.unlink(sock)
    p = subprocess.Popen(
        [QSD, "--blockdev", f"file,node-name=file0,filename={img}",
         "--blockdev", f"{qemu_fmt(fmt)},node-name=img0,file=file0",
         "--nbd-server", f"addr.type=unix,addr.path={sock}",
         "--export", "nbd,id=exp0,node-name=img0,name=img0,writable=off"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, env=CHILD_ENV, start_new_session=True)
    for _ in range(400):
        if os.path.exists(sock) or p.poll() is not None:
            break
        time.sleep(0.025)
    return p


def nbd_server_stop(p):
    p.terminate()
    try:
        p.wait(timeout=30)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def walk_take(walk, count, step, pos):
    """The offset at which an image's write walk goes on for count writes
    (4 KiB each, step bytes apart, modulo pos blocks); advances the walk
    past them."""
    off = walk[0] * 4096
    walk[0] = (walk[0] + count * (step // 4096)) % pos
    walk[1] += count
    return off


def calibrate(measure, fmt, img, lay, walk):
    """A count that makes one run last about --bench-secs.  walk: for
    writes, [next block of the walk, blocks written so far] of this image,
    which the calibration's own runs advance: each lands on blocks no
    earlier write touched, so the count is that of allocating writes, not
    of overwrites (which are many times faster)."""
    step, pos = bench_step(lay.vsize)
    write = "write" in measure
    count = 256 if bench_kind(measure)[1] == 1 else 2048
    for _ in range(4):
        off = walk_take(walk, count, step, pos) if write else 0
        r = run(command(measure, fmt, img, lay, count, off),
                timeout=ARGS.timeout)
        m = re.search(r"Run completed in ([0-9.]+) seconds", r.out)
        if r.rc != 0 or not m:
            return None, (r.err or r.out).strip()[-200:]
        secs = float(m.group(1))
        if secs >= ARGS.bench_secs / 4:
            break
        count *= 4
    count = max(64, int(count * ARGS.bench_secs / max(secs, 1e-3)))
    if write:
        # keep every write run within one pass over the 4 KiB blocks,
        # leaving room for the write measures after this one
        count = min(count, max(64, (pos - walk[1]) // (4 * ARGS.runs)))
    return count, ""


def callgrind(lay, fmt, img):
    out = os.path.join(OUT.resdir, "logs", f"callgrind-{lay.name}-{fmt}.out")
    r = run([VALGRIND, "--tool=callgrind", f"--callgrind-out-file={out}",
             QIMG, "map", "--output=json", "-f", qemu_fmt(fmt), img],
            stdout=subprocess.DEVNULL, timeout=ARGS.timeout * 20)
    if r.rc != 0:
        OUT.skip(lay.name, fmt, "callgrind",
                 f"valgrind exit {r.rc}: {r.err.strip()[-200:]}")
        return
    func = CALLGRIND_FUNCS[fmt]
    incl, calls, total = callgrind_inclusive(out, func)
    ann = os.path.join(OUT.resdir, "logs",
                       f"callgrind-{lay.name}-{fmt}.annotate.txt")
    with open(ann, "w") as f:
        subprocess.run([CG_ANNOTATE, "--inclusive=yes", out], stdout=f,
                       stderr=subprocess.DEVNULL)
    entries = ""
    with open(IMAGES_CSV_PATH) as f:
        for row in csv.DictReader(f):
            if row["scenario"] == lay.name and row["format"] == fmt:
                entries = int(row["map_entries"])
    if not calls:
        OUT.skip(lay.name, fmt, "callgrind", f"no calls to {func} recorded")
        return
    OUT.row("callgrind", {
        "scenario": lay.name, "format": fmt, "function": func,
        "calls": calls, "inclusive_ir": incl,
        "ir_per_call": f"{incl / calls:.1f}", "total_ir": total,
        "map_entries": entries,
        "total_ir_per_entry": f"{total / entries:.1f}" if entries else ""})
    log(f"{lay.name} {fmt}: {func}: {calls} calls, "
        f"{incl / calls:.0f} instructions a call (inclusive)")


def callgrind_inclusive(path, func):
    """Inclusive Ir of func over all its calls from other functions, the
    number of those calls, and the program total, read from a callgrind
    output file (the same figures callgrind_annotate --inclusive=yes and
    --tree=caller show)."""
    names = {}

    def name(spec):
        spec = spec.strip()
        m = re.match(r"\((\d+)\)(?:\s+(.*))?$", spec)
        if not m:
            return spec
        if m.group(2):
            names[m.group(1)] = m.group(2)
        return names.get(m.group(1), "")

    fn = cfn = None
    pending = None
    incl = calls = total = 0
    with open(path, errors="replace") as f:
        for line in f:
            if line.startswith("fn="):
                fn = name(line[3:])
            elif line.startswith("cfn="):
                cfn = name(line[4:])
            elif line.startswith("calls="):
                pending = int(line[6:].split()[0])
            elif pending is not None and line[:1] in "0123456789+-*":
                parts = line.split()
                if cfn == func and fn != func:
                    incl += int(parts[1]) if len(parts) > 1 else 0
                    calls += pending
                pending = None
            elif line.startswith(("summary:", "totals:")):
                total = max(total, int(line.split()[1]))
    return incl, calls, total


def run_scenario(name):
    lay = images.layout(name, DIV)
    ms = measures_for(name)
    fmts = [f for f in ARGS.formats
            if lay.host_formats is None or f in lay.host_formats]
    if not fmts:
        log(f"{name}: none of the selected formats applies "
            f"(it needs {', '.join(lay.host_formats)})")
        return
    log(f"{name}: {lay.desc}")
    script = os.path.join(ARGS.workdir, f"{name}.qemu-io")
    if lay.tool == "qemu-io":
        with open(script, "w") as f:
            lay.qemu_io_script(f)
    imgs = {}
    for fmt in fmts:
        if fmt == "extree" and not HAVE_EXTREE:
            OUT.skip(name, fmt, "*", NO_EXTREE)
            continue
        try:
            img = build(lay, fmt, script)
        except RuntimeError as e:
            OUT.skip(name, fmt, "*", f"building the image failed: {e}")
            img = None
        if img:
            imgs[fmt] = img
    if os.path.exists(script):
        os.unlink(script)
    verify(lay, imgs)
    built = [f for f in fmts if f in imgs]
    read_ms = [m for m in ms if m in READ_MEASURES]
    for rep in range(ARGS.runs):
        k = rep % max(1, len(built))
        order = built[k:] + built[:k]
        for m in read_ms:
            for fmt in order:
                if not applicable(m, fmt):
                    continue
                for cache in ("cold", "warm"):
                    measure_once(m, fmt, imgs[fmt], lay, cache, rep)
        log(f"{name}: repetition {rep + 1}/{ARGS.runs} done")
    if "callgrind" in ms:
        for fmt in built:
            if applicable("callgrind", fmt):
                callgrind(lay, fmt, imgs[fmt])
    bench_ms = [m for m in ms if m in BENCH_MEASURES]
    # reads first; writes change the images, so they come last.  Each
    # image's write walk goes on from measure to measure.
    walk = {fmt: [0, 0] for fmt in built}
    step, pos = bench_step(lay.vsize)
    for m in bench_ms:
        counts = {}
        for fmt in built:
            if not applicable(m, fmt):
                counts[fmt] = None
                continue
            if fmt == "raw-btrfs" and m.startswith("bench-read-d") and \
                    m != "bench-read-d1":
                OUT.skip(name, fmt, m, BTRFS_DEPTH_READS)
                counts[fmt] = None
                continue
            counts[fmt], err = calibrate(m, fmt, imgs[fmt], lay, walk[fmt])
            if counts[fmt] is None:
                OUT.skip(name, fmt, m, f"qemu-img bench failed: {err}")
        for rep in range(ARGS.runs):
            k = rep % max(1, len(built))
            for fmt in built[k:] + built[:k]:
                if counts[fmt] is None:
                    continue
                for cache in ("cold", "warm"):
                    off = 0
                    if "write" in m:
                        # continue the walk: every write run lands on
                        # blocks no earlier run wrote
                        off = walk_take(walk[fmt], counts[fmt], step, pos)
                    measure_once(m, fmt, imgs[fmt], lay, cache, rep,
                                 count=counts[fmt], offset=off)
        log(f"{name}: {m} done")
    for img in imgs.values():
        os.unlink(img)
    os.sync()
    for fs in sorted({host_fs(f, name) for f in imgs}):
        subprocess.run(["fstrim", os.path.join(ARGS.mnt, fs)],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


PART_KEYS = ("command", "started", "duration_s", "scenarios", "formats",
             "measures", "runs", "bench_secs", "loadavg_start",
             "loadavg_end", "qemu_img_sha256", "qemu_io_sha256")


def merge_meta(old, new, all_names):
    """The meta of one run, or of several parts (--append): the last part's
    machine description, every part's command, time, load and binary under
    "parts", and the union of what was measured."""
    part = {k: new.get(k) for k in PART_KEYS}
    if not old:
        new["parts"] = [part]
        return new
    parts = (old.get("parts") or [{k: old.get(k) for k in PART_KEYS}]) + \
        [part]
    merged = dict(new)
    merged["parts"] = parts
    have = {s for p in parts for s in p["scenarios"]}
    merged["scenarios"] = [n for n in all_names if n in have]
    fm = {f for p in parts for f in p["formats"]}
    merged["formats"] = [f for f in ALL_FORMATS if f in fm]
    merged["runs"] = min(p["runs"] for p in parts)
    merged["command"] = " ; ".join(p["command"] for p in parts)
    merged["started"] = parts[0]["started"]
    merged["duration_s"] = sum(p["duration_s"] or 0 for p in parts)
    merged["extree_driver"] = new["extree_driver"] and \
        old.get("extree_driver", False)
    return merged


def first_line(argv):
    try:
        r = subprocess.run(argv, capture_output=True, text=True)
    except OSError:
        return ""
    lines = (r.stdout + r.stderr).strip().splitlines()
    return lines[0] if lines else ""


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


def main():
    global ARGS, OUT, DIV, QIMG, QIO, XFS_IO, VALGRIND, CG_ANNOTATE
    global QIMG_STOCK, QSD, NBDINFO, NBD_URI
    global PREWARM, HAVE_EXTREE, NO_EXTREE, CONVERT_TARGET, CHILD_ENV
    global IMAGES_CSV_PATH, TIME
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--top", required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--scale", default="quick")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--scenarios", default="all")
    ap.add_argument("--formats", default="all")
    ap.add_argument("--measures", default="")
    ap.add_argument("--image-fs", default="xfs")
    ap.add_argument("--bench-secs", type=float, default=None)
    ap.add_argument("--max-image-gib", type=float, default=32)
    ap.add_argument("--reserve-gib", type=float, default=8)
    ap.add_argument("--build-cache", default="none")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--cmdline", default="")
    ap.add_argument("--append", action="store_true")
    ARGS = ap.parse_args()
    DIV = images.parse_scale(ARGS.scale)
    ARGS.mnt = os.path.join(ARGS.dir, "mnt")
    ARGS.workdir = os.path.join(ARGS.dir, "work")
    ARGS.reserve = int(ARGS.reserve_gib * GiB)
    if ARGS.bench_secs is None:
        ARGS.bench_secs = 5.0 if DIV == 1 else 0.15
    ARGS.formats = ALL_FORMATS if ARGS.formats == "all" else \
        ARGS.formats.split(",")
    for f in ARGS.formats:
        if f not in ALL_FORMATS:
            sys.exit(f"bench: unknown format {f!r}; have "
                     f"{', '.join(ALL_FORMATS)}")
    all_names = images.names(DIV)
    if ARGS.scenarios == "all":
        scen = all_names
    else:
        scen = []
        for s in ARGS.scenarios.split(","):
            if s == "SCALE":
                scen += [n for n in all_names if n.startswith("SCALE-")]
            else:
                images.layout(s, DIV)      # raises on an unknown name
                scen.append(s)
    ARGS.measures = ARGS.measures.split(",") if ARGS.measures else []
    for m in ARGS.measures:
        if m not in ALL_MEASURES:
            sys.exit(f"bench: unknown measure {m!r}; have "
                     f"{', '.join(ALL_MEASURES)}")
    sname = images.scale_name(DIV).replace("/", "-")
    resdir = os.path.join(ARGS.dir, "results", sname)
    old_meta = None
    if ARGS.append and os.path.exists(os.path.join(resdir, "meta.json")):
        with open(os.path.join(resdir, "meta.json")) as f:
            old_meta = json.load(f)
        if old_meta.get("qemu_img_sha256") != sha256(
                os.path.join(ARGS.top, "build", "qemu", "qemu-img")):
            log("note: build/qemu/qemu-img changed since the earlier parts "
                "of these results; each part records its own binary")
    elif os.path.isdir(resdir):
        shutil.rmtree(resdir)
    os.makedirs(ARGS.workdir, exist_ok=True)
    CHILD_ENV = dict(os.environ, LC_ALL="C")

    # One snapshot of the QEMU tools for every format of this run.
    bindir = os.path.join(ARGS.dir, "bin")
    os.makedirs(bindir, exist_ok=True)
    src = os.path.join(ARGS.top, "build", "qemu")
    QIMG = os.path.join(bindir, "qemu-img")
    QIO = os.path.join(bindir, "qemu-io")
    for b in ("qemu-img", "qemu-io"):
        shutil.copy2(os.path.join(src, b), os.path.join(bindir, b))
    # stock qemu-img (no patches/qemu/0004) for map-stock, if built
    QIMG_STOCK = None
    if os.path.exists(os.path.join(src, "qemu-img-stock")):
        QIMG_STOCK = os.path.join(bindir, "qemu-img-stock")
        shutil.copy2(os.path.join(src, "qemu-img-stock"), QIMG_STOCK)
    QSD = os.path.join(bindir, "qemu-storage-daemon")
    shutil.copy2(os.path.join(src, "storage-daemon", "qemu-storage-daemon"),
                 QSD)
    NBDINFO = shutil.which("nbdinfo")
    NBD_URI = "nbd+unix:///img0?socket=" + os.path.join(ARGS.workdir,
                                                         "nbd.sock")
    XFS_IO = shutil.which("xfs_io") or "/usr/sbin/xfs_io"
    TIME = "/usr/bin/time"
    VALGRIND = shutil.which("valgrind") or "valgrind"
    CG_ANNOTATE = shutil.which("callgrind_annotate") or "callgrind_annotate"
    PREWARM = [QIMG, QIO, XFS_IO]
    for b in (QIMG, XFS_IO):
        PREWARM += libraries(b)
    helptext = subprocess.run([QIMG, "--help"], capture_output=True,
                              text=True).stdout
    HAVE_EXTREE = bool(re.search(r"(^|\s)extree(\s|$)", helptext))
    NO_EXTREE = ("this build of qemu-img has no extree driver "
                 "(`build/qemu/qemu-img --help` does not list it)")
    if "extree" in ARGS.formats and not HAVE_EXTREE:
        log(f"extree: skipped: {NO_EXTREE}")
    CONVERT_TARGET = os.path.join(ARGS.mnt, ARGS.image_fs,
                                  "convert-target.raw")

    OUT = Out(resdir, now={(sc, m) for sc in scen for m in measures_for(sc)}
              if old_meta else None)
    IMAGES_CSV_PATH = os.path.join(resdir, "images.csv")
    verfile = os.path.join(ARGS.top, "build", "qemu-version.txt")
    meta = {
        "scale": images.scale_name(DIV), "divisor": DIV, "runs": ARGS.runs,
        "scenarios": scen, "formats": ARGS.formats,
        "measures": ARGS.measures or "default",
        "image_fs": ARGS.image_fs, "bench_secs": ARGS.bench_secs,
        "build_cache": ARGS.build_cache,
        "command": ARGS.cmdline,
        "started": datetime.datetime.now(datetime.timezone.utc)
        .strftime("%Y-%m-%d %H:%M UTC"),
        "nproc": os.cpu_count(),
        "free_g": subprocess.run(["free", "-g"], capture_output=True,
                                 text=True).stdout,
        "kernel": os.uname().release,
        "qemu_version": open(verfile).read().strip()
        if os.path.exists(verfile) else "",
        "qemu_img_version": first_line([QIMG, "--version"]),
        "qemu_img_sha256": sha256(QIMG), "qemu_io_sha256": sha256(QIO),
        "extree_driver": HAVE_EXTREE,
        "loadavg_start": open("/proc/loadavg").read().split()[:3],
        "mkfs": {t: first_line([f"mkfs.{t}", "-V"])
                 for t in ("btrfs", "xfs", "ext4")},
    }
    meta["filesystems"] = {}
    for fs in sorted(os.listdir(ARGS.mnt)):
        r = subprocess.run(["findmnt", "-n", "-o", "FSTYPE,OPTIONS",
                            os.path.join(ARGS.mnt, fs)],
                           capture_output=True, text=True)
        if r.returncode == 0 and r.stdout.split():
            fstype, opts = (r.stdout.split() + [""])[:2]
            meta["filesystems"][fs] = f"{fstype} ({opts})"
    # what /usr/bin/time adds to every timed run
    direct = sorted(run(["/bin/true"]).wall for _ in range(21))[10]
    wrapped = sorted(run(["/bin/true"], rss=True).wall for _ in range(21))[10]
    meta["time_wrapper_ms"] = round((wrapped - direct) * 1000, 3)
    meta["true_ms"] = round(direct * 1000, 3)
    t_start = time.time()

    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)
    try:
        for name in scen:
            run_scenario(name)
    finally:
        meta["loadavg_end"] = open("/proc/loadavg").read().split()[:3]
        meta["duration_s"] = round(time.time() - t_start)
        meta = merge_meta(old_meta, meta, all_names)
        with open(os.path.join(resdir, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
        OUT.summary()
        OUT.close()
        for t in ("out.tmp", "err.tmp"):
            p = os.path.join(ARGS.workdir, t)
            if os.path.exists(p):
                os.unlink(p)
    log(f"results in {resdir} ({meta['duration_s']} s)")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt as e:
        log(f"interrupted ({e or 'SIGINT'}); partial results written")
        sys.exit(130)

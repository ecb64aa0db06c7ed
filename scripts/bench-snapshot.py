#!/usr/bin/python3
"""Internal snapshots: whole-command times of qemu-img snapshot -c, -a and
-d, extree against qcow2 with 64 KiB and 4 KiB clusters (issue 21, point 5).
Python 3 stdlib only.

Layouts: S1 and S2 of scripts/bench-images.py (16 GiB with 4 KiB of data
every 128 KiB, 64 GiB with 4 KiB every 64 KiB: 131,072 and 1,048,576 data
runs at full scale).  The data is written once into a sparse raw file (in
guest order, directly: the raw file is only the source) and every format's
image is made from it with qemu-img convert, so all hold the same runs.

Measures, each a whole qemu-img command (open, work, close), the formats
alternating within each of --runs rounds, medians printed and written as
CSV under --results:

  create    qemu-img snapshot -c on the image as built (then deleted again,
            untimed)
  revert    qemu-img snapshot -a to a snapshot taken of the same state
  delete    qemu-img snapshot -d of a snapshot whose data was overwritten
            afterwards (qemu-img convert -n of a second raw file with other
            bytes at the same runs: every data block rewritten), so the
            delete must free almost all of the snapshot's data
  space     host bytes of the image before the snapshot was taken and after
            that delete (the overwritten copy is what is left)
  write     one qemu-io writing 1,000 scattered 4 KiB blocks of data
            (overwrites of the layout's data runs, in random order): with
            no snapshot, and right after one was taken (every write the
            first to its data and mostly to its leaf: the copies sharing
            costs)

Scenario F (fragmented free space): a 4 GiB image, 1,600 MiB written and
then every other 4 KiB block of it discarded by one qemu-io (204,800
extents and as many free ranges at full scale; sizes divided by the
scale's divisor); create and revert as above.  The targets hold "at any
image size and extent count", and a writer's open reads the free space.

    scripts/bench-snapshot.py [--scale full|quick|1/N] [--runs N]
        [--scenarios S1,S2,F] [--formats extree,qcow2-64k,qcow2-4k]
        [--dir DIR] [--results DIR] [--keep] [--max-image-gib N]
"""

import argparse
import csv
import importlib.util
import os
import random
import shutil
import statistics
import subprocess
import sys
import time

TOP = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QIMG = os.path.join(TOP, "build", "qemu", "qemu-img")
_spec = importlib.util.spec_from_file_location(
    "bench_images", os.path.join(TOP, "scripts", "bench-images.py"))
images = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(images)

FORMATS = images.FORMATS


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def timed(argv):
    """Wall seconds of one command; raises on failure.  The page cache's
    dirty data is written back first: qemu-img convert (the untimed set-up
    before a delete) leaves gigabytes unflushed (its default cache mode
    is unsafe), and the next command's first flush would pay for them."""
    os.sync()
    t0 = time.perf_counter()
    r = subprocess.run(argv, capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit {r.returncode}: "
                           f"{(r.stdout + r.stderr).strip()[-400:]}")
    return dt


def check(argv):
    subprocess.run(argv, check=True, capture_output=True)


def write_raw(path, lay, byte):
    """The layout's data into a sparse raw file, @byte repeated"""
    with open(path, "wb") as f:
        f.truncate(lay.vsize)
        block = bytes([byte]) * (64 * 1024)
        for off, n in sorted(lay.writes):
            f.seek(off)
            while n:
                k = min(n, len(block))
                f.write(block[:k])
                n -= k


def host_bytes(path):
    return os.stat(path).st_blocks * 512


def qcheck(fmt, img):
    r = subprocess.run([QIMG, "check", "-f", FORMATS[fmt][0], img],
                       capture_output=True, text=True)
    return "ok" if r.returncode == 0 else \
        f"exit {r.returncode}: {(r.stdout + r.stderr).strip()[-200:]}"


def snap(fmt, img, op, name):
    return timed([QIMG, "snapshot", "-f", FORMATS[fmt][0], op, name, img])


QIO = os.path.join(TOP, "build", "qemu", "qemu-io")


def writes(fmt, img, offs, byte):
    """Wall seconds of one qemu-io writing 4 KiB at each of @offs"""
    script = "".join(f"write -q -P {byte} {o} 4k\n" for o in offs)
    os.sync()
    t0 = time.perf_counter()
    r = subprocess.run([QIO, "-f", FORMATS[fmt][0], img], input=script,
                       capture_output=True, text=True)
    dt = time.perf_counter() - t0
    out = (r.stdout + r.stderr).lower()
    if r.returncode != 0 or "fail" in out or "error" in out:
        raise RuntimeError(f"qemu-io: {(r.stdout + r.stderr).strip()[-300:]}")
    return dt


def frag_free(args, fmts, div, rows):
    """Scenario F: create and revert on images whose free space is in as
    many pieces as their data"""
    vsize = (4 << 30) // div
    blocks = ((1600 << 20) // div) // 4096
    desc = (f"F: {vsize >> 20} MiB virtual, {blocks * 4} KiB written, every "
            f"other 4 KiB block of it discarded ({blocks // 2} extents, as "
            "many free ranges)")
    log(desc)
    script = (f"write -q -P 1 0 {blocks * 4096}\n" +
              "".join(f"discard -q {i * 4096} 4k\n"
                      for i in range(0, blocks, 2)))
    imgs = {}
    for fmt in fmts:
        img = os.path.join(args.dir, f"F.{fmt}")
        fm, opts = FORMATS[fmt]
        check([QIMG, "create", "-f", fm] + opts + [img, str(vsize)])
        r = subprocess.run([QIO, "-f", fm, img], input=script,
                           capture_output=True, text=True)
        out = (r.stdout + r.stderr).lower()
        if r.returncode != 0 or "fail" in out or "error" in out:
            raise RuntimeError(f"qemu-io: {(r.stdout + r.stderr)[-300:]}")
        imgs[fmt] = img
    times = {(fmt, m): [] for fmt in imgs for m in ("create", "revert")}
    for rep in range(args.runs):
        for fmt, img in imgs.items():
            times[(fmt, "create")].append(snap(fmt, img, "-c", "s"))
            times[(fmt, "revert")].append(snap(fmt, img, "-a", "s"))
            snap(fmt, img, "-d", "s")
    for fmt, img in imgs.items():
        rows.append({"scenario": "F", "format": fmt, "measure": "*",
                     "n": 0, "median_s": "", "min_s": "", "max_s": "",
                     "note": desc})
        for m in ("create", "revert"):
            v = times[(fmt, m)]
            rows.append({"scenario": "F", "format": fmt, "measure": m,
                         "n": len(v),
                         "median_s": f"{statistics.median(v):.4f}",
                         "min_s": f"{min(v):.4f}", "max_s": f"{max(v):.4f}",
                         "note": ""})
            log(f"F {fmt} {m}: median {statistics.median(v):.3f} s "
                f"(min {min(v):.3f}, max {max(v):.3f}, n {len(v)})")
        if not args.keep:
            os.unlink(img)


def private_binaries(d):
    """Copies of qemu-img and qemu-io: a rebuild during the run must not
    pull them out from under it"""
    global QIMG, QIO
    os.makedirs(d, exist_ok=True)
    for name in ("qemu-img", "qemu-io"):
        dst = os.path.join(d, name)
        shutil.copy2(os.path.join(TOP, "build", "qemu", name), dst)
        if name == "qemu-img":
            QIMG = dst
        else:
            QIO = dst


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", default="full")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--scenarios", default="S1,S2,F")
    ap.add_argument("--formats", default="extree,qcow2-64k,qcow2-4k")
    ap.add_argument("--dir", default=os.path.join(TOP, "build", "bench-snap"))
    ap.add_argument("--results", default=None)
    ap.add_argument("--keep", action="store_true")
    # as scripts/bench.py: free space on a loop-mounted file system says
    # nothing of the disk that holds its backing file
    ap.add_argument("--max-image-gib", type=float, default=32)
    args = ap.parse_args()
    div = images.parse_scale(args.scale)
    fmts = args.formats.split(",")
    os.makedirs(args.dir, exist_ok=True)
    resdir = args.results or os.path.join(args.dir, "results")
    os.makedirs(resdir, exist_ok=True)
    private_binaries(os.path.join(args.dir, "bin"))
    rows = []

    for sc in args.scenarios.split(","):
        if sc == "F":
            frag_free(args, fmts, div, rows)
            continue
        lay = images.layout(sc, div)
        log(f"{sc}: {lay.desc}")
        raw = os.path.join(args.dir, f"{sc}.raw")
        raw2 = os.path.join(args.dir, f"{sc}-2.raw")
        write_raw(raw, lay, 0x5a)
        write_raw(raw2, lay, 0xa5)
        imgs = {}
        for fmt in list(fmts):
            # the image and, in the delete measure, its overwritten copy
            need = 2 * lay.estimate_host_bytes(fmt)
            st = os.statvfs(args.dir)
            if lay.estimate_host_bytes(fmt) > args.max_image_gib * 2**30:
                note = (f"skipped: needs about {need >> 30} GiB of host "
                        f"space (over the {args.max_image_gib:g} GiB cap, "
                        "--max-image-gib)")
                log(f"{sc} {fmt}: {note}")
                rows.append({"scenario": sc, "format": fmt,
                             "measure": "*", "n": 0, "median_s": "",
                             "min_s": "", "max_s": "", "note": note})
                continue
            if need > st.f_bavail * st.f_frsize:
                log(f"{sc} {fmt}: skipped, needs about {need >> 30} GiB, "
                    f"{(st.f_bavail * st.f_frsize) >> 30} GiB free")
                rows.append({"scenario": sc, "format": fmt,
                             "measure": "*", "n": 0, "median_s": "",
                             "min_s": "", "max_s": "",
                             "note": f"skipped: needs about {need >> 30} "
                                     "GiB of host space"})
                continue
            img = os.path.join(args.dir, f"{sc}.{fmt}")
            fm, opts = FORMATS[fmt]
            t = timed([QIMG, "convert", "-f", "raw", "-O", fm] + opts +
                      [raw, img])
            imgs[fmt] = img
            log(f"{sc} {fmt}: converted in {t:.1f} s, "
                f"{host_bytes(img) / 2**20:.0f} MiB")
        sfmts = list(imgs)
        times = {(fmt, m): [] for fmt in sfmts
                 for m in ("create", "revert", "delete", "write-plain",
                           "write-after-snapshot")}
        rng = random.Random(21)
        data_offs = [o for o, _ in lay.writes]
        space = {}
        for rep in range(args.runs):
            offs = rng.sample(data_offs, 2000)
            for fmt in sfmts:
                img = imgs[fmt]
                # create (the image as built, no snapshot), then revert
                times[(fmt, "create")].append(snap(fmt, img, "-c", "s"))
                times[(fmt, "revert")].append(snap(fmt, img, "-a", "s"))
                snap(fmt, img, "-d", "s")
                # 1,000 scattered overwrites, without and right after a
                # snapshot (the same offsets for every format)
                times[(fmt, "write-plain")].append(
                    writes(fmt, img, offs[:1000], 7))
                snap(fmt, img, "-c", "w")
                times[(fmt, "write-after-snapshot")].append(
                    writes(fmt, img, offs[1000:], 9))
                snap(fmt, img, "-d", "w")
        for fmt in sfmts:
            # delete of a mostly overwritten snapshot: once per run would
            # rewrite the whole image each time; --runs rounds of it
            img = imgs[fmt]
            for rep in range(args.runs):
                before = host_bytes(img)
                snap(fmt, img, "-c", "old")
                check([QIMG, "convert", "-n", "-f", "raw", "-O",
                       FORMATS[fmt][0], raw2 if rep % 2 == 0 else raw, img])
                during = host_bytes(img)
                times[(fmt, "delete")].append(snap(fmt, img, "-d", "old"))
                after = host_bytes(img)
                space.setdefault(fmt, []).append((before, during, after))
            log(f"{sc} {fmt}: check {qcheck(fmt, img)}")
        for fmt in sfmts:
            for m in ("create", "revert", "delete", "write-plain",
                      "write-after-snapshot"):
                v = times[(fmt, m)]
                rows.append({"scenario": sc, "format": fmt, "measure": m,
                             "n": len(v), "median_s": f"{statistics.median(v):.4f}",
                             "min_s": f"{min(v):.4f}", "max_s": f"{max(v):.4f}",
                             "note": ""})
                log(f"{sc} {fmt} {m}: median {statistics.median(v):.3f} s "
                    f"(min {min(v):.3f}, max {max(v):.3f}, n {len(v)})")
            b, d, a = space[fmt][-1]
            pct = [100.0 * (a1 - b1) / b1 for b1, _, a1 in space[fmt]]
            rows.append({"scenario": sc, "format": fmt, "measure": "space",
                         "n": len(pct), "median_s": "", "min_s": "",
                         "max_s": "",
                         "note": f"host bytes before create {b}, with the "
                                 f"overwritten snapshot {d}, after delete "
                                 f"{a} ({pct[-1]:+.2f}%); every round: " +
                                 ", ".join(f"{p:+.2f}%" for p in pct)})
            log(f"{sc} {fmt} space: {rows[-1]['note']}")
        if not args.keep:
            for p in [raw, raw2] + list(imgs.values()):
                os.unlink(p)
    # "1/8" names no file: as bench.py, "1-8"
    sname = images.scale_name(div).replace("/", "-")
    out = os.path.join(resdir, f"snapshot-{sname}.csv")
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    log(f"results: {out}")


if __name__ == "__main__":
    sys.exit(main())

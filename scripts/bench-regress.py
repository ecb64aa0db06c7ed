#!/usr/bin/python3
"""Whole-command costs that regressed once and must not again (issue 50).
Python 3 stdlib only.

  startup   qemu-img info of a small image: build/qemu's on an extree and
            on a qcow2 image, Debian's own /usr/bin/qemu-img on the qcow2
            one (RBD and iSCSI are loadable modules: no command pays for
            librbd and libiscsi unless it opens such an image)
  create    qemu-img snapshot -c on the image as built (then deleted,
            untimed)
  delete    qemu-img snapshot -d of a snapshot taken just before (nothing
            changed since: what it frees is the snapshot table's entry)
  write     one qemu-io writing one 4 KiB block into a hole between the
            data (a new mapping: the tree changes): on the image with no
            snapshot (write-plain), with one (write-snapshot), and
            with 64 MiB past host_end as a crash's grow-ahead leaves it
            (write-tail: the one case that reads every tree first, the
            lowered host_end protection); read-only, one qemu-io reading
            one block (read)

Layouts: S2 of scripts/bench-images.py (4 KiB of data every 64 KiB, in
random order) at 1/16 of its size (65,536 extents) and whole (1,048,576),
made with qemu-img convert from a raw file (closed cleanly: the file ends
at host_end).  Each round runs every measure once, in turn; medians of
--runs rounds.  The CSV gives the previous round's figure beside each
(issue 50, measured at 4754fed) and the target.

    scripts/bench-regress.py [--scale full|quick|1/N] [--runs N]
        [--dir DIR] [--out CSV] [--keep] [--bin DIR]
"""

import argparse
import csv
import importlib.util
import os
import random
import statistics
import subprocess
import sys
import time

TOP = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QIMG = os.path.join(TOP, "build", "qemu", "qemu-img")
QIO = os.path.join(TOP, "build", "qemu", "qemu-io")
DEBIAN_QIMG = "/usr/bin/qemu-img"
_spec = importlib.util.spec_from_file_location(
    "bench_images", os.path.join(TOP, "scripts", "bench-images.py"))
images = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(images)

# (previous round's figure at 4754fed, target), from issue 50
PREVIOUS = {
    "startup": ("qemu-img --version 45-56 ms, info 46 ms; Debian's 15-22 ms",
                "within 1.2x of Debian's qemu-img"),
    "create": ("80-90 ms at 65,536 extents, 128-203 ms at 262,144",
               "at most 20 ms, and within 2x of its cost at 65,536"),
    "delete": ("grew with the metadata as create did",
               "at most 20 ms, and within 2x of its cost at 65,536"),
    "write-snapshot": ("80-100 ms more than a read at 262,144 extents",
                       "at most 10 ms more than write-plain"),
}


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def timed(argv, input_text=None):
    """Wall seconds of one whole command; raises on failure"""
    t0 = time.perf_counter()
    r = subprocess.run(argv, capture_output=True, text=True,
                       input=input_text)
    dt = time.perf_counter() - t0
    out = (r.stdout + r.stderr).lower()
    if r.returncode != 0 or "error" in out or "failed" in out:
        raise RuntimeError(f"{' '.join(argv)}: exit {r.returncode}: "
                           f"{(r.stdout + r.stderr).strip()[-400:]}")
    return dt


def run(argv):
    subprocess.run(argv, check=True, capture_output=True)


def write_raw(path, lay):
    with open(path, "wb") as f:
        f.truncate(lay.vsize)
        block = bytes([0x5a]) * (4 * 1024)
        for off, n in sorted(lay.writes):
            f.seek(off)
            f.write(block[:n] if n <= len(block) else bytes([0x5a]) * n)


def startup(args, rows):
    small = os.path.join(args.dir, "small")
    run([QIMG, "create", "-f", "extree", small + ".extree", "1G"])
    run([QIMG, "create", "-f", "qcow2", small + ".qcow2", "1G"])
    cmds = {"build/qemu extree": [QIMG, "info", small + ".extree"],
            "build/qemu qcow2": [QIMG, "info", small + ".qcow2"]}
    if os.path.exists(DEBIAN_QIMG):
        cmds["debian qcow2"] = [DEBIAN_QIMG, "info", small + ".qcow2"]
    t = {k: [] for k in cmds}
    for _ in range(3):
        for argv in cmds.values():
            timed(argv)
    for _ in range(max(args.runs, 11)):
        for k, argv in cmds.items():
            t[k].append(timed(argv))
    for k, v in t.items():
        rows.append(row("small", "startup", k, v))
    if "debian qcow2" in t:
        ratio = statistics.median(t["build/qemu extree"]) / \
            statistics.median(t["debian qcow2"])
        log(f"startup: qemu-img info extree / Debian's on qcow2 {ratio:.2f}")
        rows[-3]["note"] = f"{ratio:.2f}x Debian's qemu-img info"
    for f in (small + ".extree", small + ".qcow2"):
        os.unlink(f)


def row(scenario, measure, what, v):
    prev, target = PREVIOUS.get(measure, ("", ""))
    med = statistics.median(v)
    log(f"{scenario} {measure} ({what}): median {med * 1000:.1f} ms "
        f"(min {min(v) * 1000:.1f}, max {max(v) * 1000:.1f}, n {len(v)})")
    return {"scenario": scenario, "measure": measure, "what": what,
            "n": len(v), "median_s": f"{med:.4f}", "min_s": f"{min(v):.4f}",
            "max_s": f"{max(v):.4f}", "previous": prev, "target": target,
            "note": ""}


def layout_runs(args, div, rows):
    lay = images.layout("S2", div)
    name = f"S2/{div}" if div > 1 else "S2"
    log(f"{name}: {lay.desc}")
    raw = os.path.join(args.dir, "regress.raw")
    img = os.path.join(args.dir, "regress.extree")
    write_raw(raw, lay)
    run([QIMG, "convert", "-f", "raw", "-O", "extree", raw, img])
    os.unlink(raw)
    rng = random.Random(50)
    offs = [o for o, _ in lay.writes]
    meas = ("create", "delete", "read", "write-plain", "write-snapshot",
            "write-tail")
    t = {m: [] for m in meas}
    snap = [QIMG, "snapshot", "-f", "extree"]
    for rep in range(args.runs + 1):
        got = {}
        got["create"] = timed(snap + ["-c", "s", img])
        run(snap + ["-d", "s", img])
        run(snap + ["-c", "s", img])
        got["delete"] = timed(snap + ["-d", "s", img])
        # into holes between the layout's data (a new mapping: the tree
        # changes), a different one each time
        a, b, c = (o + 32 * 1024 for o in rng.sample(offs, 3))
        r = rng.choice(offs)
        got["read"] = timed([QIO, "-r", "-f", "extree", "-c",
                             f"read {r} 4k", img])
        got["write-plain"] = timed([QIO, "-f", "extree", "-c",
                                    f"write -P 7 {a} 4k", img])
        run(snap + ["-c", "keep", img])
        got["write-snapshot"] = timed([QIO, "-f", "extree", "-c",
                                       f"write -P 8 {b} 4k", img])
        run(snap + ["-d", "keep", img])
        # a crash's grow-ahead: bytes past host_end (cut back at close)
        with open(img, "ab") as f:
            f.truncate(os.path.getsize(img) + 64 * 2**20)
        got["write-tail"] = timed([QIO, "-f", "extree", "-c",
                                   f"write -P 9 {c} 4k", img])
        if rep == 0:
            continue            # warm-up round
        for m in meas:
            t[m].append(got[m])
    for m in meas:
        rows.append(row(name, m, "extree", t[m]))
    d = statistics.median(t["write-snapshot"]) - \
        statistics.median(t["write-plain"])
    rows[-2]["note"] = f"{d * 1000:+.1f} ms against write-plain"
    r = subprocess.run([QIMG, "check", "-f", "extree", img],
                       capture_output=True, text=True)
    log(f"{name}: check exit {r.returncode}")
    if not args.keep:
        os.unlink(img)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", default="full")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--dir", default=os.path.join(TOP, "build",
                                                  "bench-regress"))
    ap.add_argument("--out", default=None)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--bin", default=None,
                    help="qemu-img and qemu-io from this directory instead "
                         "of build/qemu (to measure another build the same "
                         "way)")
    args = ap.parse_args()
    if args.bin:
        global QIMG, QIO
        QIMG = os.path.join(args.bin, "qemu-img")
        QIO = os.path.join(args.bin, "qemu-io")
    div = images.parse_scale(args.scale)
    os.makedirs(args.dir, exist_ok=True)
    rows = []
    startup(args, rows)
    for d in (16 * div, div):
        layout_runs(args, d, rows)
    out = args.out or os.path.join(args.dir, "regress.csv")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    log(f"results: {out}")


if __name__ == "__main__":
    sys.exit(main())

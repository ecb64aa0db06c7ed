#!/usr/bin/python3
"""Allocating random 4 KiB writes on one extree image, across QEMU builds.

    scripts/bench-write.py [--scale full|quick|1/N] [--scenario S1]
                           [--image IMG] [--dir DIR]
                           [--qemu LABEL=BUILDDIR ...] [--preallocate]
                           [--depths 1,32] [--runs 5] [--count N]

Builds the scenario's image with the benchmark's own qemu-io script (or
takes --image, one built that way), then, --runs times per depth and build,
alternating the builds: copies the image afresh (every write lands in a
hole and allocates, as in `make bench`'s write measures) and times
`qemu-img bench -w` on the copy (cache=none, aio=native, 4 KiB, the same
Weyl step over the disk).  --preallocate adds each build once more with
QEMU's preallocate filter between extree and the file.  Prints the median
seconds and IOPS with the range.  Default build: build/qemu.  python3
stdlib only.
"""

import argparse
import importlib.util
import os
import re
import shutil
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TOP = os.path.dirname(HERE)


# bench-cache.py's image builder, and the benchmark modules it loaded
_spec = importlib.util.spec_from_file_location(
    "bench_cache", os.path.join(HERE, "bench-cache.py"))
cache = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cache)
images, bench = cache.images, cache.bench


def one(qemu, prealloc, src, copy, depth, count, step):
    """Seconds for @count allocating writes on a fresh copy of @src"""
    subprocess.check_call(["cp", "--sparse=always", src, copy])
    if prealloc:
        opts = ("driver=extree,file.driver=preallocate,file.file.driver=file,"
                f"file.file.filename={copy}")
    else:
        opts = f"driver=extree,file.driver=file,file.filename={copy}"
    argv = [os.path.join(qemu, "qemu-img"), "bench", "-w", "--pattern",
            "165", "-t", "none", "-i", "native", "-d", str(depth), "-c",
            str(count), "-s", "4096", "-S", str(step), "--image-opts", opts]
    r = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True)
    m = re.search(r"Run completed in ([0-9.]+) seconds", r.stdout)
    if r.returncode != 0 or not m:
        sys.exit(f"bench-write: {' '.join(argv)} failed: {r.stdout[-300:]}")
    chk = subprocess.run([os.path.join(qemu, "qemu-img"), "check", "-q",
                          "-f", "extree", copy])
    if chk.returncode != 0:
        sys.exit(f"bench-write: qemu-img check {copy} failed after the run")
    os.unlink(copy)
    return float(m.group(1))


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--scale", default="full")
    ap.add_argument("--scenario", default="S1")
    ap.add_argument("--image")
    ap.add_argument("--dir", default=os.path.join(TOP, "build", "bench-write"))
    ap.add_argument("--qemu", action="append", metavar="LABEL=BUILDDIR")
    ap.add_argument("--preallocate", action="store_true")
    ap.add_argument("--depths", default="1,32")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--count", type=int, default=20000)
    a = ap.parse_args()

    lay, depths = cache.check_args("bench-write", a)
    builds = []
    for q in a.qemu or [f"build/qemu={os.path.join(TOP, 'build', 'qemu')}"]:
        label, sep, qdir = q.partition("=")
        if not sep or not os.access(os.path.join(qdir, "qemu-img"), os.X_OK):
            sys.exit(f"bench-write: --qemu {q}: want LABEL=DIR with a "
                     "qemu-img in DIR")
        builds.append((label, qdir, False))
        if a.preallocate:
            builds.append((label + " +preallocate", qdir, True))
    img = cache.scenario_image(a, lay, builds[0][1])
    copy = os.path.join(os.path.dirname(os.path.abspath(img)),
                        "bench-write-copy.extree")
    if shutil.disk_usage(os.path.dirname(copy)).free < 2 * os.stat(
            img).st_blocks * 512:
        sys.exit(f"bench-write: not enough space for a copy of {img}")
    step, _ = bench.bench_step(lay.vsize)
    print(f"{img}: {lay.desc}; {a.count} writes a run, step {step}, "
          "each run on a fresh copy")
    print(f"{'depth':>5}  {'build':<28} {'median s':>9} {'range':>13} "
          f"{'IOPS':>8}")
    for depth in depths:
        res = {b[0]: [] for b in builds}
        for rep in range(a.runs):
            k = rep % len(builds)
            for label, qdir, pre in builds[k:] + builds[:k]:
                res[label].append(one(qdir, pre, img, copy, depth, a.count,
                                      step))
        for label, _, _ in builds:
            t = res[label]
            med = statistics.median(t)
            print(f"{depth:>5}  {label:<28} {med:>9.2f} "
                  f"{min(t):>6.2f}–{max(t):<6.2f} {a.count / med:>8.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

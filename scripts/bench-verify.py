#!/usr/bin/python3
"""What verifying before freeing costs (issue 38, point 6): qemu-img
snapshot -d and -a, and in-place rewrites through qemu-io, timed with two
builds in alternation on the same S2 image (scripts/bench-images.py).

    scripts/bench-verify.py BEFORE_DIR [--scale full|1/N] [--runs N]
        [--dir DIR]

BEFORE_DIR holds qemu-img and qemu-io of the build without the checks;
the build under test is build/qemu.  Measures, each a whole command:

  delete    snapshot -d of a snapshot whose every data block was then
            overwritten (qemu-img convert -n of a second raw file): the
            drop frees almost all of its nodes and data, and each is
            checked against the live tree
  revert    snapshot -a to a snapshot of the same state (the S2 figure)
  revert-x  snapshot -a to a snapshot after every data block was
            overwritten: the old live tree is freed and checked
  rewrite   one qemu-io rewriting 1,000 scattered 4 KiB blocks of data
            in place (they were copied once after a snapshot was taken):
            each write asks whether a snapshot maps the same block

Medians of --runs alternating rounds, wall and CPU (user + system of the
command), printed.  Python 3 stdlib only.
"""

import argparse
import importlib.util
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import time

TOP = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(name):
    spec = importlib.util.spec_from_file_location(
        name.replace("-", "_"), os.path.join(TOP, "scripts", name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


images = load("bench-images")
bs = load("bench-snapshot")


CPU = []         # CPU seconds (user + system) of each timed command


def run(argv, script=None):
    os.sync()
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run(argv, input=script, capture_output=True, text=True)
    dt = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    CPU.append(ru1.ru_utime - ru0.ru_utime + ru1.ru_stime - ru0.ru_stime)
    out = (r.stdout + r.stderr).lower()
    if r.returncode != 0 or "fail" in out or "error" in out:
        raise RuntimeError(f"{' '.join(argv)}: exit {r.returncode}: "
                           f"{(r.stdout + r.stderr).strip()[-300:]}")
    return dt


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("before")
    ap.add_argument("--scale", default="full")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", default=os.path.join(TOP, "build",
                                                  "bench-verify"))
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    bins = {}
    for label, d in (("before", args.before),
                     ("after", os.path.join(TOP, "build", "qemu"))):
        bd = os.path.join(args.dir, label)
        os.makedirs(bd, exist_ok=True)
        for name in ("qemu-img", "qemu-io"):
            shutil.copy2(os.path.join(d, name), os.path.join(bd, name))
        bins[label] = (os.path.join(bd, "qemu-img"),
                       os.path.join(bd, "qemu-io"))
    qimg = bins["after"][0]
    lay = images.layout("S2", images.parse_scale(args.scale))
    print(f"S2: {lay.desc}", flush=True)
    raw = os.path.join(args.dir, "S2.raw")
    raw2 = os.path.join(args.dir, "S2-2.raw")
    img = os.path.join(args.dir, "S2.extree")
    bs.write_raw(raw, lay, 0x5a)
    bs.write_raw(raw2, lay, 0xa5)
    run([qimg, "convert", "-f", "raw", "-O", "extree", raw, img])
    rng = random.Random(38)
    offs = [o for o, _ in rng.sample(lay.writes, 1000)]
    times = {(b, m): [] for b in bins
             for m in ("delete", "revert", "revert-x", "rewrite")}
    cpu = {k: [] for k in times}

    def timed(b, m, argv, script=None):
        times[(b, m)].append(run(argv, script))
        cpu[(b, m)].append(CPU[-1])
    src = [raw2, raw]
    for rep in range(args.runs):
        order = list(bins) if rep % 2 == 0 else list(bins)[::-1]
        for b in order:
            qi, qio = bins[b]
            # revert to the same state
            run([qimg, "snapshot", "-c", "s", img])
            timed(b, "revert", [qi, "snapshot", "-a", "s", img])
            run([qimg, "snapshot", "-d", "s", img])
            # revert across an overwrite of every data block
            run([qimg, "snapshot", "-c", "s", img])
            run([qimg, "convert", "-n", "-f", "raw", "-O", "extree",
                 src[0], img])
            src.reverse()
            timed(b, "revert-x", [qi, "snapshot", "-a", "s", img])
            run([qimg, "snapshot", "-d", "s", img])
            # delete of a snapshot whose data was overwritten
            run([qimg, "snapshot", "-c", "old", img])
            run([qimg, "convert", "-n", "-f", "raw", "-O", "extree",
                 src[0], img])
            src.reverse()
            timed(b, "delete", [qi, "snapshot", "-d", "old", img])
            # in-place rewrites under a snapshot: copied once, then timed
            run([qimg, "snapshot", "-c", "w", img])
            script = "".join(f"write -q -P 7 {o} 4k\n" for o in offs)
            run([bins["after"][1], "-f", "extree", img], script)
            script = "".join(f"write -q -P 9 {o} 4k\n" for o in offs)
            timed(b, "rewrite", [qio, "-f", "extree", img], script)
            run([qimg, "snapshot", "-d", "w", img])
    r = subprocess.run([qimg, "check", img], capture_output=True, text=True)
    print(f"check: exit {r.returncode}", flush=True)
    for m in ("delete", "revert", "revert-x", "rewrite"):
        line = [m]
        med = {}
        for b in bins:
            v = times[(b, m)]
            med[b] = statistics.median(v)
            line.append(f"{b} {med[b]:.4f} s (min {min(v):.4f}, max "
                        f"{max(v):.4f}, n {len(v)})")
        line.append(f"after/before {med['after'] / med['before']:.3f}")
        c = {b: statistics.median(cpu[(b, m)]) for b in bins}
        line.append(f"CPU median before {c['before']:.4f} s after "
                    f"{c['after']:.4f} s")
        print("  ".join(line), flush=True)
    for p in (raw, raw2, img):
        os.unlink(p)


if __name__ == "__main__":
    sys.exit(main())

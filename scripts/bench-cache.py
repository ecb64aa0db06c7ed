#!/usr/bin/python3
"""Random 4 KiB reads on one extree image against the node cache size.

    scripts/bench-cache.py [--scale full|quick|1/N] [--scenario S2]
                           [--image IMG] [--dir DIR]
                           [--cache-sizes 32M,48M,64M] [--depths 1,32]
                           [--runs 5] [--count N]

Builds the scenario's image with the benchmark's own qemu-io script (or
takes --image, one built that way), then runs `qemu-img bench` as `make
bench` does (cache=none, aio=native, 4 KiB, the same Weyl step over the
disk) with the image opened as driver=extree,cache-size=SIZE, --runs times
per depth and size, alternating the sizes.  Prints the median IOPS, the
spread and the peak RSS of each.  python3 stdlib only; uses build/qemu.
"""

import argparse
import importlib.util
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TOP = os.path.dirname(HERE)


def load(name, file):
    spec = importlib.util.spec_from_file_location(name,
                                                  os.path.join(HERE, file))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


images = load("bench_images", "bench-images.py")
bench = load("bench", "bench.py")


def build(lay, qemu, img):
    script = img + ".qemu-io"
    with open(script, "w") as f:
        lay.qemu_io_script(f)
    subprocess.check_call([os.path.join(qemu, "qemu-img"), "create", "-q",
                           "-f", "extree", img, str(lay.vsize)])
    t0 = time.perf_counter()
    with open(script) as sin:
        r = subprocess.run([os.path.join(qemu, "qemu-io"), "-t", "none",
                            "-f", "extree", img], stdin=sin,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
    os.unlink(script)
    if r.returncode != 0 or re.search(r"error|failed", r.stdout, re.I):
        sys.exit(f"bench-cache: building {img} failed: {r.stdout[-300:]}")
    print(f"built {img} in {time.perf_counter() - t0:.0f} s")


def check_args(prog, a):
    """The layout of --scenario (built with qemu-io) and the --depths, or
    exit with a message"""
    try:
        lay = images.layout(a.scenario, images.parse_scale(a.scale))
    except (KeyError, ValueError) as e:
        sys.exit(f"{prog}: {e}")
    if lay.tool != "qemu-io":
        sys.exit(f"{prog}: {a.scenario} is not built with qemu-io")
    depths = [int(d) for d in a.depths.split(",")]
    if a.runs < 1 or a.count < 1 or not all(d >= 1 for d in depths):
        sys.exit(f"{prog}: --runs, --count and --depths must be >= 1")
    return lay, depths


def scenario_image(a, lay, qemu):
    """--image, or the scenario's image in --dir, built there if missing"""
    if a.image:
        return a.image
    os.makedirs(a.dir, exist_ok=True)
    img = os.path.join(a.dir, f"{a.scenario}-{a.scale.replace('/', '_')}"
                       ".extree")
    if not os.path.exists(img):
        build(lay, qemu, img)
    return img


def one(qemu, img, size, depth, count, step):
    opts = f"driver=extree,cache-size={size},file.filename={img}"
    argv = ["/usr/bin/time", "-f", "rss %M",
            os.path.join(qemu, "qemu-img"), "bench", "-t", "none",
            "-i", "native", "-d", str(depth), "-c", str(count),
            "-s", "4096", "-S", str(step), "--image-opts", opts]
    r = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True)
    m = re.search(r"Run completed in ([0-9.]+) seconds", r.stdout)
    rss = re.search(r"rss (\d+)", r.stderr)
    if r.returncode != 0 or not m or not rss:
        sys.exit(f"bench-cache: {' '.join(argv)} failed: "
                 f"{(r.stdout + r.stderr)[-300:]}")
    return count / float(m.group(1)), int(rss.group(1))


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--scale", default="full")
    ap.add_argument("--scenario", default="S2")
    ap.add_argument("--image")
    ap.add_argument("--dir", default=os.path.join(TOP, "build", "bench-cache"))
    ap.add_argument("--cache-sizes", default="32M,48M,64M")
    ap.add_argument("--depths", default="1,32")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--count", type=int, default=100000)
    ap.add_argument("--qemu", default=os.path.join(TOP, "build", "qemu"))
    a = ap.parse_args()

    lay, depths = check_args("bench-cache", a)
    sizes = a.cache_sizes.split(",")
    img = scenario_image(a, lay, a.qemu)
    step, _ = bench.bench_step(lay.vsize)
    print(f"{img}: {lay.desc}; {a.count} reads a run, step {step}")
    print(f"{'depth':>5} {'cache-size':>10} {'median IOPS':>12} "
          f"{'min':>9} {'max':>9} {'peak RSS':>10}")
    for depth in depths:
        res = {s: [] for s in sizes}
        for rep in range(a.runs):
            k = rep % len(sizes)
            for s in sizes[k:] + sizes[:k]:
                res[s].append(one(a.qemu, img, s, depth, a.count, step))
        for s in sizes:
            iops = [x for x, _ in res[s]]
            rss = max(r for _, r in res[s])
            print(f"{depth:>5} {s:>10} {statistics.median(iops):>12.0f} "
                  f"{min(iops):>9.0f} {max(iops):>9.0f} "
                  f"{rss / 1024:>7.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())

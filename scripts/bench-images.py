#!/usr/bin/python3
"""Scenario layouts for the extree benchmark (issue 5), python3 stdlib only.

A layout is the list of guest writes that builds a scenario's image, in the
order they are made, plus what the image should look like afterwards.  The
same writes, with the same data pattern, build every format: bench.py feeds
them to build/qemu's qemu-io on stdin as `write -q -P <pattern> <off> <len>`
lines.  The pattern byte of a write depends only on its guest offset, so all
formats hold the same data.

Scenarios (full scale; quick divides the sizes by 64, --scale 1/N by N):
  S1     16 GiB virtual, 4 KiB of data every 128 KiB, in guest order
  S2     64 GiB virtual, 4 KiB of data every 64 KiB, in random order
  S3     [0, 2 GiB) as 16 KiB extents in random order, a 1 MiB hole, then
         64 MiB of data; 3 GiB virtual (the btrfs llseek case, LSFMM 2017)
  S3L    the 2022 btrfs patch's layout: a raw file of 16 GiB written with
         compress=lzo, 1 MiB punched at 15 GiB (xfs_io, raw on btrfs only)
  S4     1 TiB virtual (not scaled) with 8 large extents of 64 MiB
  SCALE  N extents of 4 KiB every 64 KiB in random order, for the map
         scaling plot; N = 1e4 3e4 1e5 3e5 1e6 (full), 1e3 3e3 1e4 3e4 (quick)

Usage:
  bench-images.py list   [--scale S]          scenario names at that scale
  bench-images.py info   SCENARIO [--scale S] layout summary as JSON
  bench-images.py script SCENARIO [--scale S] the qemu-io command script
"""

import json
import random
import sys

KiB = 1024

# The formats the scenario benchmarks set side by side: name -> (driver,
# qemu-img create options)
FORMATS = {"extree": ("extree", []),
           "qcow2-64k": ("qcow2", ["-o", "cluster_size=65536"]),
           "qcow2-4k": ("qcow2", ["-o", "cluster_size=4096"])}
MiB = 1024 * KiB
GiB = 1024 * MiB
TiB = 1024 * GiB

SCALE_SIZES = {
    1: [10_000, 30_000, 100_000, 300_000, 1_000_000],
    64: [1_000, 3_000, 10_000, 30_000],
}


def parse_scale(s):
    """'full' -> 1, 'quick' -> 64, '1/N' -> N."""
    if s == "full":
        return 1
    if s == "quick":
        return 64
    if s.startswith("1/") and s[2:].isdigit() and int(s[2:]) >= 1:
        return int(s[2:])
    raise ValueError(f"bad scale {s!r}: want full, quick or 1/N")


def scale_name(div):
    return {1: "full", 64: "quick"}.get(div, f"1/{div}")


def pattern(off):
    """Data byte of the write at guest offset off: never 0, so no write is
    all zeroes, and it varies between neighbouring extents."""
    return (off // (4 * KiB)) % 251 + 1


def scale_sizes(div):
    if div in SCALE_SIZES:
        return SCALE_SIZES[div]
    return sorted({max(100, n // div) for n in SCALE_SIZES[1]})


def scale_label(n):
    """10000 -> '1e4', 30000 -> '3e4', 3000 -> '3e3'; other N as digits."""
    s = str(n)
    if s[0] in "123456789" and s[1:] == "0" * (len(s) - 1) and len(s) > 2:
        return f"{s[0]}e{len(s) - 1}"
    return s


def names(div):
    return ["S1", "S2", "S3", "S3L", "S4"] + \
           [f"SCALE-{scale_label(n)}" for n in scale_sizes(div)]


class Layout:
    """name, virtual size, writes [(off, len)] in write order, and facts."""

    def __init__(self, name, div, vsize, writes, guest_runs, desc,
                 tool="qemu-io", host_formats=None):
        self.name = name
        self.div = div
        self.vsize = vsize
        self.writes = writes
        self.guest_runs = guest_runs        # maximal runs of guest data
        self.desc = desc
        self.tool = tool                    # "qemu-io" or "xfs_io" (S3L)
        self.host_formats = host_formats    # None: every format
        self.data_bytes = sum(n for _, n in writes)

    def info(self):
        return {
            "scenario": self.name, "scale": scale_name(self.div),
            "virtual_size": self.vsize, "data_bytes": self.data_bytes,
            "writes": len(self.writes), "guest_runs": self.guest_runs,
            "tool": self.tool, "description": self.desc,
        }

    def qemu_io_script(self, out):
        for off, n in self.writes:
            # qemu-io buffers a whole write: split big extents into 16 MiB
            # writes (the same for every format).
            pos = off
            while pos < off + n:
                step = min(16 * MiB, off + n - pos)
                out.write(f"write -q -P {pattern(off)} {pos} {step}\n")
                pos += step

    def clusters(self, csize):
        """Distinct csize-aligned clusters the data touches."""
        seen = set()
        for off, n in self.writes:
            seen.update(range(off // csize, (off + n - 1) // csize + 1))
        return len(seen)

    def estimate_host_bytes(self, fmt):
        """A generous estimate of the host space an image of fmt needs."""
        if fmt.startswith("qcow2-"):
            csize = 64 * KiB if fmt == "qcow2-64k" else 4 * KiB
            clusters = self.clusters(csize)
            l2_entries = csize // 8
            l2_tables = len({(o // csize) // l2_entries for o, _ in
                             self.writes})
            return (clusters + l2_tables + 16) * csize + 16 * MiB
        if fmt == "extree":
            return int(self.data_bytes * 1.1) + 64 * MiB
        return self.data_bytes + 16 * MiB


def _every(vsize, stride, length, order_seed=None):
    offs = list(range(0, vsize, stride))
    if order_seed is not None:
        random.Random(order_seed).shuffle(offs)
    return [(o, length) for o in offs]


def layout(name, div):
    if name == "S1":
        vsize = 16 * GiB // div
        w = _every(vsize, 128 * KiB, 4 * KiB)
        return Layout(name, div, vsize, w, len(w),
                      f"{vsize // MiB} MiB virtual, 4 KiB of data every "
                      f"128 KiB in guest order ({len(w)} runs)")
    if name == "S2":
        vsize = 64 * GiB // div
        w = _every(vsize, 64 * KiB, 4 * KiB, order_seed=2)
        return Layout(name, div, vsize, w, len(w),
                      f"{vsize // MiB} MiB virtual, 4 KiB of data every "
                      f"64 KiB in random order ({len(w)} runs)")
    if name == "S3":
        vsize = 3 * GiB // div
        first = 2 * GiB // div
        tail = 64 * MiB // div
        w = _every(first, 16 * KiB, 16 * KiB, order_seed=3)
        n16 = len(w)
        w.append((first + 1 * MiB, tail))
        return Layout(name, div, vsize, w, 2,
                      f"{vsize // MiB} MiB virtual: [0, {first // MiB} MiB) "
                      f"as {n16} 16 KiB extents in random order, a 1 MiB "
                      f"hole, then {tail // MiB} MiB of data")
    if name == "S3L":
        vsize = 16 * GiB // div
        punch = 15 * GiB // div
        w = [(0, punch), (punch + MiB, vsize - punch - MiB)]
        return Layout(name, div, vsize, w, 2,
                      f"raw file of {vsize // MiB} MiB written by xfs_io "
                      f"(pwrite -S 0xab -b 1M) on btrfs mounted with "
                      f"compress=lzo, 1 MiB punched at {punch // MiB} MiB",
                      tool="xfs_io", host_formats=["raw-btrfs"])
    if name == "S4":
        vsize = TiB
        ext = 64 * MiB // div
        starts = [0, 1 * GiB, 10 * GiB, 100 * GiB, 256 * GiB, 512 * GiB,
                  768 * GiB, vsize - ext]
        w = [(s, ext) for s in starts]
        return Layout(name, div, vsize, w, len(w),
                      f"1 TiB virtual, {len(w)} extents of "
                      f"{ext // MiB} MiB spread over it")
    if name.startswith("SCALE-"):
        lab = name[len("SCALE-"):]
        sizes = {scale_label(n): n for n in scale_sizes(div)}
        if lab not in sizes and lab.isdigit():
            sizes[lab] = int(lab)
        if lab not in sizes:
            raise ValueError(f"unknown scaling size {lab!r} at scale "
                             f"{scale_name(div)}: have {', '.join(sizes)}")
        n = sizes[lab]
        vsize = n * 64 * KiB
        w = _every(vsize, 64 * KiB, 4 * KiB, order_seed=n)
        return Layout(name, div, vsize, w, n,
                      f"{n} extents of 4 KiB every 64 KiB in random order")
    raise ValueError(f"unknown scenario {name!r}")


def main(argv):
    args = argv[1:]
    scale = "quick"
    if "--scale" in args:
        i = args.index("--scale")
        scale = args[i + 1]
        del args[i:i + 2]
    div = parse_scale(scale)
    if not args or args[0] not in ("list", "info", "script"):
        sys.stderr.write(__doc__)
        return 2
    if args[0] == "list":
        print(" ".join(names(div)))
        return 0
    if len(args) != 2:
        sys.stderr.write(__doc__)
        return 2
    lay = layout(args[1], div)
    if args[0] == "info":
        print(json.dumps(lay.info(), indent=1))
    else:
        lay.qemu_io_script(sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

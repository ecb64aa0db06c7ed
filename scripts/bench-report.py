#!/usr/bin/python3
"""Publish the benchmark: copy a run's CSVs to docs/performance/<scale>/,
draw the map-scaling plot there (Debian's python3-matplotlib), and rewrite
docs/performance.rst from every scale found under docs/performance/.

  scripts/bench-report.py [--results build/bench/results/<scale>] [--top DIR]

Without --results it only regenerates the page and plots from the CSVs
already under docs/performance/.  Every figure on the page comes from those
CSVs; nothing is typed in by hand except the issue's reference figures,
which are labelled as such.
"""

import argparse
import csv
import importlib.util
import json
import os
import shutil
import sys
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location(
    "bench_images", os.path.join(HERE, "bench-images.py"))
images = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(images)

FORMATS = ["extree", "qcow2-64k", "qcow2-4k", "raw-btrfs", "raw-xfs",
           "raw-ext4"]
SCALE_ORDER = ["full", "quick"]
# written into docs/performance/full by scripts run on their own
# (bench-compress.py, bench-crypt.py; bench-bitmaps.py also inside a run)
STANDALONE = {"compress.csv", "crypt.csv", "bitmaps.csv", "regress.csv"}
MiB = 1024 * 1024


# ---------------------------------------------------------------- loading

class Run:
    """One scale's results, read from docs/performance/<scale>/."""

    def __init__(self, d):
        self.dir = d
        self.name = os.path.basename(d)
        with open(os.path.join(d, "meta.json")) as f:
            self.meta = json.load(f)
        self.summary = {}
        self.skips = {}
        for r in self.csv("summary"):
            if r["status"] == "skipped":
                self.skips[(r["scenario"], r["format"], r["measure"])] = \
                    r["note"]
            else:
                self.summary[(r["scenario"], r["format"], r["measure"],
                              r["cache"])] = r
        self.images = {(r["scenario"], r["format"]): r
                       for r in self.csv("images")}
        self.cg = {(r["scenario"], r["format"]): r
                   for r in self.csv("callgrind")}
        self.scenarios = self.meta["scenarios"]
        self.div = self.meta["divisor"]

    def csv(self, name):
        p = os.path.join(self.dir, f"{name}.csv")
        if not os.path.exists(p):
            return []
        with open(p, newline="") as f:
            return list(csv.DictReader(f))

    def med(self, sc, fmt, measure, cache):
        r = self.summary.get((sc, fmt, measure, cache))
        if r and r["median"] not in ("", None):
            return float(r["median"])
        return None

    def row(self, sc, fmt, measure, cache):
        return self.summary.get((sc, fmt, measure, cache))

    def skip_reason(self, sc, fmt, measure):
        return self.skips.get((sc, fmt, measure)) or \
            self.skips.get((sc, fmt, "*"))

    def formats(self):
        return [f for f in FORMATS if f in self.meta["formats"]]

    def has(self, sc):
        return sc in self.scenarios


# ---------------------------------------------------------------- formatting

def secs(v):
    if v is None:
        return "—"
    if v < 1:
        return f"{v * 1000:.3g} ms"
    return f"{v:.3g} s"


def nbytes(v):
    v = float(v)
    if v >= 1024 ** 3:
        return f"{v / 1024 ** 3:.2f} GiB"
    if v >= MiB:
        return f"{v / MiB:.1f} MiB"
    return f"{v / 1024:.0f} KiB"


def table(header, rows):
    """An RST simple table."""
    rows = [[str(c) for c in r] for r in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in rows)) if rows
              else len(str(h)) for i, h in enumerate(header)]
    sep = "  ".join("=" * w for w in widths)
    out = [sep, "  ".join(str(h).ljust(w) for h, w in zip(header, widths)),
           sep]
    for r in rows:
        out.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    out.append(sep)
    return "\n".join(out) + "\n"


def cell(run, sc, fmt, measure, show=secs, caches=("warm", "cold")):
    """'warm / cold' medians, or why there is none."""
    if not run.has(sc):
        return "not run"
    vals = []
    for c in caches:
        r = run.row(sc, fmt, measure, c)
        if r is None:
            reason = run.skip_reason(sc, fmt, measure)
            if reason:
                return "skipped†"
            return "—"
        if r["median"] == "":
            return "failed"
        vals.append(show(float(r["median"])))
    return " / ".join(vals)


# ---------------------------------------------------------------- plot

def plot(run):
    """map time against extent count, warm and cold, one line per format."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench-report: python3-matplotlib is missing: no plot "
              "(apt-get install python3-matplotlib)", file=sys.stderr)
        return None
    points = {}
    # S2 is the same layout (4 KiB every 64 KiB, random order) with 2^20
    # runs: the 10^6 point, unless SCALE-1e6 itself was run
    sizes = [sc for sc in run.scenarios if sc.startswith("SCALE-")]
    if "S2" in run.scenarios and not any(
            images.layout(sc, run.div).guest_runs >= 1_000_000
            for sc in sizes):
        sizes.append("S2")
    for sc in sizes:
        n = images.layout(sc, run.div).guest_runs
        for fmt in run.formats():
            for cache in ("warm", "cold"):
                v = run.med(sc, fmt, "map", cache)
                if v is not None:
                    points.setdefault((fmt, cache), []).append((n, v))
    if not points:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    markers = dict(zip(FORMATS, "os^vDx"))
    for ax, cache in zip(axes, ("warm", "cold")):
        for fmt in run.formats():
            pts = sorted(points.get((fmt, cache), []))
            if not pts:
                continue
            ax.plot([p[0] for p in pts], [p[1] for p in pts],
                    marker=markers[fmt], label=fmt)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("data extents (4 KiB every 64 KiB, random order)")
        ax.set_title(f"qemu-img map --output=json, {cache}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("seconds (median)")
    axes[0].legend()
    fig.suptitle(f"Map time against extent count ({run.name} scale, "
                 f"median of {run.meta['runs']} runs)")
    fig.tight_layout()
    path = os.path.join(run.dir, "map-scaling.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# ---------------------------------------------------------------- targets

REF = {
    "S2-map": "qcow2 4 KiB 18.0 s warm / 22.6 s cold; raw on ext4 5.5 / "
              "9.2 s; raw on btrfs 10.9 / 11.7 s",
    "S1-map": "qcow2 64 KiB 0.21 s warm for 262,144 entries",
    "cg": "qcow2 ≈ 830 instructions a call",
    "S3": "whole xfs_io command on the 2022 patch's layout: 44 ms warm, "
          "104 ms cold",
    "space": "qcow2 64 KiB: 8.0 GiB for S1's 512 MiB of data",
    "iops": "",
}


def ratio(a, b):
    if a is None or b is None or b == 0:
        return None
    return a / b


def targets(run):
    """[(target, reference, measured, verdict)] for issue 5's targets."""
    quick = run.div != 1
    ex = "extree" in run.meta["formats"] and run.meta.get("extree_driver")
    rows = []

    def verdict(ok, why_not):
        """why_not: why this scale cannot judge it (None: it can)."""
        if not ex:
            return "not measured: no extree driver in this build"
        if ok is None:
            return "no figure"
        word = "met" if ok else "MISSED"
        if quick and why_not:
            return (f"cannot be judged at this scale ({why_not}); "
                    f"{'met' if ok else 'missed'} here, as an indication "
                    f"only")
        return word

    # S2 map ratios
    parts, oks = [], []
    for peer, want in (("qcow2-4k", 5), ("raw-ext4", 3), ("raw-btrfs", 6)):
        for c in ("warm", "cold"):
            r = ratio(run.med("S2", peer, "map", c),
                      run.med("S2", "extree", "map", c))
            if r is not None:
                parts.append(f"{r:.1f}× vs {peer} {c}")
                oks.append(r >= want)
    rows.append(["S2 map ≥ 5× faster than qcow2 4 KiB, ≥ 3× than raw on "
                 "ext4, ≥ 6× than raw on btrfs", REF["S2-map"],
                 "; ".join(parts) or "—",
                 verdict(all(oks) if oks else None,
                         "S2 has 1/64 of its runs; qcow2 4 KiB's L2 tables "
                         "for the 1 GiB image (2 MiB) nearly fit its L2 "
                         "cache, those of the 64 GiB one (128 MiB) do not; "
                         "start-up is a large part of every time")])
    # issue 18: the patched map's absolute time, and qcow2 4 KiB at 10×
    parts, oks = [], []
    for c, limit in (("warm", 0.8), ("cold", 1.2)):
        t = run.med("S2", "extree", "map", c)
        if t is not None:
            parts.append(f"{t:.2f} s {c}")
            oks.append(t <= limit)
        r = ratio(run.med("S2", "qcow2-4k", "map", c),
                  run.med("S2", "extree", "map", c))
        if r is not None:
            parts.append(f"{r:.1f}× vs qcow2-4k {c}")
            oks.append(r >= 10)
    rows.append(["S2 map ≤ 0.8 s warm, ≤ 1.2 s cold, ≥ 10× faster than "
                 "qcow2 4 KiB (issue 18)", "—", "; ".join(parts) or "—",
                 verdict(all(oks) if oks else None,
                         "S2 has 1/64 of its runs")])
    # issue 18: NBD server CPU for a whole nbdinfo --map
    parts, oks = [], []
    for peer, div in (("qcow2-4k", 3), ("raw-ext4", 10)):
        for c in ("warm", "cold"):
            r = ratio(run.med("S2", peer, "nbdmap-server", c),
                      run.med("S2", "extree", "nbdmap-server", c))
            if r is not None:
                parts.append(f"1/{r:.1f} of {peer}'s {c}")
                oks.append(r >= div)
    rows.append(["S2 nbdinfo --map server CPU ≤ 1/3 of qcow2 4 KiB's, "
                 "≤ 1/10 of raw on ext4's (issue 18)", "—",
                 "; ".join(parts) or "—",
                 verdict(all(oks) if oks else None,
                         "start-up is most of the server's time")])
    # S1 per entry
    e = run.images.get(("S1", "extree"))
    q = run.images.get(("S1", "qcow2-64k"))
    me, mq = run.med("S1", "extree", "map", "warm"), \
        run.med("S1", "qcow2-64k", "map", "warm")
    r = None
    if e and q and me and mq and int(e["map_entries"]) and \
            int(q["map_entries"]):
        r = (me / int(e["map_entries"])) / (mq / int(q["map_entries"]))
    rows.append(["S1 map time per entry ≤ 1.1× qcow2 64 KiB's", REF["S1-map"],
                 f"{r:.2f}× qcow2 64 KiB's (warm, whole command)" if r
                 else "—",
                 verdict(None if r is None else r <= 1.1,
                         "with 4,096 entries, start-up and open are most "
                         "of the time")])
    # callgrind
    ce = run.cg.get(("S1", "extree"))
    cq = run.cg.get(("S1", "qcow2-64k"))
    r = None
    if ce and cq:
        r = float(ce["ir_per_call"]) / float(cq["ir_per_call"])
    txt = "—"
    if r:
        txt = (f"extree {float(ce['ir_per_call']):.0f} a call, qcow2 64 KiB "
               f"{float(cq['ir_per_call']):.0f}: {r:.0%}")
        if quick:
            txt += (" (per call, so the scale matters little, but the quick "
                    "S1 tree is smaller than the full one)")
    rows.append(["driver instructions per block-status call ≤ 25% of "
                 "qcow2's", REF["cg"], txt,
                 verdict(None if r is None else r <= 0.25, None)])
    # S3
    aw, ac = run.med("S3", "extree", "alloc", "warm"), \
        run.med("S3", "extree", "alloc", "cold")
    ow, oc = run.med("S3", "extree", "open", "warm"), \
        run.med("S3", "extree", "open", "cold")
    txt, ok = "—", None
    if None not in (aw, ac, ow, oc):
        qw, qc = aw - ow, ac - oc

        def q(v):
            # medians of two noisy commands: a difference below 0 means
            # the query is lost in the start-up's spread
            return secs(v) if v > 0 else "≈ 0"
        txt = (f"query {q(qw)} warm, {q(qc)} cold (alloc minus open; ≈ 0 "
               f"when the difference is within the spread of start-up); "
               f"whole command {secs(aw)} warm, {secs(ac)} cold")
        # the whole command: within 10 ms of the query's bound
        ok = qw <= 0.005 and qc <= 0.020 and aw <= 0.015 and ac <= 0.030
    rows.append(["S3 first hole ≤ 5 ms warm and ≤ 20 ms cold for the query, "
                 "the whole qemu-io command within 10 ms more (≤ 15 ms warm, "
                 "≤ 30 ms cold)", REF["S3"],
                 txt, verdict(ok, "2,048 extents instead of 131,072: the "
                              "query is lost in the noise of start-up")])
    # space
    txt, ok = "—", None
    worst = None
    for sc in run.scenarios:
        im = run.images.get((sc, "extree"))
        if not im:
            continue
        allow = 1.05 * int(im["data_bytes"]) + 64 * MiB
        frac = int(im["host_bytes"]) / allow
        if worst is None or frac > worst[0]:
            worst = (frac, sc, im)
    if worst:
        frac, sc, im = worst
        txt = (f"worst {sc}: {nbytes(im['host_bytes'])} for "
               f"{nbytes(im['data_bytes'])} of data ({frac:.2f} of the "
               f"allowance)")
        ok = frac <= 1
    rows.append(["host space ≤ 1.05 × data + 64 MiB", REF["space"], txt,
                 verdict(ok, "the 64 MiB allowance is more than the quick "
                         "images' data")])
    # IOPS
    parts, oks = [], []
    for m in ("bench-read-d1", "bench-read-d32"):
        for c in ("warm", "cold"):
            r = ratio(run.med("S2", "extree", m, c),
                      run.med("S2", "qcow2-4k", m, c))
            if r is not None:
                parts.append(f"{r:.2f}× ({m[6:]}, {c})")
                oks.append(r >= 1)
    rows.append(["S2 random 4 KiB read IOPS ≥ qcow2 4 KiB's", "—",
                 "; ".join(parts) or "—",
                 verdict(all(oks) if oks else None,
                         "the quick image's metadata fits qcow2's caches, "
                         "and each run lasts only "
                         f"{run.meta['bench_secs']} s")])
    # depth scaling with a metadata cache smaller than the tree
    parts, oks = [], []
    for c in ("warm", "cold"):
        r = ratio(run.med("S2", "extree", "bench-read-d32-cache8m", c),
                  run.med("S2", "extree", "bench-read-d1-cache8m", c))
        if r is not None:
            parts.append(f"{r:.2f}× ({c})")
            oks.append(r >= 2)
    rows.append(["S2 random 4 KiB reads with cache-size=8M: depth 32 ≥ 2× "
                 "depth 1's IOPS", "—", "; ".join(parts) or "—",
                 verdict(all(oks) if oks else None,
                         "the quick image's tree fits in 8 MiB")])
    return rows


def wrap(text, indent="", first=None):
    first = indent if first is None else first
    return textwrap.fill(text, width=78, initial_indent=first,
                         subsequent_indent=indent, break_on_hyphens=False,
                         break_long_words=False)


# ---------------------------------------------------------------- page

def section(run, top):
    m = run.meta
    out = []
    title = f"Results at {run.name} scale"
    if run.div != 1:
        title += f" (sizes divided by {run.div})"
    out += [title, "=" * len(title), ""]
    parts = m.get("parts") or []
    if len(parts) <= 1:
        out.append(f"Measured {m['started']} with ``{m['command']}`` "
                   f"({m['runs']} runs, each cold and warm; "
                   f"{m.get('duration_s', '?')} s in all).")
    else:
        out.append(f"Measured in {len(parts)} parts (``--append``), "
                   f"{m['runs']} runs each, cold and warm, "
                   f"{m.get('duration_s', '?')} s in all:")
        out.append("")
        for p in parts:
            out.append(wrap(
                f"{p['started']}: ``{p['command']}`` "
                f"({p.get('duration_s', '?')} s; load average "
                f"{' '.join(p.get('loadavg_start') or ['?'])} at the "
                f"start, {' '.join(p.get('loadavg_end') or ['?'])} at the "
                f"end; qemu-img sha256 "
                f"``{(p.get('qemu_img_sha256') or '?')[:16]}…``)",
                "  ", "- "))
        shas = {p.get("qemu_img_sha256") for p in parts}
        if len(shas) > 1:
            out.append("")
            out.append(wrap(
                f"The parts ran {len(shas)} different qemu-img binaries "
                "(sha256 above): every row of a table comes from the part "
                "that measured its scenario and measure, so the formats it "
                "compares ran through the same binary.  "
                "``docs/performance-notes.rst`` says what each binary was "
                "built from."))
    out.append("")
    free = m["free_g"].strip().splitlines()
    mem = free[1].split()[1] if len(free) > 1 else "?"
    out.append(f"- Machine: {m['nproc']} CPUs (``nproc``), {mem} GiB of "
               f"memory (``free -g``), kernel {m['kernel']} "
               f"(``uname -r``); shared with other jobs, load average "
               f"{' '.join(m['loadavg_start'])} at the start, "
               f"{' '.join(m.get('loadavg_end', ['?']))} at the end.")
    out.append(f"- QEMU: {m['qemu_version']} "
               f"(build/qemu-version.txt); qemu-img sha256 "
               f"{'of the last part ' if len(parts) > 1 else ''}"
               f"``{m['qemu_img_sha256'][:16]}…``; extree driver "
               f"{'present' if m['extree_driver'] else 'ABSENT: extree was not measured'}.")
    fss = m.get("filesystems", {})
    out.append("- Filesystems (loop devices over sparse files): " +
               "; ".join(f"{k}: {' '.join(v.split()[:1])} ``"
                         f"{v.split()[-1].strip('()')}``"
                         for k, v in sorted(fss.items())) +
               f".  qcow2 and extree images live on {m['image_fs']}.")
    out.append(f"- ``/usr/bin/time`` (peak RSS) adds about "
               f"{m.get('time_wrapper_ms', '?')} ms to every timed run; "
               f"starting ``/bin/true`` takes {m.get('true_ms', '?')} ms.")
    out.append("")

    def sub(t):
        out.extend([t, "-" * len(t), ""])

    sub("Targets of issue 5")
    if run.div != 1:
        out.append(f"At 1/{run.div} of the sizes the absolute targets cannot "
                   "be judged: the images have 1/64 of the extents, so "
                   "process start-up and open (a few ms) dominate every "
                   "time, and S3's 2,048 extents are not the llseek case.  "
                   "Ratios are shown as indications only; the instructions "
                   "per block-status call do not depend much on the size.")
        out.append("")
    for tgt, ref, meas, verd in targets(run):
        out.append(wrap(tgt, "  ", "- "))
        out.append("")
        out.append(wrap(f"reference (QEMU 10.0.13 on these machines): {ref}",
                        "    ", "  - "))
        out.append(wrap(f"measured at {run.name} scale: {meas}", "    ",
                        "  - "))
        out.append(wrap(f"verdict: {verd}", "    ", "  - "))
        out.append("")

    fmts = run.formats()
    scen = [s for s in run.scenarios if not s.startswith("SCALE-")]

    sub("Images")
    rows = []
    for sc in run.scenarios:
        for f in fmts:
            im = run.images.get((sc, f))
            if im:
                ratio_ = int(im["host_bytes"]) / max(1, int(im["data_bytes"]))
                rows.append([sc, f, im["host_fs"], nbytes(im["data_bytes"]),
                             nbytes(im["host_bytes"]), f"{ratio_:.2f}",
                             im["host_extents"], im["map_entries"],
                             f"{float(im['build_s']):.1f} s",
                             im["check"] or "—"])
    out.append("Host space is the image file's allocated blocks after "
               "``sync``; host extents are what FIEMAP reports for it; map "
               "entries are the lines of ``qemu-img map --output=json``.")
    out.append("")
    out.append(table(["Scenario", "Format", "On", "Data", "Host space",
                      "Space/data", "Host extents", "Map entries", "Build",
                      "qemu-img check"], rows))
    for sc in scen:
        out.append(f"- {sc}: {images.layout(sc, run.div).desc}.")
    scal = [s for s in run.scenarios if s.startswith("SCALE-")]
    if scal:
        out.append("- SCALE-N: N extents of 4 KiB every 64 KiB in random "
                   f"order, N = {', '.join(s[6:] for s in scal)}" +
                   (f"; S2 is the same layout with "
                    f"{images.layout('S2', run.div).guest_runs:,} extents "
                    "and is plotted with them." if "S2" in run.scenarios and
                    not any(s.endswith("e6") for s in scal) else "."))
    out.append("")

    unmeasured = []   # (scenario, measure) no part of the run measured

    def measure_table(title, measure, show=secs, scs=None, note=None,
                      caches=("warm", "cold")):
        scs = [s for s in (scs or scen) if any(
            run.row(s, f, measure, c) or run.skip_reason(s, f, measure)
            for f in fmts for c in caches)]
        if not scs:
            return
        sub(title)
        if note:
            out.extend([note, ""])
        rows = [[f] + [cell(run, s, f, measure, show, caches) for s in scs]
                for f in fmts]
        unmeasured.extend((s, measure) for s in scs if not any(
            run.row(s, f, measure, c) for f in fmts for c in caches))
        out.append(table(["Format"] + [f"{s} ({' / '.join(caches)})"
                                       for s in scs], rows))

    measure_table("qemu-img map --output=json", "map",
                  note="Median wall time of the whole command, output to "
                       "/dev/null.")
    measure_table("qemu-img map --output=json, stock qemu-img", "map-stock",
                  note="The same command with qemu-img built without "
                       "patches/qemu/0004 (one coroutine for the walk, file "
                       "names refreshed only when the file changes, a "
                       "cheap formatter): the patch helps every format.")
    measure_table("nbdinfo --map through qemu-storage-daemon", "nbdmap",
                  note="Client wall time of the whole nbdinfo --map; the "
                       "image exported read-only over a unix socket.")
    measure_table("nbdinfo --map: the server's CPU time", "nbdmap-server",
                  note="User + system CPU time of qemu-storage-daemon "
                       "during the map (/proc/PID/stat): what the format "
                       "costs the server, below the client's floor.")
    measure_table("Allocation query: qemu-io -c \"alloc 0 <size>\"", "alloc",
                  note="qemu-io's alloc and map ask whether the format layer "
                       "allocated each range (block status without "
                       "want_zero).  For raw the answer is always \"all of "
                       "it\" without asking the host filesystem, so the raw "
                       "rows time only start-up and open.")
    measure_table("Allocation map: qemu-io -c map", "qmap")
    measure_table("Open only: qemu-io -c quit", "open",
                  note="Start-up, open and close: subtracted from the alloc "
                       "time to estimate the query itself.")

    if run.has("S3") or run.has("S3L"):
        sub("S3: the first hole from offset 0")
        rows = []
        for f in fmts:
            for c in ("warm", "cold"):
                a = run.med("S3", f, "alloc", c)
                o = run.med("S3", f, "open", c)
                h = run.med("S3", f, "seekhole", c)
                if a is None and h is None:
                    continue
                diff = secs(a - o) if None not in (a, o) else "—"
                if f.startswith("raw-"):
                    diff = "n/a (raw)"
                rows.append([f, c, secs(a), secs(o), diff, secs(h)])
        for c in ("warm", "cold"):
            h = run.med("S3L", "raw-btrfs", "seekhole", c)
            if h is not None:
                rows.append(["raw-btrfs, S3L (compress=lzo)", c, "—", "—",
                             "—", secs(h)])
        out.append("``qemu-io -r -c \"alloc 0 <size>\"`` (whole command), "
                   "``qemu-io -r -c quit`` (open only), their difference, "
                   "and ``xfs_io -r -c \"seek -h 0\"`` (whole command) on "
                   "the raw files.  S3L is the 2022 btrfs patch's layout.")
        out.append("")
        out.append(table(["Format", "Cache", "alloc (whole)", "open only",
                          "alloc − open", "xfs_io seek -h 0"], rows))

    measure_table("qemu-img convert -O raw", "convert-raw",
                  note=f"Target: a new raw file on {m['image_fs']}, deleted "
                       "after each run.")
    measure_table("qemu-img convert to null-co", "convert-null",
                  note="``qemu-img convert -n --target-is-zero <img> "
                       "--target-image-opts driver=null-co,size=<size>``: "
                       "reads the data and skips the holes, writes nowhere.")
    for mm, label in (("bench-read-d1", "random 4 KiB reads, depth 1"),
                      ("bench-read-d32", "random 4 KiB reads, depth 32"),
                      ("bench-read-d1-cache8m", "random 4 KiB reads, depth 1, "
                       "cache-size=8M"),
                      ("bench-read-d32-cache8m", "random 4 KiB reads, "
                       "depth 32, cache-size=8M"),
                      ("bench-write-d1", "random 4 KiB writes, depth 1"),
                      ("bench-write-d32", "random 4 KiB writes, depth 32")):
        measure_table(f"qemu-img bench: {label} (IOPS)", mm,
                      show=lambda v: f"{v:,.0f}",
                      note="``qemu-img bench -t none -i native -s 4096`` with "
                           "a step of a prime number of 4 KiB blocks near "
                           "0.618 of the image (a Weyl sequence over every "
                           "block); the count is calibrated per format to "
                           "about " + f"{m['bench_secs']} s.  Reads land on "
                           "data in proportion to the image's density "
                           "(1/16 for S2).  Writes run last, each continuing "
                           "the walk where the previous one stopped, so "
                           "they mostly allocate." if mm == "bench-read-d1"
                      else None)

    snap = run.csv(f"snapshot-{run.name}")
    if snap:
        sub("Internal snapshots (scripts/bench-snapshot.py)")
        out.append(wrap("Whole ``qemu-img snapshot`` and ``qemu-io`` "
                        "commands on images converted from the layout's "
                        "raw file, on the image file system, after a "
                        "sync; medians over the rounds, formats "
                        "alternating.  delete: a snapshot whose every "
                        "data block was overwritten since (``qemu-img "
                        "convert -n``).  write: 1,000 scattered 4 KiB "
                        "overwrites by one qemu-io, without a snapshot "
                        "and right after one.  F: an image whose free "
                        "space is in as many pieces as its data (every "
                        "other 4 KiB block discarded), create and revert "
                        "only.  Targets (issue 21): "
                        "create and revert ≤ 20 ms, delete ≤ 2 s on S2, "
                        "host space after the delete within 1% of before "
                        "the snapshot."))
        out.append("")
        sfmts = list(dict.fromkeys(r["format"] for r in snap))
        labels = (("create", "snapshot -c"), ("revert", "snapshot -a"),
                  ("delete", "snapshot -d, data overwritten"),
                  ("write-plain", "1,000 writes, no snapshot"),
                  ("write-after-snapshot", "1,000 writes after -c"))
        for sc in dict.fromkeys(r["scenario"] for r in snap):
            rows = []
            for key, label in labels:
                cells = []
                for f in sfmts:
                    r = next((x for x in snap if x["scenario"] == sc and
                              x["format"] == f and x["measure"] == key),
                             None)
                    cells.append(secs(float(r["median_s"])) if r and
                                 r["median_s"] else "—")
                rows.append([label] + cells)
            out.append(f"{sc}:")
            out.append("")
            out.append(table(["Measure"] + sfmts, rows))
            for r in snap:
                if r["scenario"] == sc and r["measure"] in ("space", "*"):
                    out.append(wrap(f"{r['format']}, {r['measure']}: "
                                    f"{r['note']}", "  ", "- "))
            out.append("")

    reg = run.csv("regress")
    if reg:
        sub("Regression watch (scripts/bench-regress.py)")
        out.append(wrap("Whole commands that regressed once (issue 50), "
                        "medians over the rounds, each round running every "
                        "measure once.  startup: ``qemu-img info`` of a "
                        "small image, this build against Debian's own "
                        "qemu-img.  create, delete: ``qemu-img snapshot "
                        "-c``, and ``-d`` of a snapshot taken just before.  "
                        "write: one qemu-io writing 4 KiB into a hole, "
                        "without a snapshot, with one, and with 64 MiB "
                        "past host_end (a crash's grow-ahead: the one case "
                        "that reads every tree first).  The previous "
                        "round's figure and the target beside each."))
        out.append("")
        rows = [[r["scenario"], r["measure"], r["what"],
                 secs(float(r["median_s"])), r["previous"], r["target"],
                 r["note"]] for r in reg]
        out.append(table(["Scenario", "Measure", "What", "Median",
                          "Previous round", "Target", "Note"], rows))
        out.append("")

    sub("Peak RSS of qemu-img map (KiB, warm)")
    rows = []
    for f in fmts:
        r = []
        for s in scen:
            x = run.row(s, f, "map", "warm")
            r.append(x["rss_kib_median"] if x and x["rss_kib_median"]
                     else "—")
        rows.append([f] + r)
    out.append(table(["Format"] + scen, rows))

    if run.cg:
        sub("Instructions per block-status call (callgrind)")
        out.append("``valgrind --tool=callgrind qemu-img map --output=json`` "
                   "of the S1 image; inclusive instructions of the driver's "
                   "``bdrv_co_block_status`` callback over its calls "
                   "(callgrind_annotate --inclusive=yes shows the same).")
        out.append("")
        rows = [[r["scenario"], r["format"], r["function"], r["calls"],
                 f"{int(r['inclusive_ir']):,}", r["ir_per_call"],
                 f"{int(r['total_ir']):,}", r["total_ir_per_entry"]]
                for r in run.cg.values()]
        out.append(table(["Scenario", "Format", "Function", "Calls",
                          "Inclusive Ir", "Ir a call", "Program Ir",
                          "Program Ir per map entry"], rows))

    if scal:
        sub("Map time against extent count")
        png = os.path.join(run.dir, "map-scaling.png")
        if os.path.exists(png):
            rel = os.path.relpath(png, os.path.join(top, "docs"))
            out.append(f".. image:: {rel}")
            out.append(f"   :alt: qemu-img map time against extent count, "
                       f"{run.name} scale")
            out.append("")
        cols = list(scal)
        heads = [f"{s[6:]} extents (warm / cold)" for s in scal]
        if "S2" in run.scenarios and not any(s.endswith("e6") for s in scal):
            cols.append("S2")
            heads.append(f"S2, {images.layout('S2', run.div).guest_runs:,} "
                         "extents (warm / cold)")
        rows = [[f] + [cell(run, s, f, "map") for s in cols] for f in fmts]
        out.append(table(["Format"] + heads, rows))

    skips = sorted({(k[0], k[1], k[2], v) for k, v in run.skips.items()})
    if skips or unmeasured:
        sub("Not measured, and why")
    if skips:
        out.append("† in the tables above.")
        out.append("")
        for sc, f, mm, reason in skips:
            what = "everything" if mm == "*" else mm
            out.append(f"- {sc}, {f}, {what}: {reason}.")
        out.append("")
    if unmeasured:
        out.append(wrap("— in a whole column: no part of this run measured "
                        "it (" + ", ".join(f"{sc} {mm}"
                                           for sc, mm in unmeasured) +
                        "); ``docs/performance-notes.rst`` says why and "
                        "the ``scripts/bench.sh --append`` command that "
                        "adds it."))
        out.append("")
    return "\n".join(reflow(out))


def reflow(lines):
    """Wrap the long prose lines and bullets; tables and directives stay."""
    res = []
    for x in lines:
        if "\n" in x or len(x) <= 78 or x.startswith(".. ") or \
                x.startswith("   :"):
            res.append(x)
        elif x.startswith("- "):
            res.append(wrap(x[2:], "  ", "- "))
        else:
            res.append(wrap(x))
    return res


HEADER = """\
===========
Performance
===========

extree exists to make block-status queries fast on heavily fragmented
images.  This page compares it with qcow2 (64 KiB and 4 KiB clusters) and
raw sparse files on btrfs, XFS and ext4 (file-posix, ``SEEK_DATA`` /
``SEEK_HOLE``), as issue 5 asks: every figure of a scenario and measure
comes from one run in which the formats alternate, through one snapshot of
the ``build/qemu`` binaries.  This file is generated by
``scripts/bench-report.py`` from the CSVs under ``docs/performance/``; do not
edit it by hand.  Where the time goes, what was changed because of it and
what remains: ``docs/performance-notes.rst``.

Reproduce
=========

As root (loop devices, mounts and ``drop_caches``)::

    make bench                                   # full scale
    make bench BENCH_ARGS="--scale quick"        # sizes divided by 64

or ``scripts/bench.sh [--scale full|quick|1/N] [--runs N] [--scenarios
S1,S2,...] [--formats ...] [--measures ...] [--dir DIR]`` (``--help``).  It
installs what it lacks from Debian (btrfs-progs, xfsprogs, valgrind, time,
python3-matplotlib), makes btrfs, XFS and ext4 on loop devices over sparse
files under ``build/bench/fs``, mounts them under ``build/bench/mnt``, and
unmounts them and detaches its loop devices when it ends, however it ends.
Raw results land in ``build/bench/results/<scale>/`` and are copied, with the
plot, to ``docs/performance/<scale>/``; ``scripts/bench-report.py`` alone
regenerates this page from them.

Method
======

- Images: ``scripts/bench-images.py`` writes one qemu-io script per
  scenario (``write -q -P <pattern> <offset> <length>`` lines, the pattern
  byte derived from the offset); every format is built by feeding that
  script to ``qemu-io -t none`` (O_DIRECT, so the host filesystem allocates
  in write order and random order stays host-discontiguous).  Raw files are
  created with ``-o extent_size_hint=0``: by default qemu-img gives raw files
  on XFS a 1 MiB extent size hint, which preallocates unwritten extents
  around each write and would make them far from sparse.  qemu-img check
  runs on every qcow2 and extree image, and the extree image is compared with
  the raw one on XFS (``qemu-img compare``).
- Each measurement is a fresh process.  Cold: ``sync``, ``echo 3 >
  /proc/sys/vm/drop_caches``, then the QEMU binaries and their libraries are
  read back into the page cache, so cold means the image is not cached.
  Warm: the same command again straight after.  Inside each repetition the
  formats alternate (their order rotates), and each figure is the median of
  the repetitions.  Time is wall time from fork to exit.  Peak RSS comes from
  ``/usr/bin/time -f %M``.
- An image whose host space would exceed 32 GiB (``--max-image-gib``) or the
  free space is not built, and the page says so: qcow2 with 64 KiB clusters
  needs 64 GiB for S2's 4 GiB of data.
- The machine is shared (2 CPUs, other jobs compile): read the load average
  given with each run.
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--top", default=os.path.dirname(HERE))
    ap.add_argument("--results")
    a = ap.parse_args()
    perf = os.path.join(a.top, "docs", "performance")
    if a.results:
        meta = json.load(open(os.path.join(a.results, "meta.json")))
        dest = os.path.join(perf, meta["scale"].replace("/", "-"))
        # a new run replaces the last one's results; what scripts run
        # on their own wrote there stays unless this run has it too
        if os.path.isdir(dest):
            for f in os.listdir(dest):
                path = os.path.join(dest, f)
                if f in STANDALONE and not os.path.exists(
                        os.path.join(a.results, f)):
                    continue
                if os.path.isdir(path):
                    shutil.rmtree(path)
                else:
                    os.remove(path)
        os.makedirs(dest, exist_ok=True)
        for f in sorted(os.listdir(a.results)):
            if f.endswith((".csv", ".json")):
                shutil.copy2(os.path.join(a.results, f), dest)
    runs = []
    if os.path.isdir(perf):
        names = sorted(os.listdir(perf), key=lambda n: (
            SCALE_ORDER.index(n) if n in SCALE_ORDER else 9, n))
        for n in names:
            if os.path.exists(os.path.join(perf, n, "meta.json")):
                runs.append(Run(os.path.join(perf, n)))
    if not runs:
        sys.exit("bench-report: no results under docs/performance/")
    body = [HEADER]
    if not any(r.div == 1 for r in runs):
        body.append(wrap(
            "No full-scale results yet: only the scales below were run.  A "
            "full run is estimated (not measured) at 4 to 5 hours on these "
            "2-CPU machines, most of it cold conversions of S2 and the "
            "qemu-img bench runs, and needs about 30 GiB of free space; "
            "``--measures`` and ``--scenarios`` run parts of it.") + "\n")
    for run in runs:
        plot(run)
        body.append(section(run, a.top))
    page = os.path.join(a.top, "docs", "performance.rst")
    with open(page, "w") as f:
        f.write("\n".join(body).rstrip() + "\n")
    print(f"bench-report: wrote {os.path.relpath(page, a.top)} "
          f"({', '.join(r.name for r in runs)})")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Whole decode steps by Nsight Compute, one line per kernel kind (experiments/gpu-lease.sh's
ncu_step stage; issue 12).

Reads the CSV that `ncu --csv --print-units base --metrics gpu__time_duration.sum,
dram__bytes_read.sum,dram__bytes_write.sum,launch__registers_per_thread --log-file F` writes
(one row per kernel and metric: "ID", "Kernel Name", "Block Size", "Grid Size", "Metric Name",
"Metric Unit", "Metric Value", ...; other lines, such as ncu's ==PROF== log, are skipped), and
keeps the whole forward passes in it: a forward ends with the output head's matrix-vector product,
the launch with the largest grid (LLaMA3-8B: 128256 rows), so the window runs from the launch after
the first head to the last head. For each kernel kind (name, grid, block) it prints launches per
forward, the median and total microseconds per forward, DRAM bytes per launch and GB/s, and
registers; then the forward's kernel time. Against the step's time measured without ncu (TPOT),
the difference is what the gaps between kernels cost.

Usage: ncu_step.py FILE.csv [FILE.csv ...]
       ncu_step.py --check     (parses a made-up report and checks the arithmetic; CI runs it)
"""
import collections
import csv
import io
import statistics
import sys

DURATION = "gpu__time_duration.sum"
READ = "dram__bytes_read.sum"
WRITE = "dram__bytes_write.sum"
REGS = "launch__registers_per_thread"

# Units ncu may print a metric in, and their factor to nanoseconds or bytes (--print-units base
# gives "nsecond" and "byte"; the others in case a version scales anyway).
UNITS = {
    "nsecond": 1.0, "ns": 1.0, "usecond": 1e3, "us": 1e3, "msecond": 1e6, "ms": 1e6,
    "second": 1e9, "s": 1e9,
    "byte": 1.0, "kbyte": 1e3, "mbyte": 1e6, "gbyte": 1e9,
    "register/thread": 1.0, "": 1.0,
}


def number(value, unit):
    v = float(value.replace(",", "")) if value.strip() else 0.0
    return v * UNITS.get(unit.strip().lower(), 1.0)


def launches(text):
    """The report's kernels in launch order: dicts of id, name, grid, block and metrics."""
    rows = [r for r in csv.reader(io.StringIO(text)) if len(r) > 10]
    head = next((r for r in rows if "Metric Name" in r and "Kernel Name" in r), None)
    if head is None:
        return []
    col = {name: i for i, name in enumerate(head)}
    by_id = collections.OrderedDict()
    for r in rows:
        if r is head or len(r) != len(head) or r[col["Metric Name"]] == "Metric Name":
            continue
        k = by_id.setdefault(r[col["ID"]], {
            "name": r[col["Kernel Name"]].split("(")[0].strip(),
            "grid": r[col["Grid Size"]].strip() if "Grid Size" in col else "",
            "block": r[col["Block Size"]].strip() if "Block Size" in col else "",
        })
        k[r[col["Metric Name"]]] = number(r[col["Metric Value"]], r[col["Metric Unit"]])
    return [by_id[i] for i in sorted(by_id, key=lambda i: int(i))]


def grid_x(g):
    part = g.strip("()").split(",")[0].strip()
    return int(part) if part else 0


def whole_forwards(ks):
    """The launches of the whole forwards in ks, and how many forwards that is. The head is the
    launch with the widest grid in x (its rows; a prefill's head of several tokens has more
    blocks in y, oato's staged kernels one grid row a token, but the same x)."""
    if not ks:
        return [], 0
    top = max(grid_x(k["grid"]) for k in ks)
    heads = [i for i, k in enumerate(ks) if grid_x(k["grid"]) == top]
    if len(heads) < 2:
        return [], 0
    return ks[heads[0] + 1:heads[-1] + 1], len(heads) - 1


def summary(ks):
    """Lines of the summary of one report."""
    window, forwards = whole_forwards(ks)
    if forwards == 0:
        if not ks:
            return ["no kernels in the report"]
        # Fewer than two heads: the whole window, counted as one "forward" (not a whole one).
        lines = [f"{len(ks)} kernels profiled, fewer than two output-head launches: figures for "
                 "the whole window, not per forward"]
        window, forwards = ks, 1
    else:
        lines = [f"{len(ks)} kernels profiled; {forwards} whole forward(s) of "
                 f"{len(window) // forwards} launches each"]
    kinds = collections.OrderedDict()
    for k in window:
        kinds.setdefault((k["name"], k["grid"], k["block"]), []).append(k)
    lines += [
        f"{'kernel':<32} {'grid':<16} {'block':<12} {'per fwd':>7} {'median us':>10} "
        f"{'us/fwd':>9} {'MB/launch':>10} {'GB/s':>8} {'regs':>5}",
    ]
    total = 0.0
    rows = []
    for (name, grid, block), ls in kinds.items():
        t = [k.get(DURATION, 0.0) / 1e3 for k in ls]
        b = [k.get(READ, 0.0) + k.get(WRITE, 0.0) for k in ls]
        us_fwd = sum(t) / forwards
        total += us_fwd
        gbs = sum(b) / (sum(t) * 1e3) if sum(t) > 0 else 0.0
        regs = int(max(k.get(REGS, 0.0) for k in ls))
        rows.append((us_fwd, f"{name[:32]:<32} {grid:<16} {block:<12} {len(ls) / forwards:>7.2f} "
                             f"{statistics.median(t):>10.2f} {us_fwd:>9.1f} "
                             f"{statistics.median(b) / 1e6:>10.2f} {gbs:>8.1f} {regs:>5}"))
    lines += [r for _, r in sorted(rows, key=lambda r: -r[0])]
    moved = sum(k.get(READ, 0.0) + k.get(WRITE, 0.0) for k in window) / forwards
    lines.append(f"kernel time a forward: {total:.1f} us for {moved / 1e6:.1f} MB of DRAM traffic "
                 f"({moved / (total * 1e3) if total else 0.0:.1f} GB/s over the kernels' time); "
                 "against the step's TPOT, the rest is gaps between kernels")
    return lines


def check():
    """A made-up report: a startup kernel, a prefill's head (8 grid rows, one a token), then
    three forwards of (norm, matvec, head), the last one cut off; ncu log lines and a repeated
    header between."""
    out = io.StringIO()
    w = csv.writer(out, quoting=csv.QUOTE_ALL)
    cols = ["ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream",
            "Block Size", "Grid Size", "Device", "CC", "Section Name", "Metric Name",
            "Metric Unit", "Metric Value"]
    out.write("==PROF== Connected to process 1 (oato)\n")
    w.writerow(cols)
    seq = [("mmq_check", "(1, 1, 1)", 5000, 0),
           ("mmvq_q6_K(const void *, int)", "(32064, 8, 1)", 150000, 400_000_000)]  # a prefill's head
    for _ in range(3):
        seq += [("rms_norm_q8_1", "(1, 1, 1)", 2000, 32768), ("mmvq_q4_0", "(1024, 1, 1)", 6000, 9437184),
                ("mmvq_q6_K(const void *, int)", "(32064, 1, 1)", 100000, 400_000_000)]
    seq = seq[:-2]  # the third forward cut off after its norm
    for i, (name, grid, ns, by) in enumerate(seq):
        for metric, unit, v in ((DURATION, "nsecond", f"{ns:,}"), (READ, "byte", str(by)),
                                (WRITE, "byte", "0"), (REGS, "register/thread", "40")):
            w.writerow([str(i), "1", "oato", "h", name, "1", "7", "(32, 4, 1)", grid, "0", "9.0",
                        "Command line profiler metrics", metric, unit, v])
        if i == 4:
            w.writerow(cols)
    ks = launches(out.getvalue())
    assert len(ks) == 9, ks
    assert ks[4]["name"] == "mmvq_q6_K" and ks[2][DURATION] == 2000.0, ks
    window, forwards = whole_forwards(ks)
    assert forwards == 2 and [k["name"] for k in window] == ["rms_norm_q8_1", "mmvq_q4_0", "mmvq_q6_K"] * 2, window
    text = "\n".join(summary(ks))
    assert "2 whole forward(s) of 3 launches each" in text, text
    assert "kernel time a forward: 108.0 us for 409.5 MB" in text, text
    # mmvq_q4_0: 9437184 bytes in 6 us = 1572.9 GB/s.
    assert any(l.startswith("mmvq_q4_0") and " 1572.9 " in l for l in text.splitlines()), text
    # Fewer than two heads: the window's figures, said to be no forward's.
    text = "\n".join(summary(ks[:3]))
    assert "fewer than two output-head launches" in text and "kernel time a forward: 157.0 us" in text, text
    print("ncu_step.py --check: OK")


def main(argv):
    if argv[1:] == ["--check"]:
        check()
        return 0
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    for path in argv[1:]:
        try:
            text = open(path, errors="replace").read()
        except OSError as e:
            print(f"== {path}: {e}")
            continue
        print(f"== {path}")
        for line in summary(launches(text)):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

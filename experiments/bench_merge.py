#!/usr/bin/env python3
"""Merges llama-bench and `oato bench` JSON outputs into one CSV and one markdown report.

Usage:
  bench_merge.py --csv OUT.csv --md OUT.md --date D --commit C --threads T --reps R \
      [--llamacpp VERSION] [--note TEXT] \
      --run TYPE MODEL LLAMA_JSON OATO_JSON [--run ...]

LLAMA_JSON and OATO_JSON may each list several files, comma-separated (the engines run in turn,
a repetition or a test at a time): their repetitions are pooled, and the i-th file of one engine
holding a test is paired with the other engine's i-th holding it (each pair's ratio; the median
and range of the pairs' ratios go in the table). Both engines write llama-bench's JSON (an
array of objects with n_prompt, n_gen, avg_ts, stddev_ts, cpu_info); one CSV row is written per
model type x test x engine, and one markdown table per type compares the two (ratio = oato /
llama.cpp; above 1 means oato is faster).

Decode's fraction of the memory's bandwidth: `oato bench --json` adds to a CPU decode test the
weight bytes each token reads (`weight_bytes_per_token`) and the memory's read rates measured
around its runs (`membw_gbps`), and after its timed runs each token against plain reads of as
many bytes just before and after it (`membw_paired_fractions`, oato only); a file PATH.membw
next to a llama-bench JSON holds the rates measured just before and after that run (numbers
separated by white space). Each file's
weights GB/s (bytes per token x t/s) over the mean of its rates is that run's fraction; the
table gives each engine's median. Standard library only.
"""

import argparse
import csv
import json
import statistics
import sys

ENGINES = (("llama.cpp", 2), ("oato", 3))  # (name, index of its JSON in a --run)
CSV_FIELDS = ["date", "commit", "cpu", "threads", "model", "type", "test", "engine", "avg_ts", "stddev_ts"]


def test_name(r):
    p, g = int(r["n_prompt"]), int(r["n_gen"])
    if g == 0:
        name = f"pp{p}"
    elif p == 0:
        name = f"tg{g}"
    else:
        name = f"pp{p}+tg{g}"
    d = int(r.get("n_depth") or 0)
    # llama-bench's form for a test after d tokens in the cache (-d).
    return f"{name} @ d{d}" if d else name


def test_key(name):
    """pp tests before tg tests, each by length, then by depth."""
    test, _, depth = name.partition(" @ d")
    head = test.split("+")[0]
    kind, n = head[:2], head[2:]
    return (0 if kind == "pp" else 1, int(n) if n.isdigit() else 0, int(depth or 0), name)


def load_one(path):
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        sys.exit(f"error: {path}: not a llama-bench JSON array: {e}")
    if not isinstance(data, list) or not data:
        sys.exit(f"error: {path}: expected a non-empty JSON array of tests")
    out = {}
    for r in data:
        for f in ("n_prompt", "n_gen", "avg_ts", "stddev_ts"):
            if f not in r:
                sys.exit(f"error: {path}: a test has no {f!r}")
        out[test_name(r)] = r
    return out


def load_membw(path):
    """The memory's rates measured around a llama-bench run (PATH.membw), or None."""
    try:
        with open(path + ".membw") as f:
            rates = [float(x) for x in f.read().split()]
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        sys.exit(f"error: {path}.membw: expected numbers (GB/s): {e}")
    return rates or None


def load(paths):
    """One engine's tests from a JSON file, or from several (comma-separated: runs of the same
    tests taken in turn with the other engine's), their repetitions pooled: avg_ts and stddev_ts
    over every repetition (`samples_ts`, else the file's avg_ts as one); `runs` keeps each
    file's record of the test in order (for the pairs' ratios and the fractions)."""
    out = {}
    for p in paths.split(","):
        rates = load_membw(p)
        for t, r in load_one(p).items():
            if rates and "membw_gbps" not in r:
                r = dict(r, membw_gbps=rates)
            out.setdefault(t, []).append(r)
    pooled = {}
    for t, rs in out.items():
        samples = [x for r in rs for x in (r.get("samples_ts") or [r["avg_ts"]])]
        if len(rs) == 1:
            pooled[t] = dict(rs[0], runs=rs)
            continue
        mean = sum(samples) / len(samples)
        sd = (sum((x - mean) ** 2 for x in samples) / (len(samples) - 1)) ** 0.5 if len(samples) > 1 else 0.0
        pooled[t] = dict(rs[0], avg_ts=mean, stddev_ts=sd, samples_ts=samples, runs=rs)
    return pooled


def pair_ratios(lr, orr):
    """oato / llama.cpp for each pair of runs (the i-th of each engine)."""
    return [o["avg_ts"] / l["avg_ts"] for l, o in zip(lr["runs"], orr["runs"]) if l["avg_ts"] > 0]


def fraction(r, per_token):
    """(weights GB/s, median fraction of the memory's rate) over an engine's runs of a decode
    test, or None without the bytes per token or the rates."""
    fr, gb = [], []
    for run in r["runs"]:
        rates = run.get("membw_gbps")
        if not per_token or not rates:
            continue
        g = per_token * run["avg_ts"] / 1e9
        gb.append(g)
        fr.append(g / (sum(rates) / len(rates)))
    return (sum(gb) / len(gb), statistics.median(fr)) if fr else None


def fmt_fraction(x):
    """An engine's (GB/s, fraction) cell, or a dash without one."""
    return f"{x[0]:.1f} ({x[1]:.2f})" if x else "–"


def fmt(r):
    return f"{r['avg_ts']:.2f} ± {r['stddev_ts']:.2f}" if r else "–"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--csv", required=True)
    ap.add_argument("--md", required=True)
    ap.add_argument("--date", required=True)
    ap.add_argument("--commit", required=True)
    ap.add_argument("--threads", required=True)
    ap.add_argument("--reps", required=True)
    ap.add_argument("--llamacpp", default="unknown")
    ap.add_argument("--title", default="oato vs llama.cpp on the CPU (llama-bench's tests)")
    ap.add_argument("--note", default="")
    ap.add_argument("--run", nargs=4, action="append", required=True,
                    metavar=("TYPE", "MODEL", "LLAMA_JSON", "OATO_JSON"))
    a = ap.parse_args()

    runs = []
    cpu = ""
    for typ, model, llama_json, oato_json in a.run:
        results = {"llama.cpp": load(llama_json), "oato": load(oato_json)}
        cpu = cpu or next(iter(results["oato"].values())).get("cpu_info", "")
        runs.append((typ, model, results))

    with open(a.csv, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for typ, model, results in runs:
            tests = sorted(set(results["llama.cpp"]) | set(results["oato"]), key=test_key)
            for t in tests:
                for engine, _ in ENGINES:
                    r = results[engine].get(t)
                    if r is None:
                        continue
                    w.writerow({
                        "date": a.date, "commit": a.commit, "cpu": cpu, "threads": a.threads,
                        "model": model, "type": typ, "test": t, "engine": engine,
                        "avg_ts": f"{r['avg_ts']:.4f}", "stddev_ts": f"{r['stddev_ts']:.4f}",
                    })

    lines = [
        f"# {a.title}",
        "",
        f"- date: {a.date}",
        f"- oato commit: {a.commit}",
        f"- llama.cpp: {a.llamacpp}",
        f"- CPU: {cpu}",
        f"- threads: {a.threads}, repetitions: {a.reps} (after one warm-up run)",
        "- t/s: mean ± sample standard deviation of the repetitions' tokens per second; "
        "ratio = oato ÷ llama.cpp (above 1: oato faster) of the means; pairs: the median "
        "(min–max) of the ratios of runs taken one after the other",
        "- decode (tg) GB/s: the weight bytes a token reads (oato's count, the same file for "
        "both) x t/s; fraction: over the memory's read rate (`oato bench --membw`'s loop, at "
        "the same threads) measured just before and after each run, the median of the runs; "
        "oato paired: the median over oato's runs of its tokens after the timed runs, each over "
        "plain reads of as many bytes on the same threads just before and after it",
    ]
    if a.note:
        lines.append(f"- note: {a.note}")
    for typ, model, results in runs:
        lines += ["", f"## {typ} ({model})", "",
                  "| test | llama.cpp t/s | oato t/s | oato ÷ llama.cpp | pairs | "
                  "decode GB/s (fraction) llama.cpp / oato |",
                  "| --- | ---: | ---: | ---: | ---: | ---: |"]
        tests = sorted(set(results["llama.cpp"]) | set(results["oato"]), key=test_key)
        for t in tests:
            lr, orr = results["llama.cpp"].get(t), results["oato"].get(t)
            ratio = f"{orr['avg_ts'] / lr['avg_ts']:.2f}" if lr and orr and lr["avg_ts"] > 0 else "–"
            pairs = pair_ratios(lr, orr) if lr and orr else []
            pairs = (f"{statistics.median(pairs):.2f} ({min(pairs):.2f}–{max(pairs):.2f})"
                     if len(pairs) > 1 else "–")
            per_token = next((r.get("weight_bytes_per_token") for r in (orr or {}).get("runs", [])
                              if r.get("weight_bytes_per_token")), None)
            frs = [fraction(r, per_token) if r else None for r in (lr, orr)]
            fr = " / ".join(map(fmt_fraction, frs)) if any(frs) else "–"
            paired = [f for r in (orr or {}).get("runs", [])
                      for f in r.get("membw_paired_fractions") or []]
            if paired:
                fr += f"; oato paired {statistics.median(paired):.2f}"
            lines.append(f"| {t} | {fmt(lr)} | {fmt(orr)} | {ratio} | {pairs} | {fr} |")
    with open(a.md, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Merges llama-bench and `oato bench` JSON outputs into one CSV and one markdown report.

Usage:
  bench_merge.py --csv OUT.csv --md OUT.md --date D --commit C --threads T --reps R \
      [--llamacpp VERSION] [--note TEXT] \
      --run TYPE MODEL LLAMA_JSON OATO_JSON [--run ...]

LLAMA_JSON and OATO_JSON may each list several files, comma-separated (the engines run in turn,
a repetition at a time): their repetitions are pooled. Both engines write llama-bench's JSON (an
array of objects with n_prompt, n_gen, avg_ts, stddev_ts, cpu_info); one CSV row is written per model type x test x engine, and one markdown
table per type compares the two (ratio = oato / llama.cpp; above 1 means oato is faster).
Standard library only.
"""

import argparse
import csv
import json
import sys

ENGINES = (("llama.cpp", 2), ("oato", 3))  # (name, index of its JSON in a --run)
CSV_FIELDS = ["date", "commit", "cpu", "threads", "model", "type", "test", "engine", "avg_ts", "stddev_ts"]


def test_name(r):
    p, g = int(r["n_prompt"]), int(r["n_gen"])
    if g == 0:
        return f"pp{p}"
    if p == 0:
        return f"tg{g}"
    return f"pp{p}+tg{g}"


def test_key(name):
    """pp tests before tg tests, each by length."""
    head = name.split("+")[0]
    kind, n = head[:2], head[2:]
    return (0 if kind == "pp" else 1, int(n) if n.isdigit() else 0, name)


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


def load(paths):
    """One engine's tests from a JSON file, or from several (comma-separated: runs of the same
    tests taken in turn with the other engine's), their repetitions pooled: avg_ts and stddev_ts
    over every repetition (`samples_ts`, else the file's avg_ts as one)."""
    files = [load_one(p) for p in paths.split(",")]
    if len(files) == 1:
        return files[0]
    out = {}
    for t in files[0]:
        rs = [f[t] for f in files if t in f]
        samples = [x for r in rs for x in (r.get("samples_ts") or [r["avg_ts"]])]
        mean = sum(samples) / len(samples)
        sd = (sum((x - mean) ** 2 for x in samples) / (len(samples) - 1)) ** 0.5 if len(samples) > 1 else 0.0
        out[t] = dict(rs[0], avg_ts=mean, stddev_ts=sd, samples_ts=samples)
    return out


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
        "# oato vs llama.cpp on the CPU (llama-bench's tests)",
        "",
        f"- date: {a.date}",
        f"- oato commit: {a.commit}",
        f"- llama.cpp: {a.llamacpp}",
        f"- CPU: {cpu}",
        f"- threads: {a.threads}, repetitions: {a.reps} (after one warm-up run)",
        "- t/s: mean ± sample standard deviation of the repetitions' tokens per second; "
        "ratio = oato ÷ llama.cpp (above 1: oato faster)",
    ]
    if a.note:
        lines.append(f"- note: {a.note}")
    for typ, model, results in runs:
        lines += ["", f"## {typ} ({model})", "",
                  "| test | llama.cpp t/s | oato t/s | oato ÷ llama.cpp |",
                  "| --- | ---: | ---: | ---: |"]
        tests = sorted(set(results["llama.cpp"]) | set(results["oato"]), key=test_key)
        for t in tests:
            lr, orr = results["llama.cpp"].get(t), results["oato"].get(t)
            ratio = f"{orr['avg_ts'] / lr['avg_ts']:.2f}" if lr and orr and lr["avg_ts"] > 0 else "–"
            lines.append(f"| {t} | {fmt(lr)} | {fmt(orr)} | {ratio} |")
    with open(a.md, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Throughput of `oato serve` with and without continuous batching: for each --parallel N, a
server on 127.0.0.1, then C concurrent clients each sending R greedy completions of G tokens
(end-of-generation ignored, so every request makes exactly G); aggregate completion tokens/s over
the wall time, per-request latency p50/p99, and the mean decode batch from /metrics. Writes a
markdown report (commit, machine, load, the command) to --out.

    experiments/serve-batching.py --model models/synth-llama3.2-1b-Q4_0.gguf --parallel 1,4,8

Needs `cargo build --release` first (it runs target/release/oato). Standard library only.
"""

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def http(addr, path, body=None, timeout=600):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        f"http://{addr}{path}", data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def metrics(addr):
    _, text = http(addr, "/metrics")
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, v = line.rpartition(" ")
            try:
                out[name] = float(v)
            except ValueError:
                pass
    return out


def start_server(args, parallel):
    cmd = [
        os.path.join(REPO, "target/release/oato"), "serve", args.model, "--port", "0",
        "-t", str(args.threads), "--ctx", str(args.ctx), "--parallel", str(parallel),
        "--queue", str(max(64, args.clients)), "--device", "cpu",
    ]
    p = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = p.stdout.readline().strip()
    if not line.startswith("listening on http://"):
        p.kill()
        sys.exit(f"unexpected first line from the server: {line!r}")
    addr = line[len("listening on http://"):]
    for _ in range(1200):
        try:
            if http(addr, "/health", timeout=5)[0] == 200:
                return p, addr, cmd
        except OSError:
            pass
        time.sleep(0.1)
    p.kill()
    sys.exit("the server did not become ready")


def busy_processes(server_pid):
    """Other processes using the CPU (ps: CPU time over lifetime, 5% or more), for the report."""
    out = subprocess.run(
        ["ps", "-eo", "pid,pcpu,comm", "--sort=-pcpu"], capture_output=True, text=True
    ).stdout.splitlines()[1:]
    me = {str(os.getpid()), str(server_pid)}
    rows = []
    for line in out:
        pid, cpu, comm = line.split(None, 2)
        if pid in me or float(cpu) < 5.0:
            continue
        rows.append((pid, comm))
    return rows


def run_one(args, parallel):
    p, addr, cmd = start_server(args, parallel)
    try:
        # Warm-up: one request alone.
        http(addr, "/v1/completions", {"prompt": "Hello", "max_tokens": 4, "temperature": 0})
        before = metrics(addr)
        lat, toks, errors = [], [], []
        lock = threading.Lock()
        load0 = os.getloadavg()[0]
        others = set(busy_processes(p.pid))

        def client(c):
            for i in range(args.requests):
                body = {"prompt": f"Client {c}, story {i}: once upon a time",
                        "max_tokens": args.gen, "temperature": 0, "ignore_eos": True}
                t = time.perf_counter()
                status, text = http(addr, "/v1/completions", body)
                ms = (time.perf_counter() - t) * 1e3
                with lock:
                    if status != 200:
                        errors.append(f"{status}: {text[:200]}")
                        continue
                    lat.append(ms)
                    toks.append(json.loads(text)["usage"]["completion_tokens"])

        t0 = time.perf_counter()
        ts = [threading.Thread(target=client, args=(c,)) for c in range(args.clients)]
        for t in ts:
            t.start()
        last = t0
        while any(t.is_alive() for t in ts):
            time.sleep(1.0)
            if time.perf_counter() - last > 5:
                others.update(busy_processes(p.pid))
                last = time.perf_counter()
        wall = time.perf_counter() - t0
        after = metrics(addr)
        load1 = os.getloadavg()[0]
        if errors:
            sys.exit(f"--parallel {parallel}: {len(errors)} failed requests, e.g. {errors[0]}")
        lat.sort()
        pct = lambda q: lat[round((len(lat) - 1) * q)]
        steps = after.get("oato_decode_steps_total", 0) - before.get("oato_decode_steps_total", 0)
        stoks = (after.get("oato_decode_step_tokens_total", 0)
                 - before.get("oato_decode_step_tokens_total", 0))
        r = {
            "parallel": parallel, "requests": len(lat), "tokens": sum(toks), "wall_s": wall,
            "tps": sum(toks) / wall, "p50_ms": pct(0.5), "p99_ms": pct(0.99),
            "mean_ms": statistics.mean(lat), "mean_batch": stoks / steps if steps else 0.0,
            "load": (load0, load1), "others": sorted(others), "cmd": cmd,
        }
        print(f"--parallel {parallel}: {r['tokens']} tokens in {wall:.1f} s = {r['tps']:.2f} t/s, "
              f"latency p50 {r['p50_ms']:.0f} ms p99 {r['p99_ms']:.0f} ms, "
              f"mean decode batch {r['mean_batch']:.2f}, load {load0:.2f}->{load1:.2f}",
              flush=True)
        return r
    finally:
        p.kill()
        p.wait()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="models/synth-llama3.2-1b-Q4_0.gguf")
    ap.add_argument("--parallel", default="1,4,8")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=2, help="per client")
    ap.add_argument("--gen", type=int, default=32, help="tokens per request")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--out", default="results/serve-batching.md")
    ap.add_argument("--note", default="", help="a line for the report")
    ap.add_argument("--append", action="store_true", help="add to --out instead of replacing it")
    ap.add_argument("--probe", default="1,2,3,4,8,16",
                    help="batch sizes for examples/decode_batch after the runs ('' : none)")
    args = ap.parse_args()
    runs = [run_one(args, int(n)) for n in args.parallel.split(",")]

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                            capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                           capture_output=True, text=True).stdout.strip()
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
                if l.startswith("model name")), "?")
    base = runs[0]["tps"]
    title = [] if args.append else [
        "# `oato serve`: throughput with and without continuous batching", ""]
    lines = title + [
        f"## {os.path.basename(args.model)}",
        "",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%dT%H:%M:%SZ}",
        f"- commit: {commit}{' (with uncommitted changes)' if dirty else ''}",
        f"- machine: {cpu}, {os.cpu_count()} cores (how busy: the load column and the "
        f"processes below); oato on {args.threads} threads, the CPU only",
        f"- model: {os.path.basename(args.model)} (synthetic weights: its text is not real)"
        if "synth" in args.model else f"- model: {os.path.basename(args.model)}",
        f"- load: {args.clients} concurrent clients, {args.requests} requests each, "
        f"{args.gen} generated tokens per request (greedy, end-of-generation ignored), "
        f"--ctx {args.ctx}; one warm-up request first",
        f"- command: `{' '.join(shlex.quote(a) for a in sys.argv)}`",
        "- server: `" + " ".join(shlex.quote(a) for a in runs[0]["cmd"][1:]).replace(
            "--parallel " + str(runs[0]["parallel"]), "--parallel N") + "`",
    ]
    if args.note:
        lines.append(f"- note: {args.note}")
    lines += [
        "",
        "| --parallel | requests | tokens | wall s | tokens/s | × N=" + str(runs[0]["parallel"])
        + " | latency p50 ms | p99 ms | mean decode batch | load avg (start→end) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in runs:
        lines.append(
            f"| {r['parallel']} | {r['requests']} | {r['tokens']} | {r['wall_s']:.1f} | "
            f"{r['tps']:.2f} | {r['tps'] / base:.2f} | {r['p50_ms']:.0f} | {r['p99_ms']:.0f} | "
            f"{r['mean_batch']:.2f} | {r['load'][0]:.2f}→{r['load'][1]:.2f} |")
    seen = {}
    for pid, comm in {o for r in runs for o in r["others"]}:
        seen[comm] = seen.get(comm, 0) + 1
    others = [f"{comm} ×{n}" for comm, n in sorted(seen.items(), key=lambda x: -x[1])]
    lines += [
        "",
        "Other processes seen using the CPU during the runs (ps samples every 5 s; command and "
        "how many processes, each at 5% or more of a core over its life): "
        + (", ".join(others) if others else "none") + ".",
        "",
    ]
    probe = os.path.join(REPO, "target/release/examples/decode_batch")
    if args.probe and os.path.exists(probe):
        pcmd = [probe, args.model, str(args.threads)] + args.probe.split(",")
        pr = subprocess.run(pcmd, cwd=REPO, capture_output=True, text=True)
        out = pr.stdout + (f"(failed: {pr.stderr.strip()[-300:]})" if pr.returncode else "")
        lines += [
            "Decode step time against batch size, the forward pass alone (`"
            + " ".join(os.path.relpath(a, REPO) if a == probe else a for a in pcmd)
            + "`, after the runs above; `cargo build --release --example decode_batch`):",
            "",
            "```",
            out.strip(),
            "```",
            "",
        ]
    with open(os.path.join(REPO, args.out), "a" if args.append else "w") as f:
        f.write("\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

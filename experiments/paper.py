#!/usr/bin/env python3
"""Runs one of the paper's experiments from its config (configs/figN.toml) and draws its figure.

    experiments/paper.py configs/fig10.toml [--small] [--res DIR] [--figures DIR] [--no-plot]
                         [--models SHAPE,...] [--reps N] [--plot-only]

For each model of the config (synthesised with `oato synth` into $OATO_PAPER_MODELS, default
~/.cache/oato/paper-models, unless it names a `path`), each prompt length P and each number of
generated tokens G, it runs oato's policies at the config's budgets through
experiments/placement-sweep.sh (warm-up, then `reps` timed `oato run --json` runs each) and, where
the config lists the peer and its llama-bench is built, llama.cpp's -ngl at the same shares with op
offload on and off through experiments/hybrid-vs-llamacpp.sh. All rows go to RES/<figure>.csv in
DESIGN.md's results format (plus the plan's predicted TTFT/TPOT and the budget asked for), then
`oato plot` draws
FIGURES/<figure>.png and .svg with the paper's claims (paper-figures/paper-claims.csv).

--small runs the config's [small] table instead: the CPU-only variant CI runs (tests/paper.rs), on
the 135M test model and the smallest synthetic shape, with the CPU-backed test device
(OATO_TEST_DEVICE) standing in for the GPU; its defaults are RES=results/paper-small-cpu and
FIGURES=paper-figures/small-cpu.

--models runs only those of the config's models (by shape, or file name for a path) and writes
RES/<figure>-<models>.csv, so one figure can be run a model per call on a machine that limits a
command's time; the plot then takes RES/<figure>.csv and every RES/<figure>-*.csv. --reps
overrides the config's repetitions; --plot-only only redraws the figure from RES's CSVs.

A config that is not valid TOML, or has an unknown key or a value of the wrong kind, is refused
before anything runs, with its file and line.

Env: OATO_BIN (target/release/oato), OATO_PAPER_MODELS, LLAMA_BIN (llama-bench's folder; default
the CUDA build of experiments/build-llamacpp-cuda.sh, else the CPU peer in ~/.cache/oato-peers).
"""
import argparse
import csv
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
try:
    import tomllib
except ImportError:  # Python < 3.11
    try:
        import tomli as tomllib
    except ImportError:
        sys.exit("error: experiments/paper.py needs Python 3.11+ (tomllib) or the tomli package")
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIELDS = ["date", "commit", "device", "host_cpu", "threads", "model", "model_dtype", "policy",
          "vram_budget_bytes", "gpu_weight_fraction", "prompt_tokens", "gen_tokens", "rep",
          "load_ms", "ttft_ms", "tpot_ms", "e2e_ms", "tokens_per_s",
          "predicted_ttft_ms", "predicted_tpot_ms", "budget"]
POLICIES = {"oato", "oato-paper", "layer-split", "flexgen", "cpu", "gpu"}
PEERS = {"llama.cpp"}
PLOTS = {"e2e", "prompt-lengths", "gen-tokens", "budgets"}
RUN_KEYS = {"policies", "budgets", "prompt_tokens", "gen_tokens", "reps", "warmup", "threads",
            "ctx", "peers"}
MODEL_KEYS = {"shape", "type", "seed", "layers", "budgets", "path"}
LLAMA_BINS = [Path("/tmp/llamacpp-cuda/llama.cpp/build/bin"),
              Path.home() / ".cache/oato-peers/llama.cpp-py0.3.36/build/bin"]


class ConfigError(Exception):
    pass


class Config:
    """A config file's text, so that an error can name the line of the key at fault."""

    def __init__(self, path):
        self.path = path
        try:
            self.text = Path(path).read_text()
        except OSError as e:
            raise ConfigError(f"{path}: {e.strerror}") from e
        try:
            self.doc = tomllib.loads(self.text)
        except tomllib.TOMLDecodeError as e:  # its message names the line and column
            raise ConfigError(f"{path}: invalid TOML: {e}") from e
        self.where = {}

    def fail(self, key, msg):
        """Raises an error naming the line of `key`: the first after the header of the table the
        key came from (self.where: key -> table name), else the first anywhere."""
        lines = self.text.splitlines()
        start = 0
        table = self.where.get(key)
        if table:
            start = next((i for i, t in enumerate(lines)
                          if re.fullmatch(rf"\s*\[\[?\s*{re.escape(table)}\s*\]\]?\s*(#.*)?", t)), 0)
        line = next((i + 1 for i, t in enumerate(lines) if i >= start
                     and re.match(rf"\s*\[*\s*{re.escape(key)}\s*[=\]]", t)), None)
        where = f"{self.path}:{line}" if line else str(self.path)
        raise ConfigError(f"{where}: {key}: {msg}")

    def check_keys(self, table, allowed, what):
        for k in table:
            if k not in allowed:
                self.fail(k, f"unknown key in {what} (known: {', '.join(sorted(allowed))})")

    def ints(self, table, key, least, many=False):
        """A whole number >= least, or (many) a non-empty list of them."""
        v = table.get(key)
        vs = v if many and isinstance(v, list) else [v]
        if not vs or not all(isinstance(x, int) and not isinstance(x, bool) and x >= least for x in vs):
            what = "a list of whole numbers" if many else "a whole number"
            self.fail(key, f"needs {what} >= {least} (got {v!r})")
        return v

    def names(self, table, key, known):
        v = table.get(key, [])
        if not isinstance(v, list) or not all(isinstance(x, str) and (not known or x in known) for x in v):
            self.fail(key, f"needs a list of {' / '.join(sorted(known)) if known else 'strings'} (got {v!r})")
        return v

    def budgets(self, table):
        v = self.names(table, "budgets", None)
        for b in v:
            if not re.fullmatch(r"\d+(\.\d+)?(%|[KMGT]i?B?)?", b):
                self.fail("budgets", f"{b!r} is not a budget like 50% or 12G")
        return v


def load(path, small):
    """The experiment to run: run settings, models (each with its budgets), plot kind."""
    c = Config(path)
    d = c.doc
    c.check_keys(d, {"figure", "plot", "title", "run", "model", "small"}, "the file")
    for k in ("figure", "title"):
        if not isinstance(d.get(k), str):
            c.fail(k, "needs a string")
    if d.get("plot") not in PLOTS:
        c.fail("plot", f"needs one of {', '.join(sorted(PLOTS))}")
    run = dict(d.get("run") or c.fail("run", "the file needs a [run] table"))
    models = d.get("model")
    test_device = None
    if small:
        s = dict(d.get("small") or c.fail("small", "the file has no [small] table"))
        c.check_keys(s, RUN_KEYS | {"model", "test_device_bytes"}, "[small]")
        c.where = {**{k: "run" for k in run}, **{k: "small" for k in s}}
        models = s.pop("model", None)
        test_device = c.ints(s, "test_device_bytes", 1) if "test_device_bytes" in s else None
        s.pop("test_device_bytes", None)
        run.update(s)
    c.check_keys(run, RUN_KEYS, "[run]")
    if not isinstance(models, list) or not models:
        c.fail("model", "needs at least one [[model]] table")
    out = {
        "figure": d["figure"], "plot": d["plot"], "title": d["title"],
        "policies": c.names(run, "policies", POLICIES), "peers": c.names(run, "peers", PEERS),
        "prompt_tokens": c.ints(run, "prompt_tokens", 1, many=True),
        "gen_tokens": c.ints(run, "gen_tokens", 2, many=True),
        "reps": c.ints(run, "reps", 1), "warmup": c.ints(run, "warmup", 0),
        "threads": c.ints(run, "threads", 0), "ctx": c.ints(run, "ctx", 1),
        "test_device_bytes": test_device, "models": [],
    }
    for k in ("prompt_tokens", "gen_tokens"):
        if not isinstance(out[k], list):
            c.fail(k, "needs a list")
    default_budgets = c.budgets(run) if "budgets" in run else None
    for m in models:
        if not isinstance(m, dict):
            c.fail("model", f"needs [[model]] tables (got {m!r})")
        c.where = {k: "small.model" if small else "model" for k in m}
        c.check_keys(m, MODEL_KEYS, "[[model]]")
        if "path" in m and not isinstance(m["path"], str):
            c.fail("path", "needs a string")
        if "path" not in m:
            for k in ("shape", "type"):
                if not isinstance(m.get(k), str):
                    c.fail(k, "each [[model]] needs a shape and a type (or a path)")
        budgets = c.budgets(m) if "budgets" in m else default_budgets
        if not budgets:
            c.fail("budgets", "give budgets in [run] or in each [[model]]")
        out["models"].append({**m, "budgets": budgets,
                              "layers": c.ints(m, "layers", 1) if "layers" in m else None,
                              "seed": c.ints(m, "seed", 0) if "seed" in m else 42})
    return out


def model_file(oato, m, store):
    """The model's GGUF file: its path, or a synthetic file made once and kept in `store`."""
    if "path" in m:
        return Path(m["path"])
    layers = f"-L{m['layers']}" if m["layers"] else ""
    f = store / f"{m['shape']}-{m['type']}{layers}-s{m['seed']}.gguf"
    if not f.exists():
        store.mkdir(parents=True, exist_ok=True)
        tmp = f.with_suffix(".part")
        cmd = [oato, "synth", "--shape", m["shape"], "--type", m["type"], "--seed", str(m["seed"]),
               "-o", str(tmp)] + (["--layers", str(m["layers"])] if m["layers"] else [])
        print("==", " ".join(cmd), file=sys.stderr)
        subprocess.run(cmd, check=True)
        tmp.rename(f)
    return f


def sweep(oato, model, cfg, budget, p, g, threads, work, env):
    """oato's policies at one budget for prompt P and G tokens: placement-sweep.sh's rows, with
    the budget asked for (its CSV has the bytes and the share placed, not the flag)."""
    out = work / f"oato-{model.stem}-p{p}-g{g}-b{budget.rstrip('%')}"
    e = dict(env, OATO_BIN=oato, MODEL=str(model), OUT=str(out), PLAIN="", P=str(p), GEN=str(g),
             CTX=str(max(cfg["ctx"], p + g)), BUDGETS=budget,
             POLICIES=" ".join(cfg["policies"]), REPS=str(cfg["reps"]), WARMUP=str(cfg["warmup"]),
             THREADS=str(threads))
    subprocess.run([str(ROOT / "experiments/placement-sweep.sh")], env=e, check=True)
    with open(f"{out}.csv", newline="") as f:
        return [{**{k: r.get(k, "") for k in FIELDS}, "budget": budget} for r in csv.DictReader(f)]


def peer(bin_dir, model, cfg, budgets, p, g, threads, work, env, date):
    """llama.cpp's -ngl at each budget's share, op offload on and off (hybrid-vs-llamacpp.sh),
    one row per repetition from llama-bench's samples."""
    shares = [b[:-1] for b in budgets if b.endswith("%")]
    if not shares:
        return []
    res = work / f"peer-{model.stem}-p{p}-g{g}"
    e = dict(env, MODEL=str(model), LLAMA_BIN=str(bin_dir), SHARES=" ".join(shares), P=str(p),
             G=str(g), REPS=str(cfg["reps"]), THREADS=str(threads), RES=str(res))
    e.pop("OUT", None)
    subprocess.run([str(ROOT / "experiments/hybrid-vs-llamacpp.sh")], env=e, check=True,
                   stdout=subprocess.DEVNULL)
    rows = []
    with open(res / "llamacpp-hybrid.csv", newline="") as f:
        summary = list(csv.DictReader(f))
    for key in {(r["share"], r["ngl"], r["op_offload"]) for r in summary}:
        share, ngl, oo = key
        tests = json.load(open(res / "llamacpp-hybrid" / f"ngl{ngl}-nopo{1 - int(oo)}.json"))
        pp = next(t for t in tests if t["n_gen"] == 0)
        tg = next(t for t in tests if t["n_gen"] > 0)
        info = next(r for r in summary if (r["share"], r["ngl"], r["op_offload"]) == key)
        for rep, (pp_ns, tg_ns) in enumerate(zip(pp["samples_ns"], tg["samples_ns"]), 1):
            ttft = pp_ns / 1e6
            tpot = tg_ns / 1e6 / tg["n_gen"]
            rows.append({
                "date": date, "commit": "llama.cpp " + str(pp.get("build_commit", "")),
                "device": pp.get("gpu_info") or "cpu", "host_cpu": pp.get("cpu_info", ""),
                "threads": pp.get("n_threads", threads), "model": model.name,
                "model_dtype": pp.get("model_type", ""),
                "policy": "llama.cpp -ngl" + ("" if oo == "1" else " -nopo"),
                "vram_budget_bytes": "", "gpu_weight_fraction": info["gpu_weight_share"],
                "prompt_tokens": p, "gen_tokens": g, "rep": rep, "load_ms": "",
                "ttft_ms": round(ttft, 3), "tpot_ms": round(tpot, 4),
                "e2e_ms": round(ttft + (g - 1) * tpot, 3), "tokens_per_s": round(1000 / tpot, 2),
                "predicted_ttft_ms": "", "predicted_tpot_ms": "", "budget": f"{share}%",
            })
    return sorted(rows, key=lambda r: (r["gpu_weight_fraction"], r["policy"], r["rep"]))


def plot(oato, cfg, res, figs):
    """`oato plot` on RES/<figure>.csv and RES/<figure>-*.csv into FIGURES/<figure>.{png,svg}."""
    fig = cfg["figure"]
    csvs = [f for f in [res / f"{fig}.csv", *sorted(res.glob(f"{fig}-*.csv"))] if f.exists()]
    if not csvs:
        sys.exit(f"error: no {fig}.csv or {fig}-*.csv in {res}")
    figs.mkdir(parents=True, exist_ok=True)
    subprocess.run([oato, "plot", "--kind", cfg["plot"], "--title", cfg["title"], "--figure", fig,
                    "--claims", "paper-figures/paper-claims.csv", "-o", str(figs / fig),
                    *map(str, csvs)], check=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("config")
    ap.add_argument("--small", action="store_true", help="the CPU-only [small] variant")
    ap.add_argument("--res", help="folder of the results CSV")
    ap.add_argument("--figures", help="folder of the figures")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--plot-only", action="store_true", help="draw the figure from RES's CSVs, run nothing")
    ap.add_argument("--models", help="comma-separated shapes (or file names) of the config's models to run")
    ap.add_argument("--reps", type=int, help="repetitions instead of the config's")
    a = ap.parse_args()
    try:
        cfg = load(a.config, a.small)
    except ConfigError as e:
        sys.exit(f"error: {e}")
    name = lambda m: m.get("shape") or Path(m["path"]).name
    if a.models:
        want = a.models.split(",")
        unknown = [w for w in want if w not in {name(m) for m in cfg["models"]}]
        if unknown:
            sys.exit(f"error: --models: {a.config} has no model {', '.join(unknown)} "
                     f"(it has {', '.join(name(m) for m in cfg['models'])})")
        cfg["models"] = [m for m in cfg["models"] if name(m) in want]
    if a.reps is not None:
        if a.reps < 1:
            sys.exit("error: --reps needs a whole number >= 1")
        cfg["reps"] = a.reps
    given = {k: Path(v).resolve() for k, v in (("res", a.res), ("figs", a.figures)) if v}
    os.chdir(ROOT)
    oato = os.environ.get("OATO_BIN", "target/release/oato")
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    res = given.get("res") or Path("results/paper-small-cpu" if a.small else f"results/paper-{date[:10]}")
    figs = given.get("figs") or Path("paper-figures/small-cpu" if a.small else "paper-figures")
    store = Path(os.environ.get("OATO_PAPER_MODELS", Path.home() / ".cache/oato/paper-models"))
    threads = cfg["threads"] or os.cpu_count()
    env = dict(os.environ)
    if cfg["test_device_bytes"]:
        env["OATO_TEST_DEVICE"] = str(cfg["test_device_bytes"])
    bin_dir = Path(os.environ["LLAMA_BIN"]) if "LLAMA_BIN" in os.environ else next(
        (b for b in LLAMA_BINS if (b / "llama-bench").exists()), None)
    rows, failed = [], []
    fig = cfg["figure"]
    if a.plot_only:
        plot(oato, cfg, res, figs)
        return
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for m in cfg["models"]:
            try:
                model = model_file(oato, m, store)
                for p in cfg["prompt_tokens"]:
                    for g in cfg["gen_tokens"]:
                        for b in m["budgets"]:
                            rows += sweep(oato, model, cfg, b, p, g, threads, work, env)
                        if "llama.cpp" not in cfg["peers"]:
                            continue
                        if bin_dir is None or not (bin_dir / "llama-bench").exists():
                            print(f"note: llama.cpp peer skipped: no llama-bench (set LLAMA_BIN, or "
                                  "run experiments/build-llamacpp-cuda.sh)", file=sys.stderr)
                            continue
                        rows += peer(bin_dir, model, cfg, m["budgets"], p, g, threads, work, env, date)
            except (subprocess.CalledProcessError, OSError, KeyError, StopIteration) as e:
                print(f"error: {name(m)}: {e!r}", file=sys.stderr)
                failed.append(name(m))
    if not rows:
        sys.exit(f"error: {a.config}: no run succeeded")
    res.mkdir(parents=True, exist_ok=True)
    out = res / (f"{fig}-{'+'.join(name(m) for m in cfg['models'])}.csv" if a.models else f"{fig}.csv")
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {out} ({len(rows)} rows)", file=sys.stderr)
    if not a.no_plot:
        plot(oato, cfg, res, figs)
    if failed:
        sys.exit(f"error: {a.config}: models that failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()

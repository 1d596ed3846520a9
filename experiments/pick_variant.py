#!/usr/bin/env python3
"""The CUDA settings a lease's later stages run under (experiments/gpu-lease.sh; issues 10, 12).

The lease's kernels stage (experiments/gpu-vs-llamacpp.sh) times oato all on the GPU under each
of its variants (an environment each: OATO_CUDA_SPLIT=1, OATO_CUDA_MMVQ=direct, ...), one after
the other, and leaves in its raw folder `variants.tsv` (a line a variant: its name, a tab, its
VAR=VALUE settings separated by spaces, none for `default`) and `oato-NAME.json` (`oato bench
--json`: llama-bench's objects with n_prompt, n_gen, avg_ts). A device lease is 15 minutes and
no Rust builds there, so a default cannot be changed in the same lease; this picks, from those
figures, the settings the stages after it (the placement sweep, -ngl, the paper's figures) run
under, so that one lease measures the hybrid engine with the kernels the next commit would make
the default.

The rule: the decode test is the longest tg test every variant has (tg128), the prefill tests
every pp test (pp64, pp512). A variant is eligible when its decode t/s is at least (1 + GAIN)
times the default's and each prefill test's at least (1 - LOSS) times the default's; the
eligible variant with the most decode t/s wins; none eligible: the default (an empty line).
GAIN and LOSS (default 0.03 each) keep a repetition's noise from choosing.

Usage: pick_variant.py RAW_DIR [--gain G] [--loss L]
         prints the winner's settings on stdout (one line, maybe empty), the table and the
         reason on stderr; exit 0 unless RAW_DIR has no variants.tsv or no default figures.
       pick_variant.py --check   (made-up figures through the rule; CI runs it)
"""
import json
import os
import sys
import tempfile


def tests_of(path):
    """{test name: tokens/s} of an `oato bench --json` file ({} when it cannot be read)."""
    try:
        with open(path) as f:
            rows = json.load(f)
    except (OSError, ValueError):
        return {}
    out = {}
    for r in rows if isinstance(rows, list) else []:
        try:
            p, g, ts = int(r["n_prompt"]), int(r["n_gen"]), float(r["avg_ts"])
        except (KeyError, TypeError, ValueError):
            continue
        if g == 0 and p > 0:
            out[f"pp{p}"] = ts
        elif p == 0 and g > 0:
            out[f"tg{g}"] = ts
    return out


def variants_of(raw):
    """[(name, settings)] in variants.tsv's order."""
    out = []
    with open(os.path.join(raw, "variants.tsv")) as f:
        for line in f:
            line = line.rstrip("\n")
            if not line.strip():
                continue
            name, _, settings = line.partition("\t")
            out.append((name.strip(), settings.strip()))
    return out


def pick(raw, gain=0.03, loss=0.03):
    """(settings of the winner, report lines). Raises ValueError without default figures."""
    variants = variants_of(raw)
    figs = {name: tests_of(os.path.join(raw, f"oato-{name}.json")) for name, _ in variants}
    base = figs.get("default") or {}
    tg = sorted((t for t in base if t.startswith("tg")), key=lambda t: int(t[2:]))
    pp = sorted((t for t in base if t.startswith("pp")), key=lambda t: int(t[2:]))
    if not tg:
        raise ValueError(f"{raw}: no decode (tg) figures for the default")
    # The longest decode test every variant with figures has.
    measured = [n for n, _ in variants if figs[n]]
    common = [t for t in tg if all(t in figs[n] for n in measured)]
    dec = (common or tg)[-1]
    lines = [f"variant | {dec} t/s (x default) | " + " | ".join(f"{t} (x default)" for t in pp) + " | eligible"]
    best, best_ts = "default", base[dec]
    for name, settings in variants:
        f = figs[name]
        if dec not in f:
            lines.append(f"{name} | no figures | | no")
            continue
        up = f[dec] / base[dec]
        pre = [(t, f.get(t, 0.0) / base[t]) for t in pp if base[t] > 0]
        ok = name != "default" and up >= 1 + gain and all(r >= 1 - loss for _, r in pre)
        lines.append(f"{name} | {f[dec]:.1f} ({up:.3f}) | " + " | ".join(f"{f.get(t, 0.0):.1f} ({r:.3f})" for t, r in pre)
                     + f" | {'yes' if ok else 'no'}")
        if ok and f[dec] > best_ts:
            best, best_ts = name, f[dec]
    settings = dict(variants).get(best, "")
    lines.append(f"picked: {best} ({settings or 'the defaults'}): {dec} {best_ts:.1f} t/s against the default's {base[dec]:.1f}"
                 f" (rule: {dec} at least {1 + gain:.2f}x the default's, every pp test at least {1 - loss:.2f}x)")
    return settings, lines


def check():
    def bench(tss):
        rows = []
        for test, ts in tss.items():
            n = int(test[2:])
            rows.append({"n_prompt": n if test.startswith("pp") else 0,
                         "n_gen": n if test.startswith("tg") else 0, "avg_ts": ts})
        return rows

    def case(variants, figs, **kw):
        with tempfile.TemporaryDirectory() as raw:
            with open(os.path.join(raw, "variants.tsv"), "w") as f:
                for name, settings in variants:
                    f.write(f"{name}\t{settings}\n")
            for name, tss in figs.items():
                with open(os.path.join(raw, f"oato-{name}.json"), "w") as f:
                    json.dump(bench(tss), f)
            return pick(raw, **kw)

    vs = [("default", ""), ("split", "OATO_CUDA_SPLIT=1"), ("mmvq-direct", "OATO_CUDA_MMVQ=direct"),
          ("mma-off", "OATO_CUDA_MMA=0")]
    base = {"pp64": 3200, "pp512": 10000, "tg32": 190, "tg128": 180}
    # The fastest decode wins when its prefill holds; mma-off decodes faster still but loses
    # 10% of pp512, so it is not eligible.
    s, lines = case(vs, {"default": base,
                         "split": {"pp64": 3150, "pp512": 9900, "tg32": 260, "tg128": 250},
                         "mmvq-direct": {"pp64": 3200, "pp512": 10000, "tg32": 205, "tg128": 195},
                         "mma-off": {"pp64": 3200, "pp512": 9000, "tg32": 300, "tg128": 290}})
    assert s == "OATO_CUDA_SPLIT=1", (s, lines)
    assert lines[-1].startswith("picked: split (OATO_CUDA_SPLIT=1): tg128 250.0"), lines
    assert any(l.startswith("mma-off | 290.0 (1.611) | 3200.0 (1.000) | 9000.0 (0.900) | no") for l in lines), lines
    # Within the noise (2% faster): the defaults.
    s, lines = case(vs[:2], {"default": base, "split": {"pp64": 3200, "pp512": 10000, "tg32": 194, "tg128": 183.6}})
    assert s == "" and lines[-1].startswith("picked: default (the defaults)"), (s, lines)
    # A variant whose run failed (no file) is listed and skipped; a variant without tg128 makes
    # the decode test the longest they all have.
    s, lines = case(vs[:3], {"default": base, "mmvq-direct": {"pp64": 3300, "pp512": 10100, "tg32": 230}})
    assert s == "OATO_CUDA_MMVQ=direct", (s, lines)
    assert "split | no figures | | no" in lines and lines[0].startswith("variant | tg32"), lines
    # A wider gain threshold turns the same figures into the defaults.
    s, _ = case(vs[:3], {"default": base, "mmvq-direct": {"pp64": 3300, "pp512": 10100, "tg32": 230}}, gain=0.25)
    assert s == "", s
    # No default figures: an error, not a guess.
    try:
        case(vs[:2], {"split": base})
        raise AssertionError("no default accepted")
    except ValueError as e:
        assert "no decode (tg) figures for the default" in str(e), e
    print("pick_variant.py --check: OK")


def main(argv):
    if argv[1:] == ["--check"]:
        check()
        return 0
    args, gain, loss, i = [], 0.03, 0.03, 1
    while i < len(argv):
        if argv[i] in ("--gain", "--loss") and i + 1 < len(argv):
            try:
                v = float(argv[i + 1])
            except ValueError:
                print(f"error: {argv[i]} {argv[i + 1]!r}: expected a number", file=sys.stderr)
                return 2
            gain, loss = (v, loss) if argv[i] == "--gain" else (gain, v)
            i += 2
        else:
            args.append(argv[i])
            i += 1
    if len(args) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        settings, lines = pick(args[0], gain, loss)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for line in lines:
        print(line, file=sys.stderr)
    print(settings)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

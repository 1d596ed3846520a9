#!/usr/bin/env python3
"""Greedy continuations of the `oato` binary against llama.cpp's golden token ids, under the golden
file's parity rule (equal up to the first difference d; at d our token is among llama.cpp's top five
there, with a logit within 0.5 of the top one). For machines without a Rust toolchain (the borrowed GPU):
runs `oato run --json` per prompt with the given extra flags, e.g. `--device gpu`.

Usage: golden_check.py [--oato target/release/oato] [--golden tests/data/golden/smollm2-q4_1.json]
                       [--model models/SmolLM2-135M-Instruct.Q4_1.gguf] [--out FILE.json]
                       [--prompts N] [--skip N] [--max-tokens N] -- [oato run flags]
--prompts N checks the first N prompts only, --skip N not the first N of those (--prompts 3
--skip 2: the third alone), --max-tokens N the first N tokens of each (for the slow CPU-emulated
GPU of scripts/fake-gpu.sh).
Exit status 1 when any prompt breaks the rule. Standard library only.
"""

import argparse
import json
import subprocess
import sys


def parity(ours, theirs, top):
    """Equal up to the first difference d; at d our token is among llama.cpp's top choices there
    (per_step_top5, or the original per_step_top2) with a logit within 0.5 of the top one."""
    for d, (a, b) in enumerate(zip(ours, theirs)):
        if a == b:
            continue
        first = top[d][0][1]
        logit = next((l for i, l in top[d] if i == a), None)
        if logit is None:
            return f"step {d}: ours {a}, llama.cpp {b}: not among its top {len(top[d])}", False
        margin = first - logit
        if margin < 0.5:
            return f"near-tie at step {d} (margin {margin:.3f})", True
        return f"step {d}: ours {a}, llama.cpp {b}: our token's logit is {margin:.3f} below its top", False
    if len(ours) != len(theirs):
        return f"lengths differ: {len(ours)} vs {len(theirs)}", False
    return "equal", True


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--oato", default="target/release/oato")
    ap.add_argument("--golden", default="tests/data/golden/smollm2-q4_1.json")
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--out")
    ap.add_argument("--prompts", type=int, default=0, help="only the first N prompts")
    ap.add_argument("--skip", type=int, default=0, help="not the first N of those")
    ap.add_argument("--max-tokens", type=int, default=0, help="only the first N tokens of each")
    ap.add_argument("flags", nargs="*")
    a = ap.parse_args()
    g = json.load(open(a.golden))
    results, ok_all = [], True
    chosen = g["prompts"][: a.prompts or None][a.skip:]
    if not chosen:
        sys.exit(f"golden_check: --prompts {a.prompts} --skip {a.skip} leaves no prompt to check")
    for p in chosen:
        want = p["output_ids"][: a.max_tokens or None]
        cmd = [a.oato, "run", a.model, "-p", p["prompt"], "-n", str(len(want)), "--temp", "0",
               "--ignore-eos", "--json", *a.flags]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            print(f"{p['prompt']!r}: oato failed: {r.stderr.strip()}", file=sys.stderr)
            ok_all = False
            continue
        d = json.loads(r.stdout)
        prompt_ok = d["prompt_ids"] == p["prompt_ids"]
        verdict, ok = parity(d["output_ids"], want, p.get("per_step_top5") or p["per_step_top2"])
        ok = ok and prompt_ok
        ok_all &= ok
        print(f"{'OK  ' if ok else 'FAIL'} {p['prompt']!r}: {verdict}{'' if prompt_ok else ', prompt ids differ'}"
              f" (device {d.get('device')})")
        results.append({"prompt": p["prompt"], "ok": ok, "verdict": verdict, "output_ids": d["output_ids"],
                        "device": d.get("device")})
    if a.out:
        json.dump({"flags": a.flags, "all_ok": ok_all, "prompts": results}, open(a.out, "w"), indent=1)
    sys.exit(0 if ok_all else 1)


if __name__ == "__main__":
    main()

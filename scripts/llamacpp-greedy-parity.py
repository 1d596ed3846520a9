#!/usr/bin/env python3
"""Greedy token ids of `oato run` against llama.cpp's CPU peer on one GGUF file (made for synthetic
files, e.g. `oato synth --shape minicpm3-4b --type Q4_K_M --layers 2`, whose random weights give flat
logits and so frequent near-ties).

For each prompt:
  - oato: `oato run --temp 0 --json` (prompt ids and generated ids);
  - llama.cpp, two ways, both from the llama-cpp-python 0.3.36 sdist that
    ../shared/peers/build-llamacpp.sh unpacks: the peer binary `llama-simple` (greedy; its text maps
    back to ids because every synthetic piece is `▁w<id>`), and llama-cpp-python (same sources,
    ~/.cache/oato/llamacpp-py, see scripts/golden-top5.py) for the tokenizer's prompt ids and for the
    logits along oato's own path (teacher-forced, one batch, flash attention off, F16 KV cache);
  - the rule (the golden file's, scaled to these logits): prompt ids equal; generated ids equal up to
    the first step d where they differ; at d, llama.cpp's logit for oato's token is within --tie of
    its top logit there (a near-tie that any rounding difference may flip).
One line per prompt; exit status 1 when a prompt breaks the rule.

Usage: ~/.cache/oato/llamacpp-py/bin/python scripts/llamacpp-greedy-parity.py MODEL.gguf
         [--oato target/release/oato] [--peer-bin DIR] [-n 16] [--tie 0.01] [--prompt TEXT ...]
"""

import argparse
import json
import os
import subprocess
import sys

import numpy as np
from llama_cpp import Llama

PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "1 2 3 4 5",
    "hello world one two three",
    "The quick brown fox",
]


def oato_greedy(oato, model, prompt, n):
    out = subprocess.run(
        [oato, "run", model, "-p", prompt, "-n", str(n), "--temp", "0", "--ignore-eos", "--json", "-c", "512"],
        capture_output=True, text=True, check=True,
    )
    j = json.loads(out.stdout)
    return j["prompt_ids"], j["output_ids"]


def simple_greedy(bindir, model, prompt, n):
    """llama-simple's continuation as ids: its output is the prompt's text, then the pieces."""
    env = dict(os.environ, LD_LIBRARY_PATH=bindir)
    out = subprocess.run(
        [os.path.join(bindir, "llama-simple"), "-m", model, "-n", str(n), prompt],
        capture_output=True, env=env, check=True,
    ).stdout.decode("utf-8", "replace")
    text = out.replace("\u2581", " ")
    words = [w for w in text.split() if w.startswith("w") and w[1:].isdigit()]
    return [int(w[1:]) for w in words[-n:]]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--oato", default="target/release/oato")
    ap.add_argument("--peer-bin", default=os.path.expanduser("~/.cache/oato-peers/llama.cpp-py0.3.36/build/bin"))
    ap.add_argument("-n", type=int, default=16)
    ap.add_argument("--tie", type=float, default=0.01)
    ap.add_argument("--prompt", action="append")
    a = ap.parse_args()
    llm = Llama(model_path=a.model, n_ctx=512, n_batch=512, n_threads=2, logits_all=True, flash_attn=False,
                verbose=False)
    bad = 0
    for prompt in a.prompt or PROMPTS:
        pids, ours = oato_greedy(a.oato, a.model, prompt, a.n)
        theirs_pids = llm.tokenize(prompt.encode(), add_bos=True)
        simple = simple_greedy(a.peer_bin, a.model, prompt, a.n)
        llm.reset()
        path = pids + ours[:-1]
        llm.eval(path)
        logits = np.asarray(llm.scores[: len(path)], dtype=np.float64)
        rows = [logits[len(pids) - 1 + d] for d in range(len(ours))]
        # llama.cpp's own argmax along oato's path, and where the peer binary's continuation parts.
        forced = [int(np.argmax(r)) for r in rows]
        d = next((i for i, (x, y) in enumerate(zip(ours, simple)) if x != y), None)
        verdict = "ok"
        if pids != theirs_pids:
            verdict = f"BAD prompt ids differ: oato {pids} llama.cpp {theirs_pids}"
        elif d is None and len(simple) == len(ours):
            verdict = f"ok: all {len(ours)} ids equal"
        elif d is None:
            verdict = f"BAD llama-simple gave {len(simple)} ids"
        else:
            gap = rows[d].max() - rows[d][ours[d]]
            top2 = np.sort(rows[d])[-2:]
            near = gap <= a.tie
            verdict = (f"{'ok' if near else 'BAD'}: equal for {d} ids, then oato {ours[d]} vs llama.cpp "
                       f"{simple[d]}: its logit {gap:.5f} below llama.cpp's top (top-2 gap "
                       f"{top2[1] - top2[0]:.5f}, tie bound {a.tie})")
        agree = sum(f == o for f, o in zip(forced, ours))
        print(f"{prompt!r}: {verdict}; along oato's path llama.cpp's argmax is oato's token at {agree}/{len(ours)} steps")
        bad += not verdict.startswith("ok")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

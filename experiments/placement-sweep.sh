#!/usr/bin/env bash
# TTFT and TPOT of the OATO placement against llama.cpp-style layer split (and the all-CPU and
# all-GPU runs) at several shares of the weights on the GPU: for each policy and budget, one
# warm-up run and REPS timed runs of `oato run --json` (greedy, fixed prompt, GEN tokens), written
# to results/placement-sweep.csv in DESIGN.md's results format plus a markdown table of medians
# (results/placement-sweep.md). Needs a GPU (or OATO_TEST_DEVICE, whose numbers mean nothing).
#
# env: OATO_BIN (target/release/oato), MODEL (models/SmolLM2-135M-Instruct.Q4_1.gguf), THREADS (all
# cores), REPS (3), GEN (32), CTX (1024), BUDGETS ("25% 50% 75%"), POLICIES ("oato layer-split flexgen"),
# OUT (results/placement-sweep), PROMPT_FILE (text from tests/data/golden/gpl3_2000w.txt), P (64: the
# prompt is cut or repeated to exactly P tokens), PLAIN ("cpu gpu": the whole-model runs; "" skips
# them, e.g. for a model larger than the GPU), WARMUP (1: untimed runs before each policy and budget's
# REPS), ALTERNATE (1: the repetitions round by round, every run once a round; 0: each run's
# back to back). The table shows the plan's predicted TTFT/TPOT beside the measured medians (and
# the TPOT range), and the activation copies per prefill and per decode step. VARIANTS (""): extra
# runs of every policy and budget under environment settings, space-separated LABEL:VAR=VALUE[,VAR=
# VALUE...] (e.g. "awake0:OATO_CPU_AWAKE=0"), named and, in the CSV's policy, suffixed +LABEL; they
# take their turns in the same rounds as the plain runs. NGL (""): also llama.cpp-style `-ngl N` runs
# (the output head and the last N-1 layers on the GPU, no plan), one per N, space-separated.
set -euo pipefail
cd "$(dirname "$0")/.."
OATO_BIN=${OATO_BIN:-target/release/oato}
MODEL=${MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
THREADS=${THREADS:-$(nproc)}
REPS=${REPS:-3}
GEN=${GEN:-32}
BUDGETS=${BUDGETS:-"25% 50% 75%"}
POLICIES=${POLICIES:-"oato oato-paper layer-split flexgen"}
P=${P:-64}
PLAIN=${PLAIN-"cpu gpu"}
OUT=${OUT:-results/placement-sweep}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if [ -z "${PROMPT_FILE:-}" ]; then
    PROMPT_FILE=$work/prompt.txt
    # About 64 tokens of plain English.
    head -c 2000 tests/data/golden/gpl3_2000w.txt > "$PROMPT_FILE"
fi
commit=$("$OATO_BIN" --version | sed -n 's/.*commit \([^)]*\)).*/\1/p')
date=$(date -u +%Y-%m-%dT%H:%M:%SZ)
runs=()
# The runs: name and flags, one line each.
configs=()
for d in $PLAIN; do configs+=("$d --device $d"); done
for n in ${NGL:-}; do configs+=("ngl-$n -ngl $n"); done
for policy in $POLICIES; do
    for b in $BUDGETS; do
        configs+=("$policy-${b%\%}pct --vram-budget $b --policy $policy")
        for v in ${VARIANTS:-}; do
            configs+=("$policy-${b%\%}pct+${v%%:*} ${v#*:} --vram-budget $b --policy $policy")
        done
    done
done
go() { # output file, [VAR=VALUE,...], flags...
    local out=$1 vars=()
    shift
    if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then
        IFS=, read -r -a vars <<< "$1"
        shift
    fi
    env ${vars[@]+"${vars[@]}"} "$OATO_BIN" run "$MODEL" -f "$PROMPT_FILE" -n "$GEN" --prompt-tokens "$P" \
        -c "${CTX:-1024}" --temp 0 --ignore-eos -t "$THREADS" --json "$@" > "$out" 2> "$out.err" \
        || { cat "$out.err" >&2; return 1; }
}
# Untimed warm-ups of every run first; then the repetitions round by round, every run once a round
# (ALTERNATE=1, the default), so that a drift of the machine (the host CPU's share of a hybrid
# token moves by 10-30% between minutes) falls on every policy alike; ALTERNATE=0 runs each one's
# repetitions back to back, as before.
for c in "${configs[@]}"; do
    read -r -a a <<< "$c"
    for _ in $(seq 1 "${WARMUP:-1}"); do go "$work/warmup.json" "${a[@]:1}"; done
done
order=()
if [ "${ALTERNATE:-1}" = 1 ]; then
    for r in $(seq 1 "$REPS"); do for c in "${configs[@]}"; do order+=("$r $c"); done; done
else
    for c in "${configs[@]}"; do for r in $(seq 1 "$REPS"); do order+=("$r $c"); done; done
fi
for o in "${order[@]}"; do
    read -r -a a <<< "$o"
    r=${a[0]}
    name=${a[1]}
    go "$work/$name.$r.json" "${a[@]:2}"
    runs+=("$name" "$r" "$work/$name.$r.json")
    echo "== $name rep $r: $(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print("TTFT %.2f ms, TPOT %.3f ms" % (d["ttft_ms"], d["tpot_ms"]))' "$work/$name.$r.json")" >&2
done
python3 - "$OUT" "$date" "$commit" "$THREADS" "${runs[@]}" <<'PY'
import csv, json, statistics, sys
out, date, commit, threads = sys.argv[1:5]
rest = sys.argv[5:]
fields = ["date", "commit", "device", "host_cpu", "threads", "model", "model_dtype", "policy",
          "vram_budget_bytes", "gpu_weight_fraction", "prompt_tokens", "gen_tokens", "rep", "load_ms",
          "ttft_ms", "tpot_ms", "e2e_ms", "tokens_per_s", "predicted_ttft_ms", "predicted_tpot_ms",
          "crossings_prefill", "crossings_decode"]
rows, groups = [], {}
for i in range(0, len(rest), 3):
    name, rep, path = rest[i], int(rest[i + 1]), rest[i + 2]
    d = json.load(open(path))
    variant = name.partition("+")[2]  # a VARIANTS run's label
    row = {
        "date": date, "commit": commit, "device": d["device"], "host_cpu": d["host_cpu"],
        "threads": threads, "model": d["model"], "model_dtype": d["model_dtype"],
        "policy": d["policy"] + ("+" + variant if variant else ""), "vram_budget_bytes": d["vram_budget_bytes"],
        "gpu_weight_fraction": round(d["gpu_weight_bytes"] / d["target_weight_bytes"], 4),
        "prompt_tokens": len(d["prompt_ids"]), "gen_tokens": len(d["output_ids"]), "rep": rep,
        "load_ms": round(d["load_ms"], 3), "ttft_ms": round(d["ttft_ms"], 3),
        "tpot_ms": round(d["tpot_ms"], 4), "e2e_ms": round(d["e2e_ms"], 3),
        "tokens_per_s": round(d["gen_tokens_per_s"], 2),
        "predicted_ttft_ms": d.get("predicted_ttft_ms"), "predicted_tpot_ms": d.get("predicted_tpot_ms"),
        "crossings_prefill": d.get("crossings_prefill"), "crossings_decode": d.get("crossings_decode"),
    }
    rows.append(row)
    groups.setdefault(name, []).append(row)
with open(out + ".csv", "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=fields)
    w.writeheader()
    w.writerows(rows)
with open(out + ".md", "w") as f:
    first = rows[0]
    f.write(f"# Placement sweep: {first['model']} ({first['model_dtype']})\n\n")
    f.write(f"{date}, commit {commit}, {first['device']} + {first['host_cpu']}, {threads} threads, "
            f"P={first['prompt_tokens']}, G={first['gen_tokens']}; medians of {len(groups[next(iter(groups))])} runs "
            "after a warm-up (tokens/s: decode).\n\n")
    f.write("| run | policy | GPU weight share | TTFT ms | predicted | TPOT ms | predicted | TPOT min–max | tokens/s | copies prefill / decode |\n"
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n")
    fmt = lambda v, p: "" if v is None else f"{v:.{p}f}"
    for name, rs in groups.items():
        med = lambda k: statistics.median(r[k] for r in rs)
        r0 = rs[0]
        f.write(f"| {name} | {r0['policy']} | {r0['gpu_weight_fraction']:.2f} | {med('ttft_ms'):.2f} | "
                f"{fmt(r0['predicted_ttft_ms'], 2)} | {med('tpot_ms'):.3f} | {fmt(r0['predicted_tpot_ms'], 3)} | "
                f"{min(r['tpot_ms'] for r in rs):.2f}–{max(r['tpot_ms'] for r in rs):.2f} | "
                f"{med('tokens_per_s'):.1f} | {r0['crossings_prefill']} / {r0['crossings_decode']} |\n")
print(f"wrote {out}.csv and {out}.md", file=sys.stderr)
PY

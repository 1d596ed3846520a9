#!/usr/bin/env bash
# oato vs llama.cpp on the CPU, with llama-bench's own tests on both engines: pp64, pp512 (prompt
# of N tokens in one batch) and tg32, tg128 (N tokens one at a time), on the test model in four
# weight types (Q4_1 as shipped, and Q4_0, Q8_0, F16 made from it with llama-quantize).
#
# Writes results/cpu-vs-llamacpp.csv (date, commit, cpu, threads, model, type, test, engine,
# avg_ts, stddev_ts; one row per type x test x engine) and results/cpu-vs-llamacpp.md (a table
# per type: both engines' t/s and the ratio oato / llama.cpp).
#
# With SYNTH=1 (the default) it also runs the Llama-3.2-1B shape in Q4_0, Q4_K_M, Q8_0 and F16 (or
# the `oato synth` types SYNTH_TYPES names, e.g. "Q2_K Q3_K_M Q5_K_M Q6_K"), and
# with SYNTH_8B=1 the LLaMA3-8B shape in Q4_0 for the tg tests only: files made by `oato synth`
# (seed 42) into models/ and read by both engines (their text is noise; their timing is real).
# DEPTH=N (default 0: none) adds tg32 after N tokens in the cache ("tg32 @ dN", llama-bench's -d
# on both engines; the N tokens are processed before each run, untimed) for the 1B shape: decode
# with attention over a long context.
#
# Usage: experiments/cpu-vs-llamacpp.sh
# Env:   THREADS (or T, default 2), REPS (or R, default 5), SYNTH (1), SYNTH_TYPES, SYNTH_8B (0),
#        SHAPES_ONLY (1: skip the test model's four types), OUT (default results/cpu-vs-llamacpp:
#        writes OUT.csv and OUT.md),
#        LLAMACPP_BUILD (default ../shared/peers/build-llamacpp.sh; builds llama.cpp's CPU tools
#        once into ~/.cache/oato-peers and prints their bin directory),
#        DEPTH (0), LLAMACPP_BIN (skip the build script, use this bin directory), OATO_BIN (default: build
#        target/release/oato), RAW_DIR (keep every raw JSON there; default: a temporary folder).
#        ALTERNATE (test, the default: the engines take turns test by test, one repetition each,
#        the first engine swapped each repetition; 1: turns of one repetition of every test;
#        0: each engine's repetitions in one run).
# The requantised models are written to models/ (git-ignored) and reused when present. Both
# engines run the same file with the same threads; nothing else should run on the machine
# meanwhile.
set -euo pipefail
cd "$(dirname "$0")/.."

threads=${THREADS:-${T:-2}}
reps=${REPS:-${R:-5}}
prompts=64,512
gens=32,128
src=models/SmolLM2-135M-Instruct.Q4_1.gguf
for v in "$threads" "$reps"; do
  [[ $v =~ ^[1-9][0-9]*$ ]] || { echo "error: THREADS and REPS must be positive whole numbers (got $v)" >&2; exit 1; }
done
depth=${DEPTH:-0}
[[ $depth =~ ^[0-9]+$ ]] || { echo "error: DEPTH must be a whole number (got $depth)" >&2; exit 1; }

[ -f "$src" ] || scripts/fetch-models.sh

if [ -n "${LLAMACPP_BIN:-}" ]; then
  bin=$LLAMACPP_BIN
else
  build=${LLAMACPP_BUILD:-../shared/peers/build-llamacpp.sh}
  [ -f "$build" ] || { echo "error: $build not found: set LLAMACPP_BUILD or LLAMACPP_BIN" >&2; exit 1; }
  bin=$(bash "$build" | tail -n 1)
fi
for tool in llama-bench llama-quantize; do
  [ -x "$bin/$tool" ] || { echo "error: $bin/$tool is missing" >&2; exit 1; }
done

# The commit the binary comes from, taken before the runs (the source may change meanwhile).
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
git diff --quiet HEAD -- src Cargo.toml Cargo.lock build.rs 2>/dev/null || commit="$commit-dirty"
if [ -n "${OATO_BIN:-}" ]; then
  oato=$OATO_BIN
else
  cargo build --release --quiet
  oato=target/release/oato
fi

raw=${RAW_DIR:-}
if [ -z "$raw" ]; then
  raw=$(mktemp -d)
  trap 'rm -rf "$raw"' EXIT
fi
mkdir -p "$raw" results

# The other types, made from the shipped Q4_1 file (requantised: the timing is what matters).
for ty in Q4_0 Q8_0 F16; do
  out=models/SmolLM2-135M-Instruct.$ty.gguf
  if [ ! -f "$out" ]; then
    echo "== llama-quantize $src -> $out ($ty)" >&2
    "$bin/llama-quantize" --allow-requantize "$src" "$out.tmp" "$ty" >"$raw/quantize-$ty.log" 2>&1 \
      || { cat "$raw/quantize-$ty.log" >&2; rm -f "$out.tmp"; exit 1; }
    mv "$out.tmp" "$out"
  fi
done

# One label, file and test lists per comparison: the test model's four types, then the shapes.
cases=()
if [ "${SHAPES_ONLY:-0}" != 1 ]; then
  for ty in Q4_1 Q4_0 Q8_0 F16; do
    cases+=("$ty models/SmolLM2-135M-Instruct.$ty.gguf $prompts $gens 0")
  done
fi
synth() { # shape type -> path (made once)
  local out=models/synth-$1-$2.gguf
  if [ ! -f "$out" ]; then
    echo "== oato synth --shape $1 --type $2" >&2
    "$oato" synth --shape "$1" --type "$2" --seed 42 -o "$out.tmp" >&2 && mv "$out.tmp" "$out"
  fi
  echo "$out"
}
if [ "${SYNTH:-1}" = 1 ]; then
  for ty in ${SYNTH_TYPES:-Q4_0 Q4_K_M Q8_0 F16}; do
    cases+=("1B-$ty $(synth llama3.2-1b "$ty") $prompts $gens $depth")
  done
fi
if [ "${SYNTH_8B:-0}" = 1 ]; then
  cases+=("8B-Q4_0 $(synth llama3-8b Q4_0) 0 $gens 0")
fi

# ALTERNATE=test (the default): for each repetition and test, one engine's run right after the
# other's (llama.cpp first in odd repetitions, oato in even ones), so that both meet the memory
# in nearly the same state: this shared machine's read rate switches between about 33 and 60
# GB/s every 10-20 s, and turns of a whole repetition (ALTERNATE=1: every test of one engine,
# then of the other, 20-30 s apart) let one engine's decode meet the fast memory and the
# other's the slow. Decode tests also measure the memory's rate just before and after
# llama-bench's run (`oato bench --membw`; oato bench measures its own), for each engine's
# fraction. ALTERNATE=0: all of llama.cpp's repetitions, then all of oato's.
alternate=${ALTERNATE:-test}
case $alternate in
  test) turns=$reps; per=1 ;;
  1) turns=$reps; per=1 ;;
  0) turns=1; per=$reps ;;
  *) echo "error: ALTERNATE must be test, 1 or 0 (got $alternate)" >&2; exit 1 ;;
esac
membw() { # the memory's read rate at $threads threads, GB/s
  "$oato" bench --membw 128M -t "$threads" | awk -F'|' '/^\| *[0-9]/ { gsub(/ /, "", $3); print $3 }'
}
llama_run() { # model p n json [depth]
  "$bin/llama-bench" -m "$1" -t "$threads" -p "$2" -n "$3" -d "${5:-0}" -r "$per" -o json \
    >"$4" 2>"$raw/llamacpp.log" || { cat "$raw/llamacpp.log" >&2; exit 1; }
}
oato_run() { # model p n json [depth]
  "$oato" bench "$1" --device cpu -t "$threads" -p "$2" -n "$3" -d "${5:-0}" -r "$per" --json \
    >"$4" 2>"$raw/oato.log" || { cat "$raw/oato.log" >&2; exit 1; }
  grep "reads [0-9]" "$raw/oato.log" >&2 || true
}
runs=()
for c in "${cases[@]}"; do
  read -r label model p n d <<<"$c"
  lj=() oj=()
  if [ "$alternate" = test ]; then
    tests=()
    for x in ${p//,/ }; do [ "$x" = 0 ] || tests+=("$x 0 0"); done
    for x in ${n//,/ }; do [ "$x" = 0 ] || tests+=("0 $x 0"); done
    [ "$d" = 0 ] || tests+=("0 32 $d")
    for i in $(seq "$turns"); do
      for tst in "${tests[@]}"; do
        read -r tp tn td <<<"$tst"
        name=$([ "$tp" = 0 ] && echo "tg$tn" || echo "pp$tp")
        [ "$td" = 0 ] || name="$name-d$td"
        lf=$raw/llamacpp-$label-$name-$i.json of=$raw/oato-$label-$name-$i.json
        echo "== $label $name ($i/$turns)" >&2
        for e in $( ((i % 2)) && echo "llama oato" || echo "oato llama"); do
          # The memory's rate around llama.cpp's decode at depth 0 (its weight fraction).
          fr=$([ "$tp" = 0 ] && [ "$td" = 0 ] && echo 1 || echo 0)
          if [ "$e" = llama ]; then
            if [ "$fr" = 1 ]; then before=$(membw); fi
            llama_run "$model" "$tp" "$tn" "$lf" "$td"
            if [ "$fr" = 1 ]; then echo "$before $(membw)" >"$lf.membw"; fi
          else
            oato_run "$model" "$tp" "$tn" "$of" "$td"
          fi
        done
        lj+=("$lf") oj+=("$of")
      done
    done
    runs+=(--run "$label" "$(basename "$model")" "$(IFS=,; echo "${lj[*]}")" "$(IFS=,; echo "${oj[*]}")")
    continue
  fi
  [ "$d" = 0 ] || { echo "error: DEPTH takes ALTERNATE=test" >&2; exit 1; }
  for i in $(seq "$turns"); do
    echo "== $label: llama-bench ($i/$turns)" >&2
    llama_run "$model" "$p" "$n" "$raw/llamacpp-$label-$i.json"
    echo "== $label: oato bench ($i/$turns)" >&2
    oato_run "$model" "$p" "$n" "$raw/oato-$label-$i.json"
    lj+=("$raw/llamacpp-$label-$i.json") oj+=("$raw/oato-$label-$i.json")
  done
  runs+=(--run "$label" "$(basename "$model")" "$(IFS=,; echo "${lj[*]}")" "$(IFS=,; echo "${oj[*]}")")
done

llamacpp=$(basename "$(dirname "$(dirname "$bin")")")
out=${OUT:-results/cpu-vs-llamacpp}
python3 experiments/bench_merge.py \
  --csv "$out.csv" --md "$out.md" \
  --date "$(date -u +%Y-%m-%dT%H:%M:%SZ)" --commit "$commit" --threads "$threads" --reps "$reps" \
  --note "$(case $alternate in
    test) echo "the engines took turns test by test, one repetition each, the first engine swapped each repetition (ALTERNATE=test)" ;;
    1) echo "the engines took turns, one repetition each (ALTERNATE=1)" ;;
    *) echo "each engine's repetitions in one run, llama.cpp first (ALTERNATE=0)" ;;
  esac)" \
  --llamacpp "$llamacpp" "${runs[@]}"
echo "wrote $out.csv and $out.md" >&2
cat "$out.md"

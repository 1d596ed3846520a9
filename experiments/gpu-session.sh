#!/usr/bin/env bash
# (A lease is now 15 minutes of device time: experiments/gpu-lease.sh spends one in priority order.
# This script and gpu-hybrid.sh remain the pieces for longer sessions.)
# Everything a borrowed GPU machine should run, in one command (it has no Rust toolchain and no
# network): the GPU selftest and its --perf table (with prefill attention tiled and per token,
# kernel launches one by one against a CUDA graph, and quantised prefill GEMMs by the int8 kernels
# against dequantisation + cuBLAS at 64 and 512 tokens), the all-GPU and hybrid greedy continuations
# against the golden ids (all-GPU also with CUDA graphs off), `oato bench --device gpu` (decode also
# with CUDA graphs off), a profile, and the placement sweep.
# Results go to $RES (default results/gpu-<date>); on the device machine they also come back as
# $OUT/gpu-session.tgz.
#
# The binary comes from `cargo build --release` here (carry target/release/oato). The test model
# (94 MiB) is over the device's 64 MiB per-call limit, so it goes over in two calls in a row (the
# machine is released after 30 s idle):
#   here:    split -n 2 -d models/SmolLM2-135M-Instruct.Q4_1.gguf .carry/q41.part   (.carry is
#            git-ignored)
#   call 1:  carry [target/release/oato, .carry/q41.part00]; command: mkdir -p /tmp/m &&
#            cp .carry/q41.part00 /tmp/m/
#   call 2:  carry [target/release/oato, .carry/q41.part01]; command: mkdir -p models &&
#            cat /tmp/m/q41.part00 .carry/q41.part01 > models/SmolLM2-135M-Instruct.Q4_1.gguf &&
#            sha256sum models/*.gguf && experiments/gpu-session.sh
# (compare the sha256 with scripts/fetch-models.sh's).
#
# The paper's figures (issue 14), after the session above and llama.cpp's CUDA build
# (`experiments/gpu-hybrid.sh build`, its own call): one call per figure, or per figure and model
# where a call would pass the device's 10 minutes (fig7, fig8: three models; QwQ-32B alone is a
# ~18 GB file to synthesise):
#   experiments/gpu-session.sh paper fig10
#   experiments/gpu-session.sh paper fig8 --models llama3-8b   (then minicpm3-4b, qwq-32b; --reps 1
#                                                              to hurry)
# Each runs experiments/figN.sh with the flags after the figure into $RES/paper and paper-figures/,
# models synthesised once into $OATO_PAPER_MODELS (default /tmp/paper-models, kept while the
# machine stays warm), and comes back as $OUT/paper-<fig>.tgz.
set -euo pipefail
cd "$(dirname "$0")/.."
OATO=${OATO_BIN:-target/release/oato}
MODEL=${MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
RES=${RES:-results/gpu-$(date -u +%Y-%m-%d)}
mkdir -p "$RES"
if [ "${1:-}" = paper ]; then
    fig=${2:?usage: $0 paper figN [experiments/figN.sh flags]}
    shift 2
    [ -x "experiments/$fig.sh" ] || { echo "error: no experiments/$fig.sh" >&2; exit 2; }
    export OATO_BIN=$OATO OATO_PAPER_MODELS=${OATO_PAPER_MODELS:-/tmp/paper-models}
    export OATO_CACHE_DIR=${OATO_CACHE_DIR:-/tmp/oato-cache}
    status=0
    experiments/"$fig".sh --res "$RES/paper" --figures paper-figures "$@" 2>&1 \
        | tee -a "$RES/paper-$fig.log" | { grep -v '^== ' || true; } || status=1
    if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
        tar czf "$OUT/paper-$fig.tgz" "$RES/paper" paper-figures
    fi
    exit $status
fi
commit=$("$OATO" --version | sed -n 's/.*commit \([^)]*\)).*/\1/p')
header() { echo "# $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1), $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $commit"; }
step() { echo "== $*" >&2; }
status=0
step selftest
{ header; "$OATO" selftest --device gpu; } > "$RES/selftest-gpu.txt" 2>&1 || status=1
step "selftest --perf"
{ header; "$OATO" selftest --device gpu --perf; } > "$RES/selftest-gpu-perf.txt" 2>&1 || status=1
step "golden, all on the GPU"
python3 experiments/golden_check.py --oato "$OATO" --model "$MODEL" --out "$RES/golden-gpu.json" \
    -- --device gpu > "$RES/golden-gpu.txt" 2>&1 || status=1
for policy in oato oato-paper layer-split flexgen; do
    for b in 25% 50% 75%; do
        step "golden, $policy at $b"
        python3 experiments/golden_check.py --oato "$OATO" --model "$MODEL" \
            --out "$RES/golden-$policy-${b%\%}.json" -- --vram-budget "$b" --policy "$policy" \
            > "$RES/golden-$policy-${b%\%}.txt" 2>&1 || status=1
    done
done
step "golden, all on the GPU, CUDA graphs off"
OATO_CUDA_GRAPHS=0 python3 experiments/golden_check.py --oato "$OATO" --model "$MODEL" \
    --out "$RES/golden-gpu-graphs-off.json" -- --device gpu > "$RES/golden-gpu-graphs-off.txt" 2>&1 || status=1
step "bench"
"$OATO" bench "$MODEL" --device gpu -p 64,512 -n 32,128 -r 5 --json > "$RES/bench-gpu.json" 2> "$RES/bench-gpu.err" || status=1
OATO_CUDA_GRAPHS=0 "$OATO" bench "$MODEL" --device gpu -p 64 -n 32,128 -r 5 --json \
    > "$RES/bench-gpu-graphs-off.json" 2> "$RES/bench-gpu-graphs-off.err" || status=1
"$OATO" bench "$MODEL" --device cpu -p 64,512 -n 32,128 -r 5 > "$RES/bench-cpu.md" 2> "$RES/bench-cpu.err" || status=1
step profile
"$OATO" profile "$MODEL" --force -o "$RES/profile.json" > "$RES/profile.txt" 2>&1 || status=1
step "placement sweep"
OATO_BIN=$OATO MODEL=$MODEL OUT="$RES/placement-sweep" experiments/placement-sweep.sh > "$RES/placement-sweep.log" 2>&1 || status=1
tail -n 3 "$RES"/*.txt >&2 || true
# On the device machine only 8 files come back from $OUT: one archive of them all.
if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
    tar czf "$OUT/gpu-session.tgz" "$RES"
fi
exit $status

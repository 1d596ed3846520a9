#!/usr/bin/env bash
# Issue 10's measurement on a borrowed GPU machine: a synthetic LLaMA3-8B-shape Q4_0 file, oato's
# placements (oato, oato-paper, layer-split, flexgen) at 25/50/75% of the weights on the GPU with
# predicted beside measured TTFT/TPOT, and llama.cpp's -ngl at the same shares in the same session.
# The device runs one command for at most 10 minutes and keeps /tmp while it stays warm (30 s
# between calls), so it runs in three back-to-back stages:
#   experiments/gpu-hybrid.sh build   llama.cpp CUDA build (foreground, ~6 min) and the synth file
#   experiments/gpu-hybrid.sh oato    profile (link, crossing), placement sweep
#   experiments/gpu-hybrid.sh peer    llama-bench -ngl at the same shares, and at LENGTH_SHARE for
#                                     prompts of LENGTHS tokens; archive of $RES in $OUT
#   experiments/gpu-hybrid.sh lengths oato's TTFT against prompt length (LENGTHS, LENGTH_SHARE)
#   experiments/gpu-hybrid.sh kernels all on the GPU, oato (default kernels, direct matrix-vector,
#                                     split attention off, fusion off, CUDA graphs off, per-token
#                                     prefill attention, int8 prefill GEMM on / off) vs llama.cpp:
#                                     experiments/gpu-vs-llamacpp.sh into $RES/gpu-vs-llamacpp.{csv,md}
#   experiments/gpu-hybrid.sh graphs  hybrid decode with CUDA graphs on and off (OATO_CUDA_GRAPHS):
#                                     the oato policy at GRAPH_BUDGETS ("50% 75%"), $RES/graphs-{on,off}
#   experiments/gpu-hybrid.sh cpu     decode all on the CPU at 4/8/16 threads: Q4_0 interleaved and
#                                     not, against llama.cpp -ngl 0, $RES/cpu-decode.md (~6 min)
#   experiments/gpu-hybrid.sh cpu-prefetch
#                                     the interleaved kernels' decode prefetch (hint and distance,
#                                     PF_VARIANTS) on this CPU at PF_THREADS, $RES/cpu-prefetch.md
#                                     (~6 min; Intel's default was never measured on Intel)
# Carry: target/release/oato, .carry/llamacpp-src.tar.xz, and SYNTH_BIN if the oato binary has
# no synth command. Env: OATO_BIN, SYNTH_BIN (default OATO_BIN), MODEL (/tmp/m/llama3-8b-q4_0.gguf),
# RES (results/gpu-<date>-8b), REPS (3), THREADS (nproc), BUDGETS ("25% 50% 75%"), POLICIES.
set -euo pipefail
cd "$(dirname "$0")/.."
OATO=${OATO_BIN:-target/release/oato}
SYNTH=${SYNTH_BIN:-$OATO}
MODEL=${MODEL:-/tmp/m/llama3-8b-q4_0.gguf}
RES=${RES:-results/gpu-$(date -u +%Y-%m-%d)-8b}
THREADS=${THREADS:-$(nproc)}
export OATO_CACHE_DIR=${OATO_CACHE_DIR:-/tmp/oato-cache}
mkdir -p "$RES" "$(dirname "$MODEL")"
commit=$("$OATO" --version | sed -n 's/.*commit \([^)]*\)).*/\1/p')
header() { echo "# $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2), $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $commit, $THREADS threads"; }
# One CPU decode test of oato (`bench --device cpu`, CPU_GEN tokens, 2 runs) at $2 threads with
# the environment assignments after it, its logs in $1(.err); sets ts (t/s), frac (the runs'
# fraction of the read bandwidth) and paired (the paired tokens' fraction).
cpu_decode() {
    local log=$1 t=$2
    shift 2
    env "$@" "$OATO" bench "$MODEL" --device cpu -t "$t" -p 0 -n "${CPU_GEN:-16}" -r 2 --csv \
        > "$log" 2> "$log.err" || true
    ts=$(tail -1 "$log" | awk -F, '{gsub(/"/,""); print $17}')
    frac=$(grep -o "= [0-9.]* of the [0-9.]* GB/s" "$log.err" | head -1)
    paired=$(grep -o "read [0-9.]* of those reads' rate ([^)]*)" "$log.err" | head -1)
}
case ${1:-} in
build)
    [ -f "$MODEL" ] || { time "$SYNTH" synth --shape llama3-8b --type Q4_0 --seed 42 -o "$MODEL"; } 2>&1 | tail -3
    JOBS=${JOBS:-16} experiments/build-llamacpp-cuda.sh > "$RES/llamacpp-build.log" 2>&1 \
        && echo "llama.cpp built: $(tail -1 "$RES/llamacpp-build.log")" \
        || { tail -30 "$RES/llamacpp-build.log"; exit 1; }
    ;;
oato)
    { header; "$OATO" profile "$MODEL" --force -t "$THREADS" -o "$RES/profile.json"; } > "$RES/profile.txt" 2>&1
    cat "$RES/profile.txt"
    for pol in ${POLICIES:-oato oato-paper layer-split}; do
        for b in ${BUDGETS:-25% 50% 75%}; do
            "$OATO" plan --profile "$RES/profile.json" --vram-budget "$b" --policy "$pol" \
                -o "$RES/plan-$pol-${b%\%}.json" > "$RES/plan-$pol-${b%\%}.txt" 2>&1 || true
        done
    done
    OATO_BIN=$OATO MODEL=$MODEL OUT="$RES/placement-sweep" PLAIN="" THREADS=$THREADS \
        POLICIES=${POLICIES:-"oato oato-paper layer-split flexgen"} REPS=${REPS:-3} \
        experiments/placement-sweep.sh 2>&1 | tee "$RES/placement-sweep.log" | grep -v "^== " || true
    { header; cat "$RES/placement-sweep.md"; } > "$RES/placement-sweep.header.md" 2>/dev/null || true
    cat "$RES/placement-sweep.md" || true
    ;;
peer)
    MODEL=$MODEL RES=$RES THREADS=$THREADS REPS=${REPS:-3} experiments/hybrid-vs-llamacpp.sh 2>&1 | tail -40
    # TTFT against prompt length at the first share (issue 11): llama.cpp's -ngl, op offload on.
    bin=${LLAMA_BIN:-/tmp/llamacpp-cuda/llama.cpp/build/bin}
    ngl=$(( $(python3 -c "print(${N_LAYER:-32})") * ${LENGTH_SHARE:-25} / 100 ))
    "$bin/llama-bench" -m "$MODEL" -ngl "$ngl" -p "$(echo ${LENGTHS:-32 128 512 2048} | tr ' ' ',')" \
        -n 0 -r "${REPS:-3}" -t "$THREADS" -o csv > "$RES/llamacpp-lengths.csv" 2> "$RES/llamacpp-lengths.log" || true
    cat "$RES/llamacpp-lengths.csv"
    ;;
kernels)
    OATO_BIN=$OATO MODEL=$MODEL REPS=${REPS:-3} THREADS=$THREADS OUT="$RES/gpu-vs-llamacpp" \
        experiments/gpu-vs-llamacpp.sh 2>&1 | tail -40
    ;;
graphs)
    # Hybrid decode runs several GPU segments per token, each a graph launch when graphs are on.
    for g in on off; do
        OATO_CUDA_GRAPHS=$([ $g = on ] && echo 1 || echo 0) OATO_BIN=$OATO MODEL=$MODEL \
            OUT="$RES/graphs-$g" PLAIN="" THREADS=$THREADS POLICIES=oato \
            BUDGETS="${GRAPH_BUDGETS:-50% 75%}" REPS=${REPS:-3} \
            experiments/placement-sweep.sh > "$RES/graphs-$g.log" 2>&1 || true
        echo "== CUDA graphs $g"
        tail -4 "$RES/graphs-$g.md" 2>/dev/null || tail -5 "$RES/graphs-$g.log"
    done
    ;;
lengths)
    # TTFT against prompt length (issue 11) at LENGTH_SHARE (25%) for POLICIES (oato layer-split).
    for p in ${LENGTHS:-32 128 512 2048}; do
        OATO_BIN=$OATO MODEL=$MODEL OUT="$RES/lengths-p$p" PLAIN="" THREADS=$THREADS P=$p GEN=${GEN:-8} CTX=$((p + 64 > 1024 ? p + 64 : 1024)) \
            POLICIES=${POLICIES:-"oato layer-split"} BUDGETS="${LENGTH_SHARE:-25}%" REPS=${REPS:-2} \
            experiments/placement-sweep.sh > "$RES/lengths-p$p.log" 2>&1 || true
        tail -4 "$RES/lengths-p$p.md" 2>/dev/null || tail -5 "$RES/lengths-p$p.log"
    done
    ;;
cpu)
    # Issue 13 on this machine's CPU: decode all on the CPU at CPU_THREADS ("4 8 16"), oato with
    # Q4_0 interleaved (the default) and in the file's layout (OATO_CPU_REPACK=0) against
    # llama.cpp (the CUDA build with -ngl 0: decode of one token never leaves the CPU), the
    # variants alternated ROUNDS (2) times; `oato bench` prints each decode's fraction of the read
    # bandwidth it measures (--membw) at that thread count.
    bin=${LLAMA_BIN:-/tmp/llamacpp-cuda/llama.cpp/build/bin}
    out=$RES/cpu-decode.md
    { header; echo; echo "| threads | round | engine | tg${CPU_GEN:-16} t/s | runs' fraction of read bandwidth | paired tokens' fraction |"; echo "|---:|---:|---|---:|---|---|"; } > "$out"
    for t in ${CPU_THREADS:-4 8 16}; do
        "$OATO" bench --membw 1G -t "$t" >> "$RES/cpu-membw.txt" 2>&1 || true
        for r in $(seq "${ROUNDS:-2}"); do
            for v in interleaved rows llama.cpp; do
                case $v in
                llama.cpp)
                    ts=$("$bin/llama-bench" -m "$MODEL" -ngl 0 -t "$t" -p 0 -n "${CPU_GEN:-16}" -r 2 -o csv 2>/dev/null \
                        | tail -1 | python3 -c 'import csv,sys; print(list(csv.reader(sys.stdin))[0][-2])' || echo "-")
                    frac="" paired="" ;;
                *)
                    cpu_decode "$RES/cpu-$v-t$t-r$r.txt" "$t" \
                        OATO_CPU_REPACK=$([ $v = rows ] && echo 0 || echo 1) ;;
                esac
                echo "| $t | $r | $v | $ts | $frac | $paired |" | tee -a "$out"
            done
        done
    done
    cat "$RES/cpu-membw.txt"
    ;;
cpu-prefetch)
    # Issue 13 on this machine's CPU: decode of the 8B file all on the CPU with each prefetch of
    # the interleaved kernels (hint:bytes ahead, OATO_CPU_REPACK_PREFETCH_HINT and
    # OATO_CPU_REPACK_PREFETCH; "default" is the vendor's choice: t1 at 16 KiB on Intel, nta at
    # 256 bytes elsewhere; bytes 0 is none; "smallpages": the default prefetch with the weights
    # and the read loops in 4 KiB pages, OATO_HUGE_PAGES=0), the variants alternated ROUNDS (2)
    # times; oato bench's fractions of the read bandwidth, over its runs and its paired tokens.
    out=$RES/cpu-prefetch.md
    { header; echo; echo "| threads | round | prefetch | tg${CPU_GEN:-16} t/s | runs' fraction | paired tokens' fraction |"; echo "|---:|---:|---|---:|---|---|"; } > "$out"
    for t in ${PF_THREADS:-8 16}; do
        for r in $(seq "${ROUNDS:-2}"); do
            for v in ${PF_VARIANTS:-default t1:16384 t1:4096 nta:256 nta:1024 nta:4096 t1:0 smallpages}; do
                case $v in
                default) env=() ;;
                smallpages) env=(OATO_HUGE_PAGES=0) ;;
                *) env=(OATO_CPU_REPACK_PREFETCH_HINT="${v%%:*}" OATO_CPU_REPACK_PREFETCH="${v##*:}") ;;
                esac
                cpu_decode "$RES/cpu-prefetch-${v/:/-}-t$t-r$r.txt" "$t" "${env[@]}"
                echo "| $t | $r | $v | $ts | $frac | $paired |" | tee -a "$out"
            done
        done
    done
    ;;
*)
    echo "usage: $0 build|oato|peer|lengths|kernels|graphs|cpu|cpu-prefetch" >&2
    exit 2
    ;;
esac
if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
    tar czf "$OUT/gpu-hybrid.tgz" "$RES"
fi

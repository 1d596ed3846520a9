#!/usr/bin/env bash
# The open issues' GPU work for one 15-minute device lease (a start of a minute or more counts), in
# priority order, in back-to-back `run` calls (the machine goes back 30 s after a call; at most
# 64 MiB travel a call, the working tree included, so the 94 MiB test model and llama.cpp's CUDA
# build travel in parts).
#
#   here:    experiments/gpu-lease.sh prep
#            builds target/release/oato and packs it, with the llama.cpp CUDA peer prebuilt here
#            when present (.carry/llamacpp-cuda-bin.tar.xz from experiments/prebuild-llamacpp-cuda.sh:
#            22-70 minutes on 2 cores, 42 MB packed; never hold a lease back for it), into
#            .carry/lease-bin.tar;
#            splits the test model into .carry/q41.partIofN so each call stays under 64 MiB; prints
#            the calls to make, each "experiments/gpu-lease.sh next" with its carry list, 600 s.
#   there:   experiments/gpu-lease.sh next      (once per call, in the order prep prints)
#
# Every call stashes what it carried under /tmp/lease (kept while the machine stays warm), then
# runs the stages not yet done, in this order, for as long as its clock allows:
#   on the 8B synth file (LLaMA3-8B shape Q4_0, P=64, G=32, all cores), in this order:
#   selftest --device gpu, also with split weights (every operator and type against the
#   references: the GPU code written since the last GPU session has never run on a GPU), synth, profile (link: weight uploads,
#   activation copies both ways against a pinned copy, crossing, the CPU job's fixed cost), all
#   on the GPU against llama.cpp (kernels: pp64/pp512/tg32/tg128; oato default, OATO_CUDA_SPLIT=1 (with
#   its fused kernels; also with OATO_CUDA_ATTN_SPLIT=1, split decode attention below its 256
#   positions, and that alone), OATO_CUDA_MMA=0 (the int8 prefill GEMM on __dp4a, not tensor cores),
#   OATO_CUDA_FLASH_MMA=0 (the tiled prefill attention on the f32 lanes, not tensor cores),
#   OATO_CUDA_MMVQ_MAX_TOKENS=0 (decode through the prefill GEMM, on tensor cores), the
#   split layout without its fused kernels (OATO_CUDA_GLU=0 OATO_CUDA_QKV_ROPE=0), OATO_CUDA_MMVQ=pipe, OATO_CUDA_GRAPH_SPLIT=0, OATO_CUDA_GRAPHS=0, OATO_CUDA_MMVQ=direct,
#   OATO_CUDA_MMVQ_MULTI=0, OATO_CUDA_FUSE=0), then the settings the later stages run under
#   (pick_best, experiments/pick_variant.py: the variant that decodes fastest without losing
#   prefill speed, by 3% or more, else the defaults; $RES/best.env, best-variant.txt), the
#   placement sweep under them (oato, oato-paper, layer-split at 25/50/75%, predicted beside
#   measured; their own profile when they are not the defaults), the sweep again with the CPU pool free to park
#   between jobs (OATO_CPU_AWAKE=0) in the same rounds, and oato's -ngl 8/16/24 (awake_ab; and
#   by oato bench as llama-bench times them, bench_ngl),
#   selftest --perf (kernel bandwidths, the split
#   layout's and the pipelined kernels at 1-16 thread blocks a multiprocessor, copies staged
#   and direct; prefill attention on tensor cores, on the f32 lanes and per token; the prefill
#   GEMMs on __dp4a, on tensor cores with and without split-K, and by cuBLAS, also at
#   4096x1024, attn_k / attn_v; the back-to-back tables on enough copies of each weight to pass
#   twice the L2), a whole decode step's kernels one by one by Nsight Compute, one pass each
#   (duration, DRAM bytes; oato, oato with split weights, llama.cpp: ncu_step), the 50% / 75% sweep again with split weights and their own profile
#   (split_sweep), an all-GPU decode's steps by the GPU's clock, staged, split and pipelined
#   kernels (gputrace), Nsight Compute's per-kernel figures of a decode step, the split and the
#   pipelined matrix-vector kernels and llama.cpp's (ncu), llama.cpp -ngl at the sweep's shares
#   (op offload on; measured on 2026-11-28, so late), the 75% step traces of oato's and
#   oato-paper's plans (diag75);
#   once the test model is whole: golden greedy ids on the GPU (all-GPU, split weights, graphs
#   off, oato, layer-split, oato-paper, flexgen at 25/50/75%), then decode on the Xeon's CPU
#   against llama.cpp (issue 13); then, with whatever time is left, the paper's Fig. 10, 9, 7
#   and 8 on the 8B file (issue 14; experiments/figN.sh).
# Without the prebuilt peer, the first call builds llama.cpp on the device (~5 min) in the
# background while selftest and synth run, and the timed stages wait for it. Do not hold a lease
# back for the prebuild: on 2026-11-28 a session that built it first (22 min on a Zen 5 VM) found
# the loans paused when it called; call at once.
#
# Each stage has an estimate (about twice what it took on the H200 of 2026-11-28); one that
# would pass DEADLINE seconds (default 540, under the device's 600 s a call) since the call began
# waits for a later call, and one still running at the deadline is killed with its children; $RES/lease.log has each stage's time and fate.
# Results: $RES (default /tmp/lease/res) come back after every call as $OUT/lease.tgz (the later
# call's holds the earlier's); commit them under results/.
# Learnt on 2026-11-28 (H200; results/gpu-2026-11-28-h200): the whole 8B part took 205 s
# against the 1010 s the estimates then added up to (NVRTC's first build 23 s, synth 3 s); make the next call at once, reading
# nothing between (a minute's reading lost the machine and the stash with it); a later call on a
# fresh machine can skip what is done by touching $RES/done.<stage> first. ncu prints its
# per-kernel table only at the end: give it few launches (--launch-count 30) or -o FILE, or a
# timeout returns nothing.
# Env: DEADLINE, REPS (2), THREADS (nproc), RES, SYNTH_ARGS (the big file's `oato synth` flags,
#      default "--shape llama3-8b --type Q4_0 --seed 42"), PEER (1; 0 skips llama.cpp).
# A dry run without a GPU (the CPU-backed test device for the GPU, a 2-layer file, no peer):
#   prep, then for each call: OATO_TEST_DEVICE=4000000000 PEER=0 OATO_SELFTEST_PERF_SMALL=1 \
#       SYNTH_ARGS="--shape llama3.2-1b --type Q4_0 --layers 2" experiments/gpu-lease.sh next
#   (OATO_SELFTEST_PERF_SMALL=1: the perf stage's tables at small sizes; at LLaMA3-8B's the
#   test device ran past a 480 s deadline in that stage alone on the 2-core VM)
set -euo pipefail
self=$(realpath "$0")
cd "$(dirname "$0")/.."
LEASE=/tmp/lease
RES=${RES:-$LEASE/res}
DEADLINE=${DEADLINE:-540}
REPS=${REPS:-2}
THREADS=${THREADS:-$(nproc)}
MODEL8=$LEASE/llama3-8b-q4_0.gguf
TEST=$LEASE/SmolLM2-135M-Instruct.Q4_1.gguf
TEST_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
LIMIT=$((64 << 20))

prep() {
    cargo build --release --quiet
    scripts/fetch-models.sh >&2
    mkdir -p .carry
    local pk=$LEASE.pack
    rm -rf "$pk"
    mkdir -p "$pk/lease-bin"
    xz -c target/release/oato > "$pk/lease-bin/oato.xz"
    if [ -f .carry/llamacpp-cuda-bin.tar.xz ]; then
        cp .carry/llamacpp-cuda-bin.tar.xz "$pk/lease-bin/"
    else
        echo "note: no .carry/llamacpp-cuda-bin.tar.xz: call a builds llama.cpp on the device" >&2
        [ -f .carry/llamacpp-src.tar.xz ] || scripts/make-llamacpp-tarball.sh >&2
        cp .carry/llamacpp-src.tar.xz "$pk/lease-bin/"
    fi
    tar -cf .carry/lease-bin.tar -C "$pk" lease-bin
    rm -rf "$pk"
    # What travels besides the carried files: tracked and untracked-not-ignored files.
    local tree bins model first
    tree=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | xargs -0 stat -c %s 2>/dev/null \
        | awk '{s += $1} END {print s}')
    bins=$(stat -c %s .carry/lease-bin.tar)
    model=$(stat -c %s models/SmolLM2-135M-Instruct.Q4_1.gguf)
    if [ $((LIMIT - tree - bins)) -le 0 ]; then
        echo "error: the tree ($tree B) and binaries ($bins B) do not fit one call of 64 MiB" >&2
        exit 1
    fi
    # Bytes of the model each call carries: the first beside the binaries (maybe none), the
    # others as much as a call takes.
    first=$((LIMIT - tree - bins - (1 << 20)))
    first=$((first < 0 ? 0 : first < model ? first : model))
    local rest=$((LIMIT - tree - (1 << 20))) sizes=("$first") left=$((model - first)) i=0 at=0 n=0
    while [ "$left" -gt 0 ]; do
        sizes+=("$((left < rest ? left : rest))")
        left=$((left - ${sizes[-1]}))
    done
    for sz in "${sizes[@]}"; do n=$((n + (sz > 0))); done
    rm -f .carry/q41.part*
    echo "tree $tree B, .carry/lease-bin.tar $bins B, model $model B in $n parts" >&2
    local calls=()
    for sz in "${sizes[@]}"; do
        local carry=()
        [ ${#calls[@]} -eq 0 ] && carry+=('".carry/lease-bin.tar"')
        if [ "$sz" -gt 0 ]; then
            i=$((i + 1))
            dd if=models/SmolLM2-135M-Instruct.Q4_1.gguf of=".carry/q41.part${i}of$n" bs=1M \
                iflag=skip_bytes,count_bytes skip="$at" count="$sz" status=none
            at=$((at + sz))
            carry+=("\".carry/q41.part${i}of$n\"")
        fi
        calls+=("run(carry=[$(IFS=,; echo "${carry[*]}" | sed 's/,/, /g')], timeout_s=600, command=\"experiments/gpu-lease.sh next\")")
    done
    local k=0
    for c in "${calls[@]}"; do
        k=$((k + 1))
        echo "call $k: $c" >&2
    done
    echo "(each at once after the one before; then give_back; results: lease.tgz after each call)" >&2
    echo "(a lease is 15 device minutes in all: when a call's limit_s would be under its DEADLINE," >&2
    echo " prefix the command with DEADLINE=<the call's budget_left_s - 60>, or the device tool" >&2
    echo " kills the call and nothing comes back)" >&2
}

t0=$SECONDS
log() { echo "$(date -u +%H:%M:%S) [$((SECONDS - t0)) s] $*" | tee -a "$RES/lease.log" >&2; }
# stage NAME ESTIMATE_S FUNCTION ARGS...: runs it (in a process of its own, killed with its
# children at the deadline) unless its estimate would pass the deadline; marks it done.
stage() {
    local name=$1 est=$2 s=$SECONDS left rc=0
    shift 2
    if [ -f "$RES/done.$name" ]; then return 0; fi
    left=$((DEADLINE - SECONDS + t0))
    if [ "$est" -gt "$left" ]; then
        log "SKIP  $name (needs ~$est s, $left s left)"
        return 0
    fi
    log "start $name (~$est s)"
    timeout -k 5 "$left" "$self" run-stage "$@" > "$RES/$name.log" 2>&1 || rc=$?
    touch "$RES/done.$name"
    case $rc in
    0) log "ok    $name ($((SECONDS - s)) s)" ;;
    124 | 137) log "KILLED $name at the deadline ($((SECONDS - s)) s)" ;;
    *) log "FAIL  $name ($((SECONDS - s)) s, exit $rc): $(tail -n 2 "$RES/$name.log" | tr '\n' ' ')" ;;
    esac
}
header() {
    peer_building && echo "# (llama.cpp's CUDA build ran beside this stage, at nice 19)"
    echo "# $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)," \
        "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores," \
        "$(date -u +%Y-%m-%dT%H:%M:%SZ), oato $("$OATO" --version), $THREADS threads"
}

OATO=$LEASE/lease-bin/oato
LLAMA=$LEASE/lease-bin/llama-cuda-bin
export OATO_CACHE_DIR=$LEASE/cache

# The stages.
# Also with weights in split.cu's layout (the split matrix-vector kernels of every split format):
# the likely next default has never run on a GPU.
s_selftest() {
    header
    "$OATO" selftest --device gpu
    echo "== OATO_CUDA_SPLIT=1"
    OATO_CUDA_SPLIT=1 "$OATO" selftest --device gpu
}
s_synth() {
    # shellcheck disable=SC2086  # flags
    "$OATO" synth ${SYNTH_ARGS:---shape llama3-8b --type Q4_0 --seed 42} -o "$MODEL8.tmp" && mv "$MODEL8.tmp" "$MODEL8"
}
s_profile() { header; "$OATO" profile "$MODEL8" --force -t "$THREADS" -o "$RES/profile-8b.json"; }
# The CUDA settings the kernels stage's figures chose (pick_best, experiments/pick_variant.py:
# the variant that decodes fastest all on the GPU without losing prefill speed; none: the
# defaults) for the stages that measure the engine as the next commit would ship it: exported
# into the stage's process and named in its log.
# The picked settings (VAR=VALUE words; nothing for the defaults or before a pick).
best_settings() { xargs 2> /dev/null < "$RES/best.env" || true; }
use_best() {
    local v set
    if [ ! -f "$RES/best.env" ]; then
        echo "# CUDA settings: the defaults (the kernels stage has not picked any)"
        return 0
    fi
    set=$(best_settings)
    for v in $set; do export "${v?}"; done
    echo "# CUDA settings: ${set:-the defaults} (picked from the kernels stage's figures: best-variant.txt)"
}
# The profile the plans of the stages under use_best come from: their own when the settings
# differ from the defaults (the profile cache keys the split layout apart, and kernel times move).
best_profile() {
    if [ -n "$(best_settings)" ]; then
        [ -f "$RES/profile-8b-best.json" ] ||
            "$OATO" profile "$MODEL8" --force -t "$THREADS" -o "$RES/profile-8b-best.json" > "$RES/profile-best.log" 2>&1
        echo "$RES/profile-8b-best.json"
    else
        echo "$RES/profile-8b.json"
    fi
}
# After the kernels stage: best.env from its raw figures (once; its reasons in best-variant.txt).
pick_best() {
    [ -f "$RES/best.env" ] && return 0
    [ -f "$RES/gpu-vs-llamacpp-raw/variants.tsv" ] || return 0
    if python3 experiments/pick_variant.py "$RES/gpu-vs-llamacpp-raw" > "$RES/best.env.tmp" 2> "$RES/best-variant.txt"; then
        mv "$RES/best.env.tmp" "$RES/best.env"
        log "picked CUDA settings: $(grep -o '^picked: .*' "$RES/best-variant.txt" | cut -c 9- | cut -d: -f1)"
    else
        rm -f "$RES/best.env.tmp"
        log "pick_variant failed (the defaults stay): $(tail -n 1 "$RES/best-variant.txt")"
    fi
}
s_sweep() {
    use_best
    local prof
    prof=$(best_profile)
    for pol in oato oato-paper layer-split; do
        for b in 25% 50% 75%; do
            "$OATO" plan --profile "$prof" --vram-budget "$b" --policy "$pol" \
                -o "$RES/plan-$pol-${b%\%}.json" > "$RES/plan-$pol-${b%\%}.txt" 2>&1 || true
        done
    done
    OATO_BIN=$OATO MODEL=$MODEL8 OUT="$RES/placement-sweep-8b" PLAIN="" THREADS=$THREADS \
        POLICIES="oato oato-paper layer-split" REPS=$REPS experiments/placement-sweep.sh
    { header; use_best; cat "$RES/placement-sweep-8b.md"; } > "$RES/placement-sweep-8b.header.md"
}
# Issues 10 and 12 with the weights in split.cu's layout (OATO_CUDA_SPLIT=1): a profile of its
# own (the profile cache keys the layout apart) and the 50% / 75% sweep of the three policies.
s_split_sweep() {
    header
    if [[ " $(best_settings) " == *" OATO_CUDA_SPLIT=1 "* ]]; then
        echo "the split layout is the picked setting: the sweep stage ran with it"
        return 0
    fi
    OATO_CUDA_SPLIT=1 "$OATO" profile "$MODEL8" --force -t "$THREADS" -o "$RES/profile-8b-split.json"
    OATO_CUDA_SPLIT=1 OATO_BIN=$OATO MODEL=$MODEL8 OUT="$RES/placement-sweep-8b-split" PLAIN="" \
        THREADS=$THREADS BUDGETS="50% 75%" POLICIES="oato oato-paper layer-split" REPS=$REPS \
        experiments/placement-sweep.sh
}
# The CPU pool kept awake through a hybrid forward pass (the default since 2026-12-02; on a
# 2-core VM a job after a wait of 0.5 ms or more took 30-100 us longer free to park, a parked
# worker's wake-up; results/cpu-pool-awake.md) against OATO_CPU_AWAKE=0, in the same rounds, the
# sweep's profile (cached) and budgets. oato and oato-paper: on 2026-11-28 oato's 75% plan (20
# lone ffn_up jobs on the CPU a token) trailed oato-paper's (8 gate + up pairs, 4 singles) by 2.9
# ms of TPOT, and its traces showed a fixed cost of about 145 us a CPU job at 16 threads that
# back-to-back jobs (the 2-core VM's host.job_us: 0-4 us) did not: wake-ups would explain it
# (results/gpu-2026-11-28-h200/analysis-75.md).
# Also oato's -ngl 8 / 16 / 24 (no plan: llama.cpp's split of the same layers, its op offload's
# prefill streaming from 32 tokens), to set beside peer_hybrid's llama.cpp -ngl.
s_awake_ab() {
    header
    use_best
    OATO_BIN=$OATO MODEL=$MODEL8 OUT="$RES/placement-sweep-8b-awake" PLAIN="" THREADS=$THREADS \
        POLICIES="oato oato-paper" VARIANTS="awake0:OATO_CPU_AWAKE=0" NGL="8 16 24" REPS=$REPS \
        experiments/placement-sweep.sh
}
# oato bench -ngl 8,16,24 (llama-bench's tests and its count of -ngl: the head and N-1 layers;
# prefill streaming as its op offload) on the 8B file, to set beside peer_hybrid's llama-bench
# -ngl at the same values: the same method for both engines.
s_bench_ngl() {
    header
    use_best
    "$OATO" bench "$MODEL8" -ngl 8,16,24 -p 64 -n 32 -r "$REPS" -t "$THREADS" --json \
        > "$RES/bench-ngl-8b.json"
    python3 -c 'import json,sys
for t in json.load(open(sys.argv[1])):
    kind = "pp%d" % t["n_prompt"] if t["n_prompt"] else "tg%d" % t["n_gen"]
    print("ngl %2d %-5s %9.2f t/s" % (t["n_gpu_layers"], kind, t["avg_ts"]))' "$RES/bench-ngl-8b.json"
}
s_build_peer() { # only without the prebuilt peer
    JOBS=16 PREFIX=$LEASE/llamacpp TARBALL=$LEASE/lease-bin/llamacpp-src.tar.xz experiments/build-llamacpp-cuda.sh
    rm -rf "$LLAMA" && mkdir -p "$LLAMA" && cp -a "$LEASE"/llamacpp/llama.cpp/build/bin/. "$LLAMA/"
    : > "$LLAMA/RUN-ENV.sh"
}
peer_env() { # shellcheck disable=SC1091
    . "$LLAMA/RUN-ENV.sh"
}
s_peer_hybrid() {
    peer_env
    MODEL=$MODEL8 LLAMA_BIN=$LLAMA RES=$RES THREADS=$THREADS REPS=$REPS NOPO=0 \
        experiments/hybrid-vs-llamacpp.sh
}
# nvidia-smi's SM / memory clocks, power and load every 200 ms while a stage runs, into
# $RES/clocks-NAME.csv (METHOD.md: measure the card as found; an idle H200's SM clock was seen at
# 345 MHz, 1980 under load, so a table timed between host-side pauses may run below full clock).
clocks_start() {
    command -v nvidia-smi > /dev/null || return 0
    nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,utilization.gpu,temperature.gpu \
        --format=csv -lms 200 > "$RES/clocks-$1.csv" 2> /dev/null &
    CLOCKS_PID=$!
    trap clocks_stop EXIT # a stage is a process of its own: a failing command ends it here
}
clocks_stop() {
    [ -n "${CLOCKS_PID:-}" ] && kill "$CLOCKS_PID" 2> /dev/null || true
    CLOCKS_PID=
}
s_kernels() {
    peer_env
    clocks_start kernels
    OATO_BIN=$OATO MODEL=$MODEL8 LLAMA_BIN=$LLAMA REPS=$REPS THREADS=$THREADS OUT="$RES/gpu-vs-llamacpp" \
        RAW_DIR="$RES/gpu-vs-llamacpp-raw" VARIANTS="default split split-attn-split attn-split-on mma-off flash-mma-off gemm-decode split-fused-off mmvq-pipe graph-split-off graphs-off mmvq-direct multi-off fuse-off" \
        experiments/gpu-vs-llamacpp.sh
    clocks_stop
}
s_perf() {
    header
    clocks_start perf
    "$OATO" selftest --device gpu --perf
    clocks_stop
}
# Issue 12: whole decode steps kernel by kernel, oato's (default; split weights) and llama.cpp's,
# by Nsight Compute with one pass a kernel: duration, DRAM bytes and registers, with the caches and
# clocks as the run leaves them (--cache-control none --clock-control none). experiments/ncu_step.py
# keeps the whole forwards (each ends with the output head, the largest grid) and prints a line per
# kernel kind and the forward's kernel time: against the kernels stage's tg figures, the rest of a
# step is the gaps between kernels. An oato decode forward is about 290 launches (9 a layer; the
# stand-in driver counts them), so 600 from launch 300 hold one or more; llama.cpp's more.
NCU_STEP_METRICS=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,launch__registers_per_thread
ncu_step_run() { # name, launches to skip, launches to profile, command...
    local name=$1 skip=$2 count=$3 units
    shift 3
    # Base units (ns, bytes) where this ncu takes --print-units; ncu_step.py converts scaled
    # ones too, so an ncu that refuses the flag is asked again without it.
    for units in "--print-units base" ""; do
        # shellcheck disable=SC2086  # $units: the flag and its value, or nothing
        timeout 150 "$NCU_BIN" --metrics "$NCU_STEP_METRICS" --cache-control none \
            --clock-control none --launch-skip "$skip" --launch-count "$count" --csv $units \
            --log-file "$RES/ncu-step-$name.csv" "$@" > "$RES/ncu-step-$name.out" 2>&1 ||
            echo "ncu on $name ($units): exit $?"
        grep -q '"Metric Name"' "$RES/ncu-step-$name.csv" 2> /dev/null && return 0
        grep -qi 'print-units' "$RES/ncu-step-$name.out" || return 0
    done
}
# Nsight Compute's binary in NCU_BIN; false (and a line saying so) on a machine without it.
find_ncu() {
    NCU_BIN=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
    [ -x "$NCU_BIN" ] || { echo "no ncu on this machine"; return 1; }
}
s_ncu_step() {
    header
    find_ncu || return 0
    local run=(run "$MODEL8" --device gpu -p hello -n 6 --temp 0 --ignore-eos -t "$THREADS")
    OATO_CUDA_GRAPHS=0 ncu_step_run oato 300 600 "$OATO" "${run[@]}"
    OATO_CUDA_SPLIT=1 OATO_CUDA_GRAPHS=0 ncu_step_run oato-split 300 600 "$OATO" "${run[@]}"
    python3 experiments/ncu_step.py "$RES"/ncu-step-*.csv
}
# llama.cpp's decode step the same way (a stage of its own: ncu_step may run while the peer builds).
s_ncu_step_peer() {
    header
    find_ncu || return 0
    peer_env
    GGML_CUDA_DISABLE_GRAPHS=1 ncu_step_run llamacpp 100 1000 \
        "$LLAMA/llama-bench" -m "$MODEL8" -p 0 -n 8 -r 1 -ngl 99
    python3 experiments/ncu_step.py "$RES"/ncu-step-*.csv
}
# Issue 10 at 75%: oato's plan trailed oato-paper's on TPOT on the H200 (one matrix on the CPU in
# each of 20 layers against 20 in 14 layers); each step's time per forward for both, to see
# whether the CPU's pieces cost more than their bytes. The prompt is about 64 tokens (the synth
# vocabulary splits a word into about eight), as the plans assume.
s_diag75() {
    header
    use_best
    local pol prof
    prof=$(best_profile)
    for pol in oato oato-paper; do
        "$OATO" plan --profile "$prof" --vram-budget 75% --policy "$pol" \
            -o "$RES/diag75-$pol.json" > /dev/null
        echo "== $pol"
        OATO_TRACE_STEPS=1 "$OATO" run "$MODEL8" --placement "$RES/diag75-$pol.json" \
            -p "$(printf 'hello %.0s' $(seq 8))" -n 64 -t "$THREADS" --temp 0 --ignore-eos 2>&1 | grep -E 'TTFT|TPOT|n=1 '
    done
}
# Issue 12: every step of an all-GPU decode by the GPU's own clock (OATO_TRACE_STEPS=gpu: events
# around each step; the held-launch fusions are split by it), 8B file, 64 tokens.
s_gputrace() {
    header
    local mode
    for mode in staged split pipe; do
        echo "== $mode"
        # split: the file layout's kernels' mode with the weights split (split.cu's kernels).
        OATO_CUDA_SPLIT=$([ $mode = split ] && echo 1 || echo 0) \
            OATO_CUDA_MMVQ=$([ $mode = split ] && echo staged || echo $mode) \
            OATO_TRACE_STEPS=gpu "$OATO" run "$MODEL8" --device gpu -p hello -n 64 \
            --temp 0 --ignore-eos -t "$THREADS" 2>&1 | grep -E 'TTFT|TPOT|trace|n=1 '
    done
}
# Issue 12: per-kernel figures of an all-GPU decode step (graphs off), oato's and llama.cpp's, by
# Nsight Compute: duration, DRAM throughput (% of peak), achieved occupancy, registers and shared
# memory per thread block, warp stall cycles (the raw CSV has the stall reasons), so the
# matrix-vector kernels' 26% of HBM has a cause. Few launches each
# (ncu prints its table only at the end): oato's first decode step after prefill, 45 launches (three
# layers); the split layout's matrix-vector kernels (OATO_CUDA_SPLIT=1) and the pipelined ones
# (OATO_CUDA_MMVQ=pipe), 16 launches each; llama.cpp's matrix-vector kernels, 24 launches.
NCU_SECTIONS="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats"
s_ncu() {
    header
    local ncu
    ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
    [ -x "$ncu" ] || { echo "no ncu on this machine"; return 0; }
    echo "== oato (OATO_CUDA_GRAPHS=0): launches 700-744 of a 1-token prompt + 3 decode steps"
    # shellcheck disable=SC2086  # the section flags
    OATO_CUDA_GRAPHS=0 timeout 150 "$ncu" --launch-skip 700 --launch-count 45 $NCU_SECTIONS --csv \
        "$OATO" run "$MODEL8" --device gpu -p hello -n 3 --temp 0 --ignore-eos -t "$THREADS" \
        > "$RES/ncu-oato.csv" 2> "$RES/ncu-oato.err" || echo "ncu on oato: exit $?"
    echo "== oato (OATO_CUDA_SPLIT=1, OATO_CUDA_GRAPHS=0): the split layout's matrix-vector kernels (the fused glu / qkv_rope ones too), 16 launches"
    # shellcheck disable=SC2086
    OATO_CUDA_SPLIT=1 OATO_CUDA_GRAPHS=0 timeout 100 "$ncu" --kernel-name regex:mmvq_split \
        --launch-skip 140 --launch-count 16 $NCU_SECTIONS --csv \
        "$OATO" run "$MODEL8" --device gpu -p hello -n 3 --temp 0 --ignore-eos -t "$THREADS" \
        > "$RES/ncu-oato-split.csv" 2> "$RES/ncu-oato-split.err" || echo "ncu on oato (split): exit $?"
    echo "== oato (OATO_CUDA_MMVQ=pipe, OATO_CUDA_GRAPHS=0): the pipelined matrix-vector kernels, 16 launches"
    # shellcheck disable=SC2086
    OATO_CUDA_MMVQ=pipe OATO_CUDA_GRAPHS=0 timeout 100 "$ncu" --kernel-name regex:mmvq_pipe \
        --launch-skip 140 --launch-count 16 $NCU_SECTIONS --csv \
        "$OATO" run "$MODEL8" --device gpu -p hello -n 3 --temp 0 --ignore-eos -t "$THREADS" \
        > "$RES/ncu-oato-pipe.csv" 2> "$RES/ncu-oato-pipe.err" || echo "ncu on oato (pipe): exit $?"
    if peer_ready; then
        peer_env
        echo "== llama.cpp (GGML_CUDA_DISABLE_GRAPHS=1): its matrix-vector kernels, 24 launches"
        # shellcheck disable=SC2086
        GGML_CUDA_DISABLE_GRAPHS=1 timeout 150 "$ncu" --kernel-name regex:mul_mat_vec \
            --launch-skip 64 --launch-count 24 $NCU_SECTIONS --csv \
            "$LLAMA/llama-bench" -m "$MODEL8" -p 0 -n 4 -r 1 -ngl 99 \
            > "$RES/ncu-llamacpp.csv" 2> "$RES/ncu-llamacpp.err" || echo "ncu on llama.cpp: exit $?"
    fi
    # The table's essentials: kernel, grid, block, duration, DRAM throughput, occupancy.
    python3 - "$RES"/ncu-oato.csv "$RES"/ncu-oato-split.csv "$RES"/ncu-oato-pipe.csv "$RES"/ncu-llamacpp.csv <<'PY' || true
import csv, sys, collections
want = ("Duration", "DRAM Throughput", "Achieved Occupancy", "Registers Per Thread",
        "Static Shared Memory Per Block", "Memory Throughput", "Warp Cycles Per Issued Instruction")
for path in sys.argv[1:]:
    try:
        rows = [r for r in csv.reader(open(path)) if len(r) > 10]
    except OSError:
        continue
    if not rows:
        continue
    head, body = rows[0], rows[1:]
    col = {name: i for i, name in enumerate(head)}
    if "Metric Name" not in col:
        continue
    print("==", path)
    by = collections.OrderedDict()
    for r in body:
        key = (r[col["ID"]], r[col["Kernel Name"]][:40], r[col.get("Grid Size", 0)], r[col.get("Block Size", 0)])
        if r[col["Metric Name"]] in want:
            by.setdefault(key, {})[r[col["Metric Name"]]] = r[col["Metric Value"]] + " " + r[col["Metric Unit"]]
    for key, m in by.items():
        print(" | ".join(key) + " | " + "; ".join(f"{k}: {m[k]}" for k in want if k in m))
PY
}
golden() { # name, oato run flags...
    local name=$1
    shift
    python3 experiments/golden_check.py --oato "$OATO" --model "$TEST" --out "$RES/golden-$name.json" -- "$@"
}
s_golden_gpu() { golden gpu --device gpu; }
s_golden_graphs_off() { OATO_CUDA_GRAPHS=0 golden gpu-graphs-off --device gpu; }
s_golden_split() { OATO_CUDA_SPLIT=1 golden gpu-split --device gpu; }
s_golden_hybrid() { # policy, budget
    golden "$1-${2%\%}" --vram-budget "$2" --policy "$1"
}
# The picked settings' tokens (when they are not the defaults): all on the GPU and oato at 50%.
s_golden_best() {
    [ -n "$(best_settings)" ] || { echo "the defaults: checked above"; return 0; }
    use_best
    golden best-gpu --device gpu
    golden best-oato-50 --vram-budget 50% --policy oato
}
# Issue 14: the paper's figures from this machine, if a call has time left after everything above
# (experiments/figN.sh, configs/figN.toml; llama.cpp's -ngl rows where the peer is here). The
# lease's synth file stands in for the configs' llama3-8b model (the same `oato synth` flags by
# default; in a dry run, the small file), and its profile is in the cache already. Results:
# $RES/paper/figN*.csv, figures in $RES/paper-figures.
s_paper() { # figure, experiments/figN.sh flags...
    local fig=$1
    shift
    header
    use_best
    # Without the peer, a folder with no llama-bench: paper.py then skips llama.cpp's rows
    # rather than looking for another build.
    local llama=$LEASE/no-peer
    if peer_ready; then
        peer_env
        llama=$LLAMA
    fi
    mkdir -p "$LEASE/paper-models"
    ln -sf "$MODEL8" "$LEASE/paper-models/llama3-8b-Q4_0-s42.gguf"
    OATO_BIN=$OATO OATO_PAPER_MODELS=$LEASE/paper-models LLAMA_BIN=$llama \
        experiments/"$fig".sh --res "$RES/paper" --figures "$RES/paper-figures" "$@"
}
s_cpu_xeon() {
    peer_env
    OATO_BIN=$OATO MODEL=$MODEL8 RES=$RES LLAMA_BIN=$LLAMA CPU_THREADS="8 16" ROUNDS=1 experiments/gpu-hybrid.sh cpu
}
peer_ready() { [ "${PEER:-1}" = 1 ] && [ -x "$LLAMA/llama-bench" ]; }
# Without the prebuilt peer, its build (~5 min) runs in the background beside the stages that
# time nothing on the CPU (selftest, synth); the stages after them wait for it, so that no
# timing shares the CPU with a compiler.
peer_bg_start() {
    [ "${PEER:-1}" = 1 ] && ! peer_ready && [ -f "$LEASE/lease-bin/llamacpp-src.tar.xz" ] || return 0
    [ -f "$RES/done.build_peer" ] && return 0
    peer_building && return 0
    log "start build_peer in the background"
    setsid nice -n 19 "$self" run-stage s_build_peer > "$RES/build_peer.log" 2>&1 < /dev/null &
    echo $! > "$RES/build_peer.pid"
}
# Whether the background build is running.
peer_building() {
    local pid
    pid=$(cat "$RES/build_peer.pid" 2> /dev/null) && kill -0 "$pid" 2> /dev/null
}
# Waits for the background build while this call's clock leaves a minute; false if it still runs.
peer_bg_wait() {
    local pid
    pid=$(cat "$RES/build_peer.pid" 2>/dev/null) || return 0
    while kill -0 "$pid" 2>/dev/null; do
        if [ $((SECONDS - t0)) -ge $((DEADLINE - 60)) ]; then
            log "build_peer still running: the timed stages wait for the next call"
            return 1
        fi
        sleep 5
    done
    rm -f "$RES/build_peer.pid"
    touch "$RES/done.build_peer"
    if peer_ready; then log "build_peer done"; else log "FAIL  build_peer: $(tail -n 2 "$RES/build_peer.log" | tr '\n' ' ')"; fi
}
stages_8b() {
    peer_bg_start
    stage selftest 90 s_selftest
    stage synth 30 s_synth
    # While llama.cpp builds (no prebuilt peer: some 5 minutes of a first call that would be
    # waited away), the stages whose figures come from the GPU's clock (selftest --perf's event
    # timings, Nsight Compute's replays, per-step GPU events) rather than the host's; the build runs
    # at nice 19. Each starts only while the build still runs; the others keep their places below.
    local st
    for st in "perf 50 s_perf" "ncu_step 150 s_ncu_step" "gputrace 60 s_gputrace"; do
        [ -f "$MODEL8" ] && peer_building || break
        # shellcheck disable=SC2086  # name, estimate, function
        stage $st
    done
    peer_bg_wait || return 0
    [ -f "$MODEL8" ] || { log "no 8B file yet: its stages wait"; return 0; }
    stage profile 30 s_profile
    # The kernels first: their figures pick the settings the sweep and the later stages run under.
    peer_ready && stage kernels 150 s_kernels
    pick_best
    [ -f "$RES/profile-8b.json" ] && stage sweep 200 s_sweep
    [ -f "$RES/profile-8b.json" ] && stage awake_ab 150 s_awake_ab
    stage bench_ngl 60 s_bench_ngl
    stage perf 50 s_perf
    stage ncu_step 150 s_ncu_step
    peer_ready && stage ncu_step_peer 60 s_ncu_step_peer
    [ -f "$MODEL8" ] && stage split_sweep 120 s_split_sweep
    [ -f "$MODEL8" ] && stage gputrace 60 s_gputrace
    stage ncu 260 s_ncu
    # Measured on the H200 of 2026-11-28 (results/gpu-2026-11-28-h200): last, for a lease of
    # 15 device minutes.
    peer_ready && stage peer_hybrid 40 s_peer_hybrid
    [ -f "$RES/profile-8b.json" ] && stage diag75 40 s_diag75
    return 0
}
stages_golden() {
    stage golden_gpu 60 s_golden_gpu
    stage golden_split 30 s_golden_split
    stage golden_best 40 s_golden_best
    stage golden_oato_50 20 s_golden_hybrid oato 50%
    stage golden_layer_split_25 20 s_golden_hybrid layer-split 25%
    stage golden_graphs_off 20 s_golden_graphs_off
    stage golden_oato_paper_75 20 s_golden_hybrid oato-paper 75%
    stage golden_flexgen_50 20 s_golden_hybrid flexgen 50%
    local pb
    for pb in "oato 25%" "oato 75%" "layer-split 50%" "layer-split 75%" "oato-paper 25%" "oato-paper 50%"; do
        set -- $pb
        stage "golden_${1//-/_}_${2%\%}" 20 s_golden_hybrid "$1" "$2"
    done
}
# Stashes what this call carried; assembles the test model once every part is here.
stash() {
    if [ -f .carry/lease-bin.tar ] && [ ! -x "$OATO" ]; then
        tar -xf .carry/lease-bin.tar -C "$LEASE"
        xz -dc "$LEASE/lease-bin/oato.xz" > "$OATO.tmp" && chmod +x "$OATO.tmp" && mv "$OATO.tmp" "$OATO"
        if [ -f "$LEASE/lease-bin/llamacpp-cuda-bin.tar.xz" ]; then
            tar -xJf "$LEASE/lease-bin/llamacpp-cuda-bin.tar.xz" -C "$LEASE/lease-bin"
        fi
    fi
    local p n
    for p in .carry/q41.part*of*; do
        [ -f "$p" ] && cp "$p" "$LEASE/"
    done
    [ -f "$TEST" ] && return 0
    n=$(find "$LEASE" -maxdepth 1 -name 'q41.part*of*' | head -1 | sed 's/.*of\([0-9]*\)$/\1/')
    [ -n "$n" ] || return 0
    for i in $(seq "$n"); do [ -f "$LEASE/q41.part${i}of$n" ] || return 0; done
    for i in $(seq "$n"); do cat "$LEASE/q41.part${i}of$n"; done > "$TEST.tmp"
    echo "$TEST_SHA  $TEST.tmp" | sha256sum -c --status || { log "the reassembled test model's sha256 differs"; return 1; }
    mv "$TEST.tmp" "$TEST"
    log "test model assembled from $n parts"
}

case ${1:-} in
prep) prep ;;
run-stage)
    shift
    unset OUT # the scripts a stage runs would put archives of their own there
    "$@"
    ;;
next)
    mkdir -p "$LEASE" "$RES"
    log "call on $(hostname)"
    stash
    [ -x "$OATO" ] || { log "error: $OATO missing (the first call, carrying .carry/lease-bin.tar, did not run on this machine)"; exit 1; }
    stages_8b
    [ -f "$TEST" ] && stages_golden
    [ -f "$MODEL8" ] && peer_ready && stage cpu_xeon 80 s_cpu_xeon
    # Estimates: about twice what they should take on the H200 (fig10: 48 oato runs of 1.5-3 s,
    # flexgen's the longest, and six llama-bench calls); never run on a GPU yet.
    if [ -f "$MODEL8" ] && [ -f "$RES/profile-8b.json" ]; then
        stage paper_fig10 300 s_paper fig10
        stage paper_fig9 300 s_paper fig9
        stage paper_fig7 120 s_paper fig7 --models llama3-8b
        stage paper_fig8 300 s_paper fig8 --models llama3-8b --reps 1
    fi
    if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then tar czf "$OUT/lease.tgz" -C "$(dirname "$RES")" "$(basename "$RES")"; fi
    ;;
*)
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
    exit 2
    ;;
esac

#!/usr/bin/env bash
# The engine's GPU paths end to end without a GPU, on the stand-in CUDA driver of
# scripts/fake-gpu.sh (the real NVRTC, the emulator's kernels, lazily run streams, guarded
# allocations): the GPU selftest (with its --perf tables at small sizes), then greedy generation checked against llama.cpp's golden ids
# under their parity rule (experiments/golden_check.py) with the whole model on the "GPU", and
# hybrid under layer-split, flexgen (streamed weights on the copy stream), a hand-made mixed
# placement, layer-split with its CPU weights streamed in prefill (rule 5), llama.cpp's -ngl (no plan;
# its CPU weights streamed for the prompt), and the oato policy from a profile of the stand-in device (which rightly puts nothing
# on a "GPU" this slow); the mixed placement also with the activations staged rather than in
# page-locked memory (OATO_CUDA_HOST_PINNED=0). Then MiniCPM3 (latent attention) on a tiny synthetic file: its greedy ids on
# the stand-in GPU, whole and under layer-split and flexgen, equal the CPU's. The all-GPU run goes twice: as configured by default, and with
# OATO_CUDA_MMVQ=direct and OATO_CUDA_ATTN_SPLIT=1 (the direct matrix-vector kernels, and split
# decode attention, which the short prompts would not choose on their own); then a third time with
# OATO_CUDA_MMVQ=pipe (the pipelined matrix-vector kernels), and a fourth with OATO_CUDA_SPLIT=1
# (weights in split.cu's layout; also layer-split that way), then the GPU selftest
# with split weights and, where the Q4_0 / Q8_0 files were fetched, their split greedy ids against
# the CPU's. Only the first
# $OATO_FAKE_GPU_PROMPTS prompts (default 1) and their first $OATO_FAKE_GPU_TOKENS tokens (default 8):
# the emulator is slow (an all-GPU run of 8 tokens takes 19 s on the 2-core VM with a launch's
# blocks on both cores, 37 s on one, so all 6 prompts x 32 tokens would take some 8 minutes a
# placement). Timings printed here are the emulator's and mean nothing.
# Prefill attention of more than 8 tokens takes the tiled kernel (flash_prefill.cu): the third
# golden prompt (9 tokens) is checked for it.
# Decode segments run as CUDA graphs by default (replayed for real by the stand-in driver), so the
# golden checks cover them; graphs_check below also compares with OATO_CUDA_GRAPHS=0, all on the
# GPU and under a mixed placement of whole layers.
set -euo pipefail
cd "$(dirname "$0")/.."
OATO=target/release/oato
N="${OATO_FAKE_GPU_TOKENS:-8}"
# Tokens for the CUDA-graph comparisons (each runs the model twice; four tokens still give three
# replays of a graph built once: on a 2-core VM their two steps took 77 + 22 s, at 8 tokens 94 + 31).
NG="${OATO_FAKE_GPU_GRAPH_TOKENS:-4}"
P="${OATO_FAKE_GPU_PROMPTS:-1}"
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
# The stand-in's profiles stay out of the real cache, its compiled kernels do not: $W/cache/cuda
# is the real cache's kernel folder, where scripts/check-cuda-kernels.sh's NVRTC check has put
# the sm_90 CUBINs the stand-in device loads (else the first run here compiles them, about 2
# minutes of a 2-core machine), and where the next run finds them.
kernels="${OATO_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/oato}" # src/cache.rs's root
mkdir -p "$kernels/cuda" "$W/cache"
ln -s "$(cd "$kernels/cuda" && pwd)" "$W/cache/cuda"
export OATO_CACHE_DIR="$W/cache"
start=$(date +%s)
step() { echo "fake-gpu: $* ($(($(date +%s) - start)) s)"; }
fake() { scripts/fake-gpu.sh "$@"; }
# Runs skip the untimed warm-up of the prompt (--no-warmup: on the emulator it costs as much as
# the prefill itself) unless WARMUP=1, as for the first all-GPU run and layer-split at 50%, so
# the warm-up and the reset after it stay covered on the GPU and under a hybrid placement.
warmup() { [ "${WARMUP:-0}" = 1 ] || echo --no-warmup; }
golden() {
    fake python3 experiments/golden_check.py --oato "$OATO" --prompts "$P" --max-tokens "$N" -- \
        $(warmup) "$@"
}

# CUDA graphs (src/runtime/cuda_graphs.rs): greedy ids with graphs on equal those with
# OATO_CUDA_GRAPHS=0, and with them on the stand-in driver really replays graphs (it logs each
# instantiation and launch): at least one graph built and more graph launches than builds.
graphs_check() {
    local what=$1 on off built launched
    shift
    local run=("$OATO" run models/SmolLM2-135M-Instruct.Q4_1.gguf -p "The capital of France is"
        -n "$NG" --temp 0 --ignore-eos --json -c 256 --no-warmup "$@")
    local ids='import json,sys; print(json.load(sys.stdin)["output_ids"])'
    off=$(OATO_CUDA_GRAPHS=0 fake "${run[@]}" | python3 -c "$ids")
    on=$(OATO_FAKE_CUDA_LOG=1 fake "${run[@]}" 2>"$W/graphs.log" | python3 -c "$ids")
    built=$(grep -c '^fake-cuda: cuGraphInstantiate' "$W/graphs.log" || true)
    launched=$(grep -c '^fake-cuda: cuGraphLaunch' "$W/graphs.log" || true)
    if [ "$on" != "$off" ] || [ "$built" -lt 1 ] || [ "$launched" -le "$built" ]; then
        echo "FAIL graphs $what: ids $on with graphs, $off without; $built built, $launched launched" >&2
        exit 1
    fi
    echo "OK   graphs $what: $on either way; $built graphs built, $launched graph launches"
}

cargo build --release --quiet
step "selftest --device gpu, with its --perf tables at small sizes"
# OATO_SELFTEST_PERF_SMALL=1: every --perf table a lease's perf stage prints, at sizes the
# emulator runs in seconds (its times mean nothing); the run must reach the last table.
OATO_SELFTEST_PERF_SMALL=1 fake "$OATO" selftest --device gpu --perf > "$W/perf.txt"
grep -m1 'cases passed' "$W/perf.txt"
if ! grep -q '^activation copy .* direct' "$W/perf.txt"; then
    echo "FAIL selftest --perf (small) stopped before its last table:" >&2
    tail -n 5 "$W/perf.txt" >&2
    exit 1
fi
echo "OK   selftest --perf (small): $(sed -n '/cases passed/,$p' "$W/perf.txt" | grep -c '[0-9]') lines of figures"
step "the whole model on the GPU (with the warm-up)"
WARMUP=1 golden --device gpu
step "the whole model on the GPU, direct matrix-vector kernels and split decode attention"
OATO_CUDA_MMVQ=direct OATO_CUDA_ATTN_SPLIT=1 golden --device gpu
step "the whole model on the GPU, pipelined matrix-vector kernels"
OATO_CUDA_MMVQ=pipe golden --device gpu
step "the whole model on the GPU, decode through the prefill GEMM (OATO_CUDA_MMVQ_MAX_TOKENS=0: the tensor-core int8 GEMM or dequantisation + cuBLAS, as timed)"
OATO_CUDA_MMVQ_MAX_TOKENS=0 golden --device gpu
step "the whole model on the GPU, weights in the split layout (OATO_CUDA_SPLIT=1: Q4_1 layers, Q8_0 embedding and head, rewritten 1 MiB at a time)"
OATO_CUDA_SPLIT=1 OATO_CUDA_SPLIT_STAGE=1048576 golden --device gpu
step "split layout: fused kernels (gate / up / SwiGLU: mmvq_split_glu; q / k / v / RoPE / KV store: mmvq_split_qkv_rope) or not (OATO_CUDA_GLU=0 OATO_CUDA_QKV_ROPE=0)"
# Graphs off, so every launch is logged: each fused kernel replaces one launch of the kernel it
# absorbs (swiglu_q8_1, rope_store_kv_f16), and the greedy ids are the same either way (the same
# bits).
fused_run() {
    local ids='import json,sys; print(json.load(sys.stdin)["output_ids"])'
    OATO_CUDA_SPLIT=1 OATO_CUDA_GRAPHS=0 OATO_CUDA_GLU="$1" OATO_CUDA_QKV_ROPE="$1" \
        OATO_FAKE_CUDA_LOG=1 fake "$OATO" run models/SmolLM2-135M-Instruct.Q4_1.gguf \
        -p "The capital of France is" -n 2 --temp 0 --ignore-eos --json -c 256 --device gpu --no-warmup \
        2>"$W/fused$1.log" | python3 -c "$ids"
}
fused=$(fused_run 1)
plain=$(fused_run 0)
count() { grep -c "launch $1" "$2" || true; }
n_glu=$(count "mmvq_split1\?_glu_" "$W/fused1.log")
n_qkv=$(count "mmvq_split1\?_qkv_rope_" "$W/fused1.log")
n_swiglu=$(count swiglu_q8_1 "$W/fused0.log")
n_rope=$(count rope_store_kv_f16 "$W/fused0.log")
left=$(($(count swiglu_q8_1 "$W/fused1.log") + $(count rope_store_kv_f16 "$W/fused1.log")))
if [ "$fused" != "$plain" ] || [ "$n_glu" -lt 1 ] || [ "$n_glu" != "$n_swiglu" ] \
    || [ "$n_qkv" -lt 1 ] || [ "$n_qkv" != "$n_rope" ] || [ "$left" != 0 ]; then
    echo "FAIL fused: ids $fused fused, $plain not; $n_glu glu for $n_swiglu swiglu_q8_1, $n_qkv qkv_rope for $n_rope rope_store_kv_f16, $left of those left" >&2
    exit 1
fi
echo "OK   fused: $fused either way; $n_glu mmvq_split_glu for $n_swiglu swiglu_q8_1, $n_qkv mmvq_split_qkv_rope for $n_rope rope_store_kv_f16"
step "prefill GEMMs by dequantisation + cuBLAS in pieces (OATO_CUDA_MMQ=0, OATO_CUDA_GEMM_SLICE=4096: weights cut along k, products summed, or in rows)"
# Every matmul case's weight exceeds the 4 KiB scratch, so each goes in pieces: slices of k
# summed into the output (a GEMM with beta 1) where a slice still holds a block of every row,
# else slices of rows; the file layout and the split one (dequant_split_*).
for split in 0 1; do
    OATO_CUDA_SPLIT=$split OATO_CUDA_MMQ=0 OATO_CUDA_GEMM_SLICE=4096 OATO_FAKE_CUDA_LOG=1 \
        fake "$OATO" selftest --device gpu 2>"$W/slices$split.log" | tail -1
    if ! grep -q "cublasGemmEx.* beta=1" "$W/slices$split.log"; then
        echo "FAIL GEMM slices (OATO_CUDA_SPLIT=$split): no GEMM summed into its output" >&2
        exit 1
    fi
done
echo "OK   GEMM slices: k slices summed, both layouts"
step "split layout: the GPU selftest with every split format's weights held split"
# Its matmul and embedding cases (Q4_0, IQ4_NL, Q8_0, Q6_K; decode and prefill) against the CPU,
# through split_blocks_*, mmvq_split* and dequant_split_*: each kernel must have run. The weights
# are rewritten 1000 bytes (at least a row) at a time, so in many slices.
OATO_CUDA_SPLIT=1 OATO_CUDA_SPLIT_STAGE=1000 OATO_FAKE_CUDA_LOG=1 fake "$OATO" selftest --device gpu \
    2>"$W/split-st.log" | tail -1
for k in split_blocks_16 split_blocks_32 split_blocks_208 mmvq_split_q4_0 mmvq_split1_q4_0 \
    mmvq_split_q6_K mmvq_split1_q6_K mmvq_split1_q8_0 mmvq_split1_q4_K mmvq_split1_q5_K \
    mmvq_split1_q4_1 \
    dequant_split_q4_0_f16 dequant_split_q6_K_f16; do
    if ! grep -q "$k" "$W/split-st.log"; then
        echo "FAIL split selftest: $k never launched" >&2
        exit 1
    fi
done
echo "OK   split selftest: every split kernel checked launched"
step "split layout: the Q4_0 and Q8_0 files all on the GPU give the CPU's greedy ids"
# No golden data for these files; the CPU engine is the reference (its Q4_0 and Q8_0 kernels sum
# each block exactly and scale it once, as mmvq_split_* do). The file layout's kernels sum in
# another order and on the Q4_0 file's "The capital of France is" take the near-tie the other
# way (" approximately" for " capital"), so they are not compared here. Only where the files were
# fetched (scripts/fetch-models.sh fetches the Q4_1 file alone; CI has only that).
split_ids() {
    local ids='import json,sys; print(json.load(sys.stdin)["output_ids"])'
    local file="models/SmolLM2-135M-Instruct.$1.gguf"
    if [ ! -f "$file" ]; then
        echo "skip split $1: $file not fetched"
        return
    fi
    local run=(run "$file" -p "$2" -n "$N" --temp 0 --ignore-eos --json -c 256 --no-warmup)
    local cpu gpu launched
    cpu=$("$OATO" "${run[@]}" | python3 -c "$ids")
    gpu=$(OATO_CUDA_SPLIT=1 OATO_FAKE_CUDA_LOG=1 fake "$OATO" "${run[@]}" --device gpu \
        2>"$W/split.log" | python3 -c "$ids")
    launched=$(grep -c "mmvq_split1\?_${1,,}" "$W/split.log" || true)
    if [ "$cpu" != "$gpu" ] || [ "$launched" -lt 1 ]; then
        echo "FAIL split $1 \"$2\": GPU $gpu, CPU $cpu; $launched split launches" >&2
        exit 1
    fi
    echo "OK   split $1 \"$2\": $gpu on both; $launched mmvq_split launches"
}
split_ids Q4_0 "The capital of France is"
split_ids Q8_0 "Once upon a time"
step "the third prompt on the GPU, 4 tokens (its 9 tokens take the tiled prefill attention)"
fake python3 experiments/golden_check.py --oato "$OATO" --prompts 3 --skip 2 --max-tokens 4 -- \
    --device gpu --no-warmup
step "CUDA graphs: the whole model on the GPU, split decode attention (its grid grows with the context)"
OATO_CUDA_ATTN_SPLIT=1 graphs_check "all on the GPU, split attention" --device gpu
step "profile"
# Prefill timed at 16 tokens, not the default 64 (a GEMM batch all the same; half the time here).
fake "$OATO" profile --reps 1 --batches 1,16 -o "$W/profile.json" | tail -3
for policy in layer-split flexgen oato; do
    step "$policy at 50%"
    fake "$OATO" plan --profile "$W/profile.json" --vram-budget 50% --policy "$policy" \
        -o "$W/$policy.json" | tail -2
    WARMUP=$([ "$policy" = layer-split ] && echo 1 || echo 0) golden --placement "$W/$policy.json"
done
step "layer-split at 50%, the GPU's weights in the split layout"
OATO_CUDA_SPLIT=1 golden --placement "$W/layer-split.json"
step "a mixed placement (every third target weight on the GPU)"
# Two hand-made placements from layer-split's: every third target weight on the GPU (mixed), and
# every third layer's weights (mixed-layers, for the CUDA-graph check below).
python3 - "$W/layer-split.json" "$W/mixed.json" "$W/mixed-layers.json" <<'PY'
import json, re, sys
def write(path, on_gpu):
    p = json.load(open(sys.argv[1]))
    targets = sorted(o["op"] + ".weight" for o in p["order"])
    targets = [t if t in p["tensors"] else "token_embd.weight" for t in targets]
    for i, t in enumerate(targets):
        p["tensors"][t] = "gpu" if on_gpu(i, t) and t != "token_embd.weight" else "cpu"
    for o in p["order"]:
        o["device"] = p["tensors"].get(o["op"] + ".weight", "cpu")
    p["policy"] = "oato"  # the schema knows no "hand-made"; the executor does not read it
    json.dump(p, open(path, "w"))
def layer(t):
    m = re.match(r"blk\.(\d+)\.", t)
    return int(m.group(1)) if m else None
write(sys.argv[2], lambda i, t: i % 3 == 0)
write(sys.argv[3], lambda i, t: layer(t) is not None and layer(t) % 3 == 0)
PY
golden --placement "$W/mixed.json"
step "the mixed placement, activations staged (OATO_CUDA_HOST_PINNED=0)"
OATO_CUDA_HOST_PINNED=0 golden --placement "$W/mixed.json"
step "the CPU's activation buffers in page-locked memory: more host allocations with them than without"
host_allocs() {
    env "$@" OATO_FAKE_CUDA_LOG=1 scripts/fake-gpu.sh "$OATO" run models/SmolLM2-135M-Instruct.Q4_1.gguf \
        -p "The capital of France is" -n 2 --temp 0 --ignore-eos -c 256 --placement "$W/mixed.json" --no-warmup \
        2>&1 >/dev/null | grep -c '^fake-cuda: cuMemHostAlloc' || true
}
direct=$(host_allocs) staged=$(host_allocs OATO_CUDA_HOST_PINNED=0)
if [ "$direct" -le "$staged" ]; then
    echo "FAIL page-locked activation buffers: $direct host allocations with them, $staged without" >&2
    exit 1
fi
echo "OK   page-locked activation buffers: $direct host allocations with them, $staged without"
step "CUDA graphs: a mixed placement of whole layers (several GPU segments per token)"
# Every third layer's weights on the GPU: a GPU segment per such layer, long enough for a graph
# (GRAPH_MIN_KERNELS). The every-third-weight placement above no longer has one: its GPU segments
# are a matmul or two, attention's RoPE+store and attention (which now writes the next matmul's
# Q8_1 blocks itself), fewer than four kernels each.
graphs_check "mixed placement of whole layers" --placement "$W/mixed-layers.json"
step "prefill streaming (layer-split's CPU weights copied to the GPU for the prompt batch)"
python3 - "$W/layer-split.json" "$W/stream.json" <<'PY'
import json, sys
p = json.load(open(sys.argv[1]))
p["prefill_stream"] = sorted(
    t for t, d in p["tensors"].items()
    if d == "cpu" and t != "token_embd.weight" and t.startswith("blk.")
    and any(t == o["op"] + ".weight" for o in p["order"]))
assert p["prefill_stream"], "layer-split left no CPU weight to stream"
p["stream_min_tokens"] = 2
json.dump(p, open(sys.argv[2], "w"))
PY
golden --placement "$W/stream.json"
step "llama.cpp's -ngl 20 (no profile or plan; the CPU's weights streamed for prompt batches from 2 tokens)"
golden -ngl 20 --stream-min-tokens 2

# MiniCPM3's multi-head latent attention (synthetic tiny-minicpm3, Q4_K_M: head size 96, values
# padded to it, the kernels of the key/value assembly): greedy ids on the stand-in GPU, whole and
# hybrid, equal the CPU's.
"$OATO" synth --shape tiny-minicpm3 --type Q4_K_M --layers 3 -o "$W/mc3.gguf" 2>/dev/null
mc3() {
    "$@" "$OATO" run "$W/mc3.gguf" -p "The capital of France is" -n "$N" --temp 0 --ignore-eos \
        --json -c 256 --no-warmup "${MC3_ARGS[@]}" | python3 -c 'import json,sys; print(json.load(sys.stdin)["output_ids"])'
}
MC3_ARGS=(--device cpu)
mc3_cpu=$(mc3 env)
mc3_check() {
    local what=$1
    shift
    MC3_ARGS=("$@")
    local got
    got=$(mc3 fake)
    if [ "$got" != "$mc3_cpu" ]; then
        echo "FAIL minicpm3 $what: $got, the CPU's $mc3_cpu" >&2
        exit 1
    fi
    echo "OK   minicpm3 $what: $got"
}
step "minicpm3: the whole model on the GPU"
mc3_check "all on the GPU" --device gpu
step "minicpm3: direct matrix-vector kernels and split decode attention"
OATO_CUDA_MMVQ=direct OATO_CUDA_ATTN_SPLIT=1 mc3_check "direct mmvq, split attention" --device gpu
for policy in layer-split flexgen; do
    step "minicpm3: $policy at 50%"
    mc3_check "$policy at 50%" --vram-budget 50% --policy "$policy"
done
step "done"

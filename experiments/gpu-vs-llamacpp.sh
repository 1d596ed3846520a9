#!/usr/bin/env bash
# Issue 12's all-GPU comparison on a borrowed GPU machine: llama-bench's pp64, pp512, tg32 and
# tg128 on one synth file (default: LLaMA3-8B shape, Q4_0), every layer on the GPU, for
# llama.cpp (CUDA build from experiments/build-llamacpp-cuda.sh, -ngl 99, its defaults: flash
# attention as llama-bench sets it, CUDA graphs on) and for oato eighteen ways: its default
# kernels, the weights it keeps in the split layout of split.cu with its matrix-vector kernels
# (OATO_CUDA_SPLIT=1; gate, up and SwiGLU one kernel, q, k, v, RoPE and the KV store one
# kernel), the same with those as the launches they replace (split-fused-off: OATO_CUDA_SPLIT=1
# OATO_CUDA_GLU=0 OATO_CUDA_QKV_ROPE=0), the direct matrix-vector kernels (OATO_CUDA_MMVQ=direct), the pipelined ones
# (OATO_CUDA_MMVQ=pipe), q/k/v and gate/up as a launch per
# weight rather than one (OATO_CUDA_MMVQ_MULTI=0), split-K decode attention forced off
# (OATO_CUDA_ATTN_SPLIT=0) or on below its 256 positions (attn-split-on: OATO_CUDA_ATTN_SPLIT=1;
# split-attn-split: that with the split layout), RMSNorm / SwiGLU without their fused Q8_1 quantisation and the
# residual add apart from the RMSNorm after it (OATO_CUDA_FUSE=0), decode without CUDA graphs
# (OATO_CUDA_GRAPHS=0: every kernel launched on its own), a decode step as one graph rather than
# one per 64 launches (OATO_CUDA_GRAPH_SPLIT=0), prefill attention by the old one-block-per-(head, token) kernel instead of the
# tiled one (OATO_CUDA_FLASH_PREFILL=0), and prefill GEMMs of quantised weights always by the int8
# kernels (OATO_CUDA_MMQ=1) or always by dequantisation + cuBLAS (OATO_CUDA_MMQ=0; the default
# times both per shape and keeps the faster), the int8 kernels on __dp4a rather than tensor
# cores (mma-off: OATO_CUDA_MMA=0), the tiled prefill attention on the f32 lanes rather than
# tensor cores (flash-mma-off: OATO_CUDA_FLASH_MMA=0), and decode's batches (its single token
# too) through the prefill GEMM rather than the matrix-vector kernels (gemm-decode:
# OATO_CUDA_MMVQ_MAX_TOKENS=0; tensor cores where the device has them, else as the GEMM's
# timing chooses). One run, one machine, one after the other.
#
# Writes $OUT.csv and $OUT.md (default results/gpu-vs-llamacpp) through bench_merge.py: one table
# per oato variant against the same llama.cpp figures, ratio = oato / llama.cpp; and, in RAW_DIR,
# each engine's JSON and variants.tsv (each variant's name, a tab, its settings), which
# experiments/pick_variant.py reads.
#
# Env: OATO_BIN (target/release/oato), MODEL (/tmp/m/llama3-8b-q4_0.gguf; made with `oato synth`
#      when missing), LLAMA_BIN (default: the build script's bin directory), REPS (3), THREADS
#      (nproc), OUT, RAW_DIR (default: a temporary folder), PROMPTS (64,512), GENS (32,128),
#      VARIANTS (the oato variants above to run, by name; default all eighteen).
set -euo pipefail
cd "$(dirname "$0")/.."
oato=${OATO_BIN:-target/release/oato}
model=${MODEL:-/tmp/m/llama3-8b-q4_0.gguf}
reps=${REPS:-3}
threads=${THREADS:-$(nproc)}
prompts=${PROMPTS:-64,512}
gens=${GENS:-32,128}
out=${OUT:-results/gpu-vs-llamacpp}
bin=${LLAMA_BIN:-$(experiments/build-llamacpp-cuda.sh | tail -n 1)}
[ -x "$bin/llama-bench" ] || { echo "error: $bin/llama-bench is missing (build it first)" >&2; exit 1; }
if [ ! -f "$model" ]; then
  mkdir -p "$(dirname "$model")"
  "$oato" synth --shape llama3-8b --type Q4_0 --seed 42 -o "$model.tmp" >&2 && mv "$model.tmp" "$model"
fi
raw=${RAW_DIR:-}
if [ -z "$raw" ]; then
  raw=$(mktemp -d)
  trap 'rm -rf "$raw"' EXIT
fi
mkdir -p "$raw" "$(dirname "$out")"
name=$(basename "$model" .gguf)

echo "== llama-bench -ngl 99" >&2
"$bin/llama-bench" -m "$model" -ngl 99 -t "$threads" -p "$prompts" -n "$gens" -r "$reps" -o json \
  >"$raw/llamacpp.json" 2>"$raw/llamacpp.log" || { cat "$raw/llamacpp.log" >&2; exit 1; }
runs=()
: >"$raw/variants.tsv"
for variant in ${VARIANTS:-default split split-attn-split attn-split-on mma-off flash-mma-off gemm-decode split-fused-off mmvq-direct mmvq-pipe multi-off attn-split-off fuse-off graphs-off graph-split-off flash-prefill-off mmq-on mmq-off}; do
  case $variant in
    default) env=() ;;
    split) env=(OATO_CUDA_SPLIT=1) ;;
    split-fused-off) env=(OATO_CUDA_SPLIT=1 OATO_CUDA_GLU=0 OATO_CUDA_QKV_ROPE=0) ;;
    mmvq-direct) env=(OATO_CUDA_MMVQ=direct) ;;
    mmvq-pipe) env=(OATO_CUDA_MMVQ=pipe) ;;
    multi-off) env=(OATO_CUDA_MMVQ_MULTI=0) ;;
    attn-split-off) env=(OATO_CUDA_ATTN_SPLIT=0) ;;
    attn-split-on) env=(OATO_CUDA_ATTN_SPLIT=1) ;;
    split-attn-split) env=(OATO_CUDA_SPLIT=1 OATO_CUDA_ATTN_SPLIT=1) ;;
    fuse-off) env=(OATO_CUDA_FUSE=0) ;;
    graphs-off) env=(OATO_CUDA_GRAPHS=0) ;;
    graph-split-off) env=(OATO_CUDA_GRAPH_SPLIT=0) ;;
    flash-prefill-off) env=(OATO_CUDA_FLASH_PREFILL=0) ;;
    mmq-on) env=(OATO_CUDA_MMQ=1) ;;
    mmq-off) env=(OATO_CUDA_MMQ=0) ;;
    mma-off) env=(OATO_CUDA_MMA=0) ;;
    flash-mma-off) env=(OATO_CUDA_FLASH_MMA=0) ;;
    gemm-decode) env=(OATO_CUDA_MMVQ_MAX_TOKENS=0) ;;
    *) echo "error: unknown variant $variant in VARIANTS" >&2; exit 2 ;;
  esac
  # The variants and their settings, for experiments/pick_variant.py (the lease's later stages).
  printf '%s\t%s\n' "$variant" "${env[*]+${env[*]}}" >>"$raw/variants.tsv"
  echo "== oato bench --device gpu ($variant)" >&2
  env "${env[@]}" "$oato" bench "$model" --device gpu -t "$threads" -p "$prompts" -n "$gens" -r "$reps" \
    --json >"$raw/oato-$variant.json" 2>"$raw/oato-$variant.log" \
    || { cat "$raw/oato-$variant.log" >&2; exit 1; }
  runs+=(--run "$name-oato-$variant" "$(basename "$model")" "$raw/llamacpp.json" "$raw/oato-$variant.json")
done
commit=$("$oato" --version | sed -n 's/.*commit \([^)]*\)).*/\1/p')
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || true)
gpu=${gpu:-no nvidia-smi}
python3 experiments/bench_merge.py --csv "$out.csv" --md "$out.md" \
  --title "oato vs llama.cpp all on the GPU (llama-bench's tests)" \
  --date "$(date -u +%Y-%m-%dT%H:%M:%SZ)" --commit "$commit" --threads "$threads" --reps "$reps" \
  --llamacpp "$(basename "$(dirname "$(dirname "$bin")")") (CUDA, $gpu)" \
  --note "all layers on the GPU ($gpu); variants run: ${VARIANTS:-all}; oato variants: default kernels, OATO_CUDA_MMVQ=direct, OATO_CUDA_MMVQ=pipe, OATO_CUDA_MMVQ_MULTI=0 (a matrix-vector launch per weight), OATO_CUDA_ATTN_SPLIT=0 / 1 (split decode attention never / always; split-attn-split: 1 with OATO_CUDA_SPLIT=1), OATO_CUDA_FUSE=0 (RMSNorm / SwiGLU / attention without their Q8_1 blocks, the residual add apart), OATO_CUDA_GRAPHS=0 (decode without CUDA graphs), OATO_CUDA_GRAPH_SPLIT=0 (a decode step one graph, not one per 64 launches), OATO_CUDA_FLASH_PREFILL=0 (per-token prefill attention), OATO_CUDA_MMQ=1 / 0 (prefill GEMMs by the int8 kernels / by dequantisation + cuBLAS; the default times both per shape), OATO_CUDA_MMA=0 (the int8 kernels on __dp4a, not tensor cores), OATO_CUDA_FLASH_MMA=0 (the tiled prefill attention on the f32 lanes, not tensor cores), OATO_CUDA_MMVQ_MAX_TOKENS=0 (decode through the prefill GEMM)" \
  "${runs[@]}"
echo "wrote $out.csv and $out.md" >&2
cat "$out.md"

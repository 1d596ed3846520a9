#!/usr/bin/env bash
# llama.cpp's own hybrid CPU+GPU speed, the peer of oato's placements: llama-bench with -ngl N at
# several shares of the layers on the GPU, each with op offload on (llama.cpp's default: prompt
# batches run on the GPU even for layers whose weights stay in host memory, copied over per batch)
# and, where this llama-bench has -nopo, off. Runs on the GPU machine after
# experiments/build-llamacpp-cuda.sh.
#
# Writes $RES/llamacpp-hybrid.csv, one row per share x op offload x test:
#   share, ngl, op_offload (1 = llama.cpp's default), test (pp: the P-token prompt in one batch; tg:
#   G tokens one at a time), tokens_per_s (llama-bench's avg_ts), ttft_ms (pp rows: P / pp t/s *
#   1000), tpot_ms (tg rows: 1000 / tg t/s), then stddev_ts, n_tokens, reps, threads,
#   gpu_repeating_layers, output_on_gpu, gpu_weight_share (the share of the file's weight bytes
#   that -ngl N puts on the GPU), flash_attn (auto/on/off), repack (CPU weights repacked), n_ubatch,
#   model, gpu_info, build_commit, date;
# the raw llama-bench JSON and logs in $RES/llamacpp-hybrid/; a markdown table on stdout. On the
# device machine ($OUT set) all of it also comes back as $OUT/llamacpp-hybrid.tgz.
#
# How llama.cpp counts -ngl (src/llama-model.cpp, load_tensors): N counts the output layer (output
# norm and lm_head) first, then repeating layers from the last one down: 1 <= N <= n_layer puts the
# output layer and blocks n_layer-N+1 .. n_layer-1 on the GPU; N = n_layer+1 is all of them; the
# token embeddings always stay on the CPU. So SHARES=100 is not all-GPU (NGL_EXTRA="99" is), and
# the share of weight bytes differs from the share of layers: see gpu_weight_share.
#
# Usage: MODEL=x.gguf experiments/hybrid-vs-llamacpp.sh
# Env:   MODEL (required), LLAMA_BIN (default /tmp/llamacpp-cuda/llama.cpp/build/bin, where
#        build-llamacpp-cuda.sh builds), SHARES (percent of n_layer, default "25 50 75"),
#        NGL_EXTRA (extra -ngl values run as they are, share column empty; e.g. "0 99"),
#        P (prompt tokens, 64), G (generated tokens, 32), REPS (3), THREADS (default nproc),
#        N_LAYER (default: {arch}.block_count from the GGUF header), NOPO (default "0 1" where
#        llama-bench has -nopo, else "0"), LLAMA_BENCH_ARGS (added to every run, e.g. "-fa 1"),
#        RES (default results/gpu-<date>).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:?set MODEL to a GGUF file}
LLAMA_BIN=${LLAMA_BIN:-/tmp/llamacpp-cuda/llama.cpp/build/bin}
SHARES=${SHARES:-"25 50 75"}
NGL_EXTRA=${NGL_EXTRA:-}
P=${P:-64}
G=${G:-32}
REPS=${REPS:-3}
THREADS=${THREADS:-$(nproc)}
RES=${RES:-results/gpu-$(date -u +%F)}
bench=$LLAMA_BIN/llama-bench
[ -f "$MODEL" ] || { echo "error: MODEL $MODEL not found" >&2; exit 1; }
[ -x "$bench" ] || { echo "error: $bench missing (run experiments/build-llamacpp-cuda.sh, or set LLAMA_BIN)" >&2; exit 1; }
for v in "$P" "$G" "$REPS" "$THREADS" $SHARES $NGL_EXTRA ${N_LAYER:-}; do
  [[ $v =~ ^[0-9]+$ ]] || { echo "error: P, G, REPS, THREADS, SHARES, NGL_EXTRA, N_LAYER take whole numbers (got $v)" >&2; exit 1; }
done
raw=$RES/llamacpp-hybrid
mkdir -p "$raw"

# The GGUF header: n_layer, and the bytes of each block, of the output layer and of the rest (the
# tensors' sizes are the gaps between their data offsets, so every weight type is covered).
python3 - "$MODEL" > "$raw/layers.json" <<'PY'
import json, os, re, struct, sys
path = sys.argv[1]
f = open(path, "rb")
def fail(msg):
    sys.exit(f"error: {path}: {msg}")
def rd(fmt):
    n = struct.calcsize("<" + fmt)
    b = f.read(n)
    if len(b) != n:
        fail("truncated GGUF header")
    return struct.unpack("<" + fmt, b)[0]
def rstr():
    return f.read(rd("Q")).decode("utf-8", "replace")
SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
def rval(t):
    if t in SCALAR:
        return rd(SCALAR[t])
    if t == 8:
        return rstr()
    if t == 9:  # array: element type, count, elements (skipped)
        et, n = rd("I"), rd("Q")
        if et in SCALAR:
            f.seek(n * struct.calcsize("<" + SCALAR[et]), 1)
        else:
            for _ in range(n):
                rval(et)
        return None
    fail(f"unknown GGUF value type {t}")
if f.read(4) != b"GGUF":
    fail("not a GGUF file")
if rd("I") < 2:
    fail("GGUF version 1 is not supported")
n_tensors, n_kv = rd("Q"), rd("Q")
kv = {}
for _ in range(n_kv):
    key = rstr()
    kv[key] = rval(rd("I"))
arch = kv.get("general.architecture")
n_layer = kv.get(f"{arch}.block_count")
if not isinstance(n_layer, int) or n_layer <= 0:
    fail(f"no {arch}.block_count")
align = kv.get("general.alignment", 32)
offsets = []
for _ in range(n_tensors):
    name = rstr()
    f.seek(8 * rd("I"), 1)  # dims
    rd("I")                 # type
    offsets.append((rd("Q"), name))
data_start = -(-f.tell() // align) * align
data_len = os.path.getsize(path) - data_start
offsets.sort()
size = {name: (offsets[i + 1][0] if i + 1 < len(offsets) else data_len) - off
        for i, (off, name) in enumerate(offsets)}
layer, output, other = [0] * n_layer, 0, 0
for name, sz in size.items():
    m = re.match(r"blk\.(\d+)\.", name)
    if m and int(m.group(1)) < n_layer:
        layer[int(m.group(1))] += sz
    elif name.startswith("output"):  # output.weight, output_norm.weight
        output += sz
    else:                             # token_embd.weight and the like: always on the CPU
        other += sz
if "output.weight" not in size:       # tied embeddings: the output layer holds a copy of them
    output += size.get("token_embd.weight", 0)
json.dump({"arch": arch, "n_layer": n_layer, "layer_bytes": layer, "output_bytes": output,
           "other_bytes": other, "weight_bytes": data_len}, sys.stdout)
PY
n_layer=${N_LAYER:-$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["n_layer"])' "$raw/layers.json")}

help=$("$bench" --help 2>&1 || true)
if grep -q -- '--no-op-offload' <<<"$help"; then NOPO=${NOPO:-"0 1"}; else NOPO=0; fi
gpu=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -n 1 || true)
echo "== $MODEL: $n_layer layers; $gpu; llama-bench $("$bench" --version 2>&1 | grep -m 1 '^version:' || true)" >&2
# On the device machine only what lies under $OUT comes back: pack the results however this ends.
pack() {
  local files=("$raw")
  if [ -f "$RES/llamacpp-hybrid.csv" ]; then files+=("$RES/llamacpp-hybrid.csv"); fi
  if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then tar czf "$OUT/llamacpp-hybrid.tgz" "${files[@]}"; fi
}
trap pack EXIT

runs=()
status=0
one() { # share ngl nopo
  local share=$1 ngl=$2 nopo=$3 name="ngl$2-nopo$3" nopo_flag=()
  [ "$NOPO" = 0 ] || nopo_flag=(-nopo "$nopo")
  echo "== share ${share:-none}: -ngl $ngl, op offload $((1 - nopo))" >&2
  # shellcheck disable=SC2086  # LLAMA_BENCH_ARGS is a list of words
  if "$bench" -m "$MODEL" -ngl "$ngl" "${nopo_flag[@]}" -p "$P" -n "$G" -r "$REPS" -t "$THREADS" \
      -o json ${LLAMA_BENCH_ARGS:-} > "$raw/$name.json" 2> "$raw/$name.log"; then
    runs+=("${share:--}" "$ngl" "$nopo" "$raw/$name.json")
  else
    echo "error: llama-bench failed at -ngl $ngl (nopo $nopo); last lines of $raw/$name.log" \
      "(LLAMA_BENCH_ARGS=-v says more):" >&2
    tail -n 15 "$raw/$name.log" >&2
    status=1
  fi
}
for share in $SHARES; do
  ngl=$(( (share * n_layer + 50) / 100 ))  # round(share/100 * n_layer), halves up
  for nopo in $NOPO; do one "$share" "$ngl" "$nopo"; done
done
for ngl in $NGL_EXTRA; do
  for nopo in $NOPO; do one "" "$ngl" "$nopo"; done
done
[ ${#runs[@]} -gt 0 ] || { echo "error: no llama-bench run succeeded" >&2; exit 1; }

python3 - "$RES/llamacpp-hybrid.csv" "$raw/layers.json" "$n_layer" "$P" "$G" "$REPS" "$THREADS" \
    "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "${runs[@]}" <<'PY'
import csv, json, sys
out, layers_path, n_layer, P, G, reps, threads, date = sys.argv[1:9]
n_layer, P, G = int(n_layer), int(P), int(G)
lay = json.load(open(layers_path))
total = lay["weight_bytes"] or 1
def placement(ngl):
    """llama.cpp's rule: ngl counts the output layer, then blocks from the last one down."""
    act = min(ngl, n_layer + 1)
    start = max(n_layer + 1 - ngl, 0)
    blocks = [il for il in range(start, n_layer) if il - start < act]
    out_gpu = ngl >= 1
    gpu = sum(lay["layer_bytes"][il] for il in blocks if il < len(lay["layer_bytes"]))
    gpu += lay["output_bytes"] if out_gpu else 0
    return len(blocks), int(out_gpu), gpu / total
cols = ["share", "ngl", "op_offload", "test", "tokens_per_s", "ttft_ms", "tpot_ms", "stddev_ts",
        "n_tokens", "reps", "threads", "gpu_repeating_layers", "output_on_gpu", "gpu_weight_share",
        "flash_attn", "repack", "n_ubatch", "model", "gpu_info", "build_commit", "date"]
FA = {-1: "auto", 0: "off", 1: "on"}  # llama_flash_attn_type, as llama-bench's JSON writes it
rows = []
args = sys.argv[9:]
for i in range(0, len(args), 4):
    share, ngl, nopo, path = args[i:i + 4]
    ngl = int(ngl)
    blocks, out_gpu, wshare = placement(ngl)
    for t in json.load(open(path)):
        pp = t["n_gen"] == 0
        tps = float(t["avg_ts"])
        rows.append({
            "share": "" if share == "-" else share, "ngl": ngl,
            "op_offload": 0 if t.get("no_op_offload", int(nopo)) in (True, 1, "1", "true") else 1,
            "test": "pp" if pp else "tg", "tokens_per_s": f"{tps:.3f}",
            "ttft_ms": f"{t['n_prompt'] / tps * 1000:.3f}" if pp and tps > 0 else "",
            "tpot_ms": f"{1000 / tps:.4f}" if not pp and tps > 0 else "",
            "stddev_ts": f"{float(t['stddev_ts']):.3f}",
            "n_tokens": t["n_prompt"] if pp else t["n_gen"], "reps": reps, "threads": t.get("n_threads", threads),
            "gpu_repeating_layers": blocks, "output_on_gpu": out_gpu, "gpu_weight_share": f"{wshare:.4f}",
            "flash_attn": FA.get(t.get("flash_attn"), t.get("flash_attn", "")),
            "repack": int(t["repack"] in (True, 1)) if "repack" in t else "", "n_ubatch": t.get("n_ubatch", ""),
            "model": t.get("model_filename", ""), "gpu_info": t.get("gpu_info", ""),
            "build_commit": t.get("build_commit", ""), "date": date,
        })
with open(out, "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=cols)
    w.writeheader()
    w.writerows(rows)
# Markdown: one line per share x op offload, pp and tg side by side.
print(f"| share | -ngl | GPU blocks + output | GPU weight share | op offload | pp{P} t/s | TTFT ms | tg{G} t/s | TPOT ms |")
print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
seen = {}
for r in rows:
    seen.setdefault((r["share"], r["ngl"], r["op_offload"]), {})[r["test"]] = r
for (share, ngl, oo), d in seen.items():
    pp, tg = d.get("pp", {}), d.get("tg", {})
    any_r = pp or tg
    print(f"| {share or '-'} | {ngl} | {any_r['gpu_repeating_layers']} + {any_r['output_on_gpu']} | "
          f"{float(any_r['gpu_weight_share']):.1%} | {oo} | {pp.get('tokens_per_s', '')} | "
          f"{pp.get('ttft_ms', '')} | {tg.get('tokens_per_s', '')} | {tg.get('tpot_ms', '')} |")
PY
echo "wrote $RES/llamacpp-hybrid.csv (raw runs in $raw)" >&2
exit $status

#!/usr/bin/env bash
# Reads the machine code (SASS) the GPU would run, without a GPU: compiles kernel sources through
# the engine's own NVRTC path (`oato selftest --compile-only --cubin-dir`), then for each kernel
# whose name matches prints its registers, spills and shared memory (cuobjdump -res-usage) and a
# summary of its instruction stream: runs of global loads (LDG), shared loads / stores (LDS,
# STS), shuffles (SHFL), barriers (BAR), branches (BRA), calls (CALL), integer dot products
# (IDP), tensor-core ops (HMMA, IMMA), ... in program order, so "LDG:16 HADD2:1 FFMA:1 BRA:1
# LDG:16 ..." shows loads that wait for their use before the next ones go out, and
# "LDG:128 HADD2 ..." loads issued together. PTX is not enough for this: ptxas reorders (the
# staged mmvq_q4_0's PTX holds a chunk's three 16-byte weight loads before its stores; its SASS
# stores the first before the others go out).
#
# Usage:  scripts/cuda-sass.sh [-a ARCH] [-s] SOURCE.cu KERNEL_REGEX
#   e.g.  scripts/cuda-sass.sh ops.cu '^attention_f16kv$'
#         scripts/cuda-sass.sh -a 120 mmvq.cu '^mmvq_q4_0$'
#   -a ARCH  compute capability (default 90)
#   -s       also print each matching kernel's whole SASS
# Tools: NVRTC from scripts/nvrtc-env.sh's venv; cuobjdump and nvdisasm (CUDA 13.2 from
# PyPI: 13.0's are not published there; they read NVRTC 13.0's CUBINs) into
# ~/.cache/oato/cuda-sass-venv on first use.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
ARCH=90
FULL=0
while getopts "a:s" o; do
    case $o in
    a) ARCH=$OPTARG ;;
    s) FULL=1 ;;
    *) exit 2 ;;
    esac
done
shift $((OPTIND - 1))
if [ $# -ne 2 ]; then
    echo "usage: scripts/cuda-sass.sh [-a ARCH] [-s] SOURCE.cu KERNEL_REGEX" >&2
    exit 2
fi
SRC=$1
PAT=$2
. "$ROOT/scripts/nvrtc-env.sh"
nvrtc_env cuda-sass
TOOLS="${OATO_CUDA_SASS_VENV:-$HOME/.cache/oato/cuda-sass-venv}"
if [ ! -x "$TOOLS/bin/python" ]; then
    python3 -m venv "$TOOLS"
    "$TOOLS/bin/pip" install --quiet --disable-pip-version-check \
        'nvidia-cuda-cuobjdump==13.2.*' 'nvidia-cuda-nvdisasm==13.2.*'
fi
BIN=$(dirname "$(find "$TOOLS" -name cuobjdump -type f | head -1)")
if [ ! -x "$BIN/cuobjdump" ] || [ ! -x "$BIN/nvdisasm" ]; then
    echo "cuda-sass: cuobjdump or nvdisasm missing from $TOOLS" >&2
    exit 1
fi
(cd "$ROOT" && cargo build --release --quiet)
OUT="$ROOT/target/cuda-sass"
rm -rf "$OUT"
LD_LIBRARY_PATH="$NVRTC_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
OATO_CUDA_INCLUDE="$CUDA_FP16_DIR" \
    "$ROOT/target/release/oato" selftest --compile-only --arch "$ARCH" --source "$SRC" \
    --cubin-dir "$OUT" >&2
CUBIN="$OUT/${SRC%.cu}-sm$ARCH.cubin"
export PATH="$BIN:$PATH"
cuobjdump -res-usage "$CUBIN" >"$OUT/res.txt"
cuobjdump -sass "$CUBIN" >"$OUT/sass.txt"
python3 - "$OUT/res.txt" "$OUT/sass.txt" "$PAT" "$FULL" <<'EOF'
import re, sys
res_file, sass_file, pat, full = sys.argv[1], sys.argv[2], re.compile(sys.argv[3]), sys.argv[4] == "1"
usage, fn = {}, None
for line in open(res_file):
    m = re.search(r"Function (\w+):", line)
    if m:
        fn = m.group(1)
    elif fn and "REG:" in line:
        usage[fn] = line.strip()
# Instruction classes worth seeing in order; the rest is summed as "other" within a run.
CLASSES = ("LDG", "LDS", "LDSM", "LDL", "STG", "STS", "STL", "SHFL", "BAR", "MUFU", "BRA",
           "CALL", "IDP", "HMMA", "IMMA", "FFMA", "HADD2", "HFMA2", "ATOM", "RED")
code, fn = {}, None
for line in open(sass_file):
    m = re.match(r"\s*Function : (\w+)", line)
    if m:
        fn = m.group(1)
        code[fn] = []
        continue
    m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(@!?U?P[0-9T]+\s+)?([A-Z0-9_.]+)([^;]*);", line)
    if m and fn:
        code[fn].append((m.group(2), line.split(";")[0].strip()))
found = 0
for fn in sorted(code):
    if not pat.search(fn):
        continue
    found += 1
    runs = []
    for op, _ in code[fn]:
        c = op.split(".")[0]
        if c not in CLASSES:
            continue
        if runs and runs[-1][0] == c:
            runs[-1][1] += 1
        else:
            runs.append([c, 1])
    print(f"{fn}: {usage.get(fn, 'no resource line')}")
    print(f"  {len(code[fn])} instructions; in order: " + " ".join(f"{c}:{n}" for c, n in runs))
    if full:
        for _, text in code[fn]:
            print("    " + text)
if not found:
    print(f"cuda-sass: no kernel in the CUBIN matches {pat.pattern!r}", file=sys.stderr)
    sys.exit(1)
EOF

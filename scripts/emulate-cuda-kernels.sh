#!/usr/bin/env bash
# Tests every CUDA kernel's results without a GPU: the unchanged src/kernels/cuda/*.cu compile as
# host C++ against a small CUDA emulator (tests/cuda_emu/emu.h: one fiber per CUDA thread, real
# barriers and warp shuffles), and tests/cuda_emu/test_kernels.py launches each kernel and
# compares it with references that share no code with it (gguf-py's dequantisation, numpy).
# One line per check group, then "cuda-emu: N passed, N failed"; exits non-zero on a failure.
#
# Usage:  scripts/emulate-cuda-kernels.sh [-v] [--only REGEX]   (-v: one line per check;
#             --only: the check groups whose names match, e.g. --only 'qkv_rope|^rope')
#         scripts/emulate-cuda-kernels.sh --build-only  (just the libraries, for scripts/fake-gpu.sh)
# Env:    OATO_CUDA_EMU_VENV   Python venv (default ~/.cache/oato/cuda-emu-venv), made on demand
#         OATO_CUDA_EMU_SAN=1  build with AddressSanitizer + UBSan and exact-size buffers (slower)
#         OATO_CUDA_EMU_ORDER  thread order in a block: alternate (default), forward, reverse
#         OATO_CUDA_EMU_THREADS  OS threads a launch's blocks run on (default one per core, up to 8)
#         OATO_CUDA_EMU_TLS    initial-exec (default; general-dynamic where glibc cannot load it)
#                              or global-dynamic: the thread-local model (see emu.h)
#         CXX                  the C++ compiler (default g++; needs C++20)
# Builds into target/cuda-emu/ and rebuilds only when a source, the emulator or the flags change:
# libcudaemu.so (the kernels, for the checks) and fake/libcuda.so (the same kernels behind a
# stand-in CUDA driver and cuBLAS, tests/cuda_emu/fake_cuda.cpp, for scripts/fake-gpu.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s.%N)
EMU=tests/cuda_emu
SRC=src/kernels/cuda
VENV="${OATO_CUDA_EMU_VENV:-$HOME/.cache/oato/cuda-emu-venv}"
SAN="${OATO_CUDA_EMU_SAN:-0}"
TLS="${OATO_CUDA_EMU_TLS:-initial-exec}"
CXX="${CXX:-g++}"
elapsed() { echo "$(date +%s.%N) $start" | awk '{printf "%.1f s", $1 - $2}'; }

# 1. The venv, with exactly tests/cuda_emu/requirements.txt (re-installed when that changes).
mkdir -p "$(dirname "$VENV")"
(
    flock 9
    if [ ! -x "$VENV/bin/python" ]; then
        python3 -m venv "$VENV"
    fi
    want=$(sha256sum "$EMU/requirements.txt" | cut -c1-16)
    if [ "$(cat "$VENV/.oato-cuda-emu-requirements" 2>/dev/null || true)" != "$want" ]; then
        "$VENV/bin/pip" install --quiet --disable-pip-version-check -r "$EMU/requirements.txt"
        echo "$want" >"$VENV/.oato-cuda-emu-requirements"
    fi
) 9>"$VENV.lock"
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
CUDA_INC="$SITE/nvidia/cu13/include"
for h in cuda_fp16.h cuda_bf16.h crt/host_defines.h nv/target; do
    if [ ! -e "$CUDA_INC/$h" ]; then
        echo "emulate-cuda-kernels: $h missing from $CUDA_INC (see $EMU/requirements.txt)" >&2
        exit 1
    fi
done
echo "cuda-emu: venv ready ($(elapsed))"

# 2. Build target/cuda-emu/<mode>/libcudaemu.so from each kernel source + the emulator.
# Each build adds -ftls-model=initial-exec (see emu.h: thread-local state); the loaders raise
# glibc's static TLS room to the size recorded in $BUILD/static-tls (tunables, below and in
# fake-gpu.sh), and where that fails to load, general-dynamic.
# -fvisibility=hidden: the libraries export only their C ABI (runtime.cpp and fake_cuda.cpp mark
# it), so the kernels' calls into the scheduler are direct calls.
FLAGS=(-std=c++20 -fPIC -pthread -fvisibility=hidden -ffp-contract=fast -Wall -Wextra
    -Wno-unused-parameter -Wno-unknown-pragmas -isystem "$CUDA_INC" -iquote . -include "$EMU/emu.h")
if grep -qw fma /proc/cpuinfo 2>/dev/null; then
    FLAGS+=(-mfma) # so that a * b + c may fuse, as nvcc's default --fmad=true does
fi
if [ "$SAN" = 1 ]; then
    MODE=san
    FLAGS+=(-O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=all)
    LINK=(-fsanitize=address,undefined)
else
    MODE=release
    FLAGS+=(-O2 -fsanitize=alignment -fno-sanitize-recover=alignment)
    LINK=(-fsanitize=alignment)
fi
# runtime.cpp's extra flags: the scheduler's own accesses are host code, and the GPU's alignment
# rule is for the kernels (the check would sit on every load and store of the fiber switches,
# the hottest code of a stand-in run).
RT_FLAGS=()
[ "$SAN" = 1 ] || RT_FLAGS+=(-fno-sanitize=alignment)
BUILD="target/cuda-emu/$MODE"
LIB="$BUILD/libcudaemu.so"
FAKE="$BUILD/fake"
SOURCES=("$SRC"/*.cu "$EMU/selftest.cu")
mkdir -p "$BUILD"
key=$({
    "$CXX" --version
    echo "${FLAGS[@]} ${LINK[@]} -ftls-model=$TLS, else global-dynamic; runtime ${RT_FLAGS[*]}"
    cat "$SRC"/*.cu "$SRC"/*.cuh "$EMU"/emu.h "$EMU"/runtime.cpp "$EMU"/kernel_tu.cpp \
        "$EMU"/selftest.cu "$EMU"/fake_cuda.cpp "$EMU"/requirements.txt
    printf '%s\n' "${SOURCES[@]}"
} | sha256sum | cut -c1-32)
(
    flock 9
    if [ -f "$LIB" ] && [ -f "$BUILD/static-tls" ] &&
        [ "$(cat "$BUILD/stamp" 2>/dev/null || true)" = "$key" ]; then
        echo "cuda-emu: $LIB is up to date"
        exit 0
    fi
    rm -rf "$BUILD"/*.o "$BUILD"/*.exports "$BUILD/stamp" "$LIB" "$FAKE"
    # compile_and_link TLS_MODEL: both libraries, every file with -ftls-model=TLS_MODEL.
    compile_and_link() {
        local pids=() objs=() cu name p status=0
        local FLAGS=("${FLAGS[@]}" "-ftls-model=$1")
        for cu in "${SOURCES[@]}"; do
            name=$(basename "$cu" .cu)
            # Kernel names, found by the preprocessor (emu.h marks __global__ in this mode).
            "$CXX" "${FLAGS[@]}" -DEMU_LIST_KERNELS -E -P -x c++ "$cu" | tr '\n' ' ' |
                grep -oP 'EMU_KERNEL_MARK\s+void\s+\K\w+' | sed 's/.*/EMU_EXPORT(&)/' \
                >"$BUILD/$name.exports" || true
            if [ ! -s "$BUILD/$name.exports" ]; then
                echo "emulate-cuda-kernels: no __global__ kernel found in $cu" >&2
                exit 1
            fi
            "$CXX" "${FLAGS[@]}" -DEMU_SOURCE_FILE="\"$cu\"" -DEMU_SOURCE_NAME="\"$name.cu\"" \
                -DEMU_EXPORTS_FILE="\"$BUILD/$name.exports\"" \
                -c "$EMU/kernel_tu.cpp" -o "$BUILD/$name.o" &
            pids+=($!)
            objs+=("$BUILD/$name.o")
        done
        "$CXX" "${FLAGS[@]}" "${RT_FLAGS[@]}" -c "$EMU/runtime.cpp" -o "$BUILD/runtime.o" &
        pids+=($!)
        objs+=("$BUILD/runtime.o")
        # The stand-in driver is plain C++ (no emu.h).
        FAKE_FLAGS=()
        for f in "${FLAGS[@]}"; do
            case "$f" in "-include" | "$EMU/emu.h") ;; *) FAKE_FLAGS+=("$f") ;; esac
        done
        "$CXX" "${FAKE_FLAGS[@]}" -c "$EMU/fake_cuda.cpp" -o "$BUILD/fake_cuda.o" &
        pids+=($!)
        for p in "${pids[@]}"; do wait "$p" || status=1; done
        if [ "$status" != 0 ]; then
            echo "emulate-cuda-kernels: compiling the kernels as host C++ failed (above)" >&2
            exit 1
        fi
        "$CXX" -shared -pthread -o "$LIB" "${objs[@]}" "${LINK[@]}"
        # One file for both libraries cudarc opens (glibc gives the second name the same handle).
        mkdir -p "$FAKE"
        "$CXX" -shared -pthread -o "$FAKE/libcuda.so.1" "${objs[@]}" "$BUILD/fake_cuda.o" "${LINK[@]}"
        for n in libcuda.so libcublas.so libcublas.so.13; do ln -sf libcuda.so.1 "$FAKE/$n"; done
    }
    compile_and_link "$TLS"
    # 512: glibc's own default room for the initial-exec variables of libraries loaded later.
    echo 512 >"$BUILD/static-tls"
    if [ "$TLS" = initial-exec ]; then
        # The room a process loading either library needs: the larger thread-local block
        # (PT_TLS memory size) plus 64 KiB for other libraries' initial-exec variables.
        tls=0
        for so in "$LIB" "$FAKE/libcuda.so.1"; do
            t=$(readelf -lW "$so" | awk '$1 == "TLS" {print $6}') # hexadecimal, 0x...
            [ $((${t:-0})) -gt "$tls" ] && tls=$((t))
        done
        echo $((tls + 65536)) >"$BUILD/static-tls"
        # A glibc that does not take that room from GLIBC_TUNABLES cannot load an initial-exec
        # library this large: then the slower general-dynamic model, which needs no room.
        probe=(env GLIBC_TUNABLES="glibc.rtld.optional_static_tls=$(cat "$BUILD/static-tls")")
        if [ "$SAN" = 1 ]; then
            probe+=(LD_PRELOAD="$("$CXX" -print-file-name=libasan.so)" ASAN_OPTIONS=detect_leaks=0)
        fi
        if ! "${probe[@]}" "$VENV/bin/python" -c 'import ctypes, sys; ctypes.CDLL(sys.argv[1])' \
            "$LIB" 2>/dev/null; then
            echo "cuda-emu: this glibc cannot load the initial-exec build: general-dynamic (slower)" >&2
            rm -f "$BUILD"/*.o "$LIB" "$FAKE/libcuda.so.1"
            compile_and_link global-dynamic
            echo 512 >"$BUILD/static-tls"
        fi
    fi
    echo "$key" >"$BUILD/stamp"
    echo "cuda-emu: built $LIB ($(elapsed))"
) 9>"target/cuda-emu/$MODE.lock"

if [ "${1:-}" = --build-only ]; then
    exit 0
fi

# 3. The checks.
# A sanitizer report aborts, so that Python's faulthandler names the check that was running.
RUN=(env PYTHONDONTWRITEBYTECODE=1 UBSAN_OPTIONS=abort_on_error=1:print_stacktrace=1
    GLIBC_TUNABLES="${GLIBC_TUNABLES:+$GLIBC_TUNABLES:}glibc.rtld.optional_static_tls=$(cat "$BUILD/static-tls")")
if [ "$SAN" = 1 ]; then
    RUN+=(LD_PRELOAD="$("$CXX" -print-file-name=libasan.so)"
        ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 OATO_CUDA_EMU_SAN=1)
fi
status=0
"${RUN[@]}" "$VENV/bin/python" -X faulthandler "$EMU/test_kernels.py" --lib "$LIB" \
    --src "$SRC" --data tests/data/quant "$@" || status=$?
echo "cuda-emu: done in $(elapsed)"
exit "$status"

#!/usr/bin/env bash
# Runs a command with a stand-in CUDA driver and cuBLAS on the CPU (tests/cuda_emu/fake_cuda.cpp:
# the CUDA emulator's kernels behind the driver calls cudarc makes), so the engine's whole GPU
# backend (probe, NVRTC compile, uploads, launches, streams and events, cuBLAS, the hybrid
# executor) runs on a machine without a GPU. Slow, and its timings mean nothing; it checks the
# host code, not the hardware. NVRTC is the real one from PyPI (scripts/check-cuda-kernels.sh's
# venv). The device is called "oato fake CUDA device (CPU emulator, not a GPU)".
#
# Usage:  scripts/fake-gpu.sh COMMAND [ARGS...]
#   e.g.  scripts/fake-gpu.sh target/release/oato selftest --device gpu
# Env:    OATO_FAKE_CUDA_MEM    device memory in bytes (default 4 GiB)
#         OATO_FAKE_CUDA_LOG=1  one stderr line per driver call
#         OATO_CUDA_EMU_THREADS threads a launch's blocks run on (default one per core, up to 8)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${OATO_CUDA_VENV:-$HOME/.cache/oato/cuda-venv}"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check \
        'nvidia-cuda-nvrtc==13.0.*' 'nvidia-cuda-runtime==13.0.*'
fi
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
NVRTC=$(find "$SITE/nvidia" -name 'libnvrtc.so*' | sort | head -1)
FP16=$(find "$SITE/nvidia" -name 'cuda_fp16.h' | sort | head -1)
if [ -z "$NVRTC" ] || [ -z "$FP16" ]; then
    echo "fake-gpu: libnvrtc or cuda_fp16.h missing from $SITE/nvidia" >&2
    exit 1
fi
"$ROOT/scripts/emulate-cuda-kernels.sh" --build-only >&2
FAKE="$ROOT/target/cuda-emu/release/fake"
export LD_LIBRARY_PATH="$FAKE:$(dirname "$NVRTC")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export OATO_CUDA_INCLUDE="$(dirname "$FP16")"
# Room in the static TLS for the library's thread-local state (tests/cuda_emu/emu.h).
export GLIBC_TUNABLES="${GLIBC_TUNABLES:+$GLIBC_TUNABLES:}glibc.rtld.optional_static_tls=$(cat "$ROOT/target/cuda-emu/release/static-tls")"
# The emulator's kernels run with alignment checks (UBSan); a report should stop the run.
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-abort_on_error=1:print_stacktrace=1}"
exec "$@"

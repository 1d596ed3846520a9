#!/usr/bin/env bash
# Runs a command with a stand-in CUDA driver and cuBLAS on the CPU (tests/cuda_emu/fake_cuda.cpp:
# the CUDA emulator's kernels behind the driver calls cudarc makes), so the engine's whole GPU
# backend (probe, NVRTC compile, uploads, launches, streams and events, cuBLAS, the hybrid
# executor) runs on a machine without a GPU. Slow, and its timings mean nothing; it checks the
# host code, not the hardware. NVRTC is the real one from PyPI (scripts/nvrtc-env.sh's
# venv). The device is called "oato fake CUDA device (CPU emulator, not a GPU)".
#
# Usage:  scripts/fake-gpu.sh COMMAND [ARGS...]
#   e.g.  scripts/fake-gpu.sh target/release/oato selftest --device gpu
# Env:    OATO_FAKE_CUDA_MEM    device memory in bytes (default 4 GiB)
#         OATO_FAKE_CUDA_LOG=1  one stderr line per driver call
#         OATO_CUDA_EMU_THREADS threads a launch's blocks run on (default one per core, up to 8)
#         OATO_CPU_AWAKE        0 unless set: the CPU pool parks between hybrid jobs here, since
#                               the stand-in's "GPU" is these same cores (kept awake, the pool's
#                               yielding workers slowed a layer-split 50% run by 10-25%)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
. "$ROOT/scripts/nvrtc-env.sh"
nvrtc_env fake-gpu
"$ROOT/scripts/emulate-cuda-kernels.sh" --build-only >&2
FAKE="$ROOT/target/cuda-emu/release/fake"
export LD_LIBRARY_PATH="$FAKE:$NVRTC_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export OATO_CUDA_INCLUDE="$CUDA_FP16_DIR"
# Room in the static TLS for the library's thread-local state (tests/cuda_emu/emu.h).
export GLIBC_TUNABLES="${GLIBC_TUNABLES:+$GLIBC_TUNABLES:}glibc.rtld.optional_static_tls=$(cat "$ROOT/target/cuda-emu/release/static-tls")"
# The CPU pool parks between hybrid jobs here (the stand-in's "GPU" is the same cores).
export OATO_CPU_AWAKE="${OATO_CPU_AWAKE:-0}"
# The emulator's kernels run with alignment checks (UBSan); a report should stop the run.
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-abort_on_error=1:print_stacktrace=1}"
exec "$@"

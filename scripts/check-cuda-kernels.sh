#!/usr/bin/env bash
# Proves that every CUDA kernel compiles, on a machine without a GPU: NVRTC 13.0 and the CUDA
# headers come from PyPI into a virtual environment, then `oato selftest --compile-only` compiles
# each kernel source through the engine's own NVRTC path for every architecture it supports and
# checks each launched kernel is in the CUBIN. Compiler errors and warnings fail, with the log.
# Then scripts/emulate-cuda-kernels.sh runs every kernel on the CPU (tests/cuda_emu) against
# references that share no code with it.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/nvrtc-env.sh
nvrtc_env check-cuda-kernels
cargo build --release --quiet
LD_LIBRARY_PATH="$NVRTC_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
OATO_CUDA_INCLUDE="$CUDA_FP16_DIR" OATO_NVRTC_WERROR=1 \
    target/release/oato selftest --compile-only "$@"
# Then run every kernel on the CPU in the emulator against independent references.
scripts/emulate-cuda-kernels.sh
# Then the engine's whole GPU backend, on those kernels behind a stand-in CUDA driver.
scripts/fake-gpu-checks.sh

#!/usr/bin/env bash
# Proves that every CUDA kernel compiles, on a machine without a GPU: NVRTC 13.0 and the CUDA
# headers come from PyPI into a virtual environment, then `oato selftest --compile-only` compiles
# each kernel source through the engine's own NVRTC path for every architecture it supports and
# checks each launched kernel is in the CUBIN. Compiler errors and warnings fail, with the log.
# Then scripts/emulate-cuda-kernels.sh runs every kernel on the CPU (tests/cuda_emu) against
# references that share no code with it.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${OATO_CUDA_VENV:-$HOME/.cache/oato/cuda-venv}"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
"$VENV/bin/pip" install --quiet --disable-pip-version-check \
    'nvidia-cuda-nvrtc==13.0.*' 'nvidia-cuda-runtime==13.0.*'
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
NVRTC=$(find "$SITE/nvidia" -name 'libnvrtc.so*' | sort | head -1)
FP16=$(find "$SITE/nvidia" -name 'cuda_fp16.h' | sort | head -1)
if [ -z "$NVRTC" ] || [ -z "$FP16" ]; then
    echo "check-cuda-kernels: libnvrtc or cuda_fp16.h missing from the wheels in $SITE/nvidia" >&2
    exit 1
fi
cargo build --release --quiet
LD_LIBRARY_PATH="$(dirname "$NVRTC")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
OATO_CUDA_INCLUDE="$(dirname "$FP16")" OATO_NVRTC_WERROR=1 \
    target/release/oato selftest --compile-only "$@"
# Then run every kernel on the CPU in the emulator against independent references.
scripts/emulate-cuda-kernels.sh
# Then the engine's whole GPU backend, on those kernels behind a stand-in CUDA driver.
scripts/fake-gpu-checks.sh

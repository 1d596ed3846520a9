# Sourced (not run) by the scripts that compile CUDA kernels without a CUDA toolkit
# (check-cuda-kernels.sh, fake-gpu.sh, cuda-sass.sh): NVRTC 13.0 and the CUDA headers from PyPI
# in a virtual environment, $OATO_CUDA_VENV (default ~/.cache/oato/cuda-venv), installed the
# first time they are missing from it.
#
#   nvrtc_env NAME   sets NVRTC_DIR (the folder of libnvrtc.so) and CUDA_FP16_DIR (the folder of
#                    cuda_fp16.h, for OATO_CUDA_INCLUDE); if they cannot be had, says so as NAME
#                    and returns 1.
nvrtc_env() {
    local who=$1 venv="${OATO_CUDA_VENV:-$HOME/.cache/oato/cuda-venv}" site nvrtc fp16 try
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    for try in 1 2; do
        # `|| true`: before the first install there is no $site/nvidia, find fails, and under the
        # callers' `set -e -o pipefail` the assignment would end the script without a word.
        nvrtc=$(find "$site/nvidia" -name 'libnvrtc.so*' 2> /dev/null | sort | head -1 || true)
        fp16=$(find "$site/nvidia" -name 'cuda_fp16.h' 2> /dev/null | sort | head -1 || true)
        if [ -n "$nvrtc" ] && [ -n "$fp16" ]; then
            NVRTC_DIR=$(dirname "$nvrtc")
            CUDA_FP16_DIR=$(dirname "$fp16")
            return 0
        fi
        [ "$try" = 1 ] && "$venv/bin/pip" install --quiet --disable-pip-version-check \
            'nvidia-cuda-nvrtc==13.0.*' 'nvidia-cuda-runtime==13.0.*'
    done
    echo "$who: libnvrtc or cuda_fp16.h missing from the wheels in $site/nvidia" >&2
    return 1
}

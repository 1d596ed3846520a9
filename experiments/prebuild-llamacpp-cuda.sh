#!/usr/bin/env bash
# Builds llama.cpp's llama-bench with the CUDA backend HERE, on a machine without a GPU or a CUDA
# install, so that a GPU lease need not spend ~5 of its 15 minutes on the build
# (experiments/build-llamacpp-cuda.sh builds it on the device instead). The CUDA 13.0 compiler,
# runtime, cuBLAS and CCCL headers come from PyPI's nvidia-* wheels (the device's driver, 580, is
# CUDA 13.0); libcuda is a link-time stub (ggml-cuda calls eleven driver functions; the device's
# real libcuda.so.1 answers at run time). The sources are scripts/make-llamacpp-tarball.sh's trimmed
# tarball (the same llama.cpp 0c1e570 as the CPU peer).
#
# Backends load at run time (GGML_BACKEND_DL): llama-bench, libllama, libggml-base and, beside
# them, libggml-cuda.so (sm_$CUDA_ARCH, default 90: the H100) and one libggml-cpu.so built for
# AVX2 + AVX-512 (F, VBMI, VNNI, BF16; no AMX, which gives wrong Q4_0/Q4_1 results on CPUs that
# report AMX-INT8: upstream PR #16315), which runs on the H100 machine's Xeon, with an AVX2 one
# (ggml's "haswell" variant) beside it for machines without AVX-512; the loader takes the best
# that runs. Where libggml-cuda.so cannot load (no GPU here), llama-bench runs on the CPU alone, so
# the package is checked here with a tiny synth file.
#
# Output: .carry/llamacpp-cuda-bin.tar.xz (a folder llama-cuda-bin/ with the binaries and
# RUN-ENV.sh, which on the device points LD_LIBRARY_PATH at its own CUDA 13 runtime and cuBLAS);
# experiments/gpu-lease.sh packs it for the device (42 MB; so the test model then travels in three
# parts). On this project's 2-core machines the build (mostly the flash-attention and int8-GEMM
# template instances) took 67 minutes on a Zen 3 VM (4036 s, beside other work) and 22 on a Zen 5
# VM (1310 s, 2026-11-28): start it early, in the background, but never hold a lease back for it:
#   setsid nohup experiments/prebuild-llamacpp-cuda.sh > /tmp/prebuild.log 2>&1 &
#
# Env: WORK (default /tmp/llamacpp-prebuild: wheels, toolkit, sources, build tree; reused),
#      TOOLKIT (default $WORK/toolkit/nvidia/cu13: the unpacked wheels), CUDA_ARCH (90),
#      JOBS (nproc), OUT (.carry/llamacpp-cuda-bin.tar.xz).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
work=${WORK:-/tmp/llamacpp-prebuild}
arch=${CUDA_ARCH:-90}
jobs=${JOBS:-$(nproc)}
out=${OUT:-.carry/llamacpp-cuda-bin.tar.xz}
[[ $out = /* ]] || out=$root/$out
start=$SECONDS
say() { echo "== $* ($((SECONDS - start)) s)" >&2; }
mkdir -p "$work" "$(dirname "$out")"
command -v cmake >/dev/null && command -v ninja >/dev/null || python3 -m pip install -q cmake ninja >&2

# 1. The toolkit from wheels: nvcc, ptxas, cicc (nvvm), headers, cudart, cuBLAS, CCCL.
tk=${TOOLKIT:-$work/toolkit/nvidia/cu13}
if [ ! -x "$tk/bin/nvcc" ]; then
    say "CUDA 13.0 wheels"
    tk=$work/toolkit/nvidia/cu13
    rm -rf "$work/wheels" "$work/toolkit"
    for p in nvidia-cuda-nvcc nvidia-cuda-runtime nvidia-cublas nvidia-cuda-cccl nvidia-cuda-crt nvidia-nvvm; do
        python3 -m pip download -q --no-deps --only-binary=:all: -d "$work/wheels" "$p==13.0.*" >&2
    done
    mkdir -p "$work/toolkit"
    for w in "$work"/wheels/*.whl; do
        python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$w" "$work/toolkit"
    done
    chmod +x "$tk"/bin/* "$tk"/nvvm/bin/* 2>/dev/null || true
fi
# nvcc.profile looks for lib64/; CMake and the linker for the unversioned names and a driver stub.
ln -sfn lib "$tk/lib64"
for l in cudart cublas cublasLt; do ln -sf "lib$l.so.13" "$tk/lib/lib$l.so"; done
mkdir -p "$tk/lib/stubs"
if [ ! -f "$tk/lib/stubs/libcuda.so" ]; then
    { for f in cuDeviceGet cuDeviceGetAttribute cuGetErrorString cuMemAddressFree cuMemAddressReserve \
        cuMemCreate cuMemGetAllocationGranularity cuMemMap cuMemRelease cuMemSetAccess cuMemUnmap; do
        echo "int $f(void) { return 999; }"; done; } > "$work/cuda_stub.c"
    gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$tk/lib/stubs/libcuda.so" "$work/cuda_stub.c"
fi
export PATH=$tk/bin:$PATH
"$tk/bin/nvcc" --version | tail -1 >&2

# 2. The trimmed sources.
tarball=$root/.carry/llamacpp-src.tar.xz
[ -f "$tarball" ] || scripts/make-llamacpp-tarball.sh "$tarball" >&2
src=$work/llama.cpp
sum=$(sha256sum "$tarball" | cut -d' ' -f1)
if [ "$(cat "$work/tarball.sha256" 2>/dev/null)" != "$sum" ]; then
    rm -rf "$src"
    tar -xJf "$tarball" -C "$work"
    echo "$sum" > "$work/tarball.sha256"
fi
commit=$(sed -n '1s/^llama\.cpp \([0-9a-f]\{7\}\).*/\1/p' "$src/OATO-PROVENANCE.txt" 2>/dev/null || true)

# 3. Configure and build.
say "configure (sm_$arch)"
cmake -S "$src" -B "$src/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_APP=OFF -DGGML_NATIVE=OFF -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=OFF \
    -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON \
    -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF \
    -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DGGML_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=$arch" \
    "-DCMAKE_CUDA_COMPILER=$tk/bin/nvcc" "-DCUDAToolkit_ROOT=$tk" ${commit:+"-DLLAMA_BUILD_COMMIT=$commit"} >&2
say "build, $jobs jobs"
cmake --build "$src/build" -j "$jobs" --target llama-bench ggml-cuda ggml-cpu >&2
# A fallback CPU backend for machines without AVX-512 (the loader takes the best that runs).
say "AVX2 fallback CPU backend"
cmake -S "$src" -B "$src/build-avx2" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_TOOLS=OFF -DGGML_NATIVE=OFF -DGGML_BACKEND_DL=ON \
    -DGGML_CPU_ALL_VARIANTS=ON -DGGML_CUDA=OFF >&2
cmake --build "$src/build-avx2" -j "$jobs" --target ggml-cpu-haswell >&2
say "built"

# 4. Pack, with the run-time environment for the device.
bin=$src/build/bin
pack=$work/pack/llama-cuda-bin
rm -rf "$work/pack"
mkdir -p "$pack"
cp -a "$bin"/llama-bench "$bin"/*.so* "$pack/"
cp "$src/build-avx2/bin/libggml-cpu-haswell.so" "$pack/"
strip --strip-unneeded "$pack"/*.so* "$pack/llama-bench" 2>/dev/null || true
cat > "$pack/RUN-ENV.sh" <<'SH'
# Source before running llama-bench from this folder: the device's CUDA 13 runtime and cuBLAS
# (the build's run path points at the machine it was built on).
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cudalib=
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda-13*/lib64 \
    $(python3 -c 'import site; print(" ".join(p + "/nvidia/cu13/lib" for p in site.getsitepackages()))' 2>/dev/null); do
    if [ -e "$d/libcublas.so.13" ] && [ -e "$d/libcudart.so.13" ]; then cudalib=$d; break; fi
done
if [ -z "$cudalib" ]; then # the loader's cache
    d=$(ldconfig -p 2>/dev/null | awk '/libcublas\.so\.13 /{print $NF; exit}')
    [ -n "$d" ] && [ -e "$(dirname "$d")/libcudart.so.13" ] && cudalib=$(dirname "$d")
fi
if [ -z "$cudalib" ]; then # anywhere on the root file system
    d=$(find / -xdev -name libcublas.so.13 2>/dev/null | head -1)
    [ -n "$d" ] && [ -e "$(dirname "$d")/libcudart.so.13" ] && cudalib=$(dirname "$d")
fi
# Without them libggml-cuda.so does not load and llama-bench runs on the CPU alone.
[ -n "$cudalib" ] || echo "RUN-ENV.sh: no libcublas.so.13 + libcudart.so.13 found: llama-bench will run on the CPU" >&2
export LD_LIBRARY_PATH="$here${cudalib:+:$cudalib}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
SH
{
    echo "llama.cpp $commit (scripts/make-llamacpp-tarball.sh), built $(date -u +%F) on $(uname -m) by experiments/prebuild-llamacpp-cuda.sh"
    echo "CUDA: $("$tk/bin/nvcc" --version | tail -1), sm_$arch; CPU backend: AVX2 + AVX-512 F/VBMI/VNNI/BF16, no AMX"
} > "$pack/PROVENANCE.txt"
tar -cJf "$out.tmp" -C "$work/pack" llama-cuda-bin
mv "$out.tmp" "$out"
say "$out: $(stat -c %s "$out") bytes"

# 5. Check: it starts, and runs on the CPU where there is no GPU.
check=$work/check.gguf
if [ ! -f "$check" ] && [ -x target/release/oato ]; then
    target/release/oato synth --shape llama3.2-1b --type Q4_0 --layers 2 -o "$check" >&2
fi
if [ -f "$check" ]; then
    # shellcheck disable=SC1091
    (. "$pack/RUN-ENV.sh" && "$pack/llama-bench" -m "$check" -p 16 -n 4 -r 1 -t "$jobs") >&2
else
    echo "(no target/release/oato to make a check file: the run check is skipped)" >&2
fi
say "done"

#!/usr/bin/env bash
# Builds llama.cpp's llama-bench with the CUDA backend on the borrowed GPU machine (no network, no
# Rust) from the trimmed sources that scripts/make-llamacpp-tarball.sh packs here: the peer for
# experiments/hybrid-vs-llamacpp.sh. Prints the bin directory on its last line.
#
# Usage: experiments/build-llamacpp-cuda.sh                  build in the foreground
#        experiments/build-llamacpp-cuda.sh --background     start the build detached (setsid nohup),
#                                                            log to $PREFIX/build.log, exit status to
#                                                            $PREFIX/done; returns at once
#        experiments/build-llamacpp-cuda.sh --wait [SECONDS] wait for a background build (default 540 s,
#                                                            under the device's 600 s per call); prints
#                                                            the bin directory, or fails with the log's
#                                                            tail (exit 3: still building, call again)
# If $PREFIX/llama.cpp/build/bin/llama-bench exists already, every form just prints the bin directory.
# On the H100 machine (16 cores, CUDA 13.0, architecture 90) the build took 276 s with JOBS=16, so a
# foreground build fits in one 600 s call. The device machine is handed back after 30 s without a
# call, and /tmp with it: --background pays only when the next call follows within 30 s.
#
# Env: TARBALL (default .carry/llamacpp-src.tar.xz, relative to the repository root),
#      PREFIX (default /tmp/llamacpp-cuda), JOBS (default 12), EXTRA_TARGETS (built beside llama-bench,
#      e.g. "llama-completion llama-quantize"; default none), CUDA_ARCH (default: the first GPU's
#      compute_cap from nvidia-smi, 9.0 -> 90), LLAMACPP_CUDA (default 1; 0 builds the CPU backend
#      only, to check this script on a machine without nvcc).
#
# Options as ../shared/peers/build-llamacpp.sh's CPU build, except GGML_NATIVE=ON (built and run on
# the same machine) and no examples, server, app or tests. AMX stays off: ggml's AMX path gives
# wrong Q4_0/Q4_1 results or crashes on CPUs that report AMX-INT8 (upstream llama.cpp PR #16315).
set -euo pipefail
cd "$(dirname "$0")/.."
self=$(pwd)/experiments/$(basename "$0")

mode=foreground
wait_s=540
case ${1:-} in
  "") ;;
  --background) mode=background ;;
  --wait)
    mode=wait
    wait_s=${2:-540}
    [[ $wait_s =~ ^[0-9]+$ ]] || { echo "error: --wait takes whole seconds (got $wait_s)" >&2; exit 2; }
    ;;
  -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
  *) echo "error: unknown argument $1 (use --background, --wait [SECONDS] or nothing)" >&2; exit 2 ;;
esac

tarball=${TARBALL:-.carry/llamacpp-src.tar.xz}
[[ $tarball = /* ]] || tarball=$(pwd)/$tarball
prefix=${PREFIX:-/tmp/llamacpp-cuda}
jobs=${JOBS:-12}
targets="llama-bench ${EXTRA_TARGETS:-}"
cuda=${LLAMACPP_CUDA:-1}
src=$prefix/llama.cpp
bin=$src/build/bin
log=$prefix/build.log

if [ -x "$bin/llama-bench" ] && [ ! -f "$prefix/building" ]; then echo "$bin"; exit 0; fi

case $mode in
background)
  mkdir -p "$prefix"
  if [ -f "$prefix/pid" ] && kill -0 "$(cat "$prefix/pid")" 2>/dev/null; then
    echo "a build is already running under $prefix (pid $(cat "$prefix/pid")); log $log" >&2
    exit 0
  fi
  rm -f "$prefix/done" "$prefix/pid"
  export TARBALL=$tarball PREFIX=$prefix JOBS=$jobs EXTRA_TARGETS=${EXTRA_TARGETS:-} LLAMACPP_CUDA=$cuda
  # The detached shell records its own pid (setsid may fork), runs this script in the foreground,
  # then writes the exit status to done.tmp and renames it: --wait never reads half a file.
  setsid nohup bash -c 'echo $$ > "$2/pid"; "$1" > "$2/build.log" 2>&1; echo $? > "$2/done.tmp"; mv "$2/done.tmp" "$2/done"' \
    bash "$self" "$prefix" < /dev/null > /dev/null 2>&1 &
  for _ in $(seq 50); do [ -s "$prefix/pid" ] && break; sleep 0.1; done
  [ -s "$prefix/pid" ] || { echo "error: the background build did not start" >&2; exit 1; }
  echo "building in the background (pid $(cat "$prefix/pid")), log $log; then: experiments/build-llamacpp-cuda.sh --wait" >&2
  exit 0
  ;;
wait)
  deadline=$((SECONDS + wait_s))
  while [ ! -f "$prefix/done" ]; do
    if ! { [ -f "$prefix/pid" ] && kill -0 "$(cat "$prefix/pid")" 2>/dev/null; }; then
      # The process may have ended between the two tests.
      [ -f "$prefix/done" ] && break
      echo "error: no background build running under $prefix (start one with --background)" >&2
      [ -f "$log" ] && tail -n 40 "$log" >&2
      exit 1
    fi
    if [ $SECONDS -ge $deadline ]; then
      echo "still building after ${wait_s} s; last lines of $log:" >&2
      tail -n 5 "$log" >&2 || true
      exit 3
    fi
    sleep 5
  done
  rc=$(cat "$prefix/done")
  if [ "$rc" = 0 ] && [ -x "$bin/llama-bench" ]; then echo "$bin"; exit 0; fi
  echo "error: the background build failed (exit $rc); last lines of $log:" >&2
  tail -n 40 "$log" >&2
  exit 1
  ;;
esac

# Foreground build.
[ -f "$tarball" ] || { echo "error: $tarball not found (make it with scripts/make-llamacpp-tarball.sh and carry it)" >&2; exit 1; }
command -v cmake >/dev/null || { echo "error: cmake not found" >&2; exit 1; }
flags=(-DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_SERVER=OFF
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DGGML_NATIVE=ON
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
if [ "$cuda" = 1 ]; then
  if [ -z "${CUDACXX:-}" ]; then
    if command -v nvcc >/dev/null; then
      CUDACXX=$(command -v nvcc)
    elif [ -x /usr/local/cuda/bin/nvcc ]; then
      CUDACXX=/usr/local/cuda/bin/nvcc
    else
      echo "error: nvcc is neither on PATH nor at /usr/local/cuda/bin (set CUDACXX)" >&2; exit 1
    fi
  fi
  PATH=$(dirname "$CUDACXX"):$PATH
  export CUDACXX PATH
  arch=${CUDA_ARCH:-}
  if [ -z "$arch" ]; then
    cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n 1 | tr -d '[:space:]')
    [[ $cap =~ ^[0-9]+\.[0-9]+$ ]] || { echo "error: nvidia-smi gave compute_cap '$cap' (set CUDA_ARCH, e.g. 90)" >&2; exit 1; }
    arch=${cap/./}
  fi
  flags+=(-DGGML_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=$arch")
  echo "== CUDA: $CUDACXX ($("$CUDACXX" --version | tail -n 1)), architecture $arch" >&2
else
  flags+=(-DGGML_CUDA=OFF)
  echo "== LLAMACPP_CUDA=$cuda: CPU backend only" >&2
fi
command -v ninja >/dev/null && flags+=(-G Ninja)

mkdir -p "$prefix"
touch "$prefix/building"
# Unpack afresh unless this very tarball is unpacked there already (its checksum is the stamp).
sum=$(sha256sum "$tarball" | cut -d' ' -f1)
if [ "$(cat "$prefix/tarball.sha256" 2>/dev/null)" != "$sum" ]; then
  echo "== unpacking $tarball into $prefix" >&2
  rm -rf "$src" "$prefix/tarball.sha256"
  tar -xJf "$tarball" -C "$prefix"
  echo "$sum" > "$prefix/tarball.sha256"
fi
[ -f "$src/CMakeLists.txt" ] || { echo "error: $tarball did not unpack to $src" >&2; exit 1; }
commit=$(sed -n '1s/^llama\.cpp \([0-9a-f]\{7\}\).*/\1/p' "$src/OATO-PROVENANCE.txt" 2>/dev/null || true)
[ -n "$commit" ] && flags+=("-DLLAMA_BUILD_COMMIT=$commit")

echo "== cmake ${flags[*]}" >&2
cmake -S "$src" -B "$src/build" "${flags[@]}" >&2
# shellcheck disable=SC2086  # a space-separated list of targets
cmake --build "$src/build" -j"$jobs" --target $targets >&2
[ -x "$bin/llama-bench" ] || { echo "error: the build left no $bin/llama-bench" >&2; exit 1; }
rm -f "$prefix/building"
"$bin/llama-bench" --version >&2 || true
echo "$bin"

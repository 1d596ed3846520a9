#!/usr/bin/env bash
# Packs the llama.cpp sources vendored in PyPI's llama-cpp-python sdist (the same sources
# ../shared/peers/build-llamacpp.sh builds on the CPU), trimmed to what a CUDA (or CPU) build of
# llama-bench needs, into .carry/llamacpp-src.tar.xz (a few MB): the borrowed GPU machine has no
# network, and at most 64 MiB travels per call. There, experiments/build-llamacpp-cuda.sh builds it.
#
# Usage: scripts/make-llamacpp-tarball.sh [OUT]     (default OUT: .carry/llamacpp-src.tar.xz)
# Env:   LLAMACPP_PY_VERSION (default 0.3.36 = llama.cpp 0c1e570),
#        CHECK (default 1: cmake-configure the trimmed tree with -DGGML_CUDA=OFF before packing;
#        0 skips it; needs cmake).
#
# What goes: docs, models (vocab files), tests, examples, pocs, app, .github and the other dot
# folders, media, gguf-py, scripts, the conversion scripts; every ggml backend except CPU and CUDA;
# the ggml-cpu code for architectures other than x86 and ARM (and KleidiAI, SpacemiT); tools
# that need the server or the multimodal library (server, cli, ui, mtmd, tts, rpc, tuning); the
# vendored miniaudio, stb and hash, used only by mtmd and an example. No source file is edited.
# Where a CMakeLists.txt adds a removed folder under llama.cpp's default options (examples, pocs, app,
# tests, tools/{server,cli,ui,mtmd,tts}, vendor/{miniaudio,stb,hash}), the folder stays as a
# one-line stub CMakeLists.txt, so the tree still configures with those defaults (and the targets
# there simply do not exist: no llama-server, llama-cli, llama-mtmd-cli). The tools left whole (llama-bench,
# completion, quantize, tokenize, perplexity, batched-bench and the other small ones that
# tools/CMakeLists.txt adds unconditionally) cost about 0.1 MB packed.
# Unpacks to a single folder llama.cpp/, with OATO-PROVENANCE.txt (sdist, its sha256, the
# llama.cpp commit) at its top.
set -euo pipefail
cd "$(dirname "$0")/.."
ver=${LLAMACPP_PY_VERSION:-0.3.36}
out=${1:-.carry/llamacpp-src.tar.xz}
check=${CHECK:-1}

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# pip prepares an sdist's metadata even to download it, which runs its build backend
# (scikit-build-core) and CMake >= 3.21: both installed as wheels here (without cmake a fresh VM
# failed with CMakeNotFoundError on 2026-12-01), and --no-build-isolation uses them rather than
# building the build requirements from source.
python3 -m pip install -q scikit-build-core cmake >&2
python3 -m pip download -q --no-deps --no-binary :all: --no-build-isolation -d "$tmp" "llama-cpp-python==$ver" >&2
sdist=$tmp/llama_cpp_python-$ver.tar.gz
[ -f "$sdist" ] || { echo "error: pip did not leave $sdist" >&2; exit 1; }
tar -xzf "$sdist" -C "$tmp"
pkg=$tmp/llama_cpp_python-$ver
src=$tmp/pack/llama.cpp
mkdir -p "$tmp/pack"
mv "$pkg/vendor/llama.cpp" "$src"
# The sdist carries the submodule's git metadata: HEAD is the vendored llama.cpp commit.
commit=$(tr -d '[:space:]' < "$pkg/.git/modules/vendor/llama.cpp/HEAD" 2>/dev/null || true)
[[ $commit =~ ^[0-9a-f]{40}$ ]] || commit=unknown
before=$(du -sk "$src" | cut -f1)

stub() { # folder...: replace with a CMakeLists.txt that defines nothing
  local d
  for d in "$@"; do
    [ -e "$src/$d" ] || { echo "error: expected $d in llama.cpp $commit (layout changed?)" >&2; exit 1; }
    rm -rf "${src:?}/$d"
    mkdir -p "$src/$d"
    echo "# Trimmed by oato's scripts/make-llamacpp-tarball.sh: not needed to build llama-bench." \
      > "$src/$d/CMakeLists.txt"
  done
}
keep_only() { # folder, names to keep: remove every other entry of folder
  local dir=$1 e name keep; shift
  for e in "$src/$dir"/* "$src/$dir"/.[!.]*; do
    [ -e "$e" ] || continue
    name=$(basename "$e")
    keep=0
    for k in "$@"; do [ "$name" = "$k" ] && keep=1; done
    [ $keep = 1 ] || rm -rf "$e"
  done
}

# Top level: the library, ggml, common, the vendored headers common needs, tools, build scripts.
keep_only . CMakeLists.txt LICENSE licenses cmake include src ggml common vendor tools \
  examples pocs tests app
stub examples pocs tests app
# ggml: its own cmake/, headers and core sources; of the backends only CPU and CUDA.
keep_only ggml CMakeLists.txt cmake include src
for e in "$src"/ggml/src/ggml-*; do
  [ -d "$e" ] || continue
  case $(basename "$e") in ggml-cpu|ggml-cuda) ;; *) rm -rf "$e" ;; esac
done
keep_only ggml/src/ggml-cpu/arch x86 arm
rm -rf "$src"/ggml/src/ggml-cpu/{kleidiai,spacemit}
# tools: what tools/CMakeLists.txt adds unconditionally stays (small), except the multimodal ones.
rm -rf "$src"/tools/{rpc,tuning}
stub tools/server tools/cli tools/ui tools/mtmd tools/tts vendor/miniaudio vendor/stb vendor/hash
find "$src" -name '*.md' -delete
find "$src" -name '.git*' -prune -exec rm -rf {} +

after=$(du -sk "$src" | cut -f1)
cat > "$src/OATO-PROVENANCE.txt" <<EOF
llama.cpp $commit, as vendored in llama-cpp-python $ver (PyPI sdist $(basename "$sdist"),
sha256 $(sha256sum "$sdist" | cut -d' ' -f1)), trimmed by oato's scripts/make-llamacpp-tarball.sh
on $(date -u +%Y-%m-%dT%H:%M:%SZ) from ${before} KiB to ${after} KiB: what remains builds llama-bench
(CPU and CUDA backends). Build with experiments/build-llamacpp-cuda.sh.
EOF

if [ "$check" = 1 ]; then
  command -v cmake >/dev/null || { echo "error: cmake not found (apt-get install cmake, or CHECK=0)" >&2; exit 1; }
  echo "== cmake configure of the trimmed tree (GGML_CUDA=OFF, llama.cpp's default options)" >&2
  cmake -S "$src" -B "$tmp/build-default" -DGGML_CUDA=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    > "$tmp/configure.log" 2>&1 || { tail -n 40 "$tmp/configure.log" >&2; exit 1; }
  echo "== cmake configure with build-llamacpp-cuda.sh's options (less CUDA)" >&2
  cmake -S "$src" -B "$tmp/build-ours" -DGGML_CUDA=OFF -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_APP=OFF -DGGML_NATIVE=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
    "-DLLAMA_BUILD_COMMIT=${commit:0:7}" > "$tmp/configure.log" 2>&1 \
    || { tail -n 40 "$tmp/configure.log" >&2; exit 1; }
fi

mkdir -p "$(dirname "$out")"
# Fixed order, owner and times: the same sources give the same archive.
XZ_OPT=-9e tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 \
  -C "$tmp/pack" -cJf "$out.tmp" llama.cpp
mv "$out.tmp" "$out"
echo "llama.cpp $commit (llama-cpp-python $ver): ${before} KiB -> ${after} KiB unpacked" >&2
echo "$out: $(stat -c %s "$out") bytes ($(du -h "$out" | cut -f1))"

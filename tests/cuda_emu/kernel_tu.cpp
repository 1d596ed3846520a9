// kernel_tu.cpp: the translation unit the emulator build compiles once per kernel source: the
// unchanged .cu (emu.h is force-included before it), then one EMU_EXPORT(name) line per kernel
// the build found in that source, which registers the kernel for emu_launch. The build passes
//   -DEMU_SOURCE_FILE='"src/kernels/cuda/ops.cu"' -DEMU_SOURCE_NAME='"ops.cu"'
//   -DEMU_EXPORTS_FILE='"target/cuda-emu/release/ops.exports"' (paths from the repository root)
#include EMU_SOURCE_FILE
#include EMU_EXPORTS_FILE

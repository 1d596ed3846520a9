// quantize.cu: f32 activations to Q8_1 blocks, the input format of the mmvq kernels.
//
// The arithmetic is src/quant/quantize.rs's quantize_block_q8_1 (the reference `quantize_row`
// for Q8_1), step for step (common.cuh's q8_lane), so the blocks are bit-identical to it.

#include "common.cuh"

// launch: grid (ceil(n_blocks / 8), 1, 1), block (256, 1, 1): one warp per 32-element block,
// lane i quantises element i. x: [n_blocks * 32] f32; y: [n_blocks] block_q8_1, 4-byte aligned.
extern "C" __global__ void quantize_q8_1(const float* __restrict__ x, block_q8_1* __restrict__ y,
                                         int n_blocks) {
    const i64 ib = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (ib >= n_blocks) return; // the whole warp leaves together
    store_q8_1(y + ib, x[ib * QK + (threadIdx.x & 31)]);
}

// The same blocks split in two arrays, for the mmvq_direct_* and mmvq_split_* kernels: the quants
// of block ib at aq[32 ib..32 ib + 32] and its (d, s), widened exactly from the f16 values
// quantize_q8_1 stores, at ads[ib] (store_q8's split sink). launch: as quantize_q8_1. x:
// [n_blocks * 32] f32; aq: [n_blocks * 32] i8; ads: [n_blocks] float2, 8-byte aligned.
extern "C" __global__ void quantize_q8_1_split(const float* __restrict__ x, i8* __restrict__ aq,
                                               float2* __restrict__ ads, int n_blocks) {
    const i64 ib = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (ib >= n_blocks) return; // the whole warp leaves together
    store_q8(q8_sink{nullptr, aq, ads}.at(ib), x[ib * QK + (threadIdx.x & 31)]);
}

// Activations of a prefill GEMM with a quantised weight: each 32-element block rounded exactly as
// quantize_q8_1 rounds it, then written back as f16(f16(d) * q), the value the mmvq kernels (and
// ggml's CPU dot products) multiply. So a token's result does not depend on whether it came in a
// batch for the matrix-vector kernels or for the GEMM, and the GEMM sees 8-bit activations as the
// CPU engine does (|q| <= 127 times an f16 scale needs at most 18 bits; the f16 store rounds it).
// launch: as quantize_q8_1. x: [n_blocks * 32] f32; y: [n_blocks * 32] f16, 2-byte aligned.
extern "C" __global__ void round_q8_f16(const float* __restrict__ x, __half* __restrict__ y,
                                        int n_blocks) {
    const int lane = threadIdx.x & 31;
    const i64 ib = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (ib >= n_blocks) return; // the whole warp leaves together

    float d;
    const int q = q8_lane(x[ib * QK + lane], d);
    y[ib * QK + lane] = __float2half_rn(__half2float(__float2half_rn(d)) * (float)q);
}

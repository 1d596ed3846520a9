// dequant.cu: quantised (and bf16) weights to f16, for prefill, where the host then runs a cuBLAS
// f16 GEMM; plus f32 <-> f16 conversions.
//
// The values are src/quant/dequantize.rs's, step for step in f32 (each product and sum rounded
// on its own: __fmul_rn / __fadd_rn / __fsub_rn keep the compiler from fusing them), then rounded
// once to f16 (nearest even). So y equals f16(dequantize_row(w)) bit for bit.
//
// launch (every dequant_*_f16): grid (min(ceil(n_elems / 256 / 8), 65535), 1, 1),
// block (256, 1, 1), no dynamic shared memory; any grid works (grid-stride loop). The per-thread
// unit is 8 consecutive output elements (ELEMS = 8): one 16-byte store when y is 16-byte aligned.
// For the quantised types n_elems is a whole number of blocks (32, or 256 for K-quants and
// IQ4_XS); a partial trailing block is not written. w needs only 2-byte alignment.
// Arguments (w, y, n_elems, k_w, k_y): k_w == k_y (any value) reads n_elems elements of whole
// rows from w on; k_y < k_w (multiples of the block size) reads a column block, k_y elements of
// each row of k_w elements (w at the block's first element in the first row), into dense rows
// of k_y (dq_src_unit). The host cuts a large weight's prefill GEMM along k so.

#include "common.cuh"

#define DQ_ELEMS 8

// Grid-stride over the n_elems / 8 units of y; `unit(w, u, v)` fills v[0..8] with elements
// 8u..8u + 8 of w (u mapped by dq_src_unit).
template <class F>
__device__ __forceinline__ void dequant_loop(const void* w, __half* y, i64 n_elems, int k_w,
                                             int k_y, F unit) {
    const i64 units = n_elems / DQ_ELEMS;
    const bool vec = ((u64)y & 15) == 0;
    for (i64 u = (i64)blockIdx.x * blockDim.x + threadIdx.x; u < units;
         u += (i64)gridDim.x * blockDim.x) {
        float v[DQ_ELEMS];
        unit((const u8*)w, dq_src_unit(u, k_w, k_y), v);
        store8_f16(y, u * DQ_ELEMS, v, vec);
    }
}

// ---------------------------------------------------------------------------------------------
// 32-element blocks: 4 units per block; unit j holds elements 8j..8j + 8, the low nibbles of
// qs[8j..8j + 8] for j < 2 and the high nibbles of qs[8(j - 2)..] for j >= 2.

// Those 8 nibbles of unit j of the 16 bytes qs, one in each byte of (a0, a1).
__device__ __forceinline__ void nibbles8(const u8* qs, int j, u32& a0, u32& a1) {
    ld8(qs + 8 * (j & 1), a0, a1);
    const int sh = j < 2 ? 0 : 4;
    a0 = (a0 >> sh) & 0x0F0F0F0Fu;
    a1 = (a1 >> sh) & 0x0F0F0F0Fu;
}

// y = (q - 8) * d
struct dq_q4_0 {
    __device__ void operator()(const u8* w, i64 u, float* v) const {
        const block_q4_0* b = (const block_q4_0*)w + (u >> 2);
        u32 a0, a1;
        nibbles8(b->qs, (int)(u & 3), a0, a1);
        const float d = f16f(b->d);
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = (float)((int)byte8(a0, a1, e) - 8) * d;
    }
};

// y = q * d + m
struct dq_q4_1 {
    __device__ void operator()(const u8* w, i64 u, float* v) const {
        const block_q4_1* b = (const block_q4_1*)w + (u >> 2);
        u32 a0, a1;
        nibbles8(b->qs, (int)(u & 3), a0, a1);
        const float d = f16f(b->d), m = f16f(b->m);
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = __fadd_rn(__fmul_rn((float)byte8(a0, a1, e), d), m);
    }
};

// y = (q - 16) * d, the fifth bit of element i being bit i of qh.
struct dq_q5_0 {
    __device__ void operator()(const u8* w, i64 u, float* v) const {
        const block_q5_0* b = (const block_q5_0*)w + (u >> 2);
        const int j = (int)(u & 3);
        u32 a0, a1;
        nibbles8(b->qs, j, a0, a1);
        const u32 qh = ld_u32_a2(b->qh) >> (8 * j);
        const float d = f16f(b->d);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const int q = (int)(byte8(a0, a1, e) | (((qh >> e) & 1) << 4));
            v[e] = (float)(q - 16) * d;
        }
    }
};

// y = q * d + m
struct dq_q5_1 {
    __device__ void operator()(const u8* w, i64 u, float* v) const {
        const block_q5_1* b = (const block_q5_1*)w + (u >> 2);
        const int j = (int)(u & 3);
        u32 a0, a1;
        nibbles8(b->qs, j, a0, a1);
        const u32 qh = ld_u32_a2(b->qh) >> (8 * j);
        const float d = f16f(b->d), m = f16f(b->m);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const u32 q = byte8(a0, a1, e) | (((qh >> e) & 1) << 4);
            v[e] = __fadd_rn(__fmul_rn((float)q, d), m);
        }
    }
};

// IQ4_NL / IQ4_XS: y = d * IQ4_VALUES[q] for the 8 quants of unit j (nibbles8) of a 32-element
// group's 16 qs bytes; one f32 product, as dequantize.rs. d is the block's delta (IQ4_XS: the
// group's d * (ls - 32)).
__device__ __forceinline__ void dq_iq4_unit(const u8* qs, int j, float d, float* v) {
    u32 a0, a1;
    nibbles8(qs, j, a0, a1);
    const u32 q0 = iq4_values4(a0), q1 = iq4_values4(a1);
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = d * (float)(int)(i8)byte8(q0, q1, e);
}

struct dq_iq4_nl {
    __device__ void operator()(const u8* w, i64 u, float* v) const {
        const block_iq4_nl* b = (const block_iq4_nl*)w + (u >> 2);
        dq_iq4_unit(b->qs, (int)(u & 3), f16f(b->d), v);
    }
};

// y = q * d; unit j holds qs[8j..8j + 8].
struct dq_q8_0 {
    __device__ void operator()(const u8* w, i64 u, float* v) const {
        const block_q8_0* b = (const block_q8_0*)w + (u >> 2);
        const int j = (int)(u & 3);
        u32 a0, a1;
        ld8((const u8*)b->qs + 8 * j, a0, a1);
        const float d = f16f(b->d);
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = (float)(int)(i8)byte8(a0, a1, e) * d;
    }
};

// ---------------------------------------------------------------------------------------------
// K-quants: 32 units per super-block; unit j holds elements e0..e0 + 8 with e0 = 8j, all within
// one 16-element scale group and one 32-element group.

// y = (d * (sc & 15)) * q - dmin * (sc >> 4); element e: bits 2 * ((e / 32) % 4) of
// qs[32 * (e / 128) + e % 32], scale byte e / 16.
struct dq_q2_K {
    __device__ void operator()(const u8* w, i64 u, float* v) const {
        const block_q2_K* b = (const block_q2_K*)w + (u >> 5);
        const int e0 = 8 * (int)(u & 31);
        u32 a0, a1;
        ld8(b->qs + 32 * (e0 >> 7) + (e0 & 31), a0, a1);
        const int sh = 2 * ((e0 >> 5) & 3);
        const int sc = b->scales[e0 >> 4];
        const float dl = f16f(b->d) * (float)(sc & 0x0F);
        const float ml = f16f(b->dmin) * (float)(sc >> 4);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            v[e] = __fsub_rn(__fmul_rn(dl, (float)((byte8(a0, a1, e) >> sh) & 3)), ml);
        }
    }
};

// y = (d * scale) * (q - (hmask bit ? 0 : 4)); element e = 32g + l (g = 4h + p): bits 2p of
// qs[32h + l], bit g of hmask[l], scale 2g + l / 16.
struct dq_q3_K {
    __device__ void operator()(const u8* w, i64 u, float* v) const {
        const block_q3_K* b = (const block_q3_K*)w + (u >> 5);
        const int e0 = 8 * (int)(u & 31);
        const int g = e0 >> 5, l0 = e0 & 31;
        u32 a0, a1, m0, m1;
        ld8(b->qs + 32 * (g >> 2) + l0, a0, a1);
        ld8(b->hmask + l0, m0, m1);
        const int sh = 2 * (g & 3);
        const float dl = f16f(b->d) * (float)q3k_scale(b->scales, 2 * g + (l0 >> 4));
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const int low = (int)((byte8(a0, a1, e) >> sh) & 3);
            const int hi = (int)((byte8(m0, m1, e) >> g) & 1);
            v[e] = dl * (float)(low - (hi ? 0 : 4));
        }
    }
};

// Q4_K / Q5_K: y = (d * sc) * q - dmin * m; element e = 64c + l: the low (l < 32) or high
// nibble of qs[32c + l % 32], group e / 32, plus 16 where bit e / 32 of qh[l % 32] is set (Q5_K).
template <bool HAS_QH>
__device__ __forceinline__ void dq_k4(const u8* dm, const u8* scales, const u8* qh, const u8* qs,
                                      int e0, float* v) {
    const int g = e0 >> 5, l0 = e0 & 31;
    u32 a0, a1;
    ld8(qs + 32 * (g >> 1) + l0, a0, a1);
    u32 h0 = 0, h1 = 0;
    if (HAS_QH) ld8(qh + l0, h0, h1);
    const int sh = 4 * (g & 1);
    int sc, m;
    k4_scale_min(scales, g, sc, m);
    const float d = f16f(((const __half*)dm)[0]) * (float)sc;
    const float mn = f16f(((const __half*)dm)[1]) * (float)m;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        u32 q = (byte8(a0, a1, e) >> sh) & 0x0F;
        if (HAS_QH) q += ((byte8(h0, h1, e) >> g) & 1) << 4;
        v[e] = __fsub_rn(__fmul_rn(d, (float)q), mn);
    }
}

struct dq_q4_K {
    __device__ void operator()(const u8* w, i64 u, float* v) const {
        const block_q4_K* b = (const block_q4_K*)w + (u >> 5);
        dq_k4<false>((const u8*)&b->d, b->scales, nullptr, b->qs, 8 * (int)(u & 31), v);
    }
};

struct dq_q5_K {
    __device__ void operator()(const u8* w, i64 u, float* v) const {
        const block_q5_K* b = (const block_q5_K*)w + (u >> 5);
        dq_k4<true>((const u8*)&b->d, b->scales, b->qh, b->qs, 8 * (int)(u & 31), v);
    }
};

struct dq_q6_K {
    __device__ void operator()(const u8* w, i64 u, float* v) const {
        const block_q6_K* b = (const block_q6_K*)w + (u >> 5);
        dq_q6_k_unit((const u8*)b, f16f(b->d), 8 * (int)(u & 31), v);
    }
};

// IQ4_XS, 32 units per super-block as for the K-quants: unit u holds elements e0..e0 + 8
// (e0 = 8 (u % 32)) of group g = e0 / 32, unit (e0 % 32) / 8 of its 16 qs bytes qs[16g..]
// (IQ4_NL's layout). dl = d * (ls - 32) first (exact: an f16 times a 6-bit integer), then
// y = dl * IQ4_VALUES[q], as dequantize.rs.
struct dq_iq4_xs {
    __device__ void operator()(const u8* w, i64 u, float* v) const {
        const block_iq4_xs* b = (const block_iq4_xs*)w + (u >> 5);
        const int e0 = 8 * (int)(u & 31), g = e0 >> 5;
        const float dl = f16f(b->d) * (float)iq4xs_scale(b->scales_h, ld_u32_a2(b->scales_l), g);
        dq_iq4_unit(b->qs + 16 * g, (e0 & 31) >> 3, dl, v);
    }
};

// launch: grid (min(ceil(n_elems / 2048), 65535), 1, 1), block (256, 1, 1); see the top.
#define DEQUANT_KERNEL(name, F)                                                                \
    extern "C" __global__ void name(const void* __restrict__ w, __half* __restrict__ y,        \
                                    i64 n_elems, int k_w, int k_y) {                           \
        dequant_loop(w, y, n_elems, k_w, k_y, F());                                            \
    }

DEQUANT_KERNEL(dequant_q4_0_f16, dq_q4_0)
DEQUANT_KERNEL(dequant_q4_1_f16, dq_q4_1)
DEQUANT_KERNEL(dequant_q5_0_f16, dq_q5_0)
DEQUANT_KERNEL(dequant_q5_1_f16, dq_q5_1)
DEQUANT_KERNEL(dequant_q8_0_f16, dq_q8_0)
DEQUANT_KERNEL(dequant_q2_K_f16, dq_q2_K)
DEQUANT_KERNEL(dequant_q3_K_f16, dq_q3_K)
DEQUANT_KERNEL(dequant_q4_K_f16, dq_q4_K)
DEQUANT_KERNEL(dequant_q5_K_f16, dq_q5_K)
DEQUANT_KERNEL(dequant_q6_K_f16, dq_q6_K)
DEQUANT_KERNEL(dequant_iq4_nl_f16, dq_iq4_nl)
DEQUANT_KERNEL(dequant_iq4_xs_f16, dq_iq4_xs)

// launch: grid (min(ceil(n_elems / 2048), 65535), 1, 1), block (256, 1, 1); unit 8 elements
// (one 16-byte load and store when w and y are 16-byte aligned), then any n_elems % 8 tail (whole
// rows only); k_w, k_y as the quantised kernels' (a column block: multiples of 8).
// bf16 -> f32 is exact (the bits become the high half), then one rounding to f16.
extern "C" __global__ void dequant_bf16_f16(const void* __restrict__ w, __half* __restrict__ y,
                                            i64 n_elems, int k_w, int k_y) {
    const u16* x = (const u16*)w;
    const i64 units = n_elems / DQ_ELEMS;
    const bool vec = (((u64)w | (u64)y) & 15) == 0;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    const i64 tid = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    for (i64 u = tid; u < units; u += stride) {
        const i64 at = dq_src_unit(u, k_w, k_y) * DQ_ELEMS;
        float v[DQ_ELEMS];
        if (vec) {
            const uint4 r = *(const uint4*)(x + at);
            const u32 words[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                v[2 * j] = __uint_as_float(words[j] << 16);
                v[2 * j + 1] = __uint_as_float(words[j] & 0xFFFF0000u);
            }
        } else {
#pragma unroll
            for (int j = 0; j < DQ_ELEMS; ++j) v[j] = __uint_as_float((u32)x[at + j] << 16);
        }
        store8_f16(y, u * DQ_ELEMS, v, vec);
    }
    for (i64 i = units * DQ_ELEMS + tid; i < n_elems; i += stride) {
        y[i] = __float2half_rn(__uint_as_float((u32)x[i] << 16));
    }
}

// launch: grid any (e.g. min(ceil(n / 256), 65535)), block (256, 1, 1); grid-stride, one element
// per step. Round to nearest even.
extern "C" __global__ void f32_to_f16(const float* __restrict__ x, __half* __restrict__ y, i64 n) {
    GRID_STRIDE_LOOP(i, n) {
        y[i] = __float2half_rn(x[i]);
    }
}

// launch: grid any (e.g. min(ceil(n / 256), 65535)), block (256, 1, 1); grid-stride. Exact.
extern "C" __global__ void f16_to_f32(const __half* __restrict__ x, float* __restrict__ y, i64 n) {
    GRID_STRIDE_LOOP(i, n) {
        y[i] = __half2float(x[i]);
    }
}

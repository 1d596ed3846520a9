// split.cu: weights of the 32-element formats whose block is an f16 scale d then its quants
// (Q4_0 and IQ4_NL: 16 bytes of nibbles; Q8_0: 32 bytes of int8) held on the GPU in a split
// layout, and the kernels that read it: decode matrix-vector products, dequantisation for
// prefill and embedding rows.
//
// Why. In the file's layout a block is 18 (34) bytes and 2-byte aligned, so the quants of a block
// cannot be read with one 16-byte load: the kernels of mmvq.cu either stage whole rows through
// shared memory or read 2-byte words. Split, the quants of block b of row r are the 16 (32) bytes
// at qs + (r * nb + b) * QB, 16-byte aligned, and the scales follow all the quants as one f16
// array, ds[r * nb + b] (nb = k / 32 blocks a row). The weight takes the same bytes.
//
//   [ quants: n * nb * QB bytes ][ scales: n * nb f16 ]
//
// split_blocks writes the layout from the file's bytes on the GPU, once, when a weight is
// uploaded (the host keeps the file's layout for weights it streams). Every kernel here needs the
// weight's base 16-byte aligned (a cudaMalloc pointer is 256-byte aligned).
//
// The matrix-vector kernels (mmvq_split_<type>) take activations split by quantize_q8_1_split
// (quants aq [n_tok, k] i8, 16-byte aligned; (d, s) ads [n_tok, k / 32] float2) and, like
// mmvq_direct_*, apply each weight load to every token of the batch (up to 8). A warp takes one
// row; lane l takes blocks l, l + 32, ..., SPLIT_UNROLL of them loaded before the first is used
// (a 4096-element row is 128 blocks: one 16-byte load each for four, all in flight together).
// Per block the exact integer sum of the 32 products (__dp4a), then (d * d_a) * sum in f32,
// added to the lane's sum in block order; then the warp's sum. The values per block are
// src/quant/dot.rs's (one exact integer a block, one f32 scale step); the order of the f32 sums
// is the direct kernel's (per lane, then the warp), so results match the reference within f32
// rounding, not mmvq_<type>'s bits.

#include "common.cuh"

#define SPLIT_ROWS 4   // warps per thread block, one row each: blockDim (32, 4)
#define SPLIT_MAX_TOK 8
#define SPLIT_UNROLL 4 // blocks a lane loads before it computes

// ---------------------------------------------------------------------------------------------
// Per-format block dot products: the exact i32 sum of a block's 32 products with the activation
// quants a[0..32] (16-byte aligned), the block's quants in q[0..W] (W 16-byte words).

// Q4_0 (M = nib_minus8_w) and IQ4_NL (M = nib_iq4_w): byte j of the 16 holds element j in its low
// nibble and element 16 + j in its high one.
template <class M>
struct split_nib_t {
    enum : int { qb = 16, words = 1 };
    static __device__ __forceinline__ int dot(const uint4* q, const i8* a) {
        const int4 lo = __ldg((const int4*)a), hi = __ldg((const int4*)(a + 16));
        const u32 v[4] = {q[0].x, q[0].y, q[0].z, q[0].w};
        const int al[4] = {lo.x, lo.y, lo.z, lo.w}, ah[4] = {hi.x, hi.y, hi.z, hi.w};
        int s = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            s = __dp4a((int)M::map(v[i] & 0x0F0F0F0Fu), al[i], s);
            s = __dp4a((int)M::map((v[i] >> 4) & 0x0F0F0F0Fu), ah[i], s);
        }
        return s;
    }
};

struct split_minus8 { // Q4_0: q - 8
    static __device__ __forceinline__ u32 map(u32 q) { return (u32)bytes_sub(q, 0x08080808u); }
};
struct split_iq4 { // IQ4_NL: IQ4_VALUES[q]
    static __device__ __forceinline__ u32 map(u32 q) { return iq4_values4(q); }
};

typedef split_nib_t<split_minus8> split_q4_0_t;
typedef split_nib_t<split_iq4> split_iq4_nl_t;

// Q8_0: byte j of the 32 is element j.
struct split_q8_0_t {
    enum : int { qb = 32, words = 2 };
    static __device__ __forceinline__ int dot(const uint4* q, const i8* a) {
        const int4 a0 = __ldg((const int4*)a), a1 = __ldg((const int4*)(a + 16));
        int s = __dp4a((int)q[0].x, a0.x, 0);
        s = __dp4a((int)q[0].y, a0.y, s);
        s = __dp4a((int)q[0].z, a0.z, s);
        s = __dp4a((int)q[0].w, a0.w, s);
        s = __dp4a((int)q[1].x, a1.x, s);
        s = __dp4a((int)q[1].y, a1.y, s);
        s = __dp4a((int)q[1].z, a1.z, s);
        s = __dp4a((int)q[1].w, a1.w, s);
        return s;
    }
};

// The f16 scale at p (2-byte aligned), read-only, widened.
__device__ __forceinline__ float split_scale(const u16* p) {
    return __half2float(__ushort_as_half(__ldg(p)));
}

// ---------------------------------------------------------------------------------------------
// The layout from the file's blocks.

// launch: grid (min(ceil(n_blocks / 256), 65535), 1, 1), block (256, 1, 1); any grid (grid-stride
// over blocks). src: n_blocks blocks of 2 + QB bytes in the file's layout (2-byte aligned); qs:
// n_blocks * QB bytes, 16-byte aligned; ds: n_blocks f16. src must not overlap qs or ds.
template <int QB>
__device__ __forceinline__ void split_blocks_impl(const u8* __restrict__ src, u8* __restrict__ qs,
                                                  u16* __restrict__ ds, i64 n_blocks) {
    GRID_STRIDE_LOOP(b, n_blocks) {
        const u16* s = (const u16*)(src + b * (2 + QB));
        ds[b] = s[0];
        u32 w[QB / 4];
#pragma unroll
        for (int i = 0; i < QB / 4; ++i) w[i] = (u32)s[1 + 2 * i] | ((u32)s[2 + 2 * i] << 16);
        uint4* d = (uint4*)(qs + b * QB);
#pragma unroll
        for (int i = 0; i < QB / 16; ++i) {
            d[i] = make_uint4(w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]);
        }
    }
}

extern "C" __global__ void split_blocks_16(const u8* __restrict__ src, u8* __restrict__ qs,
                                           u16* __restrict__ ds, i64 n_blocks) {
    split_blocks_impl<16>(src, qs, ds, n_blocks);
}

extern "C" __global__ void split_blocks_32(const u8* __restrict__ src, u8* __restrict__ qs,
                                           u16* __restrict__ ds, i64 n_blocks) {
    split_blocks_impl<32>(src, qs, ds, n_blocks);
}

// ---------------------------------------------------------------------------------------------
// Decode matrix-vector products.

// Up to three weights that read one activation (q, k and v; gate and up) in one launch: the
// grid's warps are w0's rows, then w1's, then w2's (ni rows each, any ni >= 0), one row a warp.
template <class T, int MAXT>
__device__ __forceinline__ void mmvq_split_impl(const u8* w0, const u8* w1, const u8* w2,
                                                const i8* __restrict__ aq,
                                                const float2* __restrict__ ads, float* y0,
                                                float* y1, float* y2, int k, int n0, int n1,
                                                int n2, int n_tok) {
    if (blockDim.x != 32 || blockDim.y != SPLIT_ROWS || n_tok < 1 || n_tok > MAXT) {
        return; // whole block
    }
    int row = (int)blockIdx.x * SPLIT_ROWS + (int)threadIdx.y;
    const u8* w;
    float* y;
    int n;
    if (row < n0) {
        w = w0, y = y0, n = n0;
    } else if (row < n0 + n1) {
        w = w1, y = y1, n = n1, row -= n0;
    } else if (row < n0 + n1 + n2) {
        w = w2, y = y2, n = n2, row -= n0 + n1;
    } else {
        return; // whole warp
    }
    const int lane = threadIdx.x;
    const int nb = k / QK;
    const uint4* qs = (const uint4*)(w + (i64)row * nb * T::qb);
    const u16* ds = (const u16*)(w + (i64)n * nb * T::qb) + (i64)row * nb;
    float acc[MAXT];
#pragma unroll
    for (int t = 0; t < MAXT; ++t) acc[t] = 0.0f;
    for (int b0 = lane; b0 < nb; b0 += 32 * SPLIT_UNROLL) {
        uint4 q[SPLIT_UNROLL][T::words];
        float d[SPLIT_UNROLL];
#pragma unroll
        for (int u = 0; u < SPLIT_UNROLL; ++u) {
            const int b = b0 + 32 * u;
            if (b < nb) {
#pragma unroll
                for (int i = 0; i < T::words; ++i) q[u][i] = __ldg(qs + (i64)b * T::words + i);
                d[u] = split_scale(ds + b);
            }
        }
#pragma unroll
        for (int u = 0; u < SPLIT_UNROLL; ++u) {
            const int b = b0 + 32 * u;
            if (b < nb) {
#pragma unroll
                for (int t = 0; t < MAXT; ++t) {
                    if (t < n_tok) {
                        const int sumi = T::dot(q[u], aq + (i64)t * k + QK * b);
                        const float da = __ldg(ads + (i64)t * nb + b).x;
                        acc[t] += d[u] * da * (float)sumi;
                    }
                }
            }
        }
    }
#pragma unroll
    for (int t = 0; t < MAXT; ++t) {
        if (t < n_tok) {
            const float v = warp_sum(acc[t]);
            if (lane == 0) y[(i64)t * n + row] = v;
        }
    }
}

// launch (every mmvq_split_* kernel): grid (ceil((n0 + n1 + n2) / 4), 1, 1), block (32, 4, 1)
// exactly, no shared memory. wi: ni rows of k in the split layout (16-byte aligned; a weight with
// ni = 0 is not read, nor its yi); aq, ads: quantize_q8_1_split's [n_tok, k] quants (16-byte
// aligned) and [n_tok, k / 32] (d, s); yi: [n_tok, ni] f32; 1 <= n_tok <= 8 (else nothing is
// written); k a multiple of 32. mmvq_split1_<type>: the same for n_tok = 1 only (one sum a lane:
// 48-64 registers on sm_90 against 70-94 for eight, so more warps fit a multiprocessor).
#define MMVQ_SPLIT_KERNEL(name, MAXT, T)                                                        \
    extern "C" __global__ void __launch_bounds__(128)                                           \
        name(const u8* __restrict__ w0, const u8* __restrict__ w1, const u8* __restrict__ w2,   \
             const i8* __restrict__ aq, const float2* __restrict__ ads, float* __restrict__ y0, \
             float* __restrict__ y1, float* __restrict__ y2, int k, int n0, int n1, int n2,     \
             int n_tok) {                                                                       \
        mmvq_split_impl<T, MAXT>(w0, w1, w2, aq, ads, y0, y1, y2, k, n0, n1, n2, n_tok);        \
    }

MMVQ_SPLIT_KERNEL(mmvq_split_q4_0, SPLIT_MAX_TOK, split_q4_0_t)
MMVQ_SPLIT_KERNEL(mmvq_split_iq4_nl, SPLIT_MAX_TOK, split_iq4_nl_t)
MMVQ_SPLIT_KERNEL(mmvq_split_q8_0, SPLIT_MAX_TOK, split_q8_0_t)
MMVQ_SPLIT_KERNEL(mmvq_split1_q4_0, 1, split_q4_0_t)
MMVQ_SPLIT_KERNEL(mmvq_split1_iq4_nl, 1, split_iq4_nl_t)
MMVQ_SPLIT_KERNEL(mmvq_split1_q8_0, 1, split_q8_0_t)

// ---------------------------------------------------------------------------------------------
// Dequantisation to f16 (prefill's GEMM, embedding rows): dequant.cu's values step for step, so
// the same bits as dequant_<type>_f16 of the file's layout. Unit u: elements 8u..8u + 8, of block
// u / 4.

// The 8 nibbles of unit j (0..4) of a block's 16 quant bytes (16-byte aligned), one a byte:
// elements 8j..8j + 8 are the low nibbles of bytes 8(j % 2).. for j < 2, the high ones after.
__device__ __forceinline__ void split_nibbles8(const u8* q, int j, u32& a0, u32& a1) {
    const uint2 v = *(const uint2*)(q + 8 * (j & 1));
    const int sh = j < 2 ? 0 : 4;
    a0 = (v.x >> sh) & 0x0F0F0F0Fu;
    a1 = (v.y >> sh) & 0x0F0F0F0Fu;
}

struct dq_split_q4_0 { // (q - 8) * d
    __device__ void operator()(const u8* q, int j, float d, float* v) const {
        u32 a0, a1;
        split_nibbles8(q, j, a0, a1);
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = (float)((int)byte8(a0, a1, e) - 8) * d;
    }
};

struct dq_split_iq4_nl { // d * IQ4_VALUES[q]
    __device__ void operator()(const u8* q, int j, float d, float* v) const {
        u32 a0, a1;
        split_nibbles8(q, j, a0, a1);
        const u32 q0 = iq4_values4(a0), q1 = iq4_values4(a1);
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = d * (float)(int)(i8)byte8(q0, q1, e);
    }
};

struct dq_split_q8_0 { // q * d
    __device__ void operator()(const u8* q, int j, float d, float* v) const {
        const uint2 w = *(const uint2*)(q + 8 * j);
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = (float)(int)(i8)byte8(w.x, w.y, e) * d;
    }
};

// launch (every dequant_split_*_f16): grid (min(ceil(n_elems / 2048), 65535), 1, 1), block (256,
// 1, 1), any grid (grid-stride). qs: the quants of n_elems / 32 blocks (16-byte aligned), ds their
// scales; y: [n_elems] f16. n_elems a multiple of 32 (the blocks of a range of whole rows: qs and
// ds advanced by the rows before it).
#define DEQUANT_SPLIT_KERNEL(name, QB, F)                                                       \
    extern "C" __global__ void name(const u8* __restrict__ qs, const u16* __restrict__ ds,     \
                                    __half* __restrict__ y, i64 n_elems) {                     \
        const bool vec = ((u64)y & 15) == 0;                                                   \
        GRID_STRIDE_LOOP(u, n_elems / 8) {                                                     \
            float v[8];                                                                        \
            F()(qs + (u >> 2) * QB, (int)(u & 3), __half2float(__ushort_as_half(ds[u >> 2])),  \
                v);                                                                            \
            store8_f16(y, u * 8, v, vec);                                                      \
        }                                                                                      \
    }

DEQUANT_SPLIT_KERNEL(dequant_split_q4_0_f16, 16, dq_split_q4_0)
DEQUANT_SPLIT_KERNEL(dequant_split_iq4_nl_f16, 16, dq_split_iq4_nl)
DEQUANT_SPLIT_KERNEL(dequant_split_q8_0_f16, 32, dq_split_q8_0)

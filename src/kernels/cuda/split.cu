// split.cu: quantised weights held on the GPU in a split layout, and the kernels that read it:
// decode matrix-vector products, dequantisation for prefill and embedding rows. The formats are
// those whose blocks are f16 scales and bytes that 16-byte loads cannot reach in the file's
// layout: Q4_0 and IQ4_NL (d, then 16 bytes of nibbles: 18-byte blocks), Q4_1 (d, m, then 16
// bytes: 20), Q8_0 (d, then 32 int8: 34 bytes) and Q6_K (ql, qh and scales, 208 bytes, then d:
// 210 bytes). Q4_K and Q5_K blocks (144 and 176 bytes) are 16-byte multiples already: they keep
// the file's layout (no scales array, no rewriting) and only their decode kernels are this
// file's.
//
// Why. In the file's layout those blocks are 2-byte aligned, so the kernels of mmvq.cu either
// stage whole rows through shared memory or read 2-byte words. Split, the rest of block b of
// row r (QB bytes: 16, 32 or 208, each a multiple of 16) is at qs + (r * nb + b) * QB, 16-byte
// aligned, in the file's order, and the scales follow all of them as one array of SB bytes a
// block (d, or Q4_1's d and m), ds + (r * nb + b) * SB (nb blocks a row). The weight takes the
// same bytes.
//
//   [ quants: n * nb * QB bytes ][ scales: n * nb * SB bytes ]
//
// split_blocks_* write the layout from the file's bytes on the GPU, once, when a weight is
// uploaded (the host keeps the file's layout for weights it streams). Every kernel here needs the
// weight's base 16-byte aligned (a cudaMalloc pointer is 256-byte aligned).
//
// The matrix-vector kernels (mmvq_split_<type>) take activations split by quantize_q8_1_split
// (or by the fused kernels that write the same: quants aq [n_tok, k] i8, 16-byte aligned; (d, s)
// ads [n_tok, k / 32] float2) and, like mmvq_direct_*, apply each weight load to every token of
// the batch (up to 8). A warp takes one row; a block is cut into UPB units (the whole block for
// the 32-element formats; the K-quants' 8 units of mmvq.cu), and lane l takes units l, l + 32,
// ..., SPLIT_UNROLL of them loaded before the first is used (a 4096-element Q4_0 row is 128
// blocks: one 16-byte load each for four, all in flight together). Per unit the exact integer
// sums (__dp4a) and the format's f32 scale steps, added to the lane's sum in unit order; then the
// warp's sum.
// The values per block are src/quant/dot.rs's for the 32-element formats (one exact integer a
// block, one f32 scale step) and mmvq.cu's units for the K-quants; the order of the f32 sums is
// the direct kernel's (per lane, then the warp), so results match the reference within f32
// rounding, not mmvq_<type>'s bits.

#include "common.cuh"

#define SPLIT_ROWS 4   // warps per thread block, one row each: blockDim (32, 4)
#define SPLIT_MAX_TOK 8
#define SPLIT_UNROLL 4 // units a lane loads before it computes

// ---------------------------------------------------------------------------------------------
// Formats. Each has qk (elements a block), qb (bytes a block in the quants part), upb (units a
// block), sb (bytes a block in the scales array: 2, 4, or 0 for none), W (a unit's weight
// registers), load(q, p) (unit p of the block whose quants are at q, 16-byte aligned) and
// dot(w, sc, a, ads) (the unit's f32 contribution with the activation quants a of the block's
// elements, 16-byte aligned, and their (d, s) ads, one per 32 elements; sc the block's scale
// bytes as a little-endian word, 0 without the array).

// The f16 in the low (high) half of a scale word, widened.
__device__ __forceinline__ float split_lo(u32 sc) {
    return __half2float(__ushort_as_half((u16)(sc & 0xFFFFu)));
}
__device__ __forceinline__ float split_hi(u32 sc) {
    return __half2float(__ushort_as_half((u16)(sc >> 16)));
}

// The exact i32 sum of the 32 products of a Q4_0 / IQ4_NL / Q4_1 block's quants q (byte j:
// element j in its low nibble, element 16 + j in its high one; M maps four nibbles to the four
// factors __dp4a takes) with the activation quants a.
template <class M>
__device__ __forceinline__ int split_nib_sum(uint4 q, const i8* a) {
    const int4 lo = __ldg((const int4*)a), hi = __ldg((const int4*)(a + 16));
    const u32 v[4] = {q.x, q.y, q.z, q.w};
    const int al[4] = {lo.x, lo.y, lo.z, lo.w}, ah[4] = {hi.x, hi.y, hi.z, hi.w};
    int s = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        s = __dp4a((int)M::map(v[i] & 0x0F0F0F0Fu), al[i], s);
        s = __dp4a((int)M::map((v[i] >> 4) & 0x0F0F0F0Fu), ah[i], s);
    }
    return s;
}

// Q4_0, IQ4_NL and (MIN) Q4_1: one unit a block, its 16 bytes of nibbles; d * d_a * the exact
// sum, and for Q4_1 (d and m apart, 4 bytes; its nibbles unsigned) plus m * s_a with the
// activation block's f16 s (as ggml and mmvq_q4_1_t do).
template <class M, bool MIN>
struct split_nib_t {
    enum : int { qk = QK, qb = 16, upb = 1, sb = MIN ? 4 : 2 };
    typedef uint4 W;
    static __device__ __forceinline__ W load(const u8* q, int) { return __ldg((const uint4*)q); }
    static __device__ __forceinline__ float dot(const W& w, u32 sc, const i8* a,
                                                const float2* ads) {
        const float2 ds = __ldg(ads);
        const float r = split_lo(sc) * ds.x * (float)split_nib_sum<M>(w, a);
        return MIN ? r + split_hi(sc) * ds.y : r;
    }
};

typedef split_nib_t<nib_minus8, false> split_q4_0_t;
typedef split_nib_t<nib_iq4, false> split_iq4_nl_t;
typedef split_nib_t<nib_plain, true> split_q4_1_t;

// Q8_0: one unit a block, its 32 int8 (byte j is element j).
struct split_q8_0_t {
    enum : int { qk = QK, qb = 32, upb = 1, sb = 2 };
    struct W {
        uint4 lo, hi;
    };
    static __device__ __forceinline__ W load(const u8* q, int) {
        return {__ldg((const uint4*)q), __ldg((const uint4*)q + 1)};
    }
    static __device__ __forceinline__ float dot(const W& w, u32 sc, const i8* a,
                                                const float2* ads) {
        const int4 a0 = __ldg((const int4*)a), a1 = __ldg((const int4*)(a + 16));
        int s = __dp4a((int)w.lo.x, a0.x, 0);
        s = __dp4a((int)w.lo.y, a0.y, s);
        s = __dp4a((int)w.lo.z, a0.z, s);
        s = __dp4a((int)w.lo.w, a0.w, s);
        s = __dp4a((int)w.hi.x, a1.x, s);
        s = __dp4a((int)w.hi.y, a1.y, s);
        s = __dp4a((int)w.hi.z, a1.z, s);
        s = __dp4a((int)w.hi.w, a1.w, s);
        return split_lo(sc) * __ldg(ads).x * (float)s;
    }
};

// Q6_K: mmvq.cu's 8 units a super-block (q6k_unit_sum), then d times that. The quants part keeps
// the file's offsets: ql @0, qh @128, scales @192 (208 bytes; d apart); a unit's ql, qh and
// scale bytes are four 8-byte loads.
struct split_q6_K_t {
    enum : int { qk = QK_K, qb = 208, upb = 8, sb = 2 };
    struct W {
        uint2 la, lb, h; // ql[64h + l0..], ql[64h + 32 + l0..], qh[32h + l0..]
        uint2 sc;        // scales[8h..8h + 8]
        int p;
    };
    static __device__ __forceinline__ W load(const u8* q, int p) {
        const int h = p >> 2, l0 = 8 * (p & 3);
        const uint2* w = (const uint2*)q;
        return {__ldg(w + 8 * h + l0 / 8), __ldg(w + 8 * h + 4 + l0 / 8),
                __ldg(w + 16 + 4 * h + l0 / 8), __ldg(w + 24 + h), p};
    }
    static __device__ __forceinline__ float dot(const W& w, u32 d, const i8* a,
                                                const float2* ads) {
        const int h = w.p >> 2, l0 = 8 * (w.p & 3);
        // scales[8h + 2j + l0 / 16]: byte 2j + l0 / 16 of the eight.
        const u32 s = (l0 >> 4) ? (w.sc.x >> 8) | (w.sc.y << 24) : w.sc.x;
        const u32 t = (l0 >> 4) ? w.sc.y >> 8 : w.sc.y;
        const int sc[4] = {(i8)s, (i8)(s >> 16), (i8)t, (i8)(t >> 16)};
        return split_lo(d) *
               q6k_unit_sum(w.la.x, w.la.y, w.lb.x, w.lb.y, w.h.x, w.h.y, sc, a + l0, ads, h);
    }
};

// Q4_K (HAS_QH false) and Q5_K: the file's blocks (16-byte multiples), mmvq.cu's 8 units a
// super-block (k4_unit_dot): the block's first 16 bytes and 16 bytes of qs (and of qh for Q5_K)
// a unit.
template <bool HAS_QH>
struct split_k4_t {
    enum : int { qk = QK_K, qb = HAS_QH ? 176 : 144, upb = 8, sb = 0 };
    struct W {
        uint4 head, v, hv;
        int p;
    };
    static __device__ __forceinline__ W load(const u8* q, int p) {
        const int c = p >> 1, l0 = 16 * (p & 1);
        const uint4 z = make_uint4(0, 0, 0, 0);
        return {__ldg((const uint4*)q), __ldg((const uint4*)(q + (HAS_QH ? 48 : 16) + 32 * c + l0)),
                HAS_QH ? __ldg((const uint4*)(q + 16 + l0)) : z, p};
    }
    static __device__ __forceinline__ float dot(const W& w, u32, const i8* a,
                                                const float2* ads) {
        const int c = w.p >> 1, l0 = 16 * (w.p & 1);
        return k4_unit_dot<HAS_QH>(w.head, w.v, w.hv, a + 64 * c + l0, ads + 2 * c, w.p);
    }
};

typedef split_k4_t<false> split_q4_K_t;
typedef split_k4_t<true> split_q5_K_t;

// Block b's scale bytes (SB of them at ds + b * SB) as a little-endian word, read-only.
template <int SB>
__device__ __forceinline__ u32 split_scales(const u8* ds, i64 b) {
    if (SB == 4) return __ldg((const u32*)(ds + 4 * b));
    return SB == 2 ? (u32)__ldg((const u16*)(ds + 2 * b)) : 0u;
}

// ---------------------------------------------------------------------------------------------
// The layout from the file's blocks.

// launch: grid (min(ceil(n_blocks / 256), 65535), 1, 1), block (256, 1, 1); any grid (grid-stride
// over blocks). src: n_blocks blocks of SB + QB bytes in the file's layout (2-byte aligned), the
// SB scale bytes at byte D_AT of each (0, or QB: after the rest); qs: n_blocks * QB bytes, 16-byte
// aligned; ds: n_blocks * SB bytes. src must not overlap qs or ds.
template <int QB, int SB, int D_AT>
__device__ __forceinline__ void split_blocks_impl(const u8* __restrict__ src, u8* __restrict__ qs,
                                                  u16* __restrict__ ds, i64 n_blocks) {
    constexpr int skip = D_AT == 0 ? SB / 2 : 0; // u16 words before the quants
    GRID_STRIDE_LOOP(b, n_blocks) {
        const u16* s = (const u16*)(src + b * (SB + QB));
#pragma unroll
        for (int i = 0; i < SB / 2; ++i) ds[b * (SB / 2) + i] = s[D_AT / 2 + i];
        uint4* d = (uint4*)(qs + b * QB);
#pragma unroll 1
        for (int i = 0; i < QB / 16; ++i) {
            u32 w[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int at = skip + 8 * i + 2 * j;
                w[j] = (u32)s[at] | ((u32)s[at + 1] << 16);
            }
            d[i] = make_uint4(w[0], w[1], w[2], w[3]);
        }
    }
}

#define SPLIT_BLOCKS_KERNEL(name, QB, SB, D_AT)                                                \
    extern "C" __global__ void name(const u8* __restrict__ src, u8* __restrict__ qs,           \
                                    u16* __restrict__ ds, i64 n_blocks) {                      \
        split_blocks_impl<QB, SB, D_AT>(src, qs, ds, n_blocks);                                \
    }

SPLIT_BLOCKS_KERNEL(split_blocks_16, 16, 2, 0)   // Q4_0, IQ4_NL
SPLIT_BLOCKS_KERNEL(split_blocks_16m, 16, 4, 0)  // Q4_1
SPLIT_BLOCKS_KERNEL(split_blocks_32, 32, 2, 0)   // Q8_0
SPLIT_BLOCKS_KERNEL(split_blocks_208, 208, 2, 208) // Q6_K

// ---------------------------------------------------------------------------------------------
// Decode matrix-vector products.

// Each lane's f32 sums for row `row` of NW split weights w[0..NW) (n rows of k each) times
// every token's activations: the lane's units in order, SPLIT_UNROLL units of every weight loaded
// before the first is used (all NW weights' loads in flight together). acc[j][t]: weight j,
// token t, this lane's part (the warp's sum is the caller's).
template <class T, int MAXT, int NW>
__device__ __forceinline__ void split_dots(const u8* const (&w)[NW], int n, int row,
                                           const i8* __restrict__ aq,
                                           const float2* __restrict__ ads, int k, int n_tok,
                                           float (&acc)[NW][MAXT]) {
    const int lane = threadIdx.x;
    const int nb = k / T::qk, units = nb * T::upb;
    const u8* qs[NW];
    const u8* ds[NW];
#pragma unroll
    for (int j = 0; j < NW; ++j) {
        qs[j] = w[j] + (i64)row * nb * T::qb;
        ds[j] = w[j] + (i64)n * nb * T::qb + (i64)row * nb * T::sb;
#pragma unroll
        for (int t = 0; t < MAXT; ++t) acc[j][t] = 0.0f;
    }
    for (int u0 = lane; u0 < units; u0 += 32 * SPLIT_UNROLL) {
        typename T::W q[NW][SPLIT_UNROLL];
        u32 sc[NW][SPLIT_UNROLL];
#pragma unroll
        for (int i = 0; i < SPLIT_UNROLL; ++i) {
            const int u = u0 + 32 * i;
            if (u < units) {
                const int b = u / T::upb;
#pragma unroll
                for (int j = 0; j < NW; ++j) {
                    q[j][i] = T::load(qs[j] + (i64)b * T::qb, u - b * T::upb);
                    sc[j][i] = split_scales<T::sb>(ds[j], b);
                }
            }
        }
#pragma unroll
        for (int i = 0; i < SPLIT_UNROLL; ++i) {
            const int u = u0 + 32 * i;
            if (u < units) {
                const int b = u / T::upb;
#pragma unroll
                for (int t = 0; t < MAXT; ++t) {
                    if (t < n_tok) {
                        const i8* a = aq + (i64)t * k + (i64)b * T::qk;
                        const float2* d = ads + (i64)t * (k / QK) + (i64)b * (T::qk / QK);
#pragma unroll
                        for (int j = 0; j < NW; ++j) acc[j][t] += T::dot(q[j][i], sc[j][i], a, d);
                    }
                }
            }
        }
    }
}

// Row `row` of the split weight w (n rows of k) times every token's activations (split_dots),
// the warp's sum, y[t * n + row] written by lane 0. All 32 lanes of the warp call it.
template <class T, int MAXT>
__device__ __forceinline__ void split_row(const u8* w, int n, int row, const i8* __restrict__ aq,
                                          const float2* __restrict__ ads, float* y, int k,
                                          int n_tok) {
    const u8* const ws[1] = {w};
    float acc[1][MAXT];
    split_dots<T, MAXT, 1>(ws, n, row, aq, ads, k, n_tok, acc);
#pragma unroll
    for (int t = 0; t < MAXT; ++t) {
        if (t < n_tok) {
            const float v = warp_sum(acc[0][t]);
            if (threadIdx.x == 0) y[(i64)t * n + row] = v;
        }
    }
}

// Whether this warp is the last of `members` to finish its group, by the group's counter: the
// warp's writes are made visible to the device first, then the counter counts it; the last one
// is then ordered after every other member's writes, reads them (through L2: __ldcg) and sets
// the counter back to 0 when done, so counters stay zero between launches. All 32 lanes call it.
__device__ __forceinline__ bool split_last_warp(u32* counter, unsigned members) {
    __threadfence();
    int last = 0;
    if (threadIdx.x == 0) last = atomicAdd(counter, 1u) == members - 1;
    last = __shfl_sync(0xffffffffu, last, 0);
    if (last) __threadfence();
    return last;
}

// Which of up to three weights (n0, n1, n2 rows) this warp's row of the grid falls in, and the
// row within it: the grid's warps are w0's rows, then w1's, then w2's. -1: past them all.
__device__ __forceinline__ int split_pick(int n0, int n1, int n2, int& row) {
    row = (int)blockIdx.x * SPLIT_ROWS + (int)threadIdx.y;
    if (row < n0) return 0;
    if (row < n0 + n1) return row -= n0, 1;
    if (row < n0 + n1 + n2) return row -= n0 + n1, 2;
    return -1;
}

// Up to three weights that read one activation (q, k and v; gate and up) in one launch, one row
// a warp (any ni >= 0).
template <class T, int MAXT>
__device__ __forceinline__ void mmvq_split_impl(const u8* w0, const u8* w1, const u8* w2,
                                                const i8* __restrict__ aq,
                                                const float2* __restrict__ ads, float* y0,
                                                float* y1, float* y2, int k, int n0, int n1,
                                                int n2, int n_tok) {
    if (blockDim.x != 32 || blockDim.y != SPLIT_ROWS || n_tok < 1 || n_tok > MAXT) {
        return; // whole block
    }
    int row;
    const int which = split_pick(n0, n1, n2, row);
    if (which < 0) return; // whole warp
    const u8* w = which == 0 ? w0 : which == 1 ? w1 : w2;
    float* y = which == 0 ? y0 : which == 1 ? y1 : y2;
    split_row<T, MAXT>(w, which == 0 ? n0 : which == 1 ? n1 : n2, row, aq, ads, y, k, n_tok);
}

// launch (every mmvq_split_* kernel): grid (ceil((n0 + n1 + n2) / 4), 1, 1), block (32, 4, 1)
// exactly, no shared memory. wi: ni rows of k in the split layout (16-byte aligned; a weight with
// ni = 0 is not read, nor its yi); aq, ads: quantize_q8_1_split's [n_tok, k] quants (16-byte
// aligned) and [n_tok, k / 32] (d, s); yi: [n_tok, ni] f32; 1 <= n_tok <= 8 (else nothing is
// written); k a multiple of the block size. mmvq_split1_<type>: the same for n_tok = 1 only (one
// sum a lane: fewer registers than for eight, so more warps fit a multiprocessor). Register
// bounds: SPLIT_DECODE_KERNELS.
// For Q4_K / Q5_K (no scales array) wi is the file's layout.
#define MMVQ_SPLIT_KERNEL(name, MAXT, MINB, T)                                                  \
    extern "C" __global__ void __launch_bounds__(128, MINB)                                     \
        name(const u8* __restrict__ w0, const u8* __restrict__ w1, const u8* __restrict__ w2,   \
             const i8* __restrict__ aq, const float2* __restrict__ ads, float* __restrict__ y0, \
             float* __restrict__ y1, float* __restrict__ y2, int k, int n0, int n1, int n2,     \
             int n_tok) {                                                                       \
        mmvq_split_impl<T, MAXT>(w0, w1, w2, aq, ads, y0, y1, y2, k, n0, n1, n2, n_tok);        \
    }

// cv[d] = f16(v[d]) for d < head_dim by one warp, v through L2 (other warps wrote it): for heads
// of up to 256, a lane's loads all out before its stores (a loop of load then store waited for
// each in turn: four round trips a lane for a head of 128); a loop beyond.
__device__ __forceinline__ void store_head_f16(const float* v, __half* __restrict__ cv,
                                               int head_dim) {
    constexpr int MAXJ = 8;
    if (head_dim > 32 * MAXJ) {
        for (int d = threadIdx.x; d < head_dim; d += 32) cv[d] = __float2half_rn(__ldcg(v + d));
        return;
    }
    float x[MAXJ];
#pragma unroll
    for (int j = 0; j < MAXJ; ++j) {
        const int d = (int)threadIdx.x + 32 * j;
        if (d < head_dim) x[j] = __ldcg(v + d);
    }
#pragma unroll
    for (int j = 0; j < MAXJ; ++j) {
        const int d = (int)threadIdx.x + 32 * j;
        if (d < head_dim) cv[d] = __float2half_rn(x[j]);
    }
}

// The last warp of a head in mmvq_split_qkv_rope: the head's RoPE and KV store for every token
// (which: 0 q, 1 k, 2 v; n the weight's rows). Not inlined: its registers (the double-precision
// sincos, the pairs in flight) stay out of the matrix-vector loop every warp runs.
__device__ OATO_NOINLINE void qkv_rope_finish(int which, int head, int n, float* q, float* kk,
                                              const float* v, __half* __restrict__ ck,
                                              __half* __restrict__ cv, int head_dim, int n_tok,
                                              int n_dims, int pos0, float freq_base,
                                              float freq_scale, int neox,
                                              const float* __restrict__ freq_factors,
                                              int dim_offset) {
    const bool ok = rope_shape_ok(head_dim, n_dims, dim_offset);
    for (int t = 0; t < n_tok; ++t) {
        const i64 at = ((i64)t * (n / head_dim) + head) * head_dim;
        if (which == 0) {
            if (ok) {
                rope_head_warp(q + at + dim_offset, nullptr, pos0 + t, n_dims, freq_base,
                               freq_scale, neox, freq_factors);
            }
        } else if (which == 1) {
            if (ok) {
                rope_head_warp(kk + at + dim_offset, ck + at + dim_offset, pos0 + t, n_dims,
                               freq_base, freq_scale, neox, freq_factors);
            }
            for (int d = threadIdx.x; d < head_dim; d += 32) {
                if (!ok || d < dim_offset || d >= dim_offset + n_dims) {
                    ck[at + d] = __float2half_rn(__ldcg(kk + at + d));
                }
            }
        } else {
            store_head_f16(v + at, cv + at, head_dim);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// q, k and v, their RoPE and the KV store in one launch: decode's attention input when the three
// are split weights of one type (one mmvq_split launch) and RoPE runs with the store, one launch
// where there were two (mmvq_split_<type>, then rope_store_kv_f16). Each warp takes a row as
// mmvq_split does (the same sums); the last warp of each head to finish (a counter per head:
// q's n_head, then k's and v's n_head_kv each; a fence, then atomicAdd; it sets the counter back
// to 0) finishes the head for every token as rope_store_kv_f16 does: q's rotated in place, k's
// rotated in place and into ck, v's into cv. So q, k, v and the caches get the bits of the two
// launches it replaces.
template <class T, int MAXT>
__device__ __forceinline__ void mmvq_split_qkv_rope_impl(
    const u8* w0, const u8* w1, const u8* w2, const i8* __restrict__ aq,
    const float2* __restrict__ ads, float* q, float* kk, float* v, __half* ck, __half* cv,
    u32* counters, int k, int n_head, int n_head_kv, int head_dim, int n_tok, int n_dims,
    int pos0, float freq_base, float freq_scale, int neox, const float* freq_factors,
    int dim_offset) {
    if (blockDim.x != 32 || blockDim.y != SPLIT_ROWS || n_tok < 1 || n_tok > MAXT ||
        head_dim < 1 || head_dim % 32 || n_head < 1 || n_head_kv < 1) {
        return; // whole block
    }
    const int nq = n_head * head_dim, nkv = n_head_kv * head_dim;
    int row;
    const int which = split_pick(nq, nkv, nkv, row);
    if (which < 0) return; // whole warp
    const int n = which == 0 ? nq : nkv;
    float* y = which == 0 ? q : which == 1 ? kk : v;
    split_row<T, MAXT>(which == 0 ? w0 : which == 1 ? w1 : w2, n, row, aq, ads, y, k, n_tok);
    const int head = row / head_dim;
    const int c = which == 0 ? head : n_head + (which - 1) * n_head_kv + head;
    if (!split_last_warp(counters + c, head_dim)) return; // whole warp
    qkv_rope_finish(which, head, n, q, kk, v, ck, cv, head_dim, n_tok, n_dims, pos0, freq_base,
                    freq_scale, neox, freq_factors, dim_offset);
    if (threadIdx.x == 0) counters[c] = 0u;
}

// launch: grid (ceil((n_head + 2 n_head_kv) head_dim / 4), 1, 1), block (32, 4, 1) exactly, no
// shared memory. w0, w1, w2: q's, k's and v's weights (n_head * head_dim, n_head_kv * head_dim
// and n_head_kv * head_dim rows of k) in the split layout (the file's for Q4_K / Q5_K); aq, ads:
// as mmvq_split_*'s; q, kk, v: [n_tok, rows] f32 outputs; ck, cv: the f16 caches at position
// pos0 ([n_tok, n_head_kv * head_dim]); counters: n_head + 2 n_head_kv u32, zero before the first
// launch (and after every one); the RoPE arguments as rope_store_kv_f16's. head_dim a multiple of
// 32, 1 <= n_tok <= 8 (mmvq_split1_qkv_rope_<type>: 1); else nothing is written.
#define MMVQ_SPLIT_QKV_KERNEL(name, MAXT, MINB, T)                                              \
    extern "C" __global__ void __launch_bounds__(128, MINB)                                     \
        name(const u8* __restrict__ w0, const u8* __restrict__ w1, const u8* __restrict__ w2,   \
             const i8* __restrict__ aq, const float2* __restrict__ ads, float* q, float* kk,    \
             float* v, __half* __restrict__ ck, __half* __restrict__ cv, u32* counters, int k,  \
             int n_head, int n_head_kv, int head_dim, int n_tok, int n_dims, int pos0,          \
             float freq_base, float freq_scale, int neox, const float* __restrict__ ff,         \
             int dim_offset) {                                                                  \
        mmvq_split_qkv_rope_impl<T, MAXT>(w0, w1, w2, aq, ads, q, kk, v, ck, cv, counters, k,   \
                                          n_head, n_head_kv, head_dim, n_tok, n_dims, pos0,     \
                                          freq_base, freq_scale, neox, ff, dim_offset);         \
    }

// ---------------------------------------------------------------------------------------------
// Gate, up and SwiGLU in one launch: decode's FFN when gate and up are split weights of one type
// and SwiGLU runs on the GPU, one launch where there were two (mmvq_split_<type> of gate and up,
// then swiglu_q8_1). Warp r takes row r of both weights (split_dots: the same sums in the same
// order as mmvq_split), and writes u[t, r] = up and g[t, r] =
// silu(gate) * up as swiglu_f32 computes it. The last warp of each group of 32 rows to finish
// (a counter per group: a fence, then atomicAdd; that warp sets the counter back to 0 for the
// next launch, so the counters stay zero between launches) reads the group's 32 values of g back
// and writes their Q8_1 blocks for every token as swiglu_q8_1 does. So g, u and the blocks are
// the bits of the two launches it replaces.
template <class T, int MAXT>
__device__ __forceinline__ void mmvq_split_glu_impl(const u8* wg, const u8* wu,
                                                    const i8* __restrict__ aq,
                                                    const float2* __restrict__ ads, float* g,
                                                    float* u, q8_sink sink, u32* counters, int k,
                                                    int n, int n_tok) {
    if (blockDim.x != 32 || blockDim.y != SPLIT_ROWS || n_tok < 1 || n_tok > MAXT || n % QK) {
        return; // whole block
    }
    const int row = (int)blockIdx.x * SPLIT_ROWS + (int)threadIdx.y;
    if (row >= n) return; // whole warp
    const int lane = threadIdx.x;
    const u8* const ws[2] = {wg, wu};
    float acc[2][MAXT];
    split_dots<T, MAXT, 2>(ws, n, row, aq, ads, k, n_tok, acc);
#pragma unroll
    for (int t = 0; t < MAXT; ++t) {
        if (t < n_tok) {
            const float gv = warp_sum(acc[0][t]), uv = warp_sum(acc[1][t]);
            if (lane == 0) {
                u[(i64)t * n + row] = uv;
                g[(i64)t * n + row] = __fdiv_rn(gv, 1.0f + expf(-gv)) * uv;
            }
        }
    }
    if (!split_last_warp(counters + row / QK, QK)) return; // whole warp
    const int r0 = row / QK * QK;
    for (int t = 0; t < n_tok; ++t) {
        const i64 at = (i64)t * n + r0;
        store_q8(sink.at(at / QK), __ldcg(g + at + lane));
    }
    if (lane == 0) counters[row / QK] = 0u;
}

// launch: grid (ceil(n / 4), 1, 1), block (32, 4, 1) exactly, no shared memory. wg, wu: n rows
// of k in the split layout (the file's for Q4_K / Q5_K); aq, ads: as mmvq_split_*'s; g, u:
// [n_tok, n] f32; q: [n_tok * n / 32] block_q8_1 (4-byte aligned) and saq, sads: [n_tok * n] i8
// and [n_tok * n / 32] float2, each null when not wanted (sads with saq); counters: n / 32 u32,
// zero before the first launch (and after every one); n a multiple of 32, 1 <= n_tok <= 8
// (mmvq_split1_glu_<type>: 1); else nothing is written. Register bounds: SPLIT_DECODE_KERNELS.
#define MMVQ_SPLIT_GLU_KERNEL(name, MAXT, MINB, T)                                              \
    extern "C" __global__ void __launch_bounds__(128, MINB)                                     \
        name(const u8* __restrict__ wg, const u8* __restrict__ wu, const i8* __restrict__ aq,   \
             const float2* __restrict__ ads, float* g, float* u, block_q8_1* __restrict__ q,    \
             i8* __restrict__ saq, float2* __restrict__ sads, u32* counters, int k, int n,      \
             int n_tok) {                                                                       \
        mmvq_split_glu_impl<T, MAXT>(wg, wu, aq, ads, g, u, q8_sink{q, saq, sads}, counters, k, \
                                     n, n_tok);                                                 \
    }

// Every type's decode kernels, with their register bounds (__launch_bounds__ minimum blocks: for
// eight tokens, for one; the fused q / k / v kernels take mmvq_split's, the gate / up kernels
// theirs, for two weights' loads in flight), which keep ptxas from spilling on sm_75..sm_120.
#define SPLIT_DECODE_KERNELS(s, T, M8, M1, G8, G1)                                              \
    MMVQ_SPLIT_KERNEL(mmvq_split_##s, SPLIT_MAX_TOK, M8, T)                                     \
    MMVQ_SPLIT_KERNEL(mmvq_split1_##s, 1, M1, T)                                                \
    MMVQ_SPLIT_QKV_KERNEL(mmvq_split_qkv_rope_##s, SPLIT_MAX_TOK, M8, T)                        \
    MMVQ_SPLIT_QKV_KERNEL(mmvq_split1_qkv_rope_##s, 1, M1, T)                                   \
    MMVQ_SPLIT_GLU_KERNEL(mmvq_split_glu_##s, SPLIT_MAX_TOK, G8, T)                             \
    MMVQ_SPLIT_GLU_KERNEL(mmvq_split1_glu_##s, 1, G1, T)

SPLIT_DECODE_KERNELS(q4_0, split_q4_0_t, 4, 8, 2, 6)
SPLIT_DECODE_KERNELS(iq4_nl, split_iq4_nl_t, 4, 8, 2, 6)
SPLIT_DECODE_KERNELS(q4_1, split_q4_1_t, 4, 8, 2, 6)
SPLIT_DECODE_KERNELS(q8_0, split_q8_0_t, 4, 6, 2, 4)
SPLIT_DECODE_KERNELS(q6_K, split_q6_K_t, 4, 6, 2, 4)
SPLIT_DECODE_KERNELS(q4_K, split_q4_K_t, 2, 6, 1, 4)
SPLIT_DECODE_KERNELS(q5_K, split_q5_K_t, 2, 5, 1, 3)

// ---------------------------------------------------------------------------------------------
// Dequantisation to f16 (prefill's GEMM, embedding rows): dequant.cu's values step for step, so
// the same bits as dequant_<type>_f16 of the file's layout. Unit j of a block: its elements
// 8j..8j + 8.

// The 8 nibbles of unit j (0..4) of a block's 16 quant bytes (16-byte aligned), one a byte:
// elements 8j..8j + 8 are the low nibbles of bytes 8(j % 2).. for j < 2, the high ones after.
__device__ __forceinline__ void split_nibbles8(const u8* q, int j, u32& a0, u32& a1) {
    const uint2 v = *(const uint2*)(q + 8 * (j & 1));
    const int sh = j < 2 ? 0 : 4;
    a0 = (v.x >> sh) & 0x0F0F0F0Fu;
    a1 = (v.y >> sh) & 0x0F0F0F0Fu;
}

struct dq_split_q4_0 { // (q - 8) * d
    __device__ void operator()(const u8* q, int j, u32 sc, float* v) const {
        const float d = split_lo(sc);
        u32 a0, a1;
        split_nibbles8(q, j, a0, a1);
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = (float)((int)byte8(a0, a1, e) - 8) * d;
    }
};

struct dq_split_q4_1 { // q * d + m
    __device__ void operator()(const u8* q, int j, u32 sc, float* v) const {
        const float d = split_lo(sc), m = split_hi(sc);
        u32 a0, a1;
        split_nibbles8(q, j, a0, a1);
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = __fadd_rn(__fmul_rn((float)byte8(a0, a1, e), d), m);
    }
};

struct dq_split_iq4_nl { // d * IQ4_VALUES[q]
    __device__ void operator()(const u8* q, int j, u32 sc, float* v) const {
        const float d = split_lo(sc);
        u32 a0, a1;
        split_nibbles8(q, j, a0, a1);
        const u32 q0 = iq4_values4(a0), q1 = iq4_values4(a1);
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = d * (float)(int)(i8)byte8(q0, q1, e);
    }
};

struct dq_split_q8_0 { // q * d
    __device__ void operator()(const u8* q, int j, u32 sc, float* v) const {
        const float d = split_lo(sc);
        const uint2 w = *(const uint2*)(q + 8 * j);
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = (float)(int)(i8)byte8(w.x, w.y, e) * d;
    }
};

struct dq_split_q6_K { // (d * sc) * (q - 32), dequant.cu's dq_q6_K on the quants part
    __device__ void operator()(const u8* q, int j, u32 sc, float* v) const {
        dq_q6_k_unit(q, split_lo(sc), 8 * j, v);
    }
};

// launch (every dequant_split_*_f16): grid (min(ceil(n_elems / 2048), 65535), 1, 1), block (256,
// 1, 1), any grid (grid-stride). qs: the quants of n_elems / QK blocks (16-byte aligned), ds their
// scales (SB bytes a block); y: [n_elems] f16. n_elems a multiple of the block size QK (the
// blocks of a range of whole rows: qs and ds advanced by the rows before it). k_w, k_y as
// dequant_<type>_f16's: a column block of k_y elements of rows of k_w (qs and ds advanced to the
// block's first block in the first row).
#define DEQUANT_SPLIT_KERNEL(name, QKB, QB, SB, F)                                              \
    extern "C" __global__ void name(const u8* __restrict__ qs, const u8* __restrict__ ds,      \
                                    __half* __restrict__ y, i64 n_elems, int k_w, int k_y) {   \
        constexpr int upb = QKB / 8; /* units a block */                                       \
        const bool vec = ((u64)y & 15) == 0;                                                   \
        GRID_STRIDE_LOOP(u, n_elems / 8) {                                                     \
            const i64 su = dq_src_unit(u, k_w, k_y);                                           \
            const i64 b = su / upb;                                                            \
            float v[8];                                                                        \
            F()(qs + b * QB, (int)(su - b * upb), split_scales<SB>(ds, b), v);                  \
            store8_f16(y, u * 8, v, vec);                                                      \
        }                                                                                      \
    }

DEQUANT_SPLIT_KERNEL(dequant_split_q4_0_f16, QK, 16, 2, dq_split_q4_0)
DEQUANT_SPLIT_KERNEL(dequant_split_q4_1_f16, QK, 16, 4, dq_split_q4_1)
DEQUANT_SPLIT_KERNEL(dequant_split_iq4_nl_f16, QK, 16, 2, dq_split_iq4_nl)
DEQUANT_SPLIT_KERNEL(dequant_split_q8_0_f16, QK, 32, 2, dq_split_q8_0)
DEQUANT_SPLIT_KERNEL(dequant_split_q6_K_f16, QK_K, 208, 2, dq_split_q6_K)

// mmvq.cu: weight matrix times a few activation vectors, for decode.
//
//   y[t * n + r] = sum_i W[r, i] * act[t, i]      (f32 out; r < n rows, t < n_tok tokens)
//
// Quantised weights (mmvq_<type>) take activations already quantised to Q8_1 by quantize_q8_1
// (x: n_tok rows of k / 32 blocks) and use __dp4a on 32-bit words of packed quants: exact i32
// sums per (sub-)block, then one f32 scale step per block as in src/quant/dot.rs. Unsigned
// quants are re-centred per byte (__vsub4) where the format has an offset (Q4_0, Q5_0, Q3_K,
// Q6_K), so those sums are exact; Q4_1 / Q5_1 add m * s with the activation block's s, as ggml
// and dot.rs do; Q2_K / Q4_K / Q5_K take their mins term from exact activation sums (__dp4a with
// 0x01010101) rather than the f16 s. Float weights (mmv_*w) take f32 activations directly.
//
// Work split: one warp streams one weight row. A row of nb blocks is cut into nb * UPB "units"
// (UPB units per block, each a fixed slice of the block's quants, see each vdot_* below); lane l
// takes units l, l + 32, ..., so a warp reads consecutive bytes of the row and 32 / UPB blocks
// per step. Lane sums meet in one warp reduction.
//
// Alignment: the weight pointer must be 2-byte aligned (any GGUF tensor start and any cudaMalloc
// pointer are). Formats whose block size is a multiple of 4 (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K) use
// 32-bit loads when w is 4-byte aligned and 16-bit loads otherwise; the choice is made once per
// warp. Q8_1 activations must be 4-byte aligned (quantize_q8_1's output in a cudaMalloc buffer).
// The float kernels use 16-byte loads when w, x and the row length allow and scalar ones else.

#include "common.cuh"

// ---------------------------------------------------------------------------------------------
// Per-format unit dot products. Each returns the f32 contribution of unit p of weight block ib
// of a row (`w` points at the row) with the matching activations (`x` points at the token's row
// of Q8_1 blocks).

// Q4_0, 2 units per block: unit p holds qs[8p..8p + 8], i.e. elements 8p..8p + 8 (low nibbles)
// and 16 + 8p..16 + 8p + 8 (high nibbles).
struct mmvq_q4_0_t {
    static constexpr int qk = QK, bytes = 18, upb = 2;
    static constexpr bool a4_ok = false;
    template <bool A4>
    static __device__ __forceinline__ float dot(const u8* w, const block_q8_1* x, int ib, int p) {
        const block_q4_0* b = (const block_q4_0*)w + ib;
        const block_q8_1* a = x + ib;
        int sumi = 0;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const u32 v = ld_u32_a2(b->qs + 8 * p + 4 * i);
            const int lo = bytes_sub(v & 0x0F0F0F0Fu, 0x08080808u);
            const int hi = bytes_sub((v >> 4) & 0x0F0F0F0Fu, 0x08080808u);
            sumi = __dp4a(lo, q8_1_int(a, 2 * p + i), sumi);
            sumi = __dp4a(hi, q8_1_int(a, 4 + 2 * p + i), sumi);
        }
        return f16f(b->d) * f16f(a->d) * (float)sumi;
    }
};

// Q4_1, units as Q4_0; unit 0 also adds m * s.
struct mmvq_q4_1_t {
    static constexpr int qk = QK, bytes = 20, upb = 2;
    static constexpr bool a4_ok = true;
    template <bool A4>
    static __device__ __forceinline__ float dot(const u8* w, const block_q8_1* x, int ib, int p) {
        const block_q4_1* b = (const block_q4_1*)w + ib;
        const block_q8_1* a = x + ib;
        int sumi = 0;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const u32 v = ld_u32<A4>(b->qs + 8 * p + 4 * i);
            sumi = __dp4a((int)(v & 0x0F0F0F0Fu), q8_1_int(a, 2 * p + i), sumi);
            sumi = __dp4a((int)((v >> 4) & 0x0F0F0F0Fu), q8_1_int(a, 4 + 2 * p + i), sumi);
        }
        const float2 ds = q8_1_ds(a);
        const float r = f16f(b->d) * ds.x * (float)sumi;
        return p == 0 ? r + f16f(b->m) * ds.y : r;
    }
};

// Q5_0, units as Q4_0; the fifth bit of element e is bit e of qh.
struct mmvq_q5_0_t {
    static constexpr int qk = QK, bytes = 22, upb = 2;
    static constexpr bool a4_ok = false;
    template <bool A4>
    static __device__ __forceinline__ float dot(const u8* w, const block_q8_1* x, int ib, int p) {
        const block_q5_0* b = (const block_q5_0*)w + ib;
        const block_q8_1* a = x + ib;
        const u32 qh = ld_u32_a2(b->qh);
        int sumi = 0;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int e = 8 * p + 4 * i; // first of the four low-nibble elements
            const u32 v = ld_u32_a2(b->qs + e);
            const u32 lo = (v & 0x0F0F0F0Fu) | bits4_to_byte_bit4(qh >> e);
            const u32 hi = ((v >> 4) & 0x0F0F0F0Fu) | bits4_to_byte_bit4(qh >> (e + 16));
            sumi = __dp4a(bytes_sub(lo, 0x10101010u), q8_1_int(a, 2 * p + i), sumi);
            sumi = __dp4a(bytes_sub(hi, 0x10101010u), q8_1_int(a, 4 + 2 * p + i), sumi);
        }
        return f16f(b->d) * f16f(a->d) * (float)sumi;
    }
};

// Q5_1, units as Q4_0; unit 0 also adds m * s.
struct mmvq_q5_1_t {
    static constexpr int qk = QK, bytes = 24, upb = 2;
    static constexpr bool a4_ok = true;
    template <bool A4>
    static __device__ __forceinline__ float dot(const u8* w, const block_q8_1* x, int ib, int p) {
        const block_q5_1* b = (const block_q5_1*)w + ib;
        const block_q8_1* a = x + ib;
        const u32 qh = ld_u32<A4>(b->qh);
        int sumi = 0;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int e = 8 * p + 4 * i;
            const u32 v = ld_u32<A4>(b->qs + e);
            const u32 lo = (v & 0x0F0F0F0Fu) | bits4_to_byte_bit4(qh >> e);
            const u32 hi = ((v >> 4) & 0x0F0F0F0Fu) | bits4_to_byte_bit4(qh >> (e + 16));
            sumi = __dp4a((int)lo, q8_1_int(a, 2 * p + i), sumi);
            sumi = __dp4a((int)hi, q8_1_int(a, 4 + 2 * p + i), sumi);
        }
        const float2 ds = q8_1_ds(a);
        const float r = f16f(b->d) * ds.x * (float)sumi;
        return p == 0 ? r + f16f(b->m) * ds.y : r;
    }
};

// Q8_0, 2 units per block: unit p holds elements 16p..16p + 16.
struct mmvq_q8_0_t {
    static constexpr int qk = QK, bytes = 34, upb = 2;
    static constexpr bool a4_ok = false;
    template <bool A4>
    static __device__ __forceinline__ float dot(const u8* w, const block_q8_1* x, int ib, int p) {
        const block_q8_0* b = (const block_q8_0*)w + ib;
        const block_q8_1* a = x + ib;
        int sumi = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int v = (int)ld_u32_a2(b->qs + 16 * p + 4 * i);
            sumi = __dp4a(v, q8_1_int(a, 4 * p + i), sumi);
        }
        return f16f(b->d) * f16f(a->d) * (float)sumi;
    }
};

// Q2_K, 8 units per super-block: unit p (h = p / 4, l0 = 8 * (p % 4)) holds qs[32h + l0..+8],
// that is elements 128h + 32pl + l0..+8 for the four 2-bit planes pl, each within activation
// block 4h + pl and one 16-element scale group (8h + 2pl + l0 / 16).
struct mmvq_q2_K_t {
    static constexpr int qk = QK_K, bytes = 84, upb = 8;
    static constexpr bool a4_ok = true;
    template <bool A4>
    static __device__ __forceinline__ float dot(const u8* w, const block_q8_1* x, int ib, int p) {
        const block_q2_K* b = (const block_q2_K*)w + ib;
        const int h = p >> 2, l0 = 8 * (p & 3);
        const u32 v0 = ld_u32<A4>(b->qs + 32 * h + l0);
        const u32 v1 = ld_u32<A4>(b->qs + 32 * h + l0 + 4);
        const block_q8_1* a = x + 8 * ib + 4 * h;
        float sum_d = 0.0f, sum_m = 0.0f;
#pragma unroll
        for (int pl = 0; pl < 4; ++pl) {
            const int u0 = q8_1_int(a + pl, l0 / 4), u1 = q8_1_int(a + pl, l0 / 4 + 1);
            const int q0 = (int)((v0 >> (2 * pl)) & 0x03030303u);
            const int q1 = (int)((v1 >> (2 * pl)) & 0x03030303u);
            const int sumi = __dp4a(q1, u1, __dp4a(q0, u0, 0));
            const int suma = __dp4a(0x01010101, u1, __dp4a(0x01010101, u0, 0));
            const int sc = b->scales[8 * h + 2 * pl + (l0 >> 4)];
            const float da = f16f(a[pl].d);
            sum_d += da * (float)((sc & 0x0F) * sumi);
            sum_m += da * (float)((sc >> 4) * suma);
        }
        return f16f(b->d) * sum_d - f16f(b->dmin) * sum_m;
    }
};

// Q3_K, 8 units per super-block: unit p (h = p / 4, l0 = 8 * (p % 4)) holds qs[32h + l0..+8]
// and hmask[l0..+8], that is elements 32g + l0..+8 of the four groups g = 4h + pl.
struct mmvq_q3_K_t {
    static constexpr int qk = QK_K, bytes = 110, upb = 8;
    static constexpr bool a4_ok = false;
    template <bool A4>
    static __device__ __forceinline__ float dot(const u8* w, const block_q8_1* x, int ib, int p) {
        const block_q3_K* b = (const block_q3_K*)w + ib;
        const int h = p >> 2, l0 = 8 * (p & 3);
        const u32 v0 = ld_u32_a2(b->qs + 32 * h + l0);
        const u32 v1 = ld_u32_a2(b->qs + 32 * h + l0 + 4);
        const u32 m0 = ld_u32_a2(b->hmask + l0);
        const u32 m1 = ld_u32_a2(b->hmask + l0 + 4);
        const block_q8_1* a = x + 8 * ib + 4 * h;
        float sum = 0.0f;
#pragma unroll
        for (int pl = 0; pl < 4; ++pl) {
            const int g = 4 * h + pl;
            // 2-bit quant | 4 where the high bit is set, minus 4: -4..3 in each byte.
            const u32 q0 = ((v0 >> (2 * pl)) & 0x03030303u) | (((m0 >> g) & 0x01010101u) << 2);
            const u32 q1 = ((v1 >> (2 * pl)) & 0x03030303u) | (((m1 >> g) & 0x01010101u) << 2);
            int sumi = __dp4a(bytes_sub(q0, 0x04040404u), q8_1_int(a + pl, l0 / 4), 0);
            sumi = __dp4a(bytes_sub(q1, 0x04040404u), q8_1_int(a + pl, l0 / 4 + 1), sumi);
            const int sc = q3k_scale(b->scales, 2 * g + (l0 >> 4));
            sum += f16f(a[pl].d) * (float)(sc * sumi);
        }
        return f16f(b->d) * sum;
    }
};

// Q4_K / Q5_K, 8 units per super-block: unit p (c = p / 2, l0 = 16 * (p % 2)) holds
// qs[32c + l0..+16]: elements 64c + l0..+16 (low nibbles, group 2c, activation block 2c) and
// 64c + 32 + l0..+16 (high nibbles, group 2c + 1, activation block 2c + 1). With HAS_QH (Q5_K)
// bit 2c / 2c + 1 of qh[l0..+16] adds 16.
template <bool HAS_QH, bool A4>
__device__ __forceinline__ float vdot_k4(const u8* dm, const u8* scales, const u8* qh,
                                         const u8* qs, const block_q8_1* x, int ib, int p) {
    const int c = p >> 1, l0 = 16 * (p & 1);
    const block_q8_1* alo = x + 8 * ib + 2 * c;
    const block_q8_1* ahi = alo + 1;
    int sumi_lo = 0, sumi_hi = 0, suma_lo = 0, suma_hi = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const u32 v = ld_u32<A4>(qs + 32 * c + l0 + 4 * i);
        u32 lo = v & 0x0F0F0F0Fu;
        u32 hi = (v >> 4) & 0x0F0F0F0Fu;
        if (HAS_QH) {
            const u32 hb = ld_u32<A4>(qh + l0 + 4 * i);
            lo |= ((hb >> (2 * c)) & 0x01010101u) << 4;
            hi |= ((hb >> (2 * c + 1)) & 0x01010101u) << 4;
        }
        const int ulo = q8_1_int(alo, l0 / 4 + i), uhi = q8_1_int(ahi, l0 / 4 + i);
        sumi_lo = __dp4a((int)lo, ulo, sumi_lo);
        sumi_hi = __dp4a((int)hi, uhi, sumi_hi);
        suma_lo = __dp4a(0x01010101, ulo, suma_lo);
        suma_hi = __dp4a(0x01010101, uhi, suma_hi);
    }
    int sc_lo, m_lo, sc_hi, m_hi;
    k4_scale_min(scales, 2 * c, sc_lo, m_lo);
    k4_scale_min(scales, 2 * c + 1, sc_hi, m_hi);
    const float da_lo = f16f(alo->d), da_hi = f16f(ahi->d);
    float2 dmf;
    if (A4) {
        dmf = __half22float2(*(const __half2*)dm);
    } else {
        dmf = make_float2(f16f(((const __half*)dm)[0]), f16f(((const __half*)dm)[1]));
    }
    const float sd = da_lo * (float)(sc_lo * sumi_lo) + da_hi * (float)(sc_hi * sumi_hi);
    const float sm = da_lo * (float)(m_lo * suma_lo) + da_hi * (float)(m_hi * suma_hi);
    return dmf.x * sd - dmf.y * sm;
}

struct mmvq_q4_K_t {
    static constexpr int qk = QK_K, bytes = 144, upb = 8;
    static constexpr bool a4_ok = true;
    template <bool A4>
    static __device__ __forceinline__ float dot(const u8* w, const block_q8_1* x, int ib, int p) {
        const block_q4_K* b = (const block_q4_K*)w + ib;
        return vdot_k4<false, A4>((const u8*)&b->d, b->scales, nullptr, b->qs, x, ib, p);
    }
};

struct mmvq_q5_K_t {
    static constexpr int qk = QK_K, bytes = 176, upb = 8;
    static constexpr bool a4_ok = true;
    template <bool A4>
    static __device__ __forceinline__ float dot(const u8* w, const block_q8_1* x, int ib, int p) {
        const block_q5_K* b = (const block_q5_K*)w + ib;
        return vdot_k4<true, A4>((const u8*)&b->d, b->scales, b->qh, b->qs, x, ib, p);
    }
};

// Q6_K, 8 units per super-block: unit p (h = p / 4, l0 = 8 * (p % 4)) holds ql[64h + l0..+8],
// ql[64h + 32 + l0..+8] and qh[32h + l0..+8], that is elements 128h + 32k + l0..+8 for k = 0..3,
// each within activation block 4h + k and scale group 8h + 2k + l0 / 16.
struct mmvq_q6_K_t {
    static constexpr int qk = QK_K, bytes = 210, upb = 8;
    static constexpr bool a4_ok = false;
    template <bool A4>
    static __device__ __forceinline__ float dot(const u8* w, const block_q8_1* x, int ib, int p) {
        const block_q6_K* b = (const block_q6_K*)w + ib;
        const int h = p >> 2, l0 = 8 * (p & 3);
        const u8* ql = b->ql + 64 * h + l0;
        const u32 la0 = ld_u32_a2(ql), la1 = ld_u32_a2(ql + 4);           // ql[l], k = 0 and 2
        const u32 lb0 = ld_u32_a2(ql + 32), lb1 = ld_u32_a2(ql + 36);     // ql[l + 32], k = 1, 3
        const u32 h0 = ld_u32_a2(b->qh + 32 * h + l0), h1 = ld_u32_a2(b->qh + 32 * h + l0 + 4);
        const block_q8_1* a = x + 8 * ib + 4 * h;
        float sum = 0.0f;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const u32 n0 = k == 0 ? la0 : k == 1 ? lb0 : k == 2 ? la0 >> 4 : lb0 >> 4;
            const u32 n1 = k == 0 ? la1 : k == 1 ? lb1 : k == 2 ? la1 >> 4 : lb1 >> 4;
            const u32 q0 = (n0 & 0x0F0F0F0Fu) | (((h0 >> (2 * k)) & 0x03030303u) << 4);
            const u32 q1 = (n1 & 0x0F0F0F0Fu) | (((h1 >> (2 * k)) & 0x03030303u) << 4);
            int sumi = __dp4a(bytes_sub(q0, 0x20202020u), q8_1_int(a + k, l0 / 4), 0);
            sumi = __dp4a(bytes_sub(q1, 0x20202020u), q8_1_int(a + k, l0 / 4 + 1), sumi);
            const int sc = b->scales[8 * h + 2 * k + (l0 >> 4)];
            sum += f16f(a[k].d) * (float)(sc * sumi);
        }
        return f16f(b->d) * sum;
    }
};

// ---------------------------------------------------------------------------------------------
// The row loop shared by all quantised formats.

template <class T, bool A4>
__device__ __forceinline__ float mmvq_row_sum(const u8* wrow, const block_q8_1* xrow, int units,
                                              int lane) {
    float acc = 0.0f;
#pragma unroll 4
    for (int u = lane; u < units; u += 32) {
        acc += T::template dot<A4>(wrow, xrow, u / T::upb, u % T::upb);
    }
    return acc;
}

template <class T>
__device__ __forceinline__ void mmvq_impl(const void* w, const block_q8_1* x, float* y, int k,
                                          int n, int n_tok) {
    const int row = blockIdx.x * blockDim.y + threadIdx.y;
    const int t = blockIdx.y;
    if (row >= n || t >= n_tok) return; // whole warps leave; no block-wide sync follows
    const int lane = threadIdx.x;
    const int nb = k / T::qk;
    const u8* wrow = (const u8*)w + (i64)row * nb * T::bytes;
    const block_q8_1* xrow = x + (i64)t * (k / QK);
    const int units = nb * T::upb;
    float acc;
    if (T::a4_ok && ((u64)w & 3) == 0) {
        acc = mmvq_row_sum<T, T::a4_ok>(wrow, xrow, units, lane);
    } else {
        acc = mmvq_row_sum<T, false>(wrow, xrow, units, lane);
    }
    acc = warp_sum(acc);
    if (lane == 0) y[(i64)t * n + row] = acc;
}

// launch (every mmvq_* and mmv_* kernel): grid (ceil(n / 4), n_tok, 1), block (32, 4, 1), no
// dynamic shared memory. w: n rows of k / block_size blocks; x: [n_tok, k / 32] block_q8_1;
// y: [n_tok, n] f32. k is a multiple of the block size (32, or 256 for K-quants).
#define MMVQ_KERNEL(name, T)                                                                    \
    extern "C" __global__ void __launch_bounds__(128)                                           \
        name(const void* __restrict__ w, const block_q8_1* __restrict__ x, float* __restrict__ y, \
             int k, int n, int n_tok) {                                                         \
        mmvq_impl<T>(w, x, y, k, n, n_tok);                                                     \
    }

MMVQ_KERNEL(mmvq_q4_0, mmvq_q4_0_t)
MMVQ_KERNEL(mmvq_q4_1, mmvq_q4_1_t)
MMVQ_KERNEL(mmvq_q5_0, mmvq_q5_0_t)
MMVQ_KERNEL(mmvq_q5_1, mmvq_q5_1_t)
MMVQ_KERNEL(mmvq_q8_0, mmvq_q8_0_t)
MMVQ_KERNEL(mmvq_q2_K, mmvq_q2_K_t)
MMVQ_KERNEL(mmvq_q3_K, mmvq_q3_K_t)
MMVQ_KERNEL(mmvq_q4_K, mmvq_q4_K_t)
MMVQ_KERNEL(mmvq_q5_K, mmvq_q5_K_t)
MMVQ_KERNEL(mmvq_q6_K, mmvq_q6_K_t)

// ---------------------------------------------------------------------------------------------
// Float weights with f32 activations: products in f32, summed in f32 per lane, then the warp.

// 8 weights at w[i..i + 8] widened to f32; `vec` means a 16-byte aligned vector load is allowed
// (for f32, two of them).
__device__ __forceinline__ void load8(const float* w, i64 i, bool vec, float* o) {
    if (vec) {
        const float4 a = *(const float4*)(w + i), b = *(const float4*)(w + i + 4);
        o[0] = a.x; o[1] = a.y; o[2] = a.z; o[3] = a.w;
        o[4] = b.x; o[5] = b.y; o[6] = b.z; o[7] = b.w;
    } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) o[j] = w[i + j];
    }
}

__device__ __forceinline__ void load8(const __half* w, i64 i, bool vec, float* o) {
    if (vec) {
        const uint4 r = *(const uint4*)(w + i);
        const u32 words[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            o[2 * j] = __half2float(__ushort_as_half((u16)(words[j] & 0xFFFFu)));
            o[2 * j + 1] = __half2float(__ushort_as_half((u16)(words[j] >> 16)));
        }
    } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) o[j] = __half2float(w[i + j]);
    }
}

__device__ __forceinline__ void load8(const __nv_bfloat16* w, i64 i, bool vec, float* o) {
    if (vec) {
        const uint4 r = *(const uint4*)(w + i);
        const u32 words[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            o[2 * j] = __uint_as_float(words[j] << 16);
            o[2 * j + 1] = __uint_as_float(words[j] & 0xFFFF0000u);
        }
    } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) o[j] = __bfloat162float(w[i + j]);
    }
}

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }

// Lane l takes the 8-element chunks l, l + 32, ... of the row (256 elements per warp step, each
// lane one 16-byte load of f16/bf16 weights), then the k % 8 tail element-wise.
template <class W>
__device__ __forceinline__ void mmv_impl(const W* w, const float* x, float* y, int k, int n,
                                         int n_tok) {
    const int row = blockIdx.x * blockDim.y + threadIdx.y;
    const int t = blockIdx.y;
    if (row >= n || t >= n_tok) return;
    const int lane = threadIdx.x;
    const W* wrow = w + (i64)row * k;
    const float* xrow = x + (i64)t * k;
    // Every row start is 16-byte aligned when the bases are and k is a multiple of 8.
    const bool vec = (((u64)w | (u64)x) & 15) == 0 && (k & 7) == 0;
    const int k8 = k & ~7;
    float acc = 0.0f;
    if (vec) {
#pragma unroll 4
        for (int i = 8 * lane; i < k8; i += 256) {
            float a[8], b[8];
            load8(wrow, i, true, a);
            load8(xrow, i, true, b);
#pragma unroll
            for (int j = 0; j < 8; ++j) acc = fmaf(a[j], b[j], acc);
        }
    } else {
#pragma unroll 4
        for (int i = 8 * lane; i < k8; i += 256) {
            float a[8], b[8];
            load8(wrow, i, false, a);
            load8(xrow, i, false, b);
#pragma unroll
            for (int j = 0; j < 8; ++j) acc = fmaf(a[j], b[j], acc);
        }
    }
    for (int i = k8 + lane; i < k; i += 32) acc = fmaf(to_f32(wrow[i]), xrow[i], acc);
    acc = warp_sum(acc);
    if (lane == 0) y[(i64)t * n + row] = acc;
}

// launch: grid (ceil(n / 4), n_tok, 1), block (32, 4, 1). w: [n, k]; x: [n_tok, k] f32;
// y: [n_tok, n] f32.
extern "C" __global__ void __launch_bounds__(128)
    mmv_f32w(const float* __restrict__ w, const float* __restrict__ x, float* __restrict__ y, int k,
             int n, int n_tok) {
    mmv_impl(w, x, y, k, n, n_tok);
}

// launch: grid (ceil(n / 4), n_tok, 1), block (32, 4, 1).
extern "C" __global__ void __launch_bounds__(128)
    mmv_f16w(const __half* __restrict__ w, const float* __restrict__ x, float* __restrict__ y,
             int k, int n, int n_tok) {
    mmv_impl(w, x, y, k, n, n_tok);
}

// launch: grid (ceil(n / 4), n_tok, 1), block (32, 4, 1).
extern "C" __global__ void __launch_bounds__(128)
    mmv_bf16w(const __nv_bfloat16* __restrict__ w, const float* __restrict__ x,
              float* __restrict__ y, int k, int n, int n_tok) {
    mmv_impl(w, x, y, k, n, n_tok);
}

// mmvq.cu: weight matrix times a few activation vectors, for decode.
//
//   y[t * n + r] = sum_i W[r, i] * act[t, i]      (f32 out; r < n rows, t < n_tok tokens)
//
// Quantised weights (mmvq_<type>) take activations already quantised to Q8_1 by quantize_q8_1
// (x: n_tok rows of k / 32 blocks) and use __dp4a on 32-bit words of packed quants: exact i32
// sums per (sub-)block, then one f32 scale step per block as in src/quant/dot.rs. Unsigned
// quants are re-centred per byte (__vsub4) where the format has an offset (Q4_0, Q5_0, Q3_K,
// Q6_K), so those sums are exact; IQ4_NL / IQ4_XS turn each nibble into its int8 value by byte
// permutes (iq4_values4), exact too; Q4_1 / Q5_1 add m * s with the activation block's s, as
// ggml and dot.rs do; Q2_K / Q4_K / Q5_K take their mins term from exact activation sums (__dp4a
// with 0x01010101) rather than the f16 s. Float weights (mmv_*w) take f32 activations directly.
//
// Memory path (quantised kernels). A thread block is 4 warps, one weight row each, all for one
// token. The row is walked in chunks of T::chunk elements (2048 for the 32-element formats, 4096
// for K-quants and IQ4_XS: 1.1 to 3.4 KB of weights per warp); per chunk
//   1. the 128 threads copy the token's Q8_1 blocks of the chunk into shared memory (coalesced
//      32-bit loads, shared by the 4 rows), split into int8 quants and (d, s) as float2;
//   2. each warp copies its row's weight bytes of the chunk into its own shared buffer with
//      16-byte loads (2-byte loads only for the unaligned head and tail), keeping each byte's
//      address mod 16, so a block's alignment in shared memory is its alignment in global memory;
//   3. each warp computes from shared memory: the chunk's blocks are cut into UPB "units" each
//      (a fixed slice of a block's quants, see each format below); lane l takes units l, l + 32...
// The lane sums meet in one warp reduction at the end. Global memory is thus read once, in full
// 16-byte transactions, whatever the block size; the per-format loads hit shared memory.
//
// Alignment: the weight pointer needs 2-byte alignment only (any GGUF tensor start and any
// cudaMalloc pointer have it). When w is 16-byte (4-byte) aligned, formats whose block size is
// a multiple of 16 (Q4_K, Q5_K) (of 4: Q4_1, Q5_1, Q2_K, IQ4_XS) read their blocks with 16-byte
// (4-byte) shared loads; the choice is made once per thread block. x (Q8_1) must be 4-byte
// aligned, as quantize_q8_1's output in a cudaMalloc buffer is. The float kernels use 16-byte
// loads when w, x and k allow, scalar loads otherwise.

#include "common.cuh"

#define MMVQ_ROWS 4 // warps per thread block, one output row each: blockDim (32, 4)

// ---------------------------------------------------------------------------------------------
// Shared-memory loads of a weight block whose start is AL-byte aligned (2, 4 or 16); callers use
// AL >= 4 only at field offsets that are multiples of 4 (16 for the 16-byte load).

template <int AL>
__device__ __forceinline__ u32 lds_u32(const u8* p) {
    return AL >= 4 ? *(const u32*)p : ld_u32_a2(p);
}

template <int AL>
__device__ __forceinline__ uint4 lds_u128(const u8* p) {
    if (AL >= 16) return *(const uint4*)p;
    return make_uint4(lds_u32<AL>(p), lds_u32<AL>(p + 4), lds_u32<AL>(p + 8), lds_u32<AL>(p + 12));
}

// The f16 at a 2-byte aligned address, widened.
__device__ __forceinline__ float f16_at(const u8* p) {
    return __half2float(*(const __half*)p);
}

// Two f16 at p, p + 2 (p 4-byte aligned when AL >= 4).
template <int AL>
__device__ __forceinline__ float2 f16x2_at(const u8* p) {
    if (AL >= 4) return __half22float2(*(const __half2*)p);
    return make_float2(f16_at(p), f16_at(p + 2));
}

// Staged activation quants: ints i, i + 1 (i even) and ints i..i + 4 (i a multiple of 4) of the
// int8 run starting at aq (16-byte aligned).
__device__ __forceinline__ int2 act2(const i8* aq, int i) {
    return *(const int2*)(aq + 4 * i);
}
__device__ __forceinline__ int4 act4(const i8* aq, int i) {
    return *(const int4*)(aq + 4 * i);
}

// ---------------------------------------------------------------------------------------------
// Per-format unit dot products. dot<AL>(b, aq, ads, p) returns the f32 contribution of unit p of
// the weight block at b (shared memory) with the staged activations of the block's elements:
// aq their int8 quants, ads[j] the (d, s) of their j-th 32-element Q8_1 block.

// Q4_0-layout half-groups. The exact integer dot product of half h of a 32-element group whose
// quants are Q4_0's nibbles, qs[8h..8h + 8] held as words v0, v1 (elements 8h..8h + 8 in their
// low nibbles, 16 + 8h..16 + 8h + 8 in their high ones), with the group's activation quants aq,
// added to sumi. M::map turns four nibbles (one per byte, 0..16) into the four int8 (or, for
// Q4_1, unsigned) factors __dp4a takes.
template <class M>
__device__ __forceinline__ int nib_half_dot(u32 v0, u32 v1, const i8* aq, int h, int sumi) {
    const int2 lo = act2(aq, 2 * h), hi = act2(aq, 4 + 2 * h);
    sumi = __dp4a((int)M::map(v0 & 0x0F0F0F0Fu), lo.x, sumi);
    sumi = __dp4a((int)M::map(v1 & 0x0F0F0F0Fu), lo.y, sumi);
    sumi = __dp4a((int)M::map((v0 >> 4) & 0x0F0F0F0Fu), hi.x, sumi);
    sumi = __dp4a((int)M::map((v1 >> 4) & 0x0F0F0F0Fu), hi.y, sumi);
    return sumi;
}

// (nib_minus8, nib_plain, nib_iq4: common.cuh)

// Q4_0 (M = nib_minus8) and IQ4_NL (M = nib_iq4), 2 units per block: unit p holds qs[8p..8p + 8],
// i.e. elements 8p..8p + 8 (low nibbles) and 16 + 8p..16 + 8p + 8 (high nibbles). Fields: d @0,
// qs @2. Per unit the exact i32 sum, then (d * d_a) * sum in f32.
template <class M>
struct mmvq_d4_t {
    enum : int { qk = QK, bytes = 18, upb = 2, al_max = 2, chunk = 2048 };
    template <int AL>
    static __device__ __forceinline__ float dot(const u8* b, const i8* aq, const float2* ads,
                                                int p) {
        const int sumi = nib_half_dot<M>(ld_u32_a2(b + 2 + 8 * p), ld_u32_a2(b + 6 + 8 * p), aq,
                                         p, 0);
        return f16_at(b) * ads[0].x * (float)sumi;
    }
};
typedef mmvq_d4_t<nib_minus8> mmvq_q4_0_t;
typedef mmvq_d4_t<nib_iq4> mmvq_iq4_nl_t;

// Q4_1, units as Q4_0; unit 0 also adds m * s. Fields: d @0, m @2, qs @4.
struct mmvq_q4_1_t {
    enum : int { qk = QK, bytes = 20, upb = 2, al_max = 4, chunk = 2048 };
    template <int AL>
    static __device__ __forceinline__ float dot(const u8* b, const i8* aq, const float2* ads,
                                                int p) {
        const int sumi = nib_half_dot<nib_plain>(lds_u32<AL>(b + 4 + 8 * p),
                                                 lds_u32<AL>(b + 8 + 8 * p), aq, p, 0);
        const float2 dm = f16x2_at<AL>(b);
        const float2 ds = ads[0];
        const float r = dm.x * ds.x * (float)sumi;
        return p == 0 ? r + dm.y * ds.y : r;
    }
};

// Q5_0, units as Q4_0. Fields: d @0, qh @2, qs @6.
struct mmvq_q5_0_t {
    enum : int { qk = QK, bytes = 22, upb = 2, al_max = 2, chunk = 2048 };
    template <int AL>
    static __device__ __forceinline__ float dot(const u8* b, const i8* aq, const float2* ads,
                                                int p) {
        const u32 qh = ld_u32_a2(b + 2);
        const int2 alo = act2(aq, 2 * p), ahi = act2(aq, 4 + 2 * p);
        u32 lo0, hi0, lo1, hi1;
        q5_words(ld_u32_a2(b + 6 + 8 * p), qh, 8 * p, lo0, hi0);
        q5_words(ld_u32_a2(b + 10 + 8 * p), qh, 8 * p + 4, lo1, hi1);
        int sumi = __dp4a(bytes_sub(lo0, 0x10101010u), alo.x, 0);
        sumi = __dp4a(bytes_sub(lo1, 0x10101010u), alo.y, sumi);
        sumi = __dp4a(bytes_sub(hi0, 0x10101010u), ahi.x, sumi);
        sumi = __dp4a(bytes_sub(hi1, 0x10101010u), ahi.y, sumi);
        return f16_at(b) * ads[0].x * (float)sumi;
    }
};

// Q5_1, units as Q4_0; unit 0 also adds m * s. Fields: d @0, m @2, qh @4, qs @8.
struct mmvq_q5_1_t {
    enum : int { qk = QK, bytes = 24, upb = 2, al_max = 4, chunk = 2048 };
    template <int AL>
    static __device__ __forceinline__ float dot(const u8* b, const i8* aq, const float2* ads,
                                                int p) {
        const u32 qh = lds_u32<AL>(b + 4);
        const int2 alo = act2(aq, 2 * p), ahi = act2(aq, 4 + 2 * p);
        u32 lo0, hi0, lo1, hi1;
        q5_words(lds_u32<AL>(b + 8 + 8 * p), qh, 8 * p, lo0, hi0);
        q5_words(lds_u32<AL>(b + 12 + 8 * p), qh, 8 * p + 4, lo1, hi1);
        int sumi = __dp4a((int)lo0, alo.x, 0);
        sumi = __dp4a((int)lo1, alo.y, sumi);
        sumi = __dp4a((int)hi0, ahi.x, sumi);
        sumi = __dp4a((int)hi1, ahi.y, sumi);
        const float2 dm = f16x2_at<AL>(b);
        const float2 ds = ads[0];
        const float r = dm.x * ds.x * (float)sumi;
        return p == 0 ? r + dm.y * ds.y : r;
    }
};

// Q8_0, 2 units per block: unit p holds elements 16p..16p + 16. Fields: d @0, qs @2.
struct mmvq_q8_0_t {
    enum : int { qk = QK, bytes = 34, upb = 2, al_max = 2, chunk = 2048 };
    template <int AL>
    static __device__ __forceinline__ float dot(const u8* b, const i8* aq, const float2* ads,
                                                int p) {
        const u8* q = b + 2 + 16 * p;
        const int4 a = act4(aq, 4 * p);
        int sumi = __dp4a((int)ld_u32_a2(q), a.x, 0);
        sumi = __dp4a((int)ld_u32_a2(q + 4), a.y, sumi);
        sumi = __dp4a((int)ld_u32_a2(q + 8), a.z, sumi);
        sumi = __dp4a((int)ld_u32_a2(q + 12), a.w, sumi);
        return f16_at(b) * ads[0].x * (float)sumi;
    }
};

// Q2_K, 8 units per super-block: unit p (h = p / 4, l0 = 8 * (p % 4)) holds qs[32h + l0..+8],
// that is elements 128h + 32pl + l0..+8 for the four 2-bit planes pl, each within activation
// block 4h + pl and scale group 8h + 2pl + l0 / 16. Fields: scales @0, qs @16, d @80, dmin @82.
struct mmvq_q2_K_t {
    enum : int { qk = QK_K, bytes = 84, upb = 8, al_max = 4, chunk = 4096 };
    template <int AL>
    static __device__ __forceinline__ float dot(const u8* b, const i8* aq, const float2* ads,
                                                int p) {
        const int h = p >> 2, l0 = 8 * (p & 3);
        const u32 v0 = lds_u32<AL>(b + 16 + 32 * h + l0), v1 = lds_u32<AL>(b + 20 + 32 * h + l0);
        // scales[8h..8h + 8]: plane pl takes byte 2pl + l0 / 16.
        const u32 s0 = lds_u32<AL>(b + 8 * h), s1 = lds_u32<AL>(b + 8 * h + 4);
        const int sh = 8 * (l0 >> 4);
        float sum_d = 0.0f, sum_m = 0.0f;
#pragma unroll
        for (int pl = 0; pl < 4; ++pl) {
            const int2 a = act2(aq + 32 * (4 * h + pl), l0 / 4);
            const int q0 = (int)((v0 >> (2 * pl)) & 0x03030303u);
            const int q1 = (int)((v1 >> (2 * pl)) & 0x03030303u);
            const int sumi = __dp4a(q1, a.y, __dp4a(q0, a.x, 0));
            const int suma = __dp4a(0x01010101, a.y, __dp4a(0x01010101, a.x, 0));
            const int sc = (int)((((pl < 2 ? s0 : s1) >> (16 * (pl & 1))) >> sh) & 0xFFu);
            const float da = ads[4 * h + pl].x;
            sum_d += da * (float)((sc & 0x0F) * sumi);
            sum_m += da * (float)((sc >> 4) * suma);
        }
        const float2 dm = f16x2_at<AL>(b + 80);
        return dm.x * sum_d - dm.y * sum_m;
    }
};

// Q3_K, 8 units per super-block: unit p (h = p / 4, l0 = 8 * (p % 4)) holds qs[32h + l0..+8]
// and hmask[l0..+8], that is elements 32g + l0..+8 of the four groups g = 4h + pl.
// Fields: hmask @0, qs @32, scales @96, d @108.
struct mmvq_q3_K_t {
    enum : int { qk = QK_K, bytes = 110, upb = 8, al_max = 2, chunk = 4096 };
    template <int AL>
    static __device__ __forceinline__ float dot(const u8* b, const i8* aq, const float2* ads,
                                                int p) {
        const int h = p >> 2, l0 = 8 * (p & 3);
        const u32 v0 = ld_u32_a2(b + 32 + 32 * h + l0), v1 = ld_u32_a2(b + 36 + 32 * h + l0);
        const u32 m0 = ld_u32_a2(b + l0), m1 = ld_u32_a2(b + 4 + l0);
        float sum = 0.0f;
#pragma unroll
        for (int pl = 0; pl < 4; ++pl) {
            const int g = 4 * h + pl;
            const int2 a = act2(aq + 32 * g, l0 / 4);
            // 2-bit quant | 4 where the high bit is set, minus 4: -4..3 in each byte.
            const u32 q0 = ((v0 >> (2 * pl)) & 0x03030303u) | (((m0 >> g) & 0x01010101u) << 2);
            const u32 q1 = ((v1 >> (2 * pl)) & 0x03030303u) | (((m1 >> g) & 0x01010101u) << 2);
            int sumi = __dp4a(bytes_sub(q0, 0x04040404u), a.x, 0);
            sumi = __dp4a(bytes_sub(q1, 0x04040404u), a.y, sumi);
            const int sc = q3k_scale(b + 96, 2 * g + (l0 >> 4));
            sum += ads[g].x * (float)(sc * sumi);
        }
        return f16_at(b + 108) * sum;
    }
};

// Q4_K / Q5_K, 8 units per super-block (k4_unit_dot in common.cuh: the unit's loads are here).
// Fields: d @0, dmin @2, scales @4, then Q4_K: qs @16; Q5_K: qh @16, qs @48.
template <bool HAS_QH, int AL>
__device__ __forceinline__ float vdot_k4(const u8* b, const i8* aq, const float2* ads, int p) {
    const int c = p >> 1, l0 = 16 * (p & 1);
    const uint4 head = lds_u128<AL>(b); // d, dmin | scales[0..4] | scales[4..8] | scales[8..12]
    const uint4 v = lds_u128<AL>(b + (HAS_QH ? 48 : 16) + 32 * c + l0);
    const uint4 hv = HAS_QH ? lds_u128<AL>(b + 16 + l0) : make_uint4(0, 0, 0, 0);
    return k4_unit_dot<HAS_QH>(head, v, hv, aq + 64 * c + l0, ads + 2 * c, p);
}

struct mmvq_q4_K_t {
    enum : int { qk = QK_K, bytes = 144, upb = 8, al_max = 16, chunk = 4096 };
    template <int AL>
    static __device__ __forceinline__ float dot(const u8* b, const i8* aq, const float2* ads,
                                                int p) {
        return vdot_k4<false, AL>(b, aq, ads, p);
    }
};

struct mmvq_q5_K_t {
    enum : int { qk = QK_K, bytes = 176, upb = 8, al_max = 16, chunk = 4096 };
    template <int AL>
    static __device__ __forceinline__ float dot(const u8* b, const i8* aq, const float2* ads,
                                                int p) {
        return vdot_k4<true, AL>(b, aq, ads, p);
    }
};

// Q6_K, 8 units per super-block (q6k_unit_sum in common.cuh: the unit's loads are here).
// Fields: ql @0, qh @128, scales @192, d @208.
struct mmvq_q6_K_t {
    enum : int { qk = QK_K, bytes = 210, upb = 8, al_max = 2, chunk = 4096 };
    template <int AL>
    static __device__ __forceinline__ float dot(const u8* b, const i8* aq, const float2* ads,
                                                int p) {
        const int h = p >> 2, l0 = 8 * (p & 3);
        const u8* ql = b + 64 * h + l0;
        const i8* s = (const i8*)b + 192 + 8 * h + (l0 >> 4);
        const int sc[4] = {s[0], s[2], s[4], s[6]};
        const float sum = q6k_unit_sum(ld_u32_a2(ql), ld_u32_a2(ql + 4), ld_u32_a2(ql + 32),
                                       ld_u32_a2(ql + 36), ld_u32_a2(b + 128 + 32 * h + l0),
                                       ld_u32_a2(b + 132 + 32 * h + l0), sc, aq + l0, ads, h);
        return f16_at(b + 208) * sum;
    }
};

// IQ4_XS, 8 units per super-block: unit p is group p, qs[16p..16p + 16] (an IQ4_NL block's
// quants: both halves of nib_half_dot), activation block p, scale ls_p - 32 (iq4xs_scale).
// Fields: d @0, scales_h @2, scales_l @4, qs @8. Per unit the exact i32 sum, then the exact i32
// (ls_p - 32) * sum (|.| <= 32 * 32 * 127 * 128 < 2^24), then d * (d_a * that) in f32: Q3_K's and
// Q6_K's order, one group per unit.
struct mmvq_iq4_xs_t {
    enum : int { qk = QK_K, bytes = 136, upb = 8, al_max = 4, chunk = 4096 };
    template <int AL>
    static __device__ __forceinline__ float dot(const u8* b, const i8* aq, const float2* ads,
                                                int p) {
        const u32 head = lds_u32<AL>(b); // d | scales_h << 16
        const u8* q = b + 8 + 16 * p;
        const i8* a = aq + 32 * p;
        int sumi = nib_half_dot<nib_iq4>(lds_u32<AL>(q), lds_u32<AL>(q + 4), a, 0, 0);
        sumi = nib_half_dot<nib_iq4>(lds_u32<AL>(q + 8), lds_u32<AL>(q + 12), a, 1, sumi);
        const int sc = iq4xs_scale(head >> 16, lds_u32<AL>(b + 4), p);
        const float d = __half2float(__ushort_as_half((u16)(head & 0xFFFFu)));
        return d * (ads[p].x * (float)(sc * sumi));
    }
};

// ---------------------------------------------------------------------------------------------
// Staging and the row loop shared by all quantised formats.

// Copy the n bytes at global `src` (2-byte aligned, n even) into `dst` (16-byte aligned shared
// memory, n + 16 bytes) at offset src % 16, which is returned: byte src + i lands at
// dst + off + i. The 16-byte aligned middle goes by 16-byte loads, the head and tail (under 16
// bytes each) by 2-byte loads, all by __ldg (read-only global loads: the addresses, rebuilt from
// integers, would otherwise compile to generic ones); nothing outside [src, src + n) is read.
// Called by a whole warp.
// How stage_bytes (and the pipelined kernels' loads) cut [src, src + n): offsets from base, the
// 16-byte aligned address at or below src, which stands for the buffer's first byte.
struct byte_span {
    u64 base;
    int off;    // src's offset (src % 16)
    int mid_at; // the aligned middle's offset
    int n16;    // 16-byte words in the middle
    int ht_at;  // this lane's head or tail u16 offset, -1 for none (lanes 0-7 head, 8-15 tail)
};

__device__ __forceinline__ byte_span span_of(const u8* src, int n, int lane) {
    const u64 s = (u64)src, e = s + (u64)n;
    const u64 base = s & ~(u64)15;
    const u64 up = (s + 15) & ~(u64)15, down = e & ~(u64)15;
    const u64 head_end = up < e ? up : e;
    const u64 tail_beg = down > head_end ? down : head_end;
    const u64 g = lane < 8 ? s + 2 * lane : tail_beg + 2 * (lane - 8);
    const bool ht = lane < 8 ? g < head_end : lane < 16 && g < e;
    return {base, (int)(s - base), (int)(head_end - base), (int)((tail_beg - head_end) >> 4),
            ht ? (int)(g - base) : -1};
}

__device__ __forceinline__ int stage_bytes(u8* dst, const u8* src, int n, int lane) {
    const byte_span sp = span_of(src, n, lane);
    if (sp.ht_at >= 0) *(u16*)(dst + sp.ht_at) = __ldg((const u16*)(sp.base + sp.ht_at));
    const uint4* s16 = (const uint4*)(sp.base + sp.mid_at);
    uint4* d16 = (uint4*)(dst + sp.mid_at);
#pragma unroll 4
    for (int i = lane; i < sp.n16; i += 32) d16[i] = __ldg(s16 + i);
    return sp.off;
}

// stage_bytes with every load of the lane out before its first store; MAXW: the most 16-byte
// words a lane copies (n <= 16 * 32 * MAXW). The loop above waits for each word in turn where its
// trip count is under its unrolling's 4: Q4_0, Q4_1, Q5_0, Q5_1 and IQ4_NL chunks (1.1-1.5 KB,
// 3 words a lane) went in its branchy remainder, one round trip a word; those take this. (Q8_0
// and the K-quants, 4.25-6.6 words a lane, keep the loop, whose unrolled body holds four loads
// together: batched, their kernels went from 48-64 registers to 95-136 on sm_90, half the thread
// blocks a multiprocessor.)
template <int MAXW>
__device__ __forceinline__ int stage_bytes_batched(u8* dst, const u8* src, int n, int lane) {
    const byte_span sp = span_of(src, n, lane);
    const uint4* s16 = (const uint4*)(sp.base + sp.mid_at);
    uint4* d16 = (uint4*)(dst + sp.mid_at);
    const u16 ht = sp.ht_at >= 0 ? __ldg((const u16*)(sp.base + sp.ht_at)) : (u16)0;
    uint4 w[MAXW];
#pragma unroll
    for (int j = 0; j < MAXW; ++j) {
        if (lane + 32 * j < sp.n16) w[j] = __ldg(s16 + lane + 32 * j);
    }
    if (sp.ht_at >= 0) *(u16*)(dst + sp.ht_at) = ht;
#pragma unroll
    for (int j = 0; j < MAXW; ++j) {
        if (lane + 32 * j < sp.n16) d16[lane + 32 * j] = w[j];
    }
    return sp.off;
}

// The alignment (2, 4 or 16) at which format T's blocks are read from a weight at w (in global
// and so in shared memory): one choice per thread block, among the A4 / A16 its callers dispatch
// on.
template <class T>
__device__ __forceinline__ int block_align(const void* w) {
    constexpr int A4 = T::al_max >= 4 ? 4 : 2, A16 = T::al_max >= 16 ? 16 : A4;
    return ((u64)w & 15) == 0 ? A16 : ((u64)w & 3) == 0 ? A4 : 2;
}

// Word i of a run of Q8_1 blocks (block i / 9: its (d, s), then 8 words of quants) into the
// staged activations: (d, s) widened into sads, the quants into saq (16-byte aligned).
__device__ __forceinline__ void stage_act_word(u32 v, int i, i8* saq, float2* sads) {
    const int blk = i / 9, j = i - 9 * blk;
    if (j == 0) {
        sads[blk] = make_float2(__half2float(__ushort_as_half((u16)(v & 0xFFFFu))),
                                __half2float(__ushort_as_half((u16)(v >> 16))));
    } else {
        ((u32*)saq)[8 * blk + j - 1] = v;
    }
}

template <class T, int AL>
__device__ __forceinline__ float mmvq_chunk(const u8* wb, const i8* aq, const float2* ads,
                                            int nbc, int lane) {
    float acc = 0.0f;
    const int units = nbc * T::upb;
#pragma unroll 2
    for (int u = lane; u < units; u += 32) {
        const int ib = u / T::upb, p = u % T::upb;
        acc += T::template dot<AL>(wb + ib * T::bytes, aq + ib * T::qk, ads + ib * (T::qk / QK),
                                   p);
    }
    return acc;
}

// Size of a warp's weight buffer: a chunk's blocks plus room for the offset src % 16.
#define MMVQ_WBUF(T) ((T::bytes * (T::chunk / T::qk) + 31) / 16 * 16)

// Row block rb (of MMVQ_ROWS rows) of the product, token blockIdx.y.
template <class T>
__device__ __forceinline__ void mmvq_impl(const void* w, const block_q8_1* x, float* y, int k,
                                          int n, int n_tok, int rb) {
    __shared__ __align__(16) i8 s_aq[T::chunk];          // staged activation quants
    __shared__ __align__(16) float2 s_ads[T::chunk / QK]; // their (d, s)
    __shared__ __align__(16) u8 s_w[MMVQ_ROWS][MMVQ_WBUF(T)];

    const int t = blockIdx.y;
    if (t >= n_tok || blockDim.x != 32 || blockDim.y != MMVQ_ROWS) return; // whole block
    const int lane = threadIdx.x, warp = threadIdx.y;
    const int tid = warp * 32 + lane;
    const int row = rb * MMVQ_ROWS + warp;
    const bool active = row < n; // rows past n only help stage the activations
    const int nb = k / T::qk;
    const int k_used = nb * T::qk;
    const u8* wrow = (const u8*)w + (i64)row * nb * T::bytes;
    const u32* xw = (const u32*)(x + (i64)t * (k / QK));
    constexpr int A4 = T::al_max >= 4 ? 4 : 2, A16 = T::al_max >= 16 ? 16 : A4;
    const int al = block_align<T>(w);

    // Activation words a thread stages a chunk, at most.
    constexpr int AW = (9 * (T::chunk / QK) + 32 * MMVQ_ROWS - 1) / (32 * MMVQ_ROWS);
    float acc = 0.0f;
    for (int c0 = 0; c0 < k_used; c0 += T::chunk) {
        const int ne = min((int)T::chunk, k_used - c0);
        const int nbc = ne / T::qk;
        // 1. Activations: Q8_1 block j is 9 words, (d, s) then 8 words of quants. All of this
        //    thread's loads go out before the weights' and before any store (a loop of load,
        //    then store, waited for each word in turn: about 5 round trips a chunk).
        const u32* xs = xw + (c0 / QK) * 9;
        const int nw = 9 * (ne / QK);
        u32 aw[AW];
#pragma unroll
        for (int j = 0; j < AW; ++j) {
            const int i = tid + 32 * MMVQ_ROWS * j;
            if (i < nw) aw[j] = __ldg(xs + i);
        }
        // 2. This warp's weight bytes.
        int off = 0;
        if (active) {
            const u8* src = wrow + (i64)(c0 / T::qk) * T::bytes;
            // 16-byte words a lane copies, at most.
            constexpr int MAXW = (T::bytes * (T::chunk / T::qk) / 16 + 31) / 32;
            if constexpr (MAXW < 4) {
                off = stage_bytes_batched<MAXW>(s_w[warp], src, nbc * T::bytes, lane);
            } else {
                off = stage_bytes(s_w[warp], src, nbc * T::bytes, lane);
            }
        }
#pragma unroll
        for (int j = 0; j < AW; ++j) {
            const int i = tid + 32 * MMVQ_ROWS * j;
            if (i < nw) stage_act_word(aw[j], i, s_aq, s_ads);
        }
        __syncthreads();
        // 3. Dot products from shared memory.
        if (active) {
            const u8* wb = s_w[warp] + off;
            if (al == 16) {
                acc += mmvq_chunk<T, A16>(wb, s_aq, s_ads, nbc, lane);
            } else if (al == 4) {
                acc += mmvq_chunk<T, A4>(wb, s_aq, s_ads, nbc, lane);
            } else {
                acc += mmvq_chunk<T, 2>(wb, s_aq, s_ads, nbc, lane);
            }
        }
        __syncthreads();
    }
    if (active) {
        acc = warp_sum(acc);
        if (lane == 0) y[(i64)t * n + row] = acc;
    }
}

// launch (every mmvq_* kernel): grid (ceil(n / 4), n_tok, 1), block (32, 4, 1) exactly, no
// dynamic shared memory (static: the staged activations, 2.5 KB or 5 KB, plus 4 x a chunk's
// weight bytes; 7.2 KB for Q4_0 up to 18.2 KB for Q6_K).
// w: n rows of k / block_size blocks; x: [n_tok, k / 32] block_q8_1; y: [n_tok, n] f32.
// k is a multiple of the block size (32, or 256 for K-quants and IQ4_XS).
#define MMVQ_KERNEL(name, T)                                                                    \
    extern "C" __global__ void __launch_bounds__(128)                                           \
        name(const void* __restrict__ w, const block_q8_1* __restrict__ x, float* __restrict__ y, \
             int k, int n, int n_tok) {                                                         \
        mmvq_impl<T>(w, x, y, k, n, n_tok, blockIdx.x);                                         \
    }

// Where row block rb of up to three weights lies (their row blocks numbered w0's, w1's, w2's;
// n0 and n1 multiples of MMVQ_ROWS): weight pointer, output, rows, and the row block's index
// within its weight.
struct multi_row {
    const u8* w;
    float* y;
    int n, rb;
};

__device__ __forceinline__ multi_row multi_locate(const void* w0, const void* w1, const void* w2,
                                                  float* y0, float* y1, float* y2, int n0, int n1,
                                                  int n2, int rb) {
    const int b0 = n0 / MMVQ_ROWS, b1 = n1 / MMVQ_ROWS;
    if (rb < b0) return {(const u8*)w0, y0, n0, rb};
    if (rb < b0 + b1) return {(const u8*)w1, y1, n1, rb - b0};
    return {(const u8*)w2, y2, n2, rb - b0 - b1};
}

// Two or three weights that read one activation (q, k and v; gate and up) in one launch: the
// grid's row blocks are the first weight's, then the second's, then the third's, each computed
// exactly as its own mmvq_<type> launch computes it (the same thread block, bit for bit). n0 and
// n1 are multiples of MMVQ_ROWS, so no thread block straddles two weights; n1 may be 0 (two
// weights: w1 and y1 are then not read).
// launch: grid (n0 / 4 + n1 / 4 + ceil(n2 / 4), n_tok, 1), block (32, 4, 1) exactly; each wi, yi
// as mmvq_<type>'s w, y with ni rows.
#define MMVQ_MULTI_KERNEL(name, T)                                                              \
    extern "C" __global__ void __launch_bounds__(128)                                           \
        name(const void* __restrict__ w0, const void* __restrict__ w1,                          \
             const void* __restrict__ w2, const block_q8_1* __restrict__ x,                     \
             float* __restrict__ y0, float* __restrict__ y1, float* __restrict__ y2, int k,     \
             int n0, int n1, int n2, int n_tok) {                                               \
        /* The same choice for the whole thread block. */                                      \
        const multi_row r = multi_locate(w0, w1, w2, y0, y1, y2, n0, n1, n2, (int)blockIdx.x); \
        mmvq_impl<T>(r.w, x, r.y, k, r.n, n_tok, r.rb);                                         \
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
MMVQ_KERNEL(mmvq_iq4_nl, mmvq_iq4_nl_t)
MMVQ_KERNEL(mmvq_iq4_xs, mmvq_iq4_xs_t)

MMVQ_MULTI_KERNEL(mmvq_multi_q4_0, mmvq_q4_0_t)
MMVQ_MULTI_KERNEL(mmvq_multi_q4_1, mmvq_q4_1_t)
MMVQ_MULTI_KERNEL(mmvq_multi_q5_0, mmvq_q5_0_t)
MMVQ_MULTI_KERNEL(mmvq_multi_q5_1, mmvq_q5_1_t)
MMVQ_MULTI_KERNEL(mmvq_multi_q8_0, mmvq_q8_0_t)
MMVQ_MULTI_KERNEL(mmvq_multi_q2_K, mmvq_q2_K_t)
MMVQ_MULTI_KERNEL(mmvq_multi_q3_K, mmvq_q3_K_t)
MMVQ_MULTI_KERNEL(mmvq_multi_q4_K, mmvq_q4_K_t)
MMVQ_MULTI_KERNEL(mmvq_multi_q5_K, mmvq_q5_K_t)
MMVQ_MULTI_KERNEL(mmvq_multi_q6_K, mmvq_q6_K_t)
MMVQ_MULTI_KERNEL(mmvq_multi_iq4_nl, mmvq_iq4_nl_t)
MMVQ_MULTI_KERNEL(mmvq_multi_iq4_xs, mmvq_iq4_xs_t)

// ---------------------------------------------------------------------------------------------
// Pipelined variant (mmvq_pipe_<type>): the staged kernel's work and sums, bit for bit, with the
// global loads of the next piece of work in flight while the current one is computed.
//
// The staged kernel above copies a chunk into shared memory, waits for it (__syncthreads), then
// computes it, so a thread block's loads and its arithmetic never overlap, and a small matrix
// (4096 x 4096 Q4_0: 1024 thread blocks, two 1.1 KB chunks per warp) spends two memory round
// trips in a row per block. Here
//   - an "item" is one row block's (4 rows') next T::chunk * pipe_t<T>::cpi elements (4096 for
//     every format: two chunks of the 32-element formats, one of the K-quants), for one token;
//   - each thread block walks the row blocks blockIdx.x, blockIdx.x + gridDim.x, ... (a grid of
//     a few blocks per multiprocessor, set by the host), item after item; the row blocks are
//     those of up to three weights that share the input (mmvq_multi's numbering: w0's, w1's,
//     w2's; a single weight is w2 with n0 = n1 = 0);
//   - a thread first loads its share of item i + 1 into registers (each warp its row's weight
//     bytes as stage_bytes reads them: 16-byte loads for the aligned middle, 2-byte loads for
//     the head and tail; the block the item's Q8_1 activation words; all by __ldg), then
//     computes item i from shared memory, then stores the registers into the other of two
//     shared buffers; one __syncthreads per item (a buffer is rewritten two items later, after
//     every warp has passed the barrier that follows its last use).
// Each row's chunks are summed exactly as mmvq_impl sums them (per chunk the lanes' units in
// order from 0.0f, added to the row's sum chunk by chunk; then warp_sum), so y is the staged
// kernel's, bit for bit.

template <class T>
struct pipe_t {
    enum : int {
        cpi = T::qk == QK ? 2 : 1,                 // chunks per item
        item = T::chunk * cpi,                     // elements per item
        wbytes = T::bytes * (item / T::qk),        // a row's weight bytes per item
        wbuf = (wbytes + 31) / 16 * 16,            // with room for the offset src % 16
        u = (wbytes / 16 + 31) / 32,               // 16-byte loads per lane (the middle)
        aw = (9 * (item / QK) + 32 * MMVQ_ROWS - 1) / (32 * MMVQ_ROWS), // activation words
                                                                       // per thread
    };
};

// One thread's share of an item, in registers between its loads and its store to shared memory.
template <class T>
struct pipe_regs {
    uint4 w[pipe_t<T>::u]; // the middle of the warp's row bytes: 16-byte word lane + 32 j
    u32 a[pipe_t<T>::aw];  // activation words tid + 128 j of the item's Q8_1 blocks
    u32 ht;                // one 2-byte piece of the row's head (lanes 0..7) or tail (8..15)
    int ht_at;             // its offset in the warp's buffer, or -1
    int mid_at;            // offset of the middle's first 16-byte word in the buffer
    int n16;               // 16-byte words in the middle
    int off;               // the row's first byte's offset in the buffer (src % 16)
    int nbc;               // weight blocks in the item
    int ne;                // elements in the item
    int al;                // alignment of the weight's blocks (16, 4 or 2)
    bool active;           // the warp's row exists
};

// Issues the loads of item c (element c * item) of row block `r` for token t into `p`.
template <class T>
__device__ __forceinline__ void pipe_load(pipe_regs<T>& p, const multi_row& r, const u32* xw,
                                          int k_used, int c, int lane, int warp, int tid) {
    typedef pipe_t<T> P;
    const int c0 = c * P::item;
    p.ne = min((int)P::item, k_used - c0);
    p.nbc = p.ne / T::qk;
    const int row = r.rb * MMVQ_ROWS + warp;
    p.active = row < r.n;
    p.al = block_align<T>(r.w);
    p.ht_at = -1;
    p.n16 = 0;
    p.off = 0;
    p.mid_at = 0;
    if (p.active) {
        const int nb = k_used / T::qk;
        const u8* src = r.w + ((i64)row * nb + c0 / T::qk) * T::bytes;
        const byte_span sp = span_of(src, p.nbc * T::bytes, lane);
        if (sp.ht_at >= 0) p.ht = __ldg((const u16*)(sp.base + sp.ht_at));
        p.ht_at = sp.ht_at;
        p.n16 = sp.n16;
        p.mid_at = sp.mid_at;
        p.off = sp.off;
        const uint4* s16 = (const uint4*)(sp.base + sp.mid_at);
#pragma unroll
        for (int j = 0; j < P::u; ++j) {
            const int i = lane + 32 * j;
            if (i < p.n16) p.w[j] = __ldg(s16 + i);
        }
    }
    const u32* xs = xw + (c0 / QK) * 9;
    const int nw = 9 * (p.ne / QK);
#pragma unroll
    for (int j = 0; j < P::aw; ++j) {
        const int i = tid + 32 * MMVQ_ROWS * j;
        if (i < nw) p.a[j] = __ldg(xs + i);
    }
}

// Stores `p` into buffer set `buf`: the warp's weight bytes at sw (offset p.off for the row's
// first byte) and the activations, split into quants and (d, s), as mmvq_impl stages them.
template <class T>
__device__ __forceinline__ void pipe_store(const pipe_regs<T>& p, u8* sw, i8* saq, float2* sads,
                                           int lane, int tid) {
    typedef pipe_t<T> P;
    if (p.active) {
        if (p.ht_at >= 0) *(u16*)(sw + p.ht_at) = (u16)p.ht;
        uint4* d16 = (uint4*)(sw + p.mid_at);
#pragma unroll
        for (int j = 0; j < P::u; ++j) {
            const int i = lane + 32 * j;
            if (i < p.n16) d16[i] = p.w[j];
        }
    }
    const int nw = 9 * (p.ne / QK);
#pragma unroll
    for (int j = 0; j < P::aw; ++j) {
        const int i = tid + 32 * MMVQ_ROWS * j;
        if (i < nw) stage_act_word(p.a[j], i, saq, sads);
    }
}

// The item's chunks from shared memory, added to the row's sum as mmvq_impl adds them.
template <class T, int AL>
__device__ __forceinline__ float pipe_item(const u8* wb, const i8* saq, const float2* sads,
                                           int nbc, int lane, float acc) {
    constexpr int cb = T::chunk / T::qk; // blocks per chunk
#pragma unroll
    for (int cc = 0; cc < pipe_t<T>::cpi; ++cc) {
        const int nb = min(cb, nbc - cc * cb);
        if (nb > 0) {
            acc += mmvq_chunk<T, AL>(wb + cc * cb * T::bytes, saq + cc * T::chunk,
                                     sads + cc * (T::chunk / QK), nb, lane);
        }
    }
    return acc;
}

template <class T>
__device__ __forceinline__ void mmvq_pipe_impl(const void* w0, const void* w1, const void* w2,
                                               const block_q8_1* x, float* y0, float* y1,
                                               float* y2, int k, int n0, int n1, int n2,
                                               int n_tok) {
    typedef pipe_t<T> P;
    __shared__ __align__(16) i8 s_aq[2][P::item];
    __shared__ __align__(16) float2 s_ads[2][P::item / QK];
    __shared__ __align__(16) u8 s_w[2][MMVQ_ROWS][P::wbuf];

    const int t = blockIdx.y;
    if (t >= n_tok || blockDim.x != 32 || blockDim.y != MMVQ_ROWS) return; // whole block
    const int lane = threadIdx.x, warp = threadIdx.y;
    const int tid = warp * 32 + lane;
    const int k_used = k / T::qk * T::qk;
    const int items = (k_used + P::item - 1) / P::item; // per row block
    const int n_rb = n0 / MMVQ_ROWS + n1 / MMVQ_ROWS + (n2 + MMVQ_ROWS - 1) / MMVQ_ROWS;
    const int b0 = (int)blockIdx.x, nb_grid = (int)gridDim.x;
    const int mine = b0 < n_rb ? (n_rb - 1 - b0) / nb_grid + 1 : 0;
    const int count = mine * items;
    if (count == 0) return; // whole block
    const u32* xw = (const u32*)(x + (i64)t * (k / QK));

    pipe_regs<T> p;
    multi_row r = multi_locate(w0, w1, w2, y0, y1, y2, n0, n1, n2, b0);
    pipe_load<T>(p, r, xw, k_used, 0, lane, warp, tid);
    pipe_store<T>(p, s_w[0][warp], s_aq[0], s_ads[0], lane, tid);
    float acc = 0.0f;
    for (int it = 0; it < count; ++it) {
        const int buf = it & 1;
        const int c = it % items;
        const multi_row cur = r;
        const int off = p.off, nbc = p.nbc, al = p.al;
        const bool active = p.active;
        __syncthreads();
        // The next item's loads, in flight during this item's arithmetic.
        if (it + 1 < count) {
            if (c + 1 == items) {
                r = multi_locate(w0, w1, w2, y0, y1, y2, n0, n1, n2,
                                b0 + (it + 1) / items * nb_grid);
            }
            pipe_load<T>(p, r, xw, k_used, (it + 1) % items, lane, warp, tid);
        }
        if (active) {
            const u8* wb = s_w[buf][warp] + off;
            if (al == 16) {
                acc = pipe_item<T, (T::al_max >= 16 ? 16 : T::al_max >= 4 ? 4 : 2)>(
                    wb, s_aq[buf], s_ads[buf], nbc, lane, acc);
            } else if (al == 4) {
                acc = pipe_item<T, (T::al_max >= 4 ? 4 : 2)>(wb, s_aq[buf], s_ads[buf], nbc,
                                                             lane, acc);
            } else {
                acc = pipe_item<T, 2>(wb, s_aq[buf], s_ads[buf], nbc, lane, acc);
            }
            if (c + 1 == items) {
                acc = warp_sum(acc);
                if (lane == 0) cur.y[(i64)t * cur.n + cur.rb * MMVQ_ROWS + warp] = acc;
                acc = 0.0f;
            }
        }
        if (it + 1 < count) {
            pipe_store<T>(p, s_w[buf ^ 1][warp], s_aq[buf ^ 1], s_ads[buf ^ 1], lane, tid);
        }
    }
}

// Thread blocks a multiprocessor should hold at once: ptxas keeps the kernels to 96 registers
// (sm_90: 92-96, Q8_0 and Q6_K spilling 12 and 20 bytes; without the bound 120-128 registers, 4
// blocks). The host's default grid is this many blocks per multiprocessor.
#define MMVQ_PIPE_MIN_BLOCKS 5

// launch (every mmvq_pipe_* kernel): grid (g, n_tok, 1) for any g >= 1 (the host takes a few
// thread blocks per multiprocessor, at most the row blocks), block (32, 4, 1) exactly; w0, w1,
// w2, y0, y1, y2, n0, n1, n2 as mmvq_multi_<type>'s (n0 and n1 multiples of MMVQ_ROWS; one weight:
// n0 = n1 = 0, the weight in w2, y2, n2); x and k as mmvq_<type>'s. Static shared memory: two
// items' activations (10 KB) and weight bytes (4 x 2.3 KB for Q4_0 up to 4 x 4.4 KB for Q8_0).
#define MMVQ_PIPE_KERNEL(name, T)                                                               \
    extern "C" __global__ void __launch_bounds__(128, MMVQ_PIPE_MIN_BLOCKS)                     \
        name(const void* __restrict__ w0, const void* __restrict__ w1,                          \
             const void* __restrict__ w2, const block_q8_1* __restrict__ x,                     \
             float* __restrict__ y0, float* __restrict__ y1, float* __restrict__ y2, int k,     \
             int n0, int n1, int n2, int n_tok) {                                               \
        mmvq_pipe_impl<T>(w0, w1, w2, x, y0, y1, y2, k, n0, n1, n2, n_tok);                     \
    }

MMVQ_PIPE_KERNEL(mmvq_pipe_q4_0, mmvq_q4_0_t)
MMVQ_PIPE_KERNEL(mmvq_pipe_q4_1, mmvq_q4_1_t)
MMVQ_PIPE_KERNEL(mmvq_pipe_q5_0, mmvq_q5_0_t)
MMVQ_PIPE_KERNEL(mmvq_pipe_q5_1, mmvq_q5_1_t)
MMVQ_PIPE_KERNEL(mmvq_pipe_q8_0, mmvq_q8_0_t)
MMVQ_PIPE_KERNEL(mmvq_pipe_q2_K, mmvq_q2_K_t)
MMVQ_PIPE_KERNEL(mmvq_pipe_q3_K, mmvq_q3_K_t)
MMVQ_PIPE_KERNEL(mmvq_pipe_q4_K, mmvq_q4_K_t)
MMVQ_PIPE_KERNEL(mmvq_pipe_q5_K, mmvq_q5_K_t)
MMVQ_PIPE_KERNEL(mmvq_pipe_q6_K, mmvq_q6_K_t)
MMVQ_PIPE_KERNEL(mmvq_pipe_iq4_nl, mmvq_iq4_nl_t)
MMVQ_PIPE_KERNEL(mmvq_pipe_iq4_xs, mmvq_iq4_xs_t)

// ---------------------------------------------------------------------------------------------
// Direct variant (mmvq_direct_<type>): no shared memory, no barriers, every token per weight load.
//
// Activations come split by quantize_q8_1_split: the int8 quants of token t at aq + t * k
// (16-byte aligned, so the per-format dots read them as 64- and 128-bit words straight from
// global memory / L1) and their (d, s) as float2 at ads + t * (k / 32). A thread block is 4
// warps, one weight row each; lane l takes units l, l + 32, ... of its row (the units of the
// staged kernel above), reads each unit's weight words once from global memory (2-byte loads
// pairwise for 2-byte aligned formats, 16-byte loads for Q4_K / Q5_K rows that are 16-byte
// aligned) and applies them to every token's activations, so a batch of up to 8 tokens reads
// the matrix once. Each lane sums its units in order, then the warp reduces: the same unit
// values as the staged kernel, summed in another order (not bit for bit equal to it).

#define MMVQ_DIRECT_MAX_TOK 8

template <class T, int AL>
__device__ __forceinline__ void mmvq_direct_row(const u8* wrow, const i8* aq, const float2* ads,
                                                int nb, int k, int n_tok, int lane, float* acc) {
    const int units = nb * T::upb;
#pragma unroll 4
    for (int u = lane; u < units; u += 32) {
        const int ib = u / T::upb, p = u % T::upb;
        const u8* b = wrow + (i64)ib * T::bytes;
#pragma unroll
        for (int t = 0; t < MMVQ_DIRECT_MAX_TOK; ++t) {
            if (t < n_tok) {
                acc[t] += T::template dot<AL>(b, aq + (i64)t * k + ib * T::qk,
                                              ads + (i64)t * (k / QK) + ib * (T::qk / QK), p);
            }
        }
    }
}

template <class T>
__device__ __forceinline__ void mmvq_direct_impl(const void* w, const i8* aq, const float2* ads,
                                                 float* y, int k, int n, int n_tok) {
    if (blockDim.x != 32 || blockDim.y != MMVQ_ROWS || n_tok < 1 || n_tok > MMVQ_DIRECT_MAX_TOK) {
        return; // whole block
    }
    const int lane = threadIdx.x;
    const int row = blockIdx.x * MMVQ_ROWS + threadIdx.y;
    if (row >= n) return; // whole warp
    const int nb = k / T::qk;
    const u8* wrow = (const u8*)w + (i64)row * nb * T::bytes;
    constexpr int A4 = T::al_max >= 4 ? 4 : 2, A16 = T::al_max >= 16 ? 16 : A4;
    const int al = block_align<T>(w);
    float acc[MMVQ_DIRECT_MAX_TOK];
#pragma unroll
    for (int t = 0; t < MMVQ_DIRECT_MAX_TOK; ++t) acc[t] = 0.0f;
    if (al == 16) {
        mmvq_direct_row<T, A16>(wrow, aq, ads, nb, k, n_tok, lane, acc);
    } else if (al == 4) {
        mmvq_direct_row<T, A4>(wrow, aq, ads, nb, k, n_tok, lane, acc);
    } else {
        mmvq_direct_row<T, 2>(wrow, aq, ads, nb, k, n_tok, lane, acc);
    }
#pragma unroll
    for (int t = 0; t < MMVQ_DIRECT_MAX_TOK; ++t) {
        if (t < n_tok) {
            const float v = warp_sum(acc[t]);
            if (lane == 0) y[(i64)t * n + row] = v;
        }
    }
}

// launch (every mmvq_direct_* kernel): grid (ceil(n / 4), 1, 1), block (32, 4, 1) exactly, no
// shared memory. w: n rows of k / block_size blocks (2-byte aligned); aq: [n_tok, k] i8 and
// ads: [n_tok, k / 32] float2 from quantize_q8_1_split (aq 16-byte aligned, ads 8-byte
// aligned); y: [n_tok, n] f32; 1 <= n_tok <= 8 (else nothing is written); k a multiple of the
// block size.
#define MMVQ_DIRECT_KERNEL(name, T) Q8_SPLIT_KERNEL(name, 128, mmvq_direct_impl<T>)

MMVQ_DIRECT_KERNEL(mmvq_direct_q4_0, mmvq_q4_0_t)
MMVQ_DIRECT_KERNEL(mmvq_direct_q4_1, mmvq_q4_1_t)
MMVQ_DIRECT_KERNEL(mmvq_direct_q5_0, mmvq_q5_0_t)
MMVQ_DIRECT_KERNEL(mmvq_direct_q5_1, mmvq_q5_1_t)
MMVQ_DIRECT_KERNEL(mmvq_direct_q8_0, mmvq_q8_0_t)
MMVQ_DIRECT_KERNEL(mmvq_direct_q2_K, mmvq_q2_K_t)
MMVQ_DIRECT_KERNEL(mmvq_direct_q3_K, mmvq_q3_K_t)
MMVQ_DIRECT_KERNEL(mmvq_direct_q4_K, mmvq_q4_K_t)
MMVQ_DIRECT_KERNEL(mmvq_direct_q5_K, mmvq_q5_K_t)
MMVQ_DIRECT_KERNEL(mmvq_direct_q6_K, mmvq_q6_K_t)
MMVQ_DIRECT_KERNEL(mmvq_direct_iq4_nl, mmvq_iq4_nl_t)
MMVQ_DIRECT_KERNEL(mmvq_direct_iq4_xs, mmvq_iq4_xs_t)

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

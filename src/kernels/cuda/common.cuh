// common.cuh: what every oato CUDA kernel file shares. The host hands this file to NVRTC as the
// in-memory header "common.cuh"; each .cu includes only it (and CUDA's own headers).
//
// - Fixed-width integer names (NVRTC has no <cstdint>).
// - The ggml block layouts, byte for byte as src/quant/blocks.rs declares them, each size checked.
// - Loads of 32-bit words from block fields that are only 2-byte aligned.
// - Warp reductions, the unpacking of the packed K-quant and IQ4_XS scales, and the lookup of
//   IQ4_NL / IQ4_XS quants' values.
//
// Alignment. GGUF packs blocks at their type size (18, 20, 22, ... bytes) after a 32-byte aligned
// tensor start, so a block starts on a 2-byte boundary only (every block holds an f16, and every
// size is even). The structs below therefore have alignment 2 (their f16 members), and a field
// wider than 2 bytes is read with ld_u32_a2, never by casting to int*, unless the code knows the
// block's address is better aligned (mmvq.cu checks the weight pointer once per thread block).

#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

typedef signed char i8;
typedef unsigned char u8;
typedef unsigned short u16;
typedef int i32;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

static_assert(sizeof(i8) == 1 && sizeof(u16) == 2 && sizeof(u32) == 4 && sizeof(i64) == 8,
              "fixed-width integer typedefs");

// ---------------------------------------------------------------------------------------------
// Block layouts (ggml-common.h; src/quant/blocks.rs)

#define QK 32        // elements in a Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q8_1 block
#define QK_K 256     // elements in a K-quant super-block
#define K_SCALE_SIZE 12 // bytes of packed 6-bit scales and mins in Q4_K / Q5_K

// 32 weights x = d * (q - 8), q in 0..16.
struct block_q4_0 {
    __half d;        // delta
    u8 qs[QK / 2];   // nibbles: element j in the low nibble of qs[j], j + 16 in the high one
};
static_assert(sizeof(block_q4_0) == 18, "block_q4_0 is 18 bytes");

// 32 weights x = d * q + m, q in 0..16.
struct block_q4_1 {
    __half d;        // delta
    __half m;        // min
    u8 qs[QK / 2];   // nibbles, as block_q4_0
};
static_assert(sizeof(block_q4_1) == 20, "block_q4_1 is 20 bytes");

// 32 weights x = d * (q - 16), q in 0..32.
struct block_q5_0 {
    __half d;        // delta
    u8 qh[4];        // fifth bits: bit j of the little-endian u32 belongs to element j
    u8 qs[QK / 2];   // low 4 bits, as block_q4_0
};
static_assert(sizeof(block_q5_0) == 22, "block_q5_0 is 22 bytes");

// 32 weights x = d * q + m, q in 0..32.
struct block_q5_1 {
    __half d;        // delta
    __half m;        // min
    u8 qh[4];        // fifth bits, as block_q5_0
    u8 qs[QK / 2];   // low 4 bits, as block_q4_0
};
static_assert(sizeof(block_q5_1) == 24, "block_q5_1 is 24 bytes");

// 32 values x = d * q, q in -128..128.
struct block_q8_0 {
    __half d;        // delta
    i8 qs[QK];       // quants
};
static_assert(sizeof(block_q8_0) == 34, "block_q8_0 is 34 bytes");

// 32 activations x = d * q, with s = d * sum(q) (both f16). quantize_q8_1 writes these into
// buffers from cudaMalloc, so here (and only here) the blocks are 4-byte aligned and the mmvq
// kernels read them as 32-bit words.
struct block_q8_1 {
    __half d;        // delta
    __half s;        // d * sum(qs[i])
    i8 qs[QK];       // quants
};
static_assert(sizeof(block_q8_1) == 36, "block_q8_1 is 36 bytes");

// 256 weights in 16 groups of 16: x = d * (sc & 15) * q - dmin * (sc >> 4), q in 0..4.
// Element e is bits 2 * ((e / 32) % 4) of qs[32 * (e / 128) + e % 32], with scale byte e / 16.
struct block_q2_K {
    u8 scales[QK_K / 16]; // scales (low nibble) and mins (high nibble), 4 bits each
    u8 qs[QK_K / 4];      // quants, 2 bits each
    __half d;             // super-block scale for quantized scales
    __half dmin;          // super-block scale for quantized mins
};
static_assert(sizeof(block_q2_K) == 84, "block_q2_K is 84 bytes");

// 256 weights in 16 groups of 16: x = d * (sc - 32) * q, q in -4..4.
// Element e = 32 * g + l (g = 4 * h + p) is bits 2p of qs[32h + l], minus 4 unless bit g of
// hmask[l] is set; its scale is number 2g + l / 16 (q3k_scale).
struct block_q3_K {
    u8 hmask[QK_K / 8];   // quants, high bit (set means no -4 offset)
    u8 qs[QK_K / 4];      // quants, low 2 bits
    u8 scales[12];        // sixteen scales, 6 bits each, packed
    __half d;             // super-block scale
};
static_assert(sizeof(block_q3_K) == 110, "block_q3_K is 110 bytes");

// 256 weights in 8 groups of 32: x = d * sc * q - dmin * m, q in 0..16.
// 64-element chunk c: low nibbles of qs[32c..32c + 32] (group 2c), then their high nibbles
// (group 2c + 1).
struct block_q4_K {
    __half d;                 // super-block scale for quantized scales
    __half dmin;              // super-block scale for quantized mins
    u8 scales[K_SCALE_SIZE];  // scales and mins, quantized with 6 bits (k4_scale_min)
    u8 qs[QK_K / 2];          // 4-bit quants
};
static_assert(sizeof(block_q4_K) == 144, "block_q4_K is 144 bytes");

// 256 weights in 8 groups of 32: x = d * sc * q - dmin * m, q in 0..32.
// As block_q4_K, plus 16 where bit g (the group) of qh[l] is set (l = element index % 32).
struct block_q5_K {
    __half d;                 // super-block scale for quantized scales
    __half dmin;              // super-block scale for quantized mins
    u8 scales[K_SCALE_SIZE];  // scales and mins, quantized with 6 bits (k4_scale_min)
    u8 qh[QK_K / 8];          // quants, high bit
    u8 qs[QK_K / 2];          // quants, low 4 bits
};
static_assert(sizeof(block_q5_K) == 176, "block_q5_K is 176 bytes");

// 256 weights in 16 groups of 16: x = d * sc * (q - 32), q in 0..64.
// 128-element half h, l in 0..32: elements 128h + l + 32k (k = 0..3) are
//   k=0: ql[64h + l] & 15       | ((qh[32h + l] >> 0) & 3) << 4
//   k=1: ql[64h + l + 32] & 15  | ((qh[32h + l] >> 2) & 3) << 4
//   k=2: ql[64h + l] >> 4       | ((qh[32h + l] >> 4) & 3) << 4
//   k=3: ql[64h + l + 32] >> 4  | ((qh[32h + l] >> 6) & 3) << 4
// with scale scales[8h + l / 16 + 2k] (that is, scale number e / 16).
struct block_q6_K {
    u8 ql[QK_K / 2];      // quants, lower 4 bits
    u8 qh[QK_K / 4];      // quants, upper 2 bits
    i8 scales[QK_K / 16]; // scales, quantized with 8 bits
    __half d;             // super-block scale
};
static_assert(sizeof(block_q6_K) == 210, "block_q6_K is 210 bytes");

// 32 weights x = d * IQ4_VALUES[q], q in 0..16 (iq4_values4).
struct block_iq4_nl {
    __half d;        // delta
    u8 qs[QK / 2];   // nibbles, as block_q4_0
};
static_assert(sizeof(block_iq4_nl) == 18, "block_iq4_nl is 18 bytes");

// 256 weights in 8 groups of 32: x = d * (ls - 32) * IQ4_VALUES[q], q in 0..16, ls group j's
// 6-bit scale (iq4xs_scale). Group j's quants are qs[16j..16j + 16], laid out as a block_q4_0's.
struct block_iq4_xs {
    __half d;               // super-block scale
    u16 scales_h;           // bits 2j..2j + 2: group j's scale, high 2 bits (little-endian)
    u8 scales_l[QK_K / 64]; // nibble j % 2 of byte j / 2: group j's scale, low 4 bits
    u8 qs[QK_K / 2];        // quants, 4 bits
};
static_assert(sizeof(block_iq4_xs) == 136, "block_iq4_xs is 136 bytes");

static_assert(alignof(block_q4_0) == 2 && alignof(block_q8_1) == 2 && alignof(block_q2_K) == 2 &&
              alignof(block_q3_K) == 2 && alignof(block_q6_K) == 2 &&
              alignof(block_iq4_nl) == 2 && alignof(block_iq4_xs) == 2,
              "blocks are 2-byte aligned so that arrays of them have the GGUF stride");

// ---------------------------------------------------------------------------------------------
// Loads

// A little-endian u32 at a 2-byte aligned address (two 16-bit loads).
__device__ __forceinline__ u32 ld_u32_a2(const void* p) {
    const u16* h = (const u16*)p;
    return (u32)h[0] | ((u32)h[1] << 16);
}

// Asks L2 for the line holding global address p (PTX prefetch.global.L2: no result, no fault);
// nothing in the CPU emulator (tests/cuda_emu), which compiles this file without __CUDA_ARCH__
// and has no cache to fill.
__device__ __forceinline__ void prefetch_l2(const void* p) {
#ifdef __CUDA_ARCH__
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#else
    (void)p;
#endif
}

#ifndef __CUDA_ARCH__
// The CPU emulator's mma: each lane of the warp posts its A (4 registers) and B (2) fragment
// registers to a warp buffer (one OS thread of the emulator runs one block at a time: its own
// buffer), then after a warp barrier reads any lane's: a(l) and b(l) are lane l's; `done` is the
// barrier before the buffer is reused. Every lane of the warp calls post, then done.
struct emu_mma_frags {
    const u32 (*xa)[4];
    const u32 (*xb)[2];
    int w0;   // the warp's first thread
    int lane; // the calling thread's lane
    const u32* a(int lane) const { return xa[w0 + lane]; }
    const u32* b(int lane) const { return xb[w0 + lane]; }
    void done() const { __syncwarp(); }
};

inline emu_mma_frags emu_mma_post(const u32* a, const u32* b) {
    static thread_local u32 xa[1024][4], xb[1024][2];
    const int tid = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    for (int i = 0; i < 4; ++i) xa[tid][i] = a[i];
    xb[tid][0] = b[0];
    xb[tid][1] = b[1];
    __syncwarp();
    return {xa, xb, tid & ~31, tid & 31};
}
#endif

// The warp's 16 x 8 int32 tile C += A B for a 16 x 32 int8 tile A (row-major) and a 32 x 8 int8
// tile B (column-major): PTX mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 (tensor cores,
// sm_80 and later), exact integer sums. The fragments, as the PTX ISA lays them out, for lane
// l with g = l / 4, t = l % 4 (each int four int8 of consecutive k, the lowest k in the lowest
// byte):
//   a[0] = A[g][4t..4t+4], a[1] = A[g+8][4t..], a[2] = A[g][16+4t..], a[3] = A[g+8][16+4t..]
//   b[0] = B[4t..4t+4][g], b[1] = B[16+4t..][g]
//   c[0] = C[g][2t], c[1] = C[g][2t+1], c[2] = C[g+8][2t], c[3] = C[g+8][2t+1]
// Below sm_80 it traps: the host never launches the kernels that call it there
// (cuda_mmq::mma_on). In the CPU emulator (no __CUDA_ARCH__), which checks those kernels through
// it, the same sums from the same fragments (emu_mma_post: each lane reads the rows and columns
// it needs). Every lane of the warp must call it.
__device__ __forceinline__ void mma_s8_16x8x32(int (&c)[4], const int (&a)[4], const int (&b)[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#elif defined(__CUDA_ARCH__)
    (void)c;
    (void)a;
    (void)b;
    __trap();
#else
    const emu_mma_frags f = emu_mma_post((const u32*)a, (const u32*)b);
    const int g = f.lane >> 2, t = f.lane & 3;
    for (int j = 0; j < 4; ++j) {
        // Ints j and 4 + j of rows g and g + 8: lane 4g + j's a; of columns 2t and 2t + 1:
        // lanes 8t + j's and 8t + 4 + j's b.
        const u32* ra = f.a(4 * g + j);
        const u32* c0 = f.b(8 * t + j);
        const u32* c1 = f.b(8 * t + 4 + j);
        c[0] = __dp4a((int)ra[2], (int)c0[1], __dp4a((int)ra[0], (int)c0[0], c[0]));
        c[1] = __dp4a((int)ra[2], (int)c1[1], __dp4a((int)ra[0], (int)c1[0], c[1]));
        c[2] = __dp4a((int)ra[3], (int)c0[1], __dp4a((int)ra[1], (int)c0[0], c[2]));
        c[3] = __dp4a((int)ra[3], (int)c1[1], __dp4a((int)ra[1], (int)c1[0], c[3]));
    }
    f.done();
#endif
}

// The warp's 16 x 8 f32 tile C += A B for a 16 x 16 f16 tile A (row-major) and a 16 x 8 f16
// tile B (column-major): PTX mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 (tensor cores,
// sm_80 and later; each product of two f16 is exact in f32, the sums' order and rounding are the
// hardware's). Each u32 holds two f16 of consecutive k, the lower k in the low half; for lane l
// with g = l / 4, t = l % 4:
//   a[0] = A[g][2t..2t+2], a[1] = A[g+8][2t..], a[2] = A[g][8+2t..], a[3] = A[g+8][8+2t..]
//   b[0] = B[2t..2t+2][g], b[1] = B[8+2t..][g]
//   c[0] = C[g][2t], c[1] = C[g][2t+1], c[2] = C[g+8][2t], c[3] = C[g+8][2t+1]
// Below sm_80 it traps (the host launches its callers only on sm_80 and later). In the CPU
// emulator, from the posted fragments (emu_mma_post), each lane's four sums in k order (fmaf
// from c). Every lane of the warp must call it.
__device__ __forceinline__ void mma_f16_16x8x16(float (&c)[4], const u32 (&a)[4],
                                                const u32 (&b)[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#elif defined(__CUDA_ARCH__)
    (void)c;
    (void)a;
    (void)b;
    __trap();
#else
    const emu_mma_frags f = emu_mma_post(a, b);
    const int g = f.lane >> 2, t = f.lane & 3;
    // Element k of row r of A: lane 4 (r % 8) + (k % 8) / 2's register (r / 8) + 2 (k / 8),
    // half k % 2; of column n of B: lane 4n + (k % 8) / 2's register k / 8, half k % 2.
    auto h = [](u32 w, int k) {
        return __half2float(__ushort_as_half((u16)(k & 1 ? w >> 16 : w & 0xFFFFu)));
    };
    auto av = [&](int r, int k) {
        return h(f.a(4 * (r & 7) + ((k & 7) >> 1))[(r >> 3) + 2 * (k >> 3)], k);
    };
    auto bv = [&](int n, int k) { return h(f.b(4 * n + ((k & 7) >> 1))[k >> 3], k); };
    for (int k = 0; k < 16; ++k) {
        c[0] = fmaf(av(g, k), bv(2 * t, k), c[0]);
        c[1] = fmaf(av(g, k), bv(2 * t + 1, k), c[1]);
        c[2] = fmaf(av(g + 8, k), bv(2 * t, k), c[2]);
        c[3] = fmaf(av(g + 8, k), bv(2 * t + 1, k), c[3]);
    }
    f.done();
#endif
}

// Two f32 as the f16 pair of one mma fragment register (lo in the low half), each rounded to
// nearest.
__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
    return (u32)__half_as_ushort(__float2half_rn(lo)) |
           ((u32)__half_as_ushort(__float2half_rn(hi)) << 16);
}

// An f16 field, widened exactly.
__device__ __forceinline__ float f16f(__half h) {
    return __half2float(h);
}

// Eight bytes at a 2-byte aligned address, as two little-endian words.
__device__ __forceinline__ void ld8(const u8* p, u32& a, u32& b) {
    a = ld_u32_a2(p);
    b = ld_u32_a2(p + 4);
}

// Byte j (0..8) of the pair (a, b).
__device__ __forceinline__ u32 byte8(u32 a, u32 b, int j) {
    return ((j < 4 ? a : b) >> (8 * (j & 3))) & 0xFFu;
}

// Store 8 values at y[i..i + 8] as f16.
__device__ __forceinline__ void store8_f16(__half* y, i64 i, const float* v, bool vec) {
    if (vec) {
        u32 words[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            words[j] = (u32)__half_as_ushort(__float2half_rn(v[2 * j])) |
                       ((u32)__half_as_ushort(__float2half_rn(v[2 * j + 1])) << 16);
        }
        *(uint4*)(y + i) = make_uint4(words[0], words[1], words[2], words[3]);
    } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) y[i + j] = __float2half_rn(v[j]);
    }
}

// Q6_K elements e0..e0 + 8 (e0 a multiple of 8) of the super-block whose ql, qh and scales start
// at b (2-byte aligned, the file's offsets: ql @0, qh @128, scales @192) and whose scale is d:
// y = (d * sc) * (q - 32); element e = 128h + 32k + l is the low (k < 2) or high nibble of
// ql[64h + 32 * (k & 1) + l] with bits 2k of qh[32h + l] above it, scale 8h + 2k + l / 16
// (= e / 16). Each product rounded on its own, as dequantize.rs.
__device__ __forceinline__ void dq_q6_k_unit(const u8* b, float d, int e0, float* v) {
    const int h = e0 >> 7, k = (e0 >> 5) & 3, l0 = e0 & 31;
    u32 a0, a1, q0, q1;
    ld8(b + 64 * h + 32 * (k & 1) + l0, a0, a1);
    ld8(b + 128 + 32 * h + l0, q0, q1);
    const int shl = k < 2 ? 0 : 4;
    const float dl = d * (float)((const i8*)b)[192 + (e0 >> 4)];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        const int q = (int)(((byte8(a0, a1, e) >> shl) & 0x0F) |
                            (((byte8(q0, q1, e) >> (2 * k)) & 3) << 4));
        v[e] = dl * (float)(q - 32);
    }
}

// Q4_K / Q5_K scale and min of group j (0..8) from the 12 packed bytes held as words s0, s1, s2
// (k4_scale_min on registers).
__device__ __forceinline__ void k4_scale_min_w(u32 s0, u32 s1, u32 s2, int j, int& sc, int& m) {
    const int sh = 8 * (j & 3);
    if (j < 4) {
        sc = (int)((s0 >> sh) & 63u);
        m = (int)((s1 >> sh) & 63u);
    } else {
        const u32 r = (s2 >> sh) & 0xFFu; // raw[j + 4]
        sc = (int)((r & 0x0F) | (((s0 >> sh) >> 6) & 3u) << 4);
        m = (int)((r >> 4) | (((s1 >> sh) >> 6) & 3u) << 4);
    }
}

// Q4_K / Q5_K decode products, 8 units per super-block: unit p (c = p / 2, l0 = 16 * (p % 2))
// holds qs[32c + l0..+16]: elements 64c + l0..+16 (low nibbles, group 2c) and 64c + 32 + l0..+16
// (high nibbles, group 2c + 1). With HAS_QH (Q5_K) bit 2c / 2c + 1 of qh[l0..+16] adds 16. The
// unit's f32 contribution from its registers: head the block's first 16 bytes (d, dmin | scales),
// v those qs bytes, hv qh[l0..+16] (Q5_K); a the activation quants of element 64c + l0 on
// (16-byte aligned; elements + 32 for the high nibbles), ads their blocks' (d, s) from group 2c.
// The exact i32 sums per group (quants, and activation sums for the mins), then the f32 steps.
template <bool HAS_QH>
__device__ __forceinline__ float k4_unit_dot(uint4 head, uint4 v, uint4 hv, const i8* a,
                                             const float2* ads, int p) {
    const int c = p >> 1;
    const u32 vw[4] = {v.x, v.y, v.z, v.w};
    const u32 hw[4] = {hv.x, hv.y, hv.z, hv.w};
    const int4 alo = *(const int4*)a, ahi = *(const int4*)(a + 32);
    const int al[4] = {alo.x, alo.y, alo.z, alo.w}, ah[4] = {ahi.x, ahi.y, ahi.z, ahi.w};
    int sumi_lo = 0, sumi_hi = 0, suma_lo = 0, suma_hi = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        u32 lo = vw[i] & 0x0F0F0F0Fu;
        u32 hi = (vw[i] >> 4) & 0x0F0F0F0Fu;
        if (HAS_QH) {
            lo |= ((hw[i] >> (2 * c)) & 0x01010101u) << 4;
            hi |= ((hw[i] >> (2 * c + 1)) & 0x01010101u) << 4;
        }
        sumi_lo = __dp4a((int)lo, al[i], sumi_lo);
        sumi_hi = __dp4a((int)hi, ah[i], sumi_hi);
        suma_lo = __dp4a(0x01010101, al[i], suma_lo);
        suma_hi = __dp4a(0x01010101, ah[i], suma_hi);
    }
    int sc_lo, m_lo, sc_hi, m_hi;
    k4_scale_min_w(head.y, head.z, head.w, 2 * c, sc_lo, m_lo);
    k4_scale_min_w(head.y, head.z, head.w, 2 * c + 1, sc_hi, m_hi);
    const float da_lo = ads[0].x, da_hi = ads[1].x;
    const float d = __half2float(__ushort_as_half((u16)(head.x & 0xFFFFu)));
    const float dmin = __half2float(__ushort_as_half((u16)(head.x >> 16)));
    const float sd = da_lo * (float)(sc_lo * sumi_lo) + da_hi * (float)(sc_hi * sumi_hi);
    const float sm = da_lo * (float)(m_lo * suma_lo) + da_hi * (float)(m_hi * suma_hi);
    return d * sd - dmin * sm;
}

// ---------------------------------------------------------------------------------------------
// Grid-stride loop: i takes this thread's indices in 0..n, for any grid.
#define GRID_STRIDE_LOOP(i, n)                                                                 \
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (i64)(n);                    \
         i += (i64)gridDim.x * blockDim.x)

// The dequantisation kernels' column blocks (dequant.cu, split.cu): unit u (8 elements) of an
// output of rows of k_y elements comes from unit dq_src_unit(u) of a weight whose rows hold k_w
// elements, read from the first wanted element of its first row on. k_w == k_y: whole rows, the
// same unit. Else both are multiples of 8 and the output holds under 2^32 units (32-bit
// arithmetic; the host's GEMM slices are far smaller).
__device__ __forceinline__ i64 dq_src_unit(i64 u, int k_w, int k_y) {
    if (k_w == k_y) return u;
    const u32 uy = (u32)k_y / 8, r = (u32)u / uy;
    return u + (i64)r * ((k_w - k_y) / 8);
}

// ---------------------------------------------------------------------------------------------
// Warp reductions (all 32 lanes take part and all get the result)

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ int warp_sum_int(int v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// ---------------------------------------------------------------------------------------------
// Q8_1 activations (src/quant/quantize.rs quantize_block_q8_1, step for step, so the blocks are
// bit-identical to it): amax = max |x|, d = amax / 127, id = d != 0 ? 1 / d : 0,
// q = round_half_away(x * id), d stored as f16 (round to nearest even), s = f16(sum(q) * d). The
// divisions are IEEE-rounded intrinsics, so this holds with --use_fast_math too.

// This lane's q of the 32-element block its warp holds (v is the lane's element) and the block's
// scale d, as quantize_row(Q8_1) computes them. All 32 lanes must call it (a warp reduction).
static __device__ __forceinline__ int q8_lane(float v, float& d) {
    const float amax = warp_max(fabsf(v));
    d = __fdiv_rn(amax, 127.0f);
    const float id = d != 0.0f ? __frcp_rn(d) : 0.0f;
    // Saturate as Rust's `as i8` does, NaN to 0 (only NaN or infinite inputs get there).
    const float r = roundf(v * id);
    return r != r ? 0 : max(-128, min(127, __float2int_rz(r)));
}

// Where a kernel that writes activations also writes their Q8_1 blocks: as blocks (q, what
// quantize_q8_1 writes, for mmvq.cu's kernels) and / or split (aq, ads: what quantize_q8_1_split
// writes, for split.cu's), each null when not wanted. at(b) is the sink of block b onwards.
struct q8_sink {
    block_q8_1* q;
    i8* aq;
    float2* ads;
    __device__ __forceinline__ bool on() const { return q != nullptr || aq != nullptr; }
    __device__ __forceinline__ q8_sink at(i64 b) const {
        return {q ? q + b : nullptr, aq ? aq + b * QK : nullptr, ads ? ads + b : nullptr};
    }
};

// The Q8_1 block of the 32 values a warp holds (lane i's v is element i), written to the sink's
// first block in each layout it has. All 32 lanes must call it.
static __device__ __forceinline__ void store_q8(q8_sink o, float v) {
    float df;
    const int q = q8_lane(v, df);
    const int sum = warp_sum_int(q);
    const int lane = threadIdx.x & 31;
    const __half d = __float2half_rn(df), s = __float2half_rn((float)sum * df);
    if (o.q) {
        o.q->qs[lane] = (i8)q;
        if (lane == 0) *(__half2*)&o.q->d = __halves2half2(d, s);
    }
    if (o.aq) {
        o.aq[lane] = (i8)q;
        if (lane == 0) *o.ads = make_float2(__half2float(d), __half2float(s));
    }
}

static __device__ __forceinline__ void store_q8_1(block_q8_1* b, float v) {
    store_q8({b, nullptr, nullptr}, v);
}

// One row of n values written by one thread block: o[i] = value(i), each i by one thread; when
// the sink is on also the row's Q8_1 blocks of those values (q: the row's first block; n a
// multiple of 32), a warp per 32-element block, as quantize_q8_1 (and quantize_q8_1_split) write
// them (decode's next matrix-vector product reads them). The values are the same either way;
// value(i) may read o[i] (only its own thread writes it).
template <class F>
static __device__ __forceinline__ void write_row_q8_1(float* o, q8_sink q, int n, F value) {
    if (!q.on()) {
        for (int i = threadIdx.x; i < n; i += blockDim.x) o[i] = value(i);
        return;
    }
    const int lane = threadIdx.x & 31;
    for (int b = threadIdx.x >> 5; b < n / QK; b += blockDim.x >> 5) {
        const int i = b * QK + lane;
        const float v = value(i);
        o[i] = v;
        store_q8(q.at(b), v);
    }
}

// ---------------------------------------------------------------------------------------------
// RMSNorm's scale of one row, 1 / sqrt(mean(x^2) + eps): f32 sums, IEEE-rounded square root and
// divisions, from each thread's own sum of squares. Every thread of the block calls it and gets
// the result; all of them have finished reading the row when it returns (a barrier), so callers
// may then overwrite it.
static __device__ __forceinline__ float block_rms_scale(float sum, int n, float eps) {
    __shared__ float partial[32];
    sum = warp_sum(sum);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) partial[warp] = sum;
    __syncthreads();
    const int n_warps = blockDim.x >> 5;
    sum = lane < n_warps ? partial[lane] : 0.0f;
    sum = warp_sum(sum); // every warp reduces the partials itself: no second barrier
    return __frcp_rn(__fsqrt_rn(__fdiv_rn(sum, (float)n) + eps));
}

// The scale of row xr, each thread summing its elements threadIdx.x + k * blockDim.x in order.
static __device__ __forceinline__ float row_rms_scale(const float* xr, int n, float eps) {
    float sum = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) sum += xr[i] * xr[i];
    return block_rms_scale(sum, n, eps);
}

// ---------------------------------------------------------------------------------------------
// Packed K-quant scales (src/quant/blocks.rs q3_k_scales, k4_scales_mins)

// Q3_K scale s (0..16), re-centred to -32..32. Low 4 bits: low nibble of raw[s] (s < 8) or high
// nibble of raw[s - 8]; high 2 bits: bits 2 * (s / 4) of raw[8 + s % 4].
__device__ __forceinline__ int q3k_scale(const u8* raw, int s) {
    const int low = s < 8 ? (raw[s] & 0x0F) : (raw[s - 8] >> 4);
    const int high = (raw[8 + (s & 3)] >> (2 * (s >> 2))) & 3;
    return (low | (high << 4)) - 32;
}

// Q4_K / Q5_K scale and min of group j (0..8), each 6 bits: for j < 4 the low 6 bits of raw[j]
// and raw[j + 4]; for j >= 4 the low / high nibble of raw[j + 4] with the top 2 bits of
// raw[j - 4] / raw[j] above them.
__device__ __forceinline__ void k4_scale_min(const u8* raw, int j, int& sc, int& m) {
    if (j < 4) {
        sc = raw[j] & 63;
        m = raw[j + 4] & 63;
    } else {
        sc = (raw[j + 4] & 0x0F) | ((raw[j - 4] >> 6) << 4);
        m = (raw[j + 4] >> 4) | ((raw[j] >> 6) << 4);
    }
}

// ---------------------------------------------------------------------------------------------
// Byte-lane helpers for packed quants

// Four bits b0..b3 (the low bits of `b`) moved to bit 4 of bytes 0..3.
__device__ __forceinline__ u32 bits4_to_byte_bit4(u32 b) {
    return ((b & 1u) << 4) | ((b & 2u) << 11) | ((b & 4u) << 18) | ((b & 8u) << 25);
}

// The four low / high quants of Q5 elements e..e + 4 and e + 16..e + 20 from qs word v and the
// block's qh: nibble | fifth bit (bit e + i of qh) << 4, in bytes.
__device__ __forceinline__ void q5_words(u32 v, u32 qh, int e, u32& lo, u32& hi) {
    lo = (v & 0x0F0F0F0Fu) | bits4_to_byte_bit4(qh >> e);
    hi = ((v >> 4) & 0x0F0F0F0Fu) | bits4_to_byte_bit4(qh >> (e + 16));
}

// Byte-wise a - b, modulo 256 per byte (no borrow between bytes): turns unsigned quants into
// signed int8 lanes for __dp4a, e.g. 0..15 - 8.
__device__ __forceinline__ int bytes_sub(u32 a, u32 b) {
    return (int)__vsub4(a, b);
}

// ---------------------------------------------------------------------------------------------
// The non-linear 4-bit values of IQ4_NL / IQ4_XS (src/quant/blocks.rs IQ4_VALUES, ggml's
// kvalues_iq4nl): quant q in 0..16 stands for the int8 IQ4_VALUES[q], in -127..113.

// Four int8 values as the bytes of a little-endian word, a first.
__host__ __device__ constexpr u32 i8x4(int a, int b, int c, int d) {
    return (u32)(u8)a | (u32)(u8)b << 8 | (u32)(u8)c << 16 | (u32)(u8)d << 24;
}
constexpr u32 IQ4_W0 = i8x4(-127, -104, -83, -65), IQ4_W1 = i8x4(-49, -35, -22, -10);
constexpr u32 IQ4_W2 = i8x4(1, 13, 25, 38), IQ4_W3 = i8x4(53, 69, 89, 113);

// The values of four quants: byte i of n holds q_i (0..16, so n's high nibbles are 0); byte i of
// the result is the int8 IQ4_VALUES[q_i]. __byte_perm picks bytes by 3-bit indices (bits 0..2 of
// each of the selector's four low nibbles; bit 3 and the upper 16 bits are ignored), so the q_i
// packed into one selector look q_i & 7 up among values 0..8 and among values 8..16, and a third
// permute takes byte i from the second where bit 3 of q_i is set. Exact: a lookup, no arithmetic.
__device__ __forceinline__ u32 iq4_values4(u32 n) {
    const u32 sel = __byte_perm(n | (n >> 4), 0, 0x0020);     // nibble i of the low half: q_i
    const u32 lo = __byte_perm(IQ4_W0, IQ4_W1, sel);           // IQ4_VALUES[q_i & 7]
    const u32 hi = __byte_perm(IQ4_W2, IQ4_W3, sel);           // IQ4_VALUES[8 + (q_i & 7)]
    return __byte_perm(lo, hi, 0x3210u | ((sel >> 1) & 0x4444u)); // byte i + 4 where q_i >= 8
}

// IQ4_XS group j's (0..8) scale ls - 32, in -32..32, from the block's scales_h and its scales_l
// read as a little-endian word: the low 4 bits are nibble j of scales_l, the high 2 bits are
// bits 2j..2j + 2 of scales_h.
__device__ __forceinline__ int iq4xs_scale(u32 scales_h, u32 scales_l, int j) {
    return (int)(((scales_l >> (4 * j)) & 15u) | (((scales_h >> (2 * j)) & 3u) << 4)) - 32;
}

// ---------------------------------------------------------------------------------------------
// A kernel over quantised weights w and activations split by quantize_q8_1_split (quants aq,
// their (d, s) ads), writing f32 y: the parameter list of mmvq_direct_* and mmq_*, calling
// IMPL(w, aq, ads, y, k, n, n_tok) (IMPL in parentheses when it holds a comma).
#define Q8_SPLIT_KERNEL(name, THREADS, IMPL)                                                    \
    extern "C" __global__ void __launch_bounds__(THREADS)                                       \
        name(const void* __restrict__ w, const i8* __restrict__ aq,                             \
             const float2* __restrict__ ads, float* __restrict__ y, int k, int n, int n_tok) {  \
        IMPL(w, aq, ads, y, k, n, n_tok);                                                       \
    }

// Nibble maps: four nibbles (one a byte, 0..16) to the four factors __dp4a takes.
struct nib_minus8 { // Q4_0: q - 8
    static __device__ __forceinline__ u32 map(u32 q) { return (u32)bytes_sub(q, 0x08080808u); }
};
struct nib_plain { // Q4_1: q (its min term is added apart)
    static __device__ __forceinline__ u32 map(u32 q) { return q; }
};
struct nib_iq4 { // IQ4_NL, IQ4_XS: IQ4_VALUES[q]
    static __device__ __forceinline__ u32 map(u32 q) { return iq4_values4(q); }
};

// Q6_K decode products, 8 units per super-block: unit p (h = p / 4, l0 = 8 (p % 4)) holds
// ql[64h + l0..+8], ql[64h + 32 + l0..+8] and qh[32h + l0..+8], that is elements 128h + 32j +
// l0..+8 for j = 0..3, each in activation block 4h + j and scale group 8h + 2j + l0 / 16. From
// registers: la0 / la1 and lb0 / lb1 the words of those ql bytes, h0 / h1 of the qh bytes, sc[j]
// scale 8h + 2j + l0 / 16; a the super-block's activation quants from element l0 on, ads its
// blocks' (d, s). Per j the exact i32 sum, then d_a * (sc * sum) in f32, summed over j; the caller
// multiplies by the super-block's d.
__device__ __forceinline__ float q6k_unit_sum(u32 la0, u32 la1, u32 lb0, u32 lb1, u32 h0, u32 h1,
                                              const int* sc, const i8* a, const float2* ads,
                                              int h) {
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const u32 n0 = j == 0 ? la0 : j == 1 ? lb0 : j == 2 ? la0 >> 4 : lb0 >> 4;
        const u32 n1 = j == 0 ? la1 : j == 1 ? lb1 : j == 2 ? la1 >> 4 : lb1 >> 4;
        const u32 q0 = (n0 & 0x0F0F0F0Fu) | (((h0 >> (2 * j)) & 0x03030303u) << 4);
        const u32 q1 = (n1 & 0x0F0F0F0Fu) | (((h1 >> (2 * j)) & 0x03030303u) << 4);
        const int2 av = *(const int2*)(a + 32 * (4 * h + j));
        int sumi = __dp4a(bytes_sub(q0, 0x20202020u), av.x, 0);
        sumi = __dp4a(bytes_sub(q1, 0x20202020u), av.y, sumi);
        sum += ads[4 * h + j].x * (float)(sc[j] * sumi);
    }
    return sum;
}

// A device function kept out of line, so that its registers stay apart from its caller's. The
// emulator's host compiler takes GCC's spelling (defining __noinline__ there would break
// libstdc++'s own __attribute__((__noinline__))).
#if defined(__CUDACC__)
#define OATO_NOINLINE __noinline__
#else
#define OATO_NOINLINE __attribute__((noinline))
#endif

// ---------------------------------------------------------------------------------------------
// RoPE of one head (ops.cu's RoPE comment has the meaning)

// Pair i of a head rotated by angle theta (theta_0 * theta_scale^i, divided by freq_factors[i]
// when given): (x0, x1) -> (y0, y1), written to head (and as f16 to cache, when not null) at
// the pair's offsets i0, i1.
static __device__ __forceinline__ void rope_pair(float* head, __half* cache, int i0, int i1,
                                                 float x0, float x1, float theta, int i,
                                                 const float* __restrict__ freq_factors) {
    const float a = freq_factors ? __fdiv_rn(theta, freq_factors[i]) : theta;
    double sd, cd;
    sincos((double)a, &sd, &cd);
    const float s = (float)sd, c = (float)cd;
    const float y0 = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
    const float y1 = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
    head[i0] = y0;
    head[i1] = y1;
    if (cache) {
        cache[i0] = __float2half_rn(y0);
        cache[i1] = __float2half_rn(y1);
    }
}

// One head's rotation (head points at its first rotated dimension), at position pos; when cache
// is not null the rotated values are also written there as f16 (round to nearest even), at the
// same offsets. Shared by rope_f32 and rope_store_kv_f16 (ops.cu), and by rope_head_warp for
// split.cu's fused q / k / v kernels, so all round alike; the loop over pairs is the block's
// threads in x, which any count serves.
static __device__ __forceinline__ void rope_head(float* head, __half* cache, int pos, int n_dims,
                                                 float freq_base, float freq_scale, int neox,
                                                 const float* __restrict__ freq_factors) {
    const int half = n_dims / 2;
    const float theta_scale = (float)pow((double)freq_base, -2.0 / (double)n_dims);
    float theta = (float)pos * freq_scale;
    int at = 0; // theta == theta_0 * theta_scale^at
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        for (; at < i; ++at) theta *= theta_scale;
        const int i0 = neox ? i : 2 * i;
        const int i1 = neox ? i + half : 2 * i + 1;
        rope_pair(head, cache, i0, i1, head[i0], head[i1], theta, i, freq_factors);
    }
}

// rope_head for one warp (blockDim.x 32) and heads of up to 64 * ROPE_WARP_PAIRS dimensions
// rotated: each lane's pairs all loaded before the first is rotated and stored, where
// rope_head's loop waits for a pair's loads, stores it, then loads the next (its stores may
// alias the next loads as far as the compiler knows: in split.cu's fused q / k / v kernel, one
// round trip to L2 a pair, two a lane for a head of 128, on the kernel's last warp). The loads
// go through L2 (__ldcg), as the values come from other warps of the launch. theta is built by
// the same successive multiplies and each pair rotated by rope_pair, as in rope_head, so the
// same bits; rope_head for more dimensions.
#define ROPE_WARP_PAIRS 4
static __device__ __forceinline__ void rope_head_warp(float* head, __half* cache, int pos,
                                                      int n_dims, float freq_base,
                                                      float freq_scale, int neox,
                                                      const float* __restrict__ freq_factors) {
    const int half = n_dims / 2;
    if (half > 32 * ROPE_WARP_PAIRS) {
        rope_head(head, cache, pos, n_dims, freq_base, freq_scale, neox, freq_factors);
        return;
    }
    const float theta_scale = (float)pow((double)freq_base, -2.0 / (double)n_dims);
    float theta = (float)pos * freq_scale;
    int at = 0; // theta == theta_0 * theta_scale^at
    float th[ROPE_WARP_PAIRS], x0[ROPE_WARP_PAIRS], x1[ROPE_WARP_PAIRS];
#pragma unroll
    for (int j = 0; j < ROPE_WARP_PAIRS; ++j) {
        const int i = (int)threadIdx.x + 32 * j;
        if (i < half) {
            for (; at < i; ++at) theta *= theta_scale;
            th[j] = theta;
            x0[j] = __ldcg(head + (neox ? i : 2 * i));
            x1[j] = __ldcg(head + (neox ? i + half : 2 * i + 1));
        }
    }
#pragma unroll
    for (int j = 0; j < ROPE_WARP_PAIRS; ++j) {
        const int i = (int)threadIdx.x + 32 * j;
        if (i < half) {
            rope_pair(head, cache, neox ? i : 2 * i, neox ? i + half : 2 * i + 1, x0[j], x1[j],
                      th[j], i, freq_factors);
        }
    }
}

static __device__ __forceinline__ bool rope_shape_ok(int head_dim, int n_dims, int dim_offset) {
    return dim_offset >= 0 && dim_offset + n_dims <= head_dim && n_dims >= 2;
}

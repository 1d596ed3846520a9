// mmq.cu: quantised weight matrix times a prefill batch of activations, on 8-bit integers.
//
//   y[t * n + r] = sum_i W[r, i] * act[t, i]      (f32 out; r < n rows, t < n_tok tokens)
//
// The activations come as quantize_q8_1_split writes them (the Q8_1 blocks the matrix-vector
// kernels read, split in two arrays): int8 quants aq [n_tok, k] and per 32-element block its
// (d, s) as float2 ads [n_tok, k / 32]. The weights are GGUF blocks as uploaded.
//
// Work layout (the facts of ggml's mul_mat_q, our own code): a thread block of 8 warps computes a
// tile of ROWS = 64 (or 32: the _r32 kernels, for small grids) weight rows by MMQ_TOK = 64 tokens,
// walking k in steps of MMQ_K = 256 elements. Per step
//   1. the block unpacks the tile's weight blocks into shared memory as one signed 8-bit value
//      per element (4 to an int, a row's 64 ints padded to 65 so that the 32 lanes reading 32
//      rows hit 32 banks), with per-block f32 factors: the scale of each 32 (Q6_K: 16) elements
//      and, where the format has a min, the min of each 32;
//   2. it copies the tile's activation quants (16-byte loads) and scales into shared memory, and
//      for formats with a min the exact integer sum of each 32 quants (__dp4a with 0x01010101);
//   3. each thread computes ROWS / 32 rows (lane, lane + 32) x 8 tokens (8 per warp): per 32-element
//      group an exact i32 __dp4a sum, then one f32 step: acc += d_w * d_a * sum (minus
//      m_w * d_a * sum(a) with a min), as mmvq.cu and src/quant/dot.rs do per block, except
//      that for Q4_1 / Q5_1 the min term takes the exact sum of the quants times d_a where
//      mmvq.cu and dot.rs take the activation block's stored f16 s (ggml's way): prefill and
//      decode of those types round that term differently (both within the golden parity rule).
// Steps past k's last 32-element block (k not a multiple of 256, 32-element formats) are cut
// short; rows past n and tokens past n_tok are staged as zeros and not written.
//
// Values: the integer sums are exact, so the result differs from the f64 product of the
// dequantised weights and the Q8_1 activations only by f32 rounding of the per-block steps and
// of the sums over k / 32 blocks (tests/cuda_emu checks ~1e-5 of sum |W| |A|). Against the
// dequantise + cuBLAS path (f16(d_a * q) activations, f16 weights, f32 sums) the order of the
// sums differs and the activations are not rounded to f16: the golden parity rule applies.
//
// Alignment: weight blocks need 2-byte alignment only (their words are read as two 16-bit
// halves); aq must be 16-byte aligned with k a multiple of 32 (true for quantize_q8_1_split's
// output in a cudaMalloc buffer), ads 8-byte aligned.

#include "common.cuh"

#define MMQ_TOK 64               // tokens per thread block
#define MMQ_K 256                // elements of k per step
#define MMQ_G (MMQ_K / QK)       // 32-element groups per step
#define MMQ_WSTRIDE (MMQ_K / 4 + 1) // ints per staged weight row (+1: no bank conflicts)
#define MMQ_WARPS 8              // blockDim (32, 8)
#define MMQ_THREADS (32 * MMQ_WARPS)
#define MMQ_TPW (MMQ_TOK / MMQ_WARPS) // tokens per warp

// ---------------------------------------------------------------------------------------------
// Per-format unpacking of a step's weight tile into shared memory.
//
// For the ROWS rows r < rows of the tile (w points at the tile's first row, row_bytes apart) and
// the elements k0..k0 + 256 (ng valid 32-element groups), element e's value goes to byte e % 4 of
// qs[r * WS + e / 4] (WS: ints per staged row), the scale of each scale group j (32 elements, or 16 where
// sub = 2) to sc[r * (8 * sub + 1) + j] and, where has_min, the min of each 32-element group g to
// mn[r * 9 + g] (subtracted: x = sc * q - mn). Rows past `rows` and groups past ng get zeros.
// Formats with 32-element blocks unpack one block per call (T::block: its ints at o, scale at
// *sc, min at *mn); K-quants one quarter of a super-block (T::quarter: quarter c of row r).

// Zeros for row r's groups g0..g0 + ng: their ints, scales and mins.
template <class T, int WS>
__device__ __forceinline__ void mmq_zero(int* qs, float* sc, float* mn, int r, int g0, int ng) {
    for (int i = 8 * g0; i < 8 * (g0 + ng); ++i) qs[r * WS + i] = 0;
    for (int j = g0 * T::sub; j < (g0 + ng) * T::sub; ++j) sc[r * (8 * T::sub + 1) + j] = 0.0f;
    if (T::has_min) {
        for (int g = g0; g < g0 + ng; ++g) mn[r * 9 + g] = 0.0f;
    }
}

// 32-element formats: thread shares are (row, block) pairs.
template <class T, int ROWS, int WS>
__device__ __forceinline__ void mmq_stage32(const u8* w, i64 row_bytes, int rows, int k0, int ng,
                                            int tid, int* qs, float* sc, float* mn) {
    for (int u = tid; u < ROWS * MMQ_G; u += MMQ_THREADS) {
        const int r = u / MMQ_G, g = u % MMQ_G;
        if (r >= rows || g >= ng) {
            mmq_zero<T, WS>(qs, sc, mn, r, g, 1);
        } else {
            T::block(w + r * row_bytes + (i64)(k0 / QK + g) * T::bytes,
                     qs + r * WS + 8 * g, sc + r * 9 + g, T::has_min ? mn + r * 9 + g : mn);
        }
    }
}

// K-quants (one super-block per row and step): thread shares are (row, quarter) pairs.
template <class T, int ROWS, int WS>
__device__ __forceinline__ void mmq_stage_k(const u8* w, i64 row_bytes, int rows, int k0, int ng,
                                            int tid, int* qs, float* sc, float* mn) {
    for (int u = tid; u < ROWS * 4; u += MMQ_THREADS) {
        const int r = u / 4, c = u % 4;
        if (r >= rows) {
            mmq_zero<T, WS>(qs, sc, mn, r, 2 * c, 2);
        } else {
            T::quarter(w + r * row_bytes + (i64)(k0 / QK_K) * T::bytes, r, c, qs + r * WS, sc, mn);
        }
    }
}

// The 32 nibbles of a Q4_0 / Q4_1 block's qs (2-byte aligned) as 8 ints of bytes, minus `off`
// per byte: elements 0..16 (low nibbles) in o[0..4], 16..32 (high nibbles) in o[4..8].
__device__ __forceinline__ void mmq_nibbles(const u8* qs, int* o, u32 off) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const u32 v = ld_u32_a2(qs + 4 * j);
        o[j] = bytes_sub(v & 0x0F0F0F0Fu, off);
        o[4 + j] = bytes_sub((v >> 4) & 0x0F0F0F0Fu, off);
    }
}

// Q4_0: x = d * (q - 8). Fields: d @0, qs @2.
struct mmq_q4_0_t {
    enum : int { qk = QK, bytes = 18, sub = 1, has_min = 0 };
    static __device__ __forceinline__ void block(const u8* b, int* o, float* sc, float* mn) {
        mmq_nibbles(b + 2, o, 0x08080808u);
        *sc = __half2float(*(const __half*)b);
    }
};

// Q4_1: x = d * q + m, q 0..16; the min enters as -m. Fields: d @0, m @2, qs @4.
struct mmq_q4_1_t {
    enum : int { qk = QK, bytes = 20, sub = 1, has_min = 1 };
    static __device__ __forceinline__ void block(const u8* b, int* o, float* sc, float* mn) {
        mmq_nibbles(b + 4, o, 0u);
        *sc = __half2float(*(const __half*)b);
        *mn = -__half2float(*(const __half*)(b + 2));
    }
};

// Q8_0: x = d * q. Fields: d @0, qs @2.
struct mmq_q8_0_t {
    enum : int { qk = QK, bytes = 34, sub = 1, has_min = 0 };
    static __device__ __forceinline__ void block(const u8* b, int* o, float* sc, float* mn) {
#pragma unroll
        for (int j = 0; j < 8; ++j) o[j] = (int)ld_u32_a2(b + 2 + 4 * j);
        *sc = __half2float(*(const __half*)b);
    }
};

// Q5_0 / Q5_1 block's 32 quants from qs (16 bytes, 2-byte aligned) and qh (the fifth bits, as a
// u32) as 8 ints of bytes, minus `off` per byte, laid out as mmq_nibbles.
__device__ __forceinline__ void mmq_q5(const u8* qs, u32 qh, int* o, u32 off) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        u32 lo, hi;
        q5_words(ld_u32_a2(qs + 4 * j), qh, 4 * j, lo, hi);
        o[j] = bytes_sub(lo, off);
        o[4 + j] = bytes_sub(hi, off);
    }
}

// Q5_0: x = d * (q - 16), q 0..32. Fields: d @0, qh @2, qs @6.
struct mmq_q5_0_t {
    enum : int { qk = QK, bytes = 22, sub = 1, has_min = 0 };
    static __device__ __forceinline__ void block(const u8* b, int* o, float* sc, float* mn) {
        mmq_q5(b + 6, ld_u32_a2(b + 2), o, 0x10101010u);
        *sc = __half2float(*(const __half*)b);
    }
};

// Q5_1: x = d * q + m, q 0..32; the min enters as -m. Fields: d @0, m @2, qh @4, qs @8.
struct mmq_q5_1_t {
    enum : int { qk = QK, bytes = 24, sub = 1, has_min = 1 };
    static __device__ __forceinline__ void block(const u8* b, int* o, float* sc, float* mn) {
        mmq_q5(b + 8, ld_u32_a2(b + 4), o, 0u);
        *sc = __half2float(*(const __half*)b);
        *mn = -__half2float(*(const __half*)(b + 2));
    }
};

// Q4_K / Q5_K: x = d * sc * q - dmin * m per 32-element group. Quarter c is the 64-element chunk
// qs[32c..32c + 32]: low nibbles group 2c, high nibbles group 2c + 1; with HAS_QH (Q5_K) bit 2c
// (2c + 1) of qh[l] adds 16 to element l of the low (high) group.
// Fields: d @0, dmin @2, scales @4, then Q4_K: qs @16; Q5_K: qh @16, qs @48.
template <bool HAS_QH>
__device__ __forceinline__ void mmq_k4_quarter(const u8* b, int r, int c, int* qrow, float* sc,
                                               float* mn) {
    int* o = qrow + 16 * c;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const u32 v = ld_u32_a2(b + (HAS_QH ? 48 : 16) + 32 * c + 4 * j);
        u32 lo = v & 0x0F0F0F0Fu, hi = (v >> 4) & 0x0F0F0F0Fu;
        if (HAS_QH) {
            const u32 h = ld_u32_a2(b + 16 + 4 * j);
            lo |= ((h >> (2 * c)) & 0x01010101u) << 4;
            hi |= ((h >> (2 * c + 1)) & 0x01010101u) << 4;
        }
        o[j] = (int)lo;
        o[8 + j] = (int)hi;
    }
    const float d = __half2float(*(const __half*)b);
    const float dmin = __half2float(*(const __half*)(b + 2));
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        int s, m;
        k4_scale_min(b + 4, 2 * c + h, s, m);
        sc[r * 9 + 2 * c + h] = d * (float)s;
        mn[r * 9 + 2 * c + h] = dmin * (float)m;
    }
}

struct mmq_q4_K_t {
    enum : int { qk = QK_K, bytes = 144, sub = 1, has_min = 1 };
    static __device__ __forceinline__ void quarter(const u8* b, int r, int c, int* qrow, float* sc,
                                                   float* mn) {
        mmq_k4_quarter<false>(b, r, c, qrow, sc, mn);
    }
};

struct mmq_q5_K_t {
    enum : int { qk = QK_K, bytes = 176, sub = 1, has_min = 1 };
    static __device__ __forceinline__ void quarter(const u8* b, int r, int c, int* qrow, float* sc,
                                                   float* mn) {
        mmq_k4_quarter<true>(b, r, c, qrow, sc, mn);
    }
};

// Q6_K: x = d * sc * (q - 32), one scale per 16 elements. Quarter c (half h = c / 2,
// l0 = 16 * (c % 2)) holds elements 128h + 32k + l0..+16 for k = 0..3: group 4h + k, scale
// 8h + 2k + c % 2. Fields: ql @0, qh @128, scales @192, d @208.
struct mmq_q6_K_t {
    enum : int { qk = QK_K, bytes = 210, sub = 2, has_min = 0 };
    static __device__ __forceinline__ void quarter(const u8* b, int r, int c, int* qrow, float* sc,
                                                   float* mn) {
        const int h = c >> 1, l0 = 16 * (c & 1);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int l = l0 + 4 * j;
            const u32 la = ld_u32_a2(b + 64 * h + l);      // ql[l]: k = 0 and 2
            const u32 lb = ld_u32_a2(b + 64 * h + 32 + l); // ql[l + 32]: k = 1 and 3
            const u32 hb = ld_u32_a2(b + 128 + 32 * h + l);
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const u32 nib = k == 0 ? la : k == 1 ? lb : k == 2 ? la >> 4 : lb >> 4;
                const u32 q = (nib & 0x0F0F0F0Fu) | (((hb >> (2 * k)) & 0x03030303u) << 4);
                qrow[8 * (4 * h + k) + l / 4] = bytes_sub(q, 0x20202020u);
            }
        }
        const float d = __half2float(*(const __half*)(b + 208));
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int j = 2 * (4 * h + k) + (c & 1);
            sc[r * 17 + j] = d * (float)((const i8*)b)[192 + 8 * h + 2 * k + (c & 1)];
        }
    }
};

// Which staging loop a format takes.
template <class T, int ROWS, int WS>
__device__ __forceinline__ void mmq_stage(const u8* w, i64 row_bytes, int rows, int k0, int ng,
                                          int tid, int* qs, float* sc, float* mn) {
    if constexpr (T::qk == QK) {
        mmq_stage32<T, ROWS, WS>(w, row_bytes, rows, k0, ng, tid, qs, sc, mn);
    } else {
        mmq_stage_k<T, ROWS, WS>(w, row_bytes, rows, k0, ng, tid, qs, sc, mn);
    }
}

// A step's activations: token t's quants k0..k0 + 256 (16-byte chunk c of token t to
// qa[t * AS + 4c..]), zeros for tokens past n_tok and groups past ng; each 32's d to
// ad[t * MMQ_G + g]; with HAS_MIN the exact integer sum of each 32 quants to as[t * MMQ_G + g].
// In two halves, so that the caller stages the weights between them and the two sets of loads
// wait for the memory together: `load` reads a thread's share into registers, `store` writes it
// to shared memory. Chunks 2g, 2g + 1 (group g) sit in neighbouring lanes, which add their quant
// sums with one shuffle; every lane runs the same number of iterations (the shuffle needs the
// whole warp).
struct mmq_acts {
    enum : int {
        Q = MMQ_TOK * (MMQ_K / 16) / MMQ_THREADS, // 16-byte chunks a thread
        D = MMQ_TOK * MMQ_G / MMQ_THREADS,        // scales a thread
    };
    int4 q[Q];
    float d[D];

    __device__ __forceinline__ void load(const i8* aq, const float2* ads, int k, int nb, int t0,
                                         int n_tok, int k0, int ng, int tid) {
#pragma unroll
        for (int i = 0; i < Q; ++i) {
            const int u = tid + i * MMQ_THREADS;
            const int t = u / (MMQ_K / 16), c = u % (MMQ_K / 16);
            q[i] = make_int4(0, 0, 0, 0);
            if (t0 + t < n_tok && c / 2 < ng) {
                q[i] = *(const int4*)(aq + (i64)(t0 + t) * k + k0 + 16 * c);
            }
        }
#pragma unroll
        for (int i = 0; i < D; ++i) {
            const int u = tid + i * MMQ_THREADS;
            const int t = u / MMQ_G, g = u % MMQ_G;
            d[i] = t0 + t < n_tok && g < ng ? ads[(i64)(t0 + t) * nb + k0 / QK + g].x : 0.0f;
        }
    }

    template <bool HAS_MIN, int AS>
    __device__ __forceinline__ void store(int tid, int* qa, float* ad, int* as) const {
#pragma unroll
        for (int i = 0; i < Q; ++i) {
            const int u = tid + i * MMQ_THREADS;
            const int t = u / (MMQ_K / 16), c = u % (MMQ_K / 16);
            *(int4*)(qa + t * AS + 4 * c) = q[i];
            if (HAS_MIN) {
                int sum = __dp4a(0x01010101, q[i].x, 0);
                sum = __dp4a(0x01010101, q[i].y, sum);
                sum = __dp4a(0x01010101, q[i].z, sum);
                sum = __dp4a(0x01010101, q[i].w, sum);
                sum += __shfl_xor_sync(0xffffffffu, sum, 1);
                if ((c & 1) == 0) as[t * MMQ_G + c / 2] = sum;
            }
        }
#pragma unroll
        for (int i = 0; i < D; ++i) ad[tid + i * MMQ_THREADS] = d[i];
    }
};

// Asks L2 for step k1's bytes (when k1 < kend, the end of the block's share of k) while this
// step runs: each of the tile's weight rows' bytes of that step and each token's activation
// quants (rows of k), a 128-byte line at a time (a no-op in the CPU emulator).
template <class T, int ROWS>
__device__ __forceinline__ void mmq_prefetch(const u8* wt, i64 row_bytes, int rows, const i8* aq,
                                             int k, int kend, int t0, int n_tok, int k1,
                                             int tid) {
    if (k1 >= kend) return;
    constexpr int SPAN = MMQ_K / T::qk * T::bytes; // a row's bytes in a step
    constexpr int LINES = SPAN / 128 + 2;          // the most lines they touch
    const i64 off = (i64)(k1 / T::qk) * T::bytes;
    for (int u = tid; u < ROWS * LINES; u += MMQ_THREADS) {
        const int r = u / LINES, l = u % LINES;
        const u8* first = wt + r * row_bytes + off;
        const u8* line = (const u8*)(((u64)first & ~(u64)127) + 128 * l);
        if (r < rows && line < first + min((i64)SPAN, row_bytes - off)) prefetch_l2(line);
    }
    for (int u = tid; u < MMQ_TOK * 3; u += MMQ_THREADS) {
        const int t = u / 3, l = u % 3; // a token's 256 bytes touch at most 3 lines
        if (t0 + t < n_tok) prefetch_l2(aq + (i64)(t0 + t) * k + k1 + min(128 * l, MMQ_K - 1));
    }
}

// A thread block's shared tile: the step's weights unpacked (rows of WS ints, 4 values an int),
// their scales (sub per 32) and mins (subtracted), the activation quants (rows of AS ints),
// their d and, with a min, their exact sums per 32. `stage` fills it for the step at k0 (ng
// valid groups): the activations' loads are issued first, so that they and the weights' wait
// for the memory together. Both GEMMs (__dp4a and tensor cores) stage through it.
template <class T, int ROWS, int WS, int AS>
struct mmq_tile {
    enum : int { SCS = 8 * T::sub + 1 }; // scales a weight row
    int wq[ROWS * WS];
    float wsc[ROWS * SCS];
    float wmn[T::has_min ? ROWS * 9 : 1];
    __align__(16) int aq[MMQ_TOK * AS];
    float ad[MMQ_TOK * MMQ_G];
    int as[T::has_min ? MMQ_TOK * MMQ_G : 1];

    __device__ __forceinline__ void stage(const u8* wt, i64 row_bytes, int rows, const i8* x,
                                          const float2* xd, int k, int t0, int n_tok, int k0,
                                          int ng, int tid) {
        mmq_acts acts;
        acts.load(x, xd, k, k / QK, t0, n_tok, k0, ng, tid);
        mmq_stage<T, ROWS, WS>(wt, row_bytes, rows, k0, ng, tid, wq, wsc, wmn);
        acts.store<T::has_min, AS>(tid, aq, ad, as);
    }
};

// One 32-element group's f32 step for one (row, token), from its exact integer sums: lo + hi
// over the group (Q6_K: lo the first 16 elements, hi the last 16, each with its own scale), the
// row's scales sc0, sc1 (Q6_K's halves; else sc0 the group's) and min wmn, the token's d and
// d times its quant sum (dsa = d * (float)sum, for a min). Both GEMMs take this one expression,
// so they give the same bits.
template <class T>
__device__ __forceinline__ float mmq_group(int lo, int hi, float sc0, float sc1, float wmn,
                                           float da, float dsa) {
    float v;
    if (T::sub == 2) {
        v = da * (sc0 * (float)lo + sc1 * (float)hi);
    } else {
        v = sc0 * da * (float)(lo + hi);
    }
    if (T::has_min) v -= wmn * dsa;
    return v;
}

// ---------------------------------------------------------------------------------------------

template <class T, int ROWS>
__device__ __forceinline__ void mmq_impl(const void* w, const i8* aq, const float2* ads, float* y,
                                         int k, int n, int n_tok) {
    constexpr int RPT = ROWS / 32; // rows per thread
    __shared__ mmq_tile<T, ROWS, MMQ_WSTRIDE, MMQ_K / 4> s;

    if (blockDim.x != 32 || blockDim.y != MMQ_WARPS || k % T::qk != 0) return; // whole block
    const int lane = threadIdx.x, warp = threadIdx.y, tid = warp * 32 + lane;
    const int row0 = blockIdx.x * ROWS, t0 = blockIdx.y * MMQ_TOK;
    const int rows = min(ROWS, n - row0);
    const int nb = k / QK; // 32-element groups in a row
    const i64 row_bytes = (i64)(k / T::qk) * T::bytes;
    const u8* wt = (const u8*)w + (i64)row0 * row_bytes;
    // This warp's tokens: t0 + MMQ_TPW * warp + j; warps whose first token is past n_tok only
    // help stage.
    const int tw = MMQ_TPW * warp;
    const bool computes = t0 + tw < n_tok;

    float acc[RPT][MMQ_TPW];
#pragma unroll
    for (int i = 0; i < RPT; ++i)
#pragma unroll
        for (int j = 0; j < MMQ_TPW; ++j) acc[i][j] = 0.0f;

    for (int k0 = 0; k0 < k; k0 += MMQ_K) {
        const int ng = min(MMQ_G, nb - k0 / QK); // valid 32-element groups in this step
        // 1. The step's weights and activations into shared memory.
        s.stage(wt, row_bytes, rows, aq, ads, k, t0, n_tok, k0, ng, tid);
        __syncthreads();
        // 2. Dot products from shared memory.
        if (computes) {
            for (int g = 0; g < ng; ++g) {
                int wv[RPT][8];
                float wsc[RPT][T::sub], wmn[RPT];
#pragma unroll
                for (int i = 0; i < RPT; ++i) {
                    const int r = lane + 32 * i;
#pragma unroll
                    for (int q = 0; q < 8; ++q) wv[i][q] = s.wq[r * MMQ_WSTRIDE + 8 * g + q];
#pragma unroll
                    for (int h = 0; h < T::sub; ++h) wsc[i][h] = s.wsc[r * s.SCS + T::sub * g + h];
                    wmn[i] = T::has_min ? s.wmn[r * 9 + g] : 0.0f;
                }
#pragma unroll
                for (int j = 0; j < MMQ_TPW; ++j) {
                    const int t = tw + j;
                    const int4 a0 = *(const int4*)(s.aq + t * (MMQ_K / 4) + 8 * g);
                    const int4 a1 = *(const int4*)(s.aq + t * (MMQ_K / 4) + 8 * g + 4);
                    const float da = s.ad[t * MMQ_G + g];
                    const float dsa = T::has_min ? da * (float)s.as[t * MMQ_G + g] : 0.0f;
#pragma unroll
                    for (int i = 0; i < RPT; ++i) {
                        int lo = __dp4a(wv[i][0], a0.x, 0);
                        lo = __dp4a(wv[i][1], a0.y, lo);
                        lo = __dp4a(wv[i][2], a0.z, lo);
                        lo = __dp4a(wv[i][3], a0.w, lo);
                        int hi = __dp4a(wv[i][4], a1.x, 0);
                        hi = __dp4a(wv[i][5], a1.y, hi);
                        hi = __dp4a(wv[i][6], a1.z, hi);
                        hi = __dp4a(wv[i][7], a1.w, hi);
                        acc[i][j] +=
                            mmq_group<T>(lo, hi, wsc[i][0], wsc[i][T::sub - 1], wmn[i], da, dsa);
                    }
                }
            }
        }
        __syncthreads();
    }
    if (!computes) return;
#pragma unroll
    for (int j = 0; j < MMQ_TPW; ++j) {
        const int t = t0 + tw + j;
#pragma unroll
        for (int i = 0; i < RPT; ++i) {
            const int r = lane + 32 * i;
            if (t < n_tok && r < rows) y[(i64)t * n + row0 + r] = acc[i][j];
        }
    }
}

// launch (every mmq_<type> kernel): grid (ceil(n / 64), ceil(n_tok / 64), 1); every
// mmq_<type>_r32 kernel (32-row tiles, for grids that would not fill the device otherwise): grid
// (ceil(n / 32), ceil(n_tok / 64), 1). Block (32, 8, 1) exactly (else nothing is written), no
// dynamic shared memory (static: under 44 KB). w: n rows of k / block_size blocks (2-byte
// aligned); aq: [n_tok, k] i8 (16-byte aligned) and ads: [n_tok, k / 32] float2 from
// quantize_q8_1_split; y: [n_tok, n] f32. k must be a multiple of the block size (32, or 256 for
// K-quants; else nothing is written).
#define MMQ_KERNEL(name, T, ROWS) Q8_SPLIT_KERNEL(name, 256, (mmq_impl<T, ROWS>))

MMQ_KERNEL(mmq_q4_0, mmq_q4_0_t, 64)
MMQ_KERNEL(mmq_q4_1, mmq_q4_1_t, 64)
MMQ_KERNEL(mmq_q5_0, mmq_q5_0_t, 64)
MMQ_KERNEL(mmq_q5_1, mmq_q5_1_t, 64)
MMQ_KERNEL(mmq_q8_0, mmq_q8_0_t, 64)
MMQ_KERNEL(mmq_q4_K, mmq_q4_K_t, 64)
MMQ_KERNEL(mmq_q5_K, mmq_q5_K_t, 64)
MMQ_KERNEL(mmq_q6_K, mmq_q6_K_t, 64)
MMQ_KERNEL(mmq_q4_0_r32, mmq_q4_0_t, 32)
MMQ_KERNEL(mmq_q4_1_r32, mmq_q4_1_t, 32)
MMQ_KERNEL(mmq_q5_0_r32, mmq_q5_0_t, 32)
MMQ_KERNEL(mmq_q5_1_r32, mmq_q5_1_t, 32)
MMQ_KERNEL(mmq_q8_0_r32, mmq_q8_0_t, 32)
MMQ_KERNEL(mmq_q4_K_r32, mmq_q4_K_t, 32)
MMQ_KERNEL(mmq_q5_K_r32, mmq_q5_K_t, 32)
MMQ_KERNEL(mmq_q6_K_r32, mmq_q6_K_t, 32)

// ---------------------------------------------------------------------------------------------
// The same GEMM on tensor cores (sm_80 and later): mmq_mma_<type> / mmq_mma_<type>_r32.
//
// Staging is the kernels' above (the same per-format unpacking into shared memory), with rows of
// MMQ_PAD = 68 ints for both the weights and the activations: 68 = 4 mod 32, so a fragment load
// (8 rows x 4 consecutive ints) hits 32 different banks. The products: each warp owns one 16-row
// m-tile of the block's ROWS rows and ROWS / 16 consecutive 8-token n-tiles of its 64 tokens
// (8 warps cover the ROWS x 64 tile: 4 x 8 or 2 x 8 fragments); per 32-element group one
// mma_s8_16x8x32 per n-tile gives each of its 16 x 8 (row, token) pairs the group's exact i32 sum,
// which takes the dp4a kernel's f32 step in the same expression (acc += d_w * d_a * sum, less
// m_w * d_a * sum(a) with a min; Q6_K's two 16-element halves each an mma of its own, the other
// half's A zero), so both kernels give the same bits wherever the compiler contracts them alike.

#define MMQ_PAD 68

template <class T, int ROWS>
__device__ __forceinline__ void mmq_mma_impl(const void* w, const i8* aq, const float2* ads,
                                             float* y, int k, int n, int n_tok) {
    constexpr int MT = ROWS / 16; // m-tiles in the block's rows, and n-tiles per warp
    __shared__ mmq_tile<T, ROWS, MMQ_PAD, MMQ_PAD> s;

    if (blockDim.x != 32 || blockDim.y != MMQ_WARPS || k % T::qk != 0) return; // whole block
    const int lane = threadIdx.x, warp = threadIdx.y, tid = warp * 32 + lane;
    const int gq = lane >> 2, tq = lane & 3; // the lane's place in a fragment
    const int row0 = blockIdx.x * ROWS, t0 = blockIdx.y * MMQ_TOK;
    const int rows = min(ROWS, n - row0);
    const int nb = k / QK;
    const i64 row_bytes = (i64)(k / T::qk) * T::bytes;
    const u8* wt = (const u8*)w + (i64)row0 * row_bytes;
    // Split-K (gridDim.z > 1): block z takes its share of k's steps and writes its partial sums
    // to y + z * n_tok * n (mmq_splitk_sum adds them up).
    const int steps = (k + MMQ_K - 1) / MMQ_K, per = (steps + gridDim.z - 1) / gridDim.z;
    const int kbeg = blockIdx.z * per * MMQ_K, kend = min(k, (int)(blockIdx.z + 1) * per * MMQ_K);
    y += (i64)blockIdx.z * n_tok * n;
    const int mr = 16 * (warp % MT); // the warp's rows mr..mr + 16 of the tile
    const int tw = 8 * MT * (warp / MT); // and its tokens tw..tw + 8 MT
    // The warp's n-tiles with a token: it skips those past n_tok (a decode batch of 1 to 8
    // tokens: one of the tile's eight), and with none only helps stage; uniform across the warp,
    // so the mma's whole-warp rule holds.
    const int jn = min(MT, (n_tok - t0 - tw + 7) / 8);

    float acc[MT][4];
#pragma unroll
    for (int j = 0; j < MT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][e] = 0.0f;

    for (int k0 = kbeg; k0 < kend; k0 += MMQ_K) {
        const int ng = min(MMQ_G, nb - k0 / QK);
        s.stage(wt, row_bytes, rows, aq, ads, k, t0, n_tok, k0, ng, tid);
        // The next step's bytes into L2 while this one computes.
        mmq_prefetch<T, ROWS>(wt, row_bytes, rows, aq, k, kend, t0, n_tok, k0 + MMQ_K, tid);
        __syncthreads();
        if (jn > 0) {
            for (int g = 0; g < ng; ++g) {
                // Rows mr + gq (e = 0, 1) and mr + gq + 8 (e = 2, 3).
                const int* w0 = s.wq + (mr + gq) * MMQ_PAD + 8 * g + tq;
                const int* w1 = w0 + 8 * MMQ_PAD;
                const int a[4] = {w0[0], w1[0], w0[4], w1[4]};
                float wsc[2][T::sub], wmn[2];
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int r = mr + gq + 8 * h;
#pragma unroll
                    for (int q = 0; q < T::sub; ++q) wsc[h][q] = s.wsc[r * s.SCS + T::sub * g + q];
                    wmn[h] = T::has_min ? s.wmn[r * 9 + g] : 0.0f;
                }
#pragma unroll
                for (int j = 0; j < MT; ++j) {
                    if (j >= jn) break;
                    const int tb = tw + 8 * j; // the n-tile's first token (in the tile)
                    const int* x0 = s.aq + (tb + gq) * MMQ_PAD + 8 * g + tq;
                    const int b[2] = {x0[0], x0[4]};
                    int lo[4] = {0, 0, 0, 0}, hi[4] = {0, 0, 0, 0};
                    if (T::sub == 2) {
                        const int alo[4] = {a[0], a[1], 0, 0}, ahi[4] = {0, 0, a[2], a[3]};
                        mma_s8_16x8x32(lo, alo, b);
                        mma_s8_16x8x32(hi, ahi, b);
                    } else {
                        mma_s8_16x8x32(lo, a, b);
                    }
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int h = e >> 1, t = tb + 2 * tq + (e & 1);
                        const float da = s.ad[t * MMQ_G + g];
                        const float dsa = T::has_min ? da * (float)s.as[t * MMQ_G + g] : 0.0f;
                        // Q6_K: lo and hi are the halves' sums; else lo the group's.
                        acc[j][e] += mmq_group<T>(lo[e], T::sub == 2 ? hi[e] : 0, wsc[h][0],
                                                  wsc[h][T::sub - 1], wmn[h], da, dsa);
                    }
                }
            }
        }
        __syncthreads();
    }
    if (jn <= 0) return;
#pragma unroll
    for (int j = 0; j < MT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int r = mr + gq + 8 * (e >> 1), t = t0 + tw + 8 * j + 2 * tq + (e & 1);
            if (t < n_tok && r < rows) y[(i64)t * n + row0 + r] = acc[j][e];
        }
}

// launch: as the mmq_<type> kernels (grid x, y, block (32, 8, 1), arguments), with grid z the
// number of k splits S: with S > 1, y is [S, n_tok, n], split z's partial sums over its share of
// k's 256-element steps (ceil(steps / S) each, the last ones possibly none: zeros), and
// mmq_splitk_sum adds them into the output. Only on devices of compute capability 8.0 or later
// (elsewhere correct but slow: the mma is emulated by shuffles). Two blocks a multiprocessor
// (about 41 KB of static shared memory each).
#define MMQ_MMA_KERNEL(name, T, ROWS)                                                           \
    extern "C" __global__ void __launch_bounds__(MMQ_THREADS, 2)                                \
        name(const void* __restrict__ w, const i8* __restrict__ aq,                             \
             const float2* __restrict__ ads, float* __restrict__ y, int k, int n, int n_tok) {  \
        mmq_mma_impl<T, ROWS>(w, aq, ads, y, k, n, n_tok);                                      \
    }

MMQ_MMA_KERNEL(mmq_mma_q4_0, mmq_q4_0_t, 64)
MMQ_MMA_KERNEL(mmq_mma_q4_1, mmq_q4_1_t, 64)
MMQ_MMA_KERNEL(mmq_mma_q5_0, mmq_q5_0_t, 64)
MMQ_MMA_KERNEL(mmq_mma_q5_1, mmq_q5_1_t, 64)
MMQ_MMA_KERNEL(mmq_mma_q8_0, mmq_q8_0_t, 64)
MMQ_MMA_KERNEL(mmq_mma_q4_K, mmq_q4_K_t, 64)
MMQ_MMA_KERNEL(mmq_mma_q5_K, mmq_q5_K_t, 64)
MMQ_MMA_KERNEL(mmq_mma_q6_K, mmq_q6_K_t, 64)
MMQ_MMA_KERNEL(mmq_mma_q4_0_r32, mmq_q4_0_t, 32)
MMQ_MMA_KERNEL(mmq_mma_q4_1_r32, mmq_q4_1_t, 32)
MMQ_MMA_KERNEL(mmq_mma_q5_0_r32, mmq_q5_0_t, 32)
MMQ_MMA_KERNEL(mmq_mma_q5_1_r32, mmq_q5_1_t, 32)
MMQ_MMA_KERNEL(mmq_mma_q8_0_r32, mmq_q8_0_t, 32)
MMQ_MMA_KERNEL(mmq_mma_q4_K_r32, mmq_q4_K_t, 32)
MMQ_MMA_KERNEL(mmq_mma_q5_K_r32, mmq_q5_K_t, 32)
MMQ_MMA_KERNEL(mmq_mma_q6_K_r32, mmq_q6_K_t, 32)

// y[i] = part[i] + part[len + i] + ... + part[(splits - 1) len + i], in that order (the split-K
// partials of an mmq_mma kernel; the same bits every run).
// launch: grid any, block (256, 1, 1). part: [splits, len] f32; y: [len] f32.
extern "C" __global__ void mmq_splitk_sum(const float* __restrict__ part, float* __restrict__ y,
                                          i64 len, int splits) {
    GRID_STRIDE_LOOP(i, len) {
        float v = part[i];
        for (int z = 1; z < splits; ++z) v += part[(i64)z * len + i];
        y[i] = v;
    }
}

// flash_prefill.cu: prefill attention as a tiled flash kernel. Same operator as attention_f16kv in
// ops.cu:
//   out[t, h] = sum_j softmax_j(scale * f16(q[t, h]) . K[j, kvh]) * V[j, kvh],  kvh = h / group,
// over positions j in 0..=pos0 + t (causal; group = n_head / n_head_kv). attention_f16kv gives
// every (head, token) its own block, which reads the whole K and V prefix from memory; here a
// block takes a tile of FLP_BQ query tokens of one head, and the tile's K and V rows are loaded
// once into shared memory per FLP_BK positions and used by all FLP_BQ queries (FLP_BQ times less
// cache traffic), with an online softmax (running max m, running sum l, f32 accumulators) per
// query, so no score matrix is ever stored.
//
// Work layout: 4 warps, FLP_BQ / 4 queries each. For each K/V tile, lane j of a warp scores
// position j0 + j against one query (a dot product over head_dim from shared memory: q rows are
// broadcast, K rows padded by one word so the 32 lanes hit 32 banks), the warp takes the tile's
// max and sum by shuffles, and lane l accumulates dims l + 32e over the tile's 32 positions, each
// weight broadcast from its lane. Positions past a query's last one score -inf (weight 0); a tile
// wholly past it is skipped.
//
// The order of the softmax sums differs from attention_f16kv's (tiles of 32 positions in one
// warp instead of 8-position tiles over 4 warps and a merge), so results agree to rounding, not
// bit for bit; both keep the weights in f32.
//
// Requirements: head_dim a multiple of 32, at most 256; n_head a multiple of n_head_kv;
// blockDim (128, 1, 1); pos0 >= 0. Otherwise the block writes NaN into its rows of out and
// touches nothing else.
// launch: grid (ceil(n_tok / 16), n_head, 1), block (128, 1, 1), no dynamic shared memory
// (static: 41 KB: K and V tiles of 32 rows and the 16 query rows, all f16).
// q: [n_tok, n_head * head_dim] f32 (after RoPE); k_cache, v_cache: [n_ctx, n_head_kv * head_dim]
// f16 holding positions 0..pos0 + n_tok; out: [n_tok, n_head * head_dim] f32.

#include "common.cuh"

#define FLP_WARPS 4                // the launch's 128 threads
#define FLP_BQ 16                  // query tokens per block
#define FLP_QW (FLP_BQ / FLP_WARPS)  // query tokens per warp
#define FLP_BK 32                  // positions per K/V tile: one per lane
#define FLP_MAX_D 256              // head_dim at most
#define FLP_MAX_E (FLP_MAX_D / 32)  // dims per lane at most
#define FLP_WORDS (FLP_BK * FLP_MAX_D / 8 / 128) // 16-byte words of K (and V) a thread a tile

#define FLP_NEG_INF (__int_as_float(0xff800000))
#define FLP_NAN (__int_as_float(0x7fc00000))

// An unsupported launch's answer: NaN in head h's rows of out for tokens t0..t_end.
__device__ __forceinline__ void flp_nan_rows(float* out, int t0, int t_end, int n_head, int h,
                                             int head_dim) {
    for (int i = threadIdx.x; i < (t_end - t0) * head_dim; i += blockDim.x) {
        const int t = t0 + i / head_dim, d = i % head_dim;
        out[((i64)t * n_head + h) * head_dim + d] = FLP_NAN;
    }
}

extern "C" __global__ void __launch_bounds__(128)
    attention_flash_f16kv(const float* __restrict__ q, const __half* __restrict__ k_cache,
                          const __half* __restrict__ v_cache, float* __restrict__ out, int n_tok,
                          int n_head, int n_head_kv, int head_dim, int pos0, float scale) {
    // + one word a row: row j starts at bank j + ...
    __shared__ __align__(16) __half s_k[FLP_BK][FLP_MAX_D + 2];
    __shared__ __align__(16) __half s_v[FLP_BK][FLP_MAX_D];
    __shared__ __half s_q[FLP_BQ][FLP_MAX_D];

    const int h = blockIdx.y, t0 = blockIdx.x * FLP_BQ;
    if (h >= n_head || t0 >= n_tok || head_dim <= 0) return;
    const int t_end = min(t0 + FLP_BQ, n_tok);
    const bool ok = head_dim % 32 == 0 && head_dim <= FLP_MAX_D && n_head_kv > 0 &&
                    n_head % n_head_kv == 0 && blockDim.x == 32 * FLP_WARPS && blockDim.y == 1 &&
                    pos0 >= 0;
    if (!ok) {
        flp_nan_rows(out, t0, t_end, n_head, h, head_dim);
        return;
    }

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int E = head_dim >> 5;
    const int kvh = h / (n_head / n_head_kv);
    const i64 kv_stride = (i64)n_head_kv * head_dim;
    const __half* kb = k_cache + (i64)kvh * head_dim;
    const __half* vb = v_cache + (i64)kvh * head_dim;

    // The tile's queries, rounded to f16 as attention_f16kv rounds them (rows past n_tok: 0).
    for (int i = threadIdx.x; i < FLP_BQ * head_dim; i += blockDim.x) {
        const int r = i / head_dim, d = i % head_dim, t = t0 + r;
        s_q[r][d] = __float2half_rn(t < n_tok ? q[((i64)t * n_head + h) * head_dim + d] : 0.0f);
    }

    float m[FLP_QW], l[FLP_QW], acc[FLP_QW][FLP_MAX_E];
#pragma unroll
    for (int qi = 0; qi < FLP_QW; ++qi) {
        m[qi] = FLP_NEG_INF;
        l[qi] = 0.0f;
#pragma unroll
        for (int e = 0; e < FLP_MAX_E; ++e) acc[qi][e] = 0.0f;
    }

    const int n_kv = pos0 + t_end; // positions the tile's last query sees
    // 16-byte loads where the caches allow them (cudaMalloc'd ones always do): rows are then
    // 16-byte aligned, head_dim being a multiple of 32.
    const bool vec = (((u64)k_cache | (u64)v_cache) & 15) == 0;
    const int cpr = head_dim >> 3; // 16-byte words a row
    for (int j0 = 0; j0 < n_kv; j0 += FLP_BK) {
        if (vec) {
            // Every load of the thread out before the barrier and the stores (the element loop
            // below waits for memory once an element).
            uint4 kw[FLP_WORDS], vw[FLP_WORDS];
#pragma unroll
            for (int u = 0; u < FLP_WORDS; ++u) {
                const int i = (int)threadIdx.x + 128 * u, r = i / cpr, j = j0 + r;
                kw[u] = vw[u] = make_uint4(0, 0, 0, 0);
                if (i < FLP_BK * cpr && j < n_kv) {
                    const i64 at = (i64)j * kv_stride + 8 * (i - r * cpr);
                    kw[u] = __ldg((const uint4*)(kb + at));
                    vw[u] = __ldg((const uint4*)(vb + at));
                }
            }
            __syncthreads(); // the previous tile's readers are done (and the queries stored)
#pragma unroll
            for (int u = 0; u < FLP_WORDS; ++u) {
                const int i = (int)threadIdx.x + 128 * u, r = i / cpr, d = 8 * (i - r * cpr);
                if (i < FLP_BK * cpr) {
                    // s_k's rows are 4-byte aligned (padded by one word), s_v's 16-byte.
                    u32* k4 = (u32*)(s_k[r] + d);
                    k4[0] = kw[u].x;
                    k4[1] = kw[u].y;
                    k4[2] = kw[u].z;
                    k4[3] = kw[u].w;
                    *(uint4*)(s_v[r] + d) = vw[u];
                }
            }
        } else {
            __syncthreads(); // the previous tile's readers are done (and the queries stored)
            for (int i = threadIdx.x; i < FLP_BK * head_dim; i += blockDim.x) {
                const int r = i / head_dim, d = i % head_dim, j = j0 + r;
                const bool in = j < n_kv;
                s_k[r][d] = in ? kb[(i64)j * kv_stride + d] : __float2half_rn(0.0f);
                s_v[r][d] = in ? vb[(i64)j * kv_stride + d] : __float2half_rn(0.0f);
            }
        }
        __syncthreads();
#pragma unroll
        for (int qi = 0; qi < FLP_QW; ++qi) {
            const int r = warp * FLP_QW + qi, t = t0 + r;
            const int last = pos0 + t; // the last position query t sees
            if (t >= n_tok || j0 > last) continue; // warp-uniform
            const int j = j0 + lane;
            float s = FLP_NEG_INF;
            if (j <= last) {
                float dot = 0.0f;
                for (int d = 0; d < head_dim; ++d) {
                    dot = fmaf(__half2float(s_q[r][d]), __half2float(s_k[lane][d]), dot);
                }
                s = dot * scale;
            }
            // Position j0 <= last is in the tile, so m_new is finite; exp(-inf) = 0 for the
            // first tile and for the masked lanes.
            const float m_new = fmaxf(m[qi], warp_max(s));
            const float corr = expf(m[qi] - m_new);
            const float p = j <= last ? expf(s - m_new) : 0.0f;
            l[qi] = l[qi] * corr + warp_sum(p);
#pragma unroll
            for (int e = 0; e < FLP_MAX_E; ++e) acc[qi][e] *= corr;
            for (int jj = 0; jj < FLP_BK; ++jj) {
                const float pj = __shfl_sync(0xffffffffu, p, jj);
#pragma unroll
                for (int e = 0; e < FLP_MAX_E; ++e) {
                    if (e < E) acc[qi][e] = fmaf(pj, __half2float(s_v[jj][lane + 32 * e]), acc[qi][e]);
                }
            }
            m[qi] = m_new;
        }
    }

#pragma unroll
    for (int qi = 0; qi < FLP_QW; ++qi) {
        const int t = t0 + warp * FLP_QW + qi;
        if (t >= n_tok) continue;
        float* o = out + ((i64)t * n_head + h) * head_dim;
        const float inv = __frcp_rn(l[qi]);
#pragma unroll
        for (int e = 0; e < FLP_MAX_E; ++e) {
            if (e < E) o[lane + 32 * e] = acc[qi][e] * inv;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// attention_flash_mma_f16kv: the same operator on tensor cores (sm_80 and later; the host
// launches it only there, for head_dim a multiple of 16 up to 128). A block takes FLM_BQ = 64
// query tokens of one head, 16 a warp; per K/V tile of FLM_BK = 64 positions (loaded once into
// shared memory, 16-byte words, rows padded by 16 bytes so the fragment loads below meet 32
// banks), each warp
//   1. scores its 16 queries against the tile's 64 positions: S = Q K^T by mma_f16_16x8x16 (Q as
//      f16, rounded as attention_f16kv rounds it, held in registers as A fragments for the whole
//      kernel; K rows are the column-major B fragments as they lie in shared memory), f32 sums;
//   2. scales and masks them (positions past a query's last one: -inf, weight 0), and updates
//      the online softmax per query row (running max m, each lane's share of the running sum l,
//      the accumulators rescaled by exp(m_old - m_new)), each row's max over its quad of lanes;
//   3. adds P V to the f32 accumulators O (16 x head_dim: head_dim / 8 C fragments a lane), the
//      weights P taken from the score fragments as A fragments (the C layout of two adjacent
//      8-position tiles is the A layout of one 16-position step) in two f16 parts, hi = f16(p)
//      and lo = f16(p - hi), so that p = hi + lo to about 2^-22 (a single f16 would round each
//      weight by up to 2^-12 relative; f32 is what the other kernels keep), each times V's B
//      fragments (two 16-bit shared loads a register: V lies position-major).
// A warp whose 16 queries all end before a tile skips it; blocks take the query tiles latest
// first (most positions first). Each thread issues all its loads of a tile (8 16-byte words of K
// and of V at head_dim 128) before the barrier that ends the previous tile, then stores them: one
// memory round trip a tile, overlapping the other warps' last steps (a loop of load-then-store
// compiled to one round trip a word: 8 a tile). ptxas: 211 registers on sm_90 (2 blocks a
// multiprocessor, the 256 blocks of a 512-token prefill of 32 heads in one wave), no spills.
// The sums' order differs from the other kernels' (the tensor cores' own order within each
// 16-step), so results agree to rounding, not bit for bit.
//
// Requirements: head_dim a multiple of 16, at most 128; n_head a multiple of n_head_kv;
// blockDim (128, 1, 1); pos0 >= 0; k_cache and v_cache 16-byte aligned. Otherwise the block
// writes NaN into its rows of out and touches nothing else.
// launch: grid (n_head, ceil(n_tok / 64), 1), block (128, 1, 1), no dynamic shared memory
// (static: 34 KB, the K and V tiles). Arguments as attention_flash_f16kv's.

#define FLM_BQ 64     // query tokens per block: 16 a warp
#define FLM_BK 64     // positions per K/V tile
#define FLM_MAX_D 128 // head_dim at most
#define FLM_ROW (FLM_MAX_D + 8) // halves per shared row: + 16 bytes, rows 4 banks apart
#define FLM_WORDS (FLM_BK * FLM_MAX_D / 8 / 128) // 16-byte words of K (and V) a thread a tile

// Two consecutive f32 of q (row `row`, dims d, d + 1) as an A fragment register; 0 past n_tok.
__device__ __forceinline__ u32 flm_q2(const float* q, int row, int n_tok, int n_head, int h,
                                      int head_dim, int d) {
    if (row >= n_tok) return 0u;
    const float* p = q + ((i64)row * n_head + h) * head_dim + d;
    return pack_f16x2(p[0], p[1]);
}

extern "C" __global__ void __launch_bounds__(128)
    attention_flash_mma_f16kv(const float* __restrict__ q, const __half* __restrict__ k_cache,
                              const __half* __restrict__ v_cache, float* __restrict__ out,
                              int n_tok, int n_head, int n_head_kv, int head_dim, int pos0,
                              float scale) {
    __shared__ __align__(16) __half s_k[FLM_BK][FLM_ROW];
    __shared__ __align__(16) __half s_v[FLM_BK][FLM_ROW];

    const int h = blockIdx.x;
    const int n_qt = (n_tok + FLM_BQ - 1) / FLM_BQ;
    const int qt = n_qt - 1 - (int)blockIdx.y; // the latest tokens first
    if (h >= n_head || qt < 0 || head_dim <= 0) return;
    const int t0 = qt * FLM_BQ;
    const int t_end = min(t0 + FLM_BQ, n_tok);
    const bool ok = head_dim % 16 == 0 && head_dim <= FLM_MAX_D && n_head_kv > 0 &&
                    n_head % n_head_kv == 0 && blockDim.x == 32 * FLP_WARPS && blockDim.y == 1 &&
                    pos0 >= 0 && (((u64)k_cache | (u64)v_cache) & 15) == 0;
    if (!ok) {
        flp_nan_rows(out, t0, t_end, n_head, h, head_dim);
        return;
    }

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, tq = lane & 3;
    const int KS = head_dim >> 4, NT = head_dim >> 3;
    const int kvh = h / (n_head / n_head_kv);
    const i64 kv_stride = (i64)n_head_kv * head_dim;
    const __half* kb = k_cache + (i64)kvh * head_dim;
    const __half* vb = v_cache + (i64)kvh * head_dim;
    const int tw = t0 + 16 * warp;        // the warp's first query token
    const int r0 = tw + g, r1 = tw + g + 8; // this lane's two query rows
    const int last0 = pos0 + r0, last1 = pos0 + r1; // the last position each sees
    const bool live0 = r0 < n_tok, live1 = r1 < n_tok;
    // The last position any of the warp's queries sees (-1: the warp has none).
    const int warp_last = tw < n_tok ? pos0 + min(tw + 15, n_tok - 1) : -1;

    u32 qa[FLM_MAX_D / 16][4];
#pragma unroll
    for (int ks = 0; ks < FLM_MAX_D / 16; ++ks) {
        if (ks < KS) {
            const int d = 16 * ks + 2 * tq;
            qa[ks][0] = flm_q2(q, r0, n_tok, n_head, h, head_dim, d);
            qa[ks][1] = flm_q2(q, r1, n_tok, n_head, h, head_dim, d);
            qa[ks][2] = flm_q2(q, r0, n_tok, n_head, h, head_dim, d + 8);
            qa[ks][3] = flm_q2(q, r1, n_tok, n_head, h, head_dim, d + 8);
        }
    }
    float o[FLM_MAX_D / 8][4];
#pragma unroll
    for (int nt = 0; nt < FLM_MAX_D / 8; ++nt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) o[nt][i] = 0.0f;
    }
    float m0 = FLP_NEG_INF, m1 = FLP_NEG_INF, l0 = 0.0f, l1 = 0.0f;

    const int n_kv = pos0 + t_end; // positions the block's last query sees
    const int cpr = head_dim >> 3;  // 16-byte words a row
    const int words = FLM_BK * cpr; // of K (and of V) a tile
    for (int j0 = 0; j0 < n_kv; j0 += FLM_BK) {
        // The tile's K and V words, all of this thread's loads issued before the first store
        // (one memory round trip a tile).
        uint4 kw[FLM_WORDS], vw[FLM_WORDS];
#pragma unroll
        for (int u = 0; u < FLM_WORDS; ++u) {
            const int i = (int)threadIdx.x + 128 * u, r = i / cpr, j = j0 + r;
            kw[u] = vw[u] = make_uint4(0, 0, 0, 0);
            if (i < words && j < n_kv) {
                const i64 at = (i64)j * kv_stride + 8 * (i - r * cpr);
                kw[u] = __ldg((const uint4*)(kb + at));
                vw[u] = __ldg((const uint4*)(vb + at));
            }
        }
        __syncthreads(); // the previous tile's readers are done
#pragma unroll
        for (int u = 0; u < FLM_WORDS; ++u) {
            const int i = (int)threadIdx.x + 128 * u, r = i / cpr;
            if (i < words) {
                *(uint4*)(s_k[r] + 8 * (i - r * cpr)) = kw[u];
                *(uint4*)(s_v[r] + 8 * (i - r * cpr)) = vw[u];
            }
        }
        __syncthreads();
        if (warp_last < j0) continue; // warp-uniform: every query of the warp ends before

        // 1. S = Q K^T: 8 tiles of 8 positions.
        float s[FLM_BK / 8][4];
#pragma unroll
        for (int nt = 0; nt < FLM_BK / 8; ++nt) {
#pragma unroll
            for (int i = 0; i < 4; ++i) s[nt][i] = 0.0f;
            const __half* krow = &s_k[8 * nt + g][2 * tq];
#pragma unroll
            for (int ks = 0; ks < FLM_MAX_D / 16; ++ks) {
                if (ks < KS) {
                    const u32 b[2] = {*(const u32*)(krow + 16 * ks),
                                      *(const u32*)(krow + 16 * ks + 8)};
                    mma_f16_16x8x16(s[nt], qa[ks], b);
                }
            }
        }
        // 2. Scale, mask, the rows' maxima over the quad, the online softmax.
        float mx0 = FLP_NEG_INF, mx1 = FLP_NEG_INF;
#pragma unroll
        for (int nt = 0; nt < FLM_BK / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int j = j0 + 8 * nt + 2 * tq + e;
                s[nt][e] = live0 && j <= last0 ? s[nt][e] * scale : FLP_NEG_INF;
                s[nt][2 + e] = live1 && j <= last1 ? s[nt][2 + e] * scale : FLP_NEG_INF;
                mx0 = fmaxf(mx0, s[nt][e]);
                mx1 = fmaxf(mx1, s[nt][2 + e]);
            }
        }
#pragma unroll
        for (int o_ = 1; o_ < 4; o_ <<= 1) {
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, o_));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, o_));
        }
        const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
        // A row with no position yet keeps m = -inf (and its zero sums).
        const float c0 = mn0 == FLP_NEG_INF ? 1.0f : expf(m0 - mn0);
        const float c1 = mn1 == FLP_NEG_INF ? 1.0f : expf(m1 - mn1);
        float ls0 = 0.0f, ls1 = 0.0f;
#pragma unroll
        for (int nt = 0; nt < FLM_BK / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float p0 = s[nt][e] == FLP_NEG_INF ? 0.0f : expf(s[nt][e] - mn0);
                const float p1 = s[nt][2 + e] == FLP_NEG_INF ? 0.0f : expf(s[nt][2 + e] - mn1);
                s[nt][e] = p0;
                s[nt][2 + e] = p1;
                ls0 += p0;
                ls1 += p1;
            }
        }
        l0 = l0 * c0 + ls0;
        l1 = l1 * c1 + ls1;
        m0 = mn0;
        m1 = mn1;
#pragma unroll
        for (int nt = 0; nt < FLM_MAX_D / 8; ++nt) {
            o[nt][0] *= c0;
            o[nt][1] *= c0;
            o[nt][2] *= c1;
            o[nt][3] *= c1;
        }
        // 3. O += P V, 16 positions a step, P as hi + lo.
#pragma unroll
        for (int ks = 0; ks < FLM_BK / 16; ++ks) {
            // Register i of the A fragment: (row g, k 2t), (g + 8, 2t), (g, 8 + 2t), (g + 8,
            // 8 + 2t), i.e. tile 2 ks's pairs (c0 c1), (c2 c3), then tile 2 ks + 1's.
            u32 ahi[4], alo[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const float x0 = s[2 * ks + (i >> 1)][2 * (i & 1)];
                const float x1 = s[2 * ks + (i >> 1)][2 * (i & 1) + 1];
                const __half h0 = __float2half_rn(x0), h1 = __float2half_rn(x1);
                ahi[i] = (u32)__half_as_ushort(h0) | ((u32)__half_as_ushort(h1) << 16);
                alo[i] = pack_f16x2(x0 - __half2float(h0), x1 - __half2float(h1));
            }
            const __half* v0 = &s_v[16 * ks + 2 * tq][g];
#pragma unroll
            for (int nt = 0; nt < FLM_MAX_D / 8; ++nt) {
                if (nt < NT) {
                    const __half* v = v0 + 8 * nt;
                    const u32 b[2] = {
                        (u32)__half_as_ushort(v[0]) | ((u32)__half_as_ushort(v[FLM_ROW]) << 16),
                        (u32)__half_as_ushort(v[8 * FLM_ROW]) |
                            ((u32)__half_as_ushort(v[9 * FLM_ROW]) << 16)};
                    mma_f16_16x8x16(o[nt], ahi, b);
                    mma_f16_16x8x16(o[nt], alo, b);
                }
            }
        }
    }

    // Each row's sum over its quad, then the rows out.
#pragma unroll
    for (int o_ = 1; o_ < 4; o_ <<= 1) {
        l0 += __shfl_xor_sync(0xffffffffu, l0, o_);
        l1 += __shfl_xor_sync(0xffffffffu, l1, o_);
    }
    const float inv0 = __frcp_rn(l0), inv1 = __frcp_rn(l1);
#pragma unroll
    for (int nt = 0; nt < FLM_MAX_D / 8; ++nt) {
        if (nt < NT) {
            const int d = 8 * nt + 2 * tq;
            if (live0) {
                *(float2*)(out + ((i64)r0 * n_head + h) * head_dim + d) =
                    make_float2(o[nt][0] * inv0, o[nt][1] * inv0);
            }
            if (live1) {
                *(float2*)(out + ((i64)r1 * n_head + h) * head_dim + d) =
                    make_float2(o[nt][2] * inv1, o[nt][3] * inv1);
            }
        }
    }
}

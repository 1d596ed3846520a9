// flash_decode.cu: decode attention split over the KV cache ("flash-decoding"), for a few query
// tokens over a long f16 cache. Same operator as attention_f16kv in ops.cu:
//   out[t, h] = sum_j softmax_j(scale * f16(q[t, h]) . K[j, kvh]) * V[j, kvh],  kvh = h / group,
// over positions j in 0..=pos0 + t (group = n_head / n_head_kv). Two kernels:
//   1. attention_split_f16kv: the positions are cut into chunks of `chunk`; one thread block per
//      (query-head slice, chunk, token) computes, for each of its gq query heads (all sharing
//      one KV head, so each K / V row is loaded once for all of them), the chunk's partial
//      softmax state: m (max score), l (sum of exp(s - m)) and acc (sum of exp(s - m) * V).
//   2. attention_merge_f32: per (head, token), the chunks' states merged by log-sum-exp:
//      out = sum_c exp(m_c - M) acc_c / sum_c exp(m_c - M) l_c,  M = max_c m_c.
// The order of the softmax sum differs from attention_f16kv's (chunks, then the merge), so the
// results agree to rounding, not bit for bit; both keep the weights in f32.
//
// Partial states, one f32 buffer `part` (host: n_tok * n_head * n_split * (head_dim + 2) floats):
//   acc at part[((t * n_head + h) * n_split + c) * head_dim + d],
//   (m, l) at part[n_tok * n_head * n_split * head_dim + ((t * n_head + h) * n_split + c) * 2].
// A chunk wholly past token t's last position (c * chunk > pos0 + t) stores m = -inf, l = 0,
// acc = 0, which the merge weighs by 0.

#include "common.cuh"

#define FD_WARPS 4       // the launch's 128 threads
#define FD_MAX_CHUNK 256 // positions per block at most
#define FD_MAX_G 8       // query heads per block at most
#define FD_MAX_GE 1024   // query heads per block x head_dim at most
#define FD_UNROLL 8      // rows each lane loads before it computes (loads in flight), up
                         // to 4 query heads a block (4 for more: registers)

#define FD_NEG_INF (__int_as_float(0xff800000))
#define FD_NAN (__int_as_float(0x7fc00000))

// The 8 f16 of a 16-byte word, widened.
__device__ __forceinline__ void fd_unpack8(uint4 r, float* o) {
    const u32 w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        o[2 * i] = __half2float(__ushort_as_half((u16)(w[i] & 0xFFFFu)));
        o[2 * i + 1] = __half2float(__ushort_as_half((u16)(w[i] >> 16)));
    }
}

// Calls f(j, x) for the rows j = j0 + u * step + r (j0 = first, first + U * step, ...
// below n_here; u < U) of a K or V slice at `base` (this lane's 8 dims of row 0), x the
// row's 8 values (zero for j >= n_here: f is called for those too, so shuffles stay in step).
// Each group of U rows is loaded, as 16-byte words, before any is used.
// With `ahead` (the V slice at the same offset as `base`'s K slice), each row's 16 bytes there are
// asked into L2 as the K row is loaded: the V pass after the softmax then finds its rows in L2
// rather than in memory.
template <int U, class F>
__device__ __forceinline__ void fd_for_rows(const __half* base, int first, int step, int r,
                                            int n_here, i64 kv_stride, F f,
                                            const __half* ahead = nullptr) {
    for (int j0 = first; j0 < n_here; j0 += U * step) {
        uint4 raw[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int j = j0 + u * step + r;
            raw[u] = j < n_here ? *(const uint4*)(base + (i64)j * kv_stride)
                                : make_uint4(0, 0, 0, 0);
            if (ahead && j < n_here) prefetch_l2(ahead + (i64)j * kv_stride);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            float x[8];
            fd_unpack8(raw[u], x);
            f(j0 + u * step + r, x);
        }
    }
}

// Work layout of a block: lane l of warp w reads dims 8c..8c + 8 (c = l % lpr, lpr = head_dim / 8
// lanes per row) of row r = l / lpr of each step; a step of the block covers FD_WARPS * 32 / lpr
// consecutive rows (warp w the w-th slice), each lane one 16-byte load per K or V row. Scores:
// the lpr lanes of a row sum their partial dots by xor shuffles (offsets < lpr stay in the row)
// and the row's first lane stores scale * dot per head in shared memory. The softmax of the chunk
// is taken per head by one warp (the score pass has asked L2 for each V row as it loaded the K
// row, so the V pass reads L2, not memory); then the V pass accumulates p * V per lane (gq x 8
// registers), summed over the rows of a warp by shuffles (offsets >= lpr) and over the warps in
// shared memory, warp 0 first. Each lane loads FD_UNROLL rows of K (of V) before it uses them:
// with 4 heads a block, a 64-position chunk of head_dim 128 goes in one round of loads.

// The kernel's work for gq <= G query heads (G sizes the per-head registers), each lane loading
// U rows of K (then of V) before it computes; s_p and s_red are the kernel's shared memory
// (declared there, so that the four instantiations share it).
template <int G, int U>
__device__ __forceinline__ void fd_split_block(const float* __restrict__ q,
                                               const __half* __restrict__ k_cache,
                                               const __half* __restrict__ v_cache,
                                               float* __restrict__ part, int n_tok, int n_head,
                                               int n_head_kv, int head_dim, int pos0, float scale,
                                               int gq, int chunk, int n_split,
                                               float (*s_p)[FD_MAX_CHUNK],
                                               float (*s_red)[FD_MAX_GE]) {
    const int t = blockIdx.z, c_idx = blockIdx.y;
    if (t >= n_tok || c_idx >= n_split || gq <= 0 || head_dim <= 0) return;
    const int h0 = blockIdx.x * gq;
    if (h0 >= n_head) return;
    const i64 row_part = (i64)t * n_head * n_split; // (t, h, c) -> (row_part + h * n_split + c)
    float* ml = part + (i64)n_tok * n_head * n_split * head_dim;
    const int lpr = head_dim >> 3;
    const int group = n_head_kv > 0 ? n_head / n_head_kv : 0;
    const bool ok = (head_dim == 32 || head_dim == 64 || head_dim == 128 || head_dim == 256) &&
                    n_head_kv > 0 && n_head % n_head_kv == 0 && gq <= FD_MAX_G &&
                    gq * head_dim <= FD_MAX_GE && group % gq == 0 && h0 + gq <= n_head &&
                    chunk >= 1 && chunk <= FD_MAX_CHUNK && blockDim.x == 32 * FD_WARPS &&
                    blockDim.y == 1 && pos0 >= 0 && (((u64)k_cache | (u64)v_cache) & 15) == 0;
    if (!ok) {
        const int gn = min(gq, n_head - h0);
        for (int i = threadIdx.x; i < gn * head_dim; i += blockDim.x) {
            const int g = i / head_dim, d = i - g * head_dim;
            part[(row_part + (i64)(h0 + g) * n_split + c_idx) * head_dim + d] = FD_NAN;
        }
        if ((int)threadIdx.x < gn) {
            const i64 r = row_part + (i64)(h0 + (int)threadIdx.x) * n_split + c_idx;
            ml[2 * r] = FD_NAN;
            ml[2 * r + 1] = 1.0f;
        }
        return;
    }

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int rpw = 32 / lpr;        // rows per warp step
    const int r = lane / lpr, c = lane % lpr;
    const int kvh = h0 / group;
    const i64 kv_stride = (i64)n_head_kv * head_dim;
    const int n_kv = pos0 + t + 1;
    const int j_beg = c_idx * chunk;
    const int n_here = max(0, min(chunk, n_kv - j_beg)); // rows of this chunk that token t sees
    const __half* kb = k_cache + (i64)j_beg * kv_stride + (i64)kvh * head_dim + 8 * c;
    const __half* vb = v_cache + (i64)j_beg * kv_stride + (i64)kvh * head_dim + 8 * c;

    // The gq query rows' dims 8c..8c + 8, rounded to f16 as the CPU path does.
    float qv[G][8];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        const float* qr = q + ((i64)t * n_head + h0 + g) * head_dim + 8 * c;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            qv[g][i] = g < gq ? __half2float(__float2half_rn(qr[i])) : 0.0f;
        }
    }

    // 1. Scores.
    const int step = FD_WARPS * rpw;
    fd_for_rows<U>(kb, warp * rpw, step, r, n_here, kv_stride, [&](int j, const float* kf) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
            if (g < gq) { // warp-uniform
                float dot = 0.0f;
#pragma unroll
                for (int i = 0; i < 8; ++i) dot = fmaf(kf[i], qv[g][i], dot);
                for (int o = lpr >> 1; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
                if (c == 0 && j < n_here) s_p[g][j] = dot * scale;
            }
        }
    }, vb);
    __syncthreads();

    // 2. The chunk's softmax per head: m, then exp(s - m) in place; l goes straight to `ml`.
    for (int g = warp; g < gq; g += FD_WARPS) {
        float m = FD_NEG_INF;
        for (int j = lane; j < n_here; j += 32) m = fmaxf(m, s_p[g][j]);
        m = warp_max(m);
        float l = 0.0f;
        for (int j = lane; j < n_here; j += 32) {
            const float p = expf(s_p[g][j] - m);
            s_p[g][j] = p;
            l += p;
        }
        l = warp_sum(l);
        if (lane == 0) {
            const i64 rr = row_part + (i64)(h0 + g) * n_split + c_idx;
            ml[2 * rr] = m; // -inf (and l = 0) for a chunk token t does not reach
            ml[2 * rr + 1] = l;
        }
    }
    __syncthreads();

    // 3. acc = sum_j p_j * V[j], same row layout as the scores.
    float acc[G][8];
#pragma unroll
    for (int g = 0; g < G; ++g) {
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[g][i] = 0.0f;
    }
    fd_for_rows<U>(vb, warp * rpw, step, r, n_here, kv_stride, [&](int j, const float* vf) {
        if (j >= n_here) return;
#pragma unroll
        for (int g = 0; g < G; ++g) {
            if (g < gq) {
                const float p = s_p[g][j];
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[g][i] = fmaf(p, vf[i], acc[g][i]);
            }
        }
    });
    // Rows of a warp: lanes l, l ^ lpr, l ^ 2lpr, ... hold the same dims.
#pragma unroll
    for (int g = 0; g < G; ++g) {
        if (g < gq) {
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                for (int o = lpr; o < 32; o <<= 1) {
                    acc[g][i] += __shfl_xor_sync(0xffffffffu, acc[g][i], o);
                }
            }
        }
    }
    if (r == 0) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
            if (g < gq) {
#pragma unroll
                for (int i = 0; i < 8; ++i) s_red[warp][g * head_dim + 8 * c + i] = acc[g][i];
            }
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < gq * head_dim; i += blockDim.x) {
        float a = s_red[0][i];
#pragma unroll
        for (int w = 1; w < FD_WARPS; ++w) a += s_red[w][i];
        const int g = i / head_dim, d = i - g * head_dim;
        part[(row_part + (i64)(h0 + g) * n_split + c_idx) * head_dim + d] = a;
    }
}

// Requirements: head_dim in {32, 64, 128, 256}; 1 <= gq <= 8, gq * head_dim <= 1024, gq divides
// group; n_head a multiple of n_head_kv; 1 <= chunk <= 256; k_cache and v_cache 16-byte aligned
// (each row then is: n_head_kv * head_dim * 2 bytes is a multiple of 64); blockDim (128, 1, 1).
// Otherwise the block stores NaN as its m and acc, so the merged rows read NaN.
// launch: grid (n_head / gq, n_split, n_tok), block (128, 1, 1), no dynamic shared memory
// (static: 8 KB of scores and 16 KB for the warps' sums). At most 128 registers a thread (the
// bound's 4 blocks a multiprocessor, as the host sizes the grid: 123-128 on sm_75..sm_120, no
// spills).
// q: [n_tok, n_head * head_dim] f32; k_cache, v_cache: [n_ctx, n_head_kv * head_dim] f16 holding
// positions 0..pos0 + n_tok; part: as above, n_split >= ceil((pos0 + n_tok) / chunk).
extern "C" __global__ void __launch_bounds__(128, 4)
    attention_split_f16kv(const float* __restrict__ q, const __half* __restrict__ k_cache,
                          const __half* __restrict__ v_cache, float* __restrict__ part, int n_tok,
                          int n_head, int n_head_kv, int head_dim, int pos0, float scale, int gq,
                          int chunk, int n_split) {
    __shared__ float s_p[FD_MAX_G][FD_MAX_CHUNK]; // scores, then exp(s - m)
    __shared__ __align__(16) float s_red[FD_WARPS][FD_MAX_GE];

    // The smallest G (registers a head) that holds gq (larger: the checks' NaN); U rows in
    // flight where they fit.
    if (gq <= 1) {
        fd_split_block<1, FD_UNROLL>(q, k_cache, v_cache, part, n_tok, n_head, n_head_kv,
                                     head_dim, pos0, scale, gq, chunk, n_split, s_p, s_red);
    } else if (gq <= 2) {
        fd_split_block<2, FD_UNROLL>(q, k_cache, v_cache, part, n_tok, n_head, n_head_kv,
                                     head_dim, pos0, scale, gq, chunk, n_split, s_p, s_red);
    } else if (gq <= 4) {
        fd_split_block<4, FD_UNROLL>(q, k_cache, v_cache, part, n_tok, n_head, n_head_kv,
                                     head_dim, pos0, scale, gq, chunk, n_split, s_p, s_red);
    } else {
        fd_split_block<8, FD_UNROLL / 2>(q, k_cache, v_cache, part, n_tok, n_head, n_head_kv,
                                         head_dim, pos0, scale, gq, chunk, n_split, s_p, s_red);
    }
}

// The merge: per (head h, token t), out = sum_c w_c acc_c / sum_c w_c l_c with
// w_c = exp(m_c - M), M = max_c m_c; chunks with m_c = -inf add nothing (chunk 0 always holds
// position 0, so M is finite unless a chunk stored NaN, which then reaches the output).
// Work layout: the block's threads take the chunks c = tid, tid + 128, ... for M and the
// denominator (block reductions in shared memory); then warp w sums the chunks c = w, w + 4, ...
// of acc, lane l dims l + 32e (every chunk's row read by coalesced loads, two chunks' loads in
// flight), and the 4 warps' sums are added in warp order. So the chunks are read in parallel
// rather than one after another (66 chunks at position 4095 on an H100 / H200).
// launch: grid (n_head, n_tok, 1), block (128, 1, 1) (else, or head_dim over 256 or not a
// multiple of 32, NaN rows).
// part: as attention_split_f16kv wrote it; out: [n_tok, n_head * head_dim] f32; out_q, out_aq,
// out_ads: null, or quantize_q8_1 (_split) of out as attention_f16kv's.
#define FM_WARPS 4 // the launch's 128 threads
#define FM_MAX_E 8 // dims a lane at most: head_dim 256

extern "C" __global__ void __launch_bounds__(128)
    attention_merge_f32(const float* __restrict__ part, float* __restrict__ out,
                        block_q8_1* __restrict__ out_q, i8* __restrict__ out_aq,
                        float2* __restrict__ out_ads, int n_tok, int n_head, int head_dim,
                        int n_split) {
    __shared__ float s_red[FM_WARPS];
    __shared__ int s_bad;
    __shared__ float s_o[FM_WARPS][32 * FM_MAX_E];
    const int h = blockIdx.x, t = blockIdx.y;
    if (h >= n_head || t >= n_tok || head_dim <= 0 || n_split <= 0) return;
    const i64 row = (i64)t * n_head + h;
    float* o = out + row * head_dim;
    const q8_sink oq = q8_sink{out_q, out_aq, out_ads}.at(row * (head_dim / QK));
    if (blockDim.x != 32 * FM_WARPS || head_dim % 32 || head_dim > 32 * FM_MAX_E) {
        for (int i = threadIdx.x; i < head_dim; i += blockDim.x) o[i] = FD_NAN;
        return;
    }
    const float* ml = part + (i64)n_tok * n_head * n_split * head_dim + row * n_split * 2;
    const float* acc = part + row * n_split * head_dim;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

    // 1. M, and whether a chunk stored NaN.
    float big = FD_NEG_INF;
    int bad = 0;
    for (int c = threadIdx.x; c < n_split; c += blockDim.x) {
        const float m = ml[2 * c];
        bad |= m != m;
        big = fmaxf(big, m);
    }
    big = warp_max(big);
    if (threadIdx.x == 0) s_bad = 0;
    __syncthreads();
    if (bad) s_bad = 1;
    if (lane == 0) s_red[warp] = big;
    __syncthreads();
    big = fmaxf(fmaxf(s_red[0], s_red[1]), fmaxf(s_red[2], s_red[3]));
    if (s_bad) big = FD_NAN;
    __syncthreads(); // s_red is reused

    // 2. The denominator, sum_c l_c w_c.
    float sum = 0.0f;
    for (int c = threadIdx.x; c < n_split; c += blockDim.x) {
        const float m = ml[2 * c];
        if (m != FD_NEG_INF) sum += ml[2 * c + 1] * expf(m - big);
    }
    sum = warp_sum(sum);
    if (lane == 0) s_red[warp] = sum;
    __syncthreads();
    sum = (s_red[0] + s_red[1]) + (s_red[2] + s_red[3]);
    const float inv = __frcp_rn(sum);

    // 3. sum_c w_c acc_c: warp w the chunks w, w + 4, ...; lane l dims l + 32e.
    const int E = head_dim >> 5;
    float a[FM_MAX_E];
#pragma unroll
    for (int e = 0; e < FM_MAX_E; ++e) a[e] = 0.0f;
#pragma unroll 2
    for (int c = warp; c < n_split; c += FM_WARPS) {
        const float m = ml[2 * c];
        const float w = m != FD_NEG_INF ? expf(m - big) : 0.0f;
        const float* ac = acc + (i64)c * head_dim + lane;
#pragma unroll
        for (int e = 0; e < FM_MAX_E; ++e) {
            if (e < E) a[e] = fmaf(ac[32 * e], w, a[e]);
        }
    }
#pragma unroll
    for (int e = 0; e < FM_MAX_E; ++e) {
        if (e < E) s_o[warp][lane + 32 * e] = a[e];
    }
    __syncthreads();
    write_row_q8_1(o, oq, head_dim, [&](int d) {
        return (((s_o[0][d] + s_o[1][d]) + s_o[2][d]) + s_o[3][d]) * inv;
    });
}

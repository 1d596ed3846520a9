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

#define FLP_NEG_INF (__int_as_float(0xff800000))
#define FLP_NAN (__int_as_float(0x7fc00000))

extern "C" __global__ void __launch_bounds__(128)
    attention_flash_f16kv(const float* __restrict__ q, const __half* __restrict__ k_cache,
                          const __half* __restrict__ v_cache, float* __restrict__ out, int n_tok,
                          int n_head, int n_head_kv, int head_dim, int pos0, float scale) {
    __shared__ __half s_k[FLP_BK][FLP_MAX_D + 2]; // + one word: row j starts at bank j + ...
    __shared__ __half s_v[FLP_BK][FLP_MAX_D];
    __shared__ __half s_q[FLP_BQ][FLP_MAX_D];

    const int h = blockIdx.y, t0 = blockIdx.x * FLP_BQ;
    if (h >= n_head || t0 >= n_tok || head_dim <= 0) return;
    const int t_end = min(t0 + FLP_BQ, n_tok);
    const bool ok = head_dim % 32 == 0 && head_dim <= FLP_MAX_D && n_head_kv > 0 &&
                    n_head % n_head_kv == 0 && blockDim.x == 32 * FLP_WARPS && blockDim.y == 1 &&
                    pos0 >= 0;
    if (!ok) {
        for (int i = threadIdx.x; i < (t_end - t0) * head_dim; i += blockDim.x) {
            const int t = t0 + i / head_dim, d = i % head_dim;
            out[((i64)t * n_head + h) * head_dim + d] = FLP_NAN;
        }
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
    for (int j0 = 0; j0 < n_kv; j0 += FLP_BK) {
        __syncthreads(); // the previous tile's readers are done (and the queries stored)
        for (int i = threadIdx.x; i < FLP_BK * head_dim; i += blockDim.x) {
            const int r = i / head_dim, d = i % head_dim, j = j0 + r;
            const bool in = j < n_kv;
            s_k[r][d] = in ? kb[(i64)j * kv_stride + d] : __float2half_rn(0.0f);
            s_v[r][d] = in ? vb[(i64)j * kv_stride + d] : __float2half_rn(0.0f);
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

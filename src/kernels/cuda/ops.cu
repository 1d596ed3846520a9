// ops.cu: the non-weight operators on f32 activations, rows of [n_tok, width] row-major:
// RMSNorm, RoPE, residual add, bias add, SwiGLU, f32 -> f16 copies into the KV cache, and causal
// grouped-query attention over the f16 KV cache. Meanings follow src/kernels/cpu/ops.rs and
// src/kernels/cpu/attention.rs. Where precision matters the code does not depend on the compiler
// options: RMSNorm's square root and division and RoPE's division are IEEE-rounded intrinsics,
// RoPE's power and sine/cosine are taken in double precision (--use_fast_math only swaps the
// single-precision functions). The softmax and SiLU exponentials are expf (__expf under
// --use_fast_math, a few ulp, which is fine there).

#include "common.cuh"

#define NEG_INF_F (__int_as_float(0xff800000))
#define NAN_F (__int_as_float(0x7fc00000))

// ---------------------------------------------------------------------------------------------
// RMSNorm

// Rows of up to ROW_REGS * blockDim.x values (8192 at 1024 threads) are held in registers, each
// thread's elements threadIdx.x + k * blockDim.x in v[k]: every load of the row (and of w, and of
// the added residual) is issued before the first result is needed, one memory round trip, where
// the loops below can wait for one each time round (the stores of y, which may be x, keep the
// compiler from moving later loads ahead; read from the code, not profiled). The per-thread sums
// run over the same elements in the same order either way, so both paths give the same bits
// (checked in the emulator). A decode row is one thread block on one multiprocessor, so its
// time is the longest thread's chain of dependent steps: the host (norm_block in
// cuda_backend.rs) gives a row four values a thread up to 1024 threads, so a 4096-value row's
// Q8_1 blocks take each thread 4 rounds of the block's reductions (q8_lane's max, the division,
// store_q8's sum), where 256 threads took 16 (the H200 timed 64 pairs of an RMSNorm with its
// Q8_1 blocks and an add, rows of 4096, at 850 us in a CUDA graph: 13 us a pair; four values a
// thread are not yet timed on a GPU). __launch_bounds__(1024, 1): at most 64 registers (48-64 on
// sm_75..sm_120, no spills; without the 1, ptxas gave rms_norm_f32 32 on sm_80 and spilled).
#define ROW_REGS 8

// One row of RMSNorm from registers: x the input row; with r, x + r (stored back to x), the
// residual add first; y = x / sqrt(mean(x^2) + eps) * w; with q also y's Q8_1 blocks, as
// write_row_q8_1 writes them. y may be x or r. Needs n <= ROW_REGS * blockDim.x and, with q,
// n a multiple of 32.
static __device__ __forceinline__ void norm_row_regs(float* x, const float* r,
                                                     const float* __restrict__ w, float* y,
                                                     q8_sink q, int n, float eps) {
    const int tid = threadIdx.x, bd = blockDim.x;
    float v[ROW_REGS], g[ROW_REGS];
#pragma unroll
    for (int k = 0; k < ROW_REGS; ++k) {
        const int i = tid + k * bd;
        if (i < n) {
            v[k] = x[i];
            if (r) v[k] += r[i];
            g[k] = w[i];
        }
    }
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < ROW_REGS; ++k) {
        const int i = tid + k * bd;
        if (i < n) {
            if (r) x[i] = v[k];
            sum += v[k] * v[k];
        }
    }
    const float scale = block_rms_scale(sum, n, eps);
#pragma unroll
    for (int k = 0; k < ROW_REGS; ++k) {
        // Warp-uniform with q (n and bd multiples of 32): the warp's 32 elements are one block.
        const int i = tid + k * bd;
        if (i < n) {
            const float val = v[k] * scale * g[k];
            y[i] = val;
            if (q.on()) store_q8(q.at(i >> 5), val);
        }
    }
}

// y = x / sqrt(mean(x^2) + eps) * w, row by row; y may be x. Sums in f32 (the CPU sums in f64).
// launch: grid (n_rows, 1, 1), block (B, 1, 1), B any multiple of 32 up to 1024.
// x: n_rows rows of n, x_stride (>= n) floats apart; y: [n_rows, n]; w: [n].
extern "C" __global__ void __launch_bounds__(1024, 1)
    rms_norm_f32(const float* x, const float* __restrict__ w, float* y, int n, float eps,
                 int x_stride) {
    const float* xr = x + (i64)blockIdx.x * x_stride;
    float* yr = y + (i64)blockIdx.x * n;
    if (n <= ROW_REGS * (int)blockDim.x) {
        norm_row_regs((float*)xr, nullptr, w, yr, {nullptr, nullptr, nullptr}, n, eps);
        return;
    }
    const float scale = row_rms_scale(xr, n, eps);
    // Each element is read and written by the same thread, so y == x is safe.
    for (int i = threadIdx.x; i < n; i += blockDim.x) yr[i] = xr[i] * scale * w[i];
}

// Row blockIdx.x of rms_norm_q8_1's outputs from its input row xr and scale: y (may be xr) and
// its Q8_1 blocks (q: the sink of the whole batch).
static __device__ __forceinline__ void norm_q8_1_row(const float* xr, float scale,
                                                     const float* __restrict__ w, float* y,
                                                     q8_sink q, int n) {
    write_row_q8_1(y + (i64)blockIdx.x * n, q.at((i64)blockIdx.x * (n / QK)), n,
                   [&](int i) { return xr[i] * scale * w[i]; });
}

// rms_norm_f32 and quantize_q8_1 of its output in one launch (decode's matrix-vector products
// read the blocks): y as rms_norm_f32 writes it, q as quantize_q8_1 of y writes it, and aq, ads
// as quantize_q8_1_split of y writes them, bit for bit (each of q and aq may be null; ads goes
// with aq).
// launch: grid (n_rows, 1, 1), block (B, 1, 1), B a multiple of 32 up to 1024; n a multiple
// of 32. x: as rms_norm_f32's; y: [n_rows, n] (may be x); w: [n]; q: [n_rows * n / 32]
// block_q8_1, 4-byte aligned; aq: [n_rows * n] i8; ads: [n_rows * n / 32] float2.
extern "C" __global__ void __launch_bounds__(1024, 1)
    rms_norm_q8_1(const float* x, const float* __restrict__ w, float* y,
                  block_q8_1* __restrict__ q, i8* __restrict__ aq, float2* __restrict__ ads,
                  int n, float eps, int x_stride) {
    const float* xr = x + (i64)blockIdx.x * x_stride;
    const q8_sink qs = {q, aq, ads};
    if (n <= ROW_REGS * (int)blockDim.x) {
        norm_row_regs((float*)xr, nullptr, w, y + (i64)blockIdx.x * n,
                      qs.at((i64)blockIdx.x * (n / QK)), n, eps);
        return;
    }
    norm_q8_1_row(xr, row_rms_scale(xr, n, eps), w, y, qs, n);
}

// The residual add and the RMSNorm after it in one launch (decode: the attention's or the FFN's
// output added to the residual stream, then the next norm): x += r, then rms_norm_q8_1 of the
// new x. x, y and q are what add_f32 and then rms_norm_q8_1 write, bit for bit.
// launch: grid (n_rows, 1, 1), block (B, 1, 1), B a multiple of 32 up to 1024; n a multiple
// of 32. x: [n_rows, n], the residual stream, updated in place; r: [n_rows, n]; w: [n];
// y: [n_rows, n] (may be x or r); q, aq, ads: as rms_norm_q8_1's.
extern "C" __global__ void __launch_bounds__(1024, 1)
    add_rms_norm_q8_1(float* x, const float* r, const float* __restrict__ w, float* y,
                      block_q8_1* __restrict__ q, i8* __restrict__ aq, float2* __restrict__ ads,
                      int n, float eps) {
    float* xr = x + (i64)blockIdx.x * n;
    const float* rr = r + (i64)blockIdx.x * n;
    const q8_sink qs = {q, aq, ads};
    if (n <= ROW_REGS * (int)blockDim.x) {
        norm_row_regs(xr, rr, w, y + (i64)blockIdx.x * n, qs.at((i64)blockIdx.x * (n / QK)), n,
                      eps);
        return;
    }
    for (int i = threadIdx.x; i < n; i += blockDim.x) xr[i] += rr[i];
    __syncthreads(); // the whole row's sums, for row_rms_scale's reads
    norm_q8_1_row(xr, row_rms_scale(xr, n, eps), w, y, qs, n);
}

// ---------------------------------------------------------------------------------------------
// RoPE

// In place on x: [n_tok, n_heads * head_dim], token t at position pos0 + t. Pair i (< n_dims / 2)
// rotates (i, i + n_dims / 2) when neox, else (2i, 2i + 1), by the angle
//   theta_i = (pos0 + t) * freq_scale * theta_scale^i,  theta_scale = freq_base^(-2 / n_dims),
// divided by freq_factors[i] when freq_factors is not null. theta_i is built by i successive f32
// multiplies, exactly as the CPU (and ggml's CPU) code does; theta_scale is the correctly
// rounded f32 of the double-precision power, and cos / sin of the f32 angle are evaluated in
// double precision and rounded (angles reach 3e4 radians at long contexts, where the f32 fast
// paths lose digits). The rotated dimensions start at dim_offset in each head (latent attention
// rotates a head's trailing dimensions); the others are untouched.
// launch: grid (n_heads, n_tok, 1), block (128, 1, 1) (any size works: a loop over pairs).
// rope_head and rope_shape_ok: common.cuh (split.cu's fused q/k/v kernels use them too, through
// rope_head_warp, which loads a lane's pairs before it rotates them: the same bits).

extern "C" __global__ void rope_f32(float* x, int n_tok, int n_heads, int head_dim, int n_dims,
                                    int pos0, float freq_base, float freq_scale, int neox,
                                    const float* __restrict__ freq_factors, int dim_offset) {
    const int h = blockIdx.x, t = blockIdx.y;
    if (h >= n_heads || t >= n_tok || !rope_shape_ok(head_dim, n_dims, dim_offset)) return;
    float* head = x + ((i64)t * n_heads + h) * head_dim + dim_offset;
    rope_head(head, nullptr, pos0 + t, n_dims, freq_base, freq_scale, neox, freq_factors);
}

// RoPE of a step's q and k fused with the KV store, in one launch: what rope_f32 on q
// ([n_tok, n_head * head_dim]), rope_f32 on k ([n_tok, n_head_kv * head_dim]) and store_kv_f16
// of k and v ([n_tok, n_head_kv * head_dim]) into ck, cv (the caches at position pos0) write,
// bit for bit: q and k rotated in place, ck = f16(rotated k), cv = f16(v). Blocks 0..n_head
// rotate q's heads, the next n_head_kv rotate k's heads and store them with v's.
// launch: grid (n_head + n_head_kv, n_tok, 1), block (128, 1, 1) (any size works).
extern "C" __global__ void rope_store_kv_f16(float* q, float* k, const float* __restrict__ v,
                                             __half* __restrict__ ck, __half* __restrict__ cv,
                                             int n_tok, int n_head, int n_head_kv, int head_dim,
                                             int n_dims, int pos0, float freq_base,
                                             float freq_scale, int neox,
                                             const float* __restrict__ freq_factors,
                                             int dim_offset) {
    const int h = blockIdx.x, t = blockIdx.y;
    if (h >= n_head + n_head_kv || t >= n_tok) return;
    const bool ok = rope_shape_ok(head_dim, n_dims, dim_offset);
    if (h < n_head) {
        if (ok) {
            float* head = q + ((i64)t * n_head + h) * head_dim + dim_offset;
            rope_head(head, nullptr, pos0 + t, n_dims, freq_base, freq_scale, neox, freq_factors);
        }
        return;
    }
    const i64 at = ((i64)t * n_head_kv + (h - n_head)) * head_dim;
    if (ok) {
        rope_head(k + at + dim_offset, ck + at + dim_offset, pos0 + t, n_dims, freq_base,
                  freq_scale, neox, freq_factors);
    }
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        if (!ok || d < dim_offset || d >= dim_offset + n_dims) ck[at + d] = __float2half_rn(k[at + d]);
        cv[at + d] = __float2half_rn(v[at + d]);
    }
}

// ---------------------------------------------------------------------------------------------
// Timing

// Keeps the GPU busy for about `us` microseconds and writes nothing: one thread sleeping 1 us
// at a time (__nanosleep's time is approximate, which does not matter here). The backend's
// stopwatch queues it before its start event, so the work it times has been queued by the host
// by the time the GPU reaches it, and the time measured is the GPU's, not the host's launches.
// launch: grid (1, 1, 1), block (32, 1, 1) (any).
extern "C" __global__ void gpu_sleep(int us) {
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        for (int i = 0; i < us; ++i) __nanosleep(1000);
    }
}

// ---------------------------------------------------------------------------------------------
// Element-wise (grid-stride; any grid, e.g. min(ceil(n / 256), 65535))

// x += y.
// launch: grid any, block (256, 1, 1).
extern "C" __global__ void add_f32(float* x, const float* y, i64 n) {
    GRID_STRIDE_LOOP(i, n) {
        x[i] += y[i];
    }
}

// x *= s (ggml_scale: one rounded multiply).
// launch: grid any, block (256, 1, 1).
extern "C" __global__ void scale_f32(float* x, float s, i64 n) {
    GRID_STRIDE_LOOP(i, n) {
        x[i] = __fmul_rn(x[i], s);
    }
}

// For each of `rows` rows r: dst[r * dst_stride + dst_col + c] =
// src[(r / src_rep) * src_stride + src_col + c], c < width (latent attention's key and value
// assembly; src_rep > 1 repeats a source row, the shared RoPE key, for every head).
// launch: grid any, block (256, 1, 1); n = rows * width.
extern "C" __global__ void copy_cols_f32(const float* __restrict__ src, float* __restrict__ dst,
                                         int width, int src_stride, int src_col, int src_rep,
                                         int dst_stride, int dst_col, i64 n) {
    GRID_STRIDE_LOOP(i, n) {
        const i64 r = i / width, c = i % width;
        dst[r * dst_stride + dst_col + c] = src[(r / src_rep) * src_stride + src_col + c];
    }
}

// x[i] += b[i % width] over n = n_rows * width elements.
// launch: grid any, block (256, 1, 1).
extern "C" __global__ void add_bias_f32(float* __restrict__ x, const float* __restrict__ b,
                                        int width, i64 n) {
    GRID_STRIDE_LOOP(i, n) {
        x[i] += b[i % width];
    }
}

// g = g / (1 + exp(-g)) * u (silu(g) * u).
// launch: grid any, block (256, 1, 1).
extern "C" __global__ void swiglu_f32(float* g, const float* u, i64 n) {
    GRID_STRIDE_LOOP(i, n) {
        const float v = g[i];
        g[i] = __fdiv_rn(v, 1.0f + expf(-v)) * u[i];
    }
}

// swiglu_f32 and quantize_q8_1 of its result in one launch (the input of ffn_down in decode): g
// as swiglu_f32 writes it, q as quantize_q8_1 of g writes it, aq and ads as quantize_q8_1_split
// writes them, bit for bit (q or aq may be null).
// launch: grid (ceil(n_blocks / 8), 1, 1), block (256, 1, 1): one warp per 32-element block.
// g, u: [n_blocks * 32]; q: [n_blocks] block_q8_1, 4-byte aligned; aq: [n_blocks * 32] i8; ads:
// [n_blocks] float2.
extern "C" __global__ void swiglu_q8_1(float* g, const float* u, block_q8_1* __restrict__ q,
                                       i8* __restrict__ aq, float2* __restrict__ ads,
                                       int n_blocks) {
    const i64 ib = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (ib >= n_blocks) return; // the whole warp leaves together
    const i64 i = ib * QK + (threadIdx.x & 31);
    const float v = g[i];
    const float r = __fdiv_rn(v, 1.0f + expf(-v)) * u[i];
    g[i] = r;
    store_q8(q8_sink{q, aq, ads}.at(ib), r);
}

// A step's K and V rows into the f16 cache in one launch: ck = f16(k), cv = f16(v), round to
// nearest even.
// launch: grid any, block (256, 1, 1). k, v: [n] f32; ck, cv: [n] f16.
extern "C" __global__ void store_kv_f16(const float* __restrict__ k, const float* __restrict__ v,
                                        __half* __restrict__ ck, __half* __restrict__ cv, i64 n) {
    GRID_STRIDE_LOOP(i, n) {
        ck[i] = __float2half_rn(k[i]);
        cv[i] = __float2half_rn(v[i]);
    }
}

// ---------------------------------------------------------------------------------------------
// Attention

#define ATT_MAX_WARPS 4 // the launch's 128 threads
#define ATT_MAX_E 8     // head_dim / 32 at most (head_dim <= 256)
#define ATT_TILE 8      // positions a warp scores at once

// Causal grouped-query attention over an f16 KV cache, one (head h, token t) per thread block:
//   out[t, h] = sum_j softmax_j(scale * q[t, h] . K[j, h / (n_head / n_head_kv)]) * V[j, ...]
// over positions j in 0..=pos0 + t. q: [n_tok, n_head * head_dim] f32 (after RoPE), rounded to
// f16 first as the CPU path does; k_cache, v_cache: [n_ctx, n_head_kv * head_dim] f16 holding
// positions 0..pos0 + n_tok; out: [n_tok, n_head * head_dim] f32.
//
// Each warp takes tiles of 8 positions in turn (tile i goes to warp i % 4) and keeps an online
// softmax (running max m, running sum l, f32 accumulators); lane l owns dimensions l + 32e. The
// warps' states are merged at the end through static shared memory (4.1 KB), so any context
// length works. The CPU rounds the softmax weights to f16 before the value sum; this kernel keeps
// them in f32 (online softmax never holds the normalised weights), so results agree to rounding,
// not bit for bit.
//
// head_dim must be a multiple of 32 and at most 256, and n_head a multiple of n_head_kv; otherwise
// (or with a block of other than 32..128 threads in whole warps) the kernel writes NaN into this
// (t, h)'s output row and touches nothing else.
// out_q: null, or [n_tok * n_head * head_dim / 32] block_q8_1 (4-byte aligned) that receives
// quantize_q8_1 of out (write_row_q8_1), bit for bit; out_aq, out_ads: null, or the same split as
// quantize_q8_1_split writes it ([n_tok * n_head * head_dim] i8, [.. / 32] float2).
// launch: grid (n_head, n_tok, 1), block (128, 1, 1), no dynamic shared memory.
extern "C" __global__ void __launch_bounds__(128)
    attention_f16kv(const float* __restrict__ q, const __half* __restrict__ k_cache,
                    const __half* __restrict__ v_cache, float* __restrict__ out,
                    block_q8_1* __restrict__ out_q, i8* __restrict__ out_aq,
                    float2* __restrict__ out_ads, int n_tok, int n_head, int n_head_kv,
                    int head_dim, int pos0, float scale) {
    __shared__ float sm_m[ATT_MAX_WARPS];
    __shared__ float sm_l[ATT_MAX_WARPS];
    __shared__ float sm_acc[ATT_MAX_WARPS][32 * ATT_MAX_E];

    const int h = blockIdx.x, t = blockIdx.y;
    if (h >= n_head || t >= n_tok || head_dim <= 0) return;
    float* o = out + ((i64)t * n_head + h) * head_dim;
    const int n_warps = blockDim.x >> 5;
    const bool ok = head_dim % 32 == 0 && head_dim <= 32 * ATT_MAX_E && n_head_kv > 0 &&
                    n_head % n_head_kv == 0 && (blockDim.x & 31) == 0 && n_warps >= 1 &&
                    n_warps <= ATT_MAX_WARPS && blockDim.y == 1 && pos0 >= 0;
    if (!ok) {
        for (int d = threadIdx.x; d < head_dim; d += blockDim.x) o[d] = NAN_F;
        return;
    }

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int E = head_dim >> 5;
    const int kvh = h / (n_head / n_head_kv);
    const i64 kv_stride = (i64)n_head_kv * head_dim;
    const __half* kb = k_cache + (i64)kvh * head_dim + lane;
    const __half* vb = v_cache + (i64)kvh * head_dim + lane;
    const int n_kv = pos0 + t + 1;

    const float* qr = q + ((i64)t * n_head + h) * head_dim + lane;
    float qv[ATT_MAX_E];
#pragma unroll
    for (int e = 0; e < ATT_MAX_E; ++e) {
        qv[e] = e < E ? __half2float(__float2half_rn(qr[32 * e])) : 0.0f;
    }

    float m = NEG_INF_F, l = 0.0f;
    float acc[ATT_MAX_E];
#pragma unroll
    for (int e = 0; e < ATT_MAX_E; ++e) acc[e] = 0.0f;

    for (int j0 = warp * ATT_TILE; j0 < n_kv; j0 += n_warps * ATT_TILE) {
        // Every K and V word of the tile's 8 positions is loaded before the first is used, so
        // the tile waits for the memory once: positions past n_kv load the last row again (no
        // branch around a position's loads; their scores are -inf below). The SASS of the
        // version that guarded each position's loads and products with `if (j0 + p < n_kv)`
        // (sm_90) waited for each position's loads before the next position's went out: 8
        // memory round trips a tile, at short contexts (32 blocks of a decode step) the kernel's
        // time. Then the scores of positions j0..j0 + 8, in the same order of f32 steps as
        // before. Branches are warp-uniform.
        __half kt[ATT_TILE][ATT_MAX_E], vt[ATT_TILE][ATT_MAX_E];
#pragma unroll
        for (int p = 0; p < ATT_TILE; ++p) {
            const i64 row = (i64)min(j0 + p, n_kv - 1) * kv_stride;
#pragma unroll
            for (int e = 0; e < ATT_MAX_E; ++e) {
                if (e < E) {
                    kt[p][e] = kb[row + 32 * e];
                    vt[p][e] = vb[row + 32 * e];
                }
            }
        }
        float s[ATT_TILE];
#pragma unroll
        for (int p = 0; p < ATT_TILE; ++p) {
            float part = 0.0f;
#pragma unroll
            for (int e = 0; e < ATT_MAX_E; ++e) {
                if (e < E) part = fmaf(__half2float(kt[p][e]), qv[e], part);
            }
            s[p] = part;
        }
        float m_tile = NEG_INF_F;
#pragma unroll
        for (int p = 0; p < ATT_TILE; ++p) {
            const float dot = warp_sum(s[p]); // all lanes, every p: the shuffles stay in step
            s[p] = j0 + p < n_kv ? dot * scale : NEG_INF_F;
            m_tile = fmaxf(m_tile, s[p]);
        }
        // Position j0 < n_kv is in the tile, so m_new is finite; exp(-inf) = 0 for a first tile.
        const float m_new = fmaxf(m, m_tile);
        const float corr = expf(m - m_new);
        l *= corr;
#pragma unroll
        for (int e = 0; e < ATT_MAX_E; ++e) acc[e] *= corr;
#pragma unroll
        for (int p = 0; p < ATT_TILE; ++p) {
            if (j0 + p < n_kv) {
                const float pw = expf(s[p] - m_new);
                l += pw;
#pragma unroll
                for (int e = 0; e < ATT_MAX_E; ++e) {
                    if (e < E) acc[e] = fmaf(pw, __half2float(vt[p][e]), acc[e]);
                }
            }
        }
        m = m_new;
    }

    // Merge the warps: weight each by exp(m_w - M), M the largest m_w; a warp that saw no
    // position has m_w = -inf, l_w = 0 and adds nothing.
    if (lane == 0) {
        sm_m[warp] = m;
        sm_l[warp] = l;
    }
#pragma unroll
    for (int e = 0; e < ATT_MAX_E; ++e) {
        if (e < E) sm_acc[warp][lane + 32 * e] = acc[e];
    }
    __syncthreads();
    float big = NEG_INF_F;
    for (int w = 0; w < n_warps; ++w) big = fmaxf(big, sm_m[w]);
    float f[ATT_MAX_WARPS];
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < ATT_MAX_WARPS; ++w) {
        f[w] = w < n_warps && sm_m[w] != NEG_INF_F ? expf(sm_m[w] - big) : 0.0f;
        if (w < n_warps) sum += sm_l[w] * f[w];
    }
    const float inv = __frcp_rn(sum);
    const q8_sink oq = q8_sink{out_q, out_aq, out_ads}.at(((i64)t * n_head + h) * (head_dim / QK));
    write_row_q8_1(o, oq, head_dim, [&](int d) {
        float a = 0.0f;
#pragma unroll
        for (int w = 0; w < ATT_MAX_WARPS; ++w) {
            if (w < n_warps) a += sm_acc[w][d] * f[w];
        }
        return a * inv;
    });
}

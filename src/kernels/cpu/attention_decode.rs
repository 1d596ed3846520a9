//! Attention for one to three tokens over the KV cache (decode) on CPUs with AVX2, FMA and F16C,
//! and for prompts three tokens at a time on CPUs without AVX-512's tiles ([`prompt`]), each
//! cache row read once for all the query heads that share it, in three steps:
//! 1. scores: each K row is widened once and dotted with every query of the group (its heads,
//!    each token);
//! 2. softmax of each (token, head) row;
//! 3. values: each V slice is widened once and added into the group's heads.
//!
//! Where a task per KV head (or per part of its group of query heads) gives every thread work,
//! one parallel pass takes each task through the three steps. Over a long cache with too few KV
//! heads for the threads, three parallel passes: scores by KV head and block of positions,
//! softmax by a few rows, values by KV head and 32 output elements.
//!
//! Each output is computed exactly as `attention::simd::attend_one_regs` computes it, so the
//! results are bit-identical with the scalar path: a score is `vec_dot_f16`'s four 8-lane FMA
//! chains over 32-element steps, `(c0 + c1) + (c2 + c3)`, `hsum8`, times the scale; softmax as
//! `ops::softmax` (its AVX-512 twin where the CPU has it); the weights rounded to f16; the output
//! one FMA per element and position, in position order.

#![allow(unsafe_op_in_unsafe_fn)]

use std::arch::x86_64::*;
use std::ops::Range;

use half::f16;

use crate::kernels::cpu::attention::AttnShape;
use crate::kernels::cpu::matmul::SharedOut;
use crate::kernels::cpu::{Isa, isa, pool};

/// Positions per scores task.
const POS_BLOCK: usize = 128;

/// Output elements per values task.
const DIM_BLOCK: usize = 32;

/// Below this many positions the passes run as one even where that gives fewer than two tasks
/// per thread (more threads than KV heads): where the three passes took over from the per-head
/// path before, which then cost less than three passes below it. Not re-measured against the
/// one pass at such thread counts.
const MIN_KV: usize = 256;

/// Whether [`attention`] takes this call: head sizes that are a multiple of 32 up to 128, one to
/// three tokens, on a CPU with AVX2, FMA and F16C.
pub fn supports(s: AttnShape, n_tok: usize, n_kv: usize) -> bool {
    s.head_dim.is_multiple_of(32)
        && s.head_dim <= 128
        && s.n_head_kv > 0
        && s.n_head.is_multiple_of(s.n_head_kv)
        && (1..4).contains(&n_tok)
        && n_kv > 0
        && isa() != Isa::Scalar
        && Isa::Avx2.supported()
}

/// As `attention::attention`, for calls [`supports`] takes.
pub fn attention(
    s: AttnShape,
    q: &[f32],
    k_cache: &[f16],
    v_cache: &[f16],
    pos0: usize,
    out: &mut [f32],
) {
    let (n_tok, q_dim) = checked(s, q, k_cache, v_cache, pos0, out);
    assert!(supports(s, n_tok, pos0 + n_tok));
    let n_kv_max = pos0 + n_tok;
    let n_rows = n_tok * s.n_head;
    let stride = n_kv_max.next_multiple_of(8);
    SCRATCH.with_borrow_mut(|(qr, p)| {
        // Queries rounded to f16 and widened, row (t, h) at (t * n_head + h) * hd.
        qr.clear();
        qr.extend_from_slice(&q[..n_tok * q_dim]);
        // SAFETY: F16C is present (supports).
        unsafe { round_f16(qr) };
        // Every entry a pass reads is written first (positions past a token's own are neither).
        p.resize(n_rows * stride, 0.0);
        passes(s, qr, p, k_cache, v_cache, pos0, n_tok, stride, out);
    });
}

/// A prompt's attention (any number of tokens) as [`attention`]'s, three tokens at a time, in one
/// parallel job: a task is one KV head and three tokens (the last one or two), taking the group's
/// heads through the three steps on its own with its scores in a buffer of its thread, the
/// tasks of the latest tokens (the longest) first. Each output has the bits of [`attention`]'s
/// for those three tokens (the same steps in the same order), so of the scalar path. Taken for
/// prompts on CPUs without AVX-512's tiles. Before, each three tokens were a call of
/// [`attention`], a parallel job of their own (from f94564c, where that replaced the per-head
/// path: 2 threads of a Zen 3 VM, pp512, 135M Q4_0 462-511 -> 593-594 t/s, F16 347-401 ->
/// 375-417, 1B Q4_0 95-112 -> 108-110): a pool dispatch per three tokens and layer, and threads
/// idle at each job's end.
pub fn prompt(
    s: AttnShape,
    q: &[f32],
    k_cache: &[f16],
    v_cache: &[f16],
    pos0: usize,
    out: &mut [f32],
) {
    let (n_tok, q_dim) = checked(s, q, k_cache, v_cache, pos0, out);
    assert!(supports(s, 3, pos0 + n_tok));
    let group = s.n_head / s.n_head_kv;
    let scale = 1.0 / (s.head_dim as f32).sqrt();
    let n_chunks = n_tok.div_ceil(3);
    let avx512 = isa() == Isa::Avx512;
    let os = SharedOut(out.as_mut_ptr());
    SCRATCH.with_borrow_mut(|(qr, _)| {
        qr.clear();
        qr.extend_from_slice(&q[..n_tok * q_dim]);
        // SAFETY: F16C is present (supports).
        unsafe { round_f16(qr) };
        let qr = &qr[..];
        pool::global().for_chunks(n_chunks * s.n_head_kv, 1, |items| {
            let os = &os;
            for idx in items {
                let (chunk, kvh) = (n_chunks - 1 - idx / s.n_head_kv, idx % s.n_head_kv);
                let t0 = 3 * chunk;
                let n = (n_tok - t0).min(3);
                let n_kv = pos0 + t0 + n;
                let stride = n_kv.next_multiple_of(8);
                TASK_SCORES.with_borrow_mut(|p| {
                    // Every entry the steps read is written first (as in `attention`).
                    if p.len() < n * s.n_head * stride {
                        p.resize(n * s.n_head * stride, 0.0);
                    }
                    let job = Scores {
                        s,
                        qr: &qr[t0 * q_dim..],
                        k_cache,
                        group,
                        n_tok: n,
                        pos0: pos0 + t0,
                        scale,
                        p: p.as_mut_ptr(),
                        stride,
                        avx512,
                    };
                    let steps = Steps {
                        s,
                        p: p.as_mut_ptr(),
                        stride,
                        v_cache,
                        pos0: pos0 + t0,
                        n_tok: n,
                        // SAFETY: tokens t0..t0 + n lie inside `out`.
                        out: unsafe { os.0.add(t0 * q_dim) },
                        avx512,
                    };
                    // SAFETY: AVX2, FMA and F16C are present (supports); the scores are this
                    // thread's, and the outputs of these tokens' heads of KV head kvh this
                    // task's alone.
                    unsafe {
                        job.run(kvh, 0..group, 0..n_kv);
                        for t in 0..n {
                            steps.softmax(t * s.n_head + kvh * group, group);
                        }
                        if avx512 {
                            steps.values_head(kvh, 0..group);
                        } else {
                            steps.values_rows_avx2(kvh);
                        }
                    }
                });
            }
        });
    });
}

/// The tokens of `out` and the size of a token's queries, after checking that the queries and
/// the cache hold them.
fn checked(
    s: AttnShape,
    q: &[f32],
    k_cache: &[f16],
    v_cache: &[f16],
    pos0: usize,
    out: &[f32],
) -> (usize, usize) {
    let q_dim = s.n_head * s.head_dim;
    let kv_dim = s.n_head_kv * s.head_dim;
    let n_tok = out.len() / q_dim;
    let n_kv_max = pos0 + n_tok;
    assert!(q.len() >= n_tok * q_dim);
    assert!(k_cache.len() >= n_kv_max * kv_dim && v_cache.len() >= n_kv_max * kv_dim);
    (n_tok, q_dim)
}

thread_local! {
    /// A [`prompt`] task's scores, kept per thread between tasks (apart from [`SCRATCH`], which
    /// the calling thread holds for the rounded queries while it runs tasks too).
    static TASK_SCORES: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

thread_local! {
    /// The calling thread's rounded queries and scores, kept between calls (one per layer and
    /// token in decode) so that no call allocates or clears them.
    static SCRATCH: std::cell::RefCell<(Vec<f32>, Vec<f32>)> = Default::default();
}

/// The passes of [`attention`] over the rounded queries `qr` and the scores `p`
/// (`n_tok * n_head` rows of `stride`): three parallel passes where positions must be split for
/// every thread to have work, else one, each task taking a KV head's queries (or part of them)
/// through all three steps, with no waits between them and its scores still in cache.
#[allow(clippy::too_many_arguments)]
fn passes(
    s: AttnShape,
    qr: &[f32],
    p: &mut [f32],
    k_cache: &[f16],
    v_cache: &[f16],
    pos0: usize,
    n_tok: usize,
    stride: usize,
    out: &mut [f32],
) {
    let hd = s.head_dim;
    let n_kv_max = pos0 + n_tok;
    let group = s.n_head / s.n_head_kv;
    let n_rows = n_tok * s.n_head;
    let pool = pool::global();
    let ps = SharedOut(p.as_mut_ptr());
    let os = SharedOut(out.as_mut_ptr());
    let avx512 = isa() == Isa::Avx512;
    let job = Scores {
        s,
        qr,
        k_cache,
        group,
        n_tok,
        pos0,
        scale: 1.0 / (hd as f32).sqrt(),
        p: ps.0,
        stride,
        avx512,
    };
    let steps = Steps {
        s,
        p: ps.0,
        stride,
        v_cache,
        pos0,
        n_tok,
        out: os.0,
        avx512,
    };
    let n_db = hd / DIM_BLOCK;
    let all = 0..group;

    // Parts of a group per task: enough tasks for two per thread, where the group allows.
    let threads = pool.n_threads();
    let parts = group.min((2 * threads).div_ceil(s.n_head_kv));
    if n_kv_max < MIN_KV || s.n_head_kv * parts >= 2 * threads {
        pool.for_chunks(s.n_head_kv * parts, 1, |items| {
            let (job, steps) = (&job, &steps);
            for idx in items {
                let (kvh, part) = (idx / parts, idx % parts);
                let heads = part * group / parts..(part + 1) * group / parts;
                // SAFETY: AVX2, FMA and F16C are present (supports); this task writes the score
                // rows and outputs of its KV head's heads `heads` only, disjoint across tasks.
                unsafe {
                    job.run(kvh, heads.clone(), 0..n_kv_max);
                    for t in 0..n_tok {
                        steps.softmax(t * s.n_head + kvh * group + heads.start, heads.len());
                    }
                    steps.values_head(kvh, heads.clone());
                }
            }
        });
        return;
    }

    let n_pb = n_kv_max.div_ceil(POS_BLOCK);
    pool.for_chunks(s.n_head_kv * n_pb, 1, |items| {
        let job = &job;
        for idx in items {
            let (kvh, b) = (idx / n_pb, idx % n_pb);
            let pos = b * POS_BLOCK..((b + 1) * POS_BLOCK).min(n_kv_max);
            // SAFETY: AVX2, FMA and F16C are present (supports); this task writes the scores of
            // its KV head's rows at its positions only, disjoint across tasks, inside `p`.
            unsafe { job.run(kvh, all.clone(), pos) };
        }
    });
    pool.for_chunks(n_rows, 4, |rows| {
        for r in rows {
            // SAFETY: row r is this task's alone; the CPU has what `supports` checks.
            unsafe { steps.softmax(r, 1) };
        }
    });
    pool.for_chunks(s.n_head_kv * n_db, 1, |items| {
        for idx in items {
            // SAFETY: these 32 elements of the KV head's heads are this task's alone.
            unsafe { steps.values(idx / n_db, idx % n_db, all.clone()) };
        }
    });
}

/// What the softmax and values steps share.
struct Steps<'a> {
    s: AttnShape,
    /// Scores, row (t, h) at `(t * n_head + h) * stride`.
    p: *mut f32,
    stride: usize,
    v_cache: &'a [f16],
    pos0: usize,
    n_tok: usize,
    out: *mut f32,
    avx512: bool,
}

// SAFETY: tasks touch disjoint rows of `p` and disjoint elements of `out`, which outlive the jobs.
unsafe impl Sync for Steps<'_> {}

impl Steps<'_> {
    /// Softmax of score rows `r..r + n`, of one token (`r / n_head`), their weights rounded to
    /// f16. The caller owns the rows, and the CPU has AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn softmax(&self, r: usize, n: usize) {
        let n_kv = self.pos0 + r / self.s.n_head + 1;
        let stride = self.stride;
        let rows = std::slice::from_raw_parts_mut(self.p.add(r * stride), n * stride);
        // Up to eight rows at a time, their f64 sums side by side; the weights rounded to f16.
        for rows in rows.chunks_mut(8 * stride) {
            let lens = &[n_kv; 8][..rows.len() / stride];
            if self.avx512 {
                // SAFETY: the CPU has AVX-512.
                super::attention_tiled::softmax_rows(rows, stride, lens);
            } else {
                super::avx2::softmax_rows(rows, stride, lens);
            }
        }
    }

    /// Output elements `32 * d..32 * (d + 1)` of KV head `kvh`'s heads `heads` (counted within
    /// the group), every token, from their weights. The caller owns those elements, and the CPU
    /// has AVX2, FMA and F16C.
    unsafe fn values(&self, kvh: usize, d: usize, heads: Range<usize>) {
        if self.avx512 {
            self.values_avx512(kvh, d, heads)
        } else {
            self.values_avx2(kvh, d, heads)
        }
    }

    /// Every output element of KV head `kvh`'s heads, every token, with sixteen vector
    /// registers: up to twelve (token, head) rows at a time, eight elements of each per pass
    /// over the positions ([`values_rows`]). By a pair of heads with 32 elements each, a
    /// prompt's three tokens and three heads took six passes, one of them with four
    /// accumulators (each FMA waiting on the one before). The caller owns those elements, and
    /// the CPU has AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn values_rows_avx2(&self, kvh: usize) {
        let s = self.s;
        let hd = s.head_dim;
        let group = s.n_head / s.n_head_kv;
        let n_rows = self.n_tok * group;
        let v = self.v_cache.as_ptr().add(kvh * hd);
        let kv_dim = s.n_head_kv * hd;
        let mut r0 = 0;
        while r0 < n_rows {
            let n = (n_rows - r0).min(ROWS_MAX);
            // Row r: token r / group (in order, so the batch's last row sees the most
            // positions), head r % group of the KV head.
            let rows = |i: usize| {
                let (t, g) = ((r0 + i) / group, (r0 + i) % group);
                let h = kvh * group + g;
                let w = self.p.add((t * s.n_head + h) * self.stride).cast_const();
                let o = self.out.add(t * s.n_head * hd + h * hd);
                (w, o, self.pos0 + t + 1)
            };
            // SAFETY: each row's weights hold the positions it sees (the scores step wrote
            // them), its output `hd` elements of this task's alone, and the cache every position
            // of the KV head (`checked`); the CPU has AVX2, FMA and F16C (this function's).
            macro_rules! call {
                ($($n:literal)*) => {
                    match n {
                        $($n => values_rows::<$n>(std::array::from_fn(rows), v, kv_dim, hd),)*
                        _ => unreachable!("at most {ROWS_MAX} rows a pass"),
                    }
                };
            }
            call!(1 2 3 4 5 6 7 8 9 10 11 12);
            r0 += n;
        }
    }

    /// [`Steps::values`] with sixteen vector registers: two heads at a time (four would spill
    /// their sixteen sums).
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn values_avx2(&self, kvh: usize, d: usize, heads: Range<usize>) {
        self.values_in::<2, false>(kvh, d, heads)
    }

    /// [`Steps::values`] with the same 8-lane arithmetic in AVX-512's thirty-two registers:
    /// four heads at a time.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
    unsafe fn values_avx512(&self, kvh: usize, d: usize, heads: Range<usize>) {
        self.values_in::<4, false>(kvh, d, heads)
    }

    /// Every output element of KV head `kvh`'s heads `heads`: on AVX-512, 64 elements (two
    /// blocks of 32) per pass over the positions, in 512-bit registers (each lane the same FMA
    /// in the same order, so the same bits), four heads at a time; else [`Steps::values`] block
    /// by block. The caller owns those elements, and the CPU has AVX2, FMA and F16C.
    unsafe fn values_head(&self, kvh: usize, heads: Range<usize>) {
        let n_db = self.s.head_dim / DIM_BLOCK;
        let mut d = 0;
        if self.avx512 {
            while d + 2 <= n_db {
                self.values_wide(kvh, d, heads.clone());
                d += 2;
            }
        }
        for d in d..n_db {
            self.values(kvh, d, heads.clone());
        }
    }

    /// Output elements `32 * d..32 * (d + 2)` of KV head `kvh`'s heads `heads`, every token,
    /// with AVX-512: [`values`] in 512-bit registers, four heads at a time.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
    unsafe fn values_wide(&self, kvh: usize, d: usize, heads: Range<usize>) {
        self.values_in::<4, true>(kvh, d, heads)
    }

    /// [`Steps::values`], up to `W` heads at a time: 32 output elements ([`values`] in 256-bit
    /// registers), or with `WIDE` 64 (in 512-bit ones, AVX-512 only).
    #[inline(always)]
    unsafe fn values_in<const W: usize, const WIDE: bool>(
        &self,
        kvh: usize,
        d: usize,
        heads: Range<usize>,
    ) {
        let s = self.s;
        let (hd, stride) = (s.head_dim, self.stride);
        let (q_dim, kv_dim) = (s.n_head * hd, s.n_head_kv * hd);
        let group = s.n_head / s.n_head_kv;
        let v0 = kvh * hd + d * DIM_BLOCK;
        let v_cache = self.v_cache;
        for t in 0..self.n_tok {
            let n_kv = self.pos0 + t + 1;
            let mut g = heads.start;
            while g < heads.end {
                let n = (heads.end - g).min(W);
                let h0 = kvh * group + g;
                let w = std::slice::from_raw_parts(
                    self.p.add((t * s.n_head + h0) * stride),
                    (n - 1) * stride + n_kv,
                );
                let o = self.out.add(t * q_dim + h0 * hd + d * DIM_BLOCK);
                // Direct calls, inlined here with this function's target features.
                macro_rules! call {
                    ($v:ty) => {
                        match n {
                            1 => values::<$v, 1>(w, stride, v_cache, v0, kv_dim, n_kv, o, hd),
                            2 => values::<$v, 2>(w, stride, v_cache, v0, kv_dim, n_kv, o, hd),
                            3 => values::<$v, 3>(w, stride, v_cache, v0, kv_dim, n_kv, o, hd),
                            _ => values::<$v, 4>(w, stride, v_cache, v0, kv_dim, n_kv, o, hd),
                        }
                    };
                }
                if WIDE {
                    call!(__m512)
                } else {
                    call!(__m256)
                }
                g += n;
            }
        }
    }
}

/// Rows per pass of [`values_rows`]: twelve accumulators, the cache's eight values and a weight.
const ROWS_MAX: usize = 12;

/// `N` (token, head) rows' outputs, eight elements at a time: for each position in order,
/// `o = fma(w[j], v[j], o)` ([`values`]' FMAs, so the same bits). Row r: its weights, its output
/// and how many positions it sees, rows in token order (the last sees the most); `v`: the KV
/// head's first cache row, `kv_dim` elements apart. Inlined into AVX2 code.
#[inline(always)]
unsafe fn values_rows<const N: usize>(
    rows: [(*const f32, *mut f32, usize); N],
    v: *const f16,
    kv_dim: usize,
    hd: usize,
) {
    let common = rows[0].2;
    let most = rows[N - 1].2;
    for e in (0..hd).step_by(8) {
        let mut acc = [_mm256_setzero_ps(); N];
        let mut at = v.add(e);
        for j in 0..common {
            let x = load8(at, 0);
            for (r, a) in acc.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(_mm256_set1_ps(*rows[r].0.add(j)), x, *a);
            }
            at = at.add(kv_dim);
        }
        // The later tokens' last positions.
        for j in common..most {
            let x = load8(at, 0);
            for (r, a) in acc.iter_mut().enumerate() {
                if j < rows[r].2 {
                    *a = _mm256_fmadd_ps(_mm256_set1_ps(*rows[r].0.add(j)), x, *a);
                }
            }
            at = at.add(kv_dim);
        }
        for (r, a) in acc.iter().enumerate() {
            _mm256_storeu_ps(rows[r].1.add(e), *a);
        }
    }
}

/// Eight f16 values from `x` at element `i`, widened.
#[inline(always)]
unsafe fn load8(x: *const f16, i: usize) -> __m256 {
    _mm256_cvtph_ps(_mm_loadu_si128(x.add(i).cast()))
}

/// What every scores task shares.
struct Scores<'a> {
    s: AttnShape,
    /// Queries rounded to f16 and widened, row (t, h) at `(t * n_head + h) * head_dim`.
    qr: &'a [f32],
    k_cache: &'a [f16],
    group: usize,
    n_tok: usize,
    pos0: usize,
    scale: f32,
    /// Scores, row (t, h) at `(t * n_head + h) * stride`.
    p: *mut f32,
    stride: usize,
    /// The CPU has AVX-512 (thirty-two vector registers).
    avx512: bool,
}

// SAFETY: tasks write disjoint rows and positions of `p`, which outlives the parallel loop.
unsafe impl Sync for Scores<'_> {}

impl Scores<'_> {
    /// Scores of KV head `kvh`'s query rows (of its heads `heads`, counted within the group) at
    /// positions `pos`; a token's positions past its own
    /// are skipped. Eight positions at a time: their K rows widened once, then each query's
    /// eight dots reduced together.
    /// The CPU has AVX2, FMA and F16C.
    unsafe fn run(&self, kvh: usize, heads: Range<usize>, pos: Range<usize>) {
        if self.avx512 {
            self.run_avx512(kvh, heads, pos)
        } else {
            self.run_avx2(kvh, heads, pos)
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn run_avx2(&self, kvh: usize, heads: Range<usize>, pos: Range<usize>) {
        self.run_any(kvh, heads, pos)
    }

    /// [`Scores::run`] with the same 8-lane arithmetic in AVX-512's thirty-two registers.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
    unsafe fn run_avx512(&self, kvh: usize, heads: Range<usize>, pos: Range<usize>) {
        self.run_any(kvh, heads, pos)
    }

    #[inline(always)]
    unsafe fn run_any(&self, kvh: usize, heads: Range<usize>, pos: Range<usize>) {
        match self.s.head_dim / 32 {
            1 => self.run_s::<1>(kvh, heads, pos),
            2 => self.run_s::<2>(kvh, heads, pos),
            3 => self.run_s::<3>(kvh, heads, pos),
            _ => self.run_s::<4>(kvh, heads, pos),
        }
    }

    /// [`Scores::run`] for head size `32 * S`.
    #[inline(always)]
    unsafe fn run_s<const S: usize>(&self, kvh: usize, heads: Range<usize>, pos: Range<usize>) {
        let Scores {
            s,
            qr,
            k_cache,
            group,
            n_tok,
            pos0,
            scale,
            p,
            stride,
            ..
        } = *self;
        use crate::kernels::cpu::avx2::{hsum8, hsum8x8};
        let hd = 32 * S;
        let kv_dim = s.n_head_kv * hd;
        let kbase = k_cache.as_ptr().add(kvh * hd);
        let vscale = _mm256_set1_ps(scale);
        // Eight widened K rows.
        let mut kw = [[0f32; 128]; 8];
        let mut j = pos.start;
        while j + 8 <= pos.end {
            for (r, row) in kw.iter_mut().enumerate() {
                let src = kbase.add((j + r) * kv_dim);
                for c in 0..4 * S {
                    _mm256_storeu_ps(row.as_mut_ptr().add(8 * c), load8(src, 8 * c));
                }
            }
            for t in 0..n_tok {
                // Positions j..j + 8 that token t sees (all of them but at its end).
                let seen = (pos0 + t + 1).saturating_sub(j).min(8);
                if seen == 0 {
                    continue;
                }
                for g in heads.clone() {
                    let row = t * s.n_head + kvh * group + g;
                    let q = qr.as_ptr().add(row * hd);
                    // A loop, not `array::from_fn`: a closure would not get the caller's
                    // target features, and the intrinsics would become calls.
                    let mut d = [_mm256_setzero_ps(); 8];
                    for (x, row) in d.iter_mut().zip(&kw) {
                        *x = dot::<S>(q, row.as_ptr());
                    }
                    let sums = _mm256_mul_ps(hsum8x8(d), vscale);
                    let out = p.add(row * stride + j);
                    if seen == 8 {
                        _mm256_storeu_ps(out, sums);
                    } else {
                        let mut tmp = [0f32; 8];
                        _mm256_storeu_ps(tmp.as_mut_ptr(), sums);
                        std::ptr::copy_nonoverlapping(tmp.as_ptr(), out, seen);
                    }
                }
            }
            j += 8;
        }
        // The last positions one at a time.
        for j in j..pos.end {
            let src = kbase.add(j * kv_dim);
            for c in 0..4 * S {
                _mm256_storeu_ps(kw[0].as_mut_ptr().add(8 * c), load8(src, 8 * c));
            }
            for t in 0..n_tok {
                if j > pos0 + t {
                    continue;
                }
                for g in heads.clone() {
                    let row = t * s.n_head + kvh * group + g;
                    let q = qr.as_ptr().add(row * hd);
                    *p.add(row * stride + j) = hsum8(dot::<S>(q, kw[0].as_ptr())) * scale;
                }
            }
        }
    }
}

/// One query's dot with a widened K row of `32 * S` elements, before the horizontal sum: the four
/// chains of `vec_dot_f16`, `(c0 + c1) + (c2 + c3)`. Inlined into the caller's AVX2 code.
#[inline(always)]
unsafe fn dot<const S: usize>(q: *const f32, k: *const f32) -> __m256 {
    let mut acc = [_mm256_setzero_ps(); 4];
    for step in 0..S {
        for (c, a) in acc.iter_mut().enumerate() {
            let i = 32 * step + 8 * c;
            *a = _mm256_fmadd_ps(_mm256_loadu_ps(k.add(i)), _mm256_loadu_ps(q.add(i)), *a);
        }
    }
    _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]))
}

/// Rounds `x` to f16 and back, as `f16::from_f32(x).to_f32()` (round to nearest even).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn round_f16(x: &mut [f32]) {
    let (chunks, tail) = x.as_chunks_mut::<8>();
    for c in chunks {
        let v = _mm256_loadu_ps(c.as_ptr());
        let r = _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v));
        _mm256_storeu_ps(c.as_mut_ptr(), r);
    }
    for v in tail {
        *v = f16::from_f32(*v).to_f32();
    }
}

/// An f32 register for [`values`] at two widths: eight lanes (AVX2) or sixteen (AVX-512). Every
/// method is `inline(always)` and carries no target features of its own, so it takes its
/// caller's.
trait Lanes: Copy {
    const LANES: usize;
    unsafe fn zero() -> Self;
    /// `LANES` f16 values from `x` at element `i`, widened.
    unsafe fn load(x: *const f16, i: usize) -> Self;
    unsafe fn splat(v: f32) -> Self;
    /// `a * b + c`, one rounding.
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self;
    unsafe fn store(self, o: *mut f32);
}

impl Lanes for __m256 {
    const LANES: usize = 8;
    #[inline(always)]
    unsafe fn zero() -> Self {
        _mm256_setzero_ps()
    }
    #[inline(always)]
    unsafe fn load(x: *const f16, i: usize) -> Self {
        load8(x, i)
    }
    #[inline(always)]
    unsafe fn splat(v: f32) -> Self {
        _mm256_set1_ps(v)
    }
    #[inline(always)]
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
        _mm256_fmadd_ps(a, b, c)
    }
    #[inline(always)]
    unsafe fn store(self, o: *mut f32) {
        _mm256_storeu_ps(o, self)
    }
}

impl Lanes for __m512 {
    const LANES: usize = 16;
    #[inline(always)]
    unsafe fn zero() -> Self {
        _mm512_setzero_ps()
    }
    #[inline(always)]
    unsafe fn load(x: *const f16, i: usize) -> Self {
        _mm512_cvtph_ps(_mm256_loadu_si256(x.add(i).cast()))
    }
    #[inline(always)]
    unsafe fn splat(v: f32) -> Self {
        _mm512_set1_ps(v)
    }
    #[inline(always)]
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
        _mm512_fmadd_ps(a, b, c)
    }
    #[inline(always)]
    unsafe fn store(self, o: *mut f32) {
        _mm512_storeu_ps(o, self)
    }
}

/// `N` consecutive heads' outputs at `4 * V::LANES` elements (32 in 256-bit registers, 64 in
/// 512-bit ones): for each position in order, `o = fma(w_h[j], v[j], o)`, so each element gets
/// the same FMAs in the same order at either width. `w`: the first head's weights, the next
/// heads' `stride` apart; `v0`: the element of a cache row where the slice starts; `o`: the
/// first head's output slice, the next heads' `hd` apart.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn values<V: Lanes, const N: usize>(
    w: &[f32],
    stride: usize,
    v_cache: &[f16],
    v0: usize,
    kv_dim: usize,
    n_kv: usize,
    o: *mut f32,
    hd: usize,
) {
    let l = V::LANES;
    assert!(w.len() >= (N - 1) * stride + n_kv);
    assert!(v_cache.len() >= (n_kv - 1) * kv_dim + v0 + 4 * l);
    let mut acc = [[V::zero(); 4]; N];
    let vp = v_cache.as_ptr().add(v0);
    let wp = w.as_ptr();
    for j in 0..n_kv {
        let row = vp.add(j * kv_dim);
        // Not `array::from_fn` or a closure: they would not get the caller's target features.
        let v = [
            V::load(row, 0),
            V::load(row, l),
            V::load(row, 2 * l),
            V::load(row, 3 * l),
        ];
        for (h, a) in acc.iter_mut().enumerate() {
            let pj = V::splat(*wp.add(h * stride + j));
            for c in 0..4 {
                a[c] = V::fma(pj, v[c], a[c]);
            }
        }
    }
    for (h, a) in acc.iter().enumerate() {
        for (c, x) in a.iter().enumerate() {
            x.store(o.add(h * hd + l * c));
        }
    }
}

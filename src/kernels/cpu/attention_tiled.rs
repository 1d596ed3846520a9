//! Causal attention for prompts on AVX-512 CPUs. The cache rows the prompt attends to are widened
//! to f32 once per call; then one item is one KV head and up to [`TOKENS`] tokens, and its
//! queries (the group's heads for each token) read every K and V row while it is in L1.
//!
//! Each output is computed as `attention::simd::attend_one_regs` computes it, so the results are
//! bit-identical with the scalar path:
//! - a score is `vec_dot_f16`'s four 8-lane FMA chains over 32-element steps (K rows and queries
//!   are stored with chains 0 and 2 in one register, 1 and 3 in the other, so one add gives
//!   `c0 + c1 | c2 + c3`), then `(c0 + c1) + (c2 + c3)` and `hsum8`'s pairs, done for eight
//!   positions at once by shuffles that add exactly the same pairs, then `* scale`;
//! - softmax as `ops::softmax`, the weights rounded to f16;
//! - the output is one FMA per element and position, in position order.

#![allow(unsafe_op_in_unsafe_fn)]

use std::arch::x86_64::*;

use half::f16;

use crate::kernels::cpu::attention::AttnShape;
use crate::kernels::cpu::matmul::SharedOut;
use crate::kernels::cpu::pool;

/// Tokens per item: with the test model's three heads per KV head, twelve queries share each row.
const TOKENS: usize = 4;

/// Bytes of K (or V) rows per position block, read by every query of an item from L1.
const BLOCK_BYTES: usize = 16 << 10;

/// Sixteen f32 lanes, aligned as a 512-bit register.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Lanes16([f32; 16]);

const ZERO: Lanes16 = Lanes16([0.0; 16]);

/// Whether [`attention`] takes these shapes: head sizes that are a multiple of 32 up to 128.
pub fn supports(s: AttnShape) -> bool {
    matches!(s.head_dim, 32 | 64 | 96 | 128) && s.n_head_kv > 0
}

/// As `attention::attention`, for shapes [`supports`] takes, on a CPU with AVX-512.
pub fn attention(
    s: AttnShape,
    q: &[f32],
    k_cache: &[f16],
    v_cache: &[f16],
    pos0: usize,
    out: &mut [f32],
) {
    assert!(supports(s) && crate::kernels::cpu::Isa::Avx512.supported());
    // SAFETY: the CPU has AVX-512 (asserted above).
    match s.head_dim / 32 {
        1 => unsafe { run::<1>(s, q, k_cache, v_cache, pos0, out) },
        2 => unsafe { run::<2>(s, q, k_cache, v_cache, pos0, out) },
        3 => unsafe { run::<3>(s, q, k_cache, v_cache, pos0, out) },
        4 => unsafe { run::<4>(s, q, k_cache, v_cache, pos0, out) },
        _ => unreachable!("supports() admits head sizes 32, 64, 96 and 128 only"),
    }
}

/// Pointer to a buffer that tasks fill in disjoint ranges.
struct SharedLanes(*mut Lanes16);
// SAFETY: tasks write disjoint ranges; the buffer outlives the parallel loop.
unsafe impl Sync for SharedLanes {}

/// Positions 0..n_pos of every KV head widened to f32: K rows with each 32-element step as
/// (elements 0..8, 16..24), (8..16, 24..32); V rows in order. Layout `[head][pos][2 * S]`, with
/// `rows` >= n_pos + 8 rows per head (the rows past n_pos are zero), so eight consecutive
/// positions from any position attended are one slice.
struct Widened {
    k: Vec<Lanes16>,
    v: Vec<Lanes16>,
    rows: usize,
}

impl Widened {
    /// Rows `pos..pos + n` of head `head`.
    fn rows<'a, const S: usize>(
        &self,
        buf: &'a [Lanes16],
        head: usize,
        pos: usize,
        n: usize,
    ) -> &'a [Lanes16] {
        debug_assert!(pos + n <= self.rows);
        let at = (head * self.rows + pos) * 2 * S;
        &buf[at..at + n * 2 * S]
    }
}

/// Sixteen f16 values at `a` (elements 0..8) and `b` (8..16) as f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn widen_two(a: &[f16], b: &[f16]) -> __m512 {
    debug_assert!(a.len() >= 8 && b.len() >= 8);
    let lo = _mm_loadu_si128(a.as_ptr().cast());
    let hi = _mm_loadu_si128(b.as_ptr().cast());
    _mm512_cvtph_ps(_mm256_inserti128_si256::<1>(_mm256_castsi128_si256(lo), hi))
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn widen_cache<const S: usize>(
    s: AttnShape,
    k_cache: &[f16],
    v_cache: &[f16],
    n_pos: usize,
) -> Widened {
    let (hd, kv_dim) = (s.head_dim, s.n_head_kv * s.head_dim);
    assert!(k_cache.len() >= n_pos * kv_dim && v_cache.len() >= n_pos * kv_dim);
    let rows = n_pos.next_multiple_of(8) + 8;
    let len = s.n_head_kv * rows * 2 * S;
    let (mut k, mut v) = (vec![ZERO; len], vec![ZERO; len]);
    let (kp, vp) = (SharedLanes(k.as_mut_ptr()), SharedLanes(v.as_mut_ptr()));
    pool::global().for_chunks(n_pos, 64, |positions| {
        let (kp, vp) = (&kp, &vp);
        for pos in positions {
            for h in 0..s.n_head_kv {
                let at = pos * kv_dim + h * hd;
                let (kr, vr) = (&k_cache[at..at + hd], &v_cache[at..at + hd]);
                let dst = (h * rows + pos) * 2 * S;
                for st in 0..S {
                    let e = 32 * st;
                    // SAFETY: row (h, pos) is dst..dst + 2S, inside the buffers and written by
                    // this task only (positions are disjoint across tasks).
                    let (ka, kb) = (
                        widen_two(&kr[e..], &kr[e + 16..]),
                        widen_two(&kr[e + 8..], &kr[e + 24..]),
                    );
                    _mm512_store_ps(kp.0.add(dst + 2 * st).cast(), ka);
                    _mm512_store_ps(kp.0.add(dst + 2 * st + 1).cast(), kb);
                    let (va, vb) = (
                        widen_two(&vr[e..], &vr[e + 8..]),
                        widen_two(&vr[e + 16..], &vr[e + 24..]),
                    );
                    _mm512_store_ps(vp.0.add(dst + 2 * st).cast(), va);
                    _mm512_store_ps(vp.0.add(dst + 2 * st + 1).cast(), vb);
                }
            }
        }
    });
    Widened { k, v, rows }
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn run<const S: usize>(
    s: AttnShape,
    q: &[f32],
    k_cache: &[f16],
    v_cache: &[f16],
    pos0: usize,
    out: &mut [f32],
) {
    let hd = 32 * S;
    let q_dim = s.n_head * hd;
    let n_tok = out.len() / q_dim;
    assert!(q.len() >= n_tok * q_dim && s.n_head.is_multiple_of(s.n_head_kv));
    let n_pos = pos0 + n_tok;
    let wide = widen_cache::<S>(s, k_cache, v_cache, n_pos);
    let group = s.n_head / s.n_head_kv;
    let n_blocks = n_tok.div_ceil(TOKENS);
    let shared = SharedOut(out.as_mut_ptr());
    let scale = 1.0 / (hd as f32).sqrt();
    pool::global().for_chunks(n_blocks * s.n_head_kv, 1, |items| {
        let shared = &shared;
        let mut scratch = Scratch::default();
        for idx in items {
            // The last tokens (the most positions) first, so the threads finish together.
            let tb = n_blocks - 1 - idx / s.n_head_kv;
            let kvh = idx % s.n_head_kv;
            let toks = tb * TOKENS..((tb + 1) * TOKENS).min(n_tok);
            let item = ItemRef {
                s,
                kvh,
                group,
                toks,
                pos0,
                scale,
                wide: &wide,
            };
            // SAFETY: the CPU has AVX-512 (this function's contract); the item writes the
            // output rows of its tokens and its KV head's query heads only, disjoint across items.
            unsafe { item.run::<S>(q, shared, &mut scratch) };
        }
    });
}

/// Buffers reused across one task's items.
#[derive(Default)]
struct Scratch {
    /// Queries rounded to f16 and widened, laid out as the K rows: `[query][2 * S]`.
    q: Vec<Lanes16>,
    /// Scores, then weights: `[query][n_kv rounded up to 8]`.
    p: Vec<f32>,
}

/// One item: the query heads of KV head `kvh` for tokens `toks`.
struct ItemRef<'a> {
    s: AttnShape,
    kvh: usize,
    group: usize,
    toks: std::ops::Range<usize>,
    pos0: usize,
    scale: f32,
    wide: &'a Widened,
}

impl ItemRef<'_> {
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn run<const S: usize>(&self, q: &[f32], out: &SharedOut, sc: &mut Scratch) {
        let hd = 32 * S;
        let q_dim = self.s.n_head * hd;
        let n_q = self.toks.len() * self.group;
        let n_kv_max = self.pos0 + self.toks.end;
        let stride = n_kv_max.next_multiple_of(8);
        // Query i * group + g: token toks.start + i, head kvh * group + g.
        sc.q.clear();
        sc.q.resize(n_q * 2 * S, ZERO);
        for (i, t) in self.toks.clone().enumerate() {
            for g in 0..self.group {
                let h = self.kvh * self.group + g;
                let src = &q[t * q_dim + h * hd..t * q_dim + (h + 1) * hd];
                let dst = &mut sc.q[(i * self.group + g) * 2 * S..][..2 * S];
                for st in 0..S {
                    let e = 32 * st;
                    let part = |a: usize| {
                        let x = _mm256_loadu_ps(src[e + a..e + a + 8].as_ptr());
                        _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x))
                    };
                    let (a, b) = (
                        _mm512_insertf32x8::<1>(_mm512_castps256_ps512(part(0)), part(16)),
                        _mm512_insertf32x8::<1>(_mm512_castps256_ps512(part(8)), part(24)),
                    );
                    _mm512_store_ps(dst[2 * st].0.as_mut_ptr(), a);
                    _mm512_store_ps(dst[2 * st + 1].0.as_mut_ptr(), b);
                }
            }
        }
        sc.p.clear();
        sc.p.resize(n_q * stride, 0.0);
        let block = (BLOCK_BYTES / (hd * 4)).max(8) / 8 * 8;
        let n_kv = |i: usize| self.pos0 + self.toks.start + i + 1;

        // Scores, eight positions at a time (those past a query's last are computed and dropped).
        let wide = self.wide;
        let mut b0 = 0;
        while b0 < n_kv_max {
            let b1 = (b0 + block).min(n_kv_max);
            for qi in 0..n_q {
                let end = n_kv(qi / self.group).min(b1);
                let qv = &sc.q[qi * 2 * S..][..2 * S];
                let mut j = b0;
                while j < end {
                    let k8 = wide.rows::<S>(&wide.k, self.kvh, j, 8);
                    let s8 = scores8::<S>(qv, k8, self.scale);
                    _mm256_storeu_ps(sc.p[qi * stride + j..][..8].as_mut_ptr(), s8);
                    j += 8;
                }
            }
            b0 = b1;
        }
        let lens: Vec<usize> = (0..n_q).map(|qi| n_kv(qi / self.group)).collect();
        softmax_rows(&mut sc.p, stride, &lens);

        // Weighted sums of the values into the output rows, per token its heads together.
        let max_heads = 8 / S;
        let mut b0 = 0;
        while b0 < n_kv_max {
            let b1 = (b0 + block).min(n_kv_max);
            for (i, t) in self.toks.clone().enumerate() {
                let end = n_kv(i).min(b1);
                if b0 >= end {
                    continue;
                }
                let mut g = 0;
                while g < self.group {
                    let n = (self.group - g).min(max_heads).min(4);
                    let h0 = self.kvh * self.group + g;
                    // SAFETY: heads h0..h0 + n of token t are this item's rows, inside `out`.
                    let o = out.0.add(t * q_dim + h0 * hd);
                    let p = &sc.p[(i * self.group + g) * stride..];
                    let vals = Values {
                        wide,
                        kvh: self.kvh,
                        p,
                        stride,
                        range: b0..end,
                        first: b0 == 0,
                    };
                    match n {
                        1 => vals.add::<S, 1>(o),
                        2 => vals.add::<S, 2>(o),
                        3 => vals.add::<S, 3>(o),
                        _ => vals.add::<S, 4>(o),
                    }
                    g += n;
                }
            }
            b0 = b1;
        }
    }
}

/// One query's scores at eight positions (`k8`: their widened K rows), times `scale`, in
/// position order.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn scores8<const S: usize>(qv: &[Lanes16], k8: &[Lanes16], scale: f32) -> __m256 {
    assert!(qv.len() >= 2 * S && k8.len() >= 16 * S);
    let ld = |x: &Lanes16| _mm512_load_ps(x.0.as_ptr());
    let mut acc = [[_mm512_setzero_ps(); 2]; 8];
    for st in 0..S {
        let (qa, qb) = (ld(&qv[2 * st]), ld(&qv[2 * st + 1]));
        for (p, a) in acc.iter_mut().enumerate() {
            let k = &k8[2 * S * p..];
            a[0] = _mm512_fmadd_ps(ld(&k[2 * st]), qa, a[0]);
            a[1] = _mm512_fmadd_ps(ld(&k[2 * st + 1]), qb, a[1]);
        }
    }
    // z = c0 + c1 (lanes 0..8) | c2 + c3 (lanes 8..16).
    let z: [__m512; 8] = std::array::from_fn(|p| _mm512_add_ps(acc[p][0], acc[p][1]));
    // Positions 2m, 2m + 1: (c0 + c1) + (c2 + c3), eight lanes each.
    let w: [__m512; 4] = std::array::from_fn(|m| {
        let (a, b) = (z[2 * m], z[2 * m + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b01_00_01_00>(a, b),
            _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b),
        )
    });
    // hsum8 step 1, positions 4m..4m + 4 (one per 128-bit lane): r_i = l_(i + 4) + l_i.
    let r: [__m512; 2] = std::array::from_fn(|m| {
        let (a, b) = (w[2 * m], w[2 * m + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b),
            _mm512_shuffle_f32x4::<0b10_00_10_00>(a, b),
        )
    });
    // Step 2, lane j: r0 + r2, r1 + r3 of position j, then of position 4 + j.
    let t = _mm512_add_ps(
        _mm512_shuffle_ps::<0b01_00_01_00>(r[0], r[1]),
        _mm512_shuffle_ps::<0b11_10_11_10>(r[0], r[1]),
    );
    // Step 3: (r0 + r2) + (r1 + r3); lane 4j is position j, lane 4j + 1 position 4 + j.
    let f = _mm512_add_ps(
        _mm512_shuffle_ps::<0b10_00_10_00>(t, t),
        _mm512_shuffle_ps::<0b11_01_11_01>(t, t),
    );
    let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
    let s8 = _mm512_castps512_ps256(_mm512_permutexvar_ps(order, f));
    _mm256_mul_ps(s8, _mm256_set1_ps(scale))
}

/// Weighted values of positions `range` added to `N` consecutive heads' output rows.
struct Values<'a> {
    wide: &'a Widened,
    kvh: usize,
    /// Weights: head n's from `p[n * stride]`.
    p: &'a [f32],
    stride: usize,
    range: std::ops::Range<usize>,
    /// The first positions: start the sums from zero instead of the output rows.
    first: bool,
}

impl Values<'_> {
    /// # Safety
    /// `o` points at `N` output rows of `32 * S` floats that no other task touches; AVX-512.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn add<const S: usize, const N: usize>(&self, o: *mut f32) {
        let hd = 32 * S;
        let mut acc = [[_mm512_setzero_ps(); 8]; N];
        if !self.first {
            for (n, a) in acc.iter_mut().enumerate() {
                for (c, x) in a.iter_mut().enumerate().take(2 * S) {
                    *x = _mm512_loadu_ps(o.add(n * hd + 16 * c));
                }
            }
        }
        for j in self.range.clone() {
            let v = self.wide.rows::<S>(&self.wide.v, self.kvh, j, 1);
            let v: [__m512; 8] = std::array::from_fn(|c| {
                if c < 2 * S {
                    _mm512_load_ps(v[c].0.as_ptr())
                } else {
                    _mm512_setzero_ps()
                }
            });
            for (n, a) in acc.iter_mut().enumerate() {
                let p = _mm512_set1_ps(self.p[n * self.stride + j]);
                for (c, x) in a.iter_mut().enumerate().take(2 * S) {
                    *x = _mm512_fmadd_ps(p, v[c], *x);
                }
            }
        }
        for (n, a) in acc.iter().enumerate() {
            for (c, x) in a.iter().enumerate().take(2 * S) {
                _mm512_storeu_ps(o.add(n * hd + 16 * c), *x);
            }
        }
    }
}

/// `ops::softmax` of row i, `p[i * stride..][..lens[i]]`, for every row, then the weights rounded
/// to f16 (as the value sums take them): AVX2's [`super::avx2::softmax_rows`] with AVX-512's
/// `expf8` (its f64 steps eight lanes at a time).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn softmax_rows(p: &mut [f32], stride: usize, lens: &[usize]) {
    super::avx2::softmax_rows_with(p, stride, lens, |x| super::avx512::expf8(x))
}

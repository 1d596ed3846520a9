//! Causal grouped-query attention over an f16 KV cache on the CPU, rounding as ggml's non-flash path
//! does: queries and attention weights are rounded to f16 before their products with the cache.
//! Query·key dots use the engine's F16 dot (`vec_dot_f16`, 4 x 8 lanes); the weighted sum of values is one
//! FMA per element and position, in position order, so every ISA variant gives identical results.
//! Prompts of four tokens or more on AVX-512 CPUs go through `attention_tiled`, which computes the
//! same numbers with the query heads of one KV head and several tokens sharing each cache row;
//! one to three tokens go through `attention_decode`, in one parallel pass or three, and longer
//! prompts on other CPUs through it three tokens at a time.

use half::f16;

use crate::kernels::cpu::matmul::SharedOut;
use crate::kernels::cpu::{Isa, isa, pool};

/// Shapes of one attention call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnShape {
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
}

fn f16_bytes(x: &[f16]) -> &[u8] {
    // SAFETY: f16 is a 2-byte plain-old-data type with no padding; u8 has alignment 1.
    unsafe { std::slice::from_raw_parts(x.as_ptr().cast(), std::mem::size_of_val(x)) }
}

/// One (token, head) item: its f16 query and the key/value rows it attends to.
struct Item<'a> {
    q: &'a [f16],
    k_cache: &'a [f16],
    v_cache: &'a [f16],
    /// Offset of this head's kv head within a cache row.
    off: usize,
    /// Cache row length (n_head_kv * head_dim).
    stride: usize,
    /// Positions attended: 0..n_kv.
    n_kv: usize,
    scale: f32,
}

impl Item<'_> {
    fn key(&self, j: usize) -> &[f16] {
        let at = j * self.stride + self.off;
        &self.k_cache[at..at + self.q.len()]
    }
    fn value(&self, j: usize) -> &[f16] {
        let at = j * self.stride + self.off;
        &self.v_cache[at..at + self.q.len()]
    }
}

/// Scores over positions `0..n_kv`, softmax, weighted sum of values into `o`. `dot` and `axpy`
/// are the variant's F16 dot and `o = fma(p, v, o)`; inlined into each variant.
#[inline(always)]
fn attend_one(
    it: &Item,
    scores: &mut Vec<f32>,
    o: &mut [f32],
    dot: impl Fn(&[u8], &[u8], usize) -> f32,
    axpy: impl Fn(&mut [f32], f32, &[f16]),
) {
    let hd = it.q.len();
    scores.clear();
    for j in 0..it.n_kv {
        scores.push(dot(f16_bytes(it.key(j)), f16_bytes(it.q), hd) * it.scale);
    }
    super::ops::softmax(scores);
    o.fill(0.0);
    for (j, &p) in scores.iter().enumerate() {
        axpy(o, f16::from_f32(p).to_f32(), it.value(j));
    }
}

fn attend_one_scalar(it: &Item, scores: &mut Vec<f32>, o: &mut [f32]) {
    attend_one(it, scores, o, super::scalar::vec_dot_f16, |o, p, v| {
        for (a, x) in o.iter_mut().zip(v) {
            *a = p.mul_add(x.to_f32(), *a);
        }
    });
}

#[cfg(target_arch = "x86_64")]
mod simd {
    #![allow(unsafe_op_in_unsafe_fn)]
    use half::f16;
    use std::arch::x86_64::*;

    use super::Item;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn axpy_f16(o: &mut [f32], p: f32, v: &[f16]) {
        let n = o.len().min(v.len());
        let pv = _mm256_set1_ps(p);
        let mut i = 0;
        while i + 8 <= n {
            let x = _mm256_cvtph_ps(_mm_loadu_si128(v.as_ptr().add(i).cast()));
            let a = _mm256_loadu_ps(o.as_ptr().add(i));
            _mm256_storeu_ps(o.as_mut_ptr().add(i), _mm256_fmadd_ps(pv, x, a));
            i += 8;
        }
        for j in i..n {
            o[j] = p.mul_add(v[j].to_f32(), o[j]);
        }
    }

    /// `attend_one` with the AVX2 F16 dot and axpy inlined.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn attend_one(it: &Item, scores: &mut Vec<f32>, o: &mut [f32]) {
        let hd = it.q.len();
        if hd.is_multiple_of(32) && hd <= 128 && o.len() == hd {
            return attend_one_regs(it, scores, o);
        }
        super::attend_one(
            it,
            scores,
            o,
            |w, a, n| unsafe { crate::kernels::cpu::avx2::vec_dot_f16(w, a, n) },
            |o, p, v| unsafe { axpy_f16(o, p, v) },
        );
    }

    /// `attend_one` for head sizes that are a multiple of 32 up to 128, with the query widened once
    /// and the output kept in registers across positions. The arithmetic is `vec_dot_f16`'s
    /// (four 8-lane FMA chains over 32-element steps, `(c0 + c1) + (c2 + c3)`, `hsum8`) and
    /// `axpy_f16`'s (one FMA per element and position, in position order).
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn attend_one_regs(it: &Item, scores: &mut Vec<f32>, o: &mut [f32]) {
        use crate::kernels::cpu::avx2::hsum8;
        let hd = it.q.len();
        let nv = hd / 8;
        let load = |x: &[f16], i: usize| _mm256_cvtph_ps(_mm_loadu_si128(x.as_ptr().add(i).cast()));
        let mut q = [_mm256_setzero_ps(); 16];
        for (c, qc) in q.iter_mut().enumerate().take(nv) {
            *qc = load(it.q, 8 * c);
        }
        scores.clear();
        for j in 0..it.n_kv {
            let kj = it.key(j);
            let mut acc = [_mm256_setzero_ps(); 4];
            for step in 0..hd / 32 {
                for (c, a) in acc.iter_mut().enumerate() {
                    let i = 32 * step + 8 * c;
                    *a = _mm256_fmadd_ps(load(kj, i), q[i / 8], *a);
                }
            }
            let s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
            scores.push(hsum8(s) * it.scale);
        }
        super::super::ops::softmax(scores);
        let mut acc = [_mm256_setzero_ps(); 16];
        for (j, &p) in scores.iter().enumerate() {
            let p = _mm256_set1_ps(f16::from_f32(p).to_f32());
            let vj = it.value(j);
            for (c, a) in acc.iter_mut().enumerate().take(nv) {
                *a = _mm256_fmadd_ps(p, load(vj, 8 * c), *a);
            }
        }
        for (c, a) in acc.iter().enumerate().take(nv) {
            _mm256_storeu_ps(o.as_mut_ptr().add(8 * c), *a);
        }
    }
}

/// `q`: [n_tok, n_head * head_dim] (after RoPE); `k_cache`, `v_cache`: [n_ctx, n_head_kv * head_dim] f16
/// holding positions 0..pos0 + n_tok; token t sits at `pos0 + t` and sees positions 0..=pos0 + t.
/// Writes `out`: [n_tok, n_head * head_dim].
pub fn attention(
    s: AttnShape,
    q: &[f32],
    k_cache: &[f16],
    v_cache: &[f16],
    pos0: usize,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if isa() == Isa::Avx512
        && out.len() >= 4 * s.n_head * s.head_dim
        && super::attention_tiled::supports(s)
    {
        return super::attention_tiled::attention(s, q, k_cache, v_cache, pos0, out);
    }
    #[cfg(target_arch = "x86_64")]
    {
        let q_dim = s.n_head * s.head_dim;
        let n_tok = out.len() / q_dim;
        if super::attention_decode::supports(s, n_tok, pos0 + n_tok) {
            return super::attention_decode::attention(s, q, k_cache, v_cache, pos0, out);
        }
        if super::attention_decode::supports(s, 3, pos0 + n_tok) {
            return super::attention_decode::prompt(s, q, k_cache, v_cache, pos0, out);
        }
    }
    attention_per_head(s, q, k_cache, v_cache, pos0, out)
}

/// The per-head path of [`attention`] (a task is the query heads of one KV head, each in turn)
/// on the SIMD kernels where the CPU has them: what the tiled and decode paths replace, for
/// comparison in benches.
pub fn attention_per_head(
    s: AttnShape,
    q: &[f32],
    k_cache: &[f16],
    v_cache: &[f16],
    pos0: usize,
    out: &mut [f32],
) {
    let simd = isa() != Isa::Scalar && Isa::Avx2.supported();
    attention_with(simd, s, q, k_cache, v_cache, pos0, out)
}

/// [`attention`] on the SIMD path (`simd`, which needs AVX2, FMA and F16C) or the scalar one.
fn attention_with(
    simd: bool,
    s: AttnShape,
    q: &[f32],
    k_cache: &[f16],
    v_cache: &[f16],
    pos0: usize,
    out: &mut [f32],
) {
    let hd = s.head_dim;
    let q_dim = s.n_head * hd;
    let kv_dim = s.n_head_kv * hd;
    let group = s.n_head / s.n_head_kv;
    let scale = 1.0 / (hd as f32).sqrt();
    let n_tok = out.len() / q_dim;
    // A task is a token's query heads that share one KV head, or a part of them where there
    // would be fewer than two tasks per thread: the heads after the first find the K and V rows
    // in cache. Work per task grows with the position; one task per chunk keeps threads balanced.
    let groups = n_tok * s.n_head_kv;
    let parts = group.min((2 * pool::global().n_threads()).div_ceil(groups.max(1)));
    let shared = SharedOut(out.as_mut_ptr());
    pool::global().for_chunks(groups * parts, 1, |range| {
        let shared = &shared;
        let mut qh = vec![f16::ZERO; hd];
        let mut scores = Vec::new();
        for task in range {
            let (t, kvh, part) = (
                task / (s.n_head_kv * parts),
                task / parts % s.n_head_kv,
                task % parts,
            );
            let heads =
                kvh * group + part * group / parts..kvh * group + (part + 1) * group / parts;
            for h in heads {
                for (d, &v) in qh
                    .iter_mut()
                    .zip(&q[t * q_dim + h * hd..t * q_dim + (h + 1) * hd])
                {
                    *d = f16::from_f32(v);
                }
                let it = Item {
                    q: &qh,
                    k_cache,
                    v_cache,
                    off: kvh * hd,
                    stride: kv_dim,
                    n_kv: pos0 + t + 1,
                    scale,
                };
                let idx = t * s.n_head + h;
                // SAFETY: (token, head) idx owns out[idx * hd..(idx + 1) * hd]; tasks hold
                // disjoint heads and `out` outlives the job.
                let o = unsafe { std::slice::from_raw_parts_mut(shared.0.add(idx * hd), hd) };
                #[cfg(target_arch = "x86_64")]
                if simd {
                    // SAFETY: AVX2, FMA and F16C are present (checked above).
                    unsafe { simd::attend_one(&it, &mut scores, o) };
                    continue;
                }
                attend_one_scalar(&it, &mut scores, o);
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The SIMD and scalar paths agree bit for bit, and both match a plain f64 computation of
    /// the same f16-rounded inputs to rounding.
    #[test]
    fn simd_equals_scalar_and_matches_f64() {
        // 40: the general path; 64 and 128: the register path.
        for head_dim in [40, 64, 128] {
            check(6, 2, head_dim, 5, 3);
        }
    }

    /// The AVX-512 prompt path (queries of one KV head and several tokens together) agrees with
    /// the scalar path bit for bit: every head size it takes, group sizes 1, 2, 3 and 4, partial
    /// token blocks, and prompts whose positions span several position blocks.
    #[test]
    fn tiled_equals_scalar() {
        for head_dim in [32, 64, 96, 128] {
            check(6, 2, head_dim, 5, 3);
            check(9, 3, head_dim, 11, 70);
        }
        check(4, 1, 64, 13, 0);
        check(4, 4, 64, 8, 130);
        check(4, 2, 128, 9, 40);
        // Groups of six and eight: a prompt chunk's 18 and 24 (token, head) rows take the AVX2
        // values step in passes of twelve rows.
        check(12, 2, 64, 7, 20);
        check(16, 2, 32, 5, 9);
    }

    /// The decode path (one to three tokens, in one pass or, over a long cache with too few
    /// KV heads for the threads, three) agrees with the scalar path bit for bit: every head size
    /// it takes, group sizes 1 to 6 (heads of a group in fours and the rest, whole or in parts),
    /// short caches and caches that end inside a position block and on one.
    #[test]
    fn decode_equals_scalar() {
        for head_dim in [32, 64, 96, 128] {
            check(8, 2, head_dim, 1, 300);
            check(8, 2, head_dim, 1, 37);
        }
        check(6, 1, 64, 2, 383);
        check(6, 1, 64, 2, 0);
        check(5, 5, 64, 3, 511);
        check(12, 2, 128, 1, 1023);
        check(32, 8, 64, 1, 128);
        // Many KV heads, so that a task takes a whole group of five or six (up to 32 threads):
        // softmax rows and values in fours and the rest.
        check(384, 64, 32, 1, 40);
        check(320, 64, 32, 2, 300);
        check(3, 3, 32, 1, 256);
        check(2, 1, 64, 1, 300);
    }

    fn check(n_head: usize, n_head_kv: usize, head_dim: usize, n_tok: usize, pos0: usize) {
        let s = AttnShape {
            n_head,
            n_head_kv,
            head_dim,
        };
        let n_ctx = pos0 + n_tok;
        let kv_dim = s.n_head_kv * s.head_dim;
        let val = |i: usize, o: f32| 0.1 + 2.0 * (i as f32 * 0.31 + o).cos();
        let q: Vec<f32> = (0..n_tok * s.n_head * s.head_dim)
            .map(|i| val(i, 0.0))
            .collect();
        let k: Vec<f16> = (0..n_ctx * kv_dim)
            .map(|i| f16::from_f32(val(i, 1.0)))
            .collect();
        let v: Vec<f16> = (0..n_ctx * kv_dim)
            .map(|i| f16::from_f32(val(i, 2.0)))
            .collect();
        let mut scalar = vec![0f32; q.len()];
        attention_with(false, s, &q, &k, &v, pos0, &mut scalar);
        let mut variants: Vec<(&str, Vec<f32>)> = Vec::new();
        if Isa::Avx2.supported() {
            let mut fast = vec![0f32; q.len()];
            attention_with(true, s, &q, &k, &v, pos0, &mut fast);
            variants.push(("simd", fast));
        }
        #[cfg(target_arch = "x86_64")]
        if Isa::Avx512.supported() && super::super::attention_tiled::supports(s) {
            let mut tiled = vec![f32::NAN; q.len()];
            super::super::attention_tiled::attention(s, &q, &k, &v, pos0, &mut tiled);
            variants.push(("tiled", tiled));
        }
        #[cfg(target_arch = "x86_64")]
        if super::super::attention_decode::supports(s, n_tok, n_ctx) {
            // Both register files: sixteen (AVX2) and thirty-two (AVX-512) vector registers.
            for (name, isa) in [("decode-avx2", Isa::Avx2), ("decode-avx512", Isa::Avx512)] {
                if isa.supported() {
                    crate::kernels::cpu::set_isa(isa).unwrap();
                    let mut decode = vec![f32::NAN; q.len()];
                    super::super::attention_decode::attention(s, &q, &k, &v, pos0, &mut decode);
                    variants.push((name, decode));
                }
            }
            crate::kernels::cpu::set_isa(Isa::detect()).unwrap();
        }
        #[cfg(target_arch = "x86_64")]
        if super::super::attention_decode::supports(s, 3, n_ctx) {
            let mut threes = vec![f32::NAN; q.len()];
            super::super::attention_decode::prompt(s, &q, &k, &v, pos0, &mut threes);
            variants.push(("prompt by threes", threes));
        }
        for (name, fast) in &variants {
            for (i, (a, b)) in scalar.iter().zip(fast).enumerate() {
                assert_eq!(
                    a.to_bits(),
                    b.to_bits(),
                    "{n_head}/{n_head_kv} heads of {head_dim}, {n_tok} tokens at {pos0}, \
                     element {i}: scalar {a} vs {name} {b}"
                );
            }
        }
        let hd = s.head_dim;
        let mut worst = 0f64;
        for t in 0..n_tok {
            for h in 0..s.n_head {
                let kvh = h / (s.n_head / s.n_head_kv);
                let qh: Vec<f64> = (0..hd)
                    .map(|d| f16::from_f32(q[(t * s.n_head + h) * hd + d]).to_f64())
                    .collect();
                let n_kv = pos0 + t + 1;
                let sc: Vec<f64> = (0..n_kv)
                    .map(|j| {
                        (0..hd)
                            .map(|d| qh[d] * k[j * kv_dim + kvh * hd + d].to_f64())
                            .sum::<f64>()
                            / (hd as f64).sqrt()
                    })
                    .collect();
                let m = sc.iter().cloned().fold(f64::MIN, f64::max);
                let z: f64 = sc.iter().map(|x| (x - m).exp()).sum();
                for d in 0..hd {
                    let want: f64 = (0..n_kv)
                        .map(|j| (sc[j] - m).exp() / z * v[j * kv_dim + kvh * hd + d].to_f64())
                        .sum();
                    worst = worst.max((want - scalar[(t * s.n_head + h) * hd + d] as f64).abs());
                }
            }
        }
        // Attention weights are rounded to f16 (relative 2^-11) before the value sum.
        assert!(
            worst < 5e-3,
            "{n_head}/{n_head_kv} heads of {head_dim}: largest difference from f64: {worst}"
        );
    }
}

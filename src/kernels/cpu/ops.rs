//! Non-weight operators on the CPU: RMSNorm, RoPE, SwiGLU, residual adds, softmax.

use crate::model::RopeParams;

/// `out = x / sqrt(mean(x^2) + eps) * w` without touching `x`, row by row: row r of `out` (rows
/// of `w.len()`) from `x[r * x_stride..]`. Per row, ggml's order: the f32 squares summed in f64
/// in element order, then `v * scale * g` per element. Eight rows' f64 sums side by side (one
/// row's sum waits on each addition: 576 of them a row for a 135M model's, 1.3% of its
/// 512-token prompt), and no copy of `x` first.
pub fn rms_norm_rows(x: &[f32], x_stride: usize, w: &[f32], eps: f32, out: &mut [f32]) {
    let n = w.len();
    if n == 0 {
        return;
    }
    for (g, out) in out.chunks_mut(8 * n).enumerate() {
        let rows = out.len() / n;
        let xs: [&[f32]; 8] = std::array::from_fn(|r| {
            let r = 8 * g + r.min(rows - 1);
            &x[r * x_stride..][..n]
        });
        let mut acc = [0f64; 8];
        for j in 0..n {
            for (a, x) in acc.iter_mut().zip(&xs) {
                let v = x[j];
                *a += (v * v) as f64;
            }
        }
        for ((out, x), sum) in out.chunks_mut(n).zip(xs).zip(acc) {
            let scale = 1.0 / ((sum / n as f64) as f32 + eps).sqrt();
            for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
                *o = v * scale * g;
            }
        }
    }
}

/// Adds `b` to every row of `x`.
pub fn add_bias(x: &mut [f32], b: &[f32]) {
    for row in x.chunks_mut(b.len()) {
        for (v, &bb) in row.iter_mut().zip(b) {
            *v += bb;
        }
    }
}

pub fn scale_inplace(x: &mut [f32], s: f32) {
    for a in x.iter_mut() {
        *a *= s;
    }
}

pub fn add_inplace(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// `gate = silu(gate) * up`, elementwise: `g / (1 + expf(-g)) * u` (vectorised on AVX-512 CPUs,
/// with the same operations).
pub fn swiglu_inplace(gate: &mut [f32], up: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    match super::isa() {
        // SAFETY: the CPU has AVX-512 (`isa` picks only supported variants).
        super::Isa::Avx512 => return unsafe { super::avx512::swiglu_inplace(gate, up) },
        // SAFETY: the CPU has AVX2, FMA and F16C (`isa` picks only supported variants).
        super::Isa::Avx2 => return unsafe { super::avx2::swiglu_inplace(gate, up) },
        super::Isa::Scalar => {}
    }
    swiglu_scalar(gate, up)
}

/// [`swiglu_inplace`] one element at a time. Always inlined, so that a caller compiled with FMA
/// (the vector variants' tails) computes [`expf`]'s `mul_add`s with the instruction (a call to
/// the library's software `fma` otherwise: 5% of 135M Q4_0 pp512's samples on an AVX2 CPU).
#[inline(always)]
pub fn swiglu_scalar(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + expf(-*g)) * u;
    }
}

/// Rotary position embedding in place on `x` = [n_tok, n_heads, head_dim], token t at `pos0 + t`,
/// on dimensions `p.dim_offset..p.dim_offset + p.n_dims` of each head.
/// `freq_factors` (Llama 3.1's rope_freqs) divide each pair's angle when present.
pub fn rope(
    x: &mut [f32],
    n_heads: usize,
    head_dim: usize,
    pos0: usize,
    p: &RopeParams,
    freq_factors: Option<&[f32]>,
) {
    let half = p.n_dims / 2;
    let theta_scale = p.freq_base.powf(-2.0 / p.n_dims as f32);
    let mut cos_sin = vec![(0f32, 0f32); half];
    for (t, tok) in x.chunks_mut(n_heads * head_dim).enumerate() {
        let mut theta = (pos0 + t) as f32 * p.freq_scale;
        for (i, cs) in cos_sin.iter_mut().enumerate() {
            let ff = freq_factors.map_or(1.0, |f| f[i]);
            let a = theta / ff;
            *cs = (a.cos(), a.sin());
            theta *= theta_scale;
        }
        for head in tok.chunks_mut(head_dim) {
            let head = &mut head[p.dim_offset..];
            for (i, &(c, s)) in cos_sin.iter().enumerate() {
                let (a, b) = if p.neox {
                    (i, i + half)
                } else {
                    (2 * i, 2 * i + 1)
                };
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0 * c - x1 * s;
                head[b] = x0 * s + x1 * c;
            }
        }
    }
}

/// Softmax in place over `x`: [`expf`]`(x - max)`, summed in f64 in order, times `1 / sum` in f32.
pub fn softmax(x: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if super::isa() != super::Isa::Scalar {
        // SAFETY: AVX2's and AVX-512's variants need FMA, so the CPU has it.
        return unsafe { softmax_fma(x) };
    }
    softmax_each(x)
}

/// [`softmax`] compiled with FMA ([`swiglu_fma`]: the same bits, no library calls).
///
/// # Safety
/// The CPU has FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn softmax_fma(x: &mut [f32]) {
    softmax_each(x)
}

#[inline(always)]
fn softmax_each(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    for v in x.iter_mut() {
        *v = expf(*v - max);
    }
    // A loop of its own: with the `exp` calls in it, the running sum would go through memory.
    let sum = x.iter().fold(0f64, |s, &v| s + v as f64);
    let inv = (1.0 / sum) as f32;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// The f64 sum, in order, of each row `i` of `p` (at `i * stride`, `lens[i]` long): eight rows'
/// chains side by side (the last repeated where there are fewer), each row's own sum exactly
/// `fold(0f64, |s, &v| s + v as f64)` (the vector softmaxes' sums).
pub(crate) fn row_sums(p: &[f32], stride: usize, lens: &[usize]) -> Vec<f64> {
    let mut sums = vec![0f64; lens.len()];
    for (g, sums) in sums.chunks_mut(8).enumerate() {
        let rows = 8 * g..8 * g + sums.len();
        let common = lens[rows.clone()].iter().copied().min().unwrap_or(0);
        let x: [&[f32]; 8] = std::array::from_fn(|r| {
            let r = (8 * g + r).min(rows.end - 1);
            &p[r * stride..][..common]
        });
        let mut acc = [0f64; 8];
        #[allow(clippy::needless_range_loop)]
        for j in 0..common {
            for r in 0..8 {
                acc[r] += x[r][j] as f64;
            }
        }
        for ((r, a), sum) in rows.zip(acc).zip(sums.iter_mut()) {
            *sum = p[r * stride + common..r * stride + lens[r]]
                .iter()
                .fold(a, |s, &v| s + v as f64);
        }
    }
    sums
}

/// glibc's `expf` table: `2^(i/32)` as bits, less `i << 47` (`__exp2f_data.tab`).
pub(crate) const EXP2F_TAB: [u64; 32] = [
    0x3ff0000000000000,
    0x3fefd9b0d3158574,
    0x3fefb5586cf9890f,
    0x3fef9301d0125b51,
    0x3fef72b83c7d517b,
    0x3fef54873168b9aa,
    0x3fef387a6e756238,
    0x3fef1e9df51fdee1,
    0x3fef06fe0a31b715,
    0x3feef1a7373aa9cb,
    0x3feedea64c123422,
    0x3feece086061892d,
    0x3feebfdad5362a27,
    0x3feeb42b569d4f82,
    0x3feeab07dd485429,
    0x3feea47eb03a5585,
    0x3feea09e667f3bcd,
    0x3fee9f75e8ec5f74,
    0x3feea11473eb0187,
    0x3feea589994cce13,
    0x3feeace5422aa0db,
    0x3feeb737b0cdc5e5,
    0x3feec49182a3f090,
    0x3feed503b23e255d,
    0x3feee89f995ad3ad,
    0x3feeff76f2fb5e47,
    0x3fef199bdd85529c,
    0x3fef3720dcef9069,
    0x3fef5818dcfba487,
    0x3fef7c97337b9b5f,
    0x3fefa4afa2a490da,
    0x3fefd0765b6e4540,
];
/// `32 / ln 2`.
pub(crate) const EXPF_INV_LN2_N: f64 = f64::from_bits(0x40471547652b82fe);
/// `1.5 * 2^52`: adding it rounds to an integer, kept in the low bits.
pub(crate) const EXPF_SHIFT: f64 = f64::from_bits(0x4338000000000000);
/// `2^(r/32) ~ 1 + C2 r + C1 r^2 + C0 r^3`.
pub(crate) const EXPF_C: [f64; 3] = [
    f64::from_bits(0x3ebc6af84b912394),
    f64::from_bits(0x3f2ebfce50fac4f3),
    f64::from_bits(0x3f962e42ff0c52d6),
];

/// Inputs at which [`expf`] leaves the main path (as `(bits >> 20) & 0x7ff`): |x| >= 88, inf, NaN.
pub(crate) const EXPF_SPECIAL_TOP: u32 = 0x42b;

/// `e^x` in f32, computed as glibc's `expf` computes it (glibc 2.28+, `e_expf.c`, in the x86-64
/// build with FMA that glibc selects on every CPU with FMA): `x * 32 / ln 2` split into an
/// integer k and r in [-1/2, 1/2] with f64 FMAs, `2^(k/32)` from a table, a cubic in r, one
/// rounding to f32. Softmax uses this instead of the platform's `expf` so that every variant
/// (and the SIMD one, which does the same operations on eight lanes) gives the same bits on
/// every platform; on x86-64 glibc they are the bits of `f32::exp`. Always inlined, so that a
/// caller compiled with FMA computes its `mul_add`s with the instruction.
#[inline(always)]
pub fn expf(x: f32) -> f32 {
    if (x.to_bits() >> 20) & 0x7ff >= EXPF_SPECIAL_TOP {
        return expf_special(x);
    }
    expf_main(x)
}

/// [`expf`]'s main path.
#[inline(always)]
fn expf_main(x: f32) -> f32 {
    let xd = x as f64;
    let kd = EXPF_INV_LN2_N.mul_add(xd, EXPF_SHIFT);
    let ki = kd.to_bits();
    let kd = kd - EXPF_SHIFT;
    let r = EXPF_INV_LN2_N.mul_add(xd, -kd);
    let s = f64::from_bits(EXP2F_TAB[(ki % 32) as usize].wrapping_add(ki << 47));
    let z = r.mul_add(EXPF_C[0], EXPF_C[1]);
    let r2 = r * r;
    let y = r.mul_add(EXPF_C[2], 1.0);
    (z.mul_add(r2, y) * s) as f32
}

/// [`expf`] for |x| >= 88, infinities and NaN.
#[cold]
pub(crate) fn expf_special(x: f32) -> f32 {
    if x == f32::NEG_INFINITY {
        0.0
    } else if (x.to_bits() >> 20) & 0x7ff >= 0x7f8 {
        x + x
    } else if x > f32::from_bits(0x42b1_7217) {
        // Overflow (glibc: 0x1p97 * 0x1p97).
        f32::INFINITY
    } else if x < f32::from_bits(0xc2cf_f1b4) {
        // Underflow (glibc: 0x1p-95 * 0x1p-95).
        0.0
    } else if x < f32::from_bits(0xc2ce_8ecf) {
        // Glibc's "may underflow" value: 0x1.4p-75 * 0x1.4p-75 rounds to the least subnormal.
        f32::from_bits(1)
    } else {
        expf_main(x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One row at a time, in place, as the CPU's RMSNorm was before [`rms_norm_rows`].
    fn rms_norm(x: &mut [f32], w: &[f32], eps: f32) {
        let sum: f64 = x.iter().map(|&v| (v * v) as f64).sum();
        let scale = 1.0 / ((sum / w.len() as f64) as f32 + eps).sqrt();
        for (v, &g) in x.iter_mut().zip(w) {
            *v = *v * scale * g;
        }
    }

    /// [`rms_norm_rows`] has the bits of the one-row [`rms_norm`] on each row, for row counts
    /// around the groups of eight and rows read at a stride past their length.
    #[test]
    fn rms_norm_rows_equals_rms_norm() {
        let n = 37;
        let w: Vec<f32> = (0..n).map(|i| 0.5 + (i as f32 * 0.7).sin()).collect();
        for (rows, stride) in [(1, n), (7, n), (8, n + 5), (9, 2 * n), (17, n + 1)] {
            let x: Vec<f32> = (0..rows * stride)
                .map(|i| (i as f32 * 0.37).cos() * (1 << (i % 13)) as f32 / 64.0)
                .collect();
            let mut got = vec![f32::NAN; rows * n];
            rms_norm_rows(&x, stride, &w, 1e-5, &mut got);
            for r in 0..rows {
                let mut want = x[r * stride..][..n].to_vec();
                rms_norm(&mut want, &w, 1e-5);
                for (j, (g, e)) in got[r * n..][..n].iter().zip(&want).enumerate() {
                    assert_eq!(g.to_bits(), e.to_bits(), "{rows} rows: row {r} element {j}");
                }
            }
        }
    }

    /// Every `step`-th f32 bit pattern (and the edges of the special ranges): `expf` against the
    /// platform's. Only on x86-64 glibc with FMA, whose `expf` this reproduces.
    fn expf_matches_libm(step: usize) {
        if !(cfg!(all(target_arch = "x86_64", target_env = "gnu"))
            && crate::kernels::cpu::Isa::Avx2.supported())
        {
            return;
        }
        let edges = [
            0x42b1_7217u32,
            0x42b1_7218,
            0xc2cf_f1b4,
            0xc2cf_f1b5,
            0xc2ce_8ecf,
            0xc2ce_8ed0,
            0x42b0_0000,
            0xc2b0_0000,
            0x7f80_0000,
            0xff80_0000,
            0x7fc0_0000,
            0xffc0_0001,
            0x7f80_0001,
            0,
            0x8000_0000,
        ];
        let mut bad = 0u64;
        let mut first = None;
        for b in (0..=u32::MAX).step_by(step).chain(edges) {
            let x = f32::from_bits(b);
            let (got, want) = (expf(x), x.exp());
            if got.to_bits() != want.to_bits() {
                bad += 1;
                first.get_or_insert((x, got, want));
            }
        }
        assert_eq!(bad, 0, "first mismatch (x, ours, libm): {first:?}");
    }

    #[test]
    fn expf_is_glibcs() {
        expf_matches_libm(997);
    }

    /// Every f32 (about a minute): `cargo test --release -- --ignored expf_every`.
    #[test]
    #[ignore]
    fn expf_every_input_is_glibcs() {
        expf_matches_libm(1);
    }
}

/// Runs `f(first_row, rows)` over `x` ([n_rows, row_len], the last row possibly short) in chunks
/// of whole rows on the pool when there is enough work to be worth it (prefill), else in one
/// call. Each row is computed exactly as alone, so the result does not depend on the split.
pub fn par_rows(x: &mut [f32], row_len: usize, f: impl Fn(usize, &mut [f32]) + Sync) {
    let row_len = row_len.max(1);
    let n_rows = x.len().div_ceil(row_len);
    let pool = super::pool::global();
    // Below ~16 K elements a pool round trip costs more than it saves.
    if n_rows < 2 || x.len() < 16384 || pool.n_threads() < 2 {
        return f(0, x);
    }
    let per = n_rows.div_ceil(pool.n_threads() * 2).max(1);
    let len = x.len();
    let out = super::matmul::SharedOut(x.as_mut_ptr());
    pool.for_chunks(n_rows, per, |rows| {
        let out = &out;
        let (a, b) = (rows.start * row_len, (rows.end * row_len).min(len));
        // SAFETY: chunks of rows are disjoint, inside `x`, which outlives the pool job.
        let chunk = unsafe { std::slice::from_raw_parts_mut(out.0.add(a), b - a) };
        f(rows.start, chunk);
    });
}

#[cfg(test)]
mod par_tests {
    use super::*;

    #[test]
    fn par_rows_covers_every_element_once_with_ragged_tails() {
        for len in [0usize, 5, 16384, 16385, 50_000, 65_536] {
            let mut x = vec![1f32; len];
            par_rows(&mut x, 1024, |r0, rows| {
                for (i, v) in rows.iter_mut().enumerate() {
                    *v += (r0 * 1024 + i) as f32;
                }
            });
            assert!(
                x.iter().enumerate().all(|(i, &v)| v == 1.0 + i as f32),
                "len {len}"
            );
        }
    }
}

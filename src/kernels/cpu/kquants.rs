//! The engine's canonical arithmetic for the K-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K weights dotted
//! with Q8_K activations, and IQ4_XS, whose super-blocks have the same shape), in plain Rust;
//! `avx2` and `avx512` reproduce it bit for bit.
//!
//! Per 256-element super-block two integers are computed EXACTLY in i32, so their grouping is free
//! (integer addition is associative) and every variant may sum them in its own lane order:
//!
//! - `isum = Σ_j sc_j · Σ_{i∈j} q_i · y_i` over the super-block's sub-blocks j (16 of 16 elements
//!   for Q2_K, Q3_K and Q6_K; 8 of 32 for Q4_K and Q5_K), with `q_i` the weight's integer quant as
//!   it enters the dequantisation (Q3_K `q − 4·[high bit clear]` in -4..3, Q6_K `q − 32` in
//!   -32..31) and `y_i` the activation's i8;
//! - `imin = Σ_g m_{j(g)} · bsum_g` over the sixteen 16-element groups g of the activation's
//!   `bsums`, for the types with mins (Q2_K, Q4_K, Q5_K); Q3_K and Q6_K have none.
//!
//! The float part then runs in one fixed order, per super-block in row order, starting from
//! `sumf = 0`:
//!
//! ```text
//! sumf = fma(d_y * d_x, isum as f32, sumf)
//! sumf = fma(-(d_y * dmin_x), imin as f32, sumf)     (types with mins only)
//! ```
//!
//! (`f32::mul_add`, one rounding each; `isum as f32` rounds to nearest even, as `vcvtdq2ps`.)
//!
//! Magnitude bounds, for ANY bytes in the blocks (so no i32 sum can overflow, whatever order a
//! variant adds in; |y| ≤ 128, |bsum| ≤ 32768):
//!
//! | type | `|sc|` | `|q|` | `|isum|` ≤ 256·sc·q·128 | `|imin|` ≤ 16·m·32768 |
//! |------|-------|-------|--------------------------|------------------------|
//! | Q2_K | 15    | 3     | 1.5e6                    | 7.9e6 (m ≤ 15)         |
//! | Q3_K | 32    | 4     | 4.2e6                    | —                      |
//! | Q4_K | 63    | 15    | 3.1e7                    | 3.3e7 (m ≤ 63)         |
//! | Q5_K | 63    | 31    | 6.4e7                    | 3.3e7 (m ≤ 63)         |
//! | Q6_K | 128   | 32    | 1.35e8                   | —                      |
//!
//! all below 2^31 ≈ 2.1e9. The SIMD variants also keep their 16-bit intermediates exact: `maddubs`
//! pairs of u8 quants ≤ 63 and i8 activations stay within ±16128 (no saturation), and 16-bit
//! products with the scales are widened by `madd`/`dpwssd`.
//!
//! This differs from ggml's generic reference (`crate::quant::vec_dot`: eight f32 lanes carried
//! across super-blocks, mins in a separate sum) by rounding only.

use crate::quant::blocks::*;

/// Q4_K / Q5_K's packed scales as 16 bytes: the eight 6-bit scales, then the eight 6-bit mins
/// (the same values as [`k4_scales_mins`], computed on 32-bit words).
#[inline(always)]
pub fn k4_scales(raw: &[u8; K_SCALE_SIZE]) -> [u8; 16] {
    let w =
        |i: usize| u32::from_le_bytes([raw[4 * i], raw[4 * i + 1], raw[4 * i + 2], raw[4 * i + 3]]);
    let (w0, w1, w2) = (w(0), w(1), w(2));
    const LOW6: u32 = 0x3F3F_3F3F;
    const LOW4: u32 = 0x0F0F_0F0F;
    const LOW2: u32 = 0x0303_0303;
    // scales 0..4 and mins 0..4: low 6 bits of raw[0..4] and raw[4..8];
    // scales 4..8: low nibbles of raw[8..12], high 2 bits from the top of raw[0..4];
    // mins 4..8: high nibbles of raw[8..12], high 2 bits from the top of raw[4..8].
    let sc_lo = w0 & LOW6;
    let sc_hi = (w2 & LOW4) | (((w0 >> 6) & LOW2) << 4);
    let m_lo = w1 & LOW6;
    let m_hi = ((w2 >> 4) & LOW4) | (((w1 >> 6) & LOW2) << 4);
    let mut out = [0u8; 16];
    for (o, v) in out
        .as_chunks_mut::<4>()
        .0
        .iter_mut()
        .zip([sc_lo, sc_hi, m_lo, m_hi])
    {
        *o = v.to_le_bytes();
    }
    out
}

/// Q3_K's sixteen 6-bit scales, re-centred to -32..32 (the same values as [`q3_k_scales`],
/// computed on 32-bit words).
#[inline(always)]
pub fn q3_scales(raw: &[u8; 12]) -> [i8; 16] {
    let w =
        |i: usize| u32::from_le_bytes([raw[4 * i], raw[4 * i + 1], raw[4 * i + 2], raw[4 * i + 3]]);
    let (w0, w1, hi) = (w(0), w(1), w(2));
    const LOW4: u32 = 0x0F0F_0F0F;
    const LOW2: u32 = 0x0303_0303;
    // scale s: low 4 bits from the low (s < 8) or high (s >= 8) nibble of raw[s % 8], high 2 bits
    // at bit 2·(s / 4) of raw[8 + s % 4].
    let words = [
        (w0 & LOW4) | ((hi & LOW2) << 4),
        (w1 & LOW4) | (((hi >> 2) & LOW2) << 4),
        ((w0 >> 4) & LOW4) | (((hi >> 4) & LOW2) << 4),
        ((w1 >> 4) & LOW4) | (((hi >> 6) & LOW2) << 4),
    ];
    let mut out = [0i8; 16];
    for (o, v) in out.as_chunks_mut::<4>().0.iter_mut().zip(words) {
        for (o, b) in o.iter_mut().zip(v.to_le_bytes()) {
            *o = b as i8 - 32;
        }
    }
    out
}

/// The canonical float step of one super-block: `fma(d_y * d_x, isum, sumf)`.
#[inline(always)]
pub fn add_scaled(sumf: f32, d_y: f32, d_x: f32, isum: i32) -> f32 {
    (d_y * d_x).mul_add(isum as f32, sumf)
}

/// The canonical mins step of one super-block: `fma(-(d_y * dmin_x), imin, sumf)`.
#[inline(always)]
pub fn sub_mins(sumf: f32, d_y: f32, dmin_x: f32, imin: i32) -> f32 {
    (-(d_y * dmin_x)).mul_add(imin as f32, sumf)
}

/// `Σ_g m_{g / per} · bsum_g` over the sixteen activation groups, `per` groups to a min.
#[inline(always)]
fn mins_sum(y: &BlockQ8K, per: usize, m: impl Fn(usize) -> u8) -> i32 {
    let mut imin = 0i32;
    for (g, b) in y.bsums.iter().enumerate() {
        imin += m(g / per) as i32 * b.get() as i32;
    }
    imin
}

/// `Σ_j sc(j) · Σ_{i ∈ group j} q_i · y_i` over the super-block's `GROUP`-element groups, with
/// the quants unpacked to bytes in element order.
#[inline(always)]
fn grouped_isum<const GROUP: usize>(
    q: &[i8; QK_K],
    y: &[i8; QK_K],
    sc: impl Fn(usize) -> i32,
) -> i32 {
    let mut isum = 0i32;
    let groups = q
        .as_chunks::<GROUP>()
        .0
        .iter()
        .zip(y.as_chunks::<GROUP>().0);
    for (j, (q, y)) in groups.enumerate() {
        let mut s = 0i32;
        for l in 0..GROUP {
            s += q[l] as i32 * y[l] as i32;
        }
        isum += sc(j) * s;
    }
    isum
}

/// Q2_K: element `128h + 32p + l` is 2-bit plane p of `qs[32h + l]`; group j of 16 takes scale
/// `scales[j] & 15` and min `scales[j] >> 4`.
pub fn vec_dot_q2_k_q8_k(xs: &[BlockQ2K], ys: &[BlockQ8K]) -> f32 {
    let mut sumf = 0.0f32;
    for (x, y) in xs.iter().zip(ys) {
        let mut q = [0i8; QK_K];
        for (h, q128) in q.as_chunks_mut::<128>().0.iter_mut().enumerate() {
            for (l, &b) in x.qs[32 * h..][..32].iter().enumerate() {
                for p in 0..4 {
                    q128[32 * p + l] = ((b >> (2 * p)) & 3) as i8;
                }
            }
        }
        let isum = grouped_isum::<16>(&q, &y.qs, |j| (x.scales[j] & 0x0F) as i32);
        let imin = mins_sum(y, 1, |j| x.scales[j] >> 4);
        let d_y = y.d.get();
        sumf = add_scaled(sumf, d_y, x.d.to_f32(), isum);
        sumf = sub_mins(sumf, d_y, x.dmin.to_f32(), imin);
    }
    sumf
}

/// Q3_K: element `32 · group + l` (group = 4h + p) is 2-bit plane p of `qs[32h + l]` minus 4
/// unless bit `group` of `hmask[l]` is set; group j of 16 takes scale j.
pub fn vec_dot_q3_k_q8_k(xs: &[BlockQ3K], ys: &[BlockQ8K]) -> f32 {
    let mut sumf = 0.0f32;
    for (x, y) in xs.iter().zip(ys) {
        let mut q = [0i8; QK_K];
        for (group, q32) in q.as_chunks_mut::<32>().0.iter_mut().enumerate() {
            let qs = &x.qs[32 * (group / 4)..][..32];
            let shift = 2 * (group % 4);
            for l in 0..32 {
                let high = ((x.hmask[l] >> group) & 1) as i8;
                q32[l] = ((qs[l] >> shift) & 3) as i8 - 4 + 4 * high;
            }
        }
        let sc = q3_scales(&x.scales);
        let isum = grouped_isum::<16>(&q, &y.qs, |j| sc[j] as i32);
        sumf = add_scaled(sumf, y.d.get(), x.d.to_f32(), isum);
    }
    sumf
}

/// Q4_K / Q5_K quants in element order: sub-block s (32 elements) is the low (even s) or high
/// (odd s) nibbles of `qs[32 · (s / 2)..][..32]`, plus 16 where bit s of `qh[l]` is set (Q5_K).
#[inline(always)]
fn unpack_k4(qs: &[u8; QK_K / 2], qh: Option<&[u8; QK_K / 8]>) -> [i8; QK_K] {
    let mut q = [0i8; QK_K];
    for (c, q64) in q.as_chunks_mut::<64>().0.iter_mut().enumerate() {
        let qs = &qs[32 * c..][..32];
        for l in 0..32 {
            q64[l] = (qs[l] & 0x0F) as i8;
            q64[l + 32] = (qs[l] >> 4) as i8;
        }
        if let Some(qh) = qh {
            let (bit0, bit1) = (1u8 << (2 * c), 2u8 << (2 * c));
            for l in 0..32 {
                q64[l] |= if qh[l] & bit0 != 0 { 16 } else { 0 };
                q64[l + 32] |= if qh[l] & bit1 != 0 { 16 } else { 0 };
            }
        }
    }
    q
}

/// Q4_K: `isum` over 8 sub-blocks of 32, `imin = Σ_g m_{g/2} · bsum_g`.
pub fn vec_dot_q4_k_q8_k(xs: &[BlockQ4K], ys: &[BlockQ8K]) -> f32 {
    let mut sumf = 0.0f32;
    for (x, y) in xs.iter().zip(ys) {
        let sm = k4_scales(&x.scales);
        let isum = grouped_isum::<32>(&unpack_k4(&x.qs, None), &y.qs, |s| sm[s] as i32);
        let imin = mins_sum(y, 2, |j| sm[8 + j]);
        let d_y = y.d.get();
        sumf = add_scaled(sumf, d_y, x.d.to_f32(), isum);
        sumf = sub_mins(sumf, d_y, x.dmin.to_f32(), imin);
    }
    sumf
}

/// Q5_K: as Q4_K with the fifth bit from `qh`.
pub fn vec_dot_q5_k_q8_k(xs: &[BlockQ5K], ys: &[BlockQ8K]) -> f32 {
    let mut sumf = 0.0f32;
    for (x, y) in xs.iter().zip(ys) {
        let sm = k4_scales(&x.scales);
        let isum = grouped_isum::<32>(&unpack_k4(&x.qs, Some(&x.qh)), &y.qs, |s| sm[s] as i32);
        let imin = mins_sum(y, 2, |j| sm[8 + j]);
        let d_y = y.d.get();
        sumf = add_scaled(sumf, d_y, x.d.to_f32(), isum);
        sumf = sub_mins(sumf, d_y, x.dmin.to_f32(), imin);
    }
    sumf
}

/// Q6_K: element `128h + 32k + l` is `ql[64h + 32 · (k % 2) + l]`'s low (k < 2) or high nibble
/// with bits `2k..2k + 2` of `qh[32h + l]` above, minus 32; group j of 16 takes `scales[j]`.
pub fn vec_dot_q6_k_q8_k(xs: &[BlockQ6K], ys: &[BlockQ8K]) -> f32 {
    let mut sumf = 0.0f32;
    for (x, y) in xs.iter().zip(ys) {
        let mut q = [0i8; QK_K];
        for (h, q128) in q.as_chunks_mut::<128>().0.iter_mut().enumerate() {
            let (ql, qh) = (&x.ql[64 * h..][..64], &x.qh[32 * h..][..32]);
            for (k, q32) in q128.as_chunks_mut::<32>().0.iter_mut().enumerate() {
                let (ql, lshift) = (&ql[32 * (k % 2)..][..32], 4 * (k / 2));
                for l in 0..32 {
                    let v = ((ql[l] >> lshift) & 0x0F) | (((qh[l] >> (2 * k)) & 3) << 4);
                    q32[l] = v as i8 - 32;
                }
            }
        }
        let isum = grouped_isum::<16>(&q, &y.qs, |j| x.scales[j] as i32);
        sumf = add_scaled(sumf, y.d.get(), x.d.to_f32(), isum);
    }
    sumf
}

/// IQ4_XS: group j of 32 is `qs[16j..16j + 16]`'s low then high nibbles through [`IQ4_VALUES`],
/// with scale `ls_j - 32`; as Q3_K and Q6_K, no mins. (|isum| ≤ 256 · 32 · 127 · 128 = 1.3e8.)
pub fn vec_dot_iq4_xs_q8_k(xs: &[BlockIQ4XS], ys: &[BlockQ8K]) -> f32 {
    let mut sumf = 0.0f32;
    for (x, y) in xs.iter().zip(ys) {
        let mut q = [0i8; QK_K];
        for (j, q32) in q.as_chunks_mut::<32>().0.iter_mut().enumerate() {
            *q32 = iq4_values(x.group(j));
        }
        let isum = grouped_isum::<32>(&q, &y.qs, |j| x.scale(j));
        sumf = add_scaled(sumf, y.d.get(), x.d.to_f32(), isum);
    }
    sumf
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu::{Isa, dot_fn};
    use crate::quant::testdata::*;
    use crate::quant::{GgmlType, as_blocks, dequantize_row, vec_dot as vec_dot_reference};

    fn canonical(wty: GgmlType, w: &[u8], a: &[u8]) -> f32 {
        let ys = as_blocks(a).unwrap();
        match wty {
            GgmlType::Q2_K => vec_dot_q2_k_q8_k(as_blocks(w).unwrap(), ys),
            GgmlType::Q3_K => vec_dot_q3_k_q8_k(as_blocks(w).unwrap(), ys),
            GgmlType::Q4_K => vec_dot_q4_k_q8_k(as_blocks(w).unwrap(), ys),
            GgmlType::Q5_K => vec_dot_q5_k_q8_k(as_blocks(w).unwrap(), ys),
            GgmlType::Q6_K => vec_dot_q6_k_q8_k(as_blocks(w).unwrap(), ys),
            GgmlType::IQ4_XS => vec_dot_iq4_xs_q8_k(as_blocks(w).unwrap(), ys),
            _ => unreachable!(),
        }
    }

    #[test]
    fn word_unpacking_of_scales_matches_the_block_helpers() {
        let mut rng = Rng(0x5EED_0001);
        for _ in 0..2000 {
            let raw: [u8; 12] = rng.bytes(12).try_into().unwrap();
            let (sc, m) = k4_scales_mins(&raw);
            let sm = k4_scales(&raw);
            assert_eq!((&sm[..8], &sm[8..]), (&sc[..], &m[..]), "{raw:02x?}");
            assert_eq!(q3_scales(&raw), q3_k_scales(&raw), "{raw:02x?}");
        }
    }

    /// The canonical order and ggml's reference order agree to rounding, relative to the sum of
    /// the magnitudes of the dequantised products.
    #[test]
    fn canonical_order_agrees_with_the_reference_to_rounding() {
        let mut rng = Rng(0xC0FF_EE00_1234_5678);
        for wty in K_TYPES {
            for n in [256usize, 1536, 4096] {
                let w = random_k_row(wty, n, &mut rng);
                let a = q8_k_row(n, 1.3);
                let (mut wf, mut af) = (vec![0f32; n], vec![0f32; n]);
                dequantize_row(wty, &w, &mut wf).unwrap();
                dequantize_row(GgmlType::Q8_K, &a, &mut af).unwrap();
                let scale: f64 = wf.iter().zip(&af).map(|(x, y)| (x * y).abs() as f64).sum();
                let ours = canonical(wty, &w, &a);
                let reference = vec_dot_reference(wty, &w, &a, n);
                let err = (ours as f64 - reference as f64).abs() / scale;
                assert!(
                    err < 1e-6,
                    "{wty} n={n}: canonical {ours} vs reference {reference} (normalised {err:e})"
                );
                assert_ne!(ours, 0.0);
            }
        }
    }

    /// ns per row of the reference, the canonical scalar and each SIMD variant; not a test of
    /// speed, run it with
    /// `cargo test --release --lib kquants::tests::timing -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn timing() {
        let mut rng = Rng(42);
        for k in [1536usize, 4096] {
            let rows = 64; // at most 220 KB of weights: they stay in L2
            let a = q8_k_row(k, 0.7);
            for wty in K_TYPES {
                let rb = wty.row_bytes(k).unwrap();
                let w: Vec<u8> = (0..rows)
                    .flat_map(|_| random_k_row(wty, k, &mut rng))
                    .collect();
                let time = |f: &dyn Fn(&[u8]) -> f32| {
                    let mut best = f64::INFINITY;
                    let mut sink = 0f32;
                    for _ in 0..7 {
                        let t = std::time::Instant::now();
                        for r in w.chunks_exact(rb) {
                            sink += f(std::hint::black_box(r));
                        }
                        best = best.min(t.elapsed().as_secs_f64());
                    }
                    std::hint::black_box(sink);
                    best * 1e9 / rows as f64
                };
                let mut line = format!(
                    "k={k} {wty}: reference {:7.1} ns/row",
                    time(&|r| vec_dot_reference(wty, r, &a, k))
                );
                for isa in Isa::all_supported() {
                    let f = dot_fn(isa, wty);
                    // SAFETY: dot_fn hands out only variants this CPU supports.
                    let ns = time(&|r| unsafe { f(r, &a, k) });
                    line += &format!(", {} {ns:7.1}", isa.name());
                }
                println!("{line}");
            }
        }
    }
}

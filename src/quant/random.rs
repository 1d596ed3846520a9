//! Random weights made directly as ggml blocks (for `oato synth`): random quants under scales chosen
//! so that the dequantised values have a wanted standard deviation σ and mean ≈ 0. No float weights
//! are made and quantised, so billions of weights take seconds.
//!
//! Per type, with j a per-block jitter uniform in [0.9, 1.1) (it adds 0.17% to the spread):
//! - F32, F16, BF16: uniform in [-σ√3, σ√3).
//! - Q4_0: random nibbles, `d = ±jσ / √21.5` (E[(q - 8)²] = 21.5). The sign is random, as ggml's own
//!   `d` takes the sign of the block's largest value; it also cancels the -0.5 mean of `q - 8`.
//! - Q8_0: random bytes, `d = jσ / √5461.5` (E[q²] = 5461.5; the mean, -0.5 d, is 0.7% of σ).
//! - Q4_K: random nibbles; 6-bit scales uniform in 48..64, mins equal to the scales and
//!   `dmin = 7.5 d`, so each 32-element group is `d·sc·(q - 7.5)`, symmetric about 0
//!   (E[(q - 7.5)²] = 21.25, E[sc²] = 3101.5).
//! - Q6_K: random 6-bit quants; 8-bit scales ±(16..32) with random signs (E[(q - 32)²] = 341.5,
//!   E[sc²] = 573.5).
//! - Q5_K: as Q4_K with random 5-bit quants and `dmin = 15.5 d` (E[(q - 15.5)²] = 85.25).
//! - Q3_K: random 3-bit quants (q in -4..4, E[q²] = 5.5); 6-bit scales ±(16..32) with random
//!   signs, which also cancel the -0.5 mean of q.
//! - Q2_K: random 2-bit quants; 4-bit scales uniform in 8..16, mins equal to the scales and
//!   `dmin = 1.5 d`, so each 16-element group is `d·sc·(q - 1.5)` (E[(q - 1.5)²] = 1.25,
//!   E[sc²] = 137.5).
//! - IQ4_NL: random nibbles, `d = ±jσ / √4548` (E[v²] = 4548 over the sixteen values); the random
//!   sign cancels their -5.875 mean, as Q4_0's.
//! - IQ4_XS: random nibbles; the eight 6-bit scales `ls - 32` = ±(16..32) with random signs
//!   (E[sc²] = 573.5), which cancel the values' mean.

use crate::error::{Error, Result};
use crate::quant::GgmlType;
use crate::quant::blocks::*;
use crate::rng::SplitMix64;

/// The types [`fill_random`] makes.
pub const RANDOM_TYPES: [GgmlType; 12] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q8_0,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::IQ4_NL,
    GgmlType::IQ4_XS,
];

/// Fills `out`, a whole number of `ty` blocks, with random weights of standard deviation `std`
/// (see the module comment for how each type is made). An error names the type or length at fault.
pub fn fill_random(ty: GgmlType, std: f32, rng: &mut SplitMix64, out: &mut [u8]) -> Result<()> {
    if !out.len().is_multiple_of(ty.type_size()) {
        return Err(Error::Model(format!(
            "random {ty} weights: {} bytes is not a whole number of {}-byte blocks",
            out.len(),
            ty.type_size()
        )));
    }
    let half_width = std * 3f32.sqrt();
    let uniform = |rng: &mut SplitMix64| (2.0 * rng.next_f32() - 1.0) * half_width;
    match ty {
        GgmlType::F32 => {
            for c in out.as_chunks_mut::<4>().0 {
                *c = uniform(rng).to_le_bytes();
            }
        }
        GgmlType::F16 => {
            for c in out.as_chunks_mut::<2>().0 {
                *c = F16Le::from_f32(uniform(rng)).0;
            }
        }
        GgmlType::BF16 => {
            for c in out.as_chunks_mut::<2>().0 {
                *c = f32_to_bf16(uniform(rng)).to_le_bytes();
            }
        }
        GgmlType::Q4_0 | GgmlType::IQ4_NL => {
            // One 18-byte layout: an f16 `d`, then sixteen bytes of nibbles.
            let square = if ty == GgmlType::Q4_0 {
                21.5f32
            } else {
                4548.0
            };
            let d = std / square.sqrt();
            for b in as_blocks_mut::<BlockQ4_0>(out)? {
                let r = rng.next_u64();
                let sign = if r & 1 == 0 { 1.0 } else { -1.0 };
                b.d = F16Le::from_f32(sign * jitter(r) * d);
                rng.fill_bytes(&mut b.qs);
            }
        }
        GgmlType::Q8_0 => {
            let d = std / 5461.5f32.sqrt();
            for b in as_blocks_mut::<BlockQ8_0>(out)? {
                b.d = F16Le::from_f32(jitter(rng.next_u64()) * d);
                let mut qs = [0u8; QK];
                rng.fill_bytes(&mut qs);
                b.qs = qs.map(|q| q as i8);
            }
        }
        GgmlType::Q4_K => {
            let d = std / (21.25f32.sqrt() * 3101.5f32.sqrt());
            for b in as_blocks_mut::<BlockQ4K>(out)? {
                let r = rng.next_u64();
                let sc: [u8; 8] = std::array::from_fn(|j| 48 + ((r >> (4 * j)) & 15) as u8);
                b.scales = pack_k4_scales_mins(&sc, &sc);
                b.d = F16Le::from_f32(jitter(r) * d);
                b.dmin = F16Le::from_f32(7.5 * b.d.to_f32());
                rng.fill_bytes(&mut b.qs);
            }
        }
        GgmlType::Q6_K => {
            let d = std / (341.5f32.sqrt() * 573.5f32.sqrt());
            for b in as_blocks_mut::<BlockQ6K>(out)? {
                let (scales, signs) = signed_scales(rng);
                b.scales = scales;
                b.d = F16Le::from_f32(jitter(signs) * d);
                rng.fill_bytes(&mut b.ql);
                rng.fill_bytes(&mut b.qh);
            }
        }
        GgmlType::Q5_K => {
            let d = std / (85.25f32.sqrt() * 3101.5f32.sqrt());
            for b in as_blocks_mut::<BlockQ5K>(out)? {
                let r = rng.next_u64();
                let sc: [u8; 8] = std::array::from_fn(|j| 48 + ((r >> (4 * j)) & 15) as u8);
                b.scales = pack_k4_scales_mins(&sc, &sc);
                b.d = F16Le::from_f32(jitter(r) * d);
                b.dmin = F16Le::from_f32(15.5 * b.d.to_f32());
                rng.fill_bytes(&mut b.qh);
                rng.fill_bytes(&mut b.qs);
            }
        }
        GgmlType::Q3_K => {
            let d = std / (5.5f32.sqrt() * 573.5f32.sqrt());
            for b in as_blocks_mut::<BlockQ3K>(out)? {
                let (sc, signs) = signed_scales(rng);
                b.scales = pack_q3_scales(&sc);
                b.d = F16Le::from_f32(jitter(signs) * d);
                rng.fill_bytes(&mut b.hmask);
                rng.fill_bytes(&mut b.qs);
            }
        }
        GgmlType::Q2_K => {
            let d = std / (1.25f32.sqrt() * 137.5f32.sqrt());
            for b in as_blocks_mut::<BlockQ2K>(out)? {
                let r = rng.next_u64();
                // Scale and min alike, 8..16, in the low and high nibble.
                b.scales = std::array::from_fn(|j| (8 + ((r >> (3 * j)) & 7) as u8) * 0x11);
                b.d = F16Le::from_f32(jitter(r) * d);
                b.dmin = F16Le::from_f32(1.5 * b.d.to_f32());
                rng.fill_bytes(&mut b.qs);
            }
        }
        GgmlType::IQ4_XS => {
            let d = std / (4548f32.sqrt() * 573.5f32.sqrt());
            for b in as_blocks_mut::<BlockIQ4XS>(out)? {
                let (sc, signs) = signed_scales(rng);
                let (mut lo, mut hi) = ([0u8; 4], 0u16);
                for (j, &s) in sc[..8].iter().enumerate() {
                    let v = (s + 32) as u8;
                    lo[j / 2] |= (v & 15) << (4 * (j % 2));
                    hi |= ((v >> 4) as u16) << (2 * j);
                }
                (b.scales_l, b.scales_h) = (lo, hi.to_le_bytes());
                b.d = F16Le::from_f32(jitter(signs) * d);
                rng.fill_bytes(&mut b.qs);
            }
        }
        _ => {
            return Err(Error::UnsupportedType(format!(
                "{ty} for random weights (made: {})",
                RANDOM_TYPES.map(|t| t.name()).join(", ")
            )));
        }
    }
    Ok(())
}

/// Sixteen scales ±(16..32) with random signs (Q6_K's and Q3_K's), and the random word the
/// signs came from (its top bits then jitter the block's `d`).
fn signed_scales(rng: &mut SplitMix64) -> ([i8; 16], u64) {
    let (r, signs) = (rng.next_u64(), rng.next_u64());
    let sc = std::array::from_fn(|j| {
        let s = 16 + ((r >> (4 * j)) & 15) as i8;
        if signs >> j & 1 == 0 { s } else { -s }
    });
    (sc, signs)
}

/// Q3_K's sixteen scales (-32..32) in its 12 bytes: scale j is stored as `j + 32` (six bits),
/// its low four in the low (j < 8) or high nibble of byte j % 8, its top two at bits
/// `2 (j / 4)` of byte `8 + j % 4` (the inverse of `kquants::q3_scales`).
fn pack_q3_scales(sc: &[i8; 16]) -> [u8; 12] {
    let mut raw = [0u8; 12];
    for (j, &s) in sc.iter().enumerate() {
        let v = (s + 32) as u8;
        raw[j % 8] |= (v & 15) << (4 * (j / 8));
        raw[8 + j % 4] |= (v >> 4) << (2 * (j / 4));
    }
    raw
}

/// A factor uniform in [0.9, 1.1) from the top 24 bits of `r`.
fn jitter(r: u64) -> f32 {
    0.9 + 0.2 * (r >> 40) as f32 / (1u64 << 24) as f32
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::dequantize_row;

    /// Mean and standard deviation of `rows` random rows of `k` elements, dequantised; every value
    /// must be finite.
    fn stats(ty: GgmlType, std: f32, k: usize, rows: usize) -> (f64, f64) {
        let mut rng = SplitMix64::new(7);
        let mut bytes = vec![0u8; ty.row_bytes(k).unwrap()];
        let mut x = vec![0f32; k];
        let (mut sum, mut sum2) = (0f64, 0f64);
        for _ in 0..rows {
            fill_random(ty, std, &mut rng, &mut bytes).unwrap();
            dequantize_row(ty, &bytes, &mut x).unwrap();
            for (i, &v) in x.iter().enumerate() {
                assert!(v.is_finite(), "{ty}: element {i} is {v}");
                sum += v as f64;
                sum2 += v as f64 * v as f64;
            }
        }
        let n = (k * rows) as f64;
        let mean = sum / n;
        (mean, (sum2 / n - mean * mean).sqrt())
    }

    #[test]
    fn dequantised_rows_have_the_wanted_spread_and_no_offset() {
        let want = 0.02f64;
        for ty in RANDOM_TYPES {
            // 2^16 values: the sample mean's own spread is σ/256.
            let (mean, std) = stats(ty, want as f32, 4096, 16);
            assert!(
                (std / want - 1.0).abs() < 0.03,
                "{ty}: std {std:.5}, wanted {want}"
            );
            // Q8_0 keeps its -0.5 d offset (0.7% of σ); a missing Q4_K min would be 160%.
            assert!(mean.abs() < 0.02 * want, "{ty}: mean {mean:.6}");
        }
    }

    #[test]
    fn k_quant_scales_are_the_ones_documented() {
        let mut rng = SplitMix64::new(1);
        let mut bytes = vec![0u8; 4 * 144];
        fill_random(GgmlType::Q4_K, 0.02, &mut rng, &mut bytes).unwrap();
        for x in as_blocks::<BlockQ4K>(&bytes).unwrap() {
            let (sc, m) = k4_scales_mins(&x.scales);
            assert_eq!(sc, m);
            assert!(sc.iter().all(|s| (48..64).contains(s)), "{sc:?}");
            let ratio = x.dmin.to_f32() / x.d.to_f32();
            assert!((ratio - 7.5).abs() < 0.01, "dmin / d = {ratio}");
        }
        let mut bytes = vec![0u8; 4 * 210];
        fill_random(GgmlType::Q6_K, 0.02, &mut rng, &mut bytes).unwrap();
        let blocks = as_blocks::<BlockQ6K>(&bytes).unwrap();
        let scales: Vec<i8> = blocks.iter().flat_map(|x| x.scales).collect();
        assert!(scales.iter().all(|s| (16..32).contains(&s.unsigned_abs())));
        assert!(scales.iter().any(|&s| s < 0) && scales.iter().any(|&s| s > 0));
        let mut bytes = vec![0u8; 4 * 110];
        fill_random(GgmlType::Q3_K, 0.02, &mut rng, &mut bytes).unwrap();
        let scales: Vec<i8> = as_blocks::<BlockQ3K>(&bytes)
            .unwrap()
            .iter()
            .flat_map(|x| crate::kernels::cpu::kquants::q3_scales(&x.scales))
            .collect();
        assert!(scales.iter().all(|s| (16..32).contains(&s.unsigned_abs())));
        assert!(scales.iter().any(|&s| s < 0) && scales.iter().any(|&s| s > 0));
        let mut bytes = vec![0u8; 4 * 136];
        fill_random(GgmlType::IQ4_XS, 0.02, &mut rng, &mut bytes).unwrap();
        let blocks = as_blocks::<BlockIQ4XS>(&bytes).unwrap();
        let scales: Vec<i32> = blocks
            .iter()
            .flat_map(|x| (0..8).map(|j| x.scale(j)))
            .collect();
        assert!(scales.iter().all(|s| (16..32).contains(&s.unsigned_abs())));
        assert!(scales.iter().any(|&s| s < 0) && scales.iter().any(|&s| s > 0));
    }

    #[test]
    fn same_seed_same_bytes_and_other_types_are_refused() {
        let fill = |seed| {
            let mut out = vec![0u8; 2 * 18];
            fill_random(GgmlType::Q4_0, 0.02, &mut SplitMix64::new(seed), &mut out).unwrap();
            out
        };
        assert_eq!(fill(3), fill(3));
        assert_ne!(fill(3), fill(4));
        let e = fill_random(GgmlType::Q5_0, 1.0, &mut SplitMix64::new(0), &mut [0; 22]);
        assert!(e.unwrap_err().to_string().contains("Q5_0"));
        let e = fill_random(GgmlType::Q4_0, 1.0, &mut SplitMix64::new(0), &mut [0; 17]);
        assert!(e.unwrap_err().to_string().contains("17 bytes"));
    }
}

//! Scalar reference quantisation: f32 rows into block formats with exactly the rounding of ggml's
//! `quantize_row_*_ref` (ggml-quants.c), so the bytes match ggml's (and the `gguf` Python
//! package's) output bit for bit.
//!
//! Rounding rules carried over from ggml:
//! - Q4_0 / Q5_0: `d = max / -8` (`-16`) where `max` is the first element of largest magnitude,
//!   `q = min(15, trunc(x / d + 8.5))` (`min(31, trunc(x / d + 16.5))`).
//! - Q4_1 / Q5_1: `d = (max - min) / 15` (`31`), `q = trunc((x - min) / d + 0.5)`.
//! - Q8_0 / Q8_1: `d = amax / 127`, `q = round(x / d)` half away from zero; Q8_1 also stores
//!   `s = f16(d * sum(q))`.
//! - Q8_K: `iscale = -127 / max`, `q = min(127, round_half_even(iscale * x))`, `d = 1 / iscale`
//!   kept as f32, `bsums` the sums of each 16 quants.
//! - `x / d` is always computed as `x * (1 / d)`, with `1 / d` taken as 0 when `d` is 0.
//! - F16 and block scales round to nearest even; BF16 as ggml (ties to even, quiet NaNs).
//!
//! Float-to-integer conversions saturate (Rust's `as`) where C's are undefined (NaN or huge
//! inputs), so no input panics.

use crate::error::{Error, Result};
use crate::quant::GgmlType;
use crate::quant::blocks::*;

/// Quantise one row of `src.len()` elements of f32 into `dst`, which must be exactly
/// `ty.row_bytes(src.len())` bytes.
///
/// Handles F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1 and Q8_K. The K-quant weight
/// formats (Q2_K..Q6_K) and the i-quants (IQ4_NL, IQ4_XS) are read-only here and give
/// `Error::UnsupportedType`, as do the others.
pub fn quantize_row(ty: GgmlType, src: &[f32], dst: &mut [u8]) -> Result<()> {
    use GgmlType::*;
    check_output(ty, src.len(), dst.len())?;
    match ty {
        F32 => {
            for (b, x) in dst.as_chunks_mut::<4>().0.iter_mut().zip(src) {
                *b = x.to_le_bytes();
            }
        }
        F16 => {
            for (b, &x) in dst.as_chunks_mut::<2>().0.iter_mut().zip(src) {
                *b = F16Le::from_f32(x).0;
            }
        }
        BF16 => {
            for (b, &x) in dst.as_chunks_mut::<2>().0.iter_mut().zip(src) {
                *b = f32_to_bf16(x).to_le_bytes();
            }
        }
        Q4_0 => each_block(src, dst, quantize_block_q4_0),
        Q4_1 => each_block(src, dst, quantize_block_q4_1),
        Q5_0 => each_block(src, dst, quantize_block_q5_0),
        Q5_1 => each_block(src, dst, quantize_block_q5_1),
        Q8_0 => each_block(src, dst, quantize_block_q8_0),
        Q8_1 => each_block(src, dst, quantize_block_q8_1),
        Q8_K => each_block(src, dst, quantize_block_q8_k),
        Q2_K | Q3_K | Q4_K | Q5_K | Q6_K | IQ4_NL | IQ4_XS => {
            return Err(Error::UnsupportedType(format!(
                "quantising to {ty} is not implemented (oato reads K-quant and i-quant weights, it does not make them)"
            )));
        }
        I8 | I16 | I32 | I64 | F64 => {
            return Err(Error::UnsupportedType(format!(
                "{ty} has no quantisation from f32"
            )));
        }
    }
    Ok(())
}

/// Apply a per-block quantiser over a row whose lengths the caller has checked.
#[inline]
fn each_block<B: Block, const N: usize>(src: &[f32], dst: &mut [u8], f: fn(&[f32; N], &mut B)) {
    for (x, y) in src
        .as_chunks::<N>()
        .0
        .iter()
        .zip(blocks_prefix_mut::<B>(dst))
    {
        f(x, y);
    }
}

/// The first element of largest magnitude, with its sign (0 for an all-zero block).
#[inline]
fn signed_absmax(x: &[f32]) -> f32 {
    let mut amax = 0.0f32;
    let mut max = 0.0f32;
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    max
}

#[inline]
fn min_max(x: &[f32]) -> (f32, f32) {
    let mut min = f32::MAX;
    let mut max = -f32::MAX;
    for &v in x {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    (min, max)
}

#[inline]
fn inverse_or_zero(d: f32) -> f32 {
    if d != 0.0 { 1.0 / d } else { 0.0 }
}

pub fn quantize_block_q4_0(x: &[f32; QK], y: &mut BlockQ4_0) {
    let d = signed_absmax(x) / -8.0;
    let id = inverse_or_zero(d);
    y.d = F16Le::from_f32(d);
    for j in 0..QK / 2 {
        let x0 = x[j] * id;
        let x1 = x[j + QK / 2] * id;
        let q0 = ((x0 + 8.5) as i8).min(15) as u8;
        let q1 = ((x1 + 8.5) as i8).min(15) as u8;
        y.qs[j] = q0 | (q1 << 4);
    }
}

pub fn quantize_block_q4_1(x: &[f32; QK], y: &mut BlockQ4_1) {
    let (min, max) = min_max(x);
    let d = (max - min) / 15.0;
    let id = inverse_or_zero(d);
    y.d = F16Le::from_f32(d);
    y.m = F16Le::from_f32(min);
    for j in 0..QK / 2 {
        let x0 = (x[j] - min) * id;
        let x1 = (x[j + QK / 2] - min) * id;
        let q0 = ((x0 + 0.5) as i8).min(15) as u8;
        let q1 = ((x1 + 0.5) as i8).min(15) as u8;
        y.qs[j] = q0 | (q1 << 4);
    }
}

/// Pack 32 five-bit quants: low nibbles into `qs` (j low, j + 16 high), fifth bits into `qh`.
#[inline]
fn pack_q5(q: &[u8; QK], qs: &mut [u8; QK / 2], qh: &mut [u8; 4]) {
    let mut h = 0u32;
    for j in 0..QK / 2 {
        let (q0, q1) = (q[j], q[j + QK / 2]);
        qs[j] = (q0 & 0x0F) | ((q1 & 0x0F) << 4);
        h |= (((q0 & 0x10) >> 4) as u32) << j;
        h |= (((q1 & 0x10) >> 4) as u32) << (j + QK / 2);
    }
    *qh = h.to_le_bytes();
}

pub fn quantize_block_q5_0(x: &[f32; QK], y: &mut BlockQ5_0) {
    let d = signed_absmax(x) / -16.0;
    let id = inverse_or_zero(d);
    y.d = F16Le::from_f32(d);
    let mut q = [0u8; QK];
    for (q, &v) in q.iter_mut().zip(x) {
        *q = ((v * id + 16.5) as i8).min(31) as u8;
    }
    pack_q5(&q, &mut y.qs, &mut y.qh);
}

pub fn quantize_block_q5_1(x: &[f32; QK], y: &mut BlockQ5_1) {
    let (min, max) = min_max(x);
    let d = (max - min) / 31.0;
    let id = inverse_or_zero(d);
    y.d = F16Le::from_f32(d);
    y.m = F16Le::from_f32(min);
    let mut q = [0u8; QK];
    for (q, &v) in q.iter_mut().zip(x) {
        // ggml clamps nothing here: (x - min) / d never exceeds 31.5.
        *q = ((v - min) * id + 0.5) as u8;
    }
    pack_q5(&q, &mut y.qs, &mut y.qh);
}

/// Q8 scale and quants shared by Q8_0 and Q8_1; returns `d` as f32.
#[inline]
fn quantize_q8(x: &[f32; QK], qs: &mut [i8; QK]) -> f32 {
    // ggml's MAX(amax, fabsf(v)), which (unlike f32::max) lets a NaN through.
    let amax = x
        .iter()
        .fold(0.0f32, |a, v| if a > v.abs() { a } else { v.abs() });
    let d = amax / 127.0;
    let id = inverse_or_zero(d);
    for (q, &v) in qs.iter_mut().zip(x) {
        *q = (v * id).round() as i8;
    }
    d
}

pub fn quantize_block_q8_0(x: &[f32; QK], y: &mut BlockQ8_0) {
    let d = quantize_q8(x, &mut y.qs);
    y.d = F16Le::from_f32(d);
}

pub fn quantize_block_q8_1(x: &[f32; QK], y: &mut BlockQ8_1) {
    let d = quantize_q8(x, &mut y.qs);
    let sum: i32 = y.qs.iter().map(|&q| q as i32).sum();
    y.d = F16Le::from_f32(d);
    y.s = F16Le::from_f32(sum as f32 * d);
}

/// For an all-zero block ggml sets `d = 0` and zero quants but leaves `bsums` unwritten; here they
/// are zero too.
pub fn quantize_block_q8_k(x: &[f32; QK_K], y: &mut BlockQ8K) {
    let mut amax = 0.0f32;
    let mut max = 0.0f32;
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax == 0.0 {
        *y = BlockQ8K::zeroed();
        return;
    }
    let iscale = -127.0 / max;
    for (q, &v) in y.qs.iter_mut().zip(x) {
        // ggml's nearest_int: adding 1.5 * 2^23 rounds half to even into the low mantissa bits,
        // exactly `round_ties_even` for |v| < 2^22 (here |v| <= 127), and it vectorises where
        // `round_ties_even` is a call to `rintf` on baseline x86-64.
        let r = ((iscale * v + 12582912.0).to_bits() & 0x007f_ffff) as i32 - 0x0040_0000;
        *q = r.clamp(-128, 127) as i8;
    }
    for (s, q16) in y.bsums.iter_mut().zip(y.qs.as_chunks::<16>().0) {
        *s = I16Le::new(q16.iter().map(|&q| q as i16).sum());
    }
    y.d = F32Le::new(1.0 / iscale);
}

/// Quantise activations for a dot product as ggml's x86 SIMD path does (`quantize_row_q8_0` /
/// `quantize_row_q8_1` under AVX2 and AVX-512, which llama.cpp runs on such CPUs): for Q8_0 and
/// Q8_1 the multiplier is `127 / amax` (not `1 / (amax / 127)`) and rounding is half to even.
/// Other types as [`quantize_row`]. The engine quantises activations with this so that its int8
/// activations equal llama.cpp's on the same inputs.
#[inline(always)]
pub fn quantize_act_row(ty: GgmlType, src: &[f32], dst: &mut [u8]) -> Result<()> {
    match ty {
        GgmlType::Q8_0 | GgmlType::Q8_1 => {
            check_output(ty, src.len(), dst.len())?;
            if ty == GgmlType::Q8_0 {
                let blocks = as_blocks_mut::<BlockQ8_0>(dst)?;
                for (x, y) in src.as_chunks::<QK>().0.iter().zip(blocks) {
                    y.d = F16Le::from_f32(quantize_q8_simd(x, &mut y.qs));
                }
            } else {
                let blocks = as_blocks_mut::<BlockQ8_1>(dst)?;
                for (x, y) in src.as_chunks::<QK>().0.iter().zip(blocks) {
                    let d = quantize_q8_simd(x, &mut y.qs);
                    let sum: i32 = y.qs.iter().map(|&q| q as i32).sum();
                    y.d = F16Le::from_f32(d);
                    y.s = F16Le::from_f32(d * sum as f32);
                }
            }
            Ok(())
        }
        _ => quantize_row(ty, src, dst),
    }
}

/// An error unless `dst_len` is the size of a `ty` row of `n` elements.
fn check_output(ty: GgmlType, n: usize, dst_len: usize) -> Result<()> {
    let want = ty.row_bytes(n)?;
    if dst_len != want {
        return Err(Error::Model(format!(
            "quantize: a {ty} row of {n} elements is {want} bytes, the output has {dst_len} bytes"
        )));
    }
    Ok(())
}

/// The x86 SIMD variant of the Q8 block quantiser; returns `d`.
#[inline(always)]
fn quantize_q8_simd(x: &[f32; QK], qs: &mut [i8; QK]) -> f32 {
    let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    for (q, &v) in qs.iter_mut().zip(x) {
        *q = (v * id).round_ties_even() as i8;
    }
    d
}

#[cfg(test)]
mod act_tests {
    use super::*;

    #[test]
    fn activation_quantiser_rounds_ties_to_even_like_ggml_x86() {
        // amax 127 makes the multiplier exactly 1, so 2.5 and -3.5 are exact ties.
        let mut x = [0.0f32; QK];
        x[0] = 127.0;
        x[1] = 2.5;
        x[2] = -3.5;
        x[3] = 1.49;
        let mut act = vec![0u8; 36];
        let mut reference = vec![0u8; 36];
        quantize_act_row(GgmlType::Q8_1, &x, &mut act).unwrap();
        quantize_row(GgmlType::Q8_1, &x, &mut reference).unwrap();
        let a = &as_blocks::<BlockQ8_1>(&act).unwrap()[0];
        let r = &as_blocks::<BlockQ8_1>(&reference).unwrap()[0];
        assert_eq!(&a.qs[..4], &[127, 2, -4, 1]);
        assert_eq!(
            &r.qs[..4],
            &[127, 3, -4, 1],
            "ggml's reference rounds half away from zero"
        );
        assert_eq!(a.d.to_f32(), 1.0);
        // s = d * sum(q) = 127 + 2 - 4 + 1.
        assert_eq!(a.s.to_f32(), 126.0);
    }

    #[test]
    fn activation_quantiser_matches_the_reference_away_from_ties() {
        let x: Vec<f32> = (0..QK * 9)
            .map(|i| 0.1 + 2.0 * (i as f32 * 0.37).cos())
            .collect();
        for ty in [
            GgmlType::Q8_0,
            GgmlType::Q8_1,
            GgmlType::Q8_K,
            GgmlType::F16,
        ] {
            let n = ty
                .row_bytes(if ty == GgmlType::Q8_K { 256 } else { x.len() })
                .unwrap();
            let len = if ty == GgmlType::Q8_K { 256 } else { x.len() };
            let (mut a, mut r) = (vec![0u8; n], vec![0u8; n]);
            quantize_act_row(ty, &x[..len], &mut a).unwrap();
            quantize_row(ty, &x[..len], &mut r).unwrap();
            let differing = a.iter().zip(&r).filter(|(p, q)| p != q).count();
            assert!(
                differing <= n / 100,
                "{ty}: {differing} of {n} bytes differ"
            );
        }
    }
}

//! Scalar reference dot products of a weight row with an activation row already quantised to the
//! weight type's `vec_dot_type`, in the arithmetic order of ggml's `ggml_vec_dot_*_generic`
//! (ggml-cpu/quants.c) and `ggml_vec_dot_{f32,f16,bf16}` without SIMD (ggml-cpu/vec.cpp).
//!
//! Precision, as ggml:
//! - 32-element formats: an exact i32 sum of quant products per block, then one f32 scale step
//!   per block accumulated in f32 (e.g. q4_1·q8_1: `sumf += (d_x * d_y) * sumi + m_x * s_y`).
//! - K-quants: exact i32 sums in eight lanes (element index mod 8) per super-block, scaled into
//!   eight f32 lane sums carried across super-blocks; Q4_K/Q5_K subtract their mins term per
//!   super-block from a separate f32 sum, and the eight lanes are added onto that sum at the end.
//! - F32, F16, BF16: each product in f32 (f16/bf16 widened exactly), accumulated in f64
//!   (`ggml_float`), returned as f32.
//!
//! No step is fused (no FMA): results equal ggml's reference C compiled without FP contraction.
//! These loops allocate nothing.

use crate::error::{Error, Result};
use crate::quant::GgmlType;
use crate::quant::blocks::*;
use crate::quant::dequantize::{dequantize_row, q6_k_quads};

/// Whether [`vec_dot`] takes weights of type `ty`.
pub fn has_vec_dot(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(
        ty,
        F32 | F16
            | BF16
            | Q4_0
            | Q4_1
            | Q5_0
            | Q5_1
            | Q8_0
            | Q2_K
            | Q3_K
            | Q4_K
            | Q5_K
            | Q6_K
            | IQ4_NL
            | IQ4_XS
    )
}

/// Dot product of one weight row `w` (type `wty`, `n` elements) with one activation row `a` in
/// `wty.vec_dot_type()` format.
///
/// Callers check lengths and types (see [`vec_dot_checked`]): wrong lengths are caught by
/// `debug_assert!` only (in release the shorter row bounds the sum; nothing reads out of bounds),
/// and a weight type without a dot product (see [`has_vec_dot`]) panics.
pub fn vec_dot(wty: GgmlType, w: &[u8], a: &[u8], n: usize) -> f32 {
    use GgmlType::*;
    debug_assert!(
        wty.row_bytes(n).is_ok_and(|b| b == w.len()),
        "vec_dot: {wty} weight row of {n} elements given {} bytes",
        w.len()
    );
    debug_assert!(
        wty.vec_dot_type().row_bytes(n).is_ok_and(|b| b == a.len()),
        "vec_dot: {} activation row of {n} elements given {} bytes",
        wty.vec_dot_type(),
        a.len()
    );
    let nb = n / wty.block_size();
    match wty {
        F32 => dot_f32_bytes(w, a, n),
        F16 => dot_f16_bytes(w, a, n),
        BF16 => dot_bf16_bytes(w, a, n),
        Q4_0 => vec_dot_q4_0_q8_0(take(w, nb), take(a, nb)),
        Q4_1 => vec_dot_q4_1_q8_1(take(w, nb), take(a, nb)),
        Q5_0 => vec_dot_q5_0_q8_0(take(w, nb), take(a, nb)),
        Q5_1 => vec_dot_q5_1_q8_1(take(w, nb), take(a, nb)),
        Q8_0 => vec_dot_q8_0_q8_0(take(w, nb), take(a, nb)),
        Q2_K => vec_dot_q2_k_q8_k(take(w, nb), take(a, nb)),
        Q3_K => vec_dot_q3_k_q8_k(take(w, nb), take(a, nb)),
        Q4_K => vec_dot_q4_k_q8_k(take(w, nb), take(a, nb)),
        Q5_K => vec_dot_q5_k_q8_k(take(w, nb), take(a, nb)),
        Q6_K => vec_dot_q6_k_q8_k(take(w, nb), take(a, nb)),
        IQ4_NL => vec_dot_iq4_nl_q8_0(take(w, nb), take(a, nb)),
        IQ4_XS => vec_dot_iq4_xs_q8_k(take(w, nb), take(a, nb)),
        Q8_1 | Q8_K | I8 | I16 | I32 | I64 | F64 => {
            panic!("vec_dot: no dot product for {wty} weights (check has_vec_dot first)")
        }
    }
}

/// [`vec_dot`] with the lengths and the weight type checked: an error instead of a panic.
pub fn vec_dot_checked(wty: GgmlType, w: &[u8], a: &[u8], n: usize) -> Result<f32> {
    if !has_vec_dot(wty) {
        return Err(Error::UnsupportedType(format!(
            "no dot product for {wty} weights"
        )));
    }
    let aty = wty.vec_dot_type();
    let (wb, ab) = (wty.row_bytes(n)?, aty.row_bytes(n)?);
    if w.len() != wb || a.len() != ab {
        return Err(Error::Model(format!(
            "vec_dot of {n} elements needs a {wb}-byte {wty} row and a {ab}-byte {aty} row, \
             got {} and {} bytes",
            w.len(),
            a.len()
        )));
    }
    Ok(vec_dot(wty, w, a, n))
}

/// The slow oracle: dequantise `w` to f32 and dot it with `x` (exact f64 products, f64 sum).
///
/// # Panics
/// When `w` is not `x.len()` elements of `wty` or `wty` cannot be dequantised; it is a test oracle.
pub fn vec_dot_f32_ref(wty: GgmlType, w: &[u8], x: &[f32]) -> f32 {
    let mut wf = vec![0.0f32; x.len()];
    if let Err(e) = dequantize_row(wty, w, &mut wf) {
        panic!("vec_dot_f32_ref: {e}");
    }
    wf.iter()
        .zip(x)
        .map(|(&a, &b)| a as f64 * b as f64)
        .sum::<f64>() as f32
}

/// The first `nb` whole blocks of `bytes` (fewer when `bytes` is short).
#[inline]
fn take<B: Block>(bytes: &[u8], nb: usize) -> &[B] {
    let blocks = blocks_prefix::<B>(bytes);
    &blocks[..nb.min(blocks.len())]
}

fn dot_f32_bytes(w: &[u8], a: &[u8], n: usize) -> f32 {
    let (w, a) = (w.as_chunks::<4>().0, a.as_chunks::<4>().0);
    let mut sum = 0.0f64;
    for (x, y) in w.iter().zip(a).take(n) {
        sum += (f32::from_le_bytes(*x) * f32::from_le_bytes(*y)) as f64;
    }
    sum as f32
}

fn dot_f16_bytes(w: &[u8], a: &[u8], n: usize) -> f32 {
    let (w, a) = (w.as_chunks::<2>().0, a.as_chunks::<2>().0);
    let mut sum = 0.0f64;
    for (x, y) in w.iter().zip(a).take(n) {
        sum += (F16Le(*x).to_f32() * F16Le(*y).to_f32()) as f64;
    }
    sum as f32
}

fn dot_bf16_bytes(w: &[u8], a: &[u8], n: usize) -> f32 {
    let (w, a) = (w.as_chunks::<2>().0, a.as_chunks::<2>().0);
    let mut sum = 0.0f64;
    for (x, y) in w.iter().zip(a).take(n) {
        let p = bf16_to_f32(u16::from_le_bytes(*x)) * bf16_to_f32(u16::from_le_bytes(*y));
        sum += p as f64;
    }
    sum as f32
}

/// `sumf += (sumi * d_x) * d_y` per block.
pub fn vec_dot_q4_0_q8_0(xs: &[BlockQ4_0], ys: &[BlockQ8_0]) -> f32 {
    let mut sumf = 0.0f32;
    for (x, y) in xs.iter().zip(ys) {
        let (mut sumi0, mut sumi1) = (0i32, 0i32);
        for j in 0..QK / 2 {
            let v0 = (x.qs[j] & 0x0F) as i32 - 8;
            let v1 = (x.qs[j] >> 4) as i32 - 8;
            sumi0 += v0 * y.qs[j] as i32;
            sumi1 += v1 * y.qs[j + QK / 2] as i32;
        }
        sumf += (sumi0 + sumi1) as f32 * x.d.to_f32() * y.d.to_f32();
    }
    sumf
}

/// The exact `Σ v·y` of 32 IQ4 values (as [`iq4_values`] spreads them) against 32 activations
/// (ggml's `sumi1 + sumi2`: integers, so in any order).
fn iq4_sumi(qs: &[u8; QK / 2], y: &[i8; QK]) -> i32 {
    iq4_values(qs)
        .iter()
        .zip(y)
        .map(|(&v, &y)| v as i32 * y as i32)
        .sum()
}

/// `sumf += (d_y * d_x) * sumi` per block, the quants through [`IQ4_VALUES`].
pub fn vec_dot_iq4_nl_q8_0(xs: &[BlockIQ4NL], ys: &[BlockQ8_0]) -> f32 {
    let mut sumf = 0.0f32;
    for (x, y) in xs.iter().zip(ys) {
        let d = y.d.to_f32() * x.d.to_f32();
        sumf += d * iq4_sumi(&x.qs, &y.qs) as f32;
    }
    sumf
}

/// Per group j of 32: `sumf += (d_x * d_y * (ls_j - 32)) * sumi_j`, groups in order.
pub fn vec_dot_iq4_xs_q8_k(xs: &[BlockIQ4XS], ys: &[BlockQ8K]) -> f32 {
    let mut sumf = 0.0f32;
    for (x, y) in xs.iter().zip(ys) {
        let d4d8 = x.d.to_f32() * y.d.get();
        for (j, q8) in y.qs.as_chunks::<QK>().0.iter().enumerate() {
            sumf += (d4d8 * x.scale(j) as f32) * iq4_sumi(x.group(j), q8) as f32;
        }
    }
    sumf
}

/// `sumf += (d_x * d_y) * sumi + m_x * s_y` per block.
pub fn vec_dot_q4_1_q8_1(xs: &[BlockQ4_1], ys: &[BlockQ8_1]) -> f32 {
    let mut sumf = 0.0f32;
    for (x, y) in xs.iter().zip(ys) {
        let (mut sumi0, mut sumi1) = (0i32, 0i32);
        for j in 0..QK / 2 {
            let v0 = (x.qs[j] & 0x0F) as i32;
            let v1 = (x.qs[j] >> 4) as i32;
            sumi0 += v0 * y.qs[j] as i32;
            sumi1 += v1 * y.qs[j + QK / 2] as i32;
        }
        let sumi = sumi0 + sumi1;
        sumf += (x.d.to_f32() * y.d.to_f32()) * sumi as f32 + x.m.to_f32() * y.s.to_f32();
    }
    sumf
}

/// Fifth bits of elements j and j + 16, shifted to bit 4.
#[inline(always)]
fn q5_high(qh: u32, j: usize) -> (i32, i32) {
    (
        (((qh >> j) << 4) & 0x10) as i32,
        ((qh >> (j + 12)) & 0x10) as i32,
    )
}

/// `sumf += (d_x * d_y) * sumi` per block.
pub fn vec_dot_q5_0_q8_0(xs: &[BlockQ5_0], ys: &[BlockQ8_0]) -> f32 {
    let mut sumf = 0.0f32;
    for (x, y) in xs.iter().zip(ys) {
        let qh = u32::from_le_bytes(x.qh);
        let (mut sumi0, mut sumi1) = (0i32, 0i32);
        for j in 0..QK / 2 {
            let (h0, h1) = q5_high(qh, j);
            let x0 = ((x.qs[j] & 0x0F) as i32 | h0) - 16;
            let x1 = ((x.qs[j] >> 4) as i32 | h1) - 16;
            sumi0 += x0 * y.qs[j] as i32;
            sumi1 += x1 * y.qs[j + QK / 2] as i32;
        }
        sumf += (x.d.to_f32() * y.d.to_f32()) * (sumi0 + sumi1) as f32;
    }
    sumf
}

/// `sumf += (d_x * d_y) * sumi + m_x * s_y` per block.
pub fn vec_dot_q5_1_q8_1(xs: &[BlockQ5_1], ys: &[BlockQ8_1]) -> f32 {
    let mut sumf = 0.0f32;
    for (x, y) in xs.iter().zip(ys) {
        let qh = u32::from_le_bytes(x.qh);
        let (mut sumi0, mut sumi1) = (0i32, 0i32);
        for j in 0..QK / 2 {
            let (h0, h1) = q5_high(qh, j);
            let x0 = (x.qs[j] & 0x0F) as i32 | h0;
            let x1 = (x.qs[j] >> 4) as i32 | h1;
            sumi0 += x0 * y.qs[j] as i32;
            sumi1 += x1 * y.qs[j + QK / 2] as i32;
        }
        let sumi = sumi0 + sumi1;
        sumf += (x.d.to_f32() * y.d.to_f32()) * sumi as f32 + x.m.to_f32() * y.s.to_f32();
    }
    sumf
}

/// `sumf += sumi * (d_x * d_y)` per block.
pub fn vec_dot_q8_0_q8_0(xs: &[BlockQ8_0], ys: &[BlockQ8_0]) -> f32 {
    let mut sumf = 0.0f32;
    for (x, y) in xs.iter().zip(ys) {
        let sumi: i32 =
            x.qs.iter()
                .zip(&y.qs)
                .map(|(&a, &b)| a as i32 * b as i32)
                .sum();
        sumf += sumi as f32 * (x.d.to_f32() * y.d.to_f32());
    }
    sumf
}

/// Per super-block: `sumf += (d_y * d_x) * isum - (d_y * dmin_x) * summs`, where `isum` sums
/// `scale * q2 * q8` and `summs` sums `min * bsum` over the sixteen 16-element groups.
pub fn vec_dot_q2_k_q8_k(xs: &[BlockQ2K], ys: &[BlockQ8K]) -> f32 {
    let mut sumf = 0.0f32;
    for (x, y) in xs.iter().zip(ys) {
        let summs: i32 = (0..QK_K / 16)
            .map(|j| y.bsums[j].get() as i32 * (x.scales[j] >> 4) as i32)
            .sum();
        let dall = y.d.get() * x.d.to_f32();
        let dmin = y.d.get() * x.dmin.to_f32();
        let mut isum = 0i32;
        // group g of 16 elements: half h = g / 8, plane p = (g / 2) % 4, bytes 16 * (g % 2)..
        for (g, q8) in y.qs.as_chunks::<16>().0.iter().enumerate() {
            let q2 = &x.qs[32 * (g / 8) + 16 * (g % 2)..][..16];
            let shift = 2 * ((g / 2) % 4);
            let mut isuml = 0i32;
            for l in 0..16 {
                isuml += q8[l] as i32 * ((q2[l] >> shift) & 3) as i32;
            }
            isum += (x.scales[g] & 0x0F) as i32 * isuml;
        }
        sumf += dall * isum as f32 - dmin * summs as f32;
    }
    sumf
}

/// Add eight exact i32 lane sums, scaled by `d`, into the eight f32 lane accumulators.
#[inline(always)]
fn scale_lanes(sums: &mut [f32; 8], d: f32, aux32: &[i32; 8]) {
    for (s, &a) in sums.iter_mut().zip(aux32) {
        *s += d * a as f32;
    }
}

/// Sum of the eight lanes, added in order onto `sumf`.
#[inline(always)]
fn finish_lanes(mut sumf: f32, sums: &[f32; 8]) -> f32 {
    for &s in sums {
        sumf += s;
    }
    sumf
}

/// Eight-lane integer sums `sum scale(i) * q8[i] * a[i]` (lane `i % 8`), with the scale constant over
/// each `group`-element group.
#[inline(always)]
fn lane_sums<const GROUP: usize>(
    a: &[i8; QK_K],
    q8: &[i8; QK_K],
    scale: impl Fn(usize) -> i32,
) -> [i32; 8] {
    let mut aux32 = [0i32; 8];
    for (g, (a, q)) in a
        .as_chunks::<GROUP>()
        .0
        .iter()
        .zip(q8.as_chunks::<GROUP>().0)
        .enumerate()
    {
        let sc = scale(g);
        for l in 0..GROUP {
            aux32[l % 8] += sc * (q[l] as i32 * a[l] as i32);
        }
    }
    aux32
}

pub fn vec_dot_q3_k_q8_k(xs: &[BlockQ3K], ys: &[BlockQ8K]) -> f32 {
    let mut sums = [0.0f32; 8];
    for (x, y) in xs.iter().zip(ys) {
        let mut a = [0i8; QK_K];
        for (group, a32) in a.as_chunks_mut::<32>().0.iter_mut().enumerate() {
            let (h, p) = (group / 4, group % 4);
            let q3 = &x.qs[32 * h..32 * h + 32];
            let mask = 1u8 << group;
            for l in 0..32 {
                let low = ((q3[l] >> (2 * p)) & 3) as i8;
                a32[l] = low - if x.hmask[l] & mask != 0 { 0 } else { 4 };
            }
        }
        let scales = q3_k_scales(&x.scales);
        let aux32 = lane_sums::<16>(&a, &y.qs, |g| scales[g] as i32);
        scale_lanes(&mut sums, x.d.to_f32() * y.d.get(), &aux32);
    }
    finish_lanes(0.0, &sums)
}

/// Q4_K / Q5_K quants as bytes in element order: sub-block `sub` (32 elements) is the low (even
/// `sub`) or high (odd) nibbles of `qs[32 * (sub / 2)..][..32]`, plus 16 where bit `sub` of `qh[l]`
/// is set (Q5_K).
#[inline(always)]
fn unpack_k4(qs: &[u8; QK_K / 2], qh: Option<&[u8; QK_K / 8]>) -> [i8; QK_K] {
    let mut a = [0i8; QK_K];
    for (sub, a32) in a.as_chunks_mut::<32>().0.iter_mut().enumerate() {
        let q4 = &qs[32 * (sub / 2)..32 * (sub / 2) + 32];
        let shift = 4 * (sub % 2);
        for l in 0..32 {
            let mut v = (q4[l] >> shift) & 0x0F;
            if let Some(qh) = qh
                && qh[l] & (1 << sub) != 0
            {
                v += 16;
            }
            a32[l] = v as i8;
        }
    }
    a
}

/// One Q4_K / Q5_K super-block: scaled quant sums into the lanes, the mins term off `sumf`.
#[inline(always)]
fn dot_k4(
    (d, dmin): (F16Le, F16Le),
    scales: &[u8; K_SCALE_SIZE],
    a: &[i8; QK_K],
    y: &BlockQ8K,
    sums: &mut [f32; 8],
    sumf: &mut f32,
) {
    let (sc, mins) = k4_scales_mins(scales);
    let sumi: i32 = (0..QK_K / 16)
        .map(|j| y.bsums[j].get() as i32 * mins[j / 2] as i32)
        .sum();
    let aux32 = lane_sums::<32>(a, &y.qs, |g| sc[g] as i32);
    scale_lanes(sums, d.to_f32() * y.d.get(), &aux32);
    let dmin = dmin.to_f32() * y.d.get();
    *sumf -= dmin * sumi as f32;
}

pub fn vec_dot_q4_k_q8_k(xs: &[BlockQ4K], ys: &[BlockQ8K]) -> f32 {
    let mut sums = [0.0f32; 8];
    let mut sumf = 0.0f32;
    for (x, y) in xs.iter().zip(ys) {
        let a = unpack_k4(&x.qs, None);
        dot_k4((x.d, x.dmin), &x.scales, &a, y, &mut sums, &mut sumf);
    }
    finish_lanes(sumf, &sums)
}

pub fn vec_dot_q5_k_q8_k(xs: &[BlockQ5K], ys: &[BlockQ8K]) -> f32 {
    let mut sums = [0.0f32; 8];
    let mut sumf = 0.0f32;
    for (x, y) in xs.iter().zip(ys) {
        let a = unpack_k4(&x.qs, Some(&x.qh));
        dot_k4((x.d, x.dmin), &x.scales, &a, y, &mut sums, &mut sumf);
    }
    finish_lanes(sumf, &sums)
}

pub fn vec_dot_q6_k_q8_k(xs: &[BlockQ6K], ys: &[BlockQ8K]) -> f32 {
    let mut sums = [0.0f32; 8];
    for (x, y) in xs.iter().zip(ys) {
        let mut a = [0i8; QK_K];
        for (h, a128) in a.as_chunks_mut::<128>().0.iter_mut().enumerate() {
            let ql = &x.ql[64 * h..64 * h + 64];
            let qh = &x.qh[32 * h..32 * h + 32];
            for l in 0..32 {
                let q = q6_k_quads(ql, qh, l);
                for (k, &qk) in q.iter().enumerate() {
                    a128[l + 32 * k] = qk;
                }
            }
        }
        let aux32 = lane_sums::<16>(&a, &y.qs, |g| x.scales[g] as i32);
        scale_lanes(&mut sums, x.d.to_f32() * y.d.get(), &aux32);
    }
    finish_lanes(0.0, &sums)
}

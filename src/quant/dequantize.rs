//! Scalar reference dequantisation: each block format back to f32, with the arithmetic of ggml's
//! `dequantize_row_*` (ggml-quants.c), so results are bit-identical to ggml's reference C.
//!
//! All products are single f32 multiplies then an f32 add, never fused: ggml's reference C rounds
//! each step (when its compiler does not contract to FMA), and so does Rust.

use crate::error::{Error, Result};
use crate::quant::GgmlType;
use crate::quant::blocks::*;

/// Dequantise one row: `src` holds `dst.len()` elements of type `ty`.
///
/// Handles F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
/// Q8_K, IQ4_NL and IQ4_XS. Errors, never panics, when `dst.len()` is not a whole number of
/// blocks, when `src` is
/// not exactly that many blocks, or when the type is not one of these.
pub fn dequantize_row(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<()> {
    use GgmlType::*;
    let want = ty.row_bytes(dst.len())?;
    if src.len() != want {
        return Err(Error::Model(format!(
            "dequantize: a {ty} row of {} elements is {want} bytes, got {} bytes",
            dst.len(),
            src.len()
        )));
    }
    match ty {
        F32 => {
            for (y, b) in dst.iter_mut().zip(src.as_chunks::<4>().0) {
                *y = f32::from_le_bytes(*b);
            }
        }
        F16 => {
            for (y, b) in dst.iter_mut().zip(src.as_chunks::<2>().0) {
                *y = F16Le(*b).to_f32();
            }
        }
        BF16 => {
            for (y, b) in dst.iter_mut().zip(src.as_chunks::<2>().0) {
                *y = bf16_to_f32(u16::from_le_bytes(*b));
            }
        }
        Q4_0 => each_block(src, dst, dequantize_block_q4_0),
        Q4_1 => each_block(src, dst, dequantize_block_q4_1),
        Q5_0 => each_block(src, dst, dequantize_block_q5_0),
        Q5_1 => each_block(src, dst, dequantize_block_q5_1),
        Q8_0 => each_block(src, dst, dequantize_block_q8_0),
        Q8_1 => each_block(src, dst, dequantize_block_q8_1),
        Q2_K => each_block(src, dst, dequantize_block_q2_k),
        Q3_K => each_block(src, dst, dequantize_block_q3_k),
        Q4_K => each_block(src, dst, dequantize_block_q4_k),
        Q5_K => each_block(src, dst, dequantize_block_q5_k),
        Q6_K => each_block(src, dst, dequantize_block_q6_k),
        Q8_K => each_block(src, dst, dequantize_block_q8_k),
        IQ4_NL => each_block(src, dst, dequantize_block_iq4_nl),
        IQ4_XS => each_block(src, dst, dequantize_block_iq4_xs),
        I8 | I16 | I32 | I64 | F64 => {
            return Err(Error::UnsupportedType(format!(
                "{ty} has no dequantisation to f32"
            )));
        }
    }
    Ok(())
}

/// Apply a per-block dequantiser over a row whose lengths the caller has checked.
#[inline]
fn each_block<B: Block, const N: usize>(src: &[u8], dst: &mut [f32], f: fn(&B, &mut [f32; N])) {
    for (x, y) in blocks_prefix::<B>(src)
        .iter()
        .zip(dst.as_chunks_mut::<N>().0)
    {
        f(x, y);
    }
}

/// `y = d * (q - 8)`.
pub fn dequantize_block_q4_0(x: &BlockQ4_0, y: &mut [f32; QK]) {
    let d = x.d.to_f32();
    for j in 0..QK / 2 {
        let x0 = (x.qs[j] & 0x0F) as i32 - 8;
        let x1 = (x.qs[j] >> 4) as i32 - 8;
        y[j] = x0 as f32 * d;
        y[j + QK / 2] = x1 as f32 * d;
    }
}

/// `y = q * d + m`.
pub fn dequantize_block_q4_1(x: &BlockQ4_1, y: &mut [f32; QK]) {
    let d = x.d.to_f32();
    let m = x.m.to_f32();
    for j in 0..QK / 2 {
        let x0 = (x.qs[j] & 0x0F) as i32;
        let x1 = (x.qs[j] >> 4) as i32;
        y[j] = x0 as f32 * d + m;
        y[j + QK / 2] = x1 as f32 * d + m;
    }
}

/// The fifth bits of elements j and j + 16 from a Q5 block's `qh`, already shifted to bit 4.
#[inline(always)]
fn q5_high_bits(qh: u32, j: usize) -> (u8, u8) {
    (
        (((qh >> j) << 4) & 0x10) as u8,
        ((qh >> (j + 12)) & 0x10) as u8,
    )
}

/// `y = d * (q - 16)`.
pub fn dequantize_block_q5_0(x: &BlockQ5_0, y: &mut [f32; QK]) {
    let d = x.d.to_f32();
    let qh = u32::from_le_bytes(x.qh);
    for j in 0..QK / 2 {
        let (h0, h1) = q5_high_bits(qh, j);
        let x0 = ((x.qs[j] & 0x0F) | h0) as i32 - 16;
        let x1 = ((x.qs[j] >> 4) | h1) as i32 - 16;
        y[j] = x0 as f32 * d;
        y[j + QK / 2] = x1 as f32 * d;
    }
}

/// `y = q * d + m`.
pub fn dequantize_block_q5_1(x: &BlockQ5_1, y: &mut [f32; QK]) {
    let d = x.d.to_f32();
    let m = x.m.to_f32();
    let qh = u32::from_le_bytes(x.qh);
    for j in 0..QK / 2 {
        let (h0, h1) = q5_high_bits(qh, j);
        let x0 = ((x.qs[j] & 0x0F) | h0) as i32;
        let x1 = ((x.qs[j] >> 4) | h1) as i32;
        y[j] = x0 as f32 * d + m;
        y[j + QK / 2] = x1 as f32 * d + m;
    }
}

/// `y = q * d`.
pub fn dequantize_block_q8_0(x: &BlockQ8_0, y: &mut [f32; QK]) {
    let d = x.d.to_f32();
    for (y, &q) in y.iter_mut().zip(&x.qs) {
        *y = q as f32 * d;
    }
}

/// `y = q * d` (the sum field `s` is not needed; ggml has no Q8_1 dequantiser, this mirrors Q8_0).
pub fn dequantize_block_q8_1(x: &BlockQ8_1, y: &mut [f32; QK]) {
    let d = x.d.to_f32();
    for (y, &q) in y.iter_mut().zip(&x.qs) {
        *y = q as f32 * d;
    }
}

/// Element order: for each 128-element half h and 2-bit plane p (shift 2p), 32 elements from
/// `qs[32h..32h + 32]`; each 16 of them take the next `scales` byte.
pub fn dequantize_block_q2_k(x: &BlockQ2K, y: &mut [f32; QK_K]) {
    let d = x.d.to_f32();
    let dmin = x.dmin.to_f32();
    let mut out = y.iter_mut();
    for h in 0..QK_K / 128 {
        let q = &x.qs[32 * h..32 * h + 32];
        for p in 0..4 {
            let shift = 2 * p;
            for g in 0..2 {
                let sc = x.scales[8 * h + 2 * p + g];
                let dl = d * (sc & 0x0F) as f32;
                let ml = dmin * (sc >> 4) as f32;
                for &qb in &q[16 * g..16 * g + 16] {
                    if let Some(o) = out.next() {
                        *o = dl * ((qb >> shift) & 3) as f32 - ml;
                    }
                }
            }
        }
    }
}

/// Q3_K element `32 * group + l` (group = 4h + p) is 2-bit plane p of `qs[32h + l]`, minus 4 unless
/// bit `group` of `hmask[l]` is set; each 16 elements take the next scale.
pub fn dequantize_block_q3_k(x: &BlockQ3K, y: &mut [f32; QK_K]) {
    let d_all = x.d.to_f32();
    let scales = q3_k_scales(&x.scales);
    for (group, y32) in y.as_chunks_mut::<32>().0.iter_mut().enumerate() {
        let (h, p) = (group / 4, group % 4);
        let q = &x.qs[32 * h..32 * h + 32];
        let mask = 1u8 << group;
        for (l, o) in y32.iter_mut().enumerate() {
            let dl = d_all * scales[2 * group + l / 16] as f32;
            let low = ((q[l] >> (2 * p)) & 3) as i32;
            let v = low - if x.hmask[l] & mask != 0 { 0 } else { 4 };
            *o = dl * v as f32;
        }
    }
}

/// Q4_K: 64-element chunk c uses `qs[32c..32c + 32]`, low nibbles with scale/min 2c, then high
/// nibbles with scale/min 2c + 1.
pub fn dequantize_block_q4_k(x: &BlockQ4K, y: &mut [f32; QK_K]) {
    let d = x.d.to_f32();
    let min = x.dmin.to_f32();
    let (sc, m) = k4_scales_mins(&x.scales);
    for (c, y64) in y.as_chunks_mut::<64>().0.iter_mut().enumerate() {
        let q = &x.qs[32 * c..32 * c + 32];
        let (d1, m1) = (d * sc[2 * c] as f32, min * m[2 * c] as f32);
        let (d2, m2) = (d * sc[2 * c + 1] as f32, min * m[2 * c + 1] as f32);
        for l in 0..32 {
            y64[l] = d1 * (q[l] & 0x0F) as f32 - m1;
            y64[l + 32] = d2 * (q[l] >> 4) as f32 - m2;
        }
    }
}

/// Q5_K: as Q4_K, plus 16 when bit `sub-block` of `qh[l]` is set.
pub fn dequantize_block_q5_k(x: &BlockQ5K, y: &mut [f32; QK_K]) {
    let d = x.d.to_f32();
    let min = x.dmin.to_f32();
    let (sc, m) = k4_scales_mins(&x.scales);
    for (c, y64) in y.as_chunks_mut::<64>().0.iter_mut().enumerate() {
        let ql = &x.qs[32 * c..32 * c + 32];
        let (u1, u2) = (1u8 << (2 * c), 2u8 << (2 * c));
        let (d1, m1) = (d * sc[2 * c] as f32, min * m[2 * c] as f32);
        let (d2, m2) = (d * sc[2 * c + 1] as f32, min * m[2 * c + 1] as f32);
        for l in 0..32 {
            let h1 = if x.qh[l] & u1 != 0 { 16 } else { 0 };
            let h2 = if x.qh[l] & u2 != 0 { 16 } else { 0 };
            y64[l] = d1 * ((ql[l] & 0x0F) + h1) as f32 - m1;
            y64[l + 32] = d2 * ((ql[l] >> 4) + h2) as f32 - m2;
        }
    }
}

/// The four 6-bit Q6_K quants (minus 32) at offsets l, l + 32, l + 64, l + 96 of a 128-element half
/// whose `ql` is 64 bytes and `qh` 32 bytes.
#[inline(always)]
pub(crate) fn q6_k_quads(ql: &[u8], qh: &[u8], l: usize) -> [i8; 4] {
    let h = qh[l];
    [
        ((ql[l] & 0x0F) | ((h & 3) << 4)) as i8 - 32,
        ((ql[l + 32] & 0x0F) | (((h >> 2) & 3) << 4)) as i8 - 32,
        ((ql[l] >> 4) | (((h >> 4) & 3) << 4)) as i8 - 32,
        ((ql[l + 32] >> 4) | (((h >> 6) & 3) << 4)) as i8 - 32,
    ]
}

/// `y = d * scale * (q - 32)`, evaluated as `(d * scale) * q` like ggml.
pub fn dequantize_block_q6_k(x: &BlockQ6K, y: &mut [f32; QK_K]) {
    let d = x.d.to_f32();
    for (h, y128) in y.as_chunks_mut::<128>().0.iter_mut().enumerate() {
        let ql = &x.ql[64 * h..64 * h + 64];
        let qh = &x.qh[32 * h..32 * h + 32];
        let sc = &x.scales[8 * h..8 * h + 8];
        for l in 0..32 {
            let is = l / 16;
            let q = q6_k_quads(ql, qh, l);
            for (k, &qk) in q.iter().enumerate() {
                y128[l + 32 * k] = d * sc[is + 2 * k] as f32 * qk as f32;
            }
        }
    }
}

/// `y = d * q`.
pub fn dequantize_block_q8_k(x: &BlockQ8K, y: &mut [f32; QK_K]) {
    let d = x.d.get();
    for (y, &q) in y.iter_mut().zip(&x.qs) {
        *y = d * q as f32;
    }
}

/// `y = d * IQ4_VALUES[q]`.
pub fn dequantize_block_iq4_nl(x: &BlockIQ4NL, y: &mut [f32; QK]) {
    let d = x.d.to_f32();
    for (y, v) in y.iter_mut().zip(iq4_values(&x.qs)) {
        *y = d * v as f32;
    }
}

/// Group j of 32: `dl = d * (ls_j - 32)` (one rounding), then `y = dl * IQ4_VALUES[q]`.
pub fn dequantize_block_iq4_xs(x: &BlockIQ4XS, y: &mut [f32; QK_K]) {
    let d = x.d.to_f32();
    for (j, y) in y.as_chunks_mut::<QK>().0.iter_mut().enumerate() {
        let dl = d * x.scale(j) as f32;
        for (y, v) in y.iter_mut().zip(iq4_values(x.group(j))) {
            *y = dl * v as f32;
        }
    }
}

//! The engine's canonical arithmetic for the 32-element formats, in plain Rust: the order of
//! ggml's x86 kernels (AVX2 `ggml_vec_dot_*` and tinyBLAS), which every SIMD variant reproduces
//! exactly. Per block, the 32 integer products are summed exactly into eight lanes of four
//! consecutive elements; each lane accumulates `fma(d_x * d_y, lane, acc)` across blocks; the
//! lanes are summed pairwise at the end (`(l0+l4 + l2+l6) + (l1+l5 + l3+l7)`), then the
//! `m_x * s_y` terms of Q4_1/Q5_1, summed in block order, are added.
//!
//! Q4_0 (and IQ4_NL, the same with its quants through a table) sums each block's 32 products
//! exactly into one integer and runs one FMA chain over
//! the blocks, `sumf = fma(d_x * d_y, isum as f32, sumf)` from `sumf = 0`, as the K-quants do:
//! with one float step per block instead of eight, its prefill panels (`kwide`, AVX-512; sixteen
//! rows per register) do one conversion and one FMA per sixteen rows and 32 elements. (Until
//! 2026-11 it had the eight-lane order above; the two differ by rounding only.)
//!
//! The plain-float formats (F32, F16, BF16; activations in the same format) widen to f32 and
//! accumulate in 4 x 8 lanes: lane (c, l) takes elements `i` with `i % 32 == 8c + l` by FMA;
//! then `(c0 + c1) + (c2 + c3)` lane-wise, [`hsum8`], and the `n % 32` tail elements by FMA in order.
//!
//! The K-quants (Q2_K..Q6_K with Q8_K activations) follow [`super::kquants`]: exact i32 sums per
//! super-block, then a fixed chain of FMAs.
//!
//! `src/quant` keeps ggml's generic reference order; the two differ by rounding only.

use crate::quant::blocks::*;

/// Sum of eight lanes as ggml's `hsum_float_8`.
#[inline(always)]
pub fn hsum8(a: &[f32; 8]) -> f32 {
    let r = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    (r[0] + r[2]) + (r[1] + r[3])
}

/// Eight lane sums of four consecutive products each.
#[inline(always)]
fn lanes(x: &[i32; QK], y: &[i8; QK]) -> [f32; 8] {
    let mut out = [0f32; 8];
    for (l, o) in out.iter_mut().enumerate() {
        let mut s = 0i32;
        for j in 4 * l..4 * l + 4 {
            s += x[j] * y[j] as i32;
        }
        *o = s as f32;
    }
    out
}

#[inline(always)]
fn fma_lanes(acc: &mut [f32; 8], d: f32, xy: &[f32; 8]) {
    for (a, &v) in acc.iter_mut().zip(xy) {
        *a = d.mul_add(v, *a);
    }
}

#[inline(always)]
fn nibbles(qs: &[u8; QK / 2], offset: i32) -> [i32; QK] {
    let mut x = [0i32; QK];
    for j in 0..QK / 2 {
        x[j] = (qs[j] & 0x0F) as i32 - offset;
        x[j + QK / 2] = (qs[j] >> 4) as i32 - offset;
    }
    x
}

#[inline(always)]
fn five_bits(qs: &[u8; QK / 2], qh: &[u8; 4], offset: i32) -> [i32; QK] {
    let qh = u32::from_le_bytes(*qh);
    let mut x = nibbles(qs, 0);
    for (j, v) in x.iter_mut().enumerate() {
        *v = (*v | (((qh >> j) & 1) << 4) as i32) - offset;
    }
    x
}

/// Q4_0 has its own order (see the module's note): per block the exact `isum = Σ (q − 8)·y`,
/// then `sumf = fma(d_x * d_y, isum as f32, sumf)` in block order from 0.
pub fn vec_dot_q4_0_q8_0(xs: &[BlockQ4_0], ys: &[BlockQ8_0]) -> f32 {
    let mut sumf = 0f32;
    for (x, y) in xs.iter().zip(ys) {
        let q = nibbles(&x.qs, 8);
        let isum: i32 = q.iter().zip(&y.qs).map(|(&q, &y)| q * y as i32).sum();
        sumf = (x.d.to_f32() * y.d.to_f32()).mul_add(isum as f32, sumf);
    }
    sumf
}

/// IQ4_NL in Q4_0's order: per block the exact `isum = Σ IQ4_VALUES[q]·y`, then
/// `sumf = fma(d_x * d_y, isum as f32, sumf)` in block order from 0.
pub fn vec_dot_iq4_nl_q8_0(xs: &[BlockIQ4NL], ys: &[BlockQ8_0]) -> f32 {
    let mut sumf = 0f32;
    for (x, y) in xs.iter().zip(ys) {
        let q = iq4_values(&x.qs);
        let isum: i32 = q
            .iter()
            .zip(&y.qs)
            .map(|(&q, &y)| q as i32 * y as i32)
            .sum();
        sumf = (x.d.to_f32() * y.d.to_f32()).mul_add(isum as f32, sumf);
    }
    sumf
}

pub fn vec_dot_q4_1_q8_1(xs: &[BlockQ4_1], ys: &[BlockQ8_1]) -> f32 {
    let mut acc = [0f32; 8];
    let mut summs = 0f32;
    for (x, y) in xs.iter().zip(ys) {
        summs += x.m.to_f32() * y.s.to_f32();
        let xy = lanes(&nibbles(&x.qs, 0), &y.qs);
        fma_lanes(&mut acc, x.d.to_f32() * y.d.to_f32(), &xy);
    }
    hsum8(&acc) + summs
}

pub fn vec_dot_q5_0_q8_0(xs: &[BlockQ5_0], ys: &[BlockQ8_0]) -> f32 {
    let mut acc = [0f32; 8];
    for (x, y) in xs.iter().zip(ys) {
        let xy = lanes(&five_bits(&x.qs, &x.qh, 16), &y.qs);
        fma_lanes(&mut acc, x.d.to_f32() * y.d.to_f32(), &xy);
    }
    hsum8(&acc)
}

pub fn vec_dot_q5_1_q8_1(xs: &[BlockQ5_1], ys: &[BlockQ8_1]) -> f32 {
    let mut acc = [0f32; 8];
    let mut summs = 0f32;
    for (x, y) in xs.iter().zip(ys) {
        summs += x.m.to_f32() * y.s.to_f32();
        let xy = lanes(&five_bits(&x.qs, &x.qh, 0), &y.qs);
        fma_lanes(&mut acc, x.d.to_f32() * y.d.to_f32(), &xy);
    }
    hsum8(&acc) + summs
}

pub fn vec_dot_q8_0_q8_0(xs: &[BlockQ8_0], ys: &[BlockQ8_0]) -> f32 {
    let mut acc = [0f32; 8];
    for (x, y) in xs.iter().zip(ys) {
        let mut xi = [0i32; QK];
        for (v, &q) in xi.iter_mut().zip(&x.qs) {
            *v = q as i32;
        }
        let xy = lanes(&xi, &y.qs);
        fma_lanes(&mut acc, x.d.to_f32() * y.d.to_f32(), &xy);
    }
    hsum8(&acc)
}

/// Dot product of two plain-float rows in the 4 x 8 lane order; `get(i)` widens element i of each.
#[inline(always)]
pub fn dot_wide(n: usize, get: impl Fn(usize) -> (f32, f32)) -> f32 {
    let mut acc = [[0f32; 8]; 4];
    let full = n / 32 * 32;
    for i in (0..full).step_by(32) {
        for (c, lanes) in acc.iter_mut().enumerate() {
            for (l, a) in lanes.iter_mut().enumerate() {
                let (x, y) = get(i + 8 * c + l);
                *a = x.mul_add(y, *a);
            }
        }
    }
    let mut s = [0f32; 8];
    for l in 0..8 {
        s[l] = (acc[0][l] + acc[1][l]) + (acc[2][l] + acc[3][l]);
    }
    let mut total = hsum8(&s);
    for i in full..n {
        let (x, y) = get(i);
        total = x.mul_add(y, total);
    }
    total
}

fn f32_at(b: &[u8], i: usize) -> f32 {
    f32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]])
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16_bits_to_f32(u16::from_le_bytes([b[2 * i], b[2 * i + 1]]))
}

fn bf16_at(b: &[u8], i: usize) -> f32 {
    bf16_to_f32(u16::from_le_bytes([b[2 * i], b[2 * i + 1]]))
}

pub fn vec_dot_f32(w: &[u8], a: &[u8], n: usize) -> f32 {
    dot_wide(n, |i| (f32_at(w, i), f32_at(a, i)))
}

pub fn vec_dot_f16(w: &[u8], a: &[u8], n: usize) -> f32 {
    dot_wide(n, |i| (f16_at(w, i), f16_at(a, i)))
}

pub fn vec_dot_bf16(w: &[u8], a: &[u8], n: usize) -> f32 {
    dot_wide(n, |i| (bf16_at(w, i), bf16_at(a, i)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{GgmlType, quantize_row, vec_dot_checked};

    /// ggml's test pattern.
    fn pattern(n: usize, offset: f32) -> Vec<f32> {
        (0..n)
            .map(|i| 0.1 + 2.0 * (i as f32 + offset).cos())
            .collect()
    }

    #[test]
    fn lane_order_agrees_with_the_reference_to_rounding() {
        let n = 32 * 37;
        let w = pattern(n, 0.0);
        let x = pattern(n, 1.3);
        for wty in [
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q5_0,
            GgmlType::Q5_1,
            GgmlType::Q8_0,
        ] {
            let mut wq = vec![0u8; wty.row_bytes(n).unwrap()];
            quantize_row(wty, &w, &mut wq).unwrap();
            let aty = wty.vec_dot_type();
            let mut xq = vec![0u8; aty.row_bytes(n).unwrap()];
            quantize_row(aty, &x, &mut xq).unwrap();
            // SAFETY: the scalar variant needs no special instructions.
            let ours = unsafe { super::super::dot_fn(super::super::Isa::Scalar, wty)(&wq, &xq, n) };
            let reference = vec_dot_checked(wty, &wq, &xq, n).unwrap();
            let scale: f32 = w.iter().zip(&x).map(|(a, b)| (a * b).abs()).sum();
            let err = (ours - reference).abs() / scale;
            assert!(
                err < 1e-6,
                "{wty}: lane order {ours} vs reference {reference} (normalised {err:e})"
            );
            assert_ne!(ours, 0.0);
        }
    }

    #[test]
    fn hsum8_pairs_as_ggml() {
        // A left-to-right sum loses the 1.0 (1 + 1e8 rounds to 1e8); ggml's pairing keeps it.
        let a = [1.0f32, 0.0, 1e8, 0.0, 0.0, 0.0, -1e8, 0.0];
        assert_eq!(a.iter().sum::<f32>(), 0.0);
        assert_eq!(hsum8(&a), 1.0);
    }
}

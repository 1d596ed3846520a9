//! Unit tests across the quant modules: dot products against the dequantise-then-dot oracle, and
//! hand-computed values.

use super::blocks::*;
use super::testdata::{Rng, pattern, random_k_row};
use super::*;

/// A weight row of `n` elements of `ty`: quantised from a pattern where oato can, otherwise random
/// blocks with sane scales.
fn weight_row(ty: GgmlType, n: usize, rng: &mut Rng) -> Vec<u8> {
    let mut w = vec![0u8; ty.row_bytes(n).unwrap()];
    if quantize_row(ty, &pattern(n, 0.5), &mut w).is_ok() {
        return w;
    }
    random_k_row(ty, n, rng)
}

const WEIGHT_TYPES: [GgmlType; 15] = {
    use GgmlType::*;
    [
        F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS,
    ]
};

fn dequantized(ty: GgmlType, bytes: &[u8], n: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; n];
    dequantize_row(ty, bytes, &mut out).unwrap();
    out
}

/// The integer-then-scale dot equals the exact dot of the two dequantised rows up to f32
/// rounding of a few terms per block: isolates the dot from the activation's quantisation.
#[test]
fn vec_dot_equals_the_dot_of_both_rows_dequantised() {
    let n = 1024;
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut report = Vec::new();
    for ty in WEIGHT_TYPES {
        let aty = ty.vec_dot_type();
        let w = weight_row(ty, n, &mut rng);
        let mut a = vec![0u8; aty.row_bytes(n).unwrap()];
        quantize_row(aty, &pattern(n, 1.25), &mut a).unwrap();
        let got = vec_dot(ty, &w, &a, n) as f64;
        let (wf, af) = (dequantized(ty, &w, n), dequantized(aty, &a, n));
        let exact: f64 = wf.iter().zip(&af).map(|(&p, &q)| p as f64 * q as f64).sum();
        let scale: f64 = wf
            .iter()
            .zip(&af)
            .map(|(&p, &q)| (p as f64 * q as f64).abs())
            .sum();
        let err = (got - exact).abs() / scale;
        report.push(format!(
            "{ty}: got {got:.6} exact {exact:.6} normalised error {err:.2e}"
        ));
        // A handful of f32 roundings per block; 1e-5 is far below any wrong-term error.
        assert!(err < 1e-5, "{}", report.join("\n"));
    }
    eprintln!("{}", report.join("\n"));
}

/// vec_dot(w, quantise(x)) against the f32 oracle dot(dequantise(w), x): the only difference is
/// the rounding of x to the activation format, bounded per element by half its step.
#[test]
fn vec_dot_matches_the_f32_oracle_within_activation_rounding() {
    let n = 1024;
    let mut rng = Rng(0x0123_4567_89AB_CDEF);
    let x = pattern(n, 3.0);
    let mut worst = (0.0f64, GgmlType::F32);
    for ty in WEIGHT_TYPES {
        let aty = ty.vec_dot_type();
        let w = weight_row(ty, n, &mut rng);
        let mut a = vec![0u8; aty.row_bytes(n).unwrap()];
        quantize_row(aty, &x, &mut a).unwrap();
        let got = vec_dot(ty, &w, &a, n) as f64;
        let want = vec_dot_f32_ref(ty, &w, &x) as f64;
        let wf = dequantized(ty, &w, n);
        // Per-element rounding of x in the activation format.
        let bs = aty.block_size();
        let mut bound = 0.0f64;
        for (b, xs) in x.chunks(bs).enumerate() {
            let amax = xs.iter().fold(0.0f32, |m, v| m.max(v.abs())) as f64;
            for (i, &xi) in xs.iter().enumerate() {
                let step = match aty {
                    // half a step of amax/127, plus 127 steps of the f16 rounding of the scale
                    GgmlType::Q8_0 | GgmlType::Q8_1 => {
                        amax / 127.0 * (0.5 + 127.0 * 2f64.powi(-11))
                    }
                    GgmlType::Q8_K => amax / 254.0,
                    GgmlType::F16 => xi.abs() as f64 * 2f64.powi(-11),
                    GgmlType::BF16 => xi.abs() as f64 * 2f64.powi(-8),
                    _ => 0.0,
                };
                bound += wf[b * bs + i].abs() as f64 * step;
            }
        }
        let magnitude: f64 = wf
            .iter()
            .zip(&x)
            .map(|(&p, &q)| (p as f64 * q as f64).abs())
            .sum();
        bound += magnitude * 1e-6; // f32 accumulation
        let err = (got - want).abs() / bound;
        eprintln!("{ty}·{aty}: got {got:.6} oracle {want:.6}, error {err:.3} of the bound");
        assert!(
            err <= 1.0,
            "{ty}: dot {got} oracle {want}: error {:e} > bound {bound:e}",
            (got - want).abs()
        );
        if err > worst.0 {
            worst = (err, ty);
        }
    }
    eprintln!("largest: {:.3} of the bound for {}", worst.0, worst.1);
}

#[test]
fn q8_0_dot_is_integer_sums_then_scales() {
    let mut x = [BlockQ8_0::zeroed(); 2];
    let mut y = [BlockQ8_0::zeroed(); 2];
    // block 0: x = j - 16, y = 3 (first half) / -1 (second half), d = 0.5 and 0.25
    // sum = 3 * (-16 - 15 - ... - 1) - (0 + 1 + ... + 15) = 3 * -136 - 120 = -528; * 0.125 = -66
    x[0].d = F16Le::from_f32(0.5);
    y[0].d = F16Le::from_f32(0.25);
    for j in 0..32 {
        x[0].qs[j] = j as i8 - 16;
        y[0].qs[j] = if j < 16 { 3 } else { -1 };
    }
    // block 1: 32 * 127 * -128 = -520192, * (1 * 2^-10) = -508
    x[1].d = F16Le::from_f32(1.0);
    y[1].d = F16Le::from_f32(1.0 / 1024.0);
    x[1].qs = [127; 32];
    y[1].qs = [-128; 32];
    let got = vec_dot(GgmlType::Q8_0, blocks_as_bytes(&x), blocks_as_bytes(&y), 64);
    assert_eq!(got, -574.0);
}

#[test]
fn q4_1_dot_adds_min_times_activation_sum() {
    // x: d = 0.5, m = -1, all nibbles 3 (x = 0.5); y: d = 0.25, q = 2 for all 32, s = d*64 = 16.
    // sumi = 32 * 3 * 2 = 192; (0.5 * 0.25) * 192 + (-1) * 16 = 24 - 16 = 8
    let mut x = BlockQ4_1::zeroed();
    x.d = F16Le::from_f32(0.5);
    x.m = F16Le::from_f32(-1.0);
    x.qs = [0x33; 16];
    let mut y = BlockQ8_1::zeroed();
    y.d = F16Le::from_f32(0.25);
    y.s = F16Le::from_f32(16.0);
    y.qs = [2; 32];
    let got = vec_dot(
        GgmlType::Q4_1,
        blocks_as_bytes(&[x]),
        blocks_as_bytes(&[y]),
        32,
    );
    assert_eq!(got, 8.0);
    // The same through the oracle: every weight is 0.5 * 3 - 1 = 0.5, activations 0.5: 32 * 0.25.
    assert_eq!(
        vec_dot_f32_ref(GgmlType::Q4_1, blocks_as_bytes(&[x]), &[0.5; 32]),
        8.0
    );
}

#[test]
fn q4_k_dot_subtracts_mins_through_bsums() {
    // One super-block: scales 1 and mins 2 for all 8 sub-blocks, every nibble 5, d = 1, dmin = 0.5.
    // Weights are 1 * 5 - 0.5 * 2 = 4. Activations all q = 1 with d = 0.25 (value 0.25).
    // Exact dot: 256 * 4 * 0.25 = 256.
    let mut x = BlockQ4K::zeroed();
    x.d = F16Le::from_f32(1.0);
    x.dmin = F16Le::from_f32(0.5);
    x.scales = [1, 1, 1, 1, 2, 2, 2, 2, 0x21, 0x21, 0x21, 0x21];
    x.qs = [0x55; 128];
    let mut y = BlockQ8K::zeroed();
    y.d = F32Le::new(0.25);
    y.qs = [1; 256];
    y.bsums = [I16Le::new(16); 16];
    let (w, a) = (
        blocks_as_bytes(&[x]).to_vec(),
        blocks_as_bytes(&[y]).to_vec(),
    );
    assert_eq!(dequantized(GgmlType::Q4_K, &w, 256), vec![4.0; 256]);
    assert_eq!(vec_dot(GgmlType::Q4_K, &w, &a, 256), 256.0);
}

#[test]
fn quantize_q8_0_rounds_half_away_and_q8_k_half_to_even() {
    let mut x = [0.0f32; 256];
    x[0] = 127.0; // scale exactly 1 (Q8_0: d = 1; Q8_K: iscale = -1)
    x[1] = 2.5;
    x[2] = -2.5;
    x[3] = 0.5;
    let mut q = [0u8; 34 * 8];
    quantize_row(GgmlType::Q8_0, &x, &mut q).unwrap();
    let b: &[BlockQ8_0] = as_blocks(&q).unwrap();
    assert_eq!(b[0].d.to_f32(), 1.0);
    assert_eq!(&b[0].qs[..4], &[127, 3, -3, 1]);
    let mut q = [0u8; 292];
    quantize_row(GgmlType::Q8_K, &x, &mut q).unwrap();
    let b: &[BlockQ8K] = as_blocks(&q).unwrap();
    assert_eq!(b[0].d.get(), -1.0);
    assert_eq!(&b[0].qs[..4], &[-127, -2, 2, 0]);
    assert_eq!(b[0].bsums[0].get(), -127);
}

#[test]
fn quantize_q4_0_uses_the_signed_largest_value() {
    // Largest magnitude is -4 (first of -4 and 4): d = -4 / -8 = 0.5, q = trunc(x / 0.5 + 8.5).
    let mut x = [0.0f32; 32];
    x[0] = 1.0;
    x[5] = -4.0;
    x[20] = 4.0;
    let mut q = [0u8; 18];
    quantize_row(GgmlType::Q4_0, &x, &mut q).unwrap();
    let b: &[BlockQ4_0] = as_blocks(&q).unwrap();
    assert_eq!(b[0].d.to_f32(), 0.5);
    assert_eq!(b[0].qs[0] & 0x0F, 10); // 1 / 0.5 + 8.5 = 10.5
    assert_eq!(b[0].qs[5] & 0x0F, 0); // -8 + 8.5
    assert_eq!(b[0].qs[4] >> 4, 15); // element 20: 8 + 8.5 = 16.5, capped at 15
    assert_eq!(b[0].qs[1] & 0x0F, 8); // zero
}

#[test]
fn vec_dot_reads_unaligned_rows() {
    let n = 512;
    let mut rng = Rng(7);
    let w = weight_row(GgmlType::Q4_K, n, &mut rng);
    let mut a = vec![0u8; GgmlType::Q8_K.row_bytes(n).unwrap()];
    quantize_row(GgmlType::Q8_K, &pattern(n, 0.0), &mut a).unwrap();
    let want = vec_dot(GgmlType::Q4_K, &w, &a, n);
    let mut w1 = vec![0u8; 3];
    w1.extend_from_slice(&w);
    let mut a1 = vec![0u8; 1];
    a1.extend_from_slice(&a);
    assert_eq!(
        vec_dot(GgmlType::Q4_K, &w1[3..], &a1[1..], n).to_bits(),
        want.to_bits()
    );
}

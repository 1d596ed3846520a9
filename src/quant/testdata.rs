//! Deterministic test data shared by the quant and kernel tests: patterned rows, random
//! blocks with sane scales.

use crate::quant::blocks::*;
use crate::quant::{GgmlType, as_blocks_mut, quantize_row};

/// xorshift64*: deterministic bytes for random blocks.
pub struct Rng(pub u64);
#[allow(clippy::should_implement_trait)]
impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| (self.next() >> 56) as u8).collect()
    }
    /// A finite f16 scale of magnitude 10^-3..10^-1, random sign when `signed`.
    pub fn scale(&mut self, signed: bool) -> F16Le {
        let u = (self.next() >> 11) as f64 / (1u64 << 53) as f64;
        let mag = 10f64.powf(-3.0 + 2.0 * u) as f32;
        let neg = signed && self.next() & 1 == 1;
        F16Le::from_f32(if neg { -mag } else { mag })
    }
}

/// The weight types dotted with Q8_K activations: the K-quants and IQ4_XS.
pub const K_TYPES: [GgmlType; 6] = [
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::IQ4_XS,
];

/// A row of `n` elements of `ty`, a K-quant or an i-quant (the types oato does not quantise to):
/// random bytes, then finite (super-)block scales.
pub fn random_k_row(ty: GgmlType, n: usize, rng: &mut Rng) -> Vec<u8> {
    let mut w = rng.bytes(ty.row_bytes(n).unwrap());
    macro_rules! fix {
        ($b:ty, |$x:ident| $body:expr) => {
            for $x in as_blocks_mut::<$b>(&mut w).unwrap() {
                $body;
            }
        };
    }
    match ty {
        GgmlType::Q2_K => fix!(BlockQ2K, |x| {
            x.d = rng.scale(true);
            x.dmin = rng.scale(true)
        }),
        GgmlType::Q3_K => fix!(BlockQ3K, |x| x.d = rng.scale(true)),
        GgmlType::Q4_K => fix!(BlockQ4K, |x| {
            x.d = rng.scale(false);
            x.dmin = rng.scale(false)
        }),
        GgmlType::Q5_K => fix!(BlockQ5K, |x| {
            x.d = rng.scale(false);
            x.dmin = rng.scale(false)
        }),
        GgmlType::Q6_K => fix!(BlockQ6K, |x| x.d = rng.scale(true)),
        GgmlType::IQ4_XS => fix!(BlockIQ4XS, |x| x.d = rng.scale(true)),
        GgmlType::IQ4_NL => fix!(BlockIQ4NL, |x| x.d = rng.scale(true)),
        _ => panic!("random_k_row: {ty} is not a K-quant or an i-quant"),
    }
    w
}

/// ggml's test pattern `0.1 + 2 cos(i + offset)`.
pub fn pattern(n: usize, offset: f32) -> Vec<f32> {
    (0..n)
        .map(|i| 0.1 + 2.0 * (i as f32 + offset).cos())
        .collect()
}

/// A Q8_K activation row quantised from the pattern.
pub fn q8_k_row(n: usize, offset: f32) -> Vec<u8> {
    let mut a = vec![0u8; GgmlType::Q8_K.row_bytes(n).unwrap()];
    quantize_row(GgmlType::Q8_K, &pattern(n, offset), &mut a).unwrap();
    a
}

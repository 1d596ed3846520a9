//! Prefill tiles: one weight row against four tokens at once, so each weight block is unpacked
//! once per four dot products. Every output is accumulated exactly as the single-row kernels do
//! (same per-block FMA chain, same horizontal sum), so tiled and untiled results are identical.

#![allow(unsafe_op_in_unsafe_fn)]

use std::arch::x86_64::*;

use crate::quant::GgmlType;
use crate::quant::blocks::*;

/// One weight row (bytes) against four activation rows (bytes); returns the four dots.
pub type TileFn = unsafe fn(&[u8], [&[u8]; 4]) -> [f32; 4];

/// Generates the tile kernels for one instruction set, given its integer dot products.
macro_rules! tiles {
    ($modname:ident, $feat:literal, $us:path, $ss:path) => {
        pub mod $modname {
            #![allow(unsafe_op_in_unsafe_fn)]
            use super::*;
            use crate::kernels::cpu::avx2::{hsum8, high_bits32, load32, nibbles32};

            /// The shared loop: `unpack(block) -> (qx, d_x, m_x)`; `$mul` picks signed/unsigned.
            macro_rules! tile_loop {
                ($xs:ident, $ys:ident, $yty:ty, |$x:ident| $unpack:expr, $mul:path, $with_min:expr) => {{
                    let ys: [&[$yty]; 4] = [as_blocks_u(&$ys[0]), as_blocks_u(&$ys[1]), as_blocks_u(&$ys[2]), as_blocks_u(&$ys[3])];
                    let mut acc = [_mm256_setzero_ps(); 4];
                    let mut summs = [0f32; 4];
                    for (b, $x) in $xs.iter().enumerate() {
                        let (qx, dx, mx): (__m256i, f32, f32) = $unpack;
                        for j in 0..4 {
                            let y = &ys[j][b];
                            if $with_min {
                                summs[j] += mx * y_s(y);
                            }
                            let d = _mm256_set1_ps(dx * y.d.to_f32());
                            let xy = _mm256_cvtepi32_ps($mul(qx, load32(&y.qs)));
                            acc[j] = _mm256_fmadd_ps(d, xy, acc[j]);
                        }
                    }
                    let mut out = [0f32; 4];
                    for j in 0..4 {
                        out[j] = if $with_min { hsum8(acc[j]) + summs[j] } else { hsum8(acc[j]) };
                    }
                    out
                }};
            }

            #[target_feature(enable = $feat)]
            pub unsafe fn q4_0(w: &[u8], a: [&[u8]; 4]) -> [f32; 4] {
                let xs: &[BlockQ4_0] = as_blocks_u(w);
                let off = _mm256_set1_epi8(8);
                tile_loop!(xs, a, BlockQ8_0, |x| (_mm256_sub_epi8(nibbles32(&x.qs), off), x.d.to_f32(), 0.0), $ss, false)
            }

            #[target_feature(enable = $feat)]
            pub unsafe fn q4_1(w: &[u8], a: [&[u8]; 4]) -> [f32; 4] {
                let xs: &[BlockQ4_1] = as_blocks_u(w);
                tile_loop!(xs, a, BlockQ8_1, |x| (nibbles32(&x.qs), x.d.to_f32(), x.m.to_f32()), $us, true)
            }

            #[target_feature(enable = $feat)]
            pub unsafe fn q5_0(w: &[u8], a: [&[u8]; 4]) -> [f32; 4] {
                let xs: &[BlockQ5_0] = as_blocks_u(w);
                let off = _mm256_set1_epi8(16);
                tile_loop!(
                    xs, a, BlockQ8_0,
                    |x| (_mm256_sub_epi8(_mm256_or_si256(nibbles32(&x.qs), high_bits32(&x.qh)), off), x.d.to_f32(), 0.0),
                    $ss, false
                )
            }

            #[target_feature(enable = $feat)]
            pub unsafe fn q5_1(w: &[u8], a: [&[u8]; 4]) -> [f32; 4] {
                let xs: &[BlockQ5_1] = as_blocks_u(w);
                tile_loop!(
                    xs, a, BlockQ8_1,
                    |x| (_mm256_or_si256(nibbles32(&x.qs), high_bits32(&x.qh)), x.d.to_f32(), x.m.to_f32()),
                    $us, true
                )
            }

            #[target_feature(enable = $feat)]
            pub unsafe fn q8_0(w: &[u8], a: [&[u8]; 4]) -> [f32; 4] {
                let xs: &[BlockQ8_0] = as_blocks_u(w);
                tile_loop!(xs, a, BlockQ8_0, |x| (load32(&x.qs), x.d.to_f32(), 0.0), $ss, false)
            }
        }
    };
}

/// Blocks of a byte slice (lengths were checked by the matmul).
fn as_blocks_u<B: Block>(b: &[u8]) -> &[B] {
    as_blocks(b).unwrap_or(&[])
}

/// `s` of a Q8_1 block (the Q8_0 arm never calls it).
trait HasSum {
    fn s(&self) -> f32;
}
impl HasSum for BlockQ8_1 {
    fn s(&self) -> f32 {
        self.s.to_f32()
    }
}
impl HasSum for BlockQ8_0 {
    fn s(&self) -> f32 {
        0.0
    }
}
fn y_s<B: HasSum>(b: &B) -> f32 {
    b.s()
}

use crate::quant::as_blocks;

tiles!(
    avx2,
    "avx2,fma,f16c",
    crate::kernels::cpu::avx2::dot_us8,
    crate::kernels::cpu::avx2::dot_ss8
);
tiles!(
    avx512,
    "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni",
    crate::kernels::cpu::avx512::dot_us8,
    crate::kernels::cpu::avx512::dot_ss8
);

/// The tile kernel for `wty` under `isa`, when there is one.
pub fn tile_fn(isa: super::Isa, wty: GgmlType) -> Option<TileFn> {
    use super::Isa;
    if !isa.supported() {
        return None;
    }
    let f: TileFn = match (isa, wty) {
        (Isa::Avx2, GgmlType::Q4_0) => avx2::q4_0,
        (Isa::Avx2, GgmlType::Q4_1) => avx2::q4_1,
        (Isa::Avx2, GgmlType::Q5_0) => avx2::q5_0,
        (Isa::Avx2, GgmlType::Q5_1) => avx2::q5_1,
        (Isa::Avx2, GgmlType::Q8_0) => avx2::q8_0,
        (Isa::Avx512, GgmlType::Q4_0) => avx512::q4_0,
        (Isa::Avx512, GgmlType::Q4_1) => avx512::q4_1,
        (Isa::Avx512, GgmlType::Q5_0) => avx512::q5_0,
        (Isa::Avx512, GgmlType::Q5_1) => avx512::q5_1,
        (Isa::Avx512, GgmlType::Q8_0) => avx512::q8_0,
        _ => return None,
    };
    Some(f)
}

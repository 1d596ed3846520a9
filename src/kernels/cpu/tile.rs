//! Register tiles for the 32-element formats: `R` weight rows against `T` tokens at once, so each
//! weight block is unpacked once per `T` dot products and each activation block's scales are
//! converted once per `R`. Every output is accumulated exactly as the single-row kernels do (same
//! per-block FMA chain, same horizontal sum; Q4_0's one chain of block sums), so tiled and
//! untiled results are bit-identical. Prefill on AVX2 CPUs uses 4 x 4 tiles (then 2 x 4 and 1 x 4
//! for the rows left; Q8_0 takes `q8tile_avx2`'s; AVX-512 CPUs use `kwide`, `qwide` and `f16wide`). Decode uses the single-row kernels, or on AVX-512 CPUs the four-row
//! kernels of `avx512::rows_fn` for Q4_0, Q8_0, Q4_K, Q5_K and Q6_K (rows taken from the four quarters of a task's
//! range, so the weights stay four long sequential streams).

#![allow(unsafe_op_in_unsafe_fn)]
// The kernels are unsafe only because they need their instruction set; `tile_fn` hands them out
// only when the CPU has it.
#![allow(clippy::missing_safety_doc)]

use std::arch::x86_64::*;

use crate::kernels::cpu::blocks;
use crate::quant::GgmlType;
use crate::quant::blocks::*;

/// `R` weight rows (bytes) against `T` activation rows (bytes): `out[r][t]`.
pub type TileFn<const R: usize, const T: usize> =
    unsafe fn([&[u8]; R], [&[u8]; T]) -> [[f32; T]; R];

/// Generates the tile kernels for one instruction set, given its integer dot products.
macro_rules! tiles {
    ($modname:ident, $feat:literal, $us:path, $ss:path) => {
        pub mod $modname {
            #![allow(unsafe_op_in_unsafe_fn)]
            use super::*;
            use crate::kernels::cpu::avx2::{high_bits32, hsum8, load32, nibbles32};

            /// The shared loop. `$unpack` maps a weight block `$x` to (quants, d, m); `$ys_s`
            /// gives an activation block's `s` (0 for Q8_0, which has none).
            macro_rules! tile_body {
                ($w:ident, $a:ident, $xty:ty, $yty:ty, |$x:ident| $unpack:expr, |$yb:ident| $ys_s:expr, $mul:path, $with_min:expr) => {{
                    let xs: [&[$xty]; R] = $w.map(blocks::<$xty>);
                    let ys: [&[$yty]; T] = $a.map(blocks::<$yty>);
                    let nb = xs.iter().chain([&xs[0]]).map(|x| x.len()).min().unwrap_or(0);
                    let nb = ys.iter().map(|y| y.len()).fold(nb, usize::min);
                    let mut acc = [[_mm256_setzero_ps(); T]; R];
                    let mut summs = [[0f32; T]; R];
                    let mut dy = [0f32; T];
                    let mut sy = [0f32; T];
                    for b in 0..nb {
                        for t in 0..T {
                            // SAFETY: b < nb <= ys[t].len().
                            let $yb = unsafe { ys[t].get_unchecked(b) };
                            dy[t] = crate::kernels::cpu::avx2::h2f($yb.d);
                            sy[t] = $ys_s;
                        }
                        for r in 0..R {
                            // SAFETY: b < nb <= xs[r].len().
                            let $x = unsafe { xs[r].get_unchecked(b) };
                            let (qx, dx, mx): (__m256i, f32, f32) = $unpack;
                            for t in 0..T {
                                if $with_min {
                                    summs[r][t] += mx * sy[t];
                                }
                                let d = _mm256_set1_ps(dx * dy[t]);
                                // SAFETY: as above.
                                let yq = unsafe { &ys[t].get_unchecked(b).qs };
                                let xy = _mm256_cvtepi32_ps($mul(qx, load32(yq)));
                                acc[r][t] = _mm256_fmadd_ps(d, xy, acc[r][t]);
                            }
                        }
                    }
                    let mut out = [[0f32; T]; R];
                    for r in 0..R {
                        for t in 0..T {
                            out[r][t] = if $with_min { hsum8(acc[r][t]) + summs[r][t] } else { hsum8(acc[r][t]) };
                        }
                    }
                    out
                }};
            }

            /// Q4_0's own order (`scalar`): each block's exact `isum` for four tokens at once
            /// (`sum4_i32`), then one FMA per block with the four tokens' chains in one
            /// register's lanes. `T` is a multiple of four, at most sixteen.
            #[target_feature(enable = $feat)]
            pub unsafe fn q4_0<const R: usize, const T: usize>(w: [&[u8]; R], a: [&[u8]; T]) -> [[f32; T]; R] {
                assert!(T % 4 == 0 && T <= 16, "Q4_0 tile of {T} tokens");
                let off = _mm256_set1_epi8(8);
                let xs: [&[BlockQ4_0]; R] = w.map(blocks::<BlockQ4_0>);
                let ys: [&[BlockQ8_0]; T] = a.map(blocks::<BlockQ8_0>);
                let nb = crate::kernels::cpu::common_blocks(&xs, &ys);
                let mut acc = [[_mm_setzero_ps(); 4]; R];
                let mut dy = [0f32; T];
                for b in 0..nb {
                    for t in 0..T {
                        // SAFETY: b < nb <= ys[t].len().
                        dy[t] = crate::kernels::cpu::avx2::h2f(unsafe { ys[t].get_unchecked(b) }.d);
                    }
                    for r in 0..R {
                        // SAFETY: b < nb <= xs[r].len().
                        let x = unsafe { xs[r].get_unchecked(b) };
                        let qx = _mm256_sub_epi8(nibbles32(&x.qs), off);
                        let dx = _mm_set1_ps(crate::kernels::cpu::avx2::h2f(x.d));
                        for q in 0..T / 4 {
                            let lanes: [__m256i; 4] = std::array::from_fn(|j| {
                                // SAFETY: as above.
                                $ss(qx, load32(&unsafe { ys[4 * q + j].get_unchecked(b) }.qs))
                            });
                            let isum = crate::kernels::cpu::avx2::sum4_i32(lanes);
                            let d = _mm_mul_ps(dx, _mm_loadu_ps(dy[4 * q..].as_ptr()));
                            acc[r][q] = _mm_fmadd_ps(d, _mm_cvtepi32_ps(isum), acc[r][q]);
                        }
                    }
                }
                let mut out = [[0f32; T]; R];
                for r in 0..R {
                    for q in 0..T / 4 {
                        _mm_storeu_ps(out[r][4 * q..].as_mut_ptr(), acc[r][q]);
                    }
                }
                out
            }

            #[target_feature(enable = $feat)]
            pub unsafe fn q4_1<const R: usize, const T: usize>(w: [&[u8]; R], a: [&[u8]; T]) -> [[f32; T]; R] {
                tile_body!(w, a, BlockQ4_1, BlockQ8_1, |x| (nibbles32(&x.qs), crate::kernels::cpu::avx2::h2f(x.d), crate::kernels::cpu::avx2::h2f(x.m)), |y| crate::kernels::cpu::avx2::h2f(y.s), $us, true)
            }

            #[target_feature(enable = $feat)]
            pub unsafe fn q5_0<const R: usize, const T: usize>(w: [&[u8]; R], a: [&[u8]; T]) -> [[f32; T]; R] {
                let off = _mm256_set1_epi8(16);
                tile_body!(
                    w, a, BlockQ5_0, BlockQ8_0,
                    |x| (_mm256_sub_epi8(_mm256_or_si256(nibbles32(&x.qs), high_bits32(&x.qh)), off), crate::kernels::cpu::avx2::h2f(x.d), 0.0),
                    |_y| 0.0, $ss, false
                )
            }

            #[target_feature(enable = $feat)]
            pub unsafe fn q5_1<const R: usize, const T: usize>(w: [&[u8]; R], a: [&[u8]; T]) -> [[f32; T]; R] {
                tile_body!(
                    w, a, BlockQ5_1, BlockQ8_1,
                    |x| (_mm256_or_si256(nibbles32(&x.qs), high_bits32(&x.qh)), crate::kernels::cpu::avx2::h2f(x.d), crate::kernels::cpu::avx2::h2f(x.m)),
                    |y| crate::kernels::cpu::avx2::h2f(y.s), $us, true
                )
            }

        }
    };
}

tiles!(
    avx2,
    "avx2,fma,f16c",
    crate::kernels::cpu::avx2::dot_us8,
    crate::kernels::cpu::avx2::dot_ss8
);

/// The 4 x 16 tile for `wty` under `isa` where sixteen tokens per unpacked weight block beat
/// four (the AVX-512 K-quant tiles, which unpack a 256-element super-block per row: 1B Q4_K_M
/// pp64 on a 2-thread EPYC, 4 tokens 95 t/s, 8 tokens 105, 16 tokens 109).
pub fn wide_tile_fn(isa: super::Isa, wty: GgmlType) -> Option<TileFn<4, 16>> {
    match wty {
        GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K if isa == super::Isa::Avx512 => {
            tile_fn::<4, 16>(isa, wty)
        }
        _ => None,
    }
}

/// The `R` x `T` tile kernel for `wty` under `isa`, when there is one.
pub fn tile_fn<const R: usize, const T: usize>(
    isa: super::Isa,
    wty: GgmlType,
) -> Option<TileFn<R, T>> {
    use super::Isa;
    if !isa.supported() {
        return None;
    }
    // AVX-512 CPUs run prefill through `qwide` and `f16wide`, and the K-quants through their
    // own tiles; elsewhere they share these.
    if isa == Isa::Scalar {
        return None;
    }
    if isa == Isa::Avx512 {
        match wty {
            GgmlType::Q4_K => return Some(super::avx512::q4_k_tile::<R, T>),
            GgmlType::Q5_K => return Some(super::avx512::q5_k_tile::<R, T>),
            GgmlType::Q6_K => return Some(super::avx512::q6_k_tile::<R, T>),
            _ => {}
        }
    }
    let f: TileFn<R, T> = match wty {
        GgmlType::Q4_0 => avx2::q4_0::<R, T>,
        GgmlType::Q4_1 => avx2::q4_1::<R, T>,
        GgmlType::Q5_0 => avx2::q5_0::<R, T>,
        GgmlType::Q5_1 => avx2::q5_1::<R, T>,
        _ => return None,
    };
    Some(f)
}

//! Register tiles for the 32-element formats: `R` weight rows against `T` tokens at once, so each
//! weight block is unpacked once per `T` dot products and each activation block's scales are
//! converted once per `R`. Every output is accumulated exactly as the single-row kernels do (same
//! per-block FMA chain, same horizontal sum), so tiled and untiled results are bit-identical.
//! Prefill uses 4 x 4 tiles (then 2 x 4 and 1 x 4 for the rows left); decode uses the single-row kernels, which
//! measured faster than 4 x 1 tiles here.

#![allow(unsafe_op_in_unsafe_fn)]
// The kernels are unsafe only because they need their instruction set; `tile_fn` hands them out
// only when the CPU has it.
#![allow(clippy::missing_safety_doc)]

use std::arch::x86_64::*;

use crate::quant::GgmlType;
use crate::quant::blocks::*;

/// `R` weight rows (bytes) against `T` activation rows (bytes): `out[r][t]`.
pub type TileFn<const R: usize, const T: usize> =
    unsafe fn([&[u8]; R], [&[u8]; T]) -> [[f32; T]; R];

/// Whole blocks of a byte slice, viewed in place (callers check lengths; a ragged tail is left out).
#[inline(always)]
fn blocks_of<B: Block>(b: &[u8]) -> &[B] {
    // SAFETY: `Block` types are alignment-1 byte structs without padding for which every byte
    // pattern is valid (see quant::blocks), and the length is rounded down to whole blocks.
    unsafe { std::slice::from_raw_parts(b.as_ptr().cast(), b.len() / size_of::<B>()) }
}

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
                ($tab:ident, $w:ident, $a:ident, $xty:ty, $yty:ty, |$x:ident| $unpack:expr, |$yb:ident| $ys_s:expr, $mul:path, $with_min:expr) => {{
                    let xs: [&[$xty]; R] = $w.map(blocks_of::<$xty>);
                    let ys: [&[$yty]; T] = $a.map(blocks_of::<$yty>);
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
                            dy[t] = $tab[$yb.d.bits() as usize];
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

            #[target_feature(enable = $feat)]
            pub unsafe fn q4_0<const R: usize, const T: usize>(w: [&[u8]; R], a: [&[u8]; T]) -> [[f32; T]; R] {
                let tab = crate::kernels::cpu::avx2::f16_table();
                let off = _mm256_set1_epi8(8);
                tile_body!(tab, w, a, BlockQ4_0, BlockQ8_0, |x| (_mm256_sub_epi8(nibbles32(&x.qs), off), tab[x.d.bits() as usize], 0.0), |_y| 0.0, $ss, false)
            }

            #[target_feature(enable = $feat)]
            pub unsafe fn q4_1<const R: usize, const T: usize>(w: [&[u8]; R], a: [&[u8]; T]) -> [[f32; T]; R] {
                let tab = crate::kernels::cpu::avx2::f16_table();
                tile_body!(tab, w, a, BlockQ4_1, BlockQ8_1, |x| (nibbles32(&x.qs), tab[x.d.bits() as usize], tab[x.m.bits() as usize]), |y| tab[y.s.bits() as usize], $us, true)
            }

            #[target_feature(enable = $feat)]
            pub unsafe fn q5_0<const R: usize, const T: usize>(w: [&[u8]; R], a: [&[u8]; T]) -> [[f32; T]; R] {
                let tab = crate::kernels::cpu::avx2::f16_table();
                let off = _mm256_set1_epi8(16);
                tile_body!(
                    tab, w, a, BlockQ5_0, BlockQ8_0,
                    |x| (_mm256_sub_epi8(_mm256_or_si256(nibbles32(&x.qs), high_bits32(&x.qh)), off), tab[x.d.bits() as usize], 0.0),
                    |_y| 0.0, $ss, false
                )
            }

            #[target_feature(enable = $feat)]
            pub unsafe fn q5_1<const R: usize, const T: usize>(w: [&[u8]; R], a: [&[u8]; T]) -> [[f32; T]; R] {
                let tab = crate::kernels::cpu::avx2::f16_table();
                tile_body!(
                    tab, w, a, BlockQ5_1, BlockQ8_1,
                    |x| (_mm256_or_si256(nibbles32(&x.qs), high_bits32(&x.qh)), tab[x.d.bits() as usize], tab[x.m.bits() as usize]),
                    |y| tab[y.s.bits() as usize], $us, true
                )
            }

            #[target_feature(enable = $feat)]
            pub unsafe fn q8_0<const R: usize, const T: usize>(w: [&[u8]; R], a: [&[u8]; T]) -> [[f32; T]; R] {
                let tab = crate::kernels::cpu::avx2::f16_table();
                tile_body!(tab, w, a, BlockQ8_0, BlockQ8_0, |x| (load32(&x.qs), tab[x.d.bits() as usize], 0.0), |_y| 0.0, $ss, false)
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

/// The `R` x `T` tile kernel for `wty` under `isa`, when there is one.
pub fn tile_fn<const R: usize, const T: usize>(
    isa: super::Isa,
    wty: GgmlType,
) -> Option<TileFn<R, T>> {
    use super::Isa;
    if !isa.supported() {
        return None;
    }
    if isa == Isa::Avx512 && T == 4 {
        let wide: TileFn<R, 4> = match wty {
            // Four rows would need more than the 32 vector registers.
            GgmlType::F16 if R <= 2 => f16w::f16::<R>,
            GgmlType::Q4_0 => avx512w::q4_0::<R>,
            GgmlType::Q4_1 => avx512w::q4_1::<R>,
            GgmlType::Q5_0 => avx512w::q5_0::<R>,
            GgmlType::Q5_1 => avx512w::q5_1::<R>,
            GgmlType::Q8_0 => avx512w::q8_0::<R>,
            _ => return None,
        };
        // SAFETY: T == 4, so the two fn pointer types are the same type.
        return Some(unsafe { std::mem::transmute::<TileFn<R, 4>, TileFn<R, T>>(wide) });
    }
    // Other shapes, and AVX-512 CPUs outside the wide tiles, use the AVX2 tiles (same numbers).
    if isa == Isa::Scalar {
        return None;
    }
    let f: TileFn<R, T> = match wty {
        GgmlType::Q4_0 => avx2::q4_0::<R, T>,
        GgmlType::Q4_1 => avx2::q4_1::<R, T>,
        GgmlType::Q5_0 => avx2::q5_0::<R, T>,
        GgmlType::Q5_1 => avx2::q5_1::<R, T>,
        GgmlType::Q8_0 => avx2::q8_0::<R, T>,
        _ => return None,
    };
    Some(f)
}

/// AVX-512 tiles with two outputs per 512-bit register: lanes 0..8 carry one token's eight lane
/// sums, lanes 8..16 the next token's, so every lane does exactly the arithmetic of the 256-bit
/// kernels (same i32 lane sums, same `d_x * d_y` product, same FMA) at twice the width. Signed
/// weights are offset to unsigned for `vpdpbusd` and the offset taken back exactly:
/// `Σ (q - c) y = Σ q y - c Σ y` in i32, lane by lane.
pub mod avx512w {
    #![allow(unsafe_op_in_unsafe_fn)]
    use super::*;
    use crate::kernels::cpu::avx2::{f16_table, high_bits32, hsum8, load32, nibbles32};

    /// Two tokens' 32 quants side by side.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn pair(a: &[i8; 32], b: &[i8; 32]) -> __m512i {
        _mm512_inserti64x4::<1>(_mm512_castsi256_si512(load32(a)), load32(b))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn halves(v: __m512) -> (__m256, __m256) {
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
        (_mm512_castps512_ps256(v), hi)
    }

    /// Two 8-lane broadcasts in one register.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn two(a: f32, b: f32) -> __m512 {
        _mm512_castpd_ps(_mm512_insertf64x4::<1>(
            _mm512_castps_pd(_mm512_castps256_ps512(_mm256_set1_ps(a))),
            _mm256_castps_pd(_mm256_set1_ps(b)),
        ))
    }

    /// `$unpack` maps a weight block to (unsigned quants, d, m); `$shift` is log2 of the offset
    /// subtracted from the quants (none for Q4_1/Q5_1); `$with_min` adds `m_x * s_y`.
    macro_rules! wide_body {
        ($tab:ident, $w:ident, $a:ident, $xty:ty, $yty:ty, |$x:ident| $unpack:expr, |$yb:ident| $ys_s:expr, $shift:expr, $with_min:expr) => {{
            const P: usize = 2;
            let xs: [&[$xty]; R] = $w.map(blocks_of::<$xty>);
            let ys: [&[$yty]; 4] = $a.map(blocks_of::<$yty>);
            let nb = xs
                .iter()
                .map(|x| x.len())
                .chain(ys.iter().map(|y| y.len()))
                .min()
                .unwrap_or(0);
            let ones = _mm512_set1_epi8(1);
            let mut acc = [[_mm512_setzero_ps(); P]; R];
            let mut summs = [[0f32; 4]; R];
            let mut sy = [0f32; 4];
            for b in 0..nb {
                let mut yq = [_mm512_setzero_si512(); P];
                let mut yoff = [_mm512_setzero_si512(); P];
                let mut dy = [_mm512_setzero_ps(); P];
                for p in 0..P {
                    // SAFETY: b < nb <= ys[t].len().
                    let (y0, y1) =
                        unsafe { (ys[2 * p].get_unchecked(b), ys[2 * p + 1].get_unchecked(b)) };
                    yq[p] = pair(&y0.qs, &y1.qs);
                    dy[p] = two($tab[y0.d.bits() as usize], $tab[y1.d.bits() as usize]);
                    if let Some(sh) = $shift {
                        let sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, yq[p]);
                        yoff[p] = _mm512_sll_epi32(sums, _mm_cvtsi32_si128(sh));
                    }
                    if $with_min {
                        let $yb = y0;
                        sy[2 * p] = $ys_s;
                        let $yb = y1;
                        sy[2 * p + 1] = $ys_s;
                    }
                }
                for r in 0..R {
                    // SAFETY: b < nb <= xs[r].len().
                    let $x = unsafe { xs[r].get_unchecked(b) };
                    let (qx, dx, mx): (__m256i, f32, f32) = $unpack;
                    let qx = _mm512_broadcast_i64x4(qx);
                    let dx = _mm512_set1_ps(dx);
                    for p in 0..P {
                        if $with_min {
                            summs[r][2 * p] += mx * sy[2 * p];
                            summs[r][2 * p + 1] += mx * sy[2 * p + 1];
                        }
                        let mut xy = _mm512_dpbusd_epi32(_mm512_setzero_si512(), qx, yq[p]);
                        if $shift.is_some() {
                            xy = _mm512_sub_epi32(xy, yoff[p]);
                        }
                        let d = _mm512_mul_ps(dx, dy[p]);
                        acc[r][p] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(xy), acc[r][p]);
                    }
                }
            }
            let mut out = [[0f32; 4]; R];
            for r in 0..R {
                for p in 0..P {
                    let (lo, hi) = halves(acc[r][p]);
                    out[r][2 * p] = hsum8(lo);
                    out[r][2 * p + 1] = hsum8(hi);
                    if $with_min {
                        out[r][2 * p] += summs[r][2 * p];
                        out[r][2 * p + 1] += summs[r][2 * p + 1];
                    }
                }
            }
            out
        }};
    }

    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub unsafe fn q4_0<const R: usize>(w: [&[u8]; R], a: [&[u8]; 4]) -> [[f32; 4]; R] {
        let tab = f16_table();
        wide_body!(
            tab,
            w,
            a,
            BlockQ4_0,
            BlockQ8_0,
            |x| (nibbles32(&x.qs), tab[x.d.bits() as usize], 0.0),
            |_y| 0.0,
            Some(3),
            false
        )
    }

    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub unsafe fn q4_1<const R: usize>(w: [&[u8]; R], a: [&[u8]; 4]) -> [[f32; 4]; R] {
        let tab = f16_table();
        wide_body!(
            tab,
            w,
            a,
            BlockQ4_1,
            BlockQ8_1,
            |x| (
                nibbles32(&x.qs),
                tab[x.d.bits() as usize],
                tab[x.m.bits() as usize]
            ),
            |y| tab[y.s.bits() as usize],
            None::<i32>,
            true
        )
    }

    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub unsafe fn q5_0<const R: usize>(w: [&[u8]; R], a: [&[u8]; 4]) -> [[f32; 4]; R] {
        let tab = f16_table();
        wide_body!(
            tab,
            w,
            a,
            BlockQ5_0,
            BlockQ8_0,
            |x| (
                _mm256_or_si256(nibbles32(&x.qs), high_bits32(&x.qh)),
                tab[x.d.bits() as usize],
                0.0
            ),
            |_y| 0.0,
            Some(4),
            false
        )
    }

    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub unsafe fn q5_1<const R: usize>(w: [&[u8]; R], a: [&[u8]; 4]) -> [[f32; 4]; R] {
        let tab = f16_table();
        wide_body!(
            tab,
            w,
            a,
            BlockQ5_1,
            BlockQ8_1,
            |x| (
                _mm256_or_si256(nibbles32(&x.qs), high_bits32(&x.qh)),
                tab[x.d.bits() as usize],
                tab[x.m.bits() as usize]
            ),
            |y| tab[y.s.bits() as usize],
            None::<i32>,
            true
        )
    }

    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub unsafe fn q8_0<const R: usize>(w: [&[u8]; R], a: [&[u8]; 4]) -> [[f32; 4]; R] {
        let tab = f16_table();
        // x + 128 as an unsigned byte is x ^ 0x80.
        let flip = _mm256_set1_epi8(-128);
        wide_body!(
            tab,
            w,
            a,
            BlockQ8_0,
            BlockQ8_0,
            |x| (
                _mm256_xor_si256(load32(&x.qs), flip),
                tab[x.d.bits() as usize],
                0.0
            ),
            |_y| 0.0,
            Some(7),
            false
        )
    }
}

/// AVX-512 F16 tiles: up to two weight rows against four tokens, two tokens per 512-bit register,
/// each lane doing `avx2::vec_dot_f16`'s arithmetic (four 8-lane FMA chains over 32-element steps,
/// `(c0 + c1) + (c2 + c3)`, `hsum8`, then the tail elements by FMA in order).
pub mod f16w {
    #![allow(unsafe_op_in_unsafe_fn)]
    use super::*;
    use crate::kernels::cpu::avx2::hsum8;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn load8(b: &[u8], i: usize) -> __m128i {
        debug_assert!(2 * (i + 8) <= b.len());
        _mm_loadu_si128(b.as_ptr().add(2 * i).cast())
    }

    fn elem(b: &[u8], i: usize) -> f32 {
        f16_bits_to_f32(u16::from_le_bytes([b[2 * i], b[2 * i + 1]]))
    }

    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub unsafe fn f16<const R: usize>(w: [&[u8]; R], a: [&[u8]; 4]) -> [[f32; 4]; R] {
        let n = w
            .iter()
            .chain(a.iter())
            .map(|x| x.len() / 2)
            .min()
            .unwrap_or(0);
        let full = n / 32 * 32;
        let mut acc = [[[_mm512_setzero_ps(); 4]; 2]; R];
        let mut i = 0;
        while i < full {
            let mut y = [[_mm512_setzero_ps(); 4]; 2];
            for (p, yp) in y.iter_mut().enumerate() {
                for (c, yc) in yp.iter_mut().enumerate() {
                    let lo = load8(a[2 * p], i + 8 * c);
                    let hi = load8(a[2 * p + 1], i + 8 * c);
                    *yc = _mm512_cvtph_ps(_mm256_inserti128_si256::<1>(
                        _mm256_castsi128_si256(lo),
                        hi,
                    ));
                }
            }
            for r in 0..R {
                for c in 0..4 {
                    let wz = _mm512_cvtph_ps(_mm256_broadcastsi128_si256(load8(w[r], i + 8 * c)));
                    for p in 0..2 {
                        acc[r][p][c] = _mm512_fmadd_ps(wz, y[p][c], acc[r][p][c]);
                    }
                }
            }
            i += 32;
        }
        let mut out = [[0f32; 4]; R];
        for r in 0..R {
            for p in 0..2 {
                let a4 = &acc[r][p];
                let s = _mm512_add_ps(_mm512_add_ps(a4[0], a4[1]), _mm512_add_ps(a4[2], a4[3]));
                let lo = _mm512_castps512_ps256(s);
                let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(s)));
                out[r][2 * p] = hsum8(lo);
                out[r][2 * p + 1] = hsum8(hi);
            }
            for (t, o) in out[r].iter_mut().enumerate() {
                for j in full..n {
                    *o = elem(w[r], j).mul_add(elem(a[t], j), *o);
                }
            }
        }
        out
    }
}

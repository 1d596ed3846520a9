//! AVX2 + FMA + F16C dot products, bit-identical with `scalar`'s lane order: per 32-element block
//! the integer products are summed into eight i32 lanes of four consecutive elements
//! (`maddubs` then `madd`), converted to f32 and accumulated with one FMA per block.

#![allow(unsafe_op_in_unsafe_fn)]

use std::arch::x86_64::*;

use crate::quant::blocks::*;

/// ggml's `hsum_float_8`: `((l0+l4) + (l2+l6)) + ((l1+l5) + (l3+l7))`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn hsum8(x: __m256) -> f32 {
    let r = _mm_add_ps(_mm256_extractf128_ps::<1>(x), _mm256_castps256_ps128(x));
    let r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    let r = _mm_add_ss(r, _mm_movehdup_ps(r));
    _mm_cvtss_f32(r)
}

/// 32 nibbles as bytes: elements 0..16 (low nibbles) then 16..32 (high nibbles).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn nibbles32(qs: &[u8; 16]) -> __m256i {
    let tmp = _mm_loadu_si128(qs.as_ptr().cast());
    let hi = _mm_srli_epi16::<4>(tmp);
    _mm256_and_si256(_mm256_set_m128i(hi, tmp), _mm256_set1_epi8(0x0F))
}

/// 0x10 in byte j where bit j of `qh` is set (the fifth bit of Q5 quants).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn high_bits32(qh: &[u8; 4]) -> __m256i {
    let bits = _mm256_set1_epi32(i32::from_le_bytes(*qh));
    let spread = _mm256_shuffle_epi8(
        bits,
        _mm256_setr_epi8(
            0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3,
            3, 3, 3,
        ),
    );
    let mask = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, mask), mask);
    _mm256_and_si256(set, _mm256_set1_epi8(0x10))
}

/// Eight i32 lanes, each the sum of four consecutive products of unsigned `a` and signed `b`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_us8(a: __m256i, b: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1))
}

/// As [`dot_us8`] for signed `a`: |a| times b with a's sign.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_ss8(a: __m256i, b: __m256i) -> __m256i {
    dot_us8(_mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a))
}

/// Loads 32 signed bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn load32(q: &[i8; 32]) -> __m256i {
    _mm256_loadu_si256(q.as_ptr().cast())
}

/// The 32-element kernels, generic over the integer dot (`maddubs` here, VNNI in `avx512`).
macro_rules! block_kernels {
    ($feat:literal, $us:path, $ss:path) => {
        #[target_feature(enable = $feat)]
        pub unsafe fn vec_dot_q4_0_q8_0(xs: &[BlockQ4_0], ys: &[BlockQ8_0]) -> f32 {
            let mut acc = _mm256_setzero_ps();
            let off = _mm256_set1_epi8(8);
            for (x, y) in xs.iter().zip(ys) {
                let d = _mm256_set1_ps(x.d.to_f32() * y.d.to_f32());
                let qx = _mm256_sub_epi8($crate::kernels::cpu::avx2::nibbles32(&x.qs), off);
                let xy = _mm256_cvtepi32_ps($ss(qx, $crate::kernels::cpu::avx2::load32(&y.qs)));
                acc = _mm256_fmadd_ps(d, xy, acc);
            }
            $crate::kernels::cpu::avx2::hsum8(acc)
        }

        #[target_feature(enable = $feat)]
        pub unsafe fn vec_dot_q4_1_q8_1(xs: &[BlockQ4_1], ys: &[BlockQ8_1]) -> f32 {
            let mut acc = _mm256_setzero_ps();
            let mut summs = 0f32;
            for (x, y) in xs.iter().zip(ys) {
                summs += x.m.to_f32() * y.s.to_f32();
                let d = _mm256_set1_ps(x.d.to_f32() * y.d.to_f32());
                let qx = $crate::kernels::cpu::avx2::nibbles32(&x.qs);
                let xy = _mm256_cvtepi32_ps($us(qx, $crate::kernels::cpu::avx2::load32(&y.qs)));
                acc = _mm256_fmadd_ps(d, xy, acc);
            }
            $crate::kernels::cpu::avx2::hsum8(acc) + summs
        }

        #[target_feature(enable = $feat)]
        pub unsafe fn vec_dot_q5_0_q8_0(xs: &[BlockQ5_0], ys: &[BlockQ8_0]) -> f32 {
            let mut acc = _mm256_setzero_ps();
            let off = _mm256_set1_epi8(16);
            for (x, y) in xs.iter().zip(ys) {
                let d = _mm256_set1_ps(x.d.to_f32() * y.d.to_f32());
                let qx = _mm256_or_si256(
                    $crate::kernels::cpu::avx2::nibbles32(&x.qs),
                    $crate::kernels::cpu::avx2::high_bits32(&x.qh),
                );
                let qx = _mm256_sub_epi8(qx, off);
                let xy = _mm256_cvtepi32_ps($ss(qx, $crate::kernels::cpu::avx2::load32(&y.qs)));
                acc = _mm256_fmadd_ps(d, xy, acc);
            }
            $crate::kernels::cpu::avx2::hsum8(acc)
        }

        #[target_feature(enable = $feat)]
        pub unsafe fn vec_dot_q5_1_q8_1(xs: &[BlockQ5_1], ys: &[BlockQ8_1]) -> f32 {
            let mut acc = _mm256_setzero_ps();
            let mut summs = 0f32;
            for (x, y) in xs.iter().zip(ys) {
                summs += x.m.to_f32() * y.s.to_f32();
                let d = _mm256_set1_ps(x.d.to_f32() * y.d.to_f32());
                let qx = _mm256_or_si256(
                    $crate::kernels::cpu::avx2::nibbles32(&x.qs),
                    $crate::kernels::cpu::avx2::high_bits32(&x.qh),
                );
                let xy = _mm256_cvtepi32_ps($us(qx, $crate::kernels::cpu::avx2::load32(&y.qs)));
                acc = _mm256_fmadd_ps(d, xy, acc);
            }
            $crate::kernels::cpu::avx2::hsum8(acc) + summs
        }

        #[target_feature(enable = $feat)]
        pub unsafe fn vec_dot_q8_0_q8_0(xs: &[BlockQ8_0], ys: &[BlockQ8_0]) -> f32 {
            let mut acc = _mm256_setzero_ps();
            for (x, y) in xs.iter().zip(ys) {
                let d = _mm256_set1_ps(x.d.to_f32() * y.d.to_f32());
                let qx = $crate::kernels::cpu::avx2::load32(&x.qs);
                let xy = _mm256_cvtepi32_ps($ss(qx, $crate::kernels::cpu::avx2::load32(&y.qs)));
                acc = _mm256_fmadd_ps(d, xy, acc);
            }
            $crate::kernels::cpu::avx2::hsum8(acc)
        }
    };
}
pub(crate) use block_kernels;

block_kernels!("avx2,fma,f16c", dot_us8, dot_ss8);

/// Plain-float dot in the 4 x 8 lane order of `scalar::dot_wide`; `load(i)` widens 8 elements.
macro_rules! wide_dot {
    ($name:ident, $load:ident, $elem:ident) => {
        #[target_feature(enable = "avx2,fma,f16c")]
        pub unsafe fn $name(w: &[u8], a: &[u8], n: usize) -> f32 {
            let mut acc = [_mm256_setzero_ps(); 4];
            let full = n / 32 * 32;
            let mut i = 0;
            while i < full {
                for (c, a_c) in acc.iter_mut().enumerate() {
                    *a_c = _mm256_fmadd_ps($load(w, i + 8 * c), $load(a, i + 8 * c), *a_c);
                }
                i += 32;
            }
            let s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
            let mut total = hsum8(s);
            for i in full..n {
                total = $elem(w, i).mul_add($elem(a, i), total);
            }
            total
        }
    };
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load_f32x8(b: &[u8], i: usize) -> __m256 {
    debug_assert!(4 * (i + 8) <= b.len());
    // The caller guarantees 8 elements from i lie inside `b` (i + 8 <= n and b holds n).
    _mm256_loadu_ps(b.as_ptr().add(4 * i).cast())
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load_f16x8(b: &[u8], i: usize) -> __m256 {
    debug_assert!(2 * (i + 8) <= b.len());
    _mm256_cvtph_ps(_mm_loadu_si128(b.as_ptr().add(2 * i).cast()))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load_bf16x8(b: &[u8], i: usize) -> __m256 {
    debug_assert!(2 * (i + 8) <= b.len());
    let h = _mm256_cvtepu16_epi32(_mm_loadu_si128(b.as_ptr().add(2 * i).cast()));
    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(h))
}

fn f32_elem(b: &[u8], i: usize) -> f32 {
    f32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]])
}
fn f16_elem(b: &[u8], i: usize) -> f32 {
    f16_bits_to_f32(u16::from_le_bytes([b[2 * i], b[2 * i + 1]]))
}
fn bf16_elem(b: &[u8], i: usize) -> f32 {
    bf16_to_f32(u16::from_le_bytes([b[2 * i], b[2 * i + 1]]))
}

wide_dot!(vec_dot_f32, load_f32x8, f32_elem);
wide_dot!(vec_dot_f16, load_f16x8, f16_elem);
wide_dot!(vec_dot_bf16, load_bf16x8, bf16_elem);

//! AVX2 + FMA + F16C dot products, bit-identical with `scalar`'s lane order: per 32-element block
//! the integer products are summed into eight i32 lanes of four consecutive elements
//! (`maddubs` then `madd`), converted to f32 and accumulated with one FMA per block. The K-quants
//! compute `kquants`' exact per-super-block integer sums and its float step.
//!
//! Every `unsafe fn` here is unsafe only because it needs the CPU to have AVX2, FMA and F16C
//! (`Isa::Avx2.supported()`); slices are indexed safely.

#![allow(unsafe_op_in_unsafe_fn)]
#![allow(clippy::missing_safety_doc)]

use std::arch::x86_64::*;

use crate::kernels::cpu::kquants;
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

/// `hsum8` of each of eight vectors, as lanes 0..8 of one: the same pairs added in the same
/// order, `((x0 + x4) + (x2 + x6)) + ((x1 + x5) + (x3 + x7))` (each addition commutes exactly).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn hsum8x8(d: [__m256; 8]) -> __m256 {
    // [x_i + x_{i+4} of vector a | of vector b], i = 0..4.
    let half = |a: __m256, b: __m256| {
        _mm256_add_ps(
            _mm256_permute2f128_ps::<0x20>(a, b),
            _mm256_permute2f128_ps::<0x31>(a, b),
        )
    };
    let (t04, t15, t26, t37) = (
        half(d[0], d[4]),
        half(d[1], d[5]),
        half(d[2], d[6]),
        half(d[3], d[7]),
    );
    // [(r0 + r2), (r1 + r3)] of vectors (a, b) in each 128-bit half.
    let pairs = |a: __m256, b: __m256| {
        _mm256_add_ps(
            _mm256_shuffle_ps::<0b01_00_01_00>(a, b),
            _mm256_shuffle_ps::<0b11_10_11_10>(a, b),
        )
    };
    let (u, v) = (pairs(t04, t15), pairs(t26, t37));
    // Lanes: vectors 0, 1, 2, 3 | 4, 5, 6, 7.
    _mm256_add_ps(
        _mm256_shuffle_ps::<0b10_00_10_00>(u, v),
        _mm256_shuffle_ps::<0b11_01_11_01>(u, v),
    )
}

/// Eight f32 lanes, aligned as a 256-bit register (buffers the AVX2 tiles load and store whole).
#[derive(Clone, Copy)]
#[repr(C, align(32))]
pub(crate) struct Lanes8(pub(crate) [f32; 8]);

/// An f16 scale to f32 with F16C (exact, as the portable conversion).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn h2f(h: F16Le) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(
        u16::from_le_bytes(h.0) as i32
    )))
}

/// `[x[0] · y[0], x[1] · y[1], ..]`: two pairs of f16 scales (a block's `d` and `m` against its
/// activations' `d` and `s`) to f32 with one F16C conversion, then one multiply; lanes 0 and 1
/// are exactly the f32 products of the scales. The hot loops took their scales from a 256 KiB
/// table of every f16 once; against real activations and weights its lines miss the cache
/// (8B Q4_0 file, 1 thread: decode 10-15% slower than against a smooth sine, whose blocks
/// share one scale).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn scale_products(x: [F16Le; 2], y: [F16Le; 2]) -> __m128 {
    let bits = |h: [F16Le; 2]| h[0].bits() as u64 | (h[1].bits() as u64) << 16;
    let v = _mm_cvtph_ps(_mm_cvtsi64_si128((bits(x) | bits(y) << 32) as i64));
    _mm_mul_ps(v, _mm_movehl_ps(v, v))
}

/// An f16 scale to f32 in all four lanes: one broadcast of the 16 bits, one F16C conversion.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn h2f_splat(h: F16Le) -> __m128 {
    _mm_cvtph_ps(_mm_set1_epi16(h.bits() as i16))
}

/// [`h2f_splat`] in all sixteen lanes of a 512-bit register (the interleaved kernels' token
/// scales).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
pub unsafe fn h2f_splat16(h: F16Le) -> __m512 {
    _mm512_cvtph_ps(_mm256_set1_epi16(h.bits() as i16))
}

/// `x · y` of two f16 scales, exactly as the f32 product ([`scale_products`]' lane 0).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn scale_product(x: F16Le, y: F16Le) -> f32 {
    let v = _mm_cvtph_ps(_mm_cvtsi32_si128(
        (x.bits() as u32 | (y.bits() as u32) << 16) as i32,
    ));
    _mm_cvtss_f32(_mm_mul_ss(v, _mm_movehdup_ps(v)))
}

/// Four f16 scales to f32 with one F16C conversion (exact, lane i from `h[i]`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn h2f4(h: [F16Le; 4]) -> __m128 {
    let [a, b, c, d] = h.map(|h| u16::from_le_bytes(h.0) as i64);
    _mm_cvtph_ps(_mm_cvtsi64_si128(a | b << 16 | c << 32 | d << 48))
}

/// `quant::quantize_act_row` with AVX2, byte for byte: Q8_0 / Q8_1 blocks by [`quantize_q8`],
/// F16 rows eight at a time by `vcvtps2ph` with round-to-nearest-even (the instruction `half`
/// uses for one value on F16C CPUs), other types by the portable code compiled for AVX2.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn quantize_act_row(
    ty: crate::quant::GgmlType,
    src: &[f32],
    dst: &mut [u8],
) -> crate::error::Result<()> {
    use crate::quant::GgmlType;
    let whole = src.len().is_multiple_of(QK) && ty.row_bytes(src.len()).ok() == Some(dst.len());
    if ty == GgmlType::Q8_0 && whole {
        let blocks = crate::quant::as_blocks_mut::<BlockQ8_0>(dst)?;
        for (x, y) in src.as_chunks::<QK>().0.iter().zip(blocks) {
            y.d = F16Le::from_f32(quantize_q8(x, &mut y.qs));
        }
        return Ok(());
    }
    if ty == GgmlType::Q8_1 && whole {
        let blocks = crate::quant::as_blocks_mut::<BlockQ8_1>(dst)?;
        for (x, y) in src.as_chunks::<QK>().0.iter().zip(blocks) {
            let d = quantize_q8(x, &mut y.qs);
            let sum: i32 = y.qs.iter().map(|&q| q as i32).sum();
            y.d = F16Le::from_f32(d);
            y.s = F16Le::from_f32(d * sum as f32);
        }
        return Ok(());
    }
    if ty == GgmlType::F16 && dst.len() == 2 * src.len() {
        let (xs, rest) = src.as_chunks::<8>();
        let (hs, hrest) = dst.as_chunks_mut::<16>();
        for (x, h) in xs.iter().zip(hs) {
            let v = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(x.as_ptr()));
            _mm_storeu_si128(h.as_mut_ptr().cast(), v);
        }
        for (&x, h) in rest.iter().zip(hrest.as_chunks_mut::<2>().0) {
            *h = F16Le::from_f32(x).0;
        }
        return Ok(());
    }
    crate::quant::quantize_act_row(ty, src, dst)
}

/// One block of `quant::quantize_act_row`'s Q8 quantiser; returns `d`. `amax` is the largest
/// `|x|` ignoring NaN (as the scalar fold with `f32::max`: `vmaxps` returns its second operand,
/// the running maximum, where the first is NaN); `d = amax / 127`; `q` is `x * (127 / amax)`
/// rounded half to even and saturated to i8, NaN to 0 (Rust's `as i8`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quantize_q8(x: &[f32; QK], qs: &mut [i8; QK]) -> f32 {
    let v: [__m256; 4] = std::array::from_fn(|i| _mm256_loadu_ps(x[8 * i..].as_ptr()));
    let sign = _mm256_set1_ps(-0.0);
    let mut m = _mm256_setzero_ps();
    for vi in v {
        m = _mm256_max_ps(_mm256_andnot_ps(sign, vi), m);
    }
    let m4 = _mm_max_ps(_mm256_extractf128_ps::<1>(m), _mm256_castps256_ps128(m));
    let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    let amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_movehdup_ps(m2)));
    let d = amax / 127.0;
    let id = _mm256_set1_ps(if amax != 0.0 { 127.0 / amax } else { 0.0 });
    let (lo, hi) = (_mm256_set1_ps(-128.0), _mm256_set1_ps(127.0));
    let q: [__m256i; 4] = std::array::from_fn(|i| {
        let r = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(v[i], id),
        );
        let nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(r, r);
        let r = _mm256_andnot_ps(nan, _mm256_min_ps(_mm256_max_ps(r, lo), hi));
        _mm256_cvttps_epi32(r)
    });
    let q16 = [
        _mm256_packs_epi32(q[0], q[1]),
        _mm256_packs_epi32(q[2], q[3]),
    ];
    let q8 = _mm256_packs_epi16(q16[0], q16[1]);
    let q8 = _mm256_permutevar8x32_epi32(q8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(qs.as_mut_ptr().cast(), q8);
    d
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
        /// Q4_0's own order (`scalar`): one exact integer per block, one FMA chain.
        #[target_feature(enable = $feat)]
        pub unsafe fn vec_dot_q4_0_q8_0(xs: &[BlockQ4_0], ys: &[BlockQ8_0]) -> f32 {
            let mut sumf = 0f32;
            let off = _mm256_set1_epi8(8);
            for (x, y) in xs.iter().zip(ys) {
                let d = $crate::kernels::cpu::avx2::scale_product(x.d, y.d);
                let qx = _mm256_sub_epi8($crate::kernels::cpu::avx2::nibbles32(&x.qs), off);
                let lanes = $ss(qx, $crate::kernels::cpu::avx2::load32(&y.qs));
                let isum = $crate::kernels::cpu::avx2::hsum_i32(lanes);
                sumf = d.mul_add(isum as f32, sumf);
            }
            sumf
        }

        #[target_feature(enable = $feat)]
        pub unsafe fn vec_dot_q4_1_q8_1(xs: &[BlockQ4_1], ys: &[BlockQ8_1]) -> f32 {
            let mut acc = _mm256_setzero_ps();
            let mut summs = 0f32;
            for (x, y) in xs.iter().zip(ys) {
                let p = $crate::kernels::cpu::avx2::scale_products([x.d, x.m], [y.d, y.s]);
                summs += _mm_cvtss_f32(_mm_movehdup_ps(p));
                let d = _mm256_broadcastss_ps(p);
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
                let d = _mm256_set1_ps($crate::kernels::cpu::avx2::scale_product(x.d, y.d));
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
                let p = $crate::kernels::cpu::avx2::scale_products([x.d, x.m], [y.d, y.s]);
                summs += _mm_cvtss_f32(_mm_movehdup_ps(p));
                let d = _mm256_broadcastss_ps(p);
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
                let d = _mm256_set1_ps($crate::kernels::cpu::avx2::scale_product(x.d, y.d));
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

/// [`super::ops::expf`] on eight lanes: the same f64 operations, lane by lane, four lanes at a
/// time (the table entry by a gather); lanes outside its main path (|x| >= 88, infinities, NaN)
/// go through the scalar function.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn expf8(x: __m256) -> __m256 {
    let top = _mm256_and_si256(
        _mm256_srli_epi32::<20>(_mm256_castps_si256(x)),
        _mm256_set1_epi32(0x7ff),
    );
    let limit = _mm256_set1_epi32(super::ops::EXPF_SPECIAL_TOP as i32 - 1);
    let special = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(top, limit)));
    let lo = expf4(_mm256_cvtps_pd(_mm256_castps256_ps128(x)));
    let hi = expf4(_mm256_cvtps_pd(_mm256_extractf128_ps::<1>(x)));
    let out = _mm256_set_m128(hi, lo);
    if special == 0 {
        return out;
    }
    expf_special_lanes(x, out, special as u32)
}

/// `out` with its lanes `l` where bit l of `special` is set replaced by
/// [`super::ops::expf_special`] of lane l of `x` (the vector `expf`s' lanes outside the main path).
#[cold]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn expf_special_lanes(x: __m256, out: __m256, special: u32) -> __m256 {
    let (mut xs, mut os) = ([0f32; 8], [0f32; 8]);
    _mm256_storeu_ps(xs.as_mut_ptr(), x);
    _mm256_storeu_ps(os.as_mut_ptr(), out);
    for l in 0..8 {
        if special & (1 << l) != 0 {
            os[l] = super::ops::expf_special(xs[l]);
        }
    }
    _mm256_loadu_ps(os.as_ptr())
}

/// [`expf8`]'s main path on four lanes, widened to f64.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn expf4(xd: __m256d) -> __m128 {
    use super::ops::{EXP2F_TAB, EXPF_C, EXPF_INV_LN2_N, EXPF_SHIFT};
    let inv_ln2_n = _mm256_set1_pd(EXPF_INV_LN2_N);
    let shift = _mm256_set1_pd(EXPF_SHIFT);
    let kd = _mm256_fmadd_pd(inv_ln2_n, xd, shift);
    let ki = _mm256_castpd_si256(kd);
    let kd = _mm256_sub_pd(kd, shift);
    let r = _mm256_fmsub_pd(inv_ln2_n, xd, kd);
    let at = _mm256_and_si256(ki, _mm256_set1_epi64x(31));
    let t = _mm256_i64gather_epi64::<8>(EXP2F_TAB.as_ptr().cast(), at);
    let s = _mm256_castsi256_pd(_mm256_add_epi64(t, _mm256_slli_epi64::<47>(ki)));
    let c = |i: usize| _mm256_set1_pd(EXPF_C[i]);
    let z = _mm256_fmadd_pd(r, c(0), c(1));
    let r2 = _mm256_mul_pd(r, r);
    let y = _mm256_fmadd_pd(r, c(2), _mm256_set1_pd(1.0));
    _mm256_cvtpd_ps(_mm256_mul_pd(_mm256_fmadd_pd(z, r2, y), s))
}

/// [`super::ops::swiglu_inplace`] eight elements at a time: `g / (1 + expf(-g)) * u`, the same
/// f32 operations lane by lane.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn swiglu_inplace(gate: &mut [f32], up: &[f32]) {
    swiglu_with(gate, up, |x| expf8(x))
}

/// [`swiglu_inplace`] with `exp` for [`expf8`] (AVX-512's, or this file's). Called from functions
/// with AVX2, FMA and F16C enabled.
#[inline(always)]
pub(crate) unsafe fn swiglu_with(gate: &mut [f32], up: &[f32], exp: impl Fn(__m256) -> __m256) {
    let n = gate.len().min(up.len());
    let (gate, up) = (&mut gate[..n], &up[..n]);
    let (gs, g_tail) = gate.as_chunks_mut::<8>();
    let (us, u_tail) = up.as_chunks::<8>();
    let (one, sign) = (_mm256_set1_ps(1.0), _mm256_set1_ps(-0.0));
    for (g, u) in gs.iter_mut().zip(us) {
        let x = _mm256_loadu_ps(g.as_ptr());
        let e = exp(_mm256_xor_ps(x, sign));
        let y = _mm256_mul_ps(
            _mm256_div_ps(x, _mm256_add_ps(one, e)),
            _mm256_loadu_ps(u.as_ptr()),
        );
        _mm256_storeu_ps(g.as_mut_ptr(), y);
    }
    super::ops::swiglu_scalar(g_tail, u_tail);
}

/// Softmax of rows `i` of `p` (row i at `i * stride`, `lens[i]` long), each as `ops::softmax`
/// then rounded to f16 as `round_f16`: the exponentials eight at a time ([`expf8`]), each row's
/// f64 sum in order with up to eight rows' chains side by side
/// ([`super::ops::row_sums`]).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn softmax_rows(p: &mut [f32], stride: usize, lens: &[usize]) {
    softmax_rows_with(p, stride, lens, |x| expf8(x))
}

/// [`softmax_rows`] with `exp` for [`expf8`] (AVX-512's, or this file's). Called from functions
/// with AVX2, FMA and F16C enabled.
#[inline(always)]
pub(crate) unsafe fn softmax_rows_with(
    p: &mut [f32],
    stride: usize,
    lens: &[usize],
    exp: impl Fn(__m256) -> __m256,
) {
    for (i, &n) in lens.iter().enumerate() {
        let x = &mut p[i * stride..][..n];
        // As `fold(NEG_INFINITY, f32::max)`: `vmaxps` returns its second operand, the running
        // maximum (never NaN), where the element is NaN.
        let (chunks, tail) = x.as_chunks::<8>();
        let mut m = _mm256_set1_ps(f32::NEG_INFINITY);
        for c in chunks {
            m = _mm256_max_ps(_mm256_loadu_ps(c.as_ptr()), m);
        }
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), m);
        let max = lanes
            .iter()
            .chain(tail)
            .copied()
            .fold(f32::NEG_INFINITY, f32::max);
        let (chunks, tail) = x.as_chunks_mut::<8>();
        let vmax = _mm256_set1_ps(max);
        for c in chunks {
            let e = exp(_mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), vmax));
            _mm256_storeu_ps(c.as_mut_ptr(), e);
        }
        for v in tail {
            *v = super::ops::expf(*v - max);
        }
    }
    let sums = super::ops::row_sums(p, stride, lens);
    for ((i, &n), sum) in lens.iter().enumerate().zip(sums) {
        let inv = (1.0 / sum) as f32;
        let x = &mut p[i * stride..][..n];
        let (chunks, tail) = x.as_chunks_mut::<8>();
        let vinv = _mm256_set1_ps(inv);
        for c in chunks {
            let w = _mm256_mul_ps(_mm256_loadu_ps(c.as_ptr()), vinv);
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(w);
            _mm256_storeu_ps(c.as_mut_ptr(), _mm256_cvtph_ps(h));
        }
        for v in tail {
            *v = half::f16::from_f32(*v * inv).to_f32();
        }
    }
}

/// 32 IQ4 quants (nibbles as [`nibbles32`] orders them) as their signed values.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn iq4_values32(qs: &[u8; 16]) -> __m256i {
    let t = _mm_loadu_si128(IQ4_VALUES.as_ptr().cast());
    _mm256_shuffle_epi8(_mm256_set_m128i(t, t), nibbles32(qs))
}

/// Eight i32 lanes of `Σ v y` over 32 signed bytes each, by 16-bit products (exact for every
/// byte, -128 included, where `maddubs` with signs would not be).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_wide16(v: __m256i, y: __m256i) -> __m256i {
    let w = |a: __m256i, i| {
        let half = if i == 0 {
            _mm256_castsi256_si128(a)
        } else {
            _mm256_extracti128_si256::<1>(a)
        };
        _mm256_cvtepi8_epi16(half)
    };
    _mm256_add_epi32(
        _mm256_madd_epi16(w(v, 0), w(y, 0)),
        _mm256_madd_epi16(w(v, 1), w(y, 1)),
    )
}

/// IQ4_NL in Q4_0's order (`scalar`): one exact integer per block, one FMA chain.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn vec_dot_iq4_nl_q8_0(xs: &[BlockIQ4NL], ys: &[BlockQ8_0]) -> f32 {
    let mut sumf = 0f32;
    for (x, y) in xs.iter().zip(ys) {
        let d = scale_product(x.d, y.d);
        let isum = hsum_i32(dot_wide16(iq4_values32(&x.qs), load32(&y.qs)));
        sumf = d.mul_add(isum as f32, sumf);
    }
    sumf
}

/// IQ4_XS in `kquants`' order: per super-block the exact `isum = Σ_j sc_j Σ v y` in eight
/// lanes, then its one FMA.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn vec_dot_iq4_xs_q8_k(xs: &[BlockIQ4XS], ys: &[BlockQ8K]) -> f32 {
    let mut sumf = 0f32;
    for (x, y) in xs.iter().zip(ys) {
        let mut acc = _mm256_setzero_si256();
        for (j, qs) in x.qs.as_chunks::<16>().0.iter().enumerate() {
            let yv = _mm256_loadu_si256(y.qs[32 * j..].as_ptr().cast());
            let lanes = dot_wide16(iq4_values32(qs), yv);
            acc = _mm256_add_epi32(
                acc,
                _mm256_mullo_epi32(lanes, _mm256_set1_epi32(x.scale(j))),
            );
        }
        sumf = super::kquants::add_scaled(sumf, y.d.get(), x.d.to_f32(), hsum_i32(acc));
    }
    sumf
}

/// Plain-float dot in the 4 x 8 lane order of `scalar::dot_wide`; `load(i)` widens 8 elements.
/// `$rows`: the same for four rows against one activation row (decode, [`rows_fn`]), each row's
/// FMAs and sums in that order (so the same bits), the activations read from L1 for the four.
macro_rules! wide_dot {
    ($name:ident, $rows:ident, $load:ident, $elem:ident, $size:literal) => {
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
            let mut total = sum_wide8(acc);
            for i in full..n {
                total = $elem(w, i).mul_add($elem(a, i), total);
            }
            total
        }

        #[target_feature(enable = "avx2,fma,f16c")]
        pub unsafe fn $rows(w: [&[u8]; 4], a: &[u8]) -> [f32; 4] {
            let n = super::common_blocks(&w, &[a]) / $size;
            let mut acc = [[_mm256_setzero_ps(); 4]; 4];
            let full = n / 32 * 32;
            let mut i = 0;
            while i < full {
                for (r, acc) in acc.iter_mut().enumerate() {
                    for (c, a_c) in acc.iter_mut().enumerate() {
                        *a_c = _mm256_fmadd_ps($load(w[r], i + 8 * c), $load(a, i + 8 * c), *a_c);
                    }
                }
                i += 32;
            }
            std::array::from_fn(|r| {
                let mut total = sum_wide8(acc[r]);
                for i in full..n {
                    total = $elem(w[r], i).mul_add($elem(a, i), total);
                }
                total
            })
        }
    };
}

/// `wide_dot`'s four accumulators summed in `dot_wide`'s order.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn sum_wide8(acc: [__m256; 4]) -> f32 {
    hsum8(_mm256_add_ps(
        _mm256_add_ps(acc[0], acc[1]),
        _mm256_add_ps(acc[2], acc[3]),
    ))
}

/// Four Q4_0 rows against one Q8_0 row, bit-identical per row with [`vec_dot_q4_0_q8_0`]: the same
/// exact `isum` per block, the four rows' `d.mul_add(isum, sumf)` as one 128-bit FMA.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn rows_q4_0(w: [&[u8]; 4], a: &[u8]) -> [f32; 4] {
    let xs: [&[BlockQ4_0]; 4] = w.map(super::blocks::<BlockQ4_0>);
    let ys: &[BlockQ8_0] = super::blocks(a);
    let nb = super::common_blocks(&xs, &[ys]);
    let off = _mm256_set1_epi8(8);
    let mut sumf = _mm_setzero_ps();
    for (b, y) in ys[..nb].iter().enumerate() {
        let x: [&BlockQ4_0; 4] = std::array::from_fn(|r| &xs[r][b]);
        let yv = load32(&y.qs);
        let lanes = x.map(|x| dot_ss8(_mm256_sub_epi8(nibbles32(&x.qs), off), yv));
        let d = _mm_mul_ps(h2f4(x.map(|x| x.d)), h2f_splat(y.d));
        sumf = _mm_fmadd_ps(d, _mm_cvtepi32_ps(sum4_i32(lanes)), sumf);
    }
    lanes4(sumf)
}

/// Four Q8_0 rows against one Q8_0 row, bit-identical per row with [`vec_dot_q8_0_q8_0`]: the
/// same eight i32 lanes per block and the same FMA with `d_x * d_y` into each row's own 8-lane
/// chain, so four independent chains (one row's chain waits four cycles a block for its FMA);
/// the activation block and its scale are loaded once for the four rows, the four rows' scales
/// converted by one F16C conversion.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn rows_q8_0(w: [&[u8]; 4], a: &[u8]) -> [f32; 4] {
    rows_q8_0_with(w, a, 0, |x, y| dot_ss8(x, y))
}

/// [`rows_q8_0`] with `dot` for [`dot_ss8`] (AVX-512's VNNI one, or this file's), asking for
/// each row's line `ahead` bytes past the current block (0: none; AVX-512's kernel takes its
/// `rows_prefetch`).
/// Called from functions with AVX2, FMA and F16C enabled.
#[inline(always)]
pub(crate) unsafe fn rows_q8_0_with(
    w: [&[u8]; 4],
    a: &[u8],
    ahead: usize,
    dot: impl Fn(__m256i, __m256i) -> __m256i,
) -> [f32; 4] {
    let xs: [&[BlockQ8_0]; 4] = w.map(super::blocks::<BlockQ8_0>);
    let ys: &[BlockQ8_0] = super::blocks(a);
    let nb = super::common_blocks(&xs, &[ys]);
    let mut acc = [_mm256_setzero_ps(); 4];
    for (b, y) in ys[..nb].iter().enumerate() {
        let x: [&BlockQ8_0; 4] = std::array::from_fn(|r| &xs[r][b]);
        let yv = load32(&y.qs);
        // d_x * d_y of the four rows, lane by lane as the scalar products.
        let d = _mm256_castps128_ps256(_mm_mul_ps(h2f4(x.map(|x| x.d)), h2f_splat(y.d)));
        for r in 0..4 {
            if ahead > 0 {
                let at = (x[r] as *const BlockQ8_0).cast::<i8>().wrapping_add(ahead);
                _mm_prefetch::<_MM_HINT_T0>(at);
            }
            let lanes = dot(load32(&x[r].qs), yv);
            let dr = _mm256_permutevar8x32_ps(d, _mm256_set1_epi32(r as i32));
            acc[r] = _mm256_fmadd_ps(dr, _mm256_cvtepi32_ps(lanes), acc[r]);
        }
    }
    acc.map(|v| hsum8(v))
}

/// The four lanes of `v`, one per row of the four-row kernels (AVX2's and AVX-512's).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn lanes4(v: __m128) -> [f32; 4] {
    let mut out = [0f32; 4];
    _mm_storeu_ps(out.as_mut_ptr(), v);
    out
}

/// Four rows at a time for decode on AVX2 CPUs, where a kernel exists (as
/// [`super::avx512::rows_fn`] on AVX-512 CPUs): Q4_0, Q8_0, F16, BF16 and F32. Out of cache, 1 EPYC
/// thread with `OATO_CPU_ISA=avx2` (`examples/matmul_dram`, alternated), fraction of the plain
/// read one row / four rows at a time: F16 8192 x 2048 0.60 / 0.78, Q4_0 4096 x 4096 0.28 /
/// 0.42, 2048 x 8192 0.30 / 0.42. 1B shape tg32, 2 threads: Q4_0 25.2 -> 32.2 t/s, F16 15.5 ->
/// 20.5. Q8_0 ([`rows_q8_0`], 2026-11-27): 8192 x 2048 out of cache, 2 threads, GB/s of weights
/// 23.7 -> 35.7 (medians of 5 alternated; one row's single FMA chain waited on its latency every
/// block); 1B shape tg128 alternated twice, 1 / 2 threads: 9.3, 8.9 -> 15.0, 14.2 t/s and 15.6,
/// 15.7 -> 19.7, 23.8 (an earlier try, 2026-11-26, had seen no gain at 2 threads: 0.61-0.90 of
/// the memory's rate against 0.65-0.85).
pub fn rows_fn(wty: crate::quant::GgmlType) -> Option<super::avx512::RowsFn<4>> {
    use crate::quant::GgmlType;
    match wty {
        GgmlType::Q4_0 => Some(rows_q4_0),
        GgmlType::Q8_0 => Some(rows_q8_0),
        GgmlType::F16 => Some(rows_f16),
        GgmlType::BF16 => Some(rows_bf16),
        GgmlType::F32 => Some(rows_f32),
        _ => None,
    }
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

wide_dot!(vec_dot_f32, rows_f32, load_f32x8, f32_elem, 4);
wide_dot!(vec_dot_f16, rows_f16, load_f16x8, f16_elem, 2);
wide_dot!(vec_dot_bf16, rows_bf16, load_bf16x8, bf16_elem, 2);

// ---------------------------------------------------------------------------------------------
// K-quants: the exact integer sums of `kquants`, 32 elements per register. Each 32-element slice t
// of a super-block (elements 32t..32t + 32) becomes unsigned quant bytes; `maddubs` with the
// activations gives 16 i16 pair sums (exact: quants ≤ 63, so |pair| ≤ 16128), `madd` with the
// 16-element groups' i16 scales widens them to eight i32 lanes. The lanes are summed to `isum`
// (and `imin`) per super-block, then the float step of `kquants` follows.

/// `vpshufb` masks spreading eight i16 group scales (the same in both lanes) to
/// `[s_{2i} x 8 | s_{2i+1} x 8]` for i in 0..4: the scales of 32-element slice `4h + i` when the
/// register holds groups `8h..8h + 8`.
static SCALE_PAIR: [[u8; 32]; 4] = {
    let mut m = [[0u8; 32]; 4];
    let mut i = 0;
    while i < 4 {
        let mut b = 0;
        while b < 32 {
            let word = if b < 16 { 2 * i } else { 2 * i + 1 };
            m[i][b] = (2 * word + b % 2) as u8;
            b += 1;
        }
        i += 1;
    }
    m
};

/// The two halves of 16 group scales (i16), each broadcast to both lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn scale_halves(groups: __m256i) -> [__m256i; 2] {
    [
        _mm256_permute2x128_si256::<0x00>(groups, groups),
        _mm256_permute2x128_si256::<0x11>(groups, groups),
    ]
}

/// The i16 scales of 32-element slice t: `[s_{2t} x 8 | s_{2t+1} x 8]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn slice_scales(halves: &[__m256i; 2], t: usize) -> __m256i {
    let mask = _mm256_loadu_si256(SCALE_PAIR[t % 4].as_ptr().cast());
    _mm256_shuffle_epi8(halves[t / 4], mask)
}

/// `[Σ a, Σ b, Σ a, Σ b]` over the i32 lanes of `a` and `b` (exact: wrapping adds of sums that
/// fit).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn hsum_i32_pair(a: __m256i, b: __m256i) -> __m128i {
    let s = _mm256_hadd_epi32(a, b); // [a01 a23 b01 b23 | a45 a67 b45 b67]
    let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
    _mm_hadd_epi32(s, s)
}

/// The sum of eight i32 lanes (exact).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn hsum_i32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32::<0b01>(s)))
}

/// The eight i32 lanes of each of four vectors summed, into lanes 0..4 (exact, any order).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn sum4_i32(v: [__m256i; 4]) -> __m128i {
    let h = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h))
}

/// Two f16 super-block scales, exactly widened, in lanes 0 and 1.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn f16_pair(d: F16Le, dmin: F16Le) -> __m128 {
    _mm_cvtph_ps(_mm_cvtsi32_si128(i32::from_le_bytes([
        d.0[0], d.0[1], dmin.0[0], dmin.0[1],
    ])))
}

/// `kquants`' float step for a type with mins: `isum`, `imin` in lanes 0, 1 of `sums`,
/// `d_x`, `dmin_x` in lanes 0, 1 of `d`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn finish_with_mins(sumf: f32, d_y: f32, d: __m128, sums: __m128i) -> f32 {
    let f = _mm_cvtepi32_ps(sums); // round to nearest even, as `as f32`
    let s = _mm_mul_ps(_mm_set1_ps(d_y), d); // [d_y * d_x, d_y * dmin_x]
    let acc = _mm_fmadd_ss(s, f, _mm_set_ss(sumf));
    // fnmadd: -(a * b) + c with one rounding, i.e. fma(-(d_y * dmin_x), imin, acc)
    _mm_cvtss_f32(_mm_fnmadd_ss(_mm_movehdup_ps(s), _mm_movehdup_ps(f), acc))
}

/// `kquants`' float step for a type without mins: `isum` in lane 0 of `sums`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn finish(sumf: f32, d_y: f32, d_x: f32, sums: __m128i) -> f32 {
    // (d_x comes widened by the scalar `to_f32`: for a lone f16, `vcvtph2ps` from a 16-bit
    // insert lets LLVM merge into whatever register is live, here `sumf`, lengthening its chain)
    let s = _mm_set_ss(d_y * d_x);
    _mm_cvtss_f32(_mm_fmadd_ss(s, _mm_cvtepi32_ps(sums), _mm_set_ss(sumf)))
}

/// The activations' 16 group sums as i16.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn load_bsums(y: &BlockQ8K) -> __m256i {
    // 16 two-byte little-endian fields, 32 contiguous bytes.
    _mm256_loadu_si256(y.bsums.as_ptr().cast())
}

/// The activations of 32-element slice t.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn y_slice(y: &BlockQ8K, t: usize) -> __m256i {
    load32(&y.qs.as_chunks::<32>().0[t])
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load_u8x32(q: &[u8; 32]) -> __m256i {
    _mm256_loadu_si256(q.as_ptr().cast())
}

/// The first 16 bytes of a Q4_K / Q5_K block (`d`, `dmin`, the 12 packed scale bytes) unpacked:
/// the eight 6-bit scales then the eight 6-bit mins as bytes (as `kquants::k4_scales`), and
/// `[d, dmin]` as f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn k4_head(head: &[u8; 16]) -> (__m128i, __m128) {
    let raw = _mm_loadu_si128(head.as_ptr().cast()); // scale byte r_i at 4 + i
    // low bits: r0..4 & 63 | r8..12 & 15 | r4..8 & 63 | r8..12 >> 4
    let p = _mm_shuffle_epi8(
        raw,
        _mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15),
    );
    let p = _mm_blend_epi32::<0b1000>(p, _mm_srli_epi16::<4>(p));
    let low = _mm_and_si128(
        p,
        _mm_setr_epi8(
            63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15,
        ),
    );
    // high 2 bits of scales / mins 4..8: the top bits of r0..4 / r4..8 moved to bits 4..6
    // (16-bit shift: the 0x30 mask drops what crosses from the neighbouring byte)
    let q = _mm_shuffle_epi8(
        raw,
        _mm_setr_epi8(-1, -1, -1, -1, 4, 5, 6, 7, -1, -1, -1, -1, 8, 9, 10, 11),
    );
    let high = _mm_and_si128(_mm_srli_epi16::<2>(q), _mm_set1_epi8(0x30));
    (_mm_or_si128(low, high), _mm_cvtph_ps(raw))
}

/// A Q4_K / Q5_K block's first 16 bytes: `d`, `dmin` and `scales`.
#[inline(always)]
pub fn k4_head_bytes<B: Block>(x: &B) -> &[u8; 16] {
    let bytes = blocks_as_bytes(std::slice::from_ref(x));
    bytes
        .first_chunk::<16>()
        .expect("a K-quant block is longer than 16 bytes")
}

/// Q4_K / Q5_K's 16 group scales (sub-block s covers groups 2s, 2s + 1) as i16, the mins term
/// `Σ_g m_{g/2} · bsum_g` in eight i32 lanes, and `[d, dmin]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn k4_groups_and_mins(head: &[u8; 16], y: &BlockQ8K) -> (__m256i, __m256i, __m128) {
    let (sm, d) = k4_head(head);
    let groups = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(sm, sm));
    let mins = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(sm, sm));
    (groups, _mm256_madd_epi16(mins, load_bsums(y)), d)
}

#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn vec_dot_q2_k_q8_k(xs: &[BlockQ2K], ys: &[BlockQ8K]) -> f32 {
    let (m2, m4) = (_mm256_set1_epi8(3), _mm_set1_epi8(0x0F));
    let mut sumf = 0.0f32;
    for (x, y) in xs.iter().zip(ys) {
        let raw = _mm_loadu_si128(x.scales.as_ptr().cast());
        let groups = _mm256_cvtepu8_epi16(_mm_and_si128(raw, m4));
        let mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16::<4>(raw), m4));
        let imin = _mm256_madd_epi16(mins, load_bsums(y));
        let halves = scale_halves(groups);
        let mut acc = _mm256_setzero_si256();
        for (h, q) in x.qs.as_chunks::<32>().0.iter().enumerate() {
            let q = load_u8x32(q);
            for p in 0..4 {
                // slice 4h + p is 2-bit plane p of qs[32h..32h + 32]
                let t = 4 * h + p;
                let qt = _mm256_and_si256(_mm256_srl_epi16(q, _mm_cvtsi32_si128(2 * p as i32)), m2);
                let prod = _mm256_maddubs_epi16(qt, y_slice(y, t));
                acc = _mm256_add_epi32(acc, _mm256_madd_epi16(prod, slice_scales(&halves, t)));
            }
        }
        let sums = hsum_i32_pair(acc, imin);
        sumf = finish_with_mins(sumf, y.d.get(), f16_pair(x.d, x.dmin), sums);
    }
    sumf
}

#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn vec_dot_q3_k_q8_k(xs: &[BlockQ3K], ys: &[BlockQ8K]) -> f32 {
    let (m2, four) = (_mm256_set1_epi8(3), _mm256_set1_epi8(4));
    let mut sumf = 0.0f32;
    for (x, y) in xs.iter().zip(ys) {
        let sc = kquants::q3_scales(&x.scales);
        let halves = scale_halves(_mm256_cvtepi8_epi16(_mm_loadu_si128(sc.as_ptr().cast())));
        let hmask = load_u8x32(&x.hmask);
        let mut acc = _mm256_setzero_si256();
        for (h, q) in x.qs.as_chunks::<32>().0.iter().enumerate() {
            let q = load_u8x32(q);
            for p in 0..4 {
                // slice t = group 4h + p: q + 4 = plane p of qs, plus 4 where bit t of hmask is set
                let t = 4 * h + p;
                let low =
                    _mm256_and_si256(_mm256_srl_epi16(q, _mm_cvtsi32_si128(2 * p as i32)), m2);
                let bit = _mm256_set1_epi8((1u8 << t) as i8);
                let set = _mm256_cmpeq_epi8(_mm256_and_si256(hmask, bit), bit);
                let qt = _mm256_or_si256(low, _mm256_and_si256(set, four));
                let yt = y_slice(y, t);
                // Σ (q + 4)·y − Σ 4·y, each pair sum exact in i16 (≤ 1792 and ≤ 1024)
                let prod =
                    _mm256_sub_epi16(_mm256_maddubs_epi16(qt, yt), _mm256_maddubs_epi16(four, yt));
                acc = _mm256_add_epi32(acc, _mm256_madd_epi16(prod, slice_scales(&halves, t)));
            }
        }
        let sums = hsum_i32_pair(acc, _mm256_setzero_si256());
        sumf = finish(sumf, y.d.get(), x.d.to_f32(), sums);
    }
    sumf
}

/// Integer sums of one Q4_K / Q5_K super-block: sub-block s = slice t is the low (even t) or high
/// (odd t) nibbles of `qs[32 · (t / 2)..]`, plus 16 where bit t of `qh` is set.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k4_isum(
    qs: &[u8; QK_K / 2],
    qh: Option<&[u8; QK_K / 8]>,
    halves: &[__m256i; 2],
    y: &BlockQ8K,
) -> __m256i {
    let m4 = _mm256_set1_epi8(0x0F);
    let sixteen = _mm256_set1_epi8(16);
    let qh = qh.map(|qh| load_u8x32(qh));
    let mut acc = _mm256_setzero_si256();
    for (c, q) in qs.as_chunks::<32>().0.iter().enumerate() {
        let q = load_u8x32(q);
        let nibbles = [
            _mm256_and_si256(q, m4),
            _mm256_and_si256(_mm256_srli_epi16::<4>(q), m4),
        ];
        for (i, mut qt) in nibbles.into_iter().enumerate() {
            let t = 2 * c + i;
            if let Some(qh) = qh {
                let bit = _mm256_set1_epi8((1u8 << t) as i8);
                let set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
                qt = _mm256_or_si256(qt, _mm256_and_si256(set, sixteen));
            }
            let prod = _mm256_maddubs_epi16(qt, y_slice(y, t));
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(prod, slice_scales(halves, t)));
        }
    }
    acc
}

#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn vec_dot_q4_k_q8_k(xs: &[BlockQ4K], ys: &[BlockQ8K]) -> f32 {
    let mut sumf = 0.0f32;
    for (x, y) in xs.iter().zip(ys) {
        let (groups, imin, d) = k4_groups_and_mins(k4_head_bytes(x), y);
        let acc = k4_isum(&x.qs, None, &scale_halves(groups), y);
        sumf = finish_with_mins(sumf, y.d.get(), d, hsum_i32_pair(acc, imin));
    }
    sumf
}

#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn vec_dot_q5_k_q8_k(xs: &[BlockQ5K], ys: &[BlockQ8K]) -> f32 {
    let mut sumf = 0.0f32;
    for (x, y) in xs.iter().zip(ys) {
        let (groups, imin, d) = k4_groups_and_mins(k4_head_bytes(x), y);
        let acc = k4_isum(&x.qs, Some(&x.qh), &scale_halves(groups), y);
        sumf = finish_with_mins(sumf, y.d.get(), d, hsum_i32_pair(acc, imin));
    }
    sumf
}

#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn vec_dot_q6_k_q8_k(xs: &[BlockQ6K], ys: &[BlockQ8K]) -> f32 {
    let (m4, m30, off) = (
        _mm256_set1_epi8(0x0F),
        _mm256_set1_epi8(0x30),
        _mm256_set1_epi8(32),
    );
    let mut sumf = 0.0f32;
    for (x, y) in xs.iter().zip(ys) {
        let scales = _mm_loadu_si128(x.scales.as_ptr().cast());
        let halves = scale_halves(_mm256_cvtepi8_epi16(scales));
        let mut acc = _mm256_setzero_si256();
        for h in 0..2 {
            let ql = x.ql[64 * h..].as_chunks::<32>().0;
            let (ql0, ql1) = (load_u8x32(&ql[0]), load_u8x32(&ql[1]));
            let qh = load_u8x32(&x.qh.as_chunks::<32>().0[h]);
            // slice 4h + k: a nibble of ql0 / ql1 with bits 2k..2k + 2 of qh moved to bits 4..6
            // (16-bit shifts: the 0x30 mask drops what crosses from the neighbouring byte)
            let q = [
                _mm256_or_si256(
                    _mm256_and_si256(ql0, m4),
                    _mm256_and_si256(_mm256_slli_epi16::<4>(qh), m30),
                ),
                _mm256_or_si256(
                    _mm256_and_si256(ql1, m4),
                    _mm256_and_si256(_mm256_slli_epi16::<2>(qh), m30),
                ),
                _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16::<4>(ql0), m4),
                    _mm256_and_si256(qh, m30),
                ),
                _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16::<4>(ql1), m4),
                    _mm256_and_si256(_mm256_srli_epi16::<2>(qh), m30),
                ),
            ];
            for (k, qk) in q.into_iter().enumerate() {
                let t = 4 * h + k;
                let yt = y_slice(y, t);
                // Σ q·y − Σ 32·y: (q − 32)·y pair sums, exact in i16 (|·| ≤ 8192)
                let prod =
                    _mm256_sub_epi16(_mm256_maddubs_epi16(qk, yt), _mm256_maddubs_epi16(off, yt));
                acc = _mm256_add_epi32(acc, _mm256_madd_epi16(prod, slice_scales(&halves, t)));
            }
        }
        let sums = hsum_i32_pair(acc, _mm256_setzero_si256());
        sumf = finish(sumf, y.d.get(), x.d.to_f32(), sums);
    }
    sumf
}

//! AVX-512 variant: the AVX2 kernels with their integer dot products done by VNNI
//! (`vpdpbusd` on 256-bit registers), which sums the same four consecutive products into each i32
//! lane, so results stay bit-identical with `scalar` and `avx2`. The K-quants use 512-bit
//! registers and `vpdpwssd` for `kquants`' exact integer sums, then its float step.
//!
//! Every `unsafe fn` here is unsafe only because it needs the CPU to have the instruction sets of
//! `Isa::Avx512`; slices are indexed safely.

#![allow(unsafe_op_in_unsafe_fn)]
#![allow(clippy::missing_safety_doc)]

use std::arch::x86_64::*;

use crate::kernels::cpu::avx2;
use crate::quant::blocks::*;

/// Eight i32 lanes of four consecutive unsigned x signed byte products, by VNNI.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn dot_us8(a: __m256i, b: __m256i) -> __m256i {
    _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, b)
}

/// As [`dot_us8`] for signed `a`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn dot_ss8(a: __m256i, b: __m256i) -> __m256i {
    dot_us8(_mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a))
}

super::avx2::block_kernels!(
    "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni",
    dot_us8,
    dot_ss8
);

/// Q4_0 · Q8_0 two blocks per 512-bit register, bit-identical with [`vec_dot_q4_0_q8_0`]: each
/// i32 lane (four consecutive products) is `Σ q·y − Σ 8·y` over the unsigned nibbles q, which is
/// exactly `Σ (q − 8)·y`; each block's eight lanes are summed to its exact `isum`, then one FMA
/// per block in block order, as there.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn vec_dot_q4_0_q8_0_x2(xs: &[BlockQ4_0], ys: &[BlockQ8_0]) -> f32 {
    let n = xs.len().min(ys.len());
    let mut sumf = 0f32;
    let low = _mm256_set1_epi8(0x0F);
    let eight = _mm512_set1_epi8(8);
    let zero = _mm512_setzero_si512();
    let (xp, xt) = xs[..n].as_chunks::<2>();
    let (yp, yt) = ys[..n].as_chunks::<2>();
    for (x, y) in xp.iter().zip(yp) {
        let q = _mm256_set_m128i(
            _mm_loadu_si128(x[1].qs.as_ptr().cast()),
            _mm_loadu_si128(x[0].qs.as_ptr().cast()),
        );
        let lo = _mm256_and_si256(q, low);
        let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), low);
        // [x0 low, x1 low, x0 high, x1 high] -> [x0 low, x0 high, x1 low, x1 high]: each block's
        // elements 0..16 then 16..32, as the activations lie.
        let z = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
        let z = _mm512_shuffle_i64x2::<0b11_01_10_00>(z, z);
        let yv = _mm512_inserti64x4::<1>(
            _mm512_castsi256_si512(_mm256_loadu_si256(y[0].qs.as_ptr().cast())),
            _mm256_loadu_si256(y[1].qs.as_ptr().cast()),
        );
        let minus8y = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, eight, yv));
        let lanes = _mm512_dpbusd_epi32(minus8y, z, yv);
        // [x0 sum, x1 sum] in lanes 0, 1 (exact).
        let s = avx2::hsum_i32_pair(
            _mm512_castsi512_si256(lanes),
            _mm512_extracti64x4_epi64::<1>(lanes),
        );
        let f = _mm_cvtepi32_ps(s);
        let d0 = avx2::scale_product(x[0].d, y[0].d);
        let d1 = avx2::scale_product(x[1].d, y[1].d);
        sumf = d0.mul_add(_mm_cvtss_f32(f), sumf);
        sumf = d1.mul_add(_mm_cvtss_f32(_mm_movehdup_ps(f)), sumf);
    }
    let off = _mm256_set1_epi8(8);
    for (x, y) in xt.iter().zip(yt) {
        let d = avx2::scale_product(x.d, y.d);
        let qx = _mm256_sub_epi8(avx2::nibbles32(&x.qs), off);
        let isum = avx2::hsum_i32(dot_ss8(qx, avx2::load32(&y.qs)));
        sumf = d.mul_add(isum as f32, sumf);
    }
    sumf
}

/// `shuffle_f32x4::<A>(a, b) + shuffle_f32x4::<B>(a, b)`: one level of a cross-register sum over
/// 128-bit quarters.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn add_quarters<const A: i32, const B: i32>(a: __m512, b: __m512) -> __m512 {
    _mm512_add_ps(
        _mm512_shuffle_f32x4::<A>(a, b),
        _mm512_shuffle_f32x4::<B>(a, b),
    )
}

/// `shuffle_ps::<A>(a, b) + shuffle_ps::<B>(a, b)`: one level of a cross-register sum within
/// each 128-bit quarter.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn add_elems<const A: i32, const B: i32>(a: __m512, b: __m512) -> __m512 {
    _mm512_add_ps(_mm512_shuffle_ps::<A>(a, b), _mm512_shuffle_ps::<B>(a, b))
}

/// Up to eight registers (`s`, zero from `s.len()` on) summed pairwise in three levels, as the
/// tiles' lane sums take them: `first` on (0, 1), (2, 3), (4, 5), (6, 7), `second` on the first
/// two results and on the last two, `third` on those, then the lanes put in `order`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn sum_tree8(
    s: &[__m512],
    first: impl Fn(__m512, __m512) -> __m512,
    second: impl Fn(__m512, __m512) -> __m512,
    third: impl Fn(__m512, __m512) -> __m512,
    order: __m512i,
) -> __m512 {
    debug_assert!(s.len() <= 8);
    let z = _mm512_setzero_ps();
    let g = |i: usize| s.get(i).copied().unwrap_or(z);
    let lo = second(first(g(0), g(1)), first(g(2), g(3)));
    let hi = if s.len() > 4 {
        second(first(g(4), g(5)), first(g(6), g(7)))
    } else {
        z
    };
    _mm512_permutexvar_ps(order, third(lo, hi))
}

/// `R` weight rows against one activation row (decode), for the types with [`rows_fn`] kernels.
pub type RowsFn<const R: usize> = unsafe fn([&[u8]; R], &[u8]) -> [f32; R];

/// Four rows at a time for decode where a kernel exists: Q4_0, Q8_0, the K-quants and the
/// plain floats F16, BF16 and F32 (`wide_dot16`). The single-row dots are bound by their one
/// FMA chain and their horizontal sums; four rows keep four chains in flight, share each
/// activation block's loads and scale, and reduce the four rows' lanes together.
pub fn rows_fn(wty: crate::quant::GgmlType) -> Option<RowsFn<4>> {
    use crate::quant::GgmlType;
    match wty {
        GgmlType::Q4_0 => Some(rows_q4_0),
        GgmlType::Q8_0 => Some(rows_q8_0),
        GgmlType::Q2_K => Some(rows_q2_k),
        GgmlType::Q3_K => Some(rows_q3_k),
        GgmlType::Q4_K => Some(rows_k4::<BlockQ4K>),
        GgmlType::Q5_K => Some(rows_k4::<BlockQ5K>),
        GgmlType::Q6_K => Some(rows_q6_k),
        GgmlType::F16 => Some(rows_f16),
        GgmlType::BF16 => Some(rows_bf16),
        GgmlType::F32 => Some(rows_f32),
        _ => None,
    }
}

/// Bytes ahead of each row that the row kernels prefetch (`OATO_CPU_ROWS_PREFETCH` sets it, 0
/// none): 512, and 4096 on AMD's Zen 5 (family 0x1A and later). 1B Q4_0 tg16 on 2 EPYC (Zen 4)
/// threads, three alternated rounds on a machine loaded by other builds (the second round slow
/// for all), GB/s of weights read: 0 bytes 26.8 / 15.3 / 29.1, 512 bytes 31.6 / 16.6 / 31.0,
/// 2048 bytes 16.0 / 16.1 / 30.8. 512 was never behind; the margin is within this machine's
/// noise. On a Zen 5 VM, 2 threads, out of cache (`examples/matmul_dram`, two alternated
/// rounds each), Q8_0 4096 x 14336 read 0.84-0.86 of the plain read with 512 bytes, 1.03-1.05
/// with 2048 and 4096 (the non-temporal hint alike).
fn rows_prefetch() -> usize {
    static AHEAD: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *AHEAD.get_or_init(|| {
        let default = if super::matmul::zen5_or_later() {
            4096
        } else {
            512
        };
        super::matmul::env_bytes("OATO_CPU_ROWS_PREFETCH", default)
    })
}

/// Four Q4_0 rows against one Q8_0 row, bit-identical with [`vec_dot_q4_0_q8_0_x2`] per row:
/// the same exact `isum` per block, the same FMA per block in block order, the four rows' chains
/// in the lanes of one register. A block's nibbles are spread by one 128-bit broadcast load, a
/// variable shift (0 for the low half, 4 for the high) and a mask; the activation block and its
/// `−8·Σy` lanes are loaded once for the four rows, and starting the VNNI sum from them replaces
/// the subtraction.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn rows_q4_0(w: [&[u8]; 4], a: &[u8]) -> [f32; 4] {
    rows_q4_0_tokens::<1>(w, [a])[0]
}

/// [`rows_q4_0`] for `T` tokens at once (a small decode batch): each weight block is unpacked
/// once for the `T` tokens; per token the same operations, so the same bits.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn rows_q4_0_tokens<const T: usize>(w: [&[u8]; 4], a: [&[u8]; T]) -> [[f32; 4]; T] {
    let xs: [&[BlockQ4_0]; 4] = w.map(super::blocks::<BlockQ4_0>);
    let ys: [&[BlockQ8_0]; T] = a.map(super::blocks::<BlockQ8_0>);
    let nb = super::common_blocks(&xs, &ys);
    let low = _mm256_set1_epi8(0x0F);
    let shift = _mm256_set_epi64x(4, 4, 0, 0);
    let eight = _mm256_set1_epi8(8);
    let zero = _mm256_setzero_si256();
    let mut acc = [_mm_setzero_ps(); T];
    let ahead = rows_prefetch();
    for b in 0..nb {
        // SAFETY (unchecked accesses): b < nb <= every row's and token's length.
        let x: [&BlockQ4_0; 4] = std::array::from_fn(|r| unsafe { xs[r].get_unchecked(b) });
        let z: [__m256i; 4] = std::array::from_fn(|r| {
            _mm_prefetch::<_MM_HINT_T0>(
                (x[r] as *const BlockQ4_0).cast::<i8>().wrapping_add(ahead),
            );
            let q = _mm256_broadcastsi128_si256(_mm_loadu_si128(x[r].qs.as_ptr().cast()));
            _mm256_and_si256(_mm256_srlv_epi64(q, shift), low)
        });
        let dx = avx2::h2f4(x.map(|x| x.d));
        for t in 0..T {
            let y = unsafe { ys[t].get_unchecked(b) };
            let yv = _mm256_loadu_si256(y.qs.as_ptr().cast());
            let minus8y = _mm256_sub_epi32(zero, _mm256_dpbusd_epi32(zero, eight, yv));
            let lanes = z.map(|z| _mm256_dpbusd_epi32(minus8y, z, yv));
            let isum = avx2::sum4_i32(lanes);
            let d = _mm_mul_ps(dx, avx2::h2f_splat(y.d));
            acc[t] = _mm_fmadd_ps(d, _mm_cvtepi32_ps(isum), acc[t]);
        }
    }
    acc.map(|v| avx2::lanes4(v))
}

/// Four Q4_0 rows against the tokens `a` (a small batch): [`rows_q4_0_tokens`] four, two, then
/// one token at a time; `put(t, sums)` gets token t's four sums.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn rows_q4_0_batch(w: [&[u8]; 4], a: &[&[u8]], mut put: impl FnMut(usize, [f32; 4])) {
    let mut t = 0;
    while t + 4 <= a.len() {
        let v = rows_q4_0_tokens::<4>(w, std::array::from_fn(|j| a[t + j]));
        v.into_iter().enumerate().for_each(|(j, v)| put(t + j, v));
        t += 4;
    }
    if t + 2 <= a.len() {
        let v = rows_q4_0_tokens::<2>(w, [a[t], a[t + 1]]);
        v.into_iter().enumerate().for_each(|(j, v)| put(t + j, v));
        t += 2;
    }
    if t < a.len() {
        put(t, rows_q4_0_tokens::<1>(w, [a[t]])[0]);
    }
}

/// Four Q8_0 rows against one Q8_0 row, bit-identical per row with the single-row kernel
/// (`dot_ss8`'s lanes, one FMA per block in block order, the same horizontal sum). The four
/// rows' scales go to f32 in one `vcvtph2ps` ([`avx2::h2f4`]), the activation block's by one
/// broadcast and conversion ([`avx2::h2f_splat`]). Both came from a 256 KiB table of every f16
/// once, whose lines real scales miss: the 1B shape's Q8_0 weights from its file, in model
/// order (1 EPYC thread, out of cache, three alternated runs, GB/s): ffn_down 25.2-27.7 with
/// the table for the weights' scales, 28.4-31.2 with `h2f4`; ffn_gate 27.8-31.0 / 30.7-33.5.
/// The activations' by `h2f` (a move to a vector register, a conversion, a broadcast) rather
/// than the table made 1B Q8_0 tg64 slower (0.75-0.79 of the memory's rate against 0.87-0.97,
/// one thread); by `h2f_splat`, 0.89-0.93 against 0.87-0.91.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn rows_q8_0(w: [&[u8]; 4], a: &[u8]) -> [f32; 4] {
    avx2::rows_q8_0_with(w, a, rows_prefetch(), |x, y| dot_ss8(x, y))
}

// ---------------------------------------------------------------------------------------------
// K-quants: the exact integer sums of `kquants`, 64 elements per 512-bit register. Quarter u of a
// super-block (elements 64u..64u + 64, groups 4u..4u + 4, one 16-element group per 128-bit lane)
// becomes unsigned quant bytes; `maddubs` with the activations gives 32 exact i16 pair sums and
// VNNI `dpwssd` multiplies them by the groups' i16 scales and adds into 16 i32 lanes. The lanes
// are summed to `isum` (and `imin`) per super-block, then the float step of `kquants` follows.

/// `vpermw` indices spreading 16 group scales (i16) to quarter u's lanes: word w takes group
/// `4u + w / 8`.
static QUARTER_IDX: [[u16; 32]; 4] = {
    let mut m = [[0u16; 32]; 4];
    let mut u = 0;
    while u < 4 {
        let mut w = 0;
        while w < 32 {
            m[u][w] = (4 * u + w / 8) as u16;
            w += 1;
        }
        u += 1;
    }
    m
};

/// The i16 scales of quarter u, from the 16 group scales in the low 256 bits of `groups`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn quarter_scales(groups: __m512i, u: usize) -> __m512i {
    let idx = _mm512_loadu_si512(QUARTER_IDX[u].as_ptr().cast());
    _mm512_permutexvar_epi16(idx, groups)
}

/// `vpshufb` indices spreading 16 unsigned group scales (bytes, the same 16 in every 128-bit
/// lane) to quarter u's i16 lanes: byte pair w of lane l takes group `4u + l`, zero-extended.
static QUARTER_SHUF: [[i8; 64]; 4] = {
    let mut m = [[0i8; 64]; 4];
    let mut u = 0;
    while u < 4 {
        let mut b = 0;
        while b < 64 {
            m[u][b] = if b % 2 == 0 {
                (4 * u + b / 16) as i8
            } else {
                -128
            };
            b += 1;
        }
        u += 1;
    }
    m
};

/// [`quarter_scales`] for unsigned scales given as bytes broadcast to every 128-bit lane: one
/// in-lane byte shuffle instead of a word permutation.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn quarter_scales_u8(bytes: __m512i, u: usize) -> __m512i {
    _mm512_shuffle_epi8(bytes, _mm512_loadu_si512(QUARTER_SHUF[u].as_ptr().cast()))
}

/// 16 group scales (i16) widened to a 512-bit register (upper half zero).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn groups512(groups: __m256i) -> __m512i {
    _mm512_zextsi256_si512(groups)
}

/// Sixteen i32 lanes folded to eight (exact).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn fold(acc: __m512i) -> __m256i {
    _mm256_add_epi32(
        _mm512_castsi512_si256(acc),
        _mm512_extracti64x4_epi64::<1>(acc),
    )
}

/// 32 bytes in both 256-bit halves.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn broadcast32(q: &[u8; 32]) -> __m512i {
    _mm512_broadcast_i64x4(_mm256_loadu_si256(q.as_ptr().cast()))
}

/// The activations of quarter u.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn y_quarter(y: &BlockQ8K, u: usize) -> __m512i {
    _mm512_loadu_si512(y.qs.as_chunks::<64>().0[u].as_ptr().cast())
}

/// `lo` in the 16-bit words of the low 256 bits, `hi` in the high ones.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn split_epi16(lo: i16, hi: i16) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_set1_epi16(lo), _mm256_set1_epi16(hi))
}

/// `lo` in the bytes of the low 256 bits, `hi` in the high ones.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn split_epi8(lo: u8, hi: u8) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_set1_epi8(lo as i8), _mm256_set1_epi8(hi as i8))
}

/// One Q2_K super-block unpacked: quarter u's quants (0..4) and scales, the sixteen mins as
/// i16, and `[d, dmin]`.
#[derive(Clone, Copy)]
struct Q2Block {
    z: [__m512i; 4],
    scales: [__m512i; 4],
    mins: __m256i,
    d: __m128,
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q2_unpack(x: &BlockQ2K) -> Q2Block {
    let (m2, m4) = (_mm512_set1_epi8(3), _mm_set1_epi8(0x0F));
    let raw = _mm_loadu_si128(x.scales.as_ptr().cast());
    let groups = groups512(_mm256_cvtepu8_epi16(_mm_and_si128(raw, m4)));
    let mut z = [_mm512_setzero_si512(); 4];
    for (h, q) in x.qs.as_chunks::<32>().0.iter().enumerate() {
        let q = broadcast32(q);
        for s in 0..2 {
            // quarter 2h + s: 2-bit planes 2s (low half) and 2s + 1 (high half) of qs[32h..]
            let shifts = split_epi16(4 * s as i16, 4 * s as i16 + 2);
            z[2 * h + s] = _mm512_and_si512(_mm512_srlv_epi16(q, shifts), m2);
        }
    }
    Q2Block {
        z,
        scales: std::array::from_fn(|u| quarter_scales(groups, u)),
        mins: _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16::<4>(raw), m4)),
        d: avx2::f16_pair(x.d, x.dmin),
    }
}

/// `isum` and `imin` of one unpacked Q2_K super-block against `y`, each in eight i32 lanes
/// (exact).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q2_sums(x: &Q2Block, y: &BlockQ8K) -> (__m256i, __m256i) {
    let mut acc = _mm512_setzero_si512();
    for u in 0..4 {
        let prod = _mm512_maddubs_epi16(x.z[u], y_quarter(y, u));
        acc = _mm512_dpwssd_epi32(acc, prod, x.scales[u]);
    }
    (fold(acc), _mm256_madd_epi16(x.mins, avx2::load_bsums(y)))
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn vec_dot_q2_k_q8_k(xs: &[BlockQ2K], ys: &[BlockQ8K]) -> f32 {
    let mut sumf = 0.0f32;
    for (x, y) in xs.iter().zip(ys) {
        let u = q2_unpack(x);
        let (isum, imin) = q2_sums(&u, y);
        let sums = avx2::hsum_i32_pair(isum, imin);
        sumf = avx2::finish_with_mins(sumf, y.d.get(), u.d, sums);
    }
    sumf
}

/// A Q2_K super-block's 256 quants (0..4) as unsigned bytes in element order (four quarters).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn q2_quants(x: &BlockQ2K) -> [__m512i; 4] {
    q2_unpack(x).z
}

/// Four Q2_K rows against one Q8_K row, bit-identical per row with [`vec_dot_q2_k_q8_k`], as
/// `rows_k4`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn rows_q2_k(w: [&[u8]; 4], a: &[u8]) -> [f32; 4] {
    rows_k::<_, _, true>(w, a, |x| q2_unpack(x), |u, y| q2_sums(u, y), |u| u.d)
}

/// Four K-quant rows against one Q8_K row: per super-block each row's `unpack`ed block, its exact
/// `isum` and (`MINS`: Q2_K, Q4_K, Q5_K) `imin` lanes (`sums`; the four rows' summed together)
/// and its `[d, dmin]` (`d`), then the canonical float step lane by lane, one chain per row in
/// the lanes of one register.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn rows_k<B: Block, U, const MINS: bool>(
    w: [&[u8]; 4],
    a: &[u8],
    unpack: impl Fn(&B) -> U,
    sums: impl Fn(&U, &BlockQ8K) -> (__m256i, __m256i),
    d: impl Fn(&U) -> __m128,
) -> [f32; 4] {
    let xs: [&[B]; 4] = w.map(super::blocks::<B>);
    let ys: &[BlockQ8K] = super::blocks(a);
    let nb = super::common_blocks(&xs, &[ys]);
    let mut sumf = _mm_setzero_ps();
    for (b, y) in ys[..nb].iter().enumerate() {
        // SAFETY: b < nb <= every row's length.
        let x: [&B; 4] = std::array::from_fn(|r| unsafe { xs[r].get_unchecked(b) });
        // One row at a time (four unpacked blocks would not fit the registers; an array of
        // per-row tuples built by `from_fn` compiled to code a third slower).
        let (mut lanes, mut mins, mut dx) = (
            [_mm256_setzero_si256(); 4],
            [_mm256_setzero_si256(); 4],
            [_mm_setzero_ps(); 4],
        );
        for r in 0..4 {
            let u = unpack(x[r]);
            (lanes[r], mins[r]) = sums(&u, y);
            dx[r] = d(&u);
        }
        let (d_x, dmin_x) = d_dmin4(dx);
        let d_y = _mm_set1_ps(y.d.get());
        let isum = _mm_cvtepi32_ps(avx2::sum4_i32(lanes));
        sumf = _mm_fmadd_ps(_mm_mul_ps(d_y, d_x), isum, sumf);
        if MINS {
            let imin = _mm_cvtepi32_ps(avx2::sum4_i32(mins));
            sumf = _mm_fnmadd_ps(_mm_mul_ps(d_y, dmin_x), imin, sumf);
        }
    }
    avx2::lanes4(sumf)
}

/// One Q3_K super-block unpacked ([`OffsetBlock`], quants `q + 4`, 0..8).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q3_unpack(x: &BlockQ3K) -> OffsetBlock {
    let (m2, four) = (_mm512_set1_epi8(3), _mm512_set1_epi8(4));
    let groups = _mm256_cvtepi8_epi16(q3_scales(&x.scales));
    let g512 = groups512(groups);
    let hmask = broadcast32(&x.hmask);
    let mut z = [_mm512_setzero_si512(); 4];
    for (h, q) in x.qs.as_chunks::<32>().0.iter().enumerate() {
        let q = broadcast32(q);
        for s in 0..2 {
            // quarter u = 2h + s holds 32-element groups 2u and 2u + 1: q + 4 = the 2-bit
            // plane, plus 4 where the group's bit of hmask is set
            let u = 2 * h + s;
            let shifts = split_epi16(4 * s as i16, 4 * s as i16 + 2);
            let low = _mm512_and_si512(_mm512_srlv_epi16(q, shifts), m2);
            let set = _mm512_test_epi8_mask(hmask, split_epi8(1 << (2 * u), 1 << (2 * u + 1)));
            z[u] = _mm512_mask_add_epi8(low, set, low, four);
        }
    }
    OffsetBlock {
        z,
        scales: std::array::from_fn(|u| quarter_scales(g512, u)),
        groups,
        d: x.d.to_f32(),
    }
}

/// Q3_K's sixteen 6-bit scales re-centred to -32..32 as i8 (`kquants::q3_scales`, four 32-bit
/// words at once): word i's low four bits from the low (i < 2) or high nibbles of the first two
/// words, its top two from bits `2i..2i + 2` of each byte of the third.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q3_scales(raw: &[u8; 12]) -> __m128i {
    let w = |i: usize| i32::from_le_bytes(raw[4 * i..4 * i + 4].try_into().unwrap());
    let (w0, w1, hi) = (w(0), w(1), w(2));
    let lo = _mm_srlv_epi32(_mm_setr_epi32(w0, w1, w0, w1), _mm_setr_epi32(0, 0, 4, 4));
    let top = _mm_srlv_epi32(_mm_set1_epi32(hi), _mm_setr_epi32(0, 2, 4, 6));
    let words = _mm_or_si128(
        _mm_and_si128(lo, _mm_set1_epi8(0x0F)),
        _mm_slli_epi32::<4>(_mm_and_si128(top, _mm_set1_epi8(3))),
    );
    _mm_sub_epi8(words, _mm_set1_epi8(32))
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn vec_dot_q3_k_q8_k(xs: &[BlockQ3K], ys: &[BlockQ8K]) -> f32 {
    let mut sumf = 0.0f32;
    for (x, y) in xs.iter().zip(ys) {
        sumf = offset_step::<2>(sumf, &q3_unpack(x), y);
    }
    sumf
}

/// A Q3_K super-block's 256 quants as unsigned bytes `q + 4` in element order (four quarters).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn q3_quants(x: &BlockQ3K) -> [__m512i; 4] {
    q3_unpack(x).z
}

/// Four Q3_K rows against one Q8_K row, bit-identical per row with [`vec_dot_q3_k_q8_k`], as
/// [`rows_q6_k`].
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn rows_q3_k(w: [&[u8]; 4], a: &[u8]) -> [f32; 4] {
    let sums = |u: &OffsetBlock, y: &BlockQ8K| (offset_isum::<2>(u, y), _mm256_setzero_si256());
    rows_k::<_, _, false>(w, a, |x| q3_unpack(x), sums, |u| _mm_set_ss(u.d))
}

/// One Q4_K / Q5_K super-block unpacked: quarter c's quants (sub-blocks 2c, the low nibbles of
/// `qs[32c..]`, and 2c + 1, the high ones, plus 16 where bit 2c / 2c + 1 of `qh` is set) and
/// scales, the eight mins as i16 (each twice, one per 16-element group), and `[d, dmin]`.
#[derive(Clone, Copy)]
struct K4Block {
    z: [__m512i; 4],
    scales: [__m512i; 4],
    mins: __m256i,
    d: __m128,
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn k4_unpack(head: &[u8; 16], qs: &[u8; QK_K / 2], qh: Option<&[u8; QK_K / 8]>) -> K4Block {
    let (sm, d) = avx2::k4_head(head);
    let groups = _mm512_broadcast_i32x4(_mm_unpacklo_epi8(sm, sm));
    let mins = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(sm, sm));
    let m4 = _mm512_set1_epi8(0x0F);
    let sixteen = _mm512_set1_epi8(16);
    let nibble_shifts = split_epi16(0, 4);
    let qh = qh.map(|qh| broadcast32(qh));
    let quarters = qs.as_chunks::<32>().0;
    let z = std::array::from_fn(|c| {
        let mut z = _mm512_and_si512(
            _mm512_srlv_epi16(broadcast32(&quarters[c]), nibble_shifts),
            m4,
        );
        if let Some(qh) = qh {
            let set = _mm512_test_epi8_mask(qh, split_epi8(1 << (2 * c), 1 << (2 * c + 1)));
            z = _mm512_mask_add_epi8(z, set, z, sixteen);
        }
        z
    });
    K4Block {
        z,
        scales: std::array::from_fn(|c| quarter_scales_u8(groups, c)),
        mins,
        d,
    }
}

/// `isum` of one unpacked Q4_K / Q5_K super-block against `y` in eight i32 lanes (exact).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn k4_isum(x: &K4Block, y: &BlockQ8K) -> __m256i {
    let mut acc = _mm512_setzero_si512();
    for c in 0..4 {
        let prod = _mm512_maddubs_epi16(x.z[c], y_quarter(y, c));
        acc = _mm512_dpwssd_epi32(acc, prod, x.scales[c]);
    }
    fold(acc)
}

/// `imin` of one unpacked Q4_K / Q5_K super-block against `y` in eight i32 lanes (exact).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn k4_imin(x: &K4Block, y: &BlockQ8K) -> __m256i {
    _mm256_madd_epi16(x.mins, avx2::load_bsums(y))
}

/// `kquants`' step of one unpacked Q4_K / Q5_K super-block against activations `y`: `isum` and
/// `imin` exactly in i32, then the float part onto `sumf`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn k4_step(sumf: f32, x: &K4Block, y: &BlockQ8K) -> f32 {
    let sums = avx2::hsum_i32_pair(k4_isum(x, y), k4_imin(x, y));
    avx2::finish_with_mins(sumf, y.d.get(), x.d, sums)
}

/// The four activation rows' super-block scales `d`, lane by lane.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn d_y4(ys: [&BlockQ8K; 4]) -> __m128 {
    _mm_setr_ps(ys[0].d.get(), ys[1].d.get(), ys[2].d.get(), ys[3].d.get())
}

/// [`k4_step`] for four tokens at once, their `sumf` in the lanes of `sumf`: the same exact
/// integers (summed in another order) and, lane by lane, the same float operations.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn k4_step4(sumf: __m128, x: &K4Block, ys: [&BlockQ8K; 4]) -> __m128 {
    let isum = avx2::sum4_i32(std::array::from_fn(|t| k4_isum(x, ys[t])));
    let imin = avx2::sum4_i32(std::array::from_fn(|t| k4_imin(x, ys[t])));
    let (fi, fm) = (_mm_cvtepi32_ps(isum), _mm_cvtepi32_ps(imin));
    let d_y = d_y4(ys);
    let d_x = _mm_shuffle_ps::<0b00_00_00_00>(x.d, x.d);
    let dmin_x = _mm_shuffle_ps::<0b01_01_01_01>(x.d, x.d);
    let acc = _mm_fmadd_ps(_mm_mul_ps(d_y, d_x), fi, sumf);
    _mm_fnmadd_ps(_mm_mul_ps(d_y, dmin_x), fm, acc)
}

/// A Q4_K / Q5_K block's parts for [`k4_unpack`].
pub(crate) trait K4Parts: Block {
    fn parts(&self) -> (&[u8; QK_K / 2], Option<&[u8; QK_K / 8]>);
}

impl K4Parts for BlockQ4K {
    fn parts(&self) -> (&[u8; QK_K / 2], Option<&[u8; QK_K / 8]>) {
        (&self.qs, None)
    }
}

impl K4Parts for BlockQ5K {
    fn parts(&self) -> (&[u8; QK_K / 2], Option<&[u8; QK_K / 8]>) {
        (&self.qs, Some(&self.qh))
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn k4_dot<B: K4Parts>(xs: &[B], ys: &[BlockQ8K]) -> f32 {
    let mut sumf = 0.0f32;
    for (x, y) in xs.iter().zip(ys) {
        sumf = k4_step(sumf, &k4_unpack_block(x), y);
    }
    sumf
}

/// `R` K-quant weight rows (blocks `B`) against `T` Q8_K activation rows (bytes): each
/// super-block of a row is unpacked once (`unpack`) for the `T` tokens, which go through `step4`
/// in fours (their sums in one register's lanes) and `step` one by one for the rest. `step` is
/// the single-row kernel's step and `step4` does its arithmetic lane by lane, so every output is
/// the single-row kernel's, bit for bit.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn k_tile<B: Block, U, const R: usize, const T: usize>(
    w: [&[u8]; R],
    a: [&[u8]; T],
    unpack: impl Fn(&B) -> U,
    step: impl Fn(f32, &U, &BlockQ8K) -> f32,
    step4: impl Fn(__m128, &U, [&BlockQ8K; 4]) -> __m128,
) -> [[f32; T]; R] {
    let xs: [&[B]; R] = w.map(blocks_prefix::<B>);
    let ys: [&[BlockQ8K]; T] = a.map(blocks_prefix::<BlockQ8K>);
    let nb = super::common_blocks(&xs, &ys);
    let mut out = [[0f32; T]; R];
    let quads = T / 4;
    let mut acc4 = [[_mm_setzero_ps(); 4]; R];
    for b in 0..nb {
        for (i, x) in xs.iter().enumerate() {
            let u = unpack(&x[b]);
            for (q, acc) in acc4[i].iter_mut().enumerate().take(quads) {
                *acc = step4(*acc, &u, std::array::from_fn(|j| &ys[4 * q + j][b]));
            }
            for (t, y) in ys.iter().enumerate().skip(4 * quads) {
                out[i][t] = step(out[i][t], &u, &y[b]);
            }
        }
    }
    for (o, acc) in out.iter_mut().zip(&acc4) {
        for (q, a) in acc.iter().enumerate().take(quads) {
            _mm_storeu_ps(o[4 * q..4 * q + 4].as_mut_ptr(), *a);
        }
    }
    out
}

/// Four rows' `[d, dmin, ..]` pairs as `([d_0..d_3], [dmin_0..dmin_3])`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn d_dmin4(d: [__m128; 4]) -> (__m128, __m128) {
    let lo = _mm_unpacklo_ps(d[0], d[1]); // [d0 d1 dmin0 dmin1]
    let hi = _mm_unpacklo_ps(d[2], d[3]); // [d2 d3 dmin2 dmin3]
    (_mm_movelh_ps(lo, hi), _mm_movehl_ps(hi, lo))
}

/// Four Q4_K / Q5_K rows against one Q8_K row, bit-identical per row with [`k4_dot`]: per
/// super-block the same exact `isum` and `imin` (the four rows' lanes summed together), then
/// [`k4_step`]'s float step lane by lane, one chain per row in the lanes of one register. No
/// software prefetch: on the EPYC, 1B Q4_K_M tg32 at one thread, 512 / 1024 / 2048 / 4096 bytes
/// ahead gave 12.8 / 10.7 / 12.2 / 13.2 t/s against 18.2 without (and 18.4 for single rows).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn rows_k4<B: K4Parts>(w: [&[u8]; 4], a: &[u8]) -> [f32; 4] {
    let sums = |u: &K4Block, y: &BlockQ8K| (k4_isum(u, y), k4_imin(u, y));
    rows_k::<_, _, true>(w, a, |x: &B| k4_unpack_block(x), sums, |u| u.d)
}

/// A Q4_K / Q5_K super-block unpacked.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn k4_unpack_block<B: K4Parts>(x: &B) -> K4Block {
    let (qs, qh) = x.parts();
    k4_unpack(avx2::k4_head_bytes(x), qs, qh)
}

/// [`k_tile`] for Q4_K / Q5_K.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn k4_tile<B: K4Parts, const R: usize, const T: usize>(
    w: [&[u8]; R],
    a: [&[u8]; T],
) -> [[f32; T]; R] {
    k_tile(
        w,
        a,
        |x: &B| k4_unpack_block(x),
        |s, u, y| k4_step(s, u, y),
        |s, u, ys| k4_step4(s, u, ys),
    )
}

/// [`k4_tile`] for Q4_K.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn q4_k_tile<const R: usize, const T: usize>(
    w: [&[u8]; R],
    a: [&[u8]; T],
) -> [[f32; T]; R] {
    k4_tile::<BlockQ4K, R, T>(w, a)
}

/// [`k4_tile`] for Q5_K.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn q5_k_tile<const R: usize, const T: usize>(
    w: [&[u8]; R],
    a: [&[u8]; T],
) -> [[f32; T]; R] {
    k4_tile::<BlockQ5K, R, T>(w, a)
}

/// A Q4_K / Q5_K super-block's 256 quants as unsigned bytes in element order (four quarters).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn k4_quants<B: K4Parts>(x: &B) -> [__m512i; 4] {
    k4_unpack_block(x).z
}

/// A Q6_K super-block's 256 quants as unsigned bytes `q + 32` in element order (four quarters).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn q6_quants(x: &BlockQ6K) -> [__m512i; 4] {
    q6_unpack(x).z
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn vec_dot_q4_k_q8_k(xs: &[BlockQ4K], ys: &[BlockQ8K]) -> f32 {
    k4_dot(xs, ys)
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn vec_dot_q5_k_q8_k(xs: &[BlockQ5K], ys: &[BlockQ8K]) -> f32 {
    k4_dot(xs, ys)
}

/// One Q6_K or Q3_K super-block unpacked, its quants entering offset by `2^S` (Q6_K: `q + 32`,
/// 0..64; Q3_K: `q + 4`, 0..8): quarter u's quants as unsigned bytes and scales, the sixteen
/// group scales as i16, and `d`.
#[derive(Clone, Copy)]
struct OffsetBlock {
    z: [__m512i; 4],
    scales: [__m512i; 4],
    groups: __m256i,
    d: f32,
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q6_unpack(x: &BlockQ6K) -> OffsetBlock {
    let (m4, m30) = (_mm512_set1_epi8(0x0F), _mm512_set1_epi8(0x30));
    // qh bits 2k..2k + 2 to bits 4..6: left 4 / 2 for k = 0 / 1, right 0 / 2 for k = 2 / 3
    // (16-bit shifts: the 0x30 mask drops what crosses from the neighbouring byte)
    let (shl, shr) = (split_epi16(4, 2), split_epi16(0, 2));
    let groups = _mm256_cvtepi8_epi16(_mm_loadu_si128(x.scales.as_ptr().cast()));
    let g512 = groups512(groups);
    let mut z = [_mm512_setzero_si512(); 4];
    for h in 0..2 {
        // quarter 2h: low nibbles of ql[64h..][..64] (k = 0 | 1); 2h + 1: the high (k = 2 | 3)
        let ql = _mm512_loadu_si512(x.ql.as_chunks::<64>().0[h].as_ptr().cast());
        let qh = broadcast32(&x.qh.as_chunks::<32>().0[h]);
        z[2 * h] = _mm512_or_si512(
            _mm512_and_si512(ql, m4),
            _mm512_and_si512(_mm512_sllv_epi16(qh, shl), m30),
        );
        z[2 * h + 1] = _mm512_or_si512(
            _mm512_and_si512(_mm512_srli_epi16::<4>(ql), m4),
            _mm512_and_si512(_mm512_srlv_epi16(qh, shr), m30),
        );
    }
    OffsetBlock {
        z,
        scales: std::array::from_fn(|u| quarter_scales(g512, u)),
        groups,
        d: x.d.to_f32(),
    }
}

/// `isum` of one unpacked Q6_K (`S` = 5) or Q3_K (`S` = 2) super-block against `y` in eight
/// i32 lanes (exact): `Σ sc·(q + 2^S)·y − 2^S Σ_g sc_g·bsum_g`. The pair sums `(q + 2^S)·y`
/// stay within i16 (|·| ≤ 2·63·128).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn offset_isum<const S: i32>(x: &OffsetBlock, y: &BlockQ8K) -> __m256i {
    let mut acc = _mm512_setzero_si512();
    for u in 0..4 {
        let prod = _mm512_maddubs_epi16(x.z[u], y_quarter(y, u));
        acc = _mm512_dpwssd_epi32(acc, prod, x.scales[u]);
    }
    let off = _mm256_madd_epi16(x.groups, avx2::load_bsums(y));
    _mm256_sub_epi32(fold(acc), _mm256_slli_epi32::<S>(off))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn offset_step<const S: i32>(sumf: f32, x: &OffsetBlock, y: &BlockQ8K) -> f32 {
    let sums = avx2::hsum_i32_pair(offset_isum::<S>(x, y), _mm256_setzero_si256());
    avx2::finish(sumf, y.d.get(), x.d, sums)
}

/// [`offset_step`] for four Q6_K tokens, their `sumf` in the lanes of `sumf`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q6_step4(sumf: __m128, x: &OffsetBlock, ys: [&BlockQ8K; 4]) -> __m128 {
    let isum = avx2::sum4_i32(std::array::from_fn(|t| offset_isum::<5>(x, ys[t])));
    let d_y = d_y4(ys);
    _mm_fmadd_ps(
        _mm_mul_ps(d_y, _mm_set1_ps(x.d)),
        _mm_cvtepi32_ps(isum),
        sumf,
    )
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn vec_dot_q6_k_q8_k(xs: &[BlockQ6K], ys: &[BlockQ8K]) -> f32 {
    let mut sumf = 0.0f32;
    for (x, y) in xs.iter().zip(ys) {
        sumf = offset_step::<5>(sumf, &q6_unpack(x), y);
    }
    sumf
}

/// Four Q6_K rows against one Q8_K row, bit-identical per row with [`vec_dot_q6_k_q8_k`]: the
/// same exact `isum` per super-block, [`offset_step`]'s float step lane by lane.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn rows_q6_k(w: [&[u8]; 4], a: &[u8]) -> [f32; 4] {
    let sums = |u: &OffsetBlock, y: &BlockQ8K| (offset_isum::<5>(u, y), _mm256_setzero_si256());
    rows_k::<_, _, false>(w, a, |x| q6_unpack(x), sums, |u| _mm_set_ss(u.d))
}

/// [`k_tile`] for Q6_K.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn q6_k_tile<const R: usize, const T: usize>(
    w: [&[u8]; R],
    a: [&[u8]; T],
) -> [[f32; T]; R] {
    k_tile(
        w,
        a,
        |x: &BlockQ6K| q6_unpack(x),
        |s, u, y| offset_step::<5>(s, u, y),
        |s, u, ys| q6_step4(s, u, ys),
    )
}

// ---------------------------------------------------------------------------------------------
// Elementwise functions.

/// [`super::ops::expf`] on eight lanes: the same f64 operations, lane by lane; lanes outside its main
/// path (|x| >= 88, infinities, NaN) go through the scalar function.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn expf8(x: __m256) -> __m256 {
    let top = _mm256_and_si256(
        _mm256_srli_epi32::<20>(_mm256_castps_si256(x)),
        _mm256_set1_epi32(0x7ff),
    );
    let special =
        _mm256_cmpge_epu32_mask(top, _mm256_set1_epi32(super::ops::EXPF_SPECIAL_TOP as i32));
    let xd = _mm512_cvtps_pd(x);
    let inv_ln2_n = _mm512_set1_pd(super::ops::EXPF_INV_LN2_N);
    let shift = _mm512_set1_pd(super::ops::EXPF_SHIFT);
    let kd = _mm512_fmadd_pd(inv_ln2_n, xd, shift);
    let ki = _mm512_castpd_si512(kd);
    let kd = _mm512_sub_pd(kd, shift);
    let r = _mm512_fmsub_pd(inv_ln2_n, xd, kd);
    // The table entry ki % 32: entries 0..16 from the first pair of registers, 16..32 the second.
    let tab = |i: usize| _mm512_loadu_si512(super::ops::EXP2F_TAB[8 * i..].as_ptr().cast());
    let lo = _mm512_permutex2var_epi64(tab(0), ki, tab(1));
    let hi = _mm512_permutex2var_epi64(tab(2), ki, tab(3));
    let upper = _mm512_test_epi64_mask(ki, _mm512_set1_epi64(16));
    let t = _mm512_mask_blend_epi64(upper, lo, hi);
    let s = _mm512_castsi512_pd(_mm512_add_epi64(t, _mm512_slli_epi64::<47>(ki)));
    let c = |i: usize| _mm512_set1_pd(super::ops::EXPF_C[i]);
    let z = _mm512_fmadd_pd(r, c(0), c(1));
    let r2 = _mm512_mul_pd(r, r);
    let y = _mm512_fmadd_pd(r, c(2), _mm512_set1_pd(1.0));
    let y = _mm512_mul_pd(_mm512_fmadd_pd(z, r2, y), s);
    let out = _mm512_cvtpd_ps(y);
    if special == 0 {
        return out;
    }
    super::avx2::expf_special_lanes(x, out, special as u32)
}

/// [`super::ops::swiglu_inplace`] eight elements at a time: `g / (1 + expf(-g)) * u`, the same
/// f32 operations lane by lane.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn swiglu_inplace(gate: &mut [f32], up: &[f32]) {
    super::avx2::swiglu_with(gate, up, |x| expf8(x))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The four-row decode kernels give each row exactly the scalar dot product (which every
    /// single-row variant equals), at several lengths and on rows that differ.
    #[test]
    fn rows_equal_scalar_dots() {
        use crate::kernels::cpu::{Isa, dot_fn};
        use crate::quant::{GgmlType, quantize_row};
        let kinds = [
            GgmlType::Q4_0,
            GgmlType::Q8_0,
            GgmlType::Q2_K,
            GgmlType::Q3_K,
            GgmlType::Q4_K,
            GgmlType::Q5_K,
            GgmlType::Q6_K,
        ];
        // AVX-512's kernels and AVX2's (those it has), each where the CPU runs it.
        let variants = kinds.iter().flat_map(|&wty| {
            let avx512 = Isa::Avx512.supported().then(|| rows_fn(wty)).flatten();
            let avx2 = Isa::Avx2
                .supported()
                .then(|| super::super::avx2::rows_fn(wty));
            [avx512, avx2.flatten()]
                .into_iter()
                .flatten()
                .map(move |f| (wty, f))
        });
        for (wty, f) in variants {
            let block = wty.block_size();
            for n in [32usize, 64, 576, 2048, 32 * 37, 256 * 3, 256 * 9]
                .into_iter()
                .filter(|n| n % block == 0)
            {
                let pattern = |off: f32| -> Vec<f32> {
                    (0..n)
                        .map(|i| 0.1 + 2.0 * (i as f32 * 0.7 + off).cos())
                        .collect()
                };
                let mut rng = crate::rng::SplitMix64::new(n as u64);
                let rows: Vec<Vec<u8>> = (0..4)
                    .map(|r| {
                        if block == 256 {
                            // No K-quant quantiser: random blocks with sane scales.
                            return super::super::random_rows(wty, n, 1, &mut rng);
                        }
                        let mut w = vec![0u8; wty.row_bytes(n).unwrap()];
                        quantize_row(wty, &pattern(r as f32 * 1.3), &mut w).unwrap();
                        w
                    })
                    .collect();
                let aty = wty.vec_dot_type();
                let mut a = vec![0u8; aty.row_bytes(n).unwrap()];
                quantize_row(aty, &pattern(2.1), &mut a).unwrap();
                // SAFETY: each variant's ISA checked above; dot_fn checks support.
                let got = unsafe { f(std::array::from_fn(|r| rows[r].as_slice()), &a) };
                for (r, w) in rows.iter().enumerate() {
                    let want = unsafe { dot_fn(Isa::Scalar, wty)(w, &a, n) };
                    assert!(want != 0.0);
                    assert_eq!(got[r].to_bits(), want.to_bits(), "{wty} n={n} row {r}");
                }
            }
        }
    }

    /// Q3_K's scales four words at a time equal `kquants`' for every value of each byte.
    #[test]
    fn q3_scales_equal_kquants() {
        if !crate::kernels::cpu::Isa::Avx512.supported() {
            return;
        }
        let mut rng = crate::rng::SplitMix64::new(5);
        for i in 0..4096u32 {
            let mut raw = [0u8; 12];
            rng.fill_bytes(&mut raw);
            raw[(i % 12) as usize] = (i / 12) as u8;
            let mut got = [0i8; 16];
            // SAFETY: AVX-512 checked above; `got` holds sixteen bytes.
            unsafe { _mm_storeu_si128(got.as_mut_ptr().cast(), q3_scales(&raw)) };
            assert_eq!(
                got,
                crate::kernels::cpu::kquants::q3_scales(&raw),
                "{raw:?}"
            );
        }
    }

    /// Eight lanes at a time (AVX-512's and AVX2's) equal the scalar `expf` (which equals
    /// glibc's) bit for bit, over every 61st f32 bit pattern: both signs, the special ranges, NaN.
    #[test]
    fn expf8_equals_expf() {
        use crate::kernels::cpu::Isa;
        type Exp = unsafe fn(__m256) -> __m256;
        let variants: [(Isa, Exp); 2] = [
            (Isa::Avx512, |x| unsafe { expf8(x) }),
            (Isa::Avx2, |x| unsafe { super::super::avx2::expf8(x) }),
        ];
        let xs: Vec<f32> = (0..=u32::MAX).step_by(61).map(f32::from_bits).collect();
        for (isa, exp) in variants.into_iter().filter(|(isa, _)| isa.supported()) {
            for c in xs.chunks_exact(8) {
                let mut got = [0f32; 8];
                // SAFETY: the CPU has the variant's ISA (filtered above).
                unsafe { _mm256_storeu_ps(got.as_mut_ptr(), exp(_mm256_loadu_ps(c.as_ptr()))) };
                for (&x, g) in c.iter().zip(got) {
                    let want = super::super::ops::expf(x);
                    assert_eq!(g.to_bits(), want.to_bits(), "{isa:?}: expf({x:e}) = {g:e}");
                }
            }
        }
    }

    /// The vector SwiGLU equals the scalar one bit for bit, tail included, on large, small,
    /// negative and special gate values.
    #[test]
    fn swiglu_equals_scalar() {
        use crate::kernels::cpu::Isa;
        type Swiglu = unsafe fn(&mut [f32], &[f32]);
        let variants: [(Isa, Swiglu); 2] = [
            (Isa::Avx512, |g, u| unsafe { swiglu_inplace(g, u) }),
            (Isa::Avx2, |g, u| unsafe {
                super::super::avx2::swiglu_inplace(g, u)
            }),
        ];
        let mut gate: Vec<f32> = (0..1000)
            .map(|i| 30.0 * (i as f32 * 0.173).sin() * (i % 7) as f32)
            .collect();
        gate.extend([
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            -0.0,
            0.0,
            100.0,
            -100.0,
            -200.0,
            89.0,
            -89.0,
            1e-40,
        ]);
        let up: Vec<f32> = (0..gate.len())
            .map(|i| 0.5 + (i as f32 * 0.31).cos())
            .collect();
        let mut want = gate.clone();
        super::super::ops::swiglu_scalar(&mut want, &up);
        for (isa, swiglu) in variants.into_iter().filter(|(isa, _)| isa.supported()) {
            let mut got = gate.clone();
            // SAFETY: the CPU has the variant's ISA (filtered above).
            unsafe { swiglu(&mut got, &up) };
            for (i, (a, b)) in want.iter().zip(&got).enumerate() {
                assert_eq!(
                    a.to_bits(),
                    b.to_bits(),
                    "{isa:?}: element {i} (gate {}): {a} vs {b}",
                    gate[i]
                );
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Plain-float dots in `scalar::dot_wide`'s 4 x 8 lane order, 16 lanes per register: accumulator
// A holds lanes 0..8 of `dot_wide`'s acc[0] and acc[1] (elements i..i + 16), B acc[2] and acc[3];
// each lane sees the same FMAs in the same order, so the result is bit-identical.

macro_rules! wide_dot16 {
    ($dot:ident, $rows:ident, $load:ident, $elem:expr, $size:literal) => {
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
        pub unsafe fn $dot(w: &[u8], a: &[u8], n: usize) -> f32 {
            let n = n.min(w.len() / $size).min(a.len() / $size);
            let (mut acc_a, mut acc_b) = (_mm512_setzero_ps(), _mm512_setzero_ps());
            let full = n / 32 * 32;
            let mut i = 0;
            while i < full {
                acc_a = _mm512_fmadd_ps($load(w, i), $load(a, i), acc_a);
                acc_b = _mm512_fmadd_ps($load(w, i + 16), $load(a, i + 16), acc_b);
                i += 32;
            }
            let mut total = sum_wide16(acc_a, acc_b);
            let elem = $elem;
            for i in full..n {
                total = elem(w, i).mul_add(elem(a, i), total);
            }
            total
        }

        /// Four rows against one activation row (decode): each activation register loaded (and
        /// widened) once for the four, eight FMA chains in flight; per row the FMAs and sums of
        /// the one-row dot in its order, so the same bits (see [`sum_wide16`]).
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
        pub unsafe fn $rows(w: [&[u8]; 4], a: &[u8]) -> [f32; 4] {
            let n = super::common_blocks(&w, &[a]) / $size;
            let mut acc_a = [_mm512_setzero_ps(); 4];
            let mut acc_b = [_mm512_setzero_ps(); 4];
            let full = n / 32 * 32;
            let ahead = float_rows_ahead();
            let mut i = 0;
            while i < full {
                if ahead > 0 {
                    for r in 0..4 {
                        for line in (0..32 * $size).step_by(64) {
                            let at = w[r].as_ptr().wrapping_add($size * i + line + ahead);
                            _mm_prefetch::<_MM_HINT_NTA>(at.cast());
                        }
                    }
                }
                let (xa, xb) = ($load(a, i), $load(a, i + 16));
                for r in 0..4 {
                    acc_a[r] = _mm512_fmadd_ps($load(w[r], i), xa, acc_a[r]);
                    acc_b[r] = _mm512_fmadd_ps($load(w[r], i + 16), xb, acc_b[r]);
                }
                i += 32;
            }
            let elem = $elem;
            std::array::from_fn(|r| {
                let mut total = sum_wide16(acc_a[r], acc_b[r]);
                for i in full..n {
                    total = elem(w[r], i).mul_add(elem(a, i), total);
                }
                total
            })
        }
    };
}

/// Bytes ahead of each row that the plain floats' four-row kernels ask for with the
/// non-temporal hint (`OATO_CPU_FLOAT_PREFETCH` sets it, 0 none): on AMD 256, elsewhere none
/// (never measured off AMD). The hint keeps the rows' lines from pushing the activations out
/// of L1 (below): 1 EPYC thread, out of cache (`examples/matmul_dram`, six alternated pairs),
/// F16 8192 x 2048 read 0.85 (0.83-0.86) of the plain read with none and 0.915 (0.77-0.92)
/// with 256 bytes; 128 and 384 read between, 512 and more worse than none (1024: 0.70). At 2
/// threads alike (0.91-1.00 / 0.94-0.98). In the 1B F16 decode (`examples/decode_mix`, the
/// engine and the matrices against a plain read in the same rounds, 1 thread, six alternated
/// pairs): the engine 0.83-0.91 -> 0.89-0.94 of the plain read, ffn_down 0.78-0.85 ->
/// 0.835-0.90, the rows of 2048 0.94-0.97 -> 0.99-1.00 (in the two quietest pairs); at 2
/// threads alike (0.90-0.98 both).
fn float_rows_ahead() -> usize {
    static AHEAD: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *AHEAD.get_or_init(|| {
        let default = if super::matmul::intel() { 0 } else { 256 };
        super::matmul::env_bytes("OATO_CPU_FLOAT_PREFETCH", default)
    })
}

/// The plain-float dots' final sum of their two accumulators, in `dot_wide`'s order. The four-row
/// decode kernels ([`rows_fn`]) exist because one row at a time, a row of 8192 F16 (16 KiB) and
/// its activations (16 KiB) filled the 32 KiB L1 and the activations came again from L2 for
/// every row: 1 EPYC thread, out of cache (`examples/matmul_dram`, alternated), 8192 x 2048 read
/// 0.53-0.56 of the plain read one row at a time and 0.85-0.87 four (2 threads 0.88 / 0.97-1.02);
/// 2048 x 8192 0.94 / 0.99; 4096 x 4096 0.92 / 0.83-0.86 at 1 thread (its rows fit), alike at 2.
/// What is left at 8192 x 2048 is the activations again: between one quad's use of an
/// activation line and the next quad's, 64 KiB of weights pass through L1. With the
/// activations' reads folded into their first 4 KiB (a throwaway build, wrong sums), four rows
/// read 0.91-0.97 of the plain read against 0.81-0.90 (three alternated pairs). Tried, not
/// kept: eight rows at a time (eight streams) 0.72-0.77; 2048 or 4096 elements of four to eight
/// quads before the next elements (their accumulators kept, the same bits) 0.55-0.80, the
/// rows' streams then broken into page-sized pieces.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn sum_wide16(acc_a: __m512, acc_b: __m512) -> f32 {
    let half = |v: __m512, hi: bool| -> __m256 {
        if hi {
            _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)))
        } else {
            _mm512_castps512_ps256(v)
        }
    };
    let s = _mm256_add_ps(
        _mm256_add_ps(half(acc_a, false), half(acc_a, true)),
        _mm256_add_ps(half(acc_b, false), half(acc_b, true)),
    );
    avx2::hsum8(s)
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn load_f16x16(b: &[u8], i: usize) -> __m512 {
    debug_assert!(2 * (i + 16) <= b.len());
    _mm512_cvtph_ps(_mm256_loadu_si256(b.as_ptr().add(2 * i).cast()))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn load_bf16x16(b: &[u8], i: usize) -> __m512 {
    debug_assert!(2 * (i + 16) <= b.len());
    let h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(b.as_ptr().add(2 * i).cast()));
    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(h))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn load_f32x16(b: &[u8], i: usize) -> __m512 {
    debug_assert!(4 * (i + 16) <= b.len());
    _mm512_loadu_ps(b.as_ptr().add(4 * i).cast())
}

fn u16_at(b: &[u8], i: usize) -> u16 {
    u16::from_le_bytes([b[2 * i], b[2 * i + 1]])
}

wide_dot16!(
    vec_dot_f16,
    rows_f16,
    load_f16x16,
    |b: &[u8], i: usize| f16_bits_to_f32(u16_at(b, i)),
    2
);
wide_dot16!(
    vec_dot_bf16,
    rows_bf16,
    load_bf16x16,
    |b: &[u8], i: usize| bf16_to_f32(u16_at(b, i)),
    2
);
wide_dot16!(
    vec_dot_f32,
    rows_f32,
    load_f32x16,
    |b: &[u8], i: usize| f32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]]),
    4
);

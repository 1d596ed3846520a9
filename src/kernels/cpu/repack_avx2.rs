//! Q4_0 weights in [`repack`](super::repack)'s interleaved layout on CPUs with AVX2 but no
//! AVX-512. The layout is the AVX-512 kernels' (sixteen rows a group, chunk c of a block holding
//! in 32-bit lane r the quant bytes `4c..4c + 4` of row r); here each 64-byte chunk is two 256-bit
//! halves, rows 0..8 and 8..16, so lane r of a half is again one row and no sum crosses lanes.
//! Per block, token and half, eight `vpmaddubsw` of the unsigned nibbles (0..15) against the
//! token's four bytes broadcast, added as 16-bit integers (each at most `8 · 2 · 15 · 128 =
//! 30720`, so exact), one `vpmaddwd` with ones into 32 bits and the block's `-8 Σy` give each row's
//! exact `isum`; the float step is the single-row kernel's, lane by lane,
//!
//! ```text
//! sumf = fma(d_x * d_y, isum as f32, sumf)        (block order)
//! ```
//!
//! so every output has the bits of `scalar::vec_dot_q4_0_q8_0`, as the AVX-512 kernels'. The
//! file-layout kernels this replaces on AVX2 (`tile::avx2::q4_0`, `avx2::rows_q4_0`) sum lanes
//! across registers for every output; llama.cpp repacks Q4_0 on AVX2 as well.

#![allow(unsafe_op_in_unsafe_fn)]

use std::arch::x86_64::*;

use super::matmul::Out;
use super::repack::{
    Ahead, K4_WORDS, Part, Q5_WORDS, Q6_GROUP_BLOCK, Q6_WORDS, QUANTS, ROWS, SCALES,
    prefetch_ahead, prefetch_part, prefetch_q4_0, q4_0_quants, q4_0_scales, q6_slot,
};
use crate::quant::blocks::{BlockQ8_0, BlockQ8K};

/// Tokens `t..t + NT` against one Q4_0 group: the sixteen rows' sums of each token, stored to
/// rows `r0..r0 + 16` (bits of `mask`) of its output row. `H` halves (of eight rows) per pass
/// over the group's blocks: both at once for few tokens, one at a time for four (whose sixteen
/// accumulators would not fit the sixteen registers beside the weights).
///
/// # Safety
/// AVX2, FMA and F16C are present; `group` holds `part.nb` blocks of sixteen rows in the
/// interleaved layout; every token `t..t + NT` of `ys` holds that many blocks and `nsum` their
/// `-8 Σy` at `(t + j) * part.stride + b`; rows `r0..r0 + 16` of those tokens inside `mask` are in
/// `out` and written by this task only.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn tokens<const NT: usize, const H: usize>(
    group: &[u8],
    part: Part,
    ys: &[&[BlockQ8_0]],
    nsum: &[i32],
    t: usize,
    out: &Out,
    r0: usize,
    mask: u16,
) {
    debug_assert!(group.len() >= part.nb * (QUANTS + SCALES));
    let q = group.as_ptr();
    let low = _mm256_set1_epi8(0x0F);
    let ones = _mm256_set1_epi16(1);
    let ahead = prefetch_ahead();
    let nb = part.nb;
    for h0 in (0..2).step_by(H) {
        let masks: [u8; H] = std::array::from_fn(|i| (mask >> (8 * (h0 + i))) as u8);
        if masks.iter().all(|&m| m == 0) {
            continue;
        }
        let mut sumf: [[__m256; H]; NT] = std::array::from_fn(|j| {
            std::array::from_fn(|i| start(out, part, t + j, r0 + 8 * (h0 + i), masks[i]))
        });
        for b in 0..nb {
            let p = q.add(q4_0_quants(b));
            let d = q.add(q4_0_scales(nb, b));
            if h0 == 0 {
                prefetch_q4_0(p, b, ahead);
            }
            for i in 0..H {
                let half = p.add(32 * (h0 + i));
                // The eight rows' `d` (f16) to f32.
                let dx = _mm256_cvtph_ps(_mm_loadu_si128(d.add(16 * (h0 + i)).cast()));
                let mut s16 = [_mm256_setzero_si256(); NT];
                for c in 0..4 {
                    let v = _mm256_loadu_si256(half.add(64 * c).cast());
                    let lo = _mm256_and_si256(v, low);
                    let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), low);
                    for (j, s) in s16.iter_mut().enumerate() {
                        let yq = ys.get_unchecked(t + j).get_unchecked(b).qs.as_ptr();
                        let pl = _mm256_maddubs_epi16(lo, ybytes(yq.add(4 * c)));
                        let ph = _mm256_maddubs_epi16(hi, ybytes(yq.add(4 * (4 + c))));
                        *s = _mm256_add_epi16(*s, _mm256_add_epi16(pl, ph));
                    }
                }
                for (j, acc) in sumf.iter_mut().enumerate() {
                    let y = ys.get_unchecked(t + j).get_unchecked(b);
                    let ns = _mm256_set1_epi32(*nsum.get_unchecked((t + j) * part.stride + b));
                    let isum = _mm256_add_epi32(_mm256_madd_epi16(s16[j], ones), ns);
                    let dd = _mm256_mul_ps(dx, _mm256_set1_ps(super::avx2::h2f(y.d)));
                    acc[i] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(isum), acc[i]);
                }
            }
        }
        for (j, acc) in sumf.iter().enumerate() {
            for i in 0..H {
                write8(out, t + j, r0 + 8 * (h0 + i), masks[i], acc[i]);
            }
        }
    }
}

/// Tokens `t..t + NT` against one Q4_K group, as [`tokens`] for Q4_0: per super-block and half,
/// the eight rows' head ([`k4_head`]); per 32-element group j, eight `vpmaddubsw` of the nibbles
/// (low for even j, high for odd, shifted down; a pair of groups from the same bytes) against the token's four bytes broadcast, added as
/// 16-bit integers (each at most `30720`), and one `vpmaddwd` with the rows' scale j in both
/// 16-bit halves of each lane gives `sc_j Σ q y` exactly; the mins' `Σ_j m_j B_j` by four
/// `vpmaddwd` of the paired mins against the activation's paired 32-element sums
/// ([`PanelActs`](super::kwide::PanelActs)). The float step is `kquants`' canonical one, lane by
/// lane: `sumf = fma(d_y * d_x, isum, sumf); sumf = fma(-(d_y * dmin_x), imin, sumf)`.
///
/// Both halves go through a super-block together (their heads first), each line of the block
/// read once for the two and each token's bytes broadcast once for them. Half after half, the
/// first half read every line of the block from memory while the second read none, and the
/// bytes were broadcast twice: 0.80-0.90 of the plain read out of cache against 1.02-1.17 this
/// way (`examples/matmul_dram` Q4_K, 2 Zen 3 threads 2048 x 8192 and 8192 x 2048, 1 thread 2048
/// x 8192, three alternated rounds each; the same bits). Which of the two changes gave what was
/// not measured apart; Q6_K's kernel, given only the first ([`tokens_q6_k`]), gained at 1 thread.
/// The prefetch distance made no difference to the old kernel (1 thread, 0 to 9216 bytes, NTA
/// and T1: 0.78-0.89).
///
/// # Safety
/// As for [`tokens`], with Q4_K super-blocks and `min_pairs` for `nsum`.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn tokens_q4_k<const NT: usize, const H: usize>(
    group: &[u8],
    part: Part,
    ys: &[&[BlockQ8K]],
    min_pairs: &[[i32; 4]],
    t: usize,
    out: &Out,
    r0: usize,
    mask: u16,
) {
    tokens_k::<Q4Pairs, NT, H>(group, part, ys, min_pairs, t, out, r0, mask)
}

/// Tokens `t..t + NT` against one Q5_K group, as [`tokens_q4_k`] (its head, mins and float
/// step): group j's quants (0..31) are a nibble of the pair's `qs` word c (words `12 + 8 (j / 2)
/// + c`) with bit j of `qh` word c (words `4 + c`) above it. One group's sums of the tokens live
/// at a time (as Q4_K's four-token path); a 16-bit sum takes four words (each product pair at most
/// `2 · 31 · 128 = 7936`, four of them 31744), then one `vpmaddwd` with the group's scale.
///
/// # Safety
/// As for [`tokens_q4_k`], with Q5_K super-blocks.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn tokens_q5_k<const NT: usize, const H: usize>(
    group: &[u8],
    part: Part,
    ys: &[&[BlockQ8K]],
    min_pairs: &[[i32; 4]],
    t: usize,
    out: &Out,
    r0: usize,
    mask: u16,
) {
    tokens_k::<Q5Pairs, NT, H>(group, part, ys, min_pairs, t, out, r0, mask)
}

/// What [`tokens_q4_k`] and [`tokens_q5_k`] do differently: the size of a super-block, and the
/// integer sums of one pair of 32-element groups. The method is `inline(always)`
/// and carries no target features of its own, so it takes its caller's.
trait KPairs {
    /// 32-bit words in one row's super-block ([`K4_WORDS`], [`Q5_WORDS`]).
    const WORDS: usize;
    /// Adds to `isum[i][tk]` the scaled integer sums `sc_j Σ q y` of groups `2 pair` and
    /// `2 pair + 1` of halves `h0..h0 + H` of the super-block at `p` against tokens `yq`.
    unsafe fn add_pair<const NT: usize, const H: usize>(
        p: *const u8,
        h0: usize,
        pair: usize,
        heads: &[K4Head; H],
        yq: &[*const i8; NT],
        isum: &mut [[__m256i; NT]; H],
    );
}

/// Half `h0 + i`'s word w of the interleaved K-quant super-block at `p` (word w of its eight
/// rows, 32 bytes).
#[inline(always)]
unsafe fn kword(p: *const u8, h0: usize, i: usize, w: usize) -> __m256i {
    _mm256_loadu_si256(p.add(32 * (h0 + i) + 64 * w).cast::<__m256i>())
}

/// Activation bytes `at..at + 4` in every 32-bit lane (for `vpmaddubsw` against eight rows).
#[inline(always)]
unsafe fn ybytes(at: *const i8) -> __m256i {
    _mm256_set1_epi32(std::ptr::read_unaligned(at.cast()))
}

struct Q4Pairs;
impl KPairs for Q4Pairs {
    const WORDS: usize = K4_WORDS;
    #[inline(always)]
    unsafe fn add_pair<const NT: usize, const H: usize>(
        p: *const u8,
        h0: usize,
        pair: usize,
        heads: &[K4Head; H],
        yq: &[*const i8; NT],
        isum: &mut [[__m256i; NT]; H],
    ) {
        // Quant bytes 32 pair..32 pair + 32 of the rows: group 2 pair in their low nibbles,
        // 2 pair + 1 in their high ones; each token's bytes broadcast once for both halves.
        let low = _mm256_set1_epi8(0x0F);
        if NT >= 4 {
            // Four tokens: the pair's low-nibble group, then its high one, so that only one
            // group's sums of the tokens live at a time (both groups' sums and bytes did not
            // fit the sixteen registers and went through the stack; 1B Q4_K_M pp64, 2 Zen 3
            // threads, alternated: 121-123 -> 132-142 t/s with Q6_K's like change); exact
            // integers either way, the same bits.
            for i in 0..H {
                for hi in [false, true] {
                    let mut s = [_mm256_setzero_si256(); NT];
                    for c in 0..8 {
                        let v = kword(p, h0, i, 4 + 8 * pair + c);
                        let q = if hi {
                            _mm256_and_si256(_mm256_srli_epi16::<4>(v), low)
                        } else {
                            _mm256_and_si256(v, low)
                        };
                        for (tk, s) in s.iter_mut().enumerate() {
                            let y = ybytes(yq[tk].add(64 * pair + 32 * hi as usize + 4 * c));
                            *s = _mm256_add_epi16(*s, _mm256_maddubs_epi16(q, y));
                        }
                    }
                    let sc = heads[i].sc[2 * pair + hi as usize];
                    for (tk, s) in s.into_iter().enumerate() {
                        isum[i][tk] = _mm256_add_epi32(isum[i][tk], _mm256_madd_epi16(s, sc));
                    }
                }
            }
            return;
        }
        let mut s_lo = [[_mm256_setzero_si256(); NT]; H];
        let mut s_hi = [[_mm256_setzero_si256(); NT]; H];
        for c in 0..8 {
            let mut y_lo = [_mm256_setzero_si256(); NT];
            let mut y_hi = [_mm256_setzero_si256(); NT];
            for tk in 0..NT {
                let at = yq[tk].add(64 * pair + 4 * c);
                y_lo[tk] = ybytes(at);
                y_hi[tk] = ybytes(at.add(32));
            }
            for i in 0..H {
                let v = kword(p, h0, i, 4 + 8 * pair + c);
                let lo = _mm256_and_si256(v, low);
                let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), low);
                for tk in 0..NT {
                    s_lo[i][tk] = _mm256_add_epi16(s_lo[i][tk], _mm256_maddubs_epi16(lo, y_lo[tk]));
                    s_hi[i][tk] = _mm256_add_epi16(s_hi[i][tk], _mm256_maddubs_epi16(hi, y_hi[tk]));
                }
            }
        }
        for i in 0..H {
            for tk in 0..NT {
                let l = _mm256_madd_epi16(s_lo[i][tk], heads[i].sc[2 * pair]);
                let h = _mm256_madd_epi16(s_hi[i][tk], heads[i].sc[2 * pair + 1]);
                isum[i][tk] = _mm256_add_epi32(isum[i][tk], _mm256_add_epi32(l, h));
            }
        }
    }
}

struct Q5Pairs;
impl KPairs for Q5Pairs {
    const WORDS: usize = Q5_WORDS;
    #[inline(always)]
    unsafe fn add_pair<const NT: usize, const H: usize>(
        p: *const u8,
        h0: usize,
        pair: usize,
        heads: &[K4Head; H],
        yq: &[*const i8; NT],
        isum: &mut [[__m256i; NT]; H],
    ) {
        let (low, bit4) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x10));
        for i in 0..H {
            for hi in 0..2 {
                let j = 2 * pair + hi;
                // Bit j of each qh byte to bit 4 (within the byte either way).
                let (left, right) = (
                    _mm_cvtsi32_si128((4 - j as i32).max(0)),
                    _mm_cvtsi32_si128((j as i32 - 4).max(0)),
                );
                let sc = heads[i].sc[j];
                for c0 in [0, 4] {
                    let mut s = [_mm256_setzero_si256(); NT];
                    for c in c0..c0 + 4 {
                        let v = kword(p, h0, i, 12 + 8 * pair + c);
                        let nib = if hi == 1 {
                            _mm256_srli_epi16::<4>(v)
                        } else {
                            v
                        };
                        let h =
                            _mm256_srl_epi32(_mm256_sll_epi32(kword(p, h0, i, 4 + c), left), right);
                        let q =
                            _mm256_or_si256(_mm256_and_si256(nib, low), _mm256_and_si256(h, bit4));
                        for (tk, s) in s.iter_mut().enumerate() {
                            let y = ybytes(yq[tk].add(32 * j + 4 * c));
                            *s = _mm256_add_epi16(*s, _mm256_maddubs_epi16(q, y));
                        }
                    }
                    for (tk, s) in s.into_iter().enumerate() {
                        isum[i][tk] = _mm256_add_epi32(isum[i][tk], _mm256_madd_epi16(s, sc));
                    }
                }
            }
        }
    }
}

/// The frame of [`tokens_q4_k`] and [`tokens_q5_k`]: per half-pair of rows `h0`, the sums a
/// token starts from; per super-block the heads, each pair's integer sums ([`KPairs`]) and the
/// float step ([`k4_step`]); the rows written. `inline(always)` without target features of its
/// own: it takes its caller's.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn tokens_k<K: KPairs, const NT: usize, const H: usize>(
    group: &[u8],
    part: Part,
    ys: &[&[BlockQ8K]],
    min_pairs: &[[i32; 4]],
    t: usize,
    out: &Out,
    r0: usize,
    mask: u16,
) {
    debug_assert!(group.len() >= part.nb * ROWS * 4 * K::WORDS);
    let ahead = prefetch_ahead();
    for h0 in (0..2).step_by(H) {
        let masks: [u8; H] = std::array::from_fn(|i| (mask >> (8 * (h0 + i))) as u8);
        if masks.iter().all(|&m| m == 0) {
            continue;
        }
        let mut sumf: [[__m256; H]; NT] = std::array::from_fn(|j| {
            std::array::from_fn(|i| start(out, part, t + j, r0 + 8 * (h0 + i), masks[i]))
        });
        for b in 0..part.nb {
            let p = group.as_ptr().add(b * ROWS * 4 * K::WORDS);
            let heads = k4_heads::<H>(p, h0);
            let mut isum = [[_mm256_setzero_si256(); NT]; H];
            let yq: [*const i8; NT] =
                std::array::from_fn(|tk| ys.get_unchecked(t + tk).get_unchecked(b).qs.as_ptr());
            for pair in 0..4 {
                if h0 == 0 {
                    prefetch_part(p, ahead, K::WORDS, pair, 4);
                }
                K::add_pair::<NT, H>(p, h0, pair, &heads, &yq, &mut isum);
            }
            for (i, head) in heads.iter().enumerate() {
                for (tk, acc) in sumf.iter_mut().enumerate() {
                    let y = ys.get_unchecked(t + tk).get_unchecked(b);
                    let pairs = min_pairs.get_unchecked((t + tk) * part.stride + b);
                    acc[i] = k4_step(acc[i], isum[i][tk], head, y, pairs);
                }
            }
        }
        for (j, acc) in sumf.iter().enumerate() {
            for i in 0..H {
                write8(out, t + j, r0 + 8 * (h0 + i), masks[i], acc[i]);
            }
        }
    }
}

/// Tokens `t..t + NT` against one Q6_K group, as [`tokens`] for Q4_0: per super-block, half and
/// 16-element group j, the 6-bit quants (0..63, `q + 32`) put together from `ql` and `qh`, four
/// `vpmaddubsw` against the token's bytes added in pairs as 16-bit integers (each at most
/// `2 · 2 · 63 · 128 = 32256`), two `vpmaddwd` with the rows' signed scale j in both 16-bit halves
/// of each lane; the `-32 Σ_j sc_j B_j` (`B_j` the activation's 16-element sums) by eight
/// `vpmaddwd` of the rows' scales paired against the sums paired as they lie in the block. The
/// float step is `kquants`' canonical one: `sumf = fma(d_y * d_x, isum, sumf)`.
///
/// A super-block's quarters each go through both halves before the next: half after half, the
/// first read all of the block's lines from memory and the second none (as Q4_K's kernel did,
/// [`tokens_q4_k`]). `examples/matmul_dram` Q6_K out of cache, fraction of the plain read, half
/// after half / quarter by quarter, three alternated rounds: 1 Zen 3 thread 2048 x 8192 0.83-0.87
/// / 0.90-0.94, 2 threads 0.76-0.97 / 0.97-1.01, 8192 x 2048 0.94-1.04 / 0.94-1.09; the same
/// bits.
///
/// # Safety
/// As for [`tokens`], with Q6_K super-blocks (the rows' `d` after the group's blocks).
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn tokens_q6_k<const NT: usize, const H: usize>(
    group: &[u8],
    part: Part,
    ys: &[&[BlockQ8K]],
    _min_pairs: &[[i32; 4]],
    t: usize,
    out: &Out,
    r0: usize,
    mask: u16,
) {
    let nb = part.nb;
    debug_assert!(group.len() >= nb * (Q6_GROUP_BLOCK + SCALES));
    let ahead = prefetch_ahead();
    let q = group.as_ptr();
    for h0 in (0..2).step_by(H) {
        let masks: [u8; H] = std::array::from_fn(|i| (mask >> (8 * (h0 + i))) as u8);
        if masks.iter().all(|&m| m == 0) {
            continue;
        }
        let mut sumf: [[__m256; H]; NT] = std::array::from_fn(|j| {
            std::array::from_fn(|i| start(out, part, t + j, r0 + 8 * (h0 + i), masks[i]))
        });
        for b in 0..nb {
            let p = q.add(b * Q6_GROUP_BLOCK);
            let ds = q.add(nb * Q6_GROUP_BLOCK);
            let first = h0 == 0;
            if first && b.is_multiple_of(2) {
                // The next group's `d`, off the stream the hardware prefetcher follows (as
                // AVX-512's kernel does).
                let next = b * SCALES + nb * (Q6_GROUP_BLOCK + SCALES);
                _mm_prefetch::<_MM_HINT_T1>(ds.wrapping_add(next).cast());
            }
            let yb: [&BlockQ8K; NT] =
                std::array::from_fn(|tk| ys.get_unchecked(t + tk).get_unchecked(b));
            // Quarter by quarter, each through both halves: a quarter's lines come from memory
            // once, while the first half runs, and serve the second from L1.
            let mut isums = [[_mm256_setzero_si256(); NT]; H];
            macro_rules! quarter {
                ($hh:literal, $s:literal) => {
                    for (i, isum) in isums.iter_mut().enumerate() {
                        let half = p.add(32 * (h0 + i));
                        let ahead = if first && i == 0 { ahead } else { Ahead::NONE };
                        q6_quarter::<$hh, $s, NT>(p, half, ahead, yb, isum);
                    }
                };
            }
            quarter!(0, 0);
            quarter!(0, 1);
            quarter!(1, 0);
            quarter!(1, 1);
            for (i, isum) in isums.into_iter().enumerate() {
                let half = p.add(32 * (h0 + i));
                let dx =
                    _mm256_cvtph_ps(_mm_loadu_si128(ds.add(b * SCALES + 16 * (h0 + i)).cast()));
                // The scales' offset: isum - 32 Σ_j sc_j B_j.
                // The rows' scales in signed 16-bit pairs (sc_2i, sc_2i + 1), once for every
                // token: pair i from byte 2 (i % 2) of scale word i / 2.
                let sp: [__m256i; 8] = std::array::from_fn(|i| {
                    let w = q6_word(half, Q6_WORDS - 4 + i / 2);
                    _mm256_srai_epi16::<8>(_mm256_shuffle_epi8(w, pairs16(2 * (i % 2) as i32)))
                });
                for ((y, acc), is) in yb.into_iter().zip(sumf.iter_mut()).zip(isum) {
                    // The block's 16-element sums, paired as they lie (bsums 2i, 2i + 1).
                    let bs = y.bsums.as_ptr().cast::<i32>();
                    let mut corr = _mm256_setzero_si256();
                    for (i, &sc) in sp.iter().enumerate() {
                        let b = _mm256_set1_epi32(bs.add(i).read_unaligned());
                        corr = _mm256_add_epi32(corr, _mm256_madd_epi16(sc, b));
                    }
                    let is = _mm256_sub_epi32(is, _mm256_slli_epi32::<5>(corr));
                    let d_y = _mm256_set1_ps(y.d.get());
                    acc[i] =
                        _mm256_fmadd_ps(_mm256_mul_ps(d_y, dx), _mm256_cvtepi32_ps(is), acc[i]);
                }
            }
        }
        for (j, acc) in sumf.iter().enumerate() {
            for i in 0..H {
                write8(out, t + j, r0 + 8 * (h0 + i), masks[i], acc[i]);
            }
        }
    }
}

/// A byte shuffle's indices putting bytes `i` and `i + 1` of every 32-bit lane into the high
/// bytes of its two 16-bit halves (an arithmetic shift right by eight then sign-extends them).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pairs16(i: i32) -> __m256i {
    in_lanes((0x80) | (i << 8) | (0x80 << 16) | ((i + 1) << 24))
}

/// A byte shuffle's indices that take, in every 32-bit lane, the bytes `idx` names of that lane
/// (four byte indices 0..4, or 0x80 for a zero byte).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn in_lanes(idx: i32) -> __m256i {
    let e = _mm256_setr_epi32(
        0,
        0x0404_0404,
        0x0808_0808,
        0x0C0C_0C0C,
        0,
        0x0404_0404,
        0x0808_0808,
        0x0C0C_0C0C,
    );
    _mm256_add_epi8(_mm256_set1_epi32(idx), e)
}

/// Word `w` (the file's order) of the eight rows' Q6_K block half at `half` (`q6_slot`), loaded
/// where the kernel asks for it: as an intrinsic, the compiler merged every load of a word (a
/// `ql` word serves two groups, a `qh` word four) into one, hoisted them to the block's start and
/// kept them on the stack (10 against 17 GB/s in cache, 1 thread); an `asm!` load with effects
/// stays where it is.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6_word(half: *const u8, w: usize) -> __m256i {
    let v: __m256i;
    // SAFETY: the caller's `half` holds the block's 52 words (64 bytes apart, 32 of them read);
    // AVX is in this function's features.
    std::arch::asm!(
        "vmovdqu {v}, ymmword ptr [{p}]",
        v = out(ymm_reg) v,
        p = in(reg) half.add(64 * q6_slot(w)),
        options(readonly, nostack, preserves_flags),
    );
    v
}

/// The four 16-element groups `j = 8 HH + 2 k + S` (k = 0..4) of the eight rows' Q6_K block half
/// at `half` (the block's sixteen rows at `p`, for the prefetch) against the tokens' blocks `ys`,
/// `Σ_j sc_j Σ q y` (quants `q + 32`, 0..63) added to `isum`. Elements `128 HH + 32 k + 16 S +
/// 4 i..+ 4` are in `ql` word `16 HH + 8 (k % 2) + 4 S + i` (low nibbles for k < 2, high for k >=
/// 2) with bits `2k..2k + 2` of `qh` word `32 + 8 HH + 4 S + i` above: word by word (i), each
/// read once for the four groups, the products of two words added in 16 bits per group.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6_quarter<const HH: usize, const S: usize, const NT: usize>(
    p: *const u8,
    half: *const u8,
    ahead: Ahead,
    ys: [&BlockQ8K; NT],
    isum: &mut [__m256i; NT],
) {
    // Scale of group k: byte (2k + S) % 4 of word 48 + 2 HH + k / 2, in both 16-bit halves,
    // sign-extended.
    let sc: [__m256i; 4] = std::array::from_fn(|k| {
        let b = ((2 * k + S) % 4) as i32;
        let w = q6_word(half, Q6_WORDS - 4 + 2 * HH + k / 2);
        let idx = in_lanes(0x80 | (b << 8) | (0x80 << 16) | (b << 24));
        _mm256_srai_epi16::<8>(_mm256_shuffle_epi8(w, idx))
    });
    if NT >= 4 {
        // Four tokens: group by group (k), so that only the tokens' sums of one group live at
        // a time (all four groups' sixteen did not fit the registers beside the words and went
        // through the stack: 1B Q6_K pp64, 2 Zen 3 threads, alternated, 57 -> 95-97 t/s, where
        // llama.cpp ran 75); every sum is an exact integer, so the order does not change a bit.
        for pair in 0..2 {
            prefetch_part(p, ahead, Q6_WORDS, 4 * (2 * HH + S) + 2 * pair, 16);
            prefetch_part(p, ahead, Q6_WORDS, 4 * (2 * HH + S) + 2 * pair + 1, 16);
            #[allow(clippy::needless_range_loop)]
            for k in 0..4 {
                let mut s = [_mm256_setzero_si256(); NT];
                for i in 2 * pair..2 * pair + 2 {
                    let ql = q6_word(half, 16 * HH + 8 * (k % 2) + 4 * S + i);
                    let z = q6_quants(ql, q6_word(half, 32 + 8 * HH + 4 * S + i), k);
                    let j = 8 * HH + 2 * k + S;
                    for (y, s) in ys.into_iter().zip(s.iter_mut()) {
                        let yq = y.qs.as_ptr().add(16 * j + 4 * i).cast::<i32>();
                        let w = _mm256_set1_epi32(yq.read_unaligned());
                        *s = _mm256_add_epi16(*s, _mm256_maddubs_epi16(z, w));
                    }
                }
                for (s, is) in s.into_iter().zip(isum.iter_mut()) {
                    *is = _mm256_add_epi32(*is, _mm256_madd_epi16(s, sc[k]));
                }
            }
        }
        return;
    }
    for pair in 0..2 {
        prefetch_part(p, ahead, Q6_WORDS, 4 * (2 * HH + S) + 2 * pair, 16);
        prefetch_part(p, ahead, Q6_WORDS, 4 * (2 * HH + S) + 2 * pair + 1, 16);
        let mut s16 = [[_mm256_setzero_si256(); 4]; NT];
        for i in 2 * pair..2 * pair + 2 {
            let ql = [
                q6_word(half, 16 * HH + 4 * S + i),
                q6_word(half, 16 * HH + 8 + 4 * S + i),
            ];
            let qh = q6_word(half, 32 + 8 * HH + 4 * S + i);
            for k in 0..4 {
                let z = q6_quants(ql[k % 2], qh, k);
                let j = 8 * HH + 2 * k + S;
                for (y, s) in ys.into_iter().zip(s16.iter_mut()) {
                    let yq = y.qs.as_ptr().add(16 * j + 4 * i).cast::<i32>();
                    let w = _mm256_set1_epi32(yq.read_unaligned());
                    s[k] = _mm256_add_epi16(s[k], _mm256_maddubs_epi16(z, w));
                }
            }
        }
        for (s, is) in s16.into_iter().zip(isum.iter_mut()) {
            for k in 0..4 {
                *is = _mm256_add_epi32(*is, _mm256_madd_epi16(s[k], sc[k]));
            }
        }
    }
}

/// Group k's 6-bit quants (0..63) of a word: the low nibbles of `ql` (k < 2) or its high ones
/// (k >= 2), with bits `2k..2k + 2` of `qh` above them.
#[inline(always)]
unsafe fn q6_quants(ql: __m256i, qh: __m256i, k: usize) -> __m256i {
    let (m4, m30) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x30));
    let lo = if k < 2 {
        ql
    } else {
        _mm256_srli_epi32::<4>(ql)
    };
    let hi = match k {
        0 => _mm256_slli_epi32::<4>(qh),
        1 => _mm256_slli_epi32::<2>(qh),
        2 => qh,
        _ => _mm256_srli_epi32::<2>(qh),
    };
    _mm256_or_si256(_mm256_and_si256(lo, m4), _mm256_and_si256(hi, m30))
}

/// A Q4_K super-block's head for eight rows: `d`, `dmin`, per 32-element group j the 6-bit scale
/// in both 16-bit halves of each lane (for `vpmaddwd` against 16-bit sums), and the mins in 16-bit
/// pairs `(m0, m2)`, `(m1, m3)`, `(m4, m6)`, `(m5, m7)` (as the activation's sums are paired).
#[derive(Clone, Copy)]
struct K4Head {
    d: __m256,
    dmin: __m256,
    sc: [__m256i; 8],
    mp: [__m256i; 4],
}

/// The heads of halves `h0..h0 + H` of the Q4_K or Q5_K super-block at `p` (words 0..4).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k4_heads<const H: usize>(p: *const u8, h0: usize) -> [K4Head; H] {
    let word = |i: usize, w: usize| kword(p, h0, i, w);
    let head0 = k4_head([word(0, 0), word(0, 1), word(0, 2), word(0, 3)]);
    if H == 2 {
        let head1 = k4_head([word(1, 0), word(1, 1), word(1, 2), word(1, 3)]);
        std::array::from_fn(|i| if i == 0 { head0 } else { head1 })
    } else {
        [head0; H]
    }
}

/// The Q4_K / Q5_K float step of one half and token, lane by lane: the mins' `imin` from the
/// head's paired mins against the token's paired sums, then `sumf = fma(d_y * d_x, isum, sumf);
/// sumf = fma(-(d_y * dmin_x), imin, sumf)`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k4_step(
    sumf: __m256,
    isum: __m256i,
    head: &K4Head,
    y: &BlockQ8K,
    pairs: &[i32; 4],
) -> __m256 {
    let mut imin = _mm256_setzero_si256();
    for (mp, &pair) in head.mp.iter().zip(pairs) {
        imin = _mm256_add_epi32(imin, _mm256_madd_epi16(*mp, _mm256_set1_epi32(pair)));
    }
    let d_y = _mm256_set1_ps(y.d.get());
    let a = _mm256_fmadd_ps(_mm256_mul_ps(d_y, head.d), _mm256_cvtepi32_ps(isum), sumf);
    _mm256_fnmadd_ps(_mm256_mul_ps(d_y, head.dmin), _mm256_cvtepi32_ps(imin), a)
}

/// [`K4Head`] from the block's first four words (lane r: row r's d and dmin, then its twelve bytes
/// of packed scales and mins, unpacked as `kquants::k4_scales` does, lane by lane).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k4_head(words: [__m256i; 4]) -> K4Head {
    let [head, w0, w1, w2] = words;
    // The low 16 bits of each lane, as eight f16 converted.
    let f16s = |v: __m256i| {
        let v = _mm256_and_si256(v, _mm256_set1_epi32(0xFFFF));
        let packed = _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        _mm256_cvtph_ps(packed)
    };
    let k = |v: u32| _mm256_set1_epi32(v as i32);
    let (low6, low4, low2) = (k(0x3F3F_3F3F), k(0x0F0F_0F0F), k(0x0303_0303));
    let top2 = |w| _mm256_slli_epi32::<4>(_mm256_and_si256(_mm256_srli_epi32::<6>(w), low2));
    let sc_lo = _mm256_and_si256(w0, low6);
    let sc_hi = _mm256_or_si256(_mm256_and_si256(w2, low4), top2(w0));
    let m_lo = _mm256_and_si256(w1, low6);
    let m_hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32::<4>(w2), low4), top2(w1));
    // Byte i of every lane into both of its 16-bit halves.
    let spread = |v: __m256i, i: i32| {
        _mm256_shuffle_epi8(v, in_lanes(i | (0x80 << 8) | (i << 16) | (0x80 << 24)))
    };
    K4Head {
        d: f16s(head),
        dmin: f16s(_mm256_srli_epi32::<16>(head)),
        sc: std::array::from_fn(|j| spread(if j < 4 { sc_lo } else { sc_hi }, (j % 4) as i32)),
        mp: std::array::from_fn(|i| {
            let m = if i < 2 { m_lo } else { m_hi };
            let m = if i % 2 == 0 {
                m
            } else {
                _mm256_srli_epi32::<8>(m)
            };
            _mm256_and_si256(m, k(0x00FF_00FF))
        }),
    }
}

/// Lanes i of a 256-bit mask: all ones where bit i of `bits` is set.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn lanes(bits: u8) -> __m256i {
    let each = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(bits as i32), each), each)
}

/// The sums a kernel starts from for token t's rows `r..r + 8` (bits of `bits`): zero, or
/// (`part.acc`) what the slab before stored there.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn start(out: &Out, part: Part, t: usize, r: usize, bits: u8) -> __m256 {
    if !part.acc || bits == 0 {
        return _mm256_setzero_ps();
    }
    let p = out.out.0.add(t * out.stride + r);
    if bits == 0xFF {
        _mm256_loadu_ps(p)
    } else {
        _mm256_maskload_ps(p, lanes(bits))
    }
}

/// Token t's rows `r..r + 8`, the lanes in `bits` of `v`, stored.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn write8(out: &Out, t: usize, r: usize, bits: u8, v: __m256) {
    let p = out.out.0.add(t * out.stride + r);
    match bits {
        0 => {}
        0xFF => _mm256_storeu_ps(p, v),
        _ => _mm256_maskstore_ps(p, lanes(bits), v),
    }
}

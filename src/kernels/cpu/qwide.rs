//! Prefill for the 32-element formats (Q4_1, Q5_0, Q5_1, Q8_0; Q4_0 is `kwide`'s) on AVX-512 CPUs. Once per
//! operator the int8 activations are laid out by token pairs, with their group sums and scales;
//! once per block of tokens each block of weight rows is unpacked to unsigned bytes and f32
//! scales, in a buffer that stays in L1. The tile's inner loop is then, per weight row and token
//! pair and block, one `vpdpbusd`, one conversion, one product of scales and one FMA.
//!
//! The arithmetic is the single-row kernels' (see `scalar`): per block, eight exact i32 sums of
//! four consecutive products per output; `fma(d_x * d_y, lane, acc)` across blocks; `hsum8`;
//! then, for Q4_1 and Q5_1, `Σ m_x s_y` added in block order. A 512-bit register holds the eight
//! lanes of two tokens interleaved (lane 2l: token 2p's lane l; 2l + 1: token 2p + 1's), so the
//! two tokens' scales are one 64-bit broadcast. Signed weights are offset to unsigned bytes for
//! `vpdpbusd`, whose accumulator starts at `-c Σ y` in each lane: the offset is taken back exactly
//! (`Σ (q - c) y = Σ q y - c Σ y`, in i32).

#![allow(unsafe_op_in_unsafe_fn)]

use std::arch::x86_64::*;
use std::cell::Cell;
use std::mem::MaybeUninit;
use std::ops::Range;

use crate::kernels::cpu::avx2::{high_bits32, load32, nibbles32};
use crate::kernels::cpu::matmul::{Out, QuantizedActs};
use crate::kernels::cpu::pool;
use crate::kernels::cpu::spare::Spared;
use crate::kernels::cpu::{LinePrefetch, blocks};
use crate::quant::GgmlType;
use crate::quant::blocks::*;

/// Sixty-four bytes, aligned as a 512-bit register.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Bytes64([u8; 64]);

const ZERO64: Bytes64 = Bytes64([0; 64]);

/// Rows per tile: eight rows x two token pairs is 16 accumulators of the 32 registers.
const MAX_ROWS: usize = 8;

/// Bytes of rearranged activations per block of tokens (each weight row block is unpacked once
/// per token block and runs against every quad in it): small enough to stay in L2.
const TOKEN_BLOCK_BYTES: usize = 384 << 10;

/// Q8_0 or Q8_1 activations by token pairs. Quad q (tokens 4q..4q + 4), block b, pair p: entry
/// `(q * nb + b) * 2 + p` of `yq` holds tokens 4q + 2p and 4q + 2p + 1's 32 quants with their
/// groups of four interleaved (group l of the first token, group l of the second, l + 1, ...),
/// and of `nsum` minus each of those groups' sums (i32, same order). `ds[q * nb + b]` holds the
/// four tokens' `d`, then their `s` (Q8_1; zero for Q8_0). Tokens after the last whole quad are
/// left out.
pub struct PairActs {
    yq: Spared<Bytes64>,
    nsum: Spared<Bytes64>,
    ds: Spared<[f32; 8]>,
    nb: usize,
    n_quads: usize,
}

/// Pointer to a buffer that tasks fill in disjoint ranges.
struct Shared<T>(*mut T);
// SAFETY: tasks write disjoint ranges of the buffer, which outlives the parallel loop.
unsafe impl<T> Sync for Shared<T> {}

impl PairActs {
    /// Rearranges Q8_0 / Q8_1 activations when the AVX-512 tiles will use them (`None`
    /// otherwise: another type, another instruction set, or fewer than four tokens).
    pub fn new(acts: &QuantizedActs) -> Option<PairActs> {
        use crate::kernels::cpu::{Isa, isa};
        let q8 = matches!(acts.ty, GgmlType::Q8_0 | GgmlType::Q8_1);
        if !q8 || acts.n_tok < 4 || isa() != Isa::Avx512 {
            return None;
        }
        Some(Self::build(acts))
    }

    /// Rearranges the whole quads of `acts` (Q8_0 or Q8_1, on a CPU with AVX-512).
    fn build(acts: &QuantizedActs) -> PairActs {
        assert!(crate::kernels::cpu::Isa::Avx512.supported());
        let with_s = match acts.ty {
            GgmlType::Q8_0 => false,
            GgmlType::Q8_1 => true,
            other => panic!("PairActs of {other} activations"),
        };
        let nb = acts.k / 32;
        let n_quads = acts.n_tok / 4;
        thread_local! {
            static YQ: Cell<Vec<Bytes64>> = const { Cell::new(Vec::new()) };
            static NSUM: Cell<Vec<Bytes64>> = const { Cell::new(Vec::new()) };
            static DS: Cell<Vec<[f32; 8]>> = const { Cell::new(Vec::new()) };
        }
        let mut yq = Spared::room(&YQ, n_quads * nb * 2);
        let mut nsum = Spared::room(&NSUM, n_quads * nb * 2);
        let mut ds = Spared::room(&DS, n_quads * nb);
        let (yq_p, nsum_p, ds_p) = (
            Shared(yq.uninit().as_mut_ptr()),
            Shared(nsum.uninit().as_mut_ptr()),
            Shared(ds.uninit().as_mut_ptr()),
        );
        pool::global().for_chunks(n_quads, 4, |quads| {
            let (yq_p, nsum_p, ds_p) = (&yq_p, &nsum_p, &ds_p);
            for q in quads {
                // SAFETY: quad q owns these ranges of the rooms, disjoint across tasks.
                let (yq, nsum, ds) = unsafe {
                    (
                        std::slice::from_raw_parts_mut(yq_p.0.add(q * nb * 2), nb * 2),
                        std::slice::from_raw_parts_mut(nsum_p.0.add(q * nb * 2), nb * 2),
                        std::slice::from_raw_parts_mut(ds_p.0.add(q * nb), nb),
                    )
                };
                let rows = std::array::from_fn(|j| acts.row(4 * q + j));
                // SAFETY: this CPU has AVX-512 (asserted above).
                unsafe { build_quad(rows, with_s, yq, nsum, ds) };
            }
        });
        // SAFETY (all three): `build_quad` wrote every entry of its quad's ranges (both pairs
        // of every block, all eight scales), and the quads cover the rooms.
        let (yq, nsum, ds) = unsafe { (yq.filled(), nsum.filled(), ds.filled()) };
        PairActs {
            yq,
            nsum,
            ds,
            nb,
            n_quads,
        }
    }

    /// Tokens the tiles cover: 0..4 * n_quads.
    pub fn n_tok(&self) -> usize {
        4 * self.n_quads
    }
}

/// (d, s, quants) of block b of an activation row.
fn act_block(row: &[u8], with_s: bool, b: usize) -> (F16Le, F16Le, &[i8; 32]) {
    if with_s {
        let y = &blocks::<BlockQ8_1>(row)[b];
        (y.d, y.s, &y.qs)
    } else {
        let y = &blocks::<BlockQ8_0>(row)[b];
        (y.d, F16Le::from_bits(0), &y.qs)
    }
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn build_quad(
    rows: [&[u8]; 4],
    with_s: bool,
    yq: &mut [MaybeUninit<Bytes64>],
    nsum: &mut [MaybeUninit<Bytes64>],
    ds: &mut [MaybeUninit<[f32; 8]>],
) {
    let interleave = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
    let ones = _mm512_set1_epi8(1);
    for (b, d) in ds.iter_mut().enumerate() {
        let blk: [(F16Le, F16Le, &[i8; 32]); 4] =
            std::array::from_fn(|t| act_block(rows[t], with_s, b));
        for p in 0..2 {
            let (a, c) = (load32(blk[2 * p].2), load32(blk[2 * p + 1].2));
            let both = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(a), c);
            let y = _mm512_permutexvar_epi32(interleave, both);
            let sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, y);
            let neg = _mm512_sub_epi32(_mm512_setzero_si512(), sums);
            _mm512_store_si512(yq[2 * b + p].as_mut_ptr().cast(), y);
            _mm512_store_si512(nsum[2 * b + p].as_mut_ptr().cast(), neg);
        }
        let h2f = crate::kernels::cpu::avx2::h2f;
        d.write(std::array::from_fn(|i| match i {
            0..4 => h2f(blk[i].0),
            _ if with_s => h2f(blk[i - 4].1),
            _ => 0.0,
        }));
    }
}

/// Weight rows unpacked for the tile: row r, block b at `qx[r * nb + b]`: the 32 unsigned
/// quants with each group of four twice (for the two interleaved tokens). `d16[g * nb + b]`
/// holds d of rows 4g..4g + 4, each four times (lane 4 (r % 4) + t), for the products with the
/// four tokens' d; `m16` the same of m, for the `m_x s_y` sums.
struct Unpacked {
    qx: Vec<Bytes64>,
    d16: Vec<[f32; 16]>,
    m16: Vec<[f32; 16]>,
    /// Scratch of the tile: `d16` times a quad's d.
    dd: Vec<[f32; 16]>,
}

/// Whether [`run_rows`] takes weights of type `ty`, with (offset shift, mins): weights are
/// offset by `1 << shift` to unsigned bytes, or carry a minimum.
fn format(ty: GgmlType) -> Option<(i32, bool)> {
    match ty {
        // (Q4_0 has its own order, and `kwide`'s panels.)
        GgmlType::Q4_1 => Some((0, true)),
        GgmlType::Q5_0 => Some((4, false)),
        GgmlType::Q5_1 => Some((0, true)),
        GgmlType::Q8_0 => Some((7, false)),
        _ => None,
    }
}

/// Whether [`run_rows`] takes weights of type `ty` (against activations `PairActs` holds).
pub fn supports(ty: GgmlType) -> bool {
    format(ty).is_some()
}

/// Unpacks `rows` (weights of type `ty`, `nb` blocks each) into `u`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn unpack(ty: GgmlType, rows: &[&[u8]], nb: usize, u: &mut Unpacked) {
    let none = F16Le::from_bits(0);
    for (r, &row) in rows.iter().enumerate() {
        match ty {
            GgmlType::Q4_1 => unpack_row::<_, true>(blocks::<BlockQ4_1>(row), r, nb, u, |x| {
                (nibbles32(&x.qs), x.d, x.m)
            }),
            GgmlType::Q5_0 => unpack_row::<_, false>(blocks::<BlockQ5_0>(row), r, nb, u, |x| {
                let q = _mm256_or_si256(nibbles32(&x.qs), high_bits32(&x.qh));
                (q, x.d, none)
            }),
            GgmlType::Q5_1 => unpack_row::<_, true>(blocks::<BlockQ5_1>(row), r, nb, u, |x| {
                let q = _mm256_or_si256(nibbles32(&x.qs), high_bits32(&x.qh));
                (q, x.d, x.m)
            }),
            // x + 128 as an unsigned byte is x ^ 0x80.
            GgmlType::Q8_0 => unpack_row::<_, false>(blocks::<BlockQ8_0>(row), r, nb, u, |x| {
                let q = _mm256_xor_si256(load32(&x.qs), _mm256_set1_epi8(-128));
                (q, x.d, none)
            }),
            other => unreachable!("unpack of {other} weights"),
        }
    }
}

/// Row `r` of [`unpack`]: `quants(block)` gives its unsigned quants, d and m (used if `MINS`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn unpack_row<B: Block, const MINS: bool>(
    xs: &[B],
    r: usize,
    nb: usize,
    u: &mut Unpacked,
    quants: impl Fn(&B) -> (__m256i, F16Le, F16Le),
) {
    let dup = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    let (g, lane) = (r / 4, 4 * (r % 4));
    let qx = &mut u.qx[r * nb..(r + 1) * nb];
    let d16 = &mut u.d16[g * nb..(g + 1) * nb];
    let m16 = &mut u.m16[g * nb..(g + 1) * nb];
    for (((x, q2), d4), m4) in xs.iter().zip(qx).zip(d16).zip(m16) {
        let (q, d, m) = quants(x);
        let q = _mm512_permutexvar_epi32(dup, _mm512_castsi256_si512(q));
        _mm512_store_si512(q2.0.as_mut_ptr().cast(), q);
        d4[lane..lane + 4].fill(crate::kernels::cpu::avx2::h2f(d));
        if MINS {
            m4[lane..lane + 4].fill(crate::kernels::cpu::avx2::h2f(m));
        }
    }
}

/// `R` unpacked rows against quad `q`: lane `8j + r` of `out[p]` is row r, token 2p + j.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn tile<const R: usize, const MINS: bool>(
    u: &mut Unpacked,
    acts: &PairActs,
    q: usize,
    shift: i32,
) -> [__m512; 2] {
    let nb = acts.nb;
    let (yq, nsum) = (
        &acts.yq[q * nb * 2..][..nb * 2],
        &acts.nsum[q * nb * 2..][..nb * 2],
    );
    let ds = &acts.ds[q * nb..][..nb];
    let groups = R.div_ceil(4);
    assert!(u.qx.len() >= R * nb && u.d16.len() >= groups * nb && u.m16.len() >= groups * nb);
    assert!(u.dd.len() >= nb * groups);
    let ld = |x: &Bytes64| _mm512_load_si512(x.0.as_ptr().cast());
    let count = _mm_cvtsi32_si128(shift);
    let mut acc = [[_mm512_setzero_ps(); 2]; R];
    let mut summs = [_mm512_setzero_ps(); 2];
    // The d_x * d_y products of every block first, lane 4 (r % 4) + t of entry b * groups + r / 4:
    // read back below as one 64-bit broadcast load per (row, pair), which keeps them off the
    // shuffle and multiply ports.
    for (b, dsb) in ds.iter().enumerate() {
        let dy = _mm512_broadcast_f32x4(_mm_loadu_ps(dsb.as_ptr()));
        for g in 0..groups {
            // SAFETY (unchecked accesses): g * nb + b < groups * nb <= len, and
            // b * groups + g < nb * groups <= dd.len() (asserted above).
            let dx = _mm512_loadu_ps(u.d16.get_unchecked(g * nb + b).as_ptr());
            let dst = u.dd.get_unchecked_mut(b * groups + g).as_mut_ptr();
            _mm512_storeu_ps(dst, _mm512_mul_ps(dx, dy));
        }
    }
    for b in 0..nb {
        let mut y = [_mm512_setzero_si512(); 2];
        let mut off = [_mm512_setzero_si512(); 2];
        for p in 0..2 {
            y[p] = ld(&yq[2 * b + p]);
            if !MINS {
                off[p] = _mm512_sll_epi32(ld(&nsum[2 * b + p]), count);
            }
        }
        for (r, acc_r) in acc.iter_mut().enumerate() {
            // SAFETY: r * nb + b < R * nb <= len (asserted above).
            let qx = ld(u.qx.get_unchecked(r * nb + b));
            for p in 0..2 {
                // Exact in i32: the sums are far from overflowing.
                let xy = _mm512_dpbusd_epi32(off[p], qx, y[p]);
                // d_x * d_y of tokens 2p and 2p + 1 in alternate lanes: one 64-bit broadcast.
                let dd = u.dd.get_unchecked(b * groups + r / 4);
                let pair = _mm_load_sd(dd[4 * (r % 4) + 2 * p..].as_ptr().cast());
                let d = _mm512_castpd_ps(_mm512_broadcastsd_pd(pair));
                acc_r[p] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(xy), acc_r[p]);
            }
        }
        if MINS {
            // summs[r][t] += m_x(r) * s_y(t), for four rows at once.
            let sy = _mm512_broadcast_f32x4(_mm_loadu_ps(ds[b][4..].as_ptr()));
            for (g, s) in summs.iter_mut().enumerate().take(groups) {
                let m = _mm512_loadu_ps(u.m16.get_unchecked(g * nb + b).as_ptr());
                *s = _mm512_add_ps(*s, _mm512_mul_ps(m, sy));
            }
        }
    }
    // Per pair: the rows' sums as `hsum8` takes them, then (Q4_1, Q5_1) `+ m_x s_y`.
    std::array::from_fn(|p| {
        let v = reduce_rows(&std::array::from_fn::<_, R, _>(|r| acc[r][p]));
        if !MINS {
            return v;
        }
        // Lane 8j + r: summs[r / 4] lane 4 (r % 4) + 2p + j (the second register from 16 on).
        let idx = _mm512_add_epi32(
            _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 1, 5, 9, 13, 17, 21, 25, 29),
            _mm512_set1_epi32(2 * p as i32),
        );
        let sm = _mm512_permutex2var_ps(summs[0], idx, summs[1]);
        _mm512_add_ps(v, sm)
    })
}

/// Up to eight rows' lanes (`s[r]`: lane 2l is token 0's lane l, 2l + 1 token 1's) summed as
/// `hsum8` sums eight lanes, all at once: lane `8j + r` of the result is row r, token j (rows
/// from `s.len()` on are zero). `hsum8` adds lanes l + 4 to l, then 2 and 3 to 0 and 1, then 1
/// to 0; the same pairs are added here across registers, and a sum does not depend on its
/// operands' order, so the results are the same bits.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn reduce_rows(s: &[__m512]) -> __m512 {
    use crate::kernels::cpu::avx512::{add_elems, add_quarters, sum_tree8};
    // Lanes l + 4 onto l (256-bit halves of rows a and b); then lanes 2, 3 onto 0, 1 (quarters
    // of rows a, b from one register, c, d from the other); then lane 1 onto 0 within each
    // quarter, which ends as [row k token 0, token 1, row k + 4 token 0, token 1].
    sum_tree8(
        s,
        |a, b| add_quarters::<0b01_00_01_00, 0b11_10_11_10>(a, b),
        |a, b| add_quarters::<0b10_00_10_00, 0b11_01_11_01>(a, b),
        |a, b| add_elems::<0b01_00_01_00, 0b11_10_11_10>(a, b),
        _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 1, 5, 9, 13, 3, 7, 11, 15),
    )
}

/// Rows `rows` of a weight of type `ty` (`row(r)`: its bytes) against the tokens `acts` covers,
/// written to `out`: token blocks of about [`TOKEN_BLOCK_BYTES`], in each
/// the rows eight (then four, two, one) at a time against every quad.
pub(crate) fn run_rows<'w>(
    acts: &PairActs,
    ty: GgmlType,
    row: impl Fn(usize) -> &'w [u8],
    rows: Range<usize>,
    out: Out,
) {
    let per_quad = acts.nb * (2 * 2 * size_of::<Bytes64>() + 32);
    let quads_per_block = (TOKEN_BLOCK_BYTES / per_quad.max(1)).max(1);
    run_blocks(acts, ty, row, rows, quads_per_block, out)
}

/// [`run_rows`] with `quads_per_block` quads per token block.
fn run_blocks<'w>(
    acts: &PairActs,
    ty: GgmlType,
    row: impl Fn(usize) -> &'w [u8],
    rows: Range<usize>,
    quads_per_block: usize,
    out: Out,
) {
    let Some((shift, mins)) = format(ty) else {
        panic!("qwide::run_rows on {ty} weights");
    };
    let nb = acts.nb;
    let mut u = Unpacked {
        qx: vec![ZERO64; MAX_ROWS * nb],
        d16: vec![[0.0; 16]; MAX_ROWS.div_ceil(4) * nb],
        dd: vec![[0.0; 16]; MAX_ROWS.div_ceil(4) * nb],
        m16: vec![[0.0; 16]; MAX_ROWS.div_ceil(4) * nb],
    };
    let mut q0 = 0;
    while q0 < acts.n_quads {
        let quads = q0..(q0 + quads_per_block).min(acts.n_quads);
        let mut r = rows.start;
        while r < rows.end {
            let n = [8, 4, 2, 1]
                .into_iter()
                .find(|&n| r + n <= rows.end)
                .unwrap();
            let w: [&[u8]; MAX_ROWS] =
                std::array::from_fn(|i| if i < n { row(r + i) } else { &[] });
            // SAFETY: `PairActs` exist only on CPUs with AVX-512.
            unsafe { unpack(ty, &w[..n], nb, &mut u) };
            // The next row block's lines, a share after each quad.
            let more_tokens = quads.end < acts.n_quads;
            let mut pf = LinePrefetch::next_block(&rows, r + n, MAX_ROWS, more_tokens, &row);
            let share = pf.lines().div_ceil(quads.len());
            for q in quads.clone() {
                pf.steps(share);
                // SAFETY: as above; the outputs of rows r..r + n and the quad's tokens are the
                // caller's (`Out`).
                unsafe {
                    match (n, mins) {
                        (8, false) => write::<8, false>(&out, &mut u, acts, q, r, shift),
                        (8, true) => write::<8, true>(&out, &mut u, acts, q, r, shift),
                        (4, false) => write::<4, false>(&out, &mut u, acts, q, r, shift),
                        (4, true) => write::<4, true>(&out, &mut u, acts, q, r, shift),
                        (2, false) => write::<2, false>(&out, &mut u, acts, q, r, shift),
                        (2, true) => write::<2, true>(&out, &mut u, acts, q, r, shift),
                        (_, false) => write::<1, false>(&out, &mut u, acts, q, r, shift),
                        (_, true) => write::<1, true>(&out, &mut u, acts, q, r, shift),
                    }
                }
            }
            r += n;
        }
        q0 = quads.end;
    }
}

/// [`tile`] of rows `r..r + R` against quad `q`, written to `out`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn write<const R: usize, const MINS: bool>(
    out: &Out,
    u: &mut Unpacked,
    acts: &PairActs,
    q: usize,
    r: usize,
    shift: i32,
) {
    let v = tile::<R, MINS>(u, acts, q, shift);
    out.write_pair::<R>(4 * q, r, v[0]);
    out.write_pair::<R>(4 * q + 2, r, v[1]);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu::{Isa, dot_fn};
    use crate::quant::quantize_row;

    /// Every (token, row) over several token blocks and every row block size equals the
    /// single-row kernel bit for bit, for each format.
    #[test]
    fn tiles_equal_single_row_dots() {
        if !Isa::Avx512.supported() {
            return;
        }
        let val = |i: usize, o: f32| 0.1 + 2.0 * (i as f32 * 0.37 + o).cos();
        for ty in [
            GgmlType::Q4_1,
            GgmlType::Q5_0,
            GgmlType::Q5_1,
            GgmlType::Q8_0,
        ] {
            let (k, n, n_tok) = (96, 23, 14);
            let rb = ty.row_bytes(k).unwrap();
            let mut w = vec![0u8; rb * n];
            for (r, dst) in w.chunks_mut(rb).enumerate() {
                let src: Vec<f32> = (0..k).map(|i| val(r * k + i, 0.0)).collect();
                quantize_row(ty, &src, dst).unwrap();
            }
            let x: Vec<f32> = (0..k * n_tok).map(|i| val(i, 1.7)).collect();
            let acts = QuantizedActs::new(ty, &x, k).unwrap();
            let pairs = PairActs::build(&acts);
            assert_eq!(pairs.n_tok(), 12);
            // Rows 1..23: 8 + 8 + 4 + 2; 0..23: 8 + 8 + 4 + 2 + 1.
            for (rows, quads_per_block) in [(1..n, 1), (0..n, 2), (5..n, 100)] {
                let mut got = vec![f32::NAN; n_tok * n];
                let shared = crate::kernels::cpu::matmul::SharedOut(got.as_mut_ptr());
                run_blocks(
                    &pairs,
                    ty,
                    |r| &w[r * rb..(r + 1) * rb],
                    rows.clone(),
                    quads_per_block,
                    Out {
                        out: &shared,
                        stride: n,
                    },
                );
                for t in 0..pairs.n_tok() {
                    for r in rows.clone() {
                        // SAFETY: the CPU has AVX-512 (checked above).
                        let want = unsafe {
                            dot_fn(Isa::Avx512, ty)(&w[r * rb..(r + 1) * rb], acts.row(t), k)
                        };
                        assert_eq!(
                            got[t * n + r].to_bits(),
                            want.to_bits(),
                            "{ty} token {t} row {r}: {} vs {want}",
                            got[t * n + r]
                        );
                    }
                }
            }
        }
    }
}

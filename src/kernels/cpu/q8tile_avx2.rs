//! Q8_0 prefill on CPUs with AVX2 but no AVX-512 (AVX-512's is `qwide`). Tiles of four rows x two
//! tokens: eight ymm accumulators stay in registers (the former 4 x 4 tiles held sixteen, every
//! register AVX2 has, and spilled them).
//!
//! Every output is computed as `avx2::vec_dot_q8_0_q8_0` computes it: per block, eight i32 lanes
//! of four products each (the weight's absolute value against the token signed by the weight:
//! `vpsignb`, `vpmaddubsw`, `vpmaddwd`), converted and added by one FMA with the scale product
//! `dx · dy` into an 8-lane chain, then `hsum8`. So the bits are those of the single-row kernels.
//!
//! What the tiles save is the scales' work. `dx · dy` is exact in f32 (two f16 significands of
//! eleven bits), so it may be formed any way: the tokens' f16 scales are converted once per
//! operator ([`Scales`]), four rows' once per group of rows (a vector `[dx0..dx3, dx0..dx3]` per
//! block), and per block of a token pair one multiply gives the eight products (a segment of
//! blocks at a time, before the segment's blocks run), which reach the FMAs as broadcast loads.
//! 1 thread of a Zen 3 VM, in cache, 64 tokens, 2048 x 1024 (`examples/matmul_dram`,
//! `OATO_DRAM_MIB=4`, best of 8 alternated runs), GB/s of weights: the 4 x 4 tiles 0.37-0.38;
//! 4 x 2 with the scale products formed in the block loop 0.50-0.54; as here 0.59-0.62; the
//! same loop without any scale work (wrong sums, a bound) 0.76-0.80.

#![allow(unsafe_op_in_unsafe_fn)]

use std::arch::x86_64::*;
use std::cell::{Cell, RefCell};
use std::ops::Range;

use super::avx2::Lanes8;
use super::matmul::{Out, QuantizedActs};
use super::spare::Spared;
use crate::quant::GgmlType;
use crate::quant::blocks::{BlockQ8_0, f16_bits_to_f32};

/// Rows per tile.
const ROWS: usize = 4;

/// The Q8_0 activations' block scales as f32, `[token][block]`, for the tiles.
pub(crate) struct Scales {
    d: Spared<f32>,
    nb: usize,
    n_tok: usize,
}

impl Scales {
    /// The scales of `acts` when the CPU runs the AVX2 kernels and `acts` are Q8_0 of at least
    /// two tokens (`None` otherwise).
    pub(crate) fn new(acts: &QuantizedActs) -> Option<Scales> {
        use crate::kernels::cpu::{Isa, isa};
        if acts.ty != GgmlType::Q8_0 || acts.n_tok < 2 || acts.k < 32 || isa() != Isa::Avx2 {
            return None;
        }
        thread_local! {
            static SPARE: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
        }
        let nb = acts.k / 32;
        let mut room = Spared::room(&SPARE, acts.n_tok * nb);
        for (t, dst) in room.uninit().chunks_exact_mut(nb).enumerate() {
            let blocks = crate::kernels::cpu::blocks::<BlockQ8_0>(acts.row(t));
            for (d, b) in dst.iter_mut().zip(blocks) {
                d.write(f16_bits_to_f32(u16::from_le_bytes(b.d.0)));
            }
        }
        // SAFETY: the loop wrote every token's `nb` scales.
        let d = unsafe { room.filled() };
        Some(Scales {
            d,
            nb,
            n_tok: acts.n_tok,
        })
    }

    /// Tokens the tiles cover: all but the last of an odd count (left to the single-row kernel).
    pub(crate) fn n_tok(&self) -> usize {
        self.n_tok / 2 * 2
    }

    fn token(&self, t: usize) -> &[f32] {
        &self.d[t * self.nb..(t + 1) * self.nb]
    }
}

/// Rows `rows` of a Q8_0 weight (`row(r)`: its bytes) against tokens `0..scales.n_tok()` of
/// `acts`, written through `out`: four rows at a time (then two, then one), each group against
/// every token pair.
pub(crate) fn run_rows<'w>(
    scales: &Scales,
    acts: &QuantizedActs,
    row: impl Fn(usize) -> &'w [u8],
    rows: Range<usize>,
    out: Out,
) {
    assert!(crate::kernels::cpu::Isa::Avx2.supported());
    thread_local! {
        /// A group's `[dx0..dx3, dx0..dx3]` per block, kept per thread across operators.
        static DX: RefCell<Vec<Lanes8>> = const { RefCell::new(Vec::new()) };
    }
    DX.with_borrow_mut(|dx| {
        if dx.len() < scales.nb {
            dx.resize(scales.nb, Lanes8([0.0; 8]));
        }
        let dx = &mut dx[..scales.nb];
        // Four rows at a time, then two, then one. SAFETY (each call): AVX2, FMA and F16C are
        // present (asserted above).
        let mut r = rows.start;
        while r + 4 <= rows.end {
            let w = std::array::from_fn(|i| row(r + i));
            unsafe { group::<4>(scales, acts, w, r, dx, &out) };
            r += 4;
        }
        if r + 2 <= rows.end {
            unsafe { group::<2>(scales, acts, [row(r), row(r + 1)], r, dx, &out) };
            r += 2;
        }
        if r < rows.end {
            unsafe { group::<1>(scales, acts, [row(r)], r, dx, &out) };
        }
    });
}

/// `x[I]` in every lane, as a load (`vbroadcastss` from memory). As an intrinsic on a vector just
/// stored, LLVM forwards the store and broadcasts in registers instead: two shuffles per use,
/// where the load ports are idle.
#[inline]
#[target_feature(enable = "avx")]
unsafe fn broadcast_load<const I: usize>(x: &Lanes8) -> __m256 {
    const { assert!(I < 8) };
    let v: __m256;
    std::arch::asm!(
        "vbroadcastss {v}, dword ptr [{p} + {o}]",
        p = in(reg) x.0.as_ptr(),
        o = const 4 * I,
        v = out(ymm_reg) v,
        options(pure, readonly, nostack, preserves_flags)
    );
    v
}

/// Rows `r0..r0 + R` (`w`, R ≤ 4) against every token pair of `scales`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn group<const R: usize>(
    scales: &Scales,
    acts: &QuantizedActs,
    w: [&[u8]; R],
    r0: usize,
    dx: &mut [Lanes8],
    out: &Out,
) {
    const { assert!(R <= ROWS) };
    let nb = scales.nb;
    let xs: [&[BlockQ8_0]; R] = w.map(crate::kernels::cpu::blocks::<BlockQ8_0>);
    assert!(xs.iter().all(|x| x.len() >= nb) && dx.len() >= nb);
    for (b, lanes) in dx.iter_mut().enumerate() {
        let mut bits = 0u64;
        for (r, x) in xs.iter().enumerate() {
            // SAFETY: b < nb <= x.len().
            bits |= u64::from(u16::from_le_bytes(x.get_unchecked(b).d.0)) << (16 * r);
        }
        _mm256_store_ps(
            lanes.0.as_mut_ptr(),
            _mm256_cvtph_ps(_mm_set1_epi64x(bits as i64)),
        );
    }
    let ones = _mm256_set1_epi16(1);
    // The scale products of a segment of blocks, formed before its blocks run.
    const SEG: usize = 32;
    let mut ds = [Lanes8([0.0; 8]); SEG];
    for t in (0..scales.n_tok()).step_by(2) {
        // Written out, not `array::map`: its closures were calls of their own (5% of 135M Q8_0
        // pp512's samples, at 18 blocks a row).
        let ys: [&[BlockQ8_0]; 2] = [
            crate::kernels::cpu::blocks(acts.row(t)),
            crate::kernels::cpu::blocks(acts.row(t + 1)),
        ];
        let dys = [scales.token(t), scales.token(t + 1)];
        assert!(ys.iter().all(|y| y.len() >= nb) && dys.iter().all(|d| d.len() >= nb));
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        for s0 in (0..nb).step_by(SEG) {
            let s1 = nb.min(s0 + SEG);
            for b in s0..s1 {
                // SAFETY: b < nb, within every slice (asserted above).
                let (dy0, dy1) = (dys[0].get_unchecked(b), dys[1].get_unchecked(b));
                let dy = _mm256_set_m128(_mm_broadcast_ss(dy1), _mm_broadcast_ss(dy0));
                // SAFETY: as above.
                let dxb = _mm256_load_ps(dx.get_unchecked(b).0.as_ptr());
                // Lane r + 4j: row r's scale times token j's (exact). SAFETY: b - s0 < SEG.
                _mm256_store_ps(
                    ds.get_unchecked_mut(b - s0).0.as_mut_ptr(),
                    _mm256_mul_ps(dxb, dy),
                );
            }
            for b in s0..s1 {
                // SAFETY: as above.
                let d = ds.get_unchecked(b - s0);
                // SAFETY: as above.
                let (y0, y1) = (ys[0].get_unchecked(b), ys[1].get_unchecked(b));
                let q0 = _mm256_loadu_si256(y0.qs.as_ptr().cast());
                let q1 = _mm256_loadu_si256(y1.qs.as_ptr().cast());
                // Row by row, unrolled by hand: the scales' offsets must be constants.
                macro_rules! row {
                    ($r:literal) => {
                        if $r < R {
                            // SAFETY: as above.
                            let qx = _mm256_loadu_si256(xs[$r].get_unchecked(b).qs.as_ptr().cast());
                            let ax = _mm256_sign_epi8(qx, qx);
                            let p0 = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(q0, qx));
                            let p0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(p0, ones));
                            acc[$r][0] = _mm256_fmadd_ps(broadcast_load::<$r>(d), p0, acc[$r][0]);
                            let p1 = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(q1, qx));
                            let p1 = _mm256_cvtepi32_ps(_mm256_madd_epi16(p1, ones));
                            acc[$r][1] =
                                _mm256_fmadd_ps(broadcast_load::<{ $r + 4 }>(d), p1, acc[$r][1]);
                        }
                    };
                }
                row!(0);
                row!(1);
                row!(2);
                row!(3);
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            for (j, &a) in acc.iter().enumerate() {
                // SAFETY: (t + j, r0 + r) is inside the output (a token of `acts`, a row of
                // this task's range) and written by this task only.
                out.write(t + j, r0 + r, crate::kernels::cpu::avx2::hsum8(a));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu::matmul::SharedOut;

    /// Every output's bits equal the single-row kernel's, over row-group remainders (4, 2, 1),
    /// odd token counts and several block counts, with random quants and scales.
    #[test]
    fn tiles_equal_single_row_dots() {
        if !crate::kernels::cpu::Isa::Avx2.supported() {
            return;
        }
        let previous = crate::kernels::cpu::isa();
        crate::kernels::cpu::set_isa(crate::kernels::cpu::Isa::Avx2).unwrap();
        let mut rng = crate::rng::SplitMix64::new(11);
        for (n, k, n_tok) in [(7, 64, 5), (4, 32, 2), (9, 256, 8), (3, 96, 3), (71, 64, 4)] {
            let rb = GgmlType::Q8_0.row_bytes(k).unwrap();
            let mut w = vec![0u8; rb * n];
            crate::kernels::cpu::random_blocks(GgmlType::Q8_0, &mut w, &mut rng, |r| {
                0.001 + 0.01 * (r.next_u64() % 100) as f32 / 100.0
            });
            let x = crate::kernels::cpu::random_acts(k * n_tok, &mut rng);
            let acts = QuantizedActs::new(GgmlType::Q8_0, &x, k).unwrap();
            let scales = Scales::new(&acts).unwrap();
            let mut y = vec![f32::NAN; n * n_tok];
            let shared = SharedOut(y.as_mut_ptr());
            let row = |r: usize| &w[r * rb..(r + 1) * rb];
            run_rows(
                &scales,
                &acts,
                row,
                0..n,
                Out {
                    out: &shared,
                    stride: n,
                },
            );
            for t in 0..scales.n_tok() {
                for r in 0..n {
                    // SAFETY: AVX2 is present (checked above).
                    let want = unsafe {
                        crate::kernels::cpu::avx2::vec_dot_q8_0_q8_0(
                            crate::kernels::cpu::blocks(row(r)),
                            crate::kernels::cpu::blocks(acts.row(t)),
                        )
                    };
                    assert_eq!(
                        y[t * n + r].to_bits(),
                        want.to_bits(),
                        "n {n} k {k} token {t} row {r}"
                    );
                }
            }
        }
        crate::kernels::cpu::set_isa(previous).unwrap();
    }
}

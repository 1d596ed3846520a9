//! F16 and BF16 prefill on CPUs with AVX2 but no AVX-512 (`f16wide` is AVX-512's). The
//! activations are widened to f32 once per operator, each token's elements in the order the tile
//! reads them; each panel of weight rows is widened once per block of tokens into a buffer that
//! stays in L2; a tile of four rows x three tokens then runs loads and FMAs only (twelve
//! accumulators, three activation registers, each weight load feeding three FMAs).
//!
//! Every output is computed as `avx2::vec_dot_f16` (`vec_dot_bf16`) computes it
//! (`scalar::dot_wide`'s order): lane (c, l) of four 8-lane FMA chains takes the elements
//! `i % 32 == 8c + l` as `fma(w, a, acc)`, then `(c0 + c1) + (c2 + c3)` lane-wise, `hsum8`, then
//! the `k % 32` tail elements by FMA in order. The chains are independent, so the tile runs them
//! one after the other, each chain of a group of rows (in L1) against every token of a block.
//! Before this, AVX2 CPUs took F16 prefill one dot product at a time, converting every weight for
//! every token: 1B shape F16, 2 threads of a Zen 3 VM, pp64 / pp512 about 21 t/s (0.32 / 0.28 of
//! llama.cpp's speed); with these tiles 38-44 / 40-44 t/s against llama.cpp's 65-69 / 73-78 in
//! the same minutes (`oato bench` and `llama-bench`, 2-3 repetitions; about 0.6). The inner
//! loop is seven loads and twelve FMAs a step; what holds it below llama.cpp's (which converts
//! f16 weights in its tiles rather than reading widened f32) was not found.

#![allow(unsafe_op_in_unsafe_fn)]

use std::arch::x86_64::*;
use std::ops::Range;

use std::cell::Cell;

use super::avx2::Lanes8;
use super::matmul::{Out, QuantizedActs};
use super::spare::Spared;
use crate::quant::GgmlType;
use crate::quant::blocks::{bf16_to_f32, f16_bits_to_f32};

/// Rows and tokens per tile: twelve accumulators of the sixteen registers.
const ROWS: usize = 4;
const TOKENS: usize = 3;

/// Bytes of widened weight rows per panel (it stays in the 512 KiB L2 of a Zen 3 core while
/// every token of a block runs against it).
const PANEL_BYTES: usize = 256 << 10;

/// Tokens per block (each panel is widened once per block; their chain sums wait in L2).
const BLOCK_TOKENS: usize = 240;

/// F16 or BF16 activations widened to f32: `[chain][token][step]` of [`Lanes8`], entry (c, t, s)
/// holding elements `32 s + 8 c..+ 8` of token t; elements past the last whole step apart (the
/// tail, taken from `acts` itself). Chain-major, so that a chain's token groups are read as one
/// stream (token-major, each group of three tokens was three short streams 8 KiB apart at
/// k = 2048: 1 Zen 3 thread, 2048 x 1024 in cache, 240 tokens, 0.21 against 0.25 GB/s).
pub(crate) struct WideActs {
    ty: GgmlType,
    data: Spared<Lanes8>,
    steps: usize,
    n_tok: usize,
}

impl WideActs {
    /// Widens F16 or BF16 activations of at least `TOKENS` tokens when the CPU runs the AVX2
    /// kernels (`None` otherwise).
    pub(crate) fn new(acts: &QuantizedActs) -> Option<WideActs> {
        use crate::kernels::cpu::{Isa, isa};
        if !matches!(acts.ty, GgmlType::F16 | GgmlType::BF16)
            || acts.n_tok < TOKENS
            || acts.k < 32
            || isa() != Isa::Avx2
        {
            return None;
        }
        let steps = acts.k / 32;
        thread_local! {
            static SPARE: Cell<Vec<Lanes8>> = const { Cell::new(Vec::new()) };
        }
        // Memory kept from the operator before: a fresh buffer each time had the kernel clear
        // its pages (23% of 1B F16 pp64's samples).
        let mut room = Spared::room(&SPARE, acts.n_tok * 4 * steps);
        let dst = room.uninit();
        let n_tok = acts.n_tok;
        for t in 0..n_tok {
            // Entry (c, s) of the token goes to chain c's run of tokens.
            widen_row(acts.ty, acts.row(t), steps, |c, s, v| {
                dst[(c * n_tok + t) * steps + s].write(v);
            });
        }
        // SAFETY: the loop wrote every token's `4 * steps` entries.
        let data = unsafe { room.filled() };
        Some(WideActs {
            ty: acts.ty,
            data,
            steps,
            n_tok: acts.n_tok,
        })
    }

    /// The weights' type these activations go with.
    pub(crate) fn ty(&self) -> GgmlType {
        self.ty
    }

    /// Tokens the tiles cover: all of them.
    pub(crate) fn n_tok(&self) -> usize {
        self.n_tok
    }

    /// Token t's chain c.
    fn chain(&self, t: usize, c: usize) -> *const f32 {
        self.data[(c * self.n_tok + t) * self.steps..]
            .as_ptr()
            .cast()
    }
}

/// Elements `at..at + 8` of an F16 (or BF16) row, widened exactly.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn widen8(ty: GgmlType, row: &[u8], at: usize) -> Lanes8 {
    let bits = _mm_loadu_si128(row[2 * at..2 * at + 16].as_ptr().cast());
    let v = if ty == GgmlType::BF16 {
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(bits)))
    } else {
        _mm256_cvtph_ps(bits)
    };
    let mut out = Lanes8([0.0; 8]);
    _mm256_store_ps(out.0.as_mut_ptr(), v);
    out
}

/// The `steps` whole 32-element steps of an F16 (or BF16) row widened in the tiles' order:
/// `put(c, s, elements 32 s + 8 c..+ 8)`. Safe to call: it checks for AVX2 and F16C.
fn widen_row(ty: GgmlType, row: &[u8], steps: usize, put: impl FnMut(usize, usize, Lanes8)) {
    assert!(row.len() >= 64 * steps && crate::kernels::cpu::Isa::Avx2.supported());
    // SAFETY: AVX2 and F16C are present (asserted).
    unsafe { widen_row_avx2(ty, row, steps, put) }
}

/// [`widen_row`] compiled for AVX2 and F16C, so that `widen8` and `put` inline into it (called
/// from code without them, `widen8` stayed a call per eight elements).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn widen_row_avx2(
    ty: GgmlType,
    row: &[u8],
    steps: usize,
    mut put: impl FnMut(usize, usize, Lanes8),
) {
    for c in 0..4 {
        for s in 0..steps {
            // Elements 32 s + 8 c..+ 8 are inside the row (s < steps; `widen_row` asserted).
            put(c, s, widen8(ty, row, 32 * s + 8 * c));
        }
    }
}

/// Element i of an F16 (or BF16) row.
fn elem(ty: GgmlType, b: &[u8], i: usize) -> f32 {
    let bits = u16::from_le_bytes([b[2 * i], b[2 * i + 1]]);
    if ty == GgmlType::BF16 {
        bf16_to_f32(bits)
    } else {
        f16_bits_to_f32(bits)
    }
}

/// Rows `rows` of an F16 or BF16 weight (`wide.ty()`; `row(r)`: its bytes) against every token
/// of `wide`, written through `out`: token blocks of about [`TOKEN_BLOCK_BYTES`], panels of about
/// [`PANEL_BYTES`] of widened weights, tiles of four rows x three tokens (then fewer).
pub(crate) fn run_rows<'w>(
    wide: &WideActs,
    acts: &QuantizedActs,
    row: impl Fn(usize) -> &'w [u8],
    rows: Range<usize>,
    out: Out,
) {
    let row_bytes = 4 * wide.steps * size_of::<Lanes8>();
    let panel_rows = (PANEL_BYTES / row_bytes / ROWS * ROWS).max(ROWS);
    run_blocks(wide, acts, row, rows, panel_rows, BLOCK_TOKENS, out)
}

/// [`run_rows`] with panels of `panel_rows` rows and blocks of `block_tokens` tokens.
fn run_blocks<'w>(
    wide: &WideActs,
    acts: &QuantizedActs,
    row: impl Fn(usize) -> &'w [u8],
    rows: Range<usize>,
    panel_rows: usize,
    block_tokens: usize,
    out: Out,
) {
    thread_local! {
        /// The widened weight rows of a panel, kept per thread across operators.
        static WBUF: std::cell::RefCell<Vec<Lanes8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    assert!(crate::kernels::cpu::Isa::Avx2.supported());
    let steps = wide.steps;
    let k = acts.k;
    WBUF.with_borrow_mut(|wbuf| {
        if wbuf.len() < panel_rows * 4 * steps + 2 * block_tokens * ROWS {
            wbuf.resize(
                panel_rows * 4 * steps + 2 * block_tokens * ROWS,
                Lanes8([0.0; 8]),
            );
        }
        let (wbuf, part) = wbuf.split_at_mut(panel_rows * 4 * steps);
        let mut psums = vec![0f32; block_tokens.min(wide.n_tok) * panel_rows];
        for t0 in (0..wide.n_tok).step_by(block_tokens) {
            let tokens = t0..(t0 + block_tokens).min(wide.n_tok);
            for r0 in rows.clone().step_by(panel_rows) {
                let panel = r0..(r0 + panel_rows).min(rows.end);
                for (i, r) in panel.clone().enumerate() {
                    let src = row(r);
                    let dst = &mut wbuf[i * 4 * steps..][..4 * steps];
                    widen_row(wide.ty, src, steps, |c, s, v| dst[c * steps + s] = v);
                }
                let put = |t: usize, i: usize, sum: f32| {
                    // The tail elements past the last whole step, by FMA in order.
                    let r = panel.start + i;
                    let mut total = sum;
                    if 32 * steps < k {
                        let (w, a) = (row(r), acts.row(t));
                        for e in 32 * steps..k {
                            total = elem(wide.ty, w, e).mul_add(elem(wide.ty, a, e), total);
                        }
                    }
                    // SAFETY: (t, r) is inside the output (every token, rows of this task's
                    // range) and written by this task only.
                    unsafe { out.write(t, r, total) };
                };
                let mut i = 0;
                while i < panel.len() {
                    let w = wbuf[i * 4 * steps..].as_ptr().cast::<f32>();
                    let left = panel.len() - i;
                    // SAFETY: AVX2, FMA present (asserted); rows i.. of the panel (as many as
                    // the group takes, inside it) and every token are widened, `4 * steps`
                    // entries each; `part` holds two entries per token and row.
                    let nr = unsafe {
                        if left >= ROWS {
                            group::<ROWS>(w, wide, tokens.clone(), steps, part)
                        } else if left >= 2 {
                            group::<2>(w, wide, tokens.clone(), steps, part)
                        } else {
                            group::<1>(w, wide, tokens.clone(), steps, part)
                        }
                    };
                    // The sums `group` left in `part`, gathered for the whole panel.
                    let sums = part.as_ptr().cast::<f32>();
                    for tl in 0..tokens.len() {
                        for l in 0..nr {
                            // SAFETY: `group` wrote entry (tl, l) of its `[n][nr]` sums, each
                            // a whole `Lanes8` whose first lane is read here.
                            psums[tl * panel.len() + i + l] =
                                unsafe { *sums.add(8 * (tl * nr + l)) };
                        }
                    }
                    i += nr;
                }
                // Handed out token by token, each token's panel of rows one run of the output
                // (group by group, four floats a token, every store reached a line of its own:
                // 7% of 1B F16 pp512's samples, and before, a call per output from inside the
                // tiles spilled their registers and cleared the upper halves: 4%).
                for (tl, t) in tokens.clone().enumerate() {
                    for (i, &v) in psums[tl * panel.len()..][..panel.len()].iter().enumerate() {
                        put(t, i, v);
                    }
                }
            }
        }
    })
}

/// `R` widened weight rows at `w` (`[row][chain][step]`, `4 * steps` entries of eight each)
/// against the tokens `tokens` of `wide`, chain by chain: a chain of the `R` rows (`8 steps`
/// floats a row) stays in L1 while every token group runs against it (all four chains of six
/// rows were 48 KiB at k = 2048, read from L2 for every token group: 38 t/s against 69 for
/// llama.cpp, 1B F16 pp64). Each (row, token)'s chain sums wait in `part` (two entries a token
/// and row): `c0`, then `c0 + c1`, with `c2` beside it, then `(c0 + c1) + (c2 + c3)`, summed by
/// `hsum8` into the first lane of the (token, row) entry of `part`'s first half, as `dot_wide`
/// does (without the tail), for the caller to hand out. Returns `R`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn group<const R: usize>(
    w: *const f32,
    wide: &WideActs,
    tokens: Range<usize>,
    steps: usize,
    part: &mut [Lanes8],
) -> usize {
    let n = tokens.len();
    assert!(part.len() >= 2 * n * R);
    let part = part.as_mut_ptr().cast::<__m256>();
    for c in 0..4 {
        let wc = w.add(8 * c * steps);
        let mut t = tokens.start;
        while t < tokens.end {
            let nt = (tokens.end - t).min(TOKENS);
            let tl = t - tokens.start;
            let ac = |j: usize| wide.chain(t + j, c);
            match nt {
                3 => fold(
                    c,
                    chain::<R, 3>(wc, [ac(0), ac(1), ac(2)], steps),
                    part,
                    tl,
                    n,
                ),
                2 => fold(c, chain::<R, 2>(wc, [ac(0), ac(1)], steps), part, tl, n),
                _ => fold(c, chain::<R, 1>(wc, [ac(0)], steps), part, tl, n),
            }
            t += nt;
        }
    }
    R
}

/// One chain (`steps` steps of eight lanes) of `R` rows at `w` (rows `32 steps` floats apart)
/// against `T` tokens' chains at `a`: `fma(w, a, acc)` lane by lane in step order.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn chain<const R: usize, const T: usize>(
    w: *const f32,
    a: [*const f32; T],
    steps: usize,
) -> [[__m256; R]; T] {
    let mut acc = [[_mm256_setzero_ps(); R]; T];
    for s in 0..steps {
        let y: [__m256; T] = std::array::from_fn(|j| _mm256_load_ps(a[j].add(8 * s)));
        #[allow(clippy::needless_range_loop)]
        for r in 0..R {
            let wr = _mm256_load_ps(w.add(r * 32 * steps + 8 * s));
            for j in 0..T {
                acc[j][r] = _mm256_fmadd_ps(wr, y[j], acc[j][r]);
            }
        }
    }
    acc
}

/// Chain `c`'s sums `acc` of tokens `t..t + T` (local index `tl` of `n` in the block) folded into
/// `part` (`[2][n][R]`): `c0`; `c0 + c1`; `c2` beside it; then `(c0 + c1) + (c2 + c3)` summed
/// by `hsum8` into the first lane of entry (token, row) of `part`'s first half.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn fold<const R: usize, const T: usize>(
    c: usize,
    acc: [[__m256; R]; T],
    part: *mut __m256,
    tl: usize,
    n: usize,
) {
    for (j, acc) in acc.iter().enumerate() {
        for (r, &v) in acc.iter().enumerate() {
            let p01 = part.add((tl + j) * R + r);
            let p2 = part.add((n + tl + j) * R + r);
            match c {
                0 => *p01 = v,
                1 => *p01 = _mm256_add_ps(*p01, v),
                2 => *p2 = v,
                _ => {
                    let sum = _mm256_add_ps(*p01, _mm256_add_ps(*p2, v));
                    *p01.cast::<f32>() = super::avx2::hsum8(sum);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu::matmul::SharedOut;
    use crate::kernels::cpu::{Isa, scalar};
    use crate::quant::quantize_row;

    /// Every (row, token) of the tiles has the bits of the single-row dot (`scalar::vec_dot_f16`,
    /// `vec_dot_bf16`), for row ranges that end in tiles of four rows and of one, token counts
    /// that end in tiles of three, two and one token, panels and token blocks from the smallest,
    /// and rows with a tail past the last whole step.
    #[test]
    fn tiles_equal_single_row_dots() {
        if !Isa::Avx2.supported() {
            return;
        }
        // Magnitudes spread over 2^-8..2^8, so that the chains' sums round.
        let val = |i: usize, o: f32| {
            (0.1 + 2.0 * (i as f32 * 0.37 + o).cos()) * (1u32 << (i * 7 % 17)) as f32 / 256.0
        };
        let previous = crate::kernels::cpu::isa();
        crate::kernels::cpu::set_isa(Isa::Avx2).unwrap();
        for ty in [GgmlType::F16, GgmlType::BF16] {
            for (k, n_tok) in [(96, 7), (64 + 13, 3), (32 * 9 + 5, 11), (256, 4), (32, 5)] {
                let n = 13;
                let rb = ty.row_bytes(k).unwrap();
                let mut w = vec![0u8; rb * n];
                for (r, dst) in w.chunks_mut(rb).enumerate() {
                    let src: Vec<f32> = (0..k).map(|i| val(r * k + i, 0.0)).collect();
                    quantize_row(ty, &src, dst).unwrap();
                }
                let x: Vec<f32> = (0..k * n_tok).map(|i| val(i, 1.7)).collect();
                let acts = QuantizedActs::new(ty, &x, k).unwrap();
                let wide = WideActs::new(&acts).expect("widened");
                let want = |t: usize, r: usize| {
                    let (wr, a) = (&w[r * rb..(r + 1) * rb], acts.row(t));
                    if ty == GgmlType::BF16 {
                        scalar::vec_dot_bf16(wr, a, k)
                    } else {
                        scalar::vec_dot_f16(wr, a, k)
                    }
                };
                for (rows, panel_rows, block_tokens) in [
                    (0..n, 4, 3),
                    (1..n, 8, 6),
                    (2..n - 1, 100, 100),
                    (0..5, 4, 9),
                ] {
                    let mut got = vec![f32::NAN; n_tok * n];
                    let shared = SharedOut(got.as_mut_ptr());
                    let out = Out {
                        out: &shared,
                        stride: n,
                    };
                    let row = |r: usize| &w[r * rb..(r + 1) * rb];
                    run_blocks(
                        &wide,
                        &acts,
                        row,
                        rows.clone(),
                        panel_rows,
                        block_tokens,
                        out,
                    );
                    for t in 0..n_tok {
                        for r in 0..n {
                            let g = got[t * n + r];
                            if rows.contains(&r) {
                                let e = want(t, r);
                                let what = format!("{ty} k={k} rows {rows:?} token {t} row {r}");
                                assert_eq!(g.to_bits(), e.to_bits(), "{what}: {g} vs {e}");
                            } else {
                                assert!(g.is_nan(), "{ty}: row {r} outside {rows:?} written");
                            }
                        }
                    }
                }
            }
        }
        crate::kernels::cpu::set_isa(previous).unwrap();
    }
}

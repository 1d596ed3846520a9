//! F16 and BF16 prefill on CPUs with AVX2 but no AVX-512 (`f16wide` is AVX-512's). The
//! activations are laid out once per operator, each token's elements in the order the tile
//! reads them; each panel of weight rows is laid out the same way once per block of tokens into
//! a buffer that stays in L2; a tile of four rows x three tokens then runs 16-byte loads that
//! widen eight halves to f32 (`vcvtph2ps`; BF16 by a zero-extension and a shift) and FMAs:
//! twelve accumulators, three tokens' values and one row's, all sixteen registers (written out
//! in `asm!`: from intrinsics LLVM moved values between registers and spilled one a step).
//!
//! Every output is computed as `avx2::vec_dot_f16` (`vec_dot_bf16`) computes it
//! (`scalar::dot_wide`'s order): lane (c, l) of four 8-lane FMA chains takes the elements
//! `i % 32 == 8c + l` as `fma(w, a, acc)`, then `(c0 + c1) + (c2 + c3)` lane-wise, `hsum8`, then
//! the `k % 32` tail elements by FMA in order. The chains are independent, so a tile runs them
//! one after the other and keeps the partial sums between them; a group of three tokens (in L1)
//! runs against every group of four rows of a panel (from L2).
//!
//! 1B shape F16, 2 threads of a Zen 3 VM (`oato bench`, alternated): one dot product at a time
//! pp64 / pp512 about 21 t/s (0.3 of llama.cpp's); tiles on weights and activations widened to
//! f32 in memory 53-62 / 54-62 t/s; halves widened in the tiles, with the finished sums written
//! once per panel and token as one run, 63-70 / 68-71 t/s in the same minutes. llama.cpp's
//! tiles (`tinyBLAS`, 4 x 3 with both operands converted in the loop) reach about 85.

#![allow(unsafe_op_in_unsafe_fn)]

use std::arch::x86_64::*;
use std::ops::Range;

use std::cell::Cell;
use std::mem::MaybeUninit;

use super::matmul::{Out, QuantizedActs};
use super::spare::Spared;
use crate::quant::GgmlType;
use crate::quant::blocks::{bf16_to_f32, f16_bits_to_f32};

/// Rows and tokens per tile: twelve accumulators of the sixteen registers.
const ROWS: usize = 4;
const TOKENS: usize = 3;

/// Bytes of laid-out weight rows per panel (it stays in the 512 KiB L2 of a Zen 3 core while
/// every token of a block runs against it).
const PANEL_BYTES: usize = 256 << 10;

/// Tokens per block (each panel is laid out once per block).
const BLOCK_TOKENS: usize = 240;

/// F16 or BF16 activations as they are, reordered: `[chain][token][step]` of [`Half8`], entry (c, t, s)
/// holding elements `32 s + 8 c..+ 8` of token t; elements past the last whole step apart (the
/// tail, taken from `acts` itself). Chain-major: a token group's chain is one run (measured
/// when the tiles ran a chain's token groups one after the other: token-major, each group of
/// three tokens was three short streams 8 KiB apart at k = 2048: 1 Zen 3 thread, 2048 x 1024 in
/// cache, 240 tokens, 0.21 against 0.25 GB/s, in f32).
pub(crate) struct HalfActs {
    ty: GgmlType,
    data: Spared<Half8>,
    steps: usize,
    n_tok: usize,
}

impl HalfActs {
    /// Lays out F16 or BF16 activations of at least `TOKENS` tokens when the CPU runs the AVX2
    /// kernels (`None` otherwise).
    pub(crate) fn new(acts: &QuantizedActs) -> Option<HalfActs> {
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
            static SPARE: Cell<Vec<Half8>> = const { Cell::new(Vec::new()) };
        }
        // Memory kept from the operator before: a fresh buffer each time had the kernel clear
        // its pages (23% of 1B F16 pp64's samples).
        let mut room = Spared::room(&SPARE, acts.n_tok * 4 * steps);
        let dst = room.uninit();
        let n_tok = acts.n_tok;
        for t in 0..n_tok {
            // Entry (c, s) of the token goes to chain c's run of tokens.
            pack_row(acts.row(t), steps, &mut dst[t * steps..], n_tok * steps);
        }
        // SAFETY: the loop wrote every token's `4 * steps` entries.
        let data = unsafe { room.filled() };
        Some(HalfActs {
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
    fn chain(&self, t: usize, c: usize) -> *const Half8 {
        self.data[(c * self.n_tok + t) * self.steps..]
            .as_ptr()
            .cast()
    }
}

/// Eight F16 or BF16 values as they are (16 bytes: one `vcvtph2ps` or widening load).
#[derive(Clone, Copy)]
#[repr(C, align(16))]
pub(crate) struct Half8([u8; 16]);

/// The `steps` whole 32-element steps of an F16 (or BF16) row in the tiles' order, their bits
/// unchanged: elements `32 s + 8 c..+ 8` (chain c, step s) to `dst[c * chain + s]`, as plain
/// 16-byte moves (through a closure per entry, packing the weights took 8.8% of the samples of
/// F16 8192 x 2048 x 64 tokens, 1 Zen 3 thread out of cache, against the tiles' 73%).
fn pack_row(row: &[u8], steps: usize, dst: &mut [MaybeUninit<Half8>], chain: usize) {
    assert!(row.len() >= 64 * steps && chain >= steps && dst.len() >= 3 * chain + steps);
    let (src, dst) = (row.as_ptr(), dst.as_mut_ptr());
    for s in 0..steps {
        for c in 0..4 {
            // SAFETY: `64 s + 16 c + 16 <= row.len()` and `c chain + s < dst.len()` (asserted);
            // `Half8` is 16 bytes of plain data.
            unsafe {
                let v = std::ptr::read_unaligned(src.add(64 * s + 16 * c).cast::<[u8; 16]>());
                dst.add(c * chain + s).write(MaybeUninit::new(Half8(v)));
            }
        }
    }
}

/// Eight values at `p` widened to f32 (exact): F16 by `vcvtph2ps`, BF16 by a shift.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load8<const BF: bool>(p: *const Half8) -> __m256 {
    let bits = _mm_load_si128(p.cast());
    if BF {
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(bits)))
    } else {
        _mm256_cvtph_ps(bits)
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

/// Rows `rows` of an F16 or BF16 weight (`half.ty()`; `row(r)`: its bytes) against every token
/// of `half`, written through `out`: token blocks of [`BLOCK_TOKENS`], panels of about
/// [`PANEL_BYTES`] of laid-out weights, tiles of four rows x three tokens (then fewer).
pub(crate) fn run_rows<'w>(
    half: &HalfActs,
    acts: &QuantizedActs,
    row: impl Fn(usize) -> &'w [u8],
    rows: Range<usize>,
    out: Out,
) {
    let row_bytes = 4 * half.steps * size_of::<Half8>();
    let panel_rows = (PANEL_BYTES / row_bytes / ROWS * ROWS).max(ROWS);
    run_blocks(half, acts, row, rows, panel_rows, BLOCK_TOKENS, out)
}

/// [`run_rows`] with panels of `panel_rows` rows and blocks of `block_tokens` tokens.
fn run_blocks<'w>(
    half: &HalfActs,
    acts: &QuantizedActs,
    row: impl Fn(usize) -> &'w [u8],
    rows: Range<usize>,
    panel_rows: usize,
    block_tokens: usize,
    out: Out,
) {
    thread_local! {
        /// The packed weight rows of a panel and the panel's finished sums, kept per thread
        /// across operators.
        static BUFS: std::cell::RefCell<(Vec<Half8>, Vec<f32>)> =
            const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
    }
    assert!(crate::kernels::cpu::Isa::Avx2.supported());
    let steps = half.steps;
    let k = acts.k;
    let bf = half.ty == GgmlType::BF16;
    BUFS.with_borrow_mut(|(wbuf, psums)| {
        if wbuf.len() < panel_rows * 4 * steps {
            wbuf.resize(panel_rows * 4 * steps, Half8([0; 16]));
        }
        // Every entry a panel's tokens read is written by its tiles first.
        if psums.len() < block_tokens.min(half.n_tok) * panel_rows {
            psums.resize(block_tokens.min(half.n_tok) * panel_rows, 0.0);
        }
        for t0 in (0..half.n_tok).step_by(block_tokens) {
            let tokens = t0..(t0 + block_tokens).min(half.n_tok);
            for r0 in rows.clone().step_by(panel_rows) {
                let panel = r0..(r0 + panel_rows).min(rows.end);
                for (i, r) in panel.clone().enumerate() {
                    let src = row(r);
                    let dst = &mut wbuf[i * 4 * steps..][..4 * steps];
                    // SAFETY: the same memory as `MaybeUninit` (same layout), only written with
                    // initialised values; `Half8` has no drop.
                    let dst = unsafe {
                        std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast(), dst.len())
                    };
                    pack_row(src, steps, dst, steps);
                }
                // Token group by token group, each against every row group of the panel: the
                // group's chains stay in L1 while the panel's rows stream from L2. Row group by
                // row group, each against every token group, the block's tokens came from L3
                // for every four rows: 1 Zen 3 thread, F16 weights in L3 (`matmul_dram`,
                // `OATO_DRAM_MIB=4`), 64 / 240 tokens, GFLOP/s: K 2048 x 2048 74 / 62 -> 76 /
                // 82, K 8192 x 1024 67 / 65 -> 81 / 86.
                let mut t = tokens.start;
                while t < tokens.end {
                    let nt = (tokens.end - t).min(TOKENS);
                    let tl = t - tokens.start;
                    let mut i = 0;
                    while i < panel.len() {
                        let w = wbuf[i * 4 * steps..].as_ptr();
                        let at = psums[tl * panel.len() + i..].as_mut_ptr();
                        let sums = Sums {
                            at,
                            stride: panel.len(),
                        };
                        macro_rules! tile {
                            ($r:literal) => {
                                match (nt, bf) {
                                    (3, false) => tile::<$r, 3, false>(w, half, t, steps, sums),
                                    (3, true) => tile::<$r, 3, true>(w, half, t, steps, sums),
                                    (2, false) => tile::<$r, 2, false>(w, half, t, steps, sums),
                                    (2, true) => tile::<$r, 2, true>(w, half, t, steps, sums),
                                    (_, false) => tile::<$r, 1, false>(w, half, t, steps, sums),
                                    (_, true) => tile::<$r, 1, true>(w, half, t, steps, sums),
                                }
                            };
                        }
                        // SAFETY: AVX2, FMA present (asserted); rows i.. of the panel (as many
                        // as the tile takes, inside it) and every token are packed, `4 * steps`
                        // entries each; `sums` has a row of `panel.len()` per token of the
                        // block, the tile's from (tl, i), `nt` tokens and the tile's rows inside.
                        let nr = unsafe {
                            match panel.len() - i {
                                4.. => tile!(4),
                                2 | 3 => tile!(2),
                                _ => tile!(1),
                            }
                        };
                        i += nr;
                    }
                    t += nt;
                }
                // Handed out token by token, each token's panel of rows one run of the output
                // (group by group, four floats a token, every store reached a line of its own:
                // 7% of 1B F16 pp512's samples, and before, a call per output from inside the
                // tiles spilled their registers and cleared the upper halves: 4%).
                for (tl, t) in tokens.clone().enumerate() {
                    let run = &mut psums[tl * panel.len()..][..panel.len()];
                    if 32 * steps < k {
                        // The tail elements past the last whole step, by FMA in order.
                        for (i, total) in run.iter_mut().enumerate() {
                            let (w, a) = (row(panel.start + i), acts.row(t));
                            for e in 32 * steps..k {
                                *total = elem(half.ty, w, e).mul_add(elem(half.ty, a, e), *total);
                            }
                        }
                    }
                    // SAFETY: token t's rows `panel` are inside the output (every token, rows
                    // of this task's range) and written by this task only.
                    unsafe { out.write_run(t, panel.start, run) };
                }
            }
        }
    })
}

/// Where a tile's finished sums go: (token j of the tile, row r of the tile) at
/// `at[j * stride + r]`.
#[derive(Clone, Copy)]
struct Sums {
    at: *mut f32,
    stride: usize,
}

/// `R` laid-out weight rows at `w` (`[row][chain][step]`, `4 * steps` entries of eight each)
/// against the tokens `t..t + T` of `half`: the four chains one after the other, `c0`, then
/// `c0 + c1`, with `c2` beside it, then `(c0 + c1) + (c2 + c3)` (four rows and three tokens in
/// one block of assembly, [`tile_4x3`]), each summed as `hsum8` sums into `sums`, as `dot_wide`
/// does (without the tail), for the caller to hand out. Returns `R`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<const R: usize, const T: usize, const BF: bool>(
    w: *const Half8,
    half: &HalfActs,
    t: usize,
    steps: usize,
    sums: Sums,
) -> usize {
    let z = _mm256_setzero_ps();
    let fin: [[__m256; R]; T] = if R == ROWS && T == TOKENS {
        // T is 3 and R 4 here; indexed so that the other tiles, which skip this, still compile.
        let a = [
            half.chain(t, 0),
            half.chain(t + T / 2, 0),
            half.chain(t + T - 1, 0),
        ];
        let a_chain = half.n_tok * steps * size_of::<Half8>();
        let v = tile_4x3::<BF>(w, a, a_chain, steps);
        std::array::from_fn(|j| std::array::from_fn(|r| v[j % 3][r % 4]))
    } else {
        let (mut p01, mut p2, mut fin) = ([[z; R]; T], [[z; R]; T], [[z; R]; T]);
        for c in 0..4 {
            let wc = w.add(c * steps);
            let a: [*const Half8; T] = std::array::from_fn(|j| half.chain(t + j, c));
            let acc: [[__m256; R]; T] = chain::<R, T, BF>(wc, a, steps);
            for j in 0..T {
                for r in 0..R {
                    let v = acc[j][r];
                    match c {
                        0 => p01[j][r] = v,
                        1 => p01[j][r] = _mm256_add_ps(p01[j][r], v),
                        2 => p2[j][r] = v,
                        _ => fin[j][r] = _mm256_add_ps(p01[j][r], _mm256_add_ps(p2[j][r], v)),
                    }
                }
            }
        }
        fin
    };
    if R == ROWS {
        // Four rows' sums of two tokens at a time, each token's a run of four floats: `hsum8x8`
        // adds the same pairs in the same order as `hsum8` (six instructions a sum).
        let mut j = 0;
        while j < T {
            let next = if j + 1 < T { fin[j + 1] } else { [z; R] };
            let v: [__m256; 8] =
                std::array::from_fn(|i| if i < 4 { fin[j][i % R] } else { next[i % R] });
            let v = super::avx2::hsum8x8(v);
            _mm_storeu_ps(sums.at.add(j * sums.stride), _mm256_castps256_ps128(v));
            if j + 1 < T {
                let hi = _mm256_extractf128_ps::<1>(v);
                _mm_storeu_ps(sums.at.add((j + 1) * sums.stride), hi);
            }
            j += 2;
        }
    } else {
        for (j, fin) in fin.iter().enumerate() {
            for (r, &sum) in fin.iter().enumerate() {
                *sums.at.add(j * sums.stride + r) = super::avx2::hsum8(sum);
            }
        }
    }
    R
}

/// The four chains of four rows and three tokens, written out as one block: each chain's pass
/// is [`chain`]'s loop (twelve accumulators, three tokens' values and one row's: all sixteen
/// registers; LLVM, given the intrinsics, rotated values between registers and spilled one a
/// step: 1 thread in cache, 2048 x 1024, 240 tokens, 0.16 GB/s of weights against 0.26 for the
/// widened f32 weights before), and between the passes the partial sums go to a buffer on the
/// stack and come back as `(c0 + c1) + (c2 + c3)`. With a pass per call and the sums combined
/// in Rust (and `hsum8` per sum), 30% of the tile's samples fell outside the loops at K = 576;
/// as here, 1 thread in cache (`matmul_dram F16 576 1536 1 240`, alternated) 35.0-37.1 -> 38.2-
/// 38.4 GMAC/s; `oato bench -t 2` alternated: 135M F16 pp512 488-518 -> 528-543 t/s, 1B F16
/// pp64 66-73 -> 76-80, pp512 79-80 -> 81-83. Still about 30% of the samples outside the loops
/// at K = 576: each pass is 18 steps. Rows at `w` (`[row][chain][step]`, rows `4 steps` entries apart), tokens' chain 0
/// at `a`, chain c `c * a_chain` bytes further; returns `[token][row]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_4x3<const BF: bool>(
    w: *const Half8,
    a: [*const Half8; 3],
    a_chain: usize,
    steps: usize,
) -> [[__m256; 4]; 3] {
    assert!(steps > 0);
    let row = 64 * steps;
    // Written by the block before it reads each entry (not cleared: a memset of 768 bytes a tile).
    let mut buf = MaybeUninit::<[__m256; 24]>::uninit();
    let (mut c0, mut c1, mut c2, mut c3, mut c4, mut c5);
    let (mut c6, mut c7, mut c8, mut c9, mut c10, mut c11);
    // `$ld` widens eight values at `[base + i]` into a register; `$label` names the pass's loop.
    macro_rules! pass {
        ($ld:ident, $label:literal) => {
            concat!(
                "vxorps {c0:y}, {c0:y}, {c0:y}\n",
                "vxorps {c1:y}, {c1:y}, {c1:y}\n",
                "vxorps {c2:y}, {c2:y}, {c2:y}\n",
                "vxorps {c3:y}, {c3:y}, {c3:y}\n",
                "vxorps {c4:y}, {c4:y}, {c4:y}\n",
                "vxorps {c5:y}, {c5:y}, {c5:y}\n",
                "vxorps {c6:y}, {c6:y}, {c6:y}\n",
                "vxorps {c7:y}, {c7:y}, {c7:y}\n",
                "vxorps {c8:y}, {c8:y}, {c8:y}\n",
                "vxorps {c9:y}, {c9:y}, {c9:y}\n",
                "vxorps {c10:y}, {c10:y}, {c10:y}\n",
                "vxorps {c11:y}, {c11:y}, {c11:y}\n",
                "xor {i:e}, {i:e}\n",
                $label,
                ":\n",
                $ld!("y0", "a0"),
                "\n",
                $ld!("y1", "a1"),
                "\n",
                $ld!("y2", "a2"),
                "\n",
                $ld!("w", "w0"),
                "\n",
                "vfmadd231ps {c0}, {w}, {y0}\n",
                "vfmadd231ps {c1}, {w}, {y1}\n",
                "vfmadd231ps {c2}, {w}, {y2}\n",
                $ld!("w", "w1"),
                "\n",
                "vfmadd231ps {c3}, {w}, {y0}\n",
                "vfmadd231ps {c4}, {w}, {y1}\n",
                "vfmadd231ps {c5}, {w}, {y2}\n",
                $ld!("w", "w2"),
                "\n",
                "vfmadd231ps {c6}, {w}, {y0}\n",
                "vfmadd231ps {c7}, {w}, {y1}\n",
                "vfmadd231ps {c8}, {w}, {y2}\n",
                $ld!("w", "w3"),
                "\n",
                "vfmadd231ps {c9}, {w}, {y0}\n",
                "vfmadd231ps {c10}, {w}, {y1}\n",
                "vfmadd231ps {c11}, {w}, {y2}\n",
                "add {i}, 16\n",
                "cmp {i}, {end}\n",
                "jne ",
                $label,
                "b\n",
                // The next chain: the rows' one `16 steps` bytes on, the tokens' `a_chain`.
                "add {w0}, {end}\n",
                "add {w1}, {end}\n",
                "add {w2}, {end}\n",
                "add {w3}, {end}\n",
                "add {a0}, {ac}\n",
                "add {a1}, {ac}\n",
                "add {a2}, {ac}\n",
            )
        };
    }
    // Each accumulator plus the buffer's entry `$at / 32 + k`.
    macro_rules! add {
        ($at:literal) => {
            concat!(
                "vaddps {c0}, {c0}, ymmword ptr [{buf} + ",
                $at,
                " + 0]\n",
                "vaddps {c1}, {c1}, ymmword ptr [{buf} + ",
                $at,
                " + 32]\n",
                "vaddps {c2}, {c2}, ymmword ptr [{buf} + ",
                $at,
                " + 64]\n",
                "vaddps {c3}, {c3}, ymmword ptr [{buf} + ",
                $at,
                " + 96]\n",
                "vaddps {c4}, {c4}, ymmword ptr [{buf} + ",
                $at,
                " + 128]\n",
                "vaddps {c5}, {c5}, ymmword ptr [{buf} + ",
                $at,
                " + 160]\n",
                "vaddps {c6}, {c6}, ymmword ptr [{buf} + ",
                $at,
                " + 192]\n",
                "vaddps {c7}, {c7}, ymmword ptr [{buf} + ",
                $at,
                " + 224]\n",
                "vaddps {c8}, {c8}, ymmword ptr [{buf} + ",
                $at,
                " + 256]\n",
                "vaddps {c9}, {c9}, ymmword ptr [{buf} + ",
                $at,
                " + 288]\n",
                "vaddps {c10}, {c10}, ymmword ptr [{buf} + ",
                $at,
                " + 320]\n",
                "vaddps {c11}, {c11}, ymmword ptr [{buf} + ",
                $at,
                " + 352]\n",
            )
        };
    }
    macro_rules! store {
        ($at:literal) => {
            concat!(
                "vmovups ymmword ptr [{buf} + ",
                $at,
                " + 0], {c0}\n",
                "vmovups ymmword ptr [{buf} + ",
                $at,
                " + 32], {c1}\n",
                "vmovups ymmword ptr [{buf} + ",
                $at,
                " + 64], {c2}\n",
                "vmovups ymmword ptr [{buf} + ",
                $at,
                " + 96], {c3}\n",
                "vmovups ymmword ptr [{buf} + ",
                $at,
                " + 128], {c4}\n",
                "vmovups ymmword ptr [{buf} + ",
                $at,
                " + 160], {c5}\n",
                "vmovups ymmword ptr [{buf} + ",
                $at,
                " + 192], {c6}\n",
                "vmovups ymmword ptr [{buf} + ",
                $at,
                " + 224], {c7}\n",
                "vmovups ymmword ptr [{buf} + ",
                $at,
                " + 256], {c8}\n",
                "vmovups ymmword ptr [{buf} + ",
                $at,
                " + 288], {c9}\n",
                "vmovups ymmword ptr [{buf} + ",
                $at,
                " + 320], {c10}\n",
                "vmovups ymmword ptr [{buf} + ",
                $at,
                " + 352], {c11}\n",
            )
        };
    }
    macro_rules! tile {
        ($ld:ident) => {
            std::arch::asm!(
                // c0 to the buffer's first half; c0 + c1 there; c2 to its second half; then
                // c3 + c2, plus (c0 + c1).
                pass!($ld, "2"),
                store!("0"),
                pass!($ld, "3"),
                add!("0"),
                store!("0"),
                pass!($ld, "4"),
                store!("384"),
                pass!($ld, "5"),
                add!("384"),
                add!("0"),
                a0 = inout(reg) a[0] => _,
                a1 = inout(reg) a[1] => _,
                a2 = inout(reg) a[2] => _,
                w0 = inout(reg) w => _,
                w1 = inout(reg) w.byte_add(row) => _,
                w2 = inout(reg) w.byte_add(2 * row) => _,
                w3 = inout(reg) w.byte_add(3 * row) => _,
                ac = in(reg) a_chain,
                buf = in(reg) buf.as_mut_ptr(),
                i = out(reg) _,
                end = in(reg) 16 * steps,
                y0 = out(ymm_reg) _,
                y1 = out(ymm_reg) _,
                y2 = out(ymm_reg) _,
                w = out(ymm_reg) _,
                c0 = out(ymm_reg) c0,
                c1 = out(ymm_reg) c1,
                c2 = out(ymm_reg) c2,
                c3 = out(ymm_reg) c3,
                c4 = out(ymm_reg) c4,
                c5 = out(ymm_reg) c5,
                c6 = out(ymm_reg) c6,
                c7 = out(ymm_reg) c7,
                c8 = out(ymm_reg) c8,
                c9 = out(ymm_reg) c9,
                c10 = out(ymm_reg) c10,
                c11 = out(ymm_reg) c11,
                options(nostack)
            )
        };
    }
    macro_rules! f16 {
        ($dst:literal, $base:literal) => {
            concat!("vcvtph2ps {", $dst, "}, xmmword ptr [{", $base, "} + {i}]")
        };
    }
    macro_rules! bf16 {
        ($dst:literal, $base:literal) => {
            concat!(
                "vpmovzxwd {",
                $dst,
                "}, xmmword ptr [{",
                $base,
                "} + {i}]\n",
                "vpslld {",
                $dst,
                "}, {",
                $dst,
                "}, 16"
            )
        };
    }
    // SAFETY: each row has four chains of `steps` entries of 16 bytes at `w` (the caller's
    // contract: four rows `4 steps` entries apart), each token four chains of `steps` entries
    // `a_chain` bytes apart from `a`; the buffer holds the 24 vectors the block writes; AVX2,
    // FMA and F16C are enabled; the block clobbers the flags (not marked preserved).
    if BF {
        tile!(bf16);
    } else {
        tile!(f16);
    }
    let _ = &mut buf;
    [[c0, c3, c6, c9], [c1, c4, c7, c10], [c2, c5, c8, c11]]
}

/// One chain (`steps` steps of eight lanes) of `R` rows at `w` (rows `4 steps` entries apart)
/// against `T` tokens' chains at `a`: `fma(w, a, acc)` lane by lane in step order.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn chain<const R: usize, const T: usize, const BF: bool>(
    w: *const Half8,
    a: [*const Half8; T],
    steps: usize,
) -> [[__m256; R]; T] {
    let mut acc = [[_mm256_setzero_ps(); R]; T];
    for s in 0..steps {
        let y: [__m256; T] = std::array::from_fn(|j| load8::<BF>(a[j].add(s)));
        #[allow(clippy::needless_range_loop)]
        for r in 0..R {
            let wr = load8::<BF>(w.add(r * 4 * steps + s));
            for j in 0..T {
                acc[j][r] = _mm256_fmadd_ps(wr, y[j], acc[j][r]);
            }
        }
    }
    acc
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
                let half = HalfActs::new(&acts).expect("laid out");
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
                        &half,
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

//! Prefill for Q4_0, the K-quants (Q2_K..Q6_K), IQ4_NL and IQ4_XS on AVX-512 CPUs: sixteen weight rows at a time,
//! interleaved so that one 512-bit register holds the same four elements of all sixteen rows.
//!
//! Once per block of sixteen rows every super-block is unpacked into a [`Panel`] (unsigned byte
//! quants, per-group scales as i32 lanes, the group corrections as i16 pairs, `d` and `dmin`), in
//! a buffer that stays in L2. A token's super-block is then, per group of `G` elements, `G / 4`
//! `vpdpbusd` of the panel's registers with the token's four bytes broadcast, one `vpmulld` by the
//! group scales and one add: lane r ends with row r's exact `isum` (and `imin` for the types with
//! mins, from the activation's 16-element sums by `vpdpwssd`). The float part is `kquants`'
//! canonical step, lane by lane, so every output is the single-row kernel's bit for bit:
//!
//! ```text
//! sumf = fma(d_y * d_x, isum as f32, sumf)
//! sumf = fma(-(d_y * dmin_x), imin as f32, sumf)     (Q2_K, Q4_K, Q5_K)
//! ```
//!
//! The integers are exact whatever their grouping (see `kquants`): Q6_K's quants enter as
//! `u = q + 32` (0..64), and `Σ_g sc_g Σ (u - 32) y = Σ_g sc_g Σ u y - 32 Σ_g sc_g bsum_g`, the
//! second sum from the activation's group sums with `-32 sc_g` as the i16 correction; Q3_K's
//! likewise as `u = q + 4` (0..8) with `-4 sc_g`; IQ4_XS's values as `u = v + 128` (1..242,
//! through a byte table) with `-128 sc_g`, and IQ4_NL as Q4_0 with the same table, from `-128 Σy`.

#![allow(unsafe_op_in_unsafe_fn)]

use std::arch::x86_64::*;
use std::ops::Range;

use crate::kernels::cpu::blocks;
use crate::kernels::cpu::matmul::QuantizedActs;
use crate::kernels::cpu::repack::signed_byte;
use crate::quant::GgmlType;
use crate::quant::blocks::*;

/// Rows per panel: one i32 lane each.
const ROWS: usize = 16;

/// Tokens whose sums stay in registers at once.
const GROUP_TOKENS: usize = 8;

/// Bytes of activations per block of tokens (each run over the panel's super-blocks reads the
/// block once per super-block: small enough to stay in L2 beside the panel).
const TOKEN_BLOCK_BYTES: usize = 192 << 10;

/// Sixteen 32-bit lanes, aligned as a 512-bit register.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Lanes([i32; 16]);

const ZERO: Lanes = Lanes([0; 16]);

/// One super-block of sixteen rows. `q[e]`: lane r holds row r's elements `4e..4e + 4` as
/// unsigned bytes; `sc[j]`: lane r, row r's scale of group j (`G` elements); `pc[p]`: lane r,
/// row r's corrections of the 16-element groups 2p and 2p + 1 as two i16 (mins for Q2_K, Q4_K
/// and Q5_K, `-4 sc` for Q3_K, `-32 sc` for Q6_K); `d`, `dmin` the rows' super-block scales.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Panel {
    q: [Lanes; QK_K / 4],
    sc: [Lanes; 16],
    pc: [Lanes; 8],
    d: [f32; 16],
    dmin: [f32; 16],
}

const EMPTY: Panel = Panel {
    q: [ZERO; QK_K / 4],
    sc: [ZERO; 16],
    pc: [ZERO; 8],
    d: [0.0; 16],
    dmin: [0.0; 16],
};

/// Whether the panels handle weights of type `ty`.
pub fn supports(ty: GgmlType) -> bool {
    // The same types as the interleaved layout's (whose groups the panels also unpack).
    crate::kernels::cpu::repack::interleaves(ty)
}

/// Rows `rows` of a weight of type `ty` (Q4_0 or a K-quant; `row(r)`: its bytes) against every
/// token of `acts` (its `vec_dot_type`, AVX-512 CPUs only), written through
/// `put(token, row, value)`, sixteen rows at a time; returns the first row not done (`rows.end`
/// minus fewer than sixteen).
/// `extra`: the operator's [`PanelActs`] for `acts`.
pub(crate) fn run_rows<'w>(
    acts: &QuantizedActs,
    extra: &PanelActs,
    ty: GgmlType,
    row: impl Fn(usize) -> &'w [u8],
    rows: Range<usize>,
    put: impl Fn(usize, usize, f32),
) -> usize {
    run_blocks(acts, extra, ty, row, rows, block_tokens(acts), put)
}

/// Tokens per block of tokens: [`TOKEN_BLOCK_BYTES`] of `acts`, at least [`GROUP_TOKENS`].
fn block_tokens(acts: &QuantizedActs) -> usize {
    (TOKEN_BLOCK_BYTES / acts.row_bytes.max(1)).max(GROUP_TOKENS)
}

/// What the panels and `repack`'s kernels need of the activations beyond their blocks, computed
/// once per operator, token by token (`nb` per token): Q4_0's `-8 Σ y` of every Q8_0 block, and
/// every Q8_K block's 32-element sums paired as [`K4Head::mp`] ([`min_pairs`], for Q4_K).
pub(crate) struct PanelActs {
    pub(crate) nsum: Vec<i32>,
    pub(crate) min_pairs: Vec<[i32; 4]>,
}

impl PanelActs {
    pub(crate) fn new(acts: &QuantizedActs) -> PanelActs {
        let nsum = if acts.ty == GgmlType::Q8_0 {
            (0..acts.n_tok)
                .flat_map(|t| blocks::<BlockQ8_0>(acts.row(t)).iter())
                .map(|y| -8 * y.qs.iter().map(|&v| v as i32).sum::<i32>())
                .collect()
        } else {
            Vec::new()
        };
        let min_pairs = if acts.ty == GgmlType::Q8_K {
            (0..acts.n_tok)
                .flat_map(|t| blocks::<BlockQ8K>(acts.row(t)).iter())
                .map(min_pairs)
                .collect()
        } else {
            Vec::new()
        };
        PanelActs { nsum, min_pairs }
    }
}

/// [`run_rows`] with `block_tokens` tokens per block of tokens.
#[allow(clippy::too_many_arguments)]
fn run_blocks<'w>(
    acts: &QuantizedActs,
    extra: &PanelActs,
    ty: GgmlType,
    row: impl Fn(usize) -> &'w [u8],
    rows: Range<usize>,
    block_tokens: usize,
    put: impl Fn(usize, usize, f32),
) -> usize {
    assert!(
        supports(ty) && acts.ty == ty.vec_dot_type(),
        "kwide::run_rows on {ty} weights with {} activations",
        acts.ty
    );
    assert!(crate::kernels::cpu::Isa::Avx512.supported());
    if matches!(ty, GgmlType::Q4_0 | GgmlType::IQ4_NL) {
        let nl = ty == GgmlType::IQ4_NL;
        let nb = acts.k / QK;
        let nsum = &extra.nsum;
        assert_eq!(
            nsum.len(),
            acts.n_tok * nb,
            "kwide: PanelActs of other activations"
        );
        let unpack = |r: usize, p: &mut [Q4Panel]| {
            let w: [&[u8]; ROWS] = std::array::from_fn(|i| row(r + i));
            // SAFETY: AVX-512 is present (asserted above).
            unsafe { unpack_q4_0(&w, p, nl) }
        };
        let block = |p: &[Q4Panel], toks: Range<usize>, acc: &mut [[f32; ROWS]]| {
            // SAFETY: as above; the activation rows hold `nb` blocks (QuantizedActs).
            unsafe {
                if nl {
                    run_block_q4_0::<true>(p, acts, nsum, toks, acc)
                } else {
                    run_block_q4_0::<false>(p, acts, nsum, toks, acc)
                }
            }
        };
        return drive(
            acts.n_tok,
            nb,
            Q4_EMPTY,
            rows,
            block_tokens,
            put,
            unpack,
            block,
        );
    }
    let unpack = |r: usize, p: &mut [Panel]| {
        let w: [&[u8]; ROWS] = std::array::from_fn(|i| row(r + i));
        // SAFETY: AVX-512 is present (asserted above).
        unsafe { unpack_plain(ty, &w, p) }
    };
    run_k_panels(acts, ty, rows, block_tokens, put, unpack)
}

/// [`run_rows`] for K-quant weights in `repack`'s interleaved layout (`packed`, the whole
/// matrix): rows `rows`, in whole groups of sixteen.
pub(crate) fn run_interleaved(
    acts: &QuantizedActs,
    ty: GgmlType,
    packed: &[u8],
    rows: Range<usize>,
    put: impl Fn(usize, usize, f32),
) {
    assert!(
        supports(ty)
            && !matches!(ty, GgmlType::Q4_0 | GgmlType::IQ4_NL)
            && acts.ty == ty.vec_dot_type(),
        "kwide::run_interleaved on {ty} weights with {} activations",
        acts.ty
    );
    assert!(crate::kernels::cpu::Isa::Avx512.supported());
    assert!(rows.start.is_multiple_of(ROWS) && rows.end.is_multiple_of(ROWS));
    let rb = ty.row_bytes(acts.k).expect("whole blocks");
    assert!(rb > 0 && packed.len().is_multiple_of(ROWS * rb) && rows.end * rb <= packed.len());
    let slabs: Vec<_> =
        crate::kernels::cpu::repack::slabs(ty, acts.k / QK_K, packed.len() / rb).collect();
    let unpack = |r: usize, p: &mut [Panel]| {
        // Each slab's blocks of the sixteen rows from that slab's group.
        for sl in &slabs {
            // SAFETY: AVX-512 is present (asserted above); the group lies inside `packed`
            // (`Slab::group_of` slices it).
            unsafe {
                unpack_interleaved(ty, sl.group_of(packed, r / ROWS), &mut p[sl.b0..][..sl.nb])
            }
        }
    };
    run_k_panels(acts, ty, rows, block_tokens(acts), put, unpack);
}

/// The K-quants' panels over rows `rows`, each sixteen unpacked by `unpack(first row, panels)`
/// (AVX-512 CPUs only: the callers assert it).
fn run_k_panels(
    acts: &QuantizedActs,
    ty: GgmlType,
    rows: Range<usize>,
    block_tokens: usize,
    put: impl Fn(usize, usize, f32),
    unpack: impl Fn(usize, &mut [Panel]),
) -> usize {
    let nb = acts.k / QK_K;
    let block = |p: &[Panel], toks: Range<usize>, acc: &mut [[f32; ROWS]]| {
        // SAFETY: AVX-512 is present (the callers assert it); the activation rows hold `nb`
        // blocks (QuantizedActs).
        unsafe {
            match ty {
                GgmlType::Q3_K | GgmlType::Q6_K => run_block::<16, false>(p, acts, toks, acc),
                GgmlType::IQ4_XS => run_block::<32, false>(p, acts, toks, acc),
                GgmlType::Q2_K => run_block::<16, true>(p, acts, toks, acc),
                _ => run_block::<32, true>(p, acts, toks, acc),
            }
        }
    };
    drive(
        acts.n_tok,
        nb,
        EMPTY,
        rows,
        block_tokens,
        put,
        unpack,
        block,
    )
}

/// The loop shared by the formats: per sixteen rows, `unpack` every block into a panel, then
/// per block of tokens `block` the dot products into `acc` and `put` them out.
#[allow(clippy::too_many_arguments)]
fn drive<P: Copy>(
    n_tok: usize,
    nb: usize,
    empty: P,
    rows: Range<usize>,
    block_tokens: usize,
    put: impl Fn(usize, usize, f32),
    unpack: impl Fn(usize, &mut [P]),
    block: impl Fn(&[P], Range<usize>, &mut [[f32; ROWS]]),
) -> usize {
    let mut panels = vec![empty; nb];
    let mut acc = vec![[0f32; ROWS]; block_tokens.min(n_tok)];
    let mut r = rows.start;
    while r + ROWS <= rows.end {
        unpack(r, &mut panels);
        let mut t0 = 0;
        while t0 < n_tok {
            let toks = t0..(t0 + block_tokens).min(n_tok);
            let acc = &mut acc[..toks.len()];
            block(&panels, toks.clone(), acc);
            for (t, a) in toks.clone().zip(acc.iter()) {
                for (i, &v) in a.iter().enumerate() {
                    put(t, r + i, v);
                }
            }
            t0 = toks.end;
        }
        r += ROWS;
    }
    r
}

/// Unpacks sixteen rows' super-blocks (the file's layout) into `panels`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn unpack_plain(ty: GgmlType, rows: &[&[u8]; ROWS], panels: &mut [Panel]) {
    use crate::kernels::cpu::avx512;
    // Row r's quants in element order: quarters 4r..4r + 4.
    let mut natural = [_mm512_setzero_si512(); 4 * ROWS];
    let size = ty.type_size();
    for (b, p) in panels.iter_mut().enumerate() {
        for (r, &row) in rows.iter().enumerate() {
            let z = match ty {
                GgmlType::Q2_K => avx512::q2_quants(&blocks::<BlockQ2K>(row)[b]),
                GgmlType::Q3_K => avx512::q3_quants(&blocks::<BlockQ3K>(row)[b]),
                GgmlType::Q4_K => avx512::k4_quants(&blocks::<BlockQ4K>(row)[b]),
                GgmlType::Q5_K => avx512::k4_quants(&blocks::<BlockQ5K>(row)[b]),
                GgmlType::Q6_K => avx512::q6_quants(&blocks::<BlockQ6K>(row)[b]),
                GgmlType::IQ4_XS => iq4_xs_quants(&blocks::<BlockIQ4XS>(row)[b]),
                other => unreachable!("kwide unpack of {other}"),
            };
            natural[4 * r..4 * r + 4].copy_from_slice(&z);
        }
        for u in 0..4 {
            let a: [__m512i; 16] = std::array::from_fn(|r| natural[4 * r + u]);
            for (c, v) in transpose16(a).into_iter().enumerate() {
                store(&mut p.q[16 * u + c], v);
            }
        }
        // The 32-bit word at byte `off` of each row's block, lane by lane (inside the block).
        let words = |off: usize| -> __m512i {
            let w: [i32; ROWS] = std::array::from_fn(|r| {
                let at = b * size + off;
                i32::from_le_bytes(rows[r][at..at + 4].try_into().unwrap())
            });
            _mm512_loadu_si512(w.as_ptr().cast())
        };
        match ty {
            GgmlType::Q4_K | GgmlType::Q5_K => {
                fill_k4(p, [words(0), words(4), words(8), words(12)]);
            }
            GgmlType::IQ4_XS => fill_iq4_xs(p, words(0), words(4)),
            GgmlType::Q6_K => {
                // Sixteen i8 scales at 192; d at 208, the top half of the word at 206.
                let d = _mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(words(206)));
                fill_q6(p, std::array::from_fn(|i| words(192 + 4 * i)), d);
            }
            GgmlType::Q2_K => {
                let xs: [&BlockQ2K; ROWS] = std::array::from_fn(|r| &blocks(rows[r])[b]);
                fill_small(
                    p,
                    |r, j| i32::from(xs[r].scales[j] & 0x0F),
                    |r, j| i32::from(xs[r].scales[j] >> 4),
                    |r| (xs[r].d, xs[r].dmin),
                );
            }
            GgmlType::Q3_K => {
                let xs: [&BlockQ3K; ROWS] = std::array::from_fn(|r| &blocks(rows[r])[b]);
                let sc: [[i8; 16]; ROWS] =
                    std::array::from_fn(|r| crate::kernels::cpu::kquants::q3_scales(&xs[r].scales));
                fill_small(
                    p,
                    |r, j| i32::from(sc[r][j]),
                    |r, j| -4 * i32::from(sc[r][j]),
                    |r| (xs[r].d, F16Le::from_f32(0.0)),
                );
            }
            other => unreachable!("kwide unpack of {other}"),
        }
    }
}

/// Sixteen rows' super-blocks from a group of `repack`'s interleaved layout (Q4_K or Q6_K)
/// into `panels`: the layout already holds each 32-bit word of the sixteen rows in one register.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn unpack_interleaved(ty: GgmlType, group: &[u8], panels: &mut [Panel]) {
    use crate::kernels::cpu::repack::{
        IQ4_XS_WORDS, K4_WORDS, Q2_WORDS, Q3_GROUP_BLOCK, Q5_WORDS, Q6_GROUP_BLOCK, Q6_WORDS,
        SCALES, q2_head, q2_quants, q3_lane_scales, q3_quants, q3_slot, q5_quants, q6_quants,
        q6_word, q6_words,
    };
    let nb = panels.len();
    let (stride, d_after) = match ty {
        GgmlType::Q2_K => (ROWS * 4 * Q2_WORDS, false),
        GgmlType::Q3_K => (Q3_GROUP_BLOCK, true),
        GgmlType::Q4_K => (ROWS * 4 * K4_WORDS, false),
        GgmlType::Q5_K => (ROWS * 4 * Q5_WORDS, false),
        GgmlType::Q6_K => (Q6_GROUP_BLOCK, true),
        GgmlType::IQ4_XS => (ROWS * 4 * IQ4_XS_WORDS, false),
        other => unreachable!("kwide: no interleaved {other}"),
    };
    assert!(group.len() >= nb * stride + if d_after { nb * SCALES } else { 0 });
    // The sixteen rows' `d` of block b, when they follow the group's blocks.
    let d_after =
        |b: usize| _mm256_loadu_si256(group.as_ptr().add(nb * stride + b * SCALES).cast());
    for (b, p) in panels.iter_mut().enumerate() {
        let at = group.as_ptr().add(b * stride);
        let word = |w: usize| _mm512_loadu_si512(at.add(64 * w).cast());
        match ty {
            GgmlType::Q2_K => {
                store_planes(
                    p,
                    |h| std::array::from_fn(|c| word(4 + 8 * h + c)),
                    |v, g| q2_quants(v, g),
                );
                let (sc, pairs) = q2_head(std::array::from_fn(word));
                fill_lanes(p, sc, pairs);
                let dd = word(Q2_WORDS - 1);
                _mm512_store_ps(p.d.as_mut_ptr(), _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dd)));
                let dmin = _mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(dd));
                _mm512_store_ps(p.dmin.as_mut_ptr(), _mm512_cvtph_ps(dmin));
                continue;
            }
            GgmlType::Q3_K => {
                let word = |w: usize| _mm512_loadu_si512(at.add(64 * q3_slot(w)).cast());
                let hm = std::array::from_fn(word);
                let qs = |h: usize| std::array::from_fn(|c| word(8 + 8 * h + c));
                store_planes(p, qs, |v, g| q3_quants(v, &hm, g));
                let sc = q3_lane_scales([word(24), word(25), word(26)]);
                fill_lanes(p, sc, offset_pairs::<2>(&sc));
                _mm512_store_ps(p.d.as_mut_ptr(), _mm512_cvtph_ps(d_after(b)));
                continue;
            }
            GgmlType::IQ4_XS => {
                use crate::kernels::cpu::repack::{iq4_bytes, iq4_table};
                let (table, low) = (iq4_table(), _mm512_set1_epi8(0x0F));
                // Word 2 + 4j + c: elements 32j + 4c.. (low nibbles) and 32j + 16 + 4c.. (high).
                for j in 0..8 {
                    for c in 0..4 {
                        let v = word(2 + 4 * j + c);
                        store(&mut p.q[8 * j + c], iq4_bytes(v, false, table, low));
                        store(&mut p.q[8 * j + 4 + c], iq4_bytes(v, true, table, low));
                    }
                }
                fill_iq4_xs(p, word(0), word(1));
                continue;
            }
            GgmlType::Q5_K => {
                let qh = std::array::from_fn(|c| word(4 + c));
                for pair in 0..4 {
                    let v = std::array::from_fn(|c| word(12 + 8 * pair + c));
                    for half in 0..2 {
                        let j = 2 * pair + half;
                        for (c, z) in q5_quants(&v, &qh, j).into_iter().enumerate() {
                            store(&mut p.q[8 * j + c], z);
                        }
                    }
                }
                fill_k4(p, [word(0), word(1), word(2), word(3)]);
                continue;
            }
            _ => {}
        }
        if ty == GgmlType::Q4_K {
            // Quant word 4 + 8 pair + c: elements 64 pair + 4c.. (low nibbles) and
            // 64 pair + 32 + 4c.. (high).
            let low = _mm512_set1_epi8(0x0F);
            for pair in 0..4 {
                for c in 0..8 {
                    let v = word(4 + 8 * pair + c);
                    store(&mut p.q[16 * pair + c], _mm512_and_si512(v, low));
                    let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), low);
                    store(&mut p.q[16 * pair + 8 + c], hi);
                }
            }
            fill_k4(p, [word(0), word(1), word(2), word(3)]);
            continue;
        }
        for h in 0..2 {
            for s in 0..2 {
                let ws = q6_words(at, h, s);
                for k in 0..4 {
                    for (i, z) in q6_quants(&ws, k).into_iter().enumerate() {
                        store(&mut p.q[32 * h + 8 * k + 4 * s + i], z);
                    }
                }
            }
        }
        let d = _mm256_loadu_si256(group.as_ptr().add(nb * Q6_GROUP_BLOCK + b * SCALES).cast());
        fill_q6(p, std::array::from_fn(|i| q6_word(at, Q6_WORDS - 4 + i)), d);
    }
}

/// The quants of a Q2_K / Q3_K panel: for each half h of the block, its eight `qs` words
/// (`words(h)`), and from them each 32-element group `g = 4 h + plane` (`quants(words, g)`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn store_planes(
    p: &mut Panel,
    words: impl Fn(usize) -> [__m512i; 8],
    quants: impl Fn(&[__m512i; 8], usize) -> [__m512i; 8],
) {
    for h in 0..2 {
        let v = words(h);
        for g in 4 * h..4 * h + 4 {
            for (c, z) in quants(&v, g).into_iter().enumerate() {
                store(&mut p.q[8 * g + c], z);
            }
        }
    }
}

/// A panel's sixteen group scales and eight correction pairs, lane r for row r.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn fill_lanes(p: &mut Panel, sc: [__m512i; 16], pairs: [__m512i; 8]) {
    for (l, v) in p.sc.iter_mut().zip(sc) {
        store(l, v);
    }
    for (l, v) in p.pc.iter_mut().zip(pairs) {
        store(l, v);
    }
}

/// A Q4_K / Q5_K panel's scales, corrections (mins), `d` and `dmin` from the sixteen rows'
/// first four words of the block.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn fill_k4(p: &mut Panel, head: [__m512i; 4]) {
    let h = k4_head(head);
    _mm512_store_ps(p.d.as_mut_ptr(), h.d);
    _mm512_store_ps(p.dmin.as_mut_ptr(), h.dmin);
    for j in 0..8 {
        store(&mut p.sc[j], h.sc[j]);
        store(
            &mut p.pc[j],
            _mm512_or_si512(h.m[j], _mm512_slli_epi32::<16>(h.m[j])),
        );
    }
}

/// A Q6_K panel's scales, corrections (`-32 sc`) and `d` from the sixteen rows' four words of
/// scales `sw` and their `d` (f16).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn fill_q6(p: &mut Panel, sw: [__m512i; 4], d: __m256i) {
    _mm512_store_ps(p.d.as_mut_ptr(), _mm512_cvtph_ps(d));
    let sc: [__m512i; 16] = std::array::from_fn(|j| signed_byte(sw[j / 4], j % 4));
    fill_lanes(p, sc, offset_pairs::<5>(&sc));
}

/// An IQ4_XS panel's scales (`ls_j - 32`, groups of 32), corrections (`-128 sc_j` for both
/// 16-element halves of group j: its quants enter as `v + 128`) and `d`, from the sixteen rows'
/// first word (`d`, `scales_h`) and second (`scales_l`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn fill_iq4_xs(p: &mut Panel, head: __m512i, scales_l: __m512i) {
    _mm512_store_ps(
        p.d.as_mut_ptr(),
        _mm512_cvtph_ps(_mm512_cvtepi32_epi16(head)),
    );
    for j in 0..8 {
        let sc = crate::kernels::cpu::repack::iq4_xs_scale(head, scales_l, j);
        store(&mut p.sc[j], sc);
        // -128 sc (within i16) in both halves.
        let c = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32::<7>(sc));
        let c = _mm512_and_si512(c, _mm512_set1_epi32(0xFFFF));
        store(&mut p.pc[j], _mm512_or_si512(c, _mm512_slli_epi32::<16>(c)));
    }
}

/// An IQ4_XS super-block's 256 quants as `IQ4_VALUES + 128` in element order (four quarters).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn iq4_xs_quants(x: &BlockIQ4XS) -> [__m512i; 4] {
    use crate::kernels::cpu::avx2::nibbles32;
    let table = crate::kernels::cpu::repack::iq4_table();
    std::array::from_fn(|u| {
        let half = |h: usize| nibbles32(x.group(2 * u + h));
        let v = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(half(0)), half(1));
        _mm512_shuffle_epi8(table, v)
    })
}

/// The corrections `-2^S sc_j` of the types whose quants enter offset by `2^S` (Q3_K: 4, Q6_K:
/// 32), groups 2k and 2k + 1 as the low and high 16 bits of pair k's lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn offset_pairs<const S: u32>(sc: &[__m512i; 16]) -> [__m512i; 8] {
    let neg = |v| {
        _mm512_sub_epi32(
            _mm512_setzero_si512(),
            _mm512_sll_epi32(v, _mm_cvtsi32_si128(S as i32)),
        )
    };
    std::array::from_fn(|k| {
        let lo = _mm512_and_si512(neg(sc[2 * k]), _mm512_set1_epi32(0xFFFF));
        _mm512_or_si512(lo, _mm512_slli_epi32::<16>(neg(sc[2 * k + 1])))
    })
}

/// A Q2_K / Q3_K panel (sixteen groups of sixteen) from row r's group scales `sc(r, j)`, group
/// corrections `pc(r, j)` (Q2_K's mins, Q3_K's `-4 sc`; within i16) and `(d, dmin)`, gathered
/// row by row.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn fill_small(
    p: &mut Panel,
    sc: impl Fn(usize, usize) -> i32,
    pc: impl Fn(usize, usize) -> i32,
    d: impl Fn(usize) -> (F16Le, F16Le),
) {
    for r in 0..ROWS {
        let (dr, mr) = d(r);
        p.d[r] = dr.to_f32();
        p.dmin[r] = mr.to_f32();
        for j in 0..16 {
            p.sc[j].0[r] = sc(r, j);
        }
        for k in 0..8 {
            p.pc[k].0[r] = (pc(r, 2 * k) & 0xFFFF) | (pc(r, 2 * k + 1) << 16);
        }
    }
}

/// A Q4_K / Q5_K super-block's head for sixteen rows: `d`, `dmin`, and per 32-element group j
/// the 6-bit scale and min as 32-bit lanes.
pub(crate) struct K4Head {
    pub(crate) d: __m512,
    pub(crate) dmin: __m512,
    pub(crate) sc: [__m512i; 8],
    pub(crate) m: [__m512i; 8],
    /// The mins in 16-bit pairs `(m0, m2)`, `(m1, m3)`, `(m4, m6)`, `(m5, m7)` (for `vpdpwssd`
    /// against the activation's 32-element sums paired alike, [`min_pairs`]).
    pub(crate) mp: [__m512i; 4],
}

/// A Q8_K block's 32-element sums `B_j` (from its 16-element `bsums`) as the 16-bit pairs of
/// [`K4Head::mp`]: `(B0, B2)`, `(B1, B3)`, `(B4, B6)`, `(B5, B7)`, each `|B_j| <= 32 * 128`.
#[inline(always)]
fn min_pairs(y: &BlockQ8K) -> [i32; 4] {
    let b = |j: usize| i32::from(y.bsums[2 * j].get()) + i32::from(y.bsums[2 * j + 1].get());
    let pair = |lo: usize, hi: usize| (b(lo) & 0xFFFF) | (b(hi) << 16);
    [pair(0, 2), pair(1, 3), pair(4, 6), pair(5, 7)]
}

/// [`K4Head`] from the block's first four 32-bit words, lane r holding row r's (d and dmin, then
/// twelve bytes of packed scales and mins, unpacked as `kquants::k4_scales` does, lane-wise).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn k4_head(words: [__m512i; 4]) -> K4Head {
    let [head, w0, w1, w2] = words;
    let f16s = |v: __m512i| _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v));
    let k = |v: u32| _mm512_set1_epi32(v as i32);
    let (low6, low4, low2) = (k(0x3F3F_3F3F), k(0x0F0F_0F0F), k(0x0303_0303));
    let top2 = |w| _mm512_slli_epi32::<4>(_mm512_and_si512(_mm512_srli_epi32::<6>(w), low2));
    let sc_lo = _mm512_and_si512(w0, low6);
    let sc_hi = _mm512_or_si512(_mm512_and_si512(w2, low4), top2(w0));
    let m_lo = _mm512_and_si512(w1, low6);
    let m_hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32::<4>(w2), low4), top2(w1));
    K4Head {
        d: f16s(head),
        dmin: f16s(_mm512_srli_epi32::<16>(head)),
        sc: std::array::from_fn(|j| byte(if j < 4 { sc_lo } else { sc_hi }, j % 4)),
        m: std::array::from_fn(|j| byte(if j < 4 { m_lo } else { m_hi }, j % 4)),
        mp: std::array::from_fn(|i| {
            let m = if i < 2 { m_lo } else { m_hi };
            let m = if i % 2 == 0 {
                m
            } else {
                _mm512_srli_epi32::<8>(m)
            };
            _mm512_and_si512(m, k(0x00FF_00FF))
        }),
    }
}

/// Byte `i` of every 32-bit lane, zero-extended.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn byte(w: __m512i, i: usize) -> __m512i {
    let shifted = _mm512_srlv_epi32(w, _mm512_set1_epi32(8 * i as i32));
    _mm512_and_si512(shifted, _mm512_set1_epi32(0xFF))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn store(l: &mut Lanes, v: __m512i) {
    _mm512_store_si512(l.0.as_mut_ptr().cast(), v)
}

/// The transpose of a 16 x 16 matrix of 32-bit words, one row per register.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn transpose16(a: [__m512i; 16]) -> [__m512i; 16] {
    // Within 128-bit lanes: t[2i] = [a2i.0 a2i+1.0 a2i.1 a2i+1.1], t[2i + 1] words 2 and 3.
    let t: [__m512i; 16] = std::array::from_fn(|i| {
        let (x, y) = (a[i & !1], a[i | 1]);
        if i % 2 == 0 {
            _mm512_unpacklo_epi32(x, y)
        } else {
            _mm512_unpackhi_epi32(x, y)
        }
    });
    // u[4i + m], 128-bit lane L: rows 4i..4i + 4 of column 4L + m.
    let u: [__m512i; 16] = std::array::from_fn(|j| {
        let (i, m) = (j / 4, j % 4);
        let (x, y) = (t[4 * i + m / 2], t[4 * i + 2 + m / 2]);
        if m % 2 == 0 {
            _mm512_unpacklo_epi64(x, y)
        } else {
            _mm512_unpackhi_epi64(x, y)
        }
    });
    // The 4 x 4 transpose of 128-bit lanes: out[4L + m], lane i = u[4i + m], lane L.
    let mut out = [_mm512_setzero_si512(); 16];
    for m in 0..4 {
        let v0 = _mm512_shuffle_i32x4::<0b01_00_01_00>(u[m], u[4 + m]);
        let v1 = _mm512_shuffle_i32x4::<0b11_10_11_10>(u[m], u[4 + m]);
        let v2 = _mm512_shuffle_i32x4::<0b01_00_01_00>(u[8 + m], u[12 + m]);
        let v3 = _mm512_shuffle_i32x4::<0b11_10_11_10>(u[8 + m], u[12 + m]);
        out[m] = _mm512_shuffle_i32x4::<0b10_00_10_00>(v0, v2);
        out[4 + m] = _mm512_shuffle_i32x4::<0b11_01_11_01>(v0, v2);
        out[8 + m] = _mm512_shuffle_i32x4::<0b10_00_10_00>(v1, v3);
        out[12 + m] = _mm512_shuffle_i32x4::<0b11_01_11_01>(v1, v3);
    }
    out
}

/// Tokens `toks` of `acts` against every super-block of `panels`: `acc[t - toks.start]` gets
/// the sixteen rows' dot products with token t. `G`: elements per scale group (32 for Q4_K /
/// Q5_K, 16 for Q6_K); `MINS`: the corrections are mins (into `imin`) rather than part of `isum`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn run_block<const G: usize, const MINS: bool>(
    panels: &[Panel],
    acts: &QuantizedActs,
    toks: Range<usize>,
    acc: &mut [[f32; ROWS]],
) {
    for a in acc.iter_mut() {
        *a = [0.0; ROWS];
    }
    let block = |t: usize, b: usize| -> &BlockQ8K { &blocks::<BlockQ8K>(acts.row(t))[b] };
    for (b, p) in panels.iter().enumerate() {
        let mut t = toks.start;
        while t + GROUP_TOKENS <= toks.end {
            let ys: [&BlockQ8K; GROUP_TOKENS] = std::array::from_fn(|i| block(t + i, b));
            let a = &mut acc[t - toks.start..][..GROUP_TOKENS];
            step::<G, MINS, GROUP_TOKENS>(p, ys, a.try_into().unwrap());
            t += GROUP_TOKENS;
        }
        while t < toks.end {
            let a = &mut acc[t - toks.start..][..1];
            step::<G, MINS, 1>(p, [block(t, b)], a.try_into().unwrap());
            t += 1;
        }
    }
}

/// One super-block of `NT` tokens: the canonical step onto each token's sixteen sums.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn step<const G: usize, const MINS: bool, const NT: usize>(
    p: &Panel,
    ys: [&BlockQ8K; NT],
    acc: &mut [[f32; ROWS]; NT],
) {
    let lanes = |l: &Lanes| _mm512_load_si512(l.0.as_ptr().cast());
    let word = |y: &BlockQ8K, at: usize| -> __m512i {
        _mm512_set1_epi32(std::ptr::read_unaligned(
            y.qs.as_ptr().add(at).cast::<i32>(),
        ))
    };
    let mut isum = [_mm512_setzero_si512(); NT];
    let mut imin = [_mm512_setzero_si512(); NT];
    let per = G / 4;
    for j in 0..QK_K / G {
        let w: [__m512i; 8] = std::array::from_fn(|e| {
            if e < per {
                lanes(&p.q[j * per + e])
            } else {
                _mm512_setzero_si512()
            }
        });
        let sc = lanes(&p.sc[j]);
        for t in 0..NT {
            let mut s = _mm512_setzero_si512();
            for (e, &we) in w.iter().enumerate().take(per) {
                s = _mm512_dpbusd_epi32(s, we, word(ys[t], j * G + 4 * e));
            }
            isum[t] = _mm512_add_epi32(isum[t], _mm512_mullo_epi32(s, sc));
        }
    }
    for t in 0..NT {
        let bsums = ys[t].bsums.as_ptr().cast::<i32>();
        let mut c = if MINS { imin[t] } else { isum[t] };
        for k in 0..8 {
            let pair = _mm512_set1_epi32(std::ptr::read_unaligned(bsums.add(k)));
            c = _mm512_dpwssd_epi32(c, lanes(&p.pc[k]), pair);
        }
        if MINS {
            imin[t] = c;
        } else {
            isum[t] = c;
        }
    }
    let d_x = _mm512_load_ps(p.d.as_ptr());
    let dmin_x = _mm512_load_ps(p.dmin.as_ptr());
    for t in 0..NT {
        let d_y = _mm512_set1_ps(ys[t].d.get());
        let sumf = _mm512_loadu_ps(acc[t].as_ptr());
        let sumf = _mm512_fmadd_ps(_mm512_mul_ps(d_y, d_x), _mm512_cvtepi32_ps(isum[t]), sumf);
        let sumf = if MINS {
            _mm512_fnmadd_ps(
                _mm512_mul_ps(d_y, dmin_x),
                _mm512_cvtepi32_ps(imin[t]),
                sumf,
            )
        } else {
            sumf
        };
        _mm512_storeu_ps(acc[t].as_mut_ptr(), sumf);
    }
}

// ---------------------------------------------------------------------------------------------
// Q4_0 (against Q8_0 activations): per block of 32, eight `vpdpbusd` from `-8 Σy` give the exact
// `isum = Σ (q - 8) y` of each row in its lane, then `scalar`'s one FMA per block.

/// One Q4_0 block of sixteen rows: `q[e]`, lane r, row r's elements `4e..4e + 4` as unsigned
/// nibbles; `d` the rows' scales.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Q4Panel {
    q: [Lanes; QK / 4],
    d: [f32; 16],
}

const Q4_EMPTY: Q4Panel = Q4Panel {
    q: [ZERO; QK / 4],
    d: [0.0; 16],
};

/// Unpacks sixteen Q4_0 rows' blocks into `panels`, two blocks per transpose.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn unpack_q4_0(rows: &[&[u8]; ROWS], panels: &mut [Q4Panel], nl: bool) {
    use crate::kernels::cpu::avx2::nibbles32;
    let table = crate::kernels::cpu::repack::iq4_table();
    let xs: [&[BlockQ4_0]; ROWS] = rows.map(blocks::<BlockQ4_0>);
    let nb = panels.len();
    for b in (0..nb).step_by(2) {
        // Lane r: row r's blocks b and b + 1 (zero past the end) in element order.
        let natural: [__m512i; ROWS] = std::array::from_fn(|r| {
            let lo = nibbles32(&xs[r][b].qs);
            let hi = if b + 1 < nb {
                nibbles32(&xs[r][b + 1].qs)
            } else {
                _mm256_setzero_si256()
            };
            _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
        });
        let mut t = transpose16(natural);
        if nl {
            t = t.map(|v| _mm512_shuffle_epi8(table, v));
        }
        for (i, p) in panels[b..(b + 2).min(nb)].iter_mut().enumerate() {
            for (e, q) in p.q.iter_mut().enumerate() {
                store(q, t[8 * i + e]);
            }
            let d: [u16; ROWS] = std::array::from_fn(|r| xs[r][b + i].d.bits());
            let d = _mm256_loadu_si256(d.as_ptr().cast());
            _mm512_store_ps(p.d.as_mut_ptr(), _mm512_cvtph_ps(d));
        }
    }
}

/// Tokens `toks` of `acts` against every block of `panels`, eight tokens at a time with their
/// sums in registers across the blocks; `acc[t - toks.start]` gets token t's sixteen sums.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn run_block_q4_0<const NL: bool>(
    panels: &[Q4Panel],
    acts: &QuantizedActs,
    nsum: &[i32],
    toks: Range<usize>,
    acc: &mut [[f32; ROWS]],
) {
    let nb = panels.len();
    let mut t = toks.start;
    while t < toks.end {
        let a = &mut acc[t - toks.start..];
        if t + GROUP_TOKENS <= toks.end {
            let ys = std::array::from_fn(|i| blocks::<BlockQ8_0>(acts.row(t + i)));
            let ns = std::array::from_fn(|i| &nsum[(t + i) * nb..][..nb]);
            q4_0_tokens::<GROUP_TOKENS, NL>(
                panels,
                ys,
                ns,
                (&mut a[..GROUP_TOKENS]).try_into().unwrap(),
            );
            t += GROUP_TOKENS;
        } else {
            let ys = [blocks::<BlockQ8_0>(acts.row(t))];
            let ns = [&nsum[t * nb..][..nb]];
            q4_0_tokens::<1, NL>(panels, ys, ns, (&mut a[..1]).try_into().unwrap());
            t += 1;
        }
    }
}

/// `NT` tokens against every block of `panels`: per block and token, the exact `isum` of each
/// row from `-8 Σy` and eight `vpdpbusd`, then `sumf = fma(d_x * d_y, isum, sumf)`. `NL`
/// (IQ4_NL): the panel's quants are `IQ4_VALUES + 128`, from `-128 Σy`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q4_0_tokens<const NT: usize, const NL: bool>(
    panels: &[Q4Panel],
    ys: [&[BlockQ8_0]; NT],
    nsum: [&[i32]; NT],
    acc: &mut [[f32; ROWS]; NT],
) {
    let mut sumf = [_mm512_setzero_ps(); NT];
    for (b, p) in panels.iter().enumerate() {
        let w: [__m512i; QK / 4] =
            std::array::from_fn(|e| _mm512_load_si512(p.q[e].0.as_ptr().cast()));
        let d_x = _mm512_load_ps(p.d.as_ptr());
        for t in 0..NT {
            let y = &ys[t][b];
            let ns = if NL { 16 * nsum[t][b] } else { nsum[t][b] };
            let mut s = _mm512_set1_epi32(ns);
            for (e, &we) in w.iter().enumerate() {
                let word = std::ptr::read_unaligned(y.qs.as_ptr().add(4 * e).cast::<i32>());
                s = _mm512_dpbusd_epi32(s, we, _mm512_set1_epi32(word));
            }
            let d = _mm512_mul_ps(d_x, crate::kernels::cpu::avx2::h2f_splat16(y.d));
            sumf[t] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(s), sumf[t]);
        }
    }
    for t in 0..NT {
        _mm512_storeu_ps(acc[t].as_mut_ptr(), sumf[t]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu::{Isa, dot_fn};
    use crate::rng::SplitMix64;

    /// Every panel output equals the canonical scalar dot's bits, for token blocks smaller than,
    /// equal to and larger than the token count, whole and partial token groups, and the rows
    /// past the last whole panel left to the caller.
    #[test]
    fn panels_equal_the_scalar_dots() {
        if !Isa::Avx512.supported() {
            eprintln!("skipped: this CPU has no AVX-512");
            return;
        }
        let mut rng = SplitMix64::new(11);
        for ty in [
            GgmlType::Q4_0,
            GgmlType::IQ4_NL,
            GgmlType::Q2_K,
            GgmlType::Q3_K,
            GgmlType::Q4_K,
            GgmlType::Q5_K,
            GgmlType::Q6_K,
            GgmlType::IQ4_XS,
        ] {
            let n = 37;
            // Q4_0, IQ4_NL: 25 blocks, the last panel's transpose half empty.
            let k = if ty.block_size() == 32 { 800 } else { 768 };
            let rb = ty.row_bytes(k).unwrap();
            let w = super::super::random_rows(ty, k, n, &mut rng);
            for n_tok in [1, 9, 21] {
                let x: Vec<f32> = (0..k * n_tok)
                    .map(|i| ((i as f32) * 0.731).sin() * 3.0 + 0.2)
                    .collect();
                let acts = QuantizedActs::new(ty, &x, k).unwrap();
                let dot = dot_fn(Isa::Scalar, ty);
                for block_tokens in [3, 8, 1000] {
                    let out = std::sync::Mutex::new(vec![f32::NAN; n * n_tok]);
                    let row = |r: usize| &w[r * rb..(r + 1) * rb];
                    let put = |t: usize, r: usize, v: f32| out.lock().unwrap()[t * n + r] = v;
                    let extra = PanelActs::new(&acts);
                    let done = run_blocks(&acts, &extra, ty, row, 2..n, block_tokens, put);
                    assert_eq!(done, 34, "{ty}: two panels from row 2");
                    let out = out.into_inner().unwrap();
                    for t in 0..n_tok {
                        for r in 0..n {
                            let got = out[t * n + r];
                            if !(2..34).contains(&r) {
                                assert!(got.is_nan(), "{ty} row {r} written");
                                continue;
                            }
                            // SAFETY: the scalar variant runs everywhere.
                            let want = unsafe { dot(row(r), acts.row(t), k) };
                            assert_eq!(
                                got.to_bits(),
                                want.to_bits(),
                                "{ty} token {t} of {n_tok} row {r}, block {block_tokens}: {got} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }
}

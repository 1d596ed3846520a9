//! Q4_0, K-quant (Q2_K..Q6_K) and IQ4_NL / IQ4_XS weights kept by the CPU in a layout of its own, rows interleaved by sixteen
//! (AVX-512 CPUs): one 512-bit register holds four quant bytes of each of sixteen rows, lane r
//! being row r. A dot product then needs no sum across lanes. Q4_0: per block and token, eight
//! `vpdpbusd` of the unpacked nibbles with the token's four bytes broadcast, started from the
//! block's `-8 Σy`, give the sixteen rows' exact `isum`; the float step is the single-row
//! kernel's, lane by lane,
//!
//! ```text
//! sumf = fma(d_x * d_y, isum as f32, sumf)        (block order)
//! ```
//!
//! so every output has the bits of `scalar::vec_dot_q4_0_q8_0`. The K-quants likewise with
//! `kquants`' integer sums and canonical step (`tokens_q2_k` .. `tokens_q6_k`). The four-row
//! kernels these replace (`avx512::rows_q4_0`, `rows_k4`, `rows_q6_k`, ...) spend most of their time
//! summing lanes across registers, which Zen 4's shuffle port bounds at about 20–30 GB/s of
//! weights per core; llama.cpp repacks Q4_0 and Q4_K for the same reason.
//!
//! Rows longer than [`SLAB`] (2048) columns are cut into column slabs of that many (the last one
//! narrower), each laid out as a matrix of its own and stored one after the other; kernels go
//! slab by slab, carrying each output from one to the next, so every sum keeps its block order.
//! Layouts, per group of sixteen rows with `nb` blocks each (in one slab). Q4_0: blocks in
//! pairs, 256 bytes of quants for each block of the pair, then 32 bytes of scales for each (a
//! last unpaired block: its quants, its scales), so that a group is one forward stream. Block
//! b's quants are four 64-byte chunks, chunk c holding in lane r bytes `4c..4c + 4` of row r's
//! block b (low nibbles: elements `4c..4c + 4`, high nibbles: `16 + 4c..20 + 4c`), its scales
//! the sixteen rows' `d` (f16). Q4_K: block b takes
//! `2304` bytes, its 32-bit word w (d and dmin, three words of packed scales, 32 of quants) at
//! `64 w`, lane r; Q2_K (21 words, 1344 bytes) and Q5_K (44 words, 2816 bytes) alike. Q3_K:
//! block b takes `1728` bytes, its 27 words at `64 q3_slot(w)` (the three of scales first, then
//! `hmask`, then `qs`), lane r, and the sixteen rows' `d` (f16) follow all the group's blocks.
//! Q6_K: block b takes `3328` bytes, its 52 words (32 of `ql`, 16 of `qh`, four
//! of scales) at `64 q6_slot(w)` (the order the kernels read them), lane r, and the sixteen
//! rows' `d` (f16) follow all the group's blocks. IQ4_NL: Q4_0's layout (its blocks are Q4_0's
//! bytes); IQ4_XS: 34 words a block (`d` and `scales_h`, `scales_l`, 32 of quants) as Q4_K's.
//! A group takes the bytes of its sixteen rows, so the repacked matrix has the file's size.

use crate::error::{Error, Result};
use crate::quant::GgmlType;

/// Rows per group: one 32-bit lane each.
pub const ROWS: usize = 16;

/// Bytes of one Q4_0 block.
const BLOCK: usize = 18;

/// Bytes of one block's quants for the group.
pub(crate) const QUANTS: usize = 256;

/// Bytes of one block's scales for the group.
pub(crate) const SCALES: usize = 32;

/// Columns of a slab: a matrix with longer rows is kept as slabs of this many columns side by
/// side (the last one narrower), each interleaved as a matrix of its own and stored after the one
/// before, and decode reads one slab's rows after the other's, each output carried from slab to
/// slab (so every sum keeps its block order and bits). Out of cache, 1 EPYC thread, one group
/// at a time, the kernels read rows of up to 2048 at the plain read's rate and longer ones far
/// below it (`examples/matmul_dram`, fraction of the plain read): Q6_K K 2048 / 2560 / 3072 x N
/// 16384 0.94 / 1.00 / 1.00, K 3584 0.80, K 4096 / 4608 / 5120 0.68 / 0.67 / 0.71, and two
/// groups side by side K 4096 0.75, 8192 0.82, 14336 0.88 against 0.93 at 2048; Q4_0 K 2048 x
/// N 8192 0.99, K 4096 x N 14336 0.76-0.85, K 8192 x N 2048 0.77-0.90 (one group, four side by
/// side). What the kernels re-read per group (the activations' blocks, the scales) is then one
/// slab's, not one long row's.
pub const SLAB: usize = 2048;

/// The column slabs of `n` rows of `nb` blocks of type `ty` ([`SLAB`]).
pub(crate) fn slabs(ty: GgmlType, nb: usize, n: usize) -> impl Iterator<Item = Slab> {
    let per = (SLAB / ty.block_size()).max(1);
    let size = ty.type_size();
    (0..nb.div_ceil(per)).map(move |s| Slab {
        b0: s * per,
        nb: per.min(nb - s * per),
        at: n * s * per * size,
        group: ROWS * per.min(nb - s * per) * size,
    })
}

/// A column slab of an interleaved matrix.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Slab {
    /// Its first block in a row, and blocks per row.
    pub(crate) b0: usize,
    pub(crate) nb: usize,
    /// Its first byte in the matrix, and bytes per group of sixteen rows.
    pub(crate) at: usize,
    pub(crate) group: usize,
}

impl Slab {
    /// Group `g`'s bytes in the interleaved matrix `packed`.
    pub(crate) fn group_of<'a>(&self, packed: &'a [u8], g: usize) -> &'a [u8] {
        &packed[self.at + g * self.group..][..self.group]
    }
}

/// Where Q4_0 block b's quants start in a group of `nb` blocks.
#[inline(always)]
pub(crate) const fn q4_0_quants(b: usize) -> usize {
    b / 2 * 2 * (QUANTS + SCALES) + b % 2 * QUANTS
}

/// Where Q4_0 block b's scales start in a group of `nb` blocks (after the pair's quants; a last
/// unpaired block's right after its quants).
#[inline(always)]
pub(crate) const fn q4_0_scales(nb: usize, b: usize) -> usize {
    let pair = b / 2 * 2;
    let n = if nb - pair < 2 { nb - pair } else { 2 };
    pair * (QUANTS + SCALES) + n * QUANTS + b % 2 * SCALES
}

/// Whether the CPU keeps a weight of type `ty`, `n` rows of `k`, in the interleaved layout: whole
/// groups of rows of a type the kernels in use read interleaved ([`kernels_for`]), unless
/// `OATO_CPU_REPACK=0`.
pub fn repacks(ty: GgmlType, k: usize, n: usize) -> bool {
    kernels_for(ty, super::isa())
        && n > 0
        && n.is_multiple_of(ROWS)
        && k > 0
        && k.is_multiple_of(ty.block_size())
        && enabled()
        && !skipped(ty)
}

/// Whether the output head, a weight of type `ty` that [`repacks`], stays in the file's layout
/// all the same: generation multiplies it by one token a step (prefill needs only the last
/// token's logits), so only the one-token kernels matter for it, and where the file layout's
/// read faster the interleaved layout buys nothing (only a perplexity run, which takes every
/// token's logits, loses its panels). `OATO_CPU_HEAD_ROWS=1` / `0` forces it either way;
/// otherwise Q6_K under the AVX-512 kernels on Zen 5 and later: 2 EPYC threads, the 1B head
/// (2048 x 128256) read at 47.3 GB/s in rows against 42.4 interleaved; whole 1B Q4_K_M file
/// (its tied head Q6_K, 28% of the bytes), tg32 +6.6-7.7% at 2 threads, +1.5-2% at 1, pp64 the
/// same (`results/cpu-zen5-prefetch.md`). Same bits either way.
pub fn head_keeps_rows(ty: GgmlType) -> bool {
    match std::env::var("OATO_CPU_HEAD_ROWS").as_deref() {
        Ok("1") => true,
        Ok("0") => false,
        _ => {
            ty == GgmlType::Q6_K
                && super::isa() == super::Isa::Avx512
                && super::matmul::zen5_or_later()
        }
    }
}

/// `OATO_CPU_REPACK_SKIP=Q6_K,Q3_K` (type names, comma-separated) keeps those types in the file's
/// layout, for timing one layout against the other per type (the same bits either way).
fn skipped(ty: GgmlType) -> bool {
    static SKIP: std::sync::OnceLock<Vec<GgmlType>> = std::sync::OnceLock::new();
    SKIP.get_or_init(|| {
        std::env::var("OATO_CPU_REPACK_SKIP")
            .unwrap_or_default()
            .split(',')
            .filter_map(|t| GgmlType::from_name(t.trim()).ok())
            .collect()
    })
    .contains(&ty)
}

/// Whether `isa`'s kernels read weights of type `ty` in the interleaved layout: AVX-512's every
/// type that [`interleaves`], AVX2's Q4_0, Q4_K, Q5_K and Q6_K (`repack_avx2`). Under other kernels an
/// interleaved matrix is read back row by row into the file's layout.
pub fn kernels_for(ty: GgmlType, isa: super::Isa) -> bool {
    match isa {
        super::Isa::Avx512 => interleaves(ty),
        super::Isa::Avx2 => matches!(
            ty,
            GgmlType::Q4_0 | GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K
        ),
        super::Isa::Scalar => false,
    }
}

/// Whether the interleaved layout and its kernels exist for weights of type `ty`.
pub fn interleaves(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::Q4_0
            | GgmlType::IQ4_NL
            | GgmlType::IQ4_XS
            | GgmlType::Q2_K
            | GgmlType::Q3_K
            | GgmlType::Q4_K
            | GgmlType::Q5_K
            | GgmlType::Q6_K
    )
}

/// `OATO_CPU_REPACK=0` keeps Q4_0 and K-quant weights in the file's layout (for comparison: the
/// same bits).
fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| crate::kernels::cpu::matmul::env_on("OATO_CPU_REPACK"))
}

/// Bytes reserved at a time for weight copies: many weights share one reservation, so
/// they sit in huge pages without each being rounded up to 2 MiB (untouched reservation costs
/// no memory).
const REGION_BYTES: usize = 1 << 30;

/// Huge-page alignment of a region's start.
const HUGE: usize = 2 << 20;

/// Anonymous memory that the CPU's weight copies (interleaved or as the file has them) are carved
/// from, one region at a time; a region is given back when the last weight in it is dropped.
#[derive(Default)]
pub struct Arena {
    /// The region being filled and the bytes of it handed out.
    current: std::sync::Mutex<(std::sync::Weak<Region>, usize)>,
}

struct Region {
    map: memmap2::MmapRaw,
    /// Offset of the first 2 MiB boundary in the map.
    start: usize,
    len: usize,
}

/// Bytes of an [`Arena`]: a weight matrix, interleaved or as the file has it.
pub struct Piece {
    region: std::sync::Arc<Region>,
    at: usize,
    len: usize,
}

impl Piece {
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: the piece lies inside the region's map (Arena::piece), which lives as long as
        // `region`; it was written only by `Arena::filled`, before this value existed.
        unsafe {
            std::slice::from_raw_parts(
                self.region.map.as_ptr().add(self.region.start + self.at),
                self.len,
            )
        }
    }
}

/// Anonymous memory for `len` bytes from a 2 MiB boundary (the offset returned, with the map),
/// asked for transparent huge pages (small pages work too; `OATO_HUGE_PAGES=0` asks for none):
/// the arena's regions, and the read loop `oato bench --membw` measures the memory with, so that
/// it reads as decode does.
pub fn huge_anon(len: usize) -> std::io::Result<(memmap2::MmapMut, usize)> {
    let map = memmap2::MmapMut::map_anon(len + HUGE)?;
    #[cfg(target_os = "linux")]
    if huge_pages() {
        let _ = map.advise(memmap2::Advice::HugePage);
    }
    let start = (map.as_ptr() as usize).next_multiple_of(HUGE) - map.as_ptr() as usize;
    Ok((map, start))
}

/// Whether [`huge_anon`] asks for huge pages: unless `OATO_HUGE_PAGES` is `0`.
fn huge_pages() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| crate::kernels::cpu::matmul::env_on("OATO_HUGE_PAGES"))
}

impl Arena {
    /// A piece of `len` bytes, 64-byte aligned, that nothing else uses.
    fn piece(&self, len: usize) -> Result<(std::sync::Arc<Region>, usize)> {
        let mut cur = self.current.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(region) = cur.0.upgrade() {
            let at = cur.1.next_multiple_of(64);
            if at + len <= region.len {
                cur.1 = at + len;
                return Ok((region, at));
            }
        }
        let size = len.max(REGION_BYTES).next_multiple_of(HUGE);
        let alloc = |e: std::io::Error| {
            Error::Msg(format!(
                "reserving {} bytes for the CPU's weights: {e}",
                size + HUGE
            ))
        };
        let (map, start) = huge_anon(size).map_err(alloc)?;
        let map = memmap2::MmapRaw::from(map);
        let region = std::sync::Arc::new(Region {
            map,
            start,
            len: size,
        });
        *cur = (std::sync::Arc::downgrade(&region), len);
        Ok((region, 0))
    }

    /// A piece of the parts' bytes (`parts`: their lengths, in order), part i filled by
    /// `fill(i, its offset, its bytes)`, runs of parts spread over `threads` threads.
    fn filled(
        &self,
        parts: &[usize],
        threads: usize,
        fill: impl Fn(usize, usize, &mut [u8]) + Sync,
    ) -> Result<Piece> {
        let len = parts.iter().sum();
        let (region, at) = self.piece(len)?;
        // SAFETY: the piece is inside the region's map and handed out once (Arena::piece):
        // nothing else reads or writes it while this slice lives.
        let mut dst = unsafe {
            std::slice::from_raw_parts_mut(region.map.as_mut_ptr().add(region.start + at), len)
        };
        let mut cut = Vec::with_capacity(parts.len());
        let mut off = 0;
        for (i, &n) in parts.iter().enumerate() {
            let (d, rest) = std::mem::take(&mut dst).split_at_mut(n);
            cut.push((i, off, d));
            dst = rest;
            off += n;
        }
        let per = parts
            .len()
            .div_ceil(threads.clamp(1, parts.len().max(1)))
            .max(1);
        let fill = &fill;
        std::thread::scope(|s| {
            for run in cut.chunks_mut(per) {
                s.spawn(move || {
                    for (i, off, d) in run.iter_mut() {
                        fill(*i, *off, d);
                    }
                });
            }
        });
        Ok(Piece { region, at, len })
    }

    /// A copy of `bytes` (as they are), over `threads` threads.
    pub fn copy(&self, bytes: &[u8], threads: usize) -> Result<Piece> {
        const MIB: usize = 1 << 20;
        let parts: Vec<usize> = (0..bytes.len().div_ceil(MIB))
            .map(|i| MIB.min(bytes.len() - i * MIB))
            .collect();
        self.filled(&parts, threads, |_, at, d| {
            d.copy_from_slice(&bytes[at..at + d.len()])
        })
    }
}

/// `plain` (`n` rows of `k` of type `ty`, the file's layout) in the interleaved layout, in a
/// piece of `arena`, groups spread over `threads` threads.
pub fn pack(
    ty: GgmlType,
    plain: &[u8],
    k: usize,
    n: usize,
    threads: usize,
    arena: &Arena,
) -> Result<Piece> {
    let rb = check(ty, plain.len(), k, n)?;
    let nb = k / ty.block_size();
    let size = ty.type_size();
    // One part per group of each slab, in the layout's order.
    let parts: Vec<(Slab, usize)> = slabs(ty, nb, n)
        .flat_map(|sl| (0..n / ROWS).map(move |g| (sl, g)))
        .collect();
    let lens: Vec<usize> = parts.iter().map(|(sl, _)| sl.group).collect();
    arena.filled(&lens, threads, |i, _, d| {
        let (sl, g) = parts[i];
        let src = &plain[g * ROWS * rb + sl.b0 * size..];
        for b in 0..sl.nb {
            for r in 0..ROWS {
                pieces(ty, sl.nb, b, r, |from, to, len| {
                    d[to..to + len].copy_from_slice(&src[r * rb + from..][..len])
                });
            }
        }
    })
}

/// Row bytes of an `n` x `k` matrix of type `ty` of `len` bytes, checked.
fn check(ty: GgmlType, len: usize, k: usize, n: usize) -> Result<usize> {
    let bs = ty.block_size();
    if !interleaves(ty)
        || n == 0
        || !k.is_multiple_of(bs)
        || !n.is_multiple_of(ROWS)
        || len != n * (k / bs) * ty.type_size()
    {
        return Err(Error::Msg(format!(
            "repack: {len} bytes are not {n} {ty} rows of {k} in groups of {ROWS}"
        )));
    }
    Ok((k / bs) * ty.type_size())
}

/// Calls `f(from, to, len)` for each piece of row `r`'s block `b` (of `nb` per row of a slab):
/// `from` its offset in the slab's part of the file's row, `to` in the row's group of the slab.
/// Q4_0: the quants as above, the scales after the pair's quants; Q2_K, Q4_K, Q5_K: every
/// 32-bit word w of the block at `4 words b + 64 w`, lane r (words: the block's); Q3_K: its 27
/// words at `1728 b + 64 q3_slot(w)`, lane r, its `d` after all the group's blocks; Q6_K: its
/// 52 words at `3328 b + 64 q6_slot(w)`, lane r, its `d` after all the group's blocks.
#[inline]
fn pieces(ty: GgmlType, nb: usize, b: usize, r: usize, mut f: impl FnMut(usize, usize, usize)) {
    match ty {
        // IQ4_NL's blocks are Q4_0's bytes (`d`, then sixteen of nibbles).
        GgmlType::Q4_0 | GgmlType::IQ4_NL => {
            f(b * BLOCK, q4_0_scales(nb, b) + 2 * r, 2);
            for c in 0..4 {
                f(b * BLOCK + 2 + 4 * c, q4_0_quants(b) + 64 * c + 4 * r, 4);
            }
        }
        GgmlType::Q6_K => {
            for w in 0..Q6_WORDS {
                let to = b * Q6_GROUP_BLOCK + 64 * q6_slot(w) + 4 * r;
                f(b * Q6_BLOCK + 4 * w, to, 4);
            }
            f(
                b * Q6_BLOCK + 4 * Q6_WORDS,
                nb * Q6_GROUP_BLOCK + b * SCALES + 2 * r,
                2,
            );
        }
        GgmlType::Q3_K => {
            for w in 0..Q3_WORDS {
                let to = b * Q3_GROUP_BLOCK + 64 * q3_slot(w) + 4 * r;
                f(b * Q3_BLOCK + 4 * w, to, 4);
            }
            f(
                b * Q3_BLOCK + 4 * Q3_WORDS,
                nb * Q3_GROUP_BLOCK + b * SCALES + 2 * r,
                2,
            );
        }
        _ => {
            let words = ty.type_size() / 4;
            for w in 0..words {
                f(
                    b * 4 * words + 4 * w,
                    b * ROWS * 4 * words + 64 * w + 4 * r,
                    4,
                );
            }
        }
    }
}

/// 32-bit words in a Q4_K block (144 bytes).
pub(crate) const K4_WORDS: usize = 36;

/// 32-bit words in a Q5_K block (176 bytes): `d` and `dmin`, three of packed scales, eight of
/// `qh`, 32 of `qs`.
pub(crate) const Q5_WORDS: usize = 44;

/// 32-bit words in a Q2_K block (84 bytes): four of scales, sixteen of `qs`, `d` and `dmin`.
pub(crate) const Q2_WORDS: usize = 21;

/// 32-bit words in an IQ4_XS block (136 bytes): `d` and `scales_h`, `scales_l`, 32 of `qs`.
pub(crate) const IQ4_XS_WORDS: usize = 34;

/// Bytes of one Q3_K block.
const Q3_BLOCK: usize = 110;

/// 32-bit words of a Q3_K block before its `d`: eight of `hmask`, sixteen of `qs`, three of
/// scales.
pub(crate) const Q3_WORDS: usize = 27;

/// Bytes of one Q3_K block's words for the group (its `d` apart).
pub(crate) const Q3_GROUP_BLOCK: usize = ROWS * 4 * Q3_WORDS;

/// Where a Q3_K block's 32-bit word `w` (the file's order: `hmask`, `qs`, scales) sits among the
/// group's 27 (`64 q3_slot(w)`): the scales first, which the kernel reads first.
pub(crate) const fn q3_slot(w: usize) -> usize {
    if w >= 24 { w - 24 } else { w + 3 }
}

/// Bytes of one Q6_K block.
const Q6_BLOCK: usize = 210;

/// 32-bit words of a Q6_K block before its `d`: 32 of `ql`, 16 of `qh`, four of scales.
pub(crate) const Q6_WORDS: usize = 52;

/// Bytes of one Q6_K block's words for the group (its `d` apart).
pub(crate) const Q6_GROUP_BLOCK: usize = ROWS * 4 * Q6_WORDS;

/// Where a Q6_K block's 32-bit word `w` (in the file's order: `ql`, `qh`, scales) sits among
/// the group's 52 (`64 q6_slot(w)`): in the order the kernels read them, so that a block is one
/// forward stream. Per half h of the block's elements: its two scale words, then for s = 0, 1
/// the eight `ql` words and four `qh` words of elements `128 h + 16 s + 32 k..+ 16` (every k;
/// [`q6_words`]).
pub(crate) const fn q6_slot(w: usize) -> usize {
    const HALF: usize = 26;
    if w >= 48 {
        HALF * ((w - 48) / 2) + (w - 48) % 2
    } else if w >= 32 {
        let x = w - 32;
        HALF * (x / 8) + 2 + 12 * ((x % 8) / 4) + 8 + x % 4
    } else {
        let x = w % 16;
        HALF * (w / 16) + 2 + 12 * ((x % 8) / 4) + 4 * (x / 8) + x % 4
    }
}

/// Row `r`'s bytes in the file's layout, from the interleaved matrix `packed` of type `ty`
/// (rows of `k`).
pub fn plain_row(ty: GgmlType, packed: &[u8], k: usize, r: usize, dst: &mut [u8]) {
    let nb = k / ty.block_size();
    let size = ty.type_size();
    let n = packed.len() / (nb * size);
    for sl in slabs(ty, nb, n) {
        let g = sl.group_of(packed, r / ROWS);
        let dst = &mut dst[sl.b0 * size..];
        for b in 0..sl.nb {
            pieces(ty, sl.nb, b, r % ROWS, |from, to, len| {
                dst[from..from + len].copy_from_slice(&g[to..to + len])
            });
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
use kernels::hint_is_nta;
#[cfg(target_arch = "x86_64")]
pub use kernels::set_prefetch_ahead;
#[cfg(target_arch = "x86_64")]
pub(crate) use kernels::{
    Ahead, Part, iq4_bytes, iq4_table, iq4_xs_scale, prefetch_ahead, prefetch_part, prefetch_q4_0,
    q2_head, q2_quants, q3_lane_scales, q3_quants, q5_quants, q6_quants, q6_word, q6_words,
    run_rows, signed_byte,
};

#[cfg(target_arch = "x86_64")]
mod kernels {
    #![allow(unsafe_op_in_unsafe_fn)]

    use std::arch::x86_64::*;
    use std::ops::Range;

    use super::{QUANTS, ROWS, SCALES};
    use crate::kernels::cpu::blocks;
    use crate::kernels::cpu::kwide::PanelActs;
    use crate::kernels::cpu::matmul::{Out, QuantizedActs};
    use crate::quant::GgmlType;
    use crate::quant::blocks::{BlockQ8_0, BlockQ8K};

    /// Rows `rows` of the interleaved matrix `packed` (type `ty`, rows of `acts.k`) against
    /// every token of `acts` (its `vec_dot_type`), into `out`; `extra` is made from `acts`. A
    /// group only partly inside `rows` is computed whole and only its rows inside are written.
    /// Only where the kernels in use read `ty` interleaved ([`super::kernels_for`]).
    pub(crate) fn run_rows(
        ty: GgmlType,
        acts: &QuantizedActs,
        extra: &PanelActs,
        packed: &[u8],
        rows: Range<usize>,
        out: &Out,
    ) {
        let isa = crate::kernels::cpu::isa();
        assert!(
            isa.supported() && super::kernels_for(ty, isa),
            "repack: {ty} under {isa:?}"
        );
        assert_eq!(
            acts.ty,
            ty.vec_dot_type(),
            "repack: {ty} against {}",
            acts.ty
        );
        let nb = acts.k / ty.block_size();
        let rb = nb * ty.type_size();
        assert!(rb > 0 && packed.len().is_multiple_of(ROWS * rb));
        let n = packed.len() / rb;
        assert!(rows.end <= n);
        let n_tok = acts.n_tok;
        // Slab by slab, each output carried from one to the next (`Part::acc`): `slab(sl)` the
        // slab's part of the matrix and what its kernels take of the activations.
        let slabs = || {
            super::slabs(ty, nb, n).enumerate().map(|(i, sl)| {
                let part = Part {
                    nb: sl.nb,
                    stride: nb,
                    acc: i > 0,
                };
                (sl, part, &packed[sl.at..][..n / ROWS * sl.group])
            })
        };
        // The tokens' blocks of a slab.
        fn tokens_blocks<'a, B: crate::quant::blocks::Block>(
            acts: &'a QuantizedActs,
            sl: &super::Slab,
        ) -> Vec<&'a [B]> {
            (0..acts.n_tok)
                .map(|t| &blocks::<B>(acts.row(t))[sl.b0..sl.b0 + sl.nb])
                .collect()
        }
        // SAFETY (the kernels below): the ISA they are compiled for is present (asserted:
        // AVX-512, or AVX2 for the `repack_avx2` kernels); each group holds
        // `part.nb` blocks, every token's blocks from the slab's first as many (and the sums
        // from there of each token's `nb`; asserted); rows r0 + lo..r0 + hi of every token are
        // inside the output (the caller's contract: `rows` inside the matrix, `out` holding
        // every token's rows) and are written (and read back from the second slab) by this
        // task only.
        match ty {
            GgmlType::Q4_0 | GgmlType::IQ4_NL => {
                assert_eq!(
                    extra.nsum.len(),
                    n_tok * nb,
                    "repack: -8Σy of other activations"
                );
                use crate::kernels::cpu::repack_avx2;
                let kernels: [Q4Fn; 3] = match (ty, isa) {
                    (GgmlType::Q4_0, crate::kernels::cpu::Isa::Avx512) => {
                        [tokens::<1, false>, tokens::<2, false>, tokens::<4, false>]
                    }
                    // Both halves of a group per pass for one and two tokens, one half per pass
                    // for four.
                    (GgmlType::Q4_0, _) => [
                        repack_avx2::tokens::<1, 2>,
                        repack_avx2::tokens::<2, 2>,
                        repack_avx2::tokens::<4, 1>,
                    ],
                    _ => [tokens::<1, true>, tokens::<2, true>, tokens::<4, true>],
                };
                // Decode too: whole groups one at a time, each one forward stream.
                for (sl, part, packed) in slabs() {
                    let ys = tokens_blocks::<BlockQ8_0>(acts, &sl);
                    let nsum = &extra.nsum[sl.b0..];
                    each_group(rows.clone(), sl.group, packed, |g, r0, mask| {
                        by_fours(n_tok, |t, nt| unsafe {
                            kernels[nt.ilog2() as usize](g, part, &ys, nsum, t, out, r0, mask)
                        })
                    });
                }
            }
            GgmlType::Q2_K
            | GgmlType::Q3_K
            | GgmlType::Q4_K
            | GgmlType::Q5_K
            | GgmlType::Q6_K
            | GgmlType::IQ4_XS => {
                assert_eq!(
                    extra.min_pairs.len(),
                    n_tok * nb,
                    "repack: sums of other activations"
                );
                // One, two and four tokens at a time.
                use crate::kernels::cpu::repack_avx2;
                let avx2 = isa != crate::kernels::cpu::Isa::Avx512;
                let kernels: [KFn; 3] = match ty {
                    GgmlType::Q4_K if avx2 => [
                        repack_avx2::tokens_q4_k::<1, 2>,
                        repack_avx2::tokens_q4_k::<2, 2>,
                        repack_avx2::tokens_q4_k::<4, 1>,
                    ],
                    GgmlType::Q5_K if avx2 => [
                        repack_avx2::tokens_q5_k::<1, 2>,
                        repack_avx2::tokens_q5_k::<2, 2>,
                        repack_avx2::tokens_q5_k::<4, 1>,
                    ],
                    GgmlType::Q6_K if avx2 => [
                        repack_avx2::tokens_q6_k::<1, 2>,
                        repack_avx2::tokens_q6_k::<2, 2>,
                        repack_avx2::tokens_q6_k::<4, 1>,
                    ],
                    GgmlType::Q2_K => [tokens_q2_k::<1>, tokens_q2_k::<2>, tokens_q2_k::<4>],
                    GgmlType::Q3_K => [tokens_q3_k::<1>, tokens_q3_k::<2>, tokens_q3_k::<4>],
                    GgmlType::Q4_K => [tokens_q4_k::<1>, tokens_q4_k::<2>, tokens_q4_k::<4>],
                    GgmlType::Q5_K => [tokens_q5_k::<1>, tokens_q5_k::<2>, tokens_q5_k::<4>],
                    GgmlType::IQ4_XS => {
                        [tokens_iq4_xs::<1>, tokens_iq4_xs::<2>, tokens_iq4_xs::<4>]
                    }
                    _ => [tokens_q6_k::<1>, tokens_q6_k::<2>, tokens_q6_k::<4>],
                };
                for (sl, part, packed) in slabs() {
                    let ys = tokens_blocks::<BlockQ8K>(acts, &sl);
                    let pairs = &extra.min_pairs[sl.b0..];
                    let group = sl.group;
                    if ty == GgmlType::Q6_K && n_tok == 1 && !avx2 {
                        // Decode: whole groups two side by side, the others one at a time.
                        let one = |r: Range<usize>| {
                            each_group(r, group, packed, |g, r0, mask| unsafe {
                                tokens_q6_k::<1>(g, part, &ys, pairs, 0, out, r0, mask)
                            })
                        };
                        spread::<Q6_SIDE>(rows.clone(), one, |gs| unsafe {
                            let groups = gs.map(|g| &packed[g * group..][..group]);
                            side_by_side_q6_k(groups, part, ys[0], out, gs)
                        });
                        continue;
                    }
                    each_group(rows.clone(), group, packed, |g, r0, mask| {
                        by_fours(n_tok, |t, nt| unsafe {
                            kernels[nt.ilog2() as usize](g, part, &ys, pairs, t, out, r0, mask)
                        })
                    });
                }
            }
            other => panic!("repack: no interleaved kernel for {other}"),
        }
    }

    /// What a kernel reads of one slab ([`super::slabs`]): its blocks per row `nb`; `stride`,
    /// the blocks of a whole row, by which the activations' sums (`PanelActs`, handed from the
    /// slab's first block) go from token to token; `acc`: whether the outputs start from what
    /// the slab before left in them (else from zero).
    #[derive(Clone, Copy)]
    pub(crate) struct Part {
        pub(crate) nb: usize,
        pub(crate) stride: usize,
        pub(crate) acc: bool,
    }

    /// The sums a kernel starts from for token `t`'s rows `r0..r0 + 16` (lanes in `mask`):
    /// zero, or (`part.acc`) what the slab before stored there.
    ///
    /// # Safety
    /// As for [`Out::write16`].
    #[inline(always)]
    unsafe fn start(out: &Out, part: Part, t: usize, r0: usize, mask: __mmask16) -> __m512 {
        if part.acc {
            out.read16(t, r0, mask)
        } else {
            _mm512_setzero_ps()
        }
    }

    /// `rows` for a decode kernel that reads `S` whole groups side by side: `many(gs)` for the
    /// groups `gs`, one from each of `S` equal parts of the whole groups inside `rows` (so each
    /// part is read as one long forward stream), `one` for the rows left (a part group at
    /// either end, the whole groups past `S` equal parts).
    fn spread<const S: usize>(
        rows: Range<usize>,
        one: impl Fn(Range<usize>),
        mut many: impl FnMut([usize; S]),
    ) {
        let (g0, g1) = (rows.start.div_ceil(ROWS), rows.end / ROWS);
        if g0 >= g1 {
            one(rows);
            return;
        }
        if rows.start < g0 * ROWS {
            one(rows.start..g0 * ROWS);
        }
        let q = (g1 - g0) / S;
        for i in 0..q {
            many(std::array::from_fn(|j| g0 + j * q + i));
        }
        if g0 + S * q < g1 {
            one((g0 + S * q) * ROWS..g1 * ROWS);
        }
        if g1 * ROWS < rows.end {
            one(g1 * ROWS..rows.end);
        }
    }

    /// Q6_K groups that decode reads side by side. Out of cache (`examples/matmul_dram`, EPYC,
    /// alternated; fraction of the plain read of the same copies, medians of the rounds), with
    /// the kernel's group indices constant ([`q6_half`]), one group against two: 1 thread,
    /// 2048 x 128256 (the 1B head) 0.80 / 0.83-0.85, 4096 x 14336 0.65-0.66 / 0.74-0.77,
    /// 14336 x 4096 0.79-0.84 / 0.93; 2 threads 0.83-0.92 / 0.92-0.95 (the 1B head), 0.98 /
    /// 0.97 (14336 x 4096). Four read as two or worse (4096 x 128256, 1 thread 0.68 / 0.75).
    /// The kernel before (indices at run time, 16 KiB prefetches) read 4096-wide rows better
    /// at 1 thread (4096 x 14336 0.83-0.86, 4096 x 128256 0.83-0.85) and the others worse.
    const Q6_SIDE: usize = 2;

    /// One token against the `G` whole Q6_K groups `groups` (groups `at`), read side by side
    /// as `G` streams: per group the operations (and bits) of [`tokens_q6_k`].
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn side_by_side_q6_k<const G: usize>(
        groups: [&[u8]; G],
        part: Part,
        y: &[BlockQ8K],
        out: &Out,
        at: [usize; G],
    ) {
        use super::Q6_GROUP_BLOCK;
        let ahead = prefetch_ahead();
        let q: [*const u8; G] = groups.map(|g| g.as_ptr());
        let mut sumf = at.map(|g| start(out, part, 0, g * ROWS, 0xFFFF));
        let nb = part.nb;
        for b in 0..nb {
            let yb = y.get_unchecked(b);
            let mut isum = [[_mm512_setzero_si512(); 1]; G];
            q6_block(q.map(|g| g.add(b * Q6_GROUP_BLOCK)), ahead, [yb], &mut isum);
            let d_y = _mm512_set1_ps(yb.d.get());
            for ((&g, [is]), acc) in q.iter().zip(isum).zip(sumf.iter_mut()) {
                let dx = d_after(g, nb, Q6_GROUP_BLOCK, b);
                *acc = _mm512_fmadd_ps(_mm512_mul_ps(d_y, dx), _mm512_cvtepi32_ps(is), *acc);
            }
        }
        for (g, acc) in at.into_iter().zip(sumf) {
            out.write16(0, g * ROWS, 0xFFFF, acc);
        }
    }

    /// A Q4_0 / IQ4_NL kernel for a number of tokens ([`tokens`]).
    type Q4Fn = unsafe fn(&[u8], Part, &[&[BlockQ8_0]], &[i32], usize, &Out, usize, __mmask16);

    /// A K-quant kernel for a number of tokens ([`tokens_q4_k`], [`tokens_q6_k`]).
    type KFn = unsafe fn(&[u8], Part, &[&[BlockQ8K]], &[[i32; 4]], usize, &Out, usize, __mmask16);

    /// `f(group bytes, first row, mask of its rows inside rows)` for each group that `rows`
    /// touches.
    fn each_group(
        rows: Range<usize>,
        group: usize,
        packed: &[u8],
        mut f: impl FnMut(&[u8], usize, __mmask16),
    ) {
        let mut g = rows.start / ROWS;
        while g * ROWS < rows.end {
            let r0 = g * ROWS;
            let lo = rows.start.max(r0) - r0;
            let hi = rows.end.min(r0 + ROWS) - r0;
            let mask = (((1u32 << hi) - 1) & !((1u32 << lo) - 1)) as __mmask16;
            f(&packed[g * group..][..group], r0, mask);
            g += 1;
        }
    }

    /// `f(first token, count)` over `n` tokens four at a time, then two, then one (eight at a
    /// time was slower for Q4_0: 1B shape pp64, 2 threads, 243 against 287 t/s).
    fn by_fours(n: usize, mut f: impl FnMut(usize, usize)) {
        let mut t = 0;
        while t + 4 <= n {
            f(t, 4);
            t += 4;
        }
        while t + 2 <= n {
            f(t, 2);
            t += 2;
        }
        if t < n {
            f(t, 1);
        }
    }

    /// Tokens `t..t + NT` against one Q4_K group: per super-block and 32-element group j, eight
    /// `vpdpbusd` of the nibbles give each row's exact `Σ q y`, times the rows' 6-bit scales
    /// (`vpmulld`), and the mins' `Σ_j m_j Σy` comes from the activation's 32-element sums, two
    /// groups per `vpdpwssd`; the float step is `kquants`' canonical one lane by lane:
    /// `sumf = fma(d_y * d_x, isum, sumf); sumf = fma(-(d_y * dmin_x), imin, sumf)`. High
    /// nibbles are masked in place (`& 0xF0`, no shift) and their sums divided by sixteen once
    /// per super-block; with the paired mins, that took the kernel from 54 to 60 GB/s of weights
    /// in the last level cache (1 EPYC thread, 4096 x 1024, `OATO_DRAM_MIB=6 examples/matmul_dram`,
    /// medians of four alternated runs); out of cache, decode reads as fast as before.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn tokens_q4_k<const NT: usize>(
        group: &[u8],
        part: Part,
        ys: &[&[BlockQ8K]],
        min_pairs: &[[i32; 4]],
        t: usize,
        out: &Out,
        r0: usize,
        mask: __mmask16,
    ) {
        let low = _mm512_set1_epi8(0x0F);
        let high = _mm512_set1_epi8(0xF0u8 as i8);
        let ahead = prefetch_ahead();
        let mut sumf: [__m512; NT] = std::array::from_fn(|j| start(out, part, t + j, r0, mask));
        for b in 0..part.nb {
            let p = group.as_ptr().add(b * ROWS * 4 * super::K4_WORDS);
            let word = |w: usize| _mm512_loadu_si512(p.add(64 * w).cast());
            let h = crate::kernels::cpu::kwide::k4_head([word(0), word(1), word(2), word(3)]);
            // Even groups (low nibbles) into `isum`, odd ones (high nibbles kept in place, so
            // sixteen times their value) into `isum16`.
            let mut isum = [_mm512_setzero_si512(); NT];
            let mut isum16 = [_mm512_setzero_si512(); NT];
            for pair in 0..4 {
                // Quant bytes 32 pair..32 pair + 32: low nibbles group 2 pair, high 2 pair + 1.
                let v: [__m512i; 8] = std::array::from_fn(|c| word(4 + 8 * pair + c));
                for half in 0..2 {
                    let j = 2 * pair + half;
                    prefetch_part(p, ahead, super::K4_WORDS, j, 8);
                    let w: [__m512i; 8] = std::array::from_fn(|c| {
                        _mm512_and_si512(v[c], if half == 0 { low } else { high })
                    });
                    let sc = h.sc[j];
                    for tk in 0..NT {
                        let yq = ys.get_unchecked(t + tk).get_unchecked(b).qs.as_ptr();
                        let y = |e: usize| {
                            _mm512_set1_epi32(std::ptr::read_unaligned(
                                yq.add(32 * j + 4 * e).cast(),
                            ))
                        };
                        let (mut s0, mut s1) = (_mm512_setzero_si512(), _mm512_setzero_si512());
                        for e in 0..4 {
                            s0 = _mm512_dpbusd_epi32(s0, w[2 * e], y(2 * e));
                            s1 = _mm512_dpbusd_epi32(s1, w[2 * e + 1], y(2 * e + 1));
                        }
                        let is = if half == 0 {
                            &mut isum[tk]
                        } else {
                            &mut isum16[tk]
                        };
                        *is =
                            _mm512_add_epi32(*is, _mm512_mullo_epi32(_mm512_add_epi32(s0, s1), sc));
                    }
                }
            }
            for tk in 0..NT {
                let y = ys.get_unchecked(t + tk).get_unchecked(b);
                let pairs = min_pairs.get_unchecked((t + tk) * part.stride + b);
                // isum16 is a multiple of sixteen: the shift is exact. |isum16| <= 4 groups *
                // 63 * 32 * 240 * 128 < 2^31.
                let is = _mm512_add_epi32(isum[tk], _mm512_srai_epi32::<4>(isum16[tk]));
                sumf[tk] = k4_step(sumf[tk], is, &h, y, pairs);
            }
        }
        store_all(out, sumf, t, r0, mask);
    }

    /// Tokens `t..t + NT` against one IQ4_XS group (34 words a block: `d` and `scales_h`,
    /// `scales_l`, then group j's sixteen quant bytes in words `2 + 4j..`). Per super-block the
    /// rows' scales `ls_j - 32` lane by lane; per 32-element group j, the low and high nibbles
    /// of its four words through the table (`IQ4_VALUES + 128`), eight `vpdpbusd` from the
    /// token's `-128 B_j` (`B_j` its 32-element sum) give each row's exact `Σ v y`, times the
    /// rows' scale j (`vpmulld`): `kquants`' `isum` (|isum| <= 8 * 32 * 127 * 128 * 32, far
    /// below 2^31). The float step is its canonical one lane by lane:
    /// `sumf = fma(d_y * d_x, isum, sumf)`.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn tokens_iq4_xs<const NT: usize>(
        group: &[u8],
        part: Part,
        ys: &[&[BlockQ8K]],
        _min_pairs: &[[i32; 4]],
        t: usize,
        out: &Out,
        r0: usize,
        mask: __mmask16,
    ) {
        use super::IQ4_XS_WORDS;
        let low = _mm512_set1_epi8(0x0F);
        let table = iq4_table();
        let ahead = prefetch_ahead();
        let mut sumf: [__m512; NT] = std::array::from_fn(|j| start(out, part, t + j, r0, mask));
        for b in 0..part.nb {
            let p = group.as_ptr().add(b * ROWS * 4 * IQ4_XS_WORDS);
            let word = |w: usize| _mm512_loadu_si512(p.add(64 * w).cast());
            let (head, scales_l) = (word(0), word(1));
            // The tokens' -128 B_j, eight to a token.
            let nb128: [[i32; 8]; NT] = std::array::from_fn(|tk| {
                let y = ys.get_unchecked(t + tk).get_unchecked(b);
                let bs = _mm256_loadu_si256(y.bsums.as_ptr().cast());
                std::mem::transmute(_mm256_madd_epi16(bs, _mm256_set1_epi16(-128)))
            });
            let mut isum = [_mm512_setzero_si512(); NT];
            #[allow(clippy::needless_range_loop)]
            for j in 0..8 {
                prefetch_part(p, ahead, IQ4_XS_WORDS, j, 8);
                let sc = iq4_xs_scale(head, scales_l, j);
                let v: [__m512i; 4] = std::array::from_fn(|c| word(2 + 4 * j + c));
                let w: [__m512i; 8] =
                    std::array::from_fn(|e| iq4_bytes(v[e % 4], e >= 4, table, low));
                for (tk, is) in isum.iter_mut().enumerate() {
                    let yq = ys.get_unchecked(t + tk).get_unchecked(b).qs.as_ptr();
                    let yq = yq.add(32 * j);
                    let mut s0 = _mm512_set1_epi32(nb128[tk][j]);
                    let mut s1 = _mm512_setzero_si512();
                    for c in 0..4 {
                        s0 = dpbusd_bcst(s0, w[c], yq.add(4 * c).cast());
                        s1 = dpbusd_bcst(s1, w[4 + c], yq.add(16 + 4 * c).cast());
                    }
                    *is = _mm512_add_epi32(*is, _mm512_mullo_epi32(_mm512_add_epi32(s0, s1), sc));
                }
            }
            let d_x = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(head));
            scaled_step(&mut sumf, d_x, &isum, ys, t, b);
        }
        store_all(out, sumf, t, r0, mask);
    }

    /// `kquants`' float step of super-block `b` for tokens `t..t + NT` (no mins), lane by lane:
    /// `sumf = fma(d_y * d_x, isum, sumf)`.
    #[inline(always)]
    unsafe fn scaled_step<const NT: usize>(
        sumf: &mut [__m512; NT],
        d_x: __m512,
        isum: &[__m512i; NT],
        ys: &[&[BlockQ8K]],
        t: usize,
        b: usize,
    ) {
        for (tk, acc) in sumf.iter_mut().enumerate() {
            let d_y = _mm512_set1_ps(ys.get_unchecked(t + tk).get_unchecked(b).d.get());
            *acc = _mm512_fmadd_ps(_mm512_mul_ps(d_y, d_x), _mm512_cvtepi32_ps(isum[tk]), *acc);
        }
    }

    /// Tokens `t..t + NT`'s sums stored to rows `r0..r0 + 16` (lanes in `mask`).
    #[inline(always)]
    unsafe fn store_all<const NT: usize>(
        out: &Out,
        sumf: [__m512; NT],
        t: usize,
        r0: usize,
        mask: __mmask16,
    ) {
        for (j, acc) in sumf.into_iter().enumerate() {
            out.write16(t + j, r0, mask, acc);
        }
    }

    /// Sixteen IQ4_XS rows' scale `ls_j - 32` of group j, lane r for row r, from the block's
    /// first word (`scales_h` in its top 16 bits) and its second (`scales_l`, nibble j at bit
    /// 4j).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(crate) unsafe fn iq4_xs_scale(head: __m512i, scales_l: __m512i, j: usize) -> __m512i {
        let lo = _mm512_and_si512(shift_bits(scales_l, -4 * j as i32), _mm512_set1_epi32(0x0F));
        let hi = _mm512_and_si512(
            shift_bits(head, -(12 + 2 * j as i32)),
            _mm512_set1_epi32(0x30),
        );
        _mm512_sub_epi32(_mm512_or_si512(lo, hi), _mm512_set1_epi32(32))
    }

    /// Tokens `t..t + NT` against one Q5_K group: as [`tokens_q4_k`], each 32-element group's
    /// quants put together from a nibble of `qs` and bit j of the matching `qh` word (which
    /// holds the fifth bit of the same four elements of each of the eight groups), 0..32.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn tokens_q5_k<const NT: usize>(
        group: &[u8],
        part: Part,
        ys: &[&[BlockQ8K]],
        min_pairs: &[[i32; 4]],
        t: usize,
        out: &Out,
        r0: usize,
        mask: __mmask16,
    ) {
        use super::Q5_WORDS;
        let ahead = prefetch_ahead();
        let mut sumf: [__m512; NT] = std::array::from_fn(|j| start(out, part, t + j, r0, mask));
        for b in 0..part.nb {
            let p = group.as_ptr().add(b * ROWS * 4 * Q5_WORDS);
            let word = |w: usize| _mm512_loadu_si512(p.add(64 * w).cast());
            let h = crate::kernels::cpu::kwide::k4_head([word(0), word(1), word(2), word(3)]);
            let qh: [__m512i; 8] = std::array::from_fn(|c| word(4 + c));
            let mut isum = [_mm512_setzero_si512(); NT];
            for pair in 0..4 {
                // Quant bytes 32 pair..32 pair + 32: low nibbles group 2 pair, high 2 pair + 1.
                let v: [__m512i; 8] = std::array::from_fn(|c| word(12 + 8 * pair + c));
                for half in 0..2 {
                    let j = 2 * pair + half;
                    prefetch_part(p, ahead, Q5_WORDS, j, 8);
                    let w = q5_quants(&v, &qh, j);
                    let sc = h.sc[j];
                    for (tk, is) in isum.iter_mut().enumerate() {
                        let yq = ys.get_unchecked(t + tk).get_unchecked(b).qs.as_ptr();
                        let yq = yq.add(32 * j);
                        let (mut s0, mut s1) = (_mm512_setzero_si512(), _mm512_setzero_si512());
                        for e in 0..4 {
                            s0 = dpbusd_bcst(s0, w[2 * e], yq.add(8 * e).cast());
                            s1 = dpbusd_bcst(s1, w[2 * e + 1], yq.add(8 * e + 4).cast());
                        }
                        *is =
                            _mm512_add_epi32(*is, _mm512_mullo_epi32(_mm512_add_epi32(s0, s1), sc));
                    }
                }
            }
            for tk in 0..NT {
                let y = ys.get_unchecked(t + tk).get_unchecked(b);
                let pairs = min_pairs.get_unchecked((t + tk) * part.stride + b);
                sumf[tk] = k4_step(sumf[tk], isum[tk], &h, y, pairs);
            }
        }
        store_all(out, sumf, t, r0, mask);
    }

    /// The quants (0..32) of 32-element group j of sixteen Q5_K rows, four elements a register
    /// (lane r: row r), from the `qs` words of the group's pair (`v`: words `12 + 8 (j / 2)..`)
    /// and the eight `qh` words: the low (even j) or high nibbles, bit j of `qh` above them.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(crate) unsafe fn q5_quants(v: &[__m512i; 8], qh: &[__m512i; 8], j: usize) -> [__m512i; 8] {
        let (low, bit4) = (_mm512_set1_epi8(0x0F), _mm512_set1_epi8(0x10));
        std::array::from_fn(|c| {
            let lo = if j.is_multiple_of(2) {
                v[c]
            } else {
                _mm512_srli_epi32::<4>(v[c])
            };
            // Bit j of each qh byte to bit 4 (within the byte either way).
            let hi = shift_bits(qh[c], 4 - j as i32);
            _mm512_ternarylogic_epi32::<0xE4>(lo, _mm512_and_si512(hi, bit4), low)
        })
    }

    /// The quants `q + 4` (0..8) of 32-element group `g = 4 h + plane` of sixteen Q3_K rows, four
    /// elements a register, from the half's `qs` words `v` and the eight `hmask` words `hm`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(crate) unsafe fn q3_quants(v: &[__m512i; 8], hm: &[__m512i; 8], g: usize) -> [__m512i; 8] {
        let (m2, bit2) = (_mm512_set1_epi8(3), _mm512_set1_epi8(4));
        std::array::from_fn(|c| {
            let lo = shift_bits(v[c], -2 * (g % 4) as i32);
            // Bit g of each hmask byte to bit 2 (within the byte either way).
            let hi = shift_bits(hm[c], 2 - g as i32);
            _mm512_ternarylogic_epi32::<0xE4>(lo, _mm512_and_si512(hi, bit2), m2)
        })
    }

    /// The quants (0..4) of 32-element group `g = 4 h + plane` of sixteen Q2_K rows, four
    /// elements a register, from the half's `qs` words `v`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(crate) unsafe fn q2_quants(v: &[__m512i; 8], g: usize) -> [__m512i; 8] {
        let m2 = _mm512_set1_epi8(3);
        std::array::from_fn(|c| _mm512_and_si512(shift_bits(v[c], -2 * (g % 4) as i32), m2))
    }

    /// Sixteen Q2_K rows' scales (0..16) and their mins in 16-bit pairs `(m_2k, m_2k+1)` (for
    /// `vpdpwssd` against the activation's `bsums` read as pairs), from the block's four words
    /// of scale bytes (lane r: row r's).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(crate) unsafe fn q2_head(raw: [__m512i; 4]) -> ([__m512i; 16], [__m512i; 8]) {
        let low4 = _mm512_set1_epi8(0x0F);
        let scw = raw.map(|w| _mm512_and_si512(w, low4));
        let mw = raw.map(|w| _mm512_and_si512(_mm512_srli_epi32::<4>(w), low4));
        // Mins 2k and 2k + 1: bytes 2 (k % 2) and 2 (k % 2) + 1 of word k / 2.
        let pairs = std::array::from_fn(|k| {
            let i = 2 * (k % 2) as i32;
            let idx = in_lanes(i | (0x80 << 8) | ((i + 1) << 16) | (0x80u32 << 24) as i32);
            _mm512_shuffle_epi8(mw[k / 2], idx)
        });
        (std::array::from_fn(|j| lane_byte(scw[j / 4], j % 4)), pairs)
    }

    /// `kquants`' step of one Q4_K / Q5_K super-block onto the sixteen rows' `sumf` for one
    /// token's block `y`: the mins' `Σ_j m_j B_j` from the activation's 32-element sums paired
    /// as the head's (`pairs`, two groups per `vpdpwssd`), then
    /// `sumf = fma(d_y * d_x, isum, sumf); sumf = fma(-(d_y * dmin_x), imin, sumf)` lane by lane.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn k4_step(
        sumf: __m512,
        isum: __m512i,
        h: &crate::kernels::cpu::kwide::K4Head,
        y: &BlockQ8K,
        pairs: &[i32; 4],
    ) -> __m512 {
        let mut imin = _mm512_setzero_si512();
        for (k, &pair) in pairs.iter().enumerate() {
            imin = _mm512_dpwssd_epi32(imin, h.mp[k], _mm512_set1_epi32(pair));
        }
        let d_y = _mm512_set1_ps(y.d.get());
        let acc = _mm512_fmadd_ps(_mm512_mul_ps(d_y, h.d), _mm512_cvtepi32_ps(isum), sumf);
        _mm512_fnmadd_ps(_mm512_mul_ps(d_y, h.dmin), _mm512_cvtepi32_ps(imin), acc)
    }

    /// Every 32-bit lane of `v` shifted left by `n` bits (right by `-n` when `n` is negative).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn shift_bits(v: __m512i, n: i32) -> __m512i {
        if n >= 0 {
            _mm512_sll_epi32(v, _mm_cvtsi32_si128(n))
        } else {
            _mm512_srl_epi32(v, _mm_cvtsi32_si128(-n))
        }
    }

    /// Byte `i` of every 32-bit lane of `v`, zero-extended, by one byte shuffle.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn lane_byte(v: __m512i, i: usize) -> __m512i {
        _mm512_shuffle_epi8(v, in_lanes(0x8080_8000u32 as i32 | i as i32))
    }

    /// A byte shuffle's indices that take, in every 32-bit lane, the bytes `idx` names of that
    /// lane (`idx`: four byte indices 0..4, or 0x80 for a zero byte; `vpshufb` indexes the
    /// 128-bit lane, so lane e of each gets 4e added).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn in_lanes(idx: i32) -> __m512i {
        let e = _mm512_broadcast_i32x4(_mm_setr_epi32(0, 0x0404_0404, 0x0808_0808, 0x0C0C_0C0C));
        _mm512_add_epi8(_mm512_set1_epi32(idx), e)
    }

    /// Tokens `t..t + NT` against one Q3_K group. Per super-block, the scales' three words give
    /// the sixteen rows' 6-bit scales (four per word, as `kquants::q3_scales`, lane by lane);
    /// per 32-element group g, each `qs` word's 2-bit plane `g % 4` with bit g of the matching
    /// `hmask` word above it gives four bytes of quants `q + 4` (0..8) per row; per 16-element
    /// group j, four `vpdpbusd` from `-4 Σy_j` give each row's exact `Σ q y`, times the rows'
    /// scale j (`vpmulld`). The float step is `kquants`' lane by lane:
    /// `sumf = fma(d_y * d_x, isum, sumf)`.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn tokens_q3_k<const NT: usize>(
        group: &[u8],
        part: Part,
        ys: &[&[BlockQ8K]],
        _min_pairs: &[[i32; 4]],
        t: usize,
        out: &Out,
        r0: usize,
        mask: __mmask16,
    ) {
        use super::{Q3_GROUP_BLOCK, Q3_WORDS, q3_slot};
        let ahead = prefetch_ahead();
        let q = group.as_ptr();
        let nb = part.nb;
        let mut sumf: [__m512; NT] = std::array::from_fn(|j| start(out, part, t + j, r0, mask));
        for b in 0..nb {
            let p = q.add(b * Q3_GROUP_BLOCK);
            let word = |w: usize| _mm512_loadu_si512(p.add(64 * q3_slot(w)).cast());
            let sc = q3_lane_scales([word(24), word(25), word(26)]);
            let hm: [__m512i; 8] = std::array::from_fn(word);
            let mut isum = [_mm512_setzero_si512(); NT];
            for h in 0..2 {
                let v: [__m512i; 8] = std::array::from_fn(|c| word(8 + 8 * h + c));
                for plane in 0..4 {
                    let g = 4 * h + plane;
                    prefetch_part(p, ahead, Q3_WORDS, g, 8);
                    let z = q3_quants(&v, &hm, g);
                    for half in 0..2 {
                        let j = 2 * g + half;
                        for (tk, is) in isum.iter_mut().enumerate() {
                            let y = ys.get_unchecked(t + tk).get_unchecked(b);
                            let yq = y.qs.as_ptr().add(16 * j);
                            let off = -4 * i32::from(y.bsums.get_unchecked(j).get());
                            let mut acc = _mm512_set1_epi32(off);
                            for i in 0..4 {
                                acc = dpbusd_bcst(acc, z[4 * half + i], yq.add(4 * i).cast());
                            }
                            *is = _mm512_add_epi32(*is, _mm512_mullo_epi32(acc, sc[j]));
                        }
                    }
                }
            }
            let dx = d_after(q, nb, Q3_GROUP_BLOCK, b);
            scaled_step(&mut sumf, dx, &isum, ys, t, b);
        }
        store_all(out, sumf, t, r0, mask);
    }

    /// The sixteen rows' sixteen Q3_K scales (-32..32, lane r: row r) from the block's three
    /// words of packed scales (lane r: row r's bytes `4i..4i + 4`): scale j's low four bits are
    /// the low (j < 8) or high nibble of byte j % 8, its top two bits `2 (j / 4)..` of byte
    /// `8 + j % 4`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(crate) unsafe fn q3_lane_scales(w: [__m512i; 3]) -> [__m512i; 16] {
        let (low4, low2) = (_mm512_set1_epi8(0x0F), _mm512_set1_epi8(3));
        let top = |k: i32| _mm512_slli_epi32::<4>(_mm512_and_si512(shift_bits(w[2], -2 * k), low2));
        // Scales 4i..4i + 4 as the bytes of word i.
        let words = [
            _mm512_or_si512(_mm512_and_si512(w[0], low4), top(0)),
            _mm512_or_si512(_mm512_and_si512(w[1], low4), top(1)),
            _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32::<4>(w[0]), low4), top(2)),
            _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32::<4>(w[1]), low4), top(3)),
        ];
        let thirty_two = _mm512_set1_epi32(32);
        std::array::from_fn(|j| _mm512_sub_epi32(lane_byte(words[j / 4], j % 4), thirty_two))
    }

    /// Tokens `t..t + NT` against one Q2_K group. Per super-block, per 32-element group g, each
    /// `qs` word's 2-bit plane `g % 4` gives four bytes of quants (0..4) per row; per 16-element
    /// group j four `vpdpbusd` give each row's exact `Σ q y`, times the rows' scale j
    /// (`vpmulld`); the mins' `Σ_j m_j bsum_j` by `vpdpwssd` of the rows' mins in 16-bit pairs
    /// against the activation's pairs of `bsums`. The float step is `kquants`' lane by lane:
    /// `sumf = fma(d_y * d_x, isum, sumf); sumf = fma(-(d_y * dmin_x), imin, sumf)`.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn tokens_q2_k<const NT: usize>(
        group: &[u8],
        part: Part,
        ys: &[&[BlockQ8K]],
        _min_pairs: &[[i32; 4]],
        t: usize,
        out: &Out,
        r0: usize,
        mask: __mmask16,
    ) {
        use super::Q2_WORDS;
        let ahead = prefetch_ahead();
        let mut sumf: [__m512; NT] = std::array::from_fn(|j| start(out, part, t + j, r0, mask));
        for b in 0..part.nb {
            let p = group.as_ptr().add(b * ROWS * 4 * Q2_WORDS);
            let word = |w: usize| _mm512_loadu_si512(p.add(64 * w).cast());
            let (sc, pairs) = q2_head(std::array::from_fn(word));
            let mut isum = [_mm512_setzero_si512(); NT];
            for h in 0..2 {
                let v: [__m512i; 8] = std::array::from_fn(|c| word(4 + 8 * h + c));
                for plane in 0..4 {
                    let g = 4 * h + plane;
                    prefetch_part(p, ahead, Q2_WORDS, g, 8);
                    // The plane's bits left in place (`4^plane q`, at most 192) and the sums
                    // shifted back once per group and token: exact, as they are multiples of
                    // `4^plane`; |sum| <= 16 * 192 * 128.
                    let keep = _mm512_set1_epi8((3 << (2 * plane)) as i8);
                    let z: [__m512i; 8] = std::array::from_fn(|c| _mm512_and_si512(v[c], keep));
                    let back = _mm_cvtsi32_si128(2 * plane as i32);
                    for half in 0..2 {
                        let j = 2 * g + half;
                        for (tk, is) in isum.iter_mut().enumerate() {
                            let y = ys.get_unchecked(t + tk).get_unchecked(b);
                            let yq = y.qs.as_ptr().add(16 * j);
                            let mut acc = _mm512_setzero_si512();
                            for i in 0..4 {
                                acc = dpbusd_bcst(acc, z[4 * half + i], yq.add(4 * i).cast());
                            }
                            let acc = _mm512_sra_epi32(acc, back);
                            *is = _mm512_add_epi32(*is, _mm512_mullo_epi32(acc, sc[j]));
                        }
                    }
                }
            }
            let dd = word(Q2_WORDS - 1);
            let d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dd));
            let dmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(dd)));
            for (tk, acc) in sumf.iter_mut().enumerate() {
                let y = ys.get_unchecked(t + tk).get_unchecked(b);
                let bsums = y.bsums.as_ptr().cast::<i32>();
                let mut imin = _mm512_setzero_si512();
                for (k, &m) in pairs.iter().enumerate() {
                    let pair = _mm512_set1_epi32(std::ptr::read_unaligned(bsums.add(k)));
                    imin = _mm512_dpwssd_epi32(imin, m, pair);
                }
                let d_y = _mm512_set1_ps(y.d.get());
                let s = _mm512_fmadd_ps(_mm512_mul_ps(d_y, d), _mm512_cvtepi32_ps(isum[tk]), *acc);
                *acc = _mm512_fnmadd_ps(_mm512_mul_ps(d_y, dmin), _mm512_cvtepi32_ps(imin), s);
            }
        }
        store_all(out, sumf, t, r0, mask);
    }

    /// Tokens `t..t + NT` against one Q6_K group. Per super-block, each 32-bit word of `ql`
    /// with the matching `qh` word gives four bytes of 6-bit quants `q + 32` per row (low
    /// nibbles with `qh` bits `2k..2k + 2` for `k < 2`, high nibbles for `k >= 2`); per group j
    /// of 16 elements, four `vpdpbusd` from `-32 Σy_j` give each row's exact `Σ q y`, times the
    /// rows' scales (`vpmulld`). The float step is `kquants`' lane by lane:
    /// `sumf = fma(d_y * d_x, isum, sumf)`.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn tokens_q6_k<const NT: usize>(
        group: &[u8],
        part: Part,
        ys: &[&[BlockQ8K]],
        _min_pairs: &[[i32; 4]],
        t: usize,
        out: &Out,
        r0: usize,
        mask: __mmask16,
    ) {
        use super::Q6_GROUP_BLOCK;
        let ahead = prefetch_ahead();
        let q = group.as_ptr();
        let mut sumf: [__m512; NT] = std::array::from_fn(|j| start(out, part, t + j, r0, mask));
        let nb = part.nb;
        for b in 0..nb {
            let p = q.add(b * Q6_GROUP_BLOCK);
            let dx = d_after(q, nb, Q6_GROUP_BLOCK, b);
            let yb: [&BlockQ8K; NT] =
                std::array::from_fn(|tk| ys.get_unchecked(t + tk).get_unchecked(b));
            let mut isum = [[_mm512_setzero_si512(); NT]; 1];
            q6_block([p], ahead, yb, &mut isum);
            let [isum] = isum;
            for (tk, y) in yb.into_iter().enumerate() {
                let d_y = _mm512_set1_ps(y.d.get());
                sumf[tk] = _mm512_fmadd_ps(
                    _mm512_mul_ps(d_y, dx),
                    _mm512_cvtepi32_ps(isum[tk]),
                    sumf[tk],
                );
            }
        }
        store_all(out, sumf, t, r0, mask);
    }

    /// The sixteen rows' `d` of block b of the group at `q` (`nb` blocks of `block` bytes, the
    /// `d`s after them: Q6_K, Q3_K), widened; every other block, the next group's `d` asked into L2 (they lie past that group's blocks, off
    /// the stream the hardware prefetcher follows; the group's own were asked for during the
    /// group before), whatever the quants' prefetch distance (none by default on AMD). The
    /// Llama-3.2-1B head (Q6_K 2048 x 128256, 2 EPYC threads, one group at a time) read
    /// 0.80-0.94 of the plain read without these and 0.95-0.98 with them.
    #[inline(always)]
    unsafe fn d_after(q: *const u8, nb: usize, block: usize, b: usize) -> __m512 {
        let d = q.add(nb * block);
        if b.is_multiple_of(2) {
            let next = b * SCALES + nb * (block + SCALES);
            _mm_prefetch::<_MM_HINT_T1>(d.wrapping_add(next).cast());
        }
        _mm512_cvtph_ps(_mm256_loadu_si256(d.add(b * SCALES).cast()))
    }

    /// One Q6_K block of each of `G` groups (at `ps`) against `NT` tokens' blocks `ys`, added to
    /// the sums `isum[group][token]`: the block's halves in the order of its words, each group's
    /// in turn ([`q6_half`]).
    #[inline(always)]
    unsafe fn q6_block<const G: usize, const NT: usize>(
        ps: [*const u8; G],
        ahead: Ahead,
        ys: [&BlockQ8K; NT],
        isum: &mut [[__m512i; NT]; G],
    ) {
        for (&p, is) in ps.iter().zip(isum.iter_mut()) {
            q6_half::<0, 0, NT>(p, ahead, ys, is);
        }
        for (&p, is) in ps.iter().zip(isum.iter_mut()) {
            q6_half::<0, 1, NT>(p, ahead, ys, is);
        }
        for (&p, is) in ps.iter().zip(isum.iter_mut()) {
            q6_half::<1, 0, NT>(p, ahead, ys, is);
        }
        for (&p, is) in ps.iter().zip(isum.iter_mut()) {
            q6_half::<1, 1, NT>(p, ahead, ys, is);
        }
    }

    /// The four groups `8 H + 2 k + S` (k = 0..4) of the sixteen rows' Q6_K block at `p` for
    /// the tokens' blocks `ys`, added to their sums `isum` ([`q6_group`]). The indices are
    /// constants, so the words' places, the shifts and the scale's byte are too (with the loops
    /// over them at run time the kernel computed each slot and shift, spilled the words and read
    /// 27-32 GB/s in cache; 1 EPYC thread, Q6_K 2048 x 512, `examples/matmul_dram`).
    #[inline(always)]
    unsafe fn q6_half<const H: usize, const S: usize, const NT: usize>(
        p: *const u8,
        ahead: Ahead,
        ys: [&BlockQ8K; NT],
        isum: &mut [__m512i; NT],
    ) {
        let ws = q6_words(p, H, S);
        q6_group::<H, S, 0, NT>(p, &ws, ahead, ys, isum);
        q6_group::<H, S, 1, NT>(p, &ws, ahead, ys, isum);
        q6_group::<H, S, 2, NT>(p, &ws, ahead, ys, isum);
        q6_group::<H, S, 3, NT>(p, &ws, ahead, ys, isum);
    }

    /// Group j = `8 H + 2 K + S` (elements `128 H + 32 K + 16 S..+ 16`) of the sixteen rows'
    /// Q6_K block at `p` (its words `ws` from [`q6_words`]`(p, H, S)`), for each token's block
    /// in `ys` and its sums in `isum`: four `vpdpbusd` from `-32 Σy_j` give each row's exact
    /// `Σ q y`, times the rows' scale j (`vpmulld`), added to the sums. Asks for this part of
    /// the lines `ahead` bytes past the block.
    #[inline(always)]
    unsafe fn q6_group<const H: usize, const S: usize, const K: usize, const NT: usize>(
        p: *const u8,
        ws: &Q6Words,
        ahead: Ahead,
        ys: [&BlockQ8K; NT],
        isum: &mut [__m512i; NT],
    ) {
        use super::Q6_WORDS;
        let j = 8 * H + 2 * K + S;
        prefetch_part(p, ahead, Q6_WORDS, 4 * (2 * H + S) + K, 16);
        let z = q6_quants(ws, K);
        // Scale j: byte j % 4 of word 48 + j / 4.
        let sc = signed_byte(q6_word(p, Q6_WORDS - 4 + j / 4), j % 4);
        for (y, is) in ys.into_iter().zip(isum.iter_mut()) {
            let yq = y.qs.as_ptr().add(16 * j);
            let off = -32 * i32::from(y.bsums.get_unchecked(j).get());
            let mut acc = _mm512_set1_epi32(off);
            for (i, zi) in z.iter().enumerate() {
                acc = dpbusd_bcst(acc, *zi, yq.add(4 * i).cast());
            }
            *is = _mm512_add_epi32(*is, _mm512_mullo_epi32(acc, sc));
        }
    }

    /// `vpdpbusd` of `z` against the four bytes at `y` in every lane, read by the instruction
    /// itself (an embedded broadcast). Written as intrinsics, the compiler took a whole Q6_K
    /// block's 64 broadcasts out of [`q6_half`]'s groups, before them, kept them on the stack
    /// and read them back 64 bytes each (27-32 against 52-55 GB/s in cache).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn dpbusd_bcst(acc: __m512i, z: __m512i, y: *const u8) -> __m512i {
        let mut acc = acc;
        // SAFETY: the caller passes `y` with four readable bytes; the instruction needs
        // AVX512-VNNI, which this function's features include.
        std::arch::asm!(
            "vpdpbusd {acc}, {z}, dword ptr [{y}]{{1to16}}",
            acc = inout(zmm_reg) acc,
            z = in(zmm_reg) z,
            y = in(reg) y,
            options(pure, readonly, nostack, preserves_flags),
        );
        acc
    }

    /// The `ql` and `qh` words of a Q6_K block at `p` in the interleaved layout that hold
    /// elements `128 h + 32 k + 16 s..+ 16` (every k) of each row: `ql` words
    /// `16 h + 8 (i / 4) + 4 s + i % 4` (i = 0..8) and `qh` words `32 + 8 h + 4 s + i`
    /// (i = 0..4), for [`q6_quants`].
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(crate) unsafe fn q6_words(p: *const u8, h: usize, s: usize) -> Q6Words {
        let word = |w: usize| q6_word(p, w);
        Q6Words {
            ql: std::array::from_fn(|i| word(16 * h + 8 * (i / 4) + 4 * s + i % 4)),
            qh: std::array::from_fn(|i| word(32 + 8 * h + 4 * s + i)),
        }
    }

    /// Word `w` (the file's order) of the sixteen rows' Q6_K block at `p` ([`super::q6_slot`]).
    #[inline(always)]
    pub(crate) unsafe fn q6_word(p: *const u8, w: usize) -> __m512i {
        _mm512_loadu_si512(p.add(64 * super::q6_slot(w)).cast())
    }

    /// See [`q6_words`].
    pub(crate) struct Q6Words {
        ql: [__m512i; 8],
        qh: [__m512i; 4],
    }

    /// The 6-bit quants `q + 32` of elements `128 h + 32 k + 16 s + 4 i..+ 4` (i = 0..4) of
    /// each row (lane r: row r) from their words `w` ([`q6_words`]): the low nibbles of `ql`
    /// for `k < 2`, the high for `k >= 2`, with bits `2k..2k + 2` of `qh` above.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(crate) unsafe fn q6_quants(w: &Q6Words, k: usize) -> [__m512i; 4] {
        let (m4, m30) = (_mm512_set1_epi8(0x0F), _mm512_set1_epi8(0x30));
        let mut z = [_mm512_setzero_si512(); 4];
        for (i, z) in z.iter_mut().enumerate() {
            let lo = w.ql[4 * (k % 2) + i];
            let lo = if k < 2 {
                lo
            } else {
                _mm512_srli_epi32::<4>(lo)
            };
            // qh bits 2k..2k + 2 to bits 4..6 (a bit shifted in from the neighbouring byte
            // lands outside 0x30).
            let hi = match k {
                0 => _mm512_slli_epi32::<4>(w.qh[i]),
                1 => _mm512_slli_epi32::<2>(w.qh[i]),
                2 => w.qh[i],
                _ => _mm512_srli_epi32::<2>(w.qh[i]),
            };
            // (lo & 0x0F) | (hi & 0x30) in two operations: `vpternlogd` takes bits 0..4
            // from lo and the others from the masked hi (0xE4: C ? A : B).
            *z = _mm512_ternarylogic_epi32::<0xE4>(lo, _mm512_and_si512(hi, m30), m4);
        }
        z
    }

    /// Byte `i` of every 32-bit lane of `w`, sign-extended (Q6_K's scales).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(crate) unsafe fn signed_byte(w: __m512i, i: usize) -> __m512i {
        match i {
            0 => _mm512_srai_epi32::<24>(_mm512_slli_epi32::<24>(w)),
            1 => _mm512_srai_epi32::<24>(_mm512_slli_epi32::<16>(w)),
            2 => _mm512_srai_epi32::<24>(_mm512_slli_epi32::<8>(w)),
            _ => _mm512_srai_epi32::<24>(w),
        }
    }

    /// Part `part` of `parts` of the `lines` cache lines `ahead.bytes` past `p` asked for (none
    /// when that is 0), with `ahead`'s hint. A block's lines asked a few at a time between its
    /// computations, not all at its start: out of cache, 1 EPYC thread, the Llama-3.2-1B head
    /// (Q6_K 2048 x 128256, `examples/matmul_dram`) read 12.5 GB/s with its 52 lines asked at
    /// once, 16.7 in four parts, 22.4 in sixteen.
    #[inline(always)]
    pub(crate) unsafe fn prefetch_part(
        p: *const u8,
        ahead: Ahead,
        lines: usize,
        part: usize,
        parts: usize,
    ) {
        if ahead.bytes > 0 {
            for c in part * lines / parts..(part + 1) * lines / parts {
                ahead.line(p.wrapping_add(ahead.bytes + 64 * c));
            }
        }
    }

    /// How far ahead of the quants the interleaved kernels prefetch, and how: taken once per
    /// kernel call ([`prefetch_ahead`]), not per line.
    #[derive(Clone, Copy)]
    pub(crate) struct Ahead {
        /// Bytes past the current block (0: no prefetch).
        bytes: usize,
        /// The non-temporal hint (AMD's short distance) rather than T1 (Intel's 16 KiB).
        nta: bool,
    }

    impl Ahead {
        /// No prefetch.
        pub(crate) const NONE: Ahead = Ahead {
            bytes: 0,
            nta: false,
        };

        /// The line at `at` asked for with this hint.
        #[inline(always)]
        unsafe fn line(self, at: *const u8) {
            if self.nta {
                _mm_prefetch::<_MM_HINT_NTA>(at.cast());
            } else {
                _mm_prefetch::<_MM_HINT_T1>(at.cast());
            }
        }
    }

    /// Bytes of quants ahead that the interleaved kernels prefetch, and the hint (0: none;
    /// `OATO_CPU_REPACK_PREFETCH` sets it). Elsewhere than on Intel 256 bytes with the
    /// non-temporal hint: the rows' lines then leave L1 first, and the requests run ahead of the hardware's prefetcher a little. 1 EPYC thread, out of cache
    /// (`examples/matmul_dram`, three or four alternated rounds), fraction of the plain read
    /// with none / 256 / 512 / 1024 bytes (K x N): Q4_0 2048 x 8192 0.92-0.97 / 1.02-1.06 /
    /// 1.04-1.10 / -; 8192 x 2048 (ffn_down) 0.90-0.95 / 0.93-1.03 / 1.03-1.05 / 0.85-0.89;
    /// 4096 x 14336 0.88-0.95 / 0.98-1.06 / 0.96-1.01 / 0.85-0.88; Q4_K 2048 x 8192 0.95-1.00 /
    /// 1.00-1.07 / 1.00-1.03 / 0.70-0.81; Q6_K 2048 x 128256 (the head) 0.93-0.955 / 0.925-0.99 / 0.91-0.94 / 0.75-0.77 (five
    /// more rounds, none / 256: 0.85-0.97 / 0.72-0.96; 8192 x 2048 0.88-0.91 / 0.80-0.91:
    /// Q6_K reads alike within this machine's noise, and keeps the one distance). At 2
    /// threads, all near the plain read already, alike (Q4_0 0.98-1.05 either way, Q6_K
    /// 0.91-1.00 / 0.92-1.02). On Intel CPUs 16 KiB into L2 for every type
    /// (the figure before the measurements below, which were all on AMD; never measured on
    /// Intel). Before the non-temporal hint, AMD took none: the hardware's prefetcher follows
    /// the blocks, which are read in order, and a prefetch into L2 ahead of it only cost. Out of
    /// cache, 4096 x 14336 (`examples/matmul_dram`, 2 EPYC threads, memory at 35-37 GB/s,
    /// alternated), fraction of the plain read with none / 16 KiB: Q4_0
    /// 0.95-0.97 / 0.89-0.90, Q4_K 1.00-1.02 / 0.89-0.90; 1 thread, Q4_0 25.3 / 21.0 GB/s.
    /// Q6_K, whose block's lines were read out of order (the scales at its end first, `ql` and
    /// `qh` in halves), read 0.46 of it with none; in the order of [`super::q6_slot`] 0.83-0.85
    /// with none and 0.87-0.88 with 16 KiB (the old order 0.83-0.85 with 16 KiB); 8, 16 and 32
    /// KiB read alike, 2 KiB much worse (0.60). Before the Q4_0 kernel read groups side by side
    /// it read better with 16 KiB (1B shape tg32, 42.0 / 34.7 t/s best / median, against 31.1 /
    /// 31.1 with none). Q6_K kept 16 KiB until its kernel took its group indices as constants
    /// ([`q6_half`]); since, the Llama-3.2-1B head (2048 x 128256) reads 0.86 of the plain read
    /// at 1 thread with none and 0.47-0.51 with 2, 8, 16 or 64 KiB (0.95 and 0.68-0.79 at 2
    /// threads).
    ///
    /// AVX2's kernels (`repack_avx2`, AMD without AVX-512) ask 2048 bytes ahead. 2 threads of a
    /// Zen 3 VM, out of cache, 2048 x 8192 (`examples/matmul_dram`, four rounds, each distance
    /// its own run, this machine's read rate moving 26-33 GB/s between them), GB/s with 256 /
    /// 1024 bytes: Q4_0 24.7 / 30.4 (0.94 / 1.02 of the plain read), Q4_K 24.6 / 26.0 (0.82 /
    /// 0.86), Q6_K 21.0 / 23.2 (0.73 / 0.70; none 16.2, 4096 24.4). Then 1024 against 2048,
    /// decode of whole files (`oato bench -n 64 -t 2`, alternated, fraction of the read loop):
    /// 1B Q4_K_M 0.82, 0.72, 0.88, 0.72 / 0.83, 0.83, 0.89, 0.79; 1B Q4_0 0.97, 0.93, 0.89,
    /// 0.87 / 0.92, 0.91, 0.99, 0.92; 8B Q4_0 (`-n 32`) 0.88, 0.93 / 1.07, 0.96. A guess at
    /// why, not measured: a stream at 14 GB/s a thread with memory ~100 ns away (a typical
    /// figure, not this VM's) needs ~1.4 KB in flight.
    ///
    /// AMD's Zen 5 (family 0x1A and later, AVX-512) asks 4096 bytes ahead: 2 threads of a Zen 5
    /// VM, out of cache (`examples/matmul_dram`, alternated rounds, this machine's read rate
    /// 40-66 GB/s between them), GB/s of weights with 256 / 4096 bytes: Q4_0 4096 x 14336
    /// 58.7, 59.6, 58.7 / 71.5, 75.0, 75.5 (2048: 67.3, 69.3, 67.1; 8192 and 16 KiB no better
    /// than 4096), 14336 x 4096 57.9, 57.4 / 73.5, 73.0, 2048 x 8192 59.1, 56.4 / 68.6, 72.9;
    /// Q4_K 4096 x 14336 68.4, 66.4 / 72.9, 73.6; Q5_K 38.2, 36.4 / 57.8, 56.0; Q6_K 28.4,
    /// 28.1 / 49.5, 54.0, 8192 x 2048 28.1, 27.9 / 46.7, 51.0, the 1B head (2048 x 128256)
    /// 36.4, 49.3 / 38.3, 59.2. Decode of whole files (`oato bench -p 0 -n 32 -t 2`,
    /// alternated), fraction of the read loop with 256 / 4096: 1B Q4_0 0.86, 0.82, 0.83 / 0.94,
    /// 0.93, 0.86; 8B Q4_0 0.83, 0.83 / 0.95, 1.00; 1B Q4_K_M 0.83-0.85 / 0.79-0.91 (noise).
    /// Zen 4 keeps 256 (its figures above).
    ///
    /// `OATO_CPU_REPACK_PREFETCH_HINT=nta|t1` picks the hint whatever the vendor (the default
    /// distance then follows the hint), so that Intel's choice can be measured
    /// (`experiments/gpu-hybrid.sh cpu-prefetch`).
    pub(crate) fn prefetch_ahead() -> Ahead {
        static ENV: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
        static HINT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        let nta = *HINT.get_or_init(|| {
            let var = std::env::var("OATO_CPU_REPACK_PREFETCH_HINT").ok();
            let intel = crate::kernels::cpu::matmul::intel();
            hint_is_nta(var.as_deref(), intel).unwrap_or_else(|bad| {
                eprintln!(
                    "oato: OATO_CPU_REPACK_PREFETCH_HINT={bad:?} is neither nta nor t1; \
                     using this CPU's default ({})",
                    if intel { "t1" } else { "nta" }
                );
                !intel
            })
        });
        let bytes = match OVERRIDE.load(std::sync::atomic::Ordering::Relaxed) {
            NONE => *ENV.get_or_init(|| {
                let avx512 = crate::kernels::cpu::isa() == crate::kernels::cpu::Isa::Avx512;
                let default = match (nta, avx512) {
                    (true, true) if crate::kernels::cpu::matmul::zen5_or_later() => 4096,
                    (true, true) => 256,
                    (true, false) => 2048,
                    (false, _) => 16 << 10,
                };
                crate::kernels::cpu::matmul::env_bytes("OATO_CPU_REPACK_PREFETCH", default)
            }),
            bytes => bytes,
        };
        Ahead { bytes, nta }
    }

    /// Whether the interleaved kernels prefetch with the non-temporal hint: as `var` says
    /// (`nta` or `t1`), else on every CPU but Intel's; `Err` with `var` when it says neither.
    pub(super) fn hint_is_nta(var: Option<&str>, intel: bool) -> Result<bool, String> {
        match var.map(str::trim) {
            None | Some("") => Ok(!intel),
            Some(v) if v.eq_ignore_ascii_case("nta") => Ok(true),
            Some(v) if v.eq_ignore_ascii_case("t1") => Ok(false),
            Some(v) => Err(v.to_string()),
        }
    }

    /// [`set_prefetch_ahead`]'s distance, [`NONE`] when unset.
    static OVERRIDE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(NONE);
    const NONE: usize = usize::MAX;

    /// Sets the prefetch distance of every interleaved kernel (`None`: as without the call,
    /// `OATO_CPU_REPACK_PREFETCH` or the per-type defaults), for experiments that compare
    /// distances in one process (`examples/matmul_dram`).
    pub fn set_prefetch_ahead(bytes: Option<usize>) {
        OVERRIDE.store(bytes.unwrap_or(NONE), std::sync::atomic::Ordering::Relaxed);
    }

    /// The lines `ahead.bytes` past Q4_0 block b's quants at `p`, and for the second block of a
    /// pair the line of their scales after them, asked for (none when that is 0). Past the
    /// group's end they are the next group's (or outside the matrix, where a prefetch does
    /// nothing).
    #[inline(always)]
    pub(crate) unsafe fn prefetch_q4_0(p: *const u8, b: usize, ahead: Ahead) {
        prefetch_part(p, ahead, QUANTS / 64, 0, 1);
        if ahead.bytes > 0 && b % 2 == 1 {
            ahead.line(p.wrapping_add(ahead.bytes + QUANTS));
        }
    }

    /// One Q4_0 block of a group, its quants at `p`: the sixteen rows' low nibbles (the block's
    /// elements `4e..4e + 4` in word e < 4), then their high nibbles left in place, sixteen
    /// times the quants `16 + 4e..` (word 4 + e; [`isum`] divides their sum by sixteen): one
    /// `vpandd` a register, where shifting them down took two. `NL` (IQ4_NL): both halves
    /// through `table` ([`iq4_table`]: `IQ4_VALUES + 128`), the high nibbles shifted down first.
    #[inline(always)]
    unsafe fn nibbles<const NL: bool>(p: *const u8, low: __m512i, table: __m512i) -> [__m512i; 8] {
        let v: [__m512i; 4] = std::array::from_fn(|c| _mm512_loadu_si512(p.add(64 * c).cast()));
        if NL {
            return std::array::from_fn(|e| iq4_bytes(v[e % 4], e >= 4, table, low));
        }
        let high = _mm512_set1_epi8(0xF0u8 as i8);
        std::array::from_fn(|e| {
            if e < 4 {
                _mm512_and_si512(v[e], low)
            } else {
                _mm512_and_si512(v[e - 4], high)
            }
        })
    }

    /// The sixteen bytes `IQ4_VALUES[q] + 128` (1..242) in every 128-bit lane: IQ4_NL's and
    /// IQ4_XS's quants as unsigned bytes for `vpdpbusd`, `Σ (v + 128) y - 128 Σ y` being the
    /// exact `Σ v y`.
    #[inline(always)]
    pub(crate) unsafe fn iq4_table() -> __m512i {
        let t: [u8; 16] = crate::quant::blocks::IQ4_VALUES.map(|v| (v as i16 + 128) as u8);
        _mm512_broadcast_i32x4(_mm_loadu_si128(t.as_ptr().cast()))
    }

    /// The low (or, `high`, the high) nibbles of every byte of `v` through `table`
    /// ([`iq4_table`]); `low` is `0x0F` in every byte.
    #[inline(always)]
    pub(crate) unsafe fn iq4_bytes(
        v: __m512i,
        high: bool,
        table: __m512i,
        low: __m512i,
    ) -> __m512i {
        let q = if high { _mm512_srli_epi16::<4>(v) } else { v };
        _mm512_shuffle_epi8(table, _mm512_and_si512(q, low))
    }

    /// The sixteen rows' exact `isum` of one block: `ns` (the token block's `-8 Σy`) plus four
    /// `vpdpbusd` of the low nibbles `w[..4]` with `word(e)`, the token's quant bytes
    /// `4e..4e + 4`, plus a sixteenth of four `vpdpbusd` of the high nibbles in place (`w[4..]`,
    /// sixteen times the quants; every product a multiple of sixteen, so the shift is exact,
    /// and `|sum| <= 16 * 240 * 128 < 2^31`). `NL` (IQ4_NL): the quants are `v + 128` in both
    /// halves, from `16 ns` (`-128 Σy`), with no shift (`|sum| <= 32 * 242 * 128 < 2^31`). The
    /// integers are exact in any order.
    #[inline(always)]
    unsafe fn isum<const NL: bool>(
        w: &[__m512i; 8],
        ns: __m512i,
        word: impl Fn(usize) -> __m512i,
    ) -> __m512i {
        let mut s0 = if NL { _mm512_slli_epi32::<4>(ns) } else { ns };
        let mut s1 = _mm512_setzero_si512();
        for e in 0..4 {
            s0 = _mm512_dpbusd_epi32(s0, w[e], word(e));
            s1 = _mm512_dpbusd_epi32(s1, w[4 + e], word(4 + e));
        }
        if NL {
            _mm512_add_epi32(s0, s1)
        } else {
            _mm512_add_epi32(s0, _mm512_srai_epi32::<4>(s1))
        }
    }

    /// Tokens `t..t + NT` against one Q4_0 group (`NL`: IQ4_NL, the same layout): the sixteen
    /// rows' sums of each token, stored to rows `r0..r0 + 16` (lanes in `mask`) of its output
    /// row.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn tokens<const NT: usize, const NL: bool>(
        group: &[u8],
        part: Part,
        ys: &[&[BlockQ8_0]],
        nsum: &[i32],
        t: usize,
        out: &Out,
        r0: usize,
        mask: __mmask16,
    ) {
        let (low, table) = (_mm512_set1_epi8(0x0F), iq4_table());
        let q = group.as_ptr();
        let mut sumf: [__m512; NT] = std::array::from_fn(|j| start(out, part, t + j, r0, mask));
        let ahead = prefetch_ahead();
        let nb = part.nb;
        for b in 0..nb {
            let p = q.add(super::q4_0_quants(b));
            let d = q.add(super::q4_0_scales(nb, b));
            prefetch_q4_0(p, b, ahead);
            let w = nibbles::<NL>(p, low, table);
            let dx = _mm512_cvtph_ps(_mm256_loadu_si256(d.cast()));
            for (j, acc) in sumf.iter_mut().enumerate() {
                let y = ys.get_unchecked(t + j).get_unchecked(b);
                let yq = y.qs.as_ptr();
                let word =
                    |e: usize| _mm512_set1_epi32(std::ptr::read_unaligned(yq.add(4 * e).cast()));
                let s = isum::<NL>(
                    &w,
                    _mm512_set1_epi32(*nsum.get_unchecked((t + j) * part.stride + b)),
                    word,
                );
                // The token block's scale broadcast and converted, not looked up in a table
                // of every f16: real activations' scales missed its lines (8B Q4_0 file, 1
                // thread, `examples/decode_mix`: 10-15% slower than against one scale).
                let dd = _mm512_mul_ps(dx, crate::kernels::cpu::avx2::h2f_splat16(y.d));
                *acc = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(s), *acc);
            }
        }
        store_all(out, sumf, t, r0, mask);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::blocks::QK;

    /// The prefetch hint: the vendor's default when unset or empty, either hint when named (in
    /// any case, spaces trimmed), an error naming anything else.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn prefetch_hint_from_the_environment() {
        for intel in [false, true] {
            assert_eq!(hint_is_nta(None, intel), Ok(!intel));
            assert_eq!(hint_is_nta(Some(" "), intel), Ok(!intel));
            assert_eq!(hint_is_nta(Some("nta"), intel), Ok(true));
            assert_eq!(hint_is_nta(Some(" T1 "), intel), Ok(false));
            assert_eq!(hint_is_nta(Some("t0"), intel), Err("t0".to_string()));
        }
    }

    #[test]
    fn rows_come_back_from_the_interleaved_layout() {
        let (k, n) = (96, 32);
        let rb = (k / QK) * BLOCK;
        let plain: Vec<u8> = (0..n * rb).map(|i| (i * 7 + i / 13) as u8).collect();
        let arena = Arena::default();
        let packed = pack(GgmlType::Q4_0, &plain, k, n, 3, &arena).unwrap();
        let again = pack(GgmlType::Q4_0, &plain, k, n, 1, &arena).unwrap();
        assert_eq!(packed.bytes(), again.bytes());
        assert_eq!(again.bytes().as_ptr() as usize % 64, 0);
        assert_eq!(packed.bytes().len(), plain.len());
        assert_ne!(packed.bytes(), &plain[..]);
        let mut row = vec![0u8; rb];
        for r in 0..n {
            plain_row(GgmlType::Q4_0, packed.bytes(), k, r, &mut row);
            assert_eq!(row, plain[r * rb..(r + 1) * rb], "row {r}");
        }
    }

    #[test]
    fn k_quant_rows_come_back_from_the_interleaved_layout() {
        for (ty, k) in [
            (GgmlType::Q4_K, 512),
            (GgmlType::Q6_K, 768),
            // Two slabs, the second narrower; three for Q4_0.
            (GgmlType::Q4_K, SLAB + 512),
            (GgmlType::Q6_K, SLAB + 768),
            (GgmlType::Q4_0, 2 * SLAB + 96),
            (GgmlType::Q2_K, SLAB + 512),
            (GgmlType::Q3_K, SLAB + 768),
            (GgmlType::Q5_K, SLAB + 256),
            (GgmlType::IQ4_NL, SLAB + 96),
            (GgmlType::IQ4_XS, SLAB + 512),
        ] {
            let n = 32;
            let mut rng = crate::rng::SplitMix64::new(5);
            let plain = crate::kernels::cpu::random_rows(ty, k, n, &mut rng);
            let packed = pack(ty, &plain, k, n, 2, &Arena::default()).unwrap();
            assert_eq!(packed.bytes().len(), plain.len());
            let rb = plain.len() / n;
            let mut row = vec![0u8; rb];
            for r in 0..n {
                plain_row(ty, packed.bytes(), k, r, &mut row);
                assert_eq!(row, plain[r * rb..(r + 1) * rb], "{ty} row {r}");
            }
        }
    }

    #[test]
    fn bad_shapes_are_refused() {
        let a = Arena::default();
        let q4 = GgmlType::Q4_0;
        assert!(pack(q4, &[0u8; 18 * 15], 32, 15, 1, &a).is_err());
        assert!(pack(q4, &[0u8; 18 * 16], 32, 16, 1, &a).is_ok());
        assert!(pack(q4, &[0u8; 18 * 16 - 1], 32, 16, 1, &a).is_err());
        assert!(pack(q4, &[], 32, 0, 1, &a).is_err());
        assert!(pack(GgmlType::Q8_0, &[0u8; 34 * 16], 32, 16, 1, &a).is_err());
        assert!(pack(GgmlType::Q4_K, &[0u8; 144 * 16], 256, 16, 1, &a).is_ok());
        assert!(pack(GgmlType::Q6_K, &[0u8; 210 * 16], 256, 16, 1, &a).is_ok());
        assert!(pack(GgmlType::Q6_K, &[0u8; 210 * 16], 128, 32, 1, &a).is_err());
    }
}

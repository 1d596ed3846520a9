//! Q4_0 weights kept by the CPU in a layout of its own, rows interleaved by sixteen (AVX-512
//! CPUs): one 512-bit register holds four quant bytes of each of sixteen rows, lane r being row r.
//! A dot product then needs no sum across lanes. Per block and token, eight `vpdpbusd` of the
//! unpacked nibbles with the token's four bytes broadcast, started from the block's `-8 Σy`, give
//! the sixteen rows' exact `isum`; the float step is the single-row kernel's, lane by lane,
//!
//! ```text
//! sumf = fma(d_x * d_y, isum as f32, sumf)        (block order)
//! ```
//!
//! so every output has the bits of `scalar::vec_dot_q4_0_q8_0`. The four-row kernel it replaces
//! (`avx512::rows_q4_0`) spends most of its time summing lanes across registers, which Zen 4's
//! shuffle port bounds at about 20 GB/s of weights per core; llama.cpp repacks Q4_0 for the same
//! reason.
//!
//! Layout, per group of sixteen rows with `nb` blocks each: `nb * 256` bytes of quants, then
//! `nb * 32` bytes of scales. Block b's quants are four 64-byte chunks: chunk c holds in lane r
//! bytes `4c..4c + 4` of row r's block b (low nibbles: elements `4c..4c + 4`, high nibbles:
//! `16 + 4c..20 + 4c`). Its scales are the sixteen rows' `d` (f16). A group takes the bytes of
//! its sixteen rows, so the repacked matrix has the file's size.

use crate::error::{Error, Result};
use crate::quant::GgmlType;
use crate::quant::blocks::QK;

/// Rows per group: one 32-bit lane each.
pub const ROWS: usize = 16;

/// Bytes of one Q4_0 block.
const BLOCK: usize = 18;

/// Bytes of one block's quants for the group.
const QUANTS: usize = 256;

/// Bytes of one block's scales for the group.
const SCALES: usize = 32;

/// Whether the CPU keeps a weight of type `ty`, `n` rows of `k`, in the interleaved layout: Q4_0
/// with whole groups of rows, on a CPU running the AVX-512 kernels, unless `OATO_CPU_REPACK=0`.
pub fn repacks(ty: GgmlType, k: usize, n: usize) -> bool {
    ty == GgmlType::Q4_0
        && n > 0
        && n.is_multiple_of(ROWS)
        && k > 0
        && k.is_multiple_of(QK)
        && super::isa() == super::Isa::Avx512
        && enabled()
}

/// `OATO_CPU_REPACK=0` keeps Q4_0 weights in the file's layout (for comparison: the same bits).
fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("OATO_CPU_REPACK").map_or(true, |v| v.trim() != "0"))
}

/// Bytes reserved at a time for interleaved weights: many weights share one reservation, so
/// they sit in huge pages without each being rounded up to 2 MiB (untouched reservation costs
/// no memory).
const REGION_BYTES: usize = 1 << 30;

/// Huge-page alignment of a region's start.
const HUGE: usize = 2 << 20;

/// Anonymous memory that interleaved weights are carved from, one region at a time; a region
/// is given back when the last weight in it is dropped.
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
                "repacking a Q4_0 weight: {} bytes: {e}",
                size + HUGE
            ))
        };
        let map = memmap2::MmapMut::map_anon(size + HUGE).map_err(alloc)?;
        #[cfg(target_os = "linux")]
        let _ = map.advise(memmap2::Advice::HugePage); // small pages work too
        let map = memmap2::MmapRaw::from(map);
        let start = (map.as_ptr() as usize).next_multiple_of(HUGE) - map.as_ptr() as usize;
        let region = std::sync::Arc::new(Region {
            map,
            start,
            len: size,
        });
        *cur = (std::sync::Arc::downgrade(&region), len);
        Ok((region, 0))
    }
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
        // `region`; it was written only by `pack`, before this value existed.
        unsafe {
            std::slice::from_raw_parts(
                self.region.map.as_ptr().add(self.region.start + self.at),
                self.len,
            )
        }
    }
}

impl Arena {
    /// A piece of `len` bytes filled by `fill(offset, bytes)` over pieces of a multiple of
    /// `unit` bytes, spread over `threads` threads.
    fn filled(
        &self,
        len: usize,
        unit: usize,
        threads: usize,
        fill: impl Fn(usize, &mut [u8]) + Sync,
    ) -> Result<Piece> {
        let (region, at) = self.piece(len)?;
        // SAFETY: the piece is inside the region's map and handed out once (Arena::piece):
        // nothing else reads or writes it while this slice lives.
        let dst = unsafe {
            std::slice::from_raw_parts_mut(region.map.as_mut_ptr().add(region.start + at), len)
        };
        let units = len.div_ceil(unit.max(1)).max(1);
        let per = units.div_ceil(threads.clamp(1, units)) * unit.max(1);
        let fill = &fill;
        std::thread::scope(|s| {
            for (i, d) in dst.chunks_mut(per).enumerate() {
                s.spawn(move || fill(i * per, d));
            }
        });
        Ok(Piece { region, at, len })
    }

    /// A copy of `bytes` (as they are), over `threads` threads.
    pub fn copy(&self, bytes: &[u8], threads: usize) -> Result<Piece> {
        self.filled(bytes.len(), 1 << 20, threads, |at, d| {
            d.copy_from_slice(&bytes[at..at + d.len()])
        })
    }
}

/// `plain` (`n` Q4_0 rows of `k`, the file's layout) in the interleaved layout, in a piece of
/// `arena`, groups spread over `threads` threads.
pub fn pack(plain: &[u8], k: usize, n: usize, threads: usize, arena: &Arena) -> Result<Piece> {
    let rb = check(plain.len(), k, n)?;
    let group = ROWS * rb;
    arena.filled(plain.len(), group, threads, |at, dst| {
        for (i, d) in dst.chunks_mut(group).enumerate() {
            pack_group(&plain[at + i * group..][..group], rb, d);
        }
    })
}

/// Row bytes of an `n` x `k` Q4_0 matrix of `len` bytes, checked.
fn check(len: usize, k: usize, n: usize) -> Result<usize> {
    if n == 0 || !k.is_multiple_of(QK) || !n.is_multiple_of(ROWS) || len != n * (k / QK) * BLOCK {
        return Err(Error::Msg(format!(
            "repack: {len} bytes are not {n} Q4_0 rows of {k} in groups of {ROWS}"
        )));
    }
    Ok((k / QK) * BLOCK)
}

/// Sixteen plain rows of `rb` bytes into one group.
fn pack_group(plain: &[u8], rb: usize, dst: &mut [u8]) {
    let nb = rb / BLOCK;
    let (q, d) = dst.split_at_mut(nb * QUANTS);
    for b in 0..nb {
        for r in 0..ROWS {
            let blk = &plain[r * rb + b * BLOCK..][..BLOCK];
            d[b * SCALES + 2 * r..][..2].copy_from_slice(&blk[..2]);
            for c in 0..4 {
                q[b * QUANTS + 64 * c + 4 * r..][..4].copy_from_slice(&blk[2 + 4 * c..][..4]);
            }
        }
    }
}

/// Row `r`'s bytes in the file's layout, from the interleaved matrix `packed` (rows of `k`).
pub fn plain_row(packed: &[u8], k: usize, r: usize, dst: &mut [u8]) {
    let nb = k / QK;
    let g = &packed[(r / ROWS) * ROWS * nb * BLOCK..][..ROWS * nb * BLOCK];
    let (q, d) = g.split_at(nb * QUANTS);
    let i = r % ROWS;
    for (b, blk) in dst[..nb * BLOCK].chunks_mut(BLOCK).enumerate() {
        blk[..2].copy_from_slice(&d[b * SCALES + 2 * i..][..2]);
        for c in 0..4 {
            blk[2 + 4 * c..][..4].copy_from_slice(&q[b * QUANTS + 64 * c + 4 * i..][..4]);
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) use kernels::run_rows;

#[cfg(target_arch = "x86_64")]
mod kernels {
    #![allow(unsafe_op_in_unsafe_fn)]

    use std::arch::x86_64::*;
    use std::ops::Range;

    use super::{QUANTS, ROWS, SCALES};
    use crate::kernels::cpu::blocks;
    use crate::kernels::cpu::matmul::{QuantizedActs, SharedOut};
    use crate::quant::blocks::{BlockQ8_0, QK};

    /// Rows `rows` of the interleaved Q4_0 matrix `packed` (rows of `acts.k`) against every
    /// token of `acts` (Q8_0), into `out` (`[token][row]`, `stride` rows per token). `nsum`:
    /// every activation block's `-8 Σy`, token by token. A group only partly inside `rows` is
    /// computed whole and only its rows inside are written. AVX-512 CPUs only.
    pub(crate) fn run_rows(
        acts: &QuantizedActs,
        nsum: &[i32],
        packed: &[u8],
        rows: Range<usize>,
        out: &SharedOut,
        stride: usize,
    ) {
        let nb = acts.k / QK;
        let group = ROWS * nb * super::BLOCK;
        assert!(crate::kernels::cpu::Isa::Avx512.supported());
        assert_eq!(
            nsum.len(),
            acts.n_tok * nb,
            "repack: -8Σy of other activations"
        );
        assert!(rows.end.div_ceil(ROWS) * group <= packed.len());
        let ys: Vec<&[BlockQ8_0]> = (0..acts.n_tok)
            .map(|t| blocks::<BlockQ8_0>(acts.row(t)))
            .collect();
        assert!(ys.iter().all(|y| y.len() == nb));
        let mut g = rows.start / ROWS;
        while g * ROWS < rows.end {
            let r0 = g * ROWS;
            let lo = rows.start.max(r0) - r0;
            let hi = rows.end.min(r0 + ROWS) - r0;
            let mask = (((1u32 << hi) - 1) & !((1u32 << lo) - 1)) as __mmask16;
            let bytes = &packed[g * group..][..group];
            let mut t = 0;
            // SAFETY: AVX-512 is present (asserted); the group holds nb blocks, every token nb
            // blocks and nb sums (asserted); rows r0 + lo..r0 + hi of tokens t.. are inside the
            // output (the caller's contract: `rows` inside the matrix, the output [n_tok][stride])
            // and are written by this task only.
            unsafe {
                // Four tokens at a time: eight (all the weights' registers reused twice as
                // often) was slower, 1B shape pp64 2 threads 243 / 287 t/s.
                while t + 4 <= ys.len() {
                    tokens::<4>(bytes, nb, &ys, nsum, t, out, stride, r0, mask);
                    t += 4;
                }
                while t + 2 <= ys.len() {
                    tokens::<2>(bytes, nb, &ys, nsum, t, out, stride, r0, mask);
                    t += 2;
                }
                if t < ys.len() {
                    tokens::<1>(bytes, nb, &ys, nsum, t, out, stride, r0, mask);
                }
            }
            g += 1;
        }
    }

    /// Bytes of quants ahead that the kernel prefetches into L2 (`OATO_CPU_REPACK_PREFETCH`, 0:
    /// none). 1B shape tg32, 2 EPYC threads, best / median of four alternated rounds, t/s: 8 KiB
    /// 35.2 / 33.1, 16 KiB 42.0 / 34.7, 32 KiB 39.5 / 32.2 (the four-row kernel 34.5 / 34.3);
    /// into L1, 1 KiB and 8 KiB were behind no prefetch (31.1 / 31.1).
    fn prefetch_ahead() -> usize {
        static AHEAD: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
        *AHEAD.get_or_init(|| {
            std::env::var("OATO_CPU_REPACK_PREFETCH")
                .ok()
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(16 << 10)
        })
    }

    /// Tokens `t..t + NT` against one group: the sixteen rows' sums of each token, stored to
    /// rows `r0..r0 + 16` (lanes in `mask`) of its output row.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn tokens<const NT: usize>(
        group: &[u8],
        nb: usize,
        ys: &[&[BlockQ8_0]],
        nsum: &[i32],
        t: usize,
        out: &SharedOut,
        stride: usize,
        r0: usize,
        mask: __mmask16,
    ) {
        let tab = crate::kernels::cpu::avx2::f16_table();
        let low = _mm512_set1_epi8(0x0F);
        let q = group.as_ptr();
        let d = q.add(nb * QUANTS);
        let mut sumf = [_mm512_setzero_ps(); NT];
        let ahead = prefetch_ahead();
        for b in 0..nb {
            let p = q.add(b * QUANTS);
            if ahead > 0 {
                // Past the group's end the lines are the next group's (or outside the matrix,
                // where a prefetch does nothing).
                for c in 0..4 {
                    _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(ahead + 64 * c).cast());
                }
                if b % 2 == 0 {
                    _mm_prefetch::<_MM_HINT_T1>(d.wrapping_add(b * SCALES + ahead / 8).cast());
                }
            }
            let v: [__m512i; 4] = std::array::from_fn(|c| _mm512_loadu_si512(p.add(64 * c).cast()));
            let w: [__m512i; 8] = std::array::from_fn(|e| {
                if e < 4 {
                    _mm512_and_si512(v[e], low)
                } else {
                    _mm512_and_si512(_mm512_srli_epi16::<4>(v[e - 4]), low)
                }
            });
            let dx = _mm512_cvtph_ps(_mm256_loadu_si256(d.add(b * SCALES).cast()));
            for (j, acc) in sumf.iter_mut().enumerate() {
                let y = ys.get_unchecked(t + j).get_unchecked(b);
                let yq = y.qs.as_ptr();
                let word =
                    |e: usize| _mm512_set1_epi32(std::ptr::read_unaligned(yq.add(4 * e).cast()));
                // Two chains of four: the integers are exact in any order.
                let mut s0 = _mm512_set1_epi32(*nsum.get_unchecked((t + j) * nb + b));
                let mut s1 = _mm512_setzero_si512();
                for e in 0..4 {
                    s0 = _mm512_dpbusd_epi32(s0, w[2 * e], word(2 * e));
                    s1 = _mm512_dpbusd_epi32(s1, w[2 * e + 1], word(2 * e + 1));
                }
                let s = _mm512_add_epi32(s0, s1);
                let dd = _mm512_mul_ps(dx, _mm512_set1_ps(tab[y.d.bits() as usize]));
                *acc = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(s), *acc);
            }
        }
        for (j, acc) in sumf.into_iter().enumerate() {
            _mm512_mask_storeu_ps(out.0.add((t + j) * stride + r0), mask, acc);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_come_back_from_the_interleaved_layout() {
        let (k, n) = (96, 32);
        let rb = (k / QK) * BLOCK;
        let plain: Vec<u8> = (0..n * rb).map(|i| (i * 7 + i / 13) as u8).collect();
        let arena = Arena::default();
        let packed = pack(&plain, k, n, 3, &arena).unwrap();
        let again = pack(&plain, k, n, 1, &arena).unwrap();
        assert_eq!(packed.bytes(), again.bytes());
        assert_eq!(again.bytes().as_ptr() as usize % 64, 0);
        assert_eq!(packed.bytes().len(), plain.len());
        assert_ne!(packed.bytes(), &plain[..]);
        let mut row = vec![0u8; rb];
        for r in 0..n {
            plain_row(packed.bytes(), k, r, &mut row);
            assert_eq!(row, plain[r * rb..(r + 1) * rb], "row {r}");
        }
    }

    #[test]
    fn bad_shapes_are_refused() {
        let a = Arena::default();
        assert!(pack(&[0u8; 18 * 15], 32, 15, 1, &a).is_err());
        assert!(pack(&[0u8; 18 * 16], 32, 16, 1, &a).is_ok());
        assert!(pack(&[0u8; 18 * 16 - 1], 32, 16, 1, &a).is_err());
        assert!(pack(&[], 32, 0, 1, &a).is_err());
    }
}

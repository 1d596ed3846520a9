//! Matrix multiplication with a weight in its GGUF format: activations are quantised once per
//! operator to the weight type's dot-product format, then rows are split over the thread pool.
//! Prefill on AVX-512 CPUs runs Q4_0 and the K-quants through `kwide`'s sixteen-row panels, and
//! lays the activations out once more for the tiles of `qwide` (the other 32-element formats) and
//! `f16wide` (F16, BF16); other CPUs use the register tiles of `tile`.

use crate::error::{Error, Result};
use crate::kernels::cpu::pool;
use crate::kernels::cpu::{dot_fn, isa};
use crate::quant::GgmlType;

/// What `kwide`'s panels need of the activations, computed once per operator (nothing off x86).
#[cfg(target_arch = "x86_64")]
type Panels = super::kwide::PanelActs;
#[cfg(not(target_arch = "x86_64"))]
type Panels = ();

/// Activations laid out once per operator for the prefill tiles (AVX-512's; AVX2's F16 / BF16).
enum Prepared {
    /// F16 or BF16 activations widened for `f16wide`'s tiles.
    #[cfg(target_arch = "x86_64")]
    Half(super::f16wide::WideActs),
    #[cfg(target_arch = "x86_64")]
    Q8(super::qwide::PairActs),
    /// F16 or BF16 activations laid out for the AVX2 tiles (`f16tile_avx2`).
    #[cfg(target_arch = "x86_64")]
    HalfAvx2(super::f16tile_avx2::HalfActs),
    /// Q8_0 activations' scales as f32 for the AVX2 tiles of Q8_0 weights (`q8tile_avx2`).
    #[cfg(target_arch = "x86_64")]
    Q8Avx2(super::q8tile_avx2::Scales),
}

impl Prepared {
    /// The layout the AVX-512 tiles take for `acts` against weights of the types `wty`, when
    /// they will run (else `None`).
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
    fn new(acts: &QuantizedActs, wty: impl Iterator<Item = GgmlType> + Clone) -> Option<Prepared> {
        #[cfg(target_arch = "x86_64")]
        {
            if let Some(w) = super::f16wide::WideActs::new(acts) {
                return Some(Prepared::Half(w));
            }
            if let Some(w) = super::f16tile_avx2::HalfActs::new(acts) {
                return Some(Prepared::HalfAvx2(w));
            }
            if wty.clone().any(|t| t == GgmlType::Q8_0)
                && let Some(s) = super::q8tile_avx2::Scales::new(acts)
            {
                return Some(Prepared::Q8Avx2(s));
            }
            let mut wty = wty;
            if !wty.any(super::qwide::supports) {
                return None;
            }
            if let Some(p) = super::qwide::PairActs::new(acts) {
                return Some(Prepared::Q8(p));
            }
        }
        None
    }
}

/// How a weight matrix's bytes are laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// The file's: each row's blocks contiguous, rows one after the other.
    Rows,
    /// Q4_0 or Q4_K rows interleaved by sixteen (`repack`).
    Interleaved,
}

/// A weight matrix view: `n` rows of `k` elements of type `ty`, laid out as `layout` says.
#[derive(Clone, Copy)]
pub struct MatRef<'a> {
    pub ty: GgmlType,
    pub k: usize,
    pub n: usize,
    pub data: &'a [u8],
    pub layout: Layout,
}

impl<'a> MatRef<'a> {
    /// Rows in the file's layout.
    pub fn rows(ty: GgmlType, k: usize, n: usize, data: &'a [u8]) -> MatRef<'a> {
        MatRef {
            ty,
            k,
            n,
            data,
            layout: Layout::Rows,
        }
    }
}

/// Activations already converted to a weight type's `vec_dot_type`: `n_tok` rows of `row_bytes`.
pub struct QuantizedActs {
    pub ty: GgmlType,
    pub k: usize,
    pub n_tok: usize,
    pub row_bytes: usize,
    pub data: Vec<u8>,
}

/// Quantises one activation row, with the AVX2 build of the quantiser when the CPU has it.
fn quantize_act_row(ty: GgmlType, src: &[f32], dst: &mut [u8]) -> Result<()> {
    #[cfg(target_arch = "x86_64")]
    if isa() != super::Isa::Scalar {
        // SAFETY: every non-scalar variant in use includes AVX2, FMA and F16C.
        return unsafe { super::avx2::quantize_act_row(ty, src, dst) };
    }
    crate::quant::quantize_act_row(ty, src, dst)
}

impl QuantizedActs {
    /// Quantises `x` ([n_tok, k], f32) for dot products with weights of type `wty`.
    pub fn new(wty: GgmlType, x: &[f32], k: usize) -> Result<Self> {
        let ty = wty.vec_dot_type();
        let row_bytes = ty.row_bytes(k)?;
        let n_tok = x.len() / k;
        let mut data = vec![0u8; row_bytes * n_tok];
        if n_tok < 8 {
            for (dst, src) in data.chunks_mut(row_bytes).zip(x.chunks(k)) {
                quantize_act_row(ty, src, dst)?;
            }
        } else {
            let out = SharedOut(data.as_mut_ptr().cast());
            let failed = std::sync::Mutex::new(None);
            pool::global().for_chunks(n_tok, 4, |toks| {
                let out = &out;
                for t in toks {
                    // SAFETY: token rows are disjoint and inside `data`, which outlives the job.
                    let dst = unsafe {
                        std::slice::from_raw_parts_mut(
                            out.0.cast::<u8>().add(t * row_bytes),
                            row_bytes,
                        )
                    };
                    if let Err(e) = quantize_act_row(ty, &x[t * k..(t + 1) * k], dst) {
                        *failed.lock().unwrap() = Some(e);
                    }
                }
            });
            if let Some(e) = failed.into_inner().unwrap() {
                return Err(e);
            }
        }
        Ok(QuantizedActs {
            ty,
            k,
            n_tok,
            row_bytes,
            data,
        })
    }

    pub fn row(&self, t: usize) -> &[u8] {
        &self.data[t * self.row_bytes..(t + 1) * self.row_bytes]
    }
}

/// Output pointer shared by tasks that write disjoint elements.
pub(crate) struct SharedOut(pub *mut f32);
// SAFETY: tasks write disjoint indices of the buffer (each owns a distinct range of rows) and the
// buffer outlives the parallel loop, which joins before the caller returns.
unsafe impl Sync for SharedOut {}
unsafe impl Send for SharedOut {}

impl SharedOut {
    /// # Safety
    /// `i` must be inside the buffer and written by no other task.
    #[inline(always)]
    pub(crate) unsafe fn write(&self, i: usize, v: f32) {
        // SAFETY: the caller's contract.
        unsafe { *self.0.add(i) = v }
    }
}

/// Where the outputs go: `[token][row]` f32 with `stride` rows per token.
pub(crate) struct Out<'a> {
    pub(crate) out: &'a SharedOut,
    pub(crate) stride: usize,
}

impl Out<'_> {
    /// # Safety
    /// (t, r) must be inside the buffer and written by no other task.
    #[inline(always)]
    pub(crate) unsafe fn write(&self, t: usize, r: usize, v: f32) {
        // SAFETY: the caller's contract.
        unsafe { self.out.write(t * self.stride + r, v) }
    }

    /// Rows `r..r + v.len()` of token t.
    ///
    /// # Safety
    /// Those outputs must be inside the buffer and written by no other task.
    #[inline]
    pub(crate) unsafe fn write_run(&self, t: usize, r: usize, v: &[f32]) {
        // SAFETY: the caller's contract; `v` is not the output buffer (that one is written
        // through the shared pointer only).
        unsafe {
            std::ptr::copy_nonoverlapping(v.as_ptr(), self.out.0.add(t * self.stride + r), v.len())
        }
    }

    /// Rows `r..r + R` of tokens t (lanes 0..R of `v`) and t + 1 (lanes 8..8 + R).
    /// Always inlined, into the AVX-512 kernels that call it (compiled for AVX-512 itself, it
    /// stayed a function of its own, called per pair with `v` through memory: 3.7-5.2% of 135M
    /// F16 pp64's samples).
    ///
    /// # Safety
    /// Those outputs must be inside the buffer and written by no other task; the CPU has AVX-512
    /// (the caller is compiled for it).
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    pub(crate) unsafe fn write_pair<const R: usize>(
        &self,
        t: usize,
        r: usize,
        v: std::arch::x86_64::__m512,
    ) {
        use std::arch::x86_64::*;
        let mask = ((1u32 << R) - 1) as __mmask8;
        // SAFETY: the caller's contract: rows r..r + R of tokens t and t + 1 are in the buffer.
        unsafe {
            let p = self.out.0.add(t * self.stride + r);
            _mm256_mask_storeu_ps(p, mask, _mm512_castps512_ps256(v));
            let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
            _mm256_mask_storeu_ps(p.add(self.stride), mask, hi);
        }
    }

    /// Rows `r..r + 16` of token t, the lanes in `mask` of `v`.
    ///
    /// # Safety
    /// Those outputs must be inside the buffer and written by no other task; the CPU has AVX-512.
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(crate) unsafe fn write16(
        &self,
        t: usize,
        r: usize,
        mask: std::arch::x86_64::__mmask16,
        v: std::arch::x86_64::__m512,
    ) {
        // SAFETY: the caller's contract.
        unsafe {
            std::arch::x86_64::_mm512_mask_storeu_ps(self.out.0.add(t * self.stride + r), mask, v)
        }
    }

    /// What [`Out::write16`] stored at token t's rows `r..r + 16` (lanes in `mask`; the others
    /// zero).
    ///
    /// # Safety
    /// Those outputs must be inside the buffer and written by no other task; the CPU has AVX-512.
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn read16(
        &self,
        t: usize,
        r: usize,
        mask: std::arch::x86_64::__mmask16,
    ) -> std::arch::x86_64::__m512 {
        // SAFETY: the caller's contract.
        unsafe {
            std::arch::x86_64::_mm512_maskz_loadu_ps(mask, self.out.0.add(t * self.stride + r))
        }
    }
}

/// Most tokens for which [`RowParts`] gives each thread one part.
const ONE_CHUNK_TOKENS: usize = 3;

/// How an operator's rows are handed to tasks: up to four parts per thread (a multiple of the
/// thread count, so threads finish together), each at least ~16 KiB of weights x tokens, in
/// whole groups of sixteen rows where `sixteens` (else of four). Decode and batches of up to
/// [`ONE_CHUNK_TOKENS`] tokens take one part per thread: each thread's rows are then one
/// stream from the memory, not four starting over (the parts go to threads in turn). 1B
/// Q4_K_M, 2 EPYC threads (`examples/decode_mix`, the engine and the matrices against a plain
/// read in the same rounds, two alternated pairs of 60 rounds each way): with the memory at its
/// fast rate (about 60 GB/s) the engine read 0.79 of the plain read with four parts and 0.83
/// with one, ffn_down 0.77-0.79 -> 0.89-0.91, attn_output 0.75-0.76 -> 0.90; at its slow rate
/// (about 35 GB/s) 0.93-0.95 -> 0.96-0.97 (1B Q4_0 alike or a little better; at 1 thread alike).
///
/// The groups are shared out so that parts differ by at most one group, the larger first: taken
/// in turn, each thread's share is then within a group of the others'. (Rounding each part up
/// to whole groups left the last one short instead: 576 rows in eight parts of 80 were 320 rows
/// for one thread and 256 for the other.)
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct RowParts {
    n_rows: usize,
    whole: usize,
    parts: usize,
}

impl RowParts {
    fn new(bytes: usize, n_rows: usize, n_tok: usize, threads: usize, sixteens: bool) -> Self {
        let work = bytes * n_tok;
        let by_size = (work / 16384).max(1);
        let per_thread = if n_tok <= ONE_CHUNK_TOKENS { 1 } else { 4 };
        let parts = if by_size < threads {
            by_size
        } else {
            by_size.min(threads * per_thread) / threads * threads
        };
        let whole = if sixteens { 16 } else { 4 };
        let groups = n_rows.div_ceil(whole);
        RowParts {
            n_rows,
            whole,
            parts: parts.clamp(1, groups.max(1)),
        }
    }

    /// The rows of part `c` (< `parts`).
    fn rows(&self, c: usize) -> std::ops::Range<usize> {
        let groups = self.n_rows.div_ceil(self.whole);
        let (q, r) = (groups / self.parts, groups % self.parts);
        let start = |c: usize| (c * q + c.min(r)) * self.whole;
        start(c).min(self.n_rows)..start(c + 1).min(self.n_rows)
    }
}

/// `y[t, r] = sum_i W[r, i] * x[t, i]`: `x` is [n_tok, k], `y` is [n_tok, n].
pub fn matmul(w: &MatRef, x: &[f32], y: &mut [f32]) -> Result<()> {
    if !x.len().is_multiple_of(w.k) {
        return Err(Error::Msg(format!(
            "matmul: input of {} is not a multiple of k={}",
            x.len(),
            w.k
        )));
    }
    let acts = QuantizedActs::new(w.ty, x, w.k)?;
    matmul_quantized(w, &acts, y)
}

/// One weight matrix's share of a (possibly fused) matmul job.
struct RowJob<'a> {
    w: MatRef<'a>,
    wrb: usize,
    dot: super::DotFn,
    #[cfg(target_arch = "x86_64")]
    tiles: (
        Option<super::tile::TileFn<4, 4>>,
        Option<super::tile::TileFn<2, 4>>,
        Option<super::tile::TileFn<1, 4>>,
    ),
    /// Four rows by sixteen tokens, for the types whose tiles gain from it (the K-quants).
    #[cfg(target_arch = "x86_64")]
    wide: Option<super::tile::TileFn<4, 16>>,
    /// Four rows against one token (decode), where the type has such a kernel (AVX-512's or
    /// AVX2's, as the ISA).
    #[cfg(target_arch = "x86_64")]
    rows4: Option<super::avx512::RowsFn<4>>,
    /// Whether the kernels are AVX-512's (small Q4_0 batches then take `rows_q4_0_batch`).
    #[cfg(target_arch = "x86_64")]
    avx512: bool,
    /// Sixteen interleaved rows against every token (`kwide`, prefill of the K-quants).
    #[cfg(target_arch = "x86_64")]
    kwide: bool,
    out: SharedOut,
}

impl<'a> RowJob<'a> {
    fn new(w: &MatRef<'a>, acts: &QuantizedActs, y: &mut [f32]) -> Result<Self> {
        let n_tok = acts.n_tok;
        let wrb = w.ty.row_bytes(w.k)?;
        if acts.k != w.k
            || acts.ty != w.ty.vec_dot_type()
            || y.len() != n_tok * w.n
            || w.data.len() != wrb * w.n
            || (w.layout == Layout::Interleaved
                && (!super::repack::interleaves(w.ty) || !w.n.is_multiple_of(super::repack::ROWS)))
        {
            return Err(Error::Msg(format!(
                "matmul: shapes do not agree (weight {} [{}x{}] {} bytes {:?}, acts {} k={} x{}, out {})",
                w.ty,
                w.n,
                w.k,
                w.data.len(),
                w.layout,
                acts.ty,
                acts.k,
                n_tok,
                y.len()
            )));
        }
        let isa = isa();
        Ok(RowJob {
            w: *w,
            wrb,
            dot: dot_fn(isa, w.ty),
            #[cfg(target_arch = "x86_64")]
            tiles: (
                super::tile::tile_fn::<4, 4>(isa, w.ty),
                super::tile::tile_fn::<2, 4>(isa, w.ty),
                super::tile::tile_fn::<1, 4>(isa, w.ty),
            ),
            #[cfg(target_arch = "x86_64")]
            wide: super::tile::wide_tile_fn(isa, w.ty),
            #[cfg(target_arch = "x86_64")]
            rows4: match isa {
                super::Isa::Avx512 => super::avx512::rows_fn(w.ty),
                super::Isa::Avx2 => super::avx2::rows_fn(w.ty),
                _ => None,
            },
            #[cfg(target_arch = "x86_64")]
            avx512: isa == super::Isa::Avx512,
            #[cfg(target_arch = "x86_64")]
            kwide: isa == super::Isa::Avx512 && super::kwide::supports(w.ty) && kwide_enabled(),
            out: SharedOut(y.as_mut_ptr()),
        })
    }

    fn row(&self, r: usize) -> &[u8] {
        &self.w.data[r * self.wrb..(r + 1) * self.wrb]
    }

    /// Whether `n_tok` tokens go through `kwide`'s panels.
    #[cfg(target_arch = "x86_64")]
    fn uses_panels(&self, n_tok: usize) -> bool {
        self.kwide && n_tok >= kwide_min_tokens(self.w.ty)
    }

    /// Whether `n_tok` tokens against this interleaved matrix go through `kwide`'s panels
    /// (unpacked straight from the interleaved groups) rather than `repack`'s kernels.
    #[cfg(target_arch = "x86_64")]
    fn interleaved_panels(&self, n_tok: usize) -> bool {
        // Out of cache, 2 EPYC threads (`examples/matmul_dram`), GB/s of weights, repack's
        // kernels / the panels: Q6_K 2048 x 8192 at 16, 24, 32, 64, 512 tokens 7.3 / 7.0,
        // 5.0 / 5.0, 3.1 / 4.2, 1.7 / 2.7, 0.23 / 0.36; Q4_K 8192 x 2048 at 32, 64, 128, 512
        // 3.8 / 3.7, 2.1 / 2.1, 0.95 / 1.08, 0.23 / 0.29; 2048 x 8192 at 32 / 48 / 64 tokens,
        // Q2_K 2.40 / 2.28, 1.57 / 1.59, 1.12 / 1.22; Q3_K 2.54 / 3.10, 1.70 / 2.19, 1.17 /
        // 1.64; Q5_K 4.23 / 4.92, 2.71 / 3.46, 2.06 / 2.65 (at 24 tokens the token kernels
        // against the panels on the file's layout: Q3_K 3.23 / 2.68, Q5_K 5.41 / 5.35);
        // IQ4_XS 2048 x 8192 at 32 / 64 tokens 1.80 / 2.07-2.12, 0.87-0.95 / 1.16-1.18 (two
        // alternated rounds, the machine loaded by a build).
        let min = match self.w.ty {
            GgmlType::Q6_K => 24,
            GgmlType::Q4_K => 64,
            GgmlType::Q2_K | GgmlType::Q3_K | GgmlType::Q5_K | GgmlType::IQ4_XS => 32,
            _ => return false,
        };
        self.kwide && n_tok >= min
    }

    fn interleaved(&self) -> bool {
        self.w.layout == Layout::Interleaved
    }

    /// Rows `rows` of an interleaved matrix: by `repack`'s kernels where the kernels in use read
    /// this type interleaved (`panels` holding what they need of the activations), else row by
    /// row through the file's layout.
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
    fn run_interleaved(
        &self,
        acts: &QuantizedActs,
        panels: Option<&Panels>,
        rows: std::ops::Range<usize>,
    ) {
        #[cfg(target_arch = "x86_64")]
        if let Some(p) = panels.filter(|_| super::repack::kernels_for(self.w.ty, isa())) {
            if self.interleaved_panels(acts.n_tok) {
                // Whole groups; a group's rows outside `rows` are another task's.
                let whole = rows.start / super::repack::ROWS * super::repack::ROWS
                    ..rows.end.next_multiple_of(super::repack::ROWS);
                super::kwide::run_interleaved(acts, self.w.ty, self.w.data, whole, |t, r, v| {
                    if rows.contains(&r) {
                        self.put(t, r, v)
                    }
                });
                return;
            }
            super::repack::run_rows(self.w.ty, acts, p, self.w.data, rows, &self.out());
            return;
        }
        let mut plain = vec![0u8; self.wrb];
        for r in rows {
            super::repack::plain_row(self.w.ty, self.w.data, self.w.k, r, &mut plain);
            for t in 0..acts.n_tok {
                // SAFETY: dot_fn returns only variants this CPU supports.
                self.put(t, r, unsafe { (self.dot)(&plain, acts.row(t), self.w.k) });
            }
        }
    }

    /// Where the outputs go.
    fn out(&self) -> Out<'_> {
        Out {
            out: &self.out,
            stride: self.w.n,
        }
    }

    /// Writes output (token t, row r).
    fn put(&self, t: usize, r: usize, v: f32) {
        // SAFETY: callers pass t < n_tok and r < n, so (t, r) is inside y (checked in `new`),
        // and each (t, r) is written by exactly one task because row ranges are disjoint.
        unsafe { self.out().write(t, r, v) }
    }

    /// Row r against token t with the single-row kernel.
    fn dot(&self, acts: &QuantizedActs, r: usize, t: usize) -> f32 {
        // SAFETY: dot_fn returns only variants this CPU supports.
        unsafe { (self.dot)(self.row(r), acts.row(t), self.w.k) }
    }

    /// Rows `r..end` in blocks of `R` through `tile` (`T` tokens at a time, then four at a time
    /// through `tail` when given, the token tail by single dots); returns the first row not done
    /// (`end` minus fewer than `R`).
    #[cfg(target_arch = "x86_64")]
    fn tiled<const R: usize, const T: usize>(
        &self,
        acts: &QuantizedActs,
        mut r: usize,
        end: usize,
        tile: Option<super::tile::TileFn<R, T>>,
        tail: Option<super::tile::TileFn<R, 4>>,
    ) -> usize {
        let n_tok = acts.n_tok;
        let Some(tile) = tile.filter(|_| n_tok >= T) else {
            return r;
        };
        while r + R <= end {
            let mut t = 0;
            while t + T <= n_tok {
                let a = std::array::from_fn(|j| acts.row(t + j));
                // SAFETY: tile_fn returns only kernels this CPU supports.
                let v = unsafe { tile(std::array::from_fn(|i| self.row(r + i)), a) };
                self.put_tile(r, t, &v);
                t += T;
            }
            if let Some(tail) = tail {
                while t + 4 <= n_tok {
                    let a = std::array::from_fn(|j| acts.row(t + j));
                    // SAFETY: as above.
                    let v = unsafe { tail(std::array::from_fn(|i| self.row(r + i)), a) };
                    self.put_tile(r, t, &v);
                    t += 4;
                }
            }
            for t in t..n_tok {
                for i in 0..R {
                    self.put(t, r + i, self.dot(acts, r + i, t));
                }
            }
            r += R;
        }
        r
    }

    /// Writes a tile's outputs: `v[i][j]` is row `r + i`, token `t + j`.
    #[cfg(target_arch = "x86_64")]
    fn put_tile<const R: usize, const T: usize>(&self, r: usize, t: usize, v: &[[f32; T]; R]) {
        for (i, vr) in v.iter().enumerate() {
            for (j, &x) in vr.iter().enumerate() {
                self.put(t + j, r + i, x);
            }
        }
    }

    /// Computes rows `rows` of this matrix for every token: with the AVX-512 tiles over the
    /// `prepared` activations when there are some, else tiles of four rows, then two, then one;
    /// single dots for what is left (decode, the tokens after the last tile, a CPU without tiles).
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
    fn run(
        &self,
        acts: &QuantizedActs,
        prepared: Option<&Prepared>,
        panels: Option<&Panels>,
        rows: std::ops::Range<usize>,
    ) {
        if self.interleaved() {
            return self.run_interleaved(acts, panels, rows);
        }
        #[allow(unused_mut)]
        let mut r = rows.start;
        #[cfg(target_arch = "x86_64")]
        if let Some(prepared) = prepared {
            let row = |r| self.row(r);
            let out = self.out();
            let done = match prepared {
                Prepared::Half(w) if self.w.ty == w.ty() => {
                    super::f16wide::run_rows(w, acts, row, rows.clone(), out);
                    Some(w.n_tok())
                }
                Prepared::HalfAvx2(w) if self.w.ty == w.ty() => {
                    super::f16tile_avx2::run_rows(w, acts, row, rows.clone(), out);
                    Some(w.n_tok())
                }
                Prepared::Q8Avx2(s) if self.w.ty == GgmlType::Q8_0 => {
                    super::q8tile_avx2::run_rows(s, acts, row, rows.clone(), out);
                    Some(s.n_tok())
                }
                Prepared::Q8(p) if super::qwide::supports(self.w.ty) => {
                    super::qwide::run_rows(p, self.w.ty, row, rows.clone(), out);
                    Some(p.n_tok())
                }
                _ => None,
            };
            if let Some(done) = done {
                for t in done..acts.n_tok {
                    for r in rows.clone() {
                        self.put(t, r, self.dot(acts, r, t));
                    }
                }
                return;
            }
        }
        // A small Q4_0 batch (decode of several sequences) goes to the four-row kernel, each
        // weight block unpacked once for all its tokens.
        #[cfg(target_arch = "x86_64")]
        let small_q4_0 = self.w.ty == GgmlType::Q4_0
            && self.rows4.is_some()
            && self.avx512
            && acts.n_tok < kwide_min_tokens(self.w.ty);
        #[cfg(target_arch = "x86_64")]
        if let Some(panels) = panels.filter(|_| self.uses_panels(acts.n_tok)) {
            let (row, put) = (|r| self.row(r), |t, r, v| self.put(t, r, v));
            r = super::kwide::run_rows(acts, panels, self.w.ty, row, rows.clone(), put);
        }
        #[cfg(target_arch = "x86_64")]
        if !small_q4_0 {
            let (t4, t2, t1) = self.tiles;
            r = self.tiled(acts, r, rows.end, self.wide, t4);
            r = self.tiled(acts, r, rows.end, t4, None);
            r = self.tiled(acts, r, rows.end, t2, None);
            r = self.tiled(acts, r, rows.end, t1, None);
        }
        let ahead = prefetch_distance();
        #[cfg(target_arch = "x86_64")]
        if let Some(rows4) = self.rows4 {
            // The four rows come from the four quarters of the range, so each quarter is read
            // as one long sequential stream (four adjacent rows would make four short streams
            // per group, which the hardware prefetchers follow badly).
            let q = (rows.end - r) / 4;
            let batch: Vec<&[u8]> = if small_q4_0 && acts.n_tok > 1 {
                (0..acts.n_tok).map(|t| acts.row(t)).collect()
            } else {
                Vec::new()
            };
            for i in 0..q {
                let at: [usize; 4] = std::array::from_fn(|j| r + j * q + i);
                if ahead > 0 {
                    at.iter().for_each(|&r| self.prefetch(r, ahead));
                }
                let w = at.map(|r| self.row(r));
                let put = |t: usize, v: [f32; 4]| (0..4).for_each(|j| self.put(t, at[j], v[j]));
                if !batch.is_empty() {
                    // SAFETY: `batch` is filled only for small Q4_0 batches, only with
                    // AVX-512's kernels (`self.avx512`: Isa::Avx512, as below).
                    unsafe { super::avx512::rows_q4_0_batch(w, &batch, put) };
                    continue;
                }
                for t in 0..acts.n_tok {
                    // SAFETY: each rows_fn's kernels are handed out only under its ISA
                    // (Isa::Avx512 or Isa::Avx2), which `isa()` returns only when the CPU has
                    // it (resolve_isa, set_isa).
                    put(t, unsafe { rows4(w, acts.row(t)) });
                }
            }
            r += 4 * q;
        }
        for r in r..rows.end {
            if ahead > 0 {
                self.prefetch(r, ahead);
            }
            for t in 0..acts.n_tok {
                self.put(t, r, self.dot(acts, r, t));
            }
        }
    }

    /// Asks for the cache lines `ahead` bytes past row `r` (clipped to the matrix), so the
    /// memory's latency overlaps the dot products of the rows before (decode reads each weight
    /// once, from DRAM).
    #[inline]
    fn prefetch(&self, r: usize, ahead: usize) {
        #[cfg(target_arch = "x86_64")]
        {
            let data = self.w.data;
            let lo = (r * self.wrb + ahead).min(data.len());
            let hi = ((r + 1) * self.wrb + ahead).min(data.len());
            let mut at = lo & !63;
            while at < hi {
                // SAFETY: `at` lies inside `data` (a prefetch never faults in any case).
                unsafe {
                    std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                        data.as_ptr().add(at).cast(),
                    )
                };
                at += 64;
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (r, ahead);
    }
}

/// Fewest tokens for which weights of type `ty` go through `kwide`'s panels (below, the 4 x 16
/// tiles, the four-row kernel and single-row dots: the panels' unpacking would not pay).
#[cfg(target_arch = "x86_64")]
fn kwide_min_tokens(ty: GgmlType) -> usize {
    // Q4_0 below 8 tokens takes the four-row kernel a batch at a time: 1B shape, 2 EPYC
    // threads, decode step (examples/decode_batch) at b = 4 / 6 / 8: panels from 4 tokens
    // 105 / 117 / 118 ms, from 8 76 / 106 / 125 (and from 12: 72 / 112 / 124).
    match ty {
        GgmlType::Q4_0 => 8,
        _ => 4,
    }
}

/// `OATO_CPU_KWIDE=0` keeps prefill on the older tiles (K-quants 4 x 16, Q4_0 4 x 4), for
/// comparison: the results are the same bits either way.
#[cfg(target_arch = "x86_64")]
fn kwide_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| env_on("OATO_CPU_KWIDE"))
}

/// Bytes ahead of the current row that decode prefetches (`OATO_CPU_PREFETCH`, 0 turns it off;
/// default [`default_prefetch`]).
fn prefetch_distance() -> usize {
    static AHEAD: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *AHEAD.get_or_init(|| env_bytes("OATO_CPU_PREFETCH", default_prefetch()))
}

/// Whether the switch in environment variable `var` is on: unless it is set to `0`. The callers
/// keep it in a `OnceLock` or an atomic: read once per process.
pub(crate) fn env_on(var: &str) -> bool {
    std::env::var(var).map_or(true, |v| v.trim() != "0")
}

/// The whole number in environment variable `var` (a prefetch distance in bytes, 0 for none),
/// else `default`. The callers keep it in a `OnceLock`: read once per process.
pub(crate) fn env_bytes(var: &str, default: usize) -> usize {
    std::env::var(var)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(default)
}

/// 1 KiB on Intel CPUs, off elsewhere. Measured, tg32 t/s without / with 1 KiB:
/// - 16-core Xeon (H100 machines), 16 threads: LLaMA3-8B Q4_0 14.4 / 15.1, and in another run
///   13.81, 12.67 / 13.92, 14.95; Llama-3.2-1B F16 34.2, 29.7 / 36.1, 40.3.
/// - AMD EPYC (this project's CI kind), 2 threads, 1B shape: F16 17.6 / 11.9 and, in later
///   runs, 13.2, 14.0 / 11.2, 11.5; Q4_0 29.4 / 26.6, Q8_0 28.2 / 25.0, Q4_K_M 34.0 / 32.2: the
///   prefetches only cost there.
fn default_prefetch() -> usize {
    if intel() { 1024 } else { 0 }
}

/// The CPU's family as CPUID leaf 1 reports it (the base family plus the extended one where
/// the base is 0xF: 0x19 for AMD's Zen 3 and Zen 4, 0x1A for Zen 5); 0 off x86-64. Asked once.
pub(crate) fn cpu_family() -> u32 {
    static FAMILY: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *FAMILY.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            // CPUID leaf 1 (the signature) exists on every x86-64 CPU.
            let eax = std::arch::x86_64::__cpuid(1).eax;
            let base = (eax >> 8) & 0xF;
            if base == 0xF {
                base + ((eax >> 20) & 0xFF)
            } else {
                base
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        0
    })
}

/// Whether the CPU is AMD's Zen 5 or later (family 0x1A and up, not Intel's), whose decode
/// kernels prefetch further ahead (`repack::prefetch_ahead`, `avx512::rows_prefetch`).
pub(crate) fn zen5_or_later() -> bool {
    !intel() && cpu_family() >= 0x1A
}

/// Whether the CPU is Intel's (whose hardware prefetchers want software prefetches' help where
/// AMD's do not); asked of CPUID once.
pub(crate) fn intel() -> bool {
    static INTEL: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *INTEL.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            // CPUID leaf 0 (the vendor) exists on every x86-64 CPU.
            let id = std::arch::x86_64::__cpuid(0);
            let mut vendor = [0u8; 12];
            vendor[..4].copy_from_slice(&id.ebx.to_le_bytes());
            vendor[4..8].copy_from_slice(&id.edx.to_le_bytes());
            vendor[8..].copy_from_slice(&id.ecx.to_le_bytes());
            &vendor == b"GenuineIntel"
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    })
}

/// As [`matmul`], with activations quantised beforehand (shared by operators with one input).
pub fn matmul_quantized(w: &MatRef, acts: &QuantizedActs, y: &mut [f32]) -> Result<()> {
    matmul_quantized_many(&mut [(*w, y)], acts)
}

/// Several matrices against the same activations as one job on the pool (q/k/v, gate/up): one
/// synchronisation instead of one per matrix. Each output is computed exactly as alone.
pub fn matmul_quantized_many(
    parts: &mut [(MatRef, &mut [f32])],
    acts: &QuantizedActs,
) -> Result<()> {
    let jobs: Vec<RowJob> = parts
        .iter_mut()
        .map(|(w, y)| RowJob::new(w, acts, y))
        .collect::<Result<_>>()?;
    // Row offsets of each matrix in the concatenated row space.
    let mut starts = Vec::with_capacity(jobs.len() + 1);
    let mut total = 0;
    for j in &jobs {
        starts.push(total);
        total += j.w.n;
    }
    starts.push(total);
    let bytes: usize = jobs.iter().map(|j| j.w.data.len()).sum();
    let prepared = Prepared::new(acts, jobs.iter().map(|j| j.w.ty));
    #[cfg(target_arch = "x86_64")]
    let panels = jobs
        .iter()
        .any(|j| j.uses_panels(acts.n_tok) || j.interleaved())
        .then(|| super::kwide::PanelActs::new(acts));
    #[cfg(not(target_arch = "x86_64"))]
    let panels: Option<Panels> = None;
    let pool = pool::global();
    // Multiples of four rows keep the prefill tiles whole; sixteen, `kwide`'s panels when there
    // are several tokens and the groups of interleaved rows (a group split between tasks would
    // be computed by both).
    let sixteens = acts.n_tok >= 4 || jobs.iter().any(|j| j.interleaved());
    let parts = RowParts::new(bytes, total, acts.n_tok, pool.n_threads(), sixteens);
    pool.for_chunks(parts.parts, 1, |cs| {
        for g in cs.map(|c| parts.rows(c)) {
            for (i, j) in jobs.iter().enumerate() {
                let (lo, hi) = (g.start.max(starts[i]), g.end.min(starts[i + 1]));
                if lo < hi {
                    j.run(
                        acts,
                        prepared.as_ref(),
                        panels.as_ref(),
                        lo - starts[i]..hi - starts[i],
                    );
                }
            }
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::quantize_row;

    fn pattern(n: usize, offset: f32) -> Vec<f32> {
        (0..n)
            .map(|i| 0.1 + 2.0 * (i as f32 * 0.37 + offset).cos())
            .collect()
    }

    /// The parts cover the rows once, in whole groups (the last part excepted), larger first,
    /// differing by at most a group; taken in turn by two threads, their shares differ by at
    /// most a group (576 rows in eight parts: 288 each, where rounding parts up gave 320 / 256).
    #[test]
    fn row_parts_share_evenly() {
        for (n_rows, n_tok, threads, sixteens) in [
            (576, 64, 2, true),
            (960, 64, 2, true),
            (2048, 1, 2, true),
            (37, 9, 2, false),
            (128256, 1, 16, true),
            (5, 64, 4, true),
            (3, 1, 8, false),
        ] {
            let p = RowParts::new(n_rows * 1024, n_rows, n_tok, threads, sixteens);
            let parts: Vec<_> = (0..p.parts).map(|c| p.rows(c)).collect();
            assert_eq!(parts[0].start, 0);
            assert_eq!(parts.last().unwrap().end, n_rows);
            for w in parts.windows(2) {
                assert_eq!(w[0].end, w[1].start);
                assert!(w[0].len() >= w[1].len() || w[1].end == n_rows);
            }
            assert!(parts.iter().all(|g| !g.is_empty()));
            assert!(parts.iter().all(|g| g.start % p.whole == 0));
            let most = parts.iter().map(|g| g.len()).max().unwrap();
            let least = parts[..parts.len() - 1].iter().map(|g| g.len()).min();
            assert!(
                least.is_none_or(|l| most - l <= p.whole),
                "{n_rows}: {parts:?}"
            );
            let mut share = vec![0; threads];
            parts
                .iter()
                .enumerate()
                .for_each(|(c, g)| share[c % threads] += g.len());
            let spread = share.iter().max().unwrap() - share.iter().min().unwrap();
            assert!(spread <= p.whole, "{n_rows} rows: shares {share:?}");
        }
        let p = RowParts::new(576 * 1152, 576, 64, 2, true);
        assert_eq!(p.parts, 8);
        let share = |t: usize| (t..8).step_by(2).map(|c| p.rows(c).len()).sum::<usize>();
        assert_eq!((share(0), share(1)), (288, 288));
    }

    /// A batch (tiled four tokens at a time, threads over rows) equals token-by-token products,
    /// bit for bit, and both match the f32 reference to rounding.
    #[test]
    fn batched_equals_token_by_token() {
        // Rows: quads with one, two and three left over (the 1-, 2- and 4-row tiles); 9 tokens:
        // two quads and one left.
        // Under every variant (switching is safe for tests running alongside: all variants compute
        // identical numbers).
        for isa in crate::kernels::cpu::Isa::all_supported() {
            crate::kernels::cpu::set_isa(isa).unwrap();
            for n in [37, 38, 39] {
                batched_equals_token_by_token_with(n);
            }
        }
        crate::kernels::cpu::set_isa(crate::kernels::cpu::Isa::detect()).unwrap();
    }

    /// The K-quant tiles and panels (AVX-512) give the single-row dots' bits: random blocks
    /// (super-block scales set to small finite values), rows with one, two and three left over
    /// from the 4-row tiles and 37 (two panels and five rows), 21 tokens (the 16-token tile, the
    /// 4-token one, one left; the panels' groups of eight and five left), under every variant.
    #[test]
    fn k_quant_batches_equal_token_by_token() {
        let (k, n_tok) = (512, 21);
        let mut rng = crate::rng::SplitMix64::new(7);
        for isa in crate::kernels::cpu::Isa::all_supported() {
            crate::kernels::cpu::set_isa(isa).unwrap();
            for ty in [GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K] {
                // 37 rows: two of kwide's sixteen-row panels (AVX-512), then the tiles.
                for n in [9, 10, 11, 37] {
                    let wq = super::super::random_rows(ty, k, n, &mut rng);
                    let x = pattern(k * n_tok, 0.3);
                    batched_vs_single(ty, k, n, &wq, &x, isa.name());
                }
            }
        }
        crate::kernels::cpu::set_isa(crate::kernels::cpu::Isa::detect()).unwrap();
    }

    /// Small Q4_0 batches (2 to 7 tokens: the four-row kernel a batch at a time on AVX-512) give
    /// the token-by-token bits, under every variant.
    #[test]
    fn small_q4_0_batches_equal_token_by_token() {
        let k = 256;
        let n = 37;
        let rb = GgmlType::Q4_0.row_bytes(k).unwrap();
        let mut wq = vec![0u8; rb * n];
        for (r, dst) in wq.chunks_mut(rb).enumerate() {
            quantize_row(GgmlType::Q4_0, &pattern(k, r as f32), dst).unwrap();
        }
        for isa in crate::kernels::cpu::Isa::all_supported() {
            crate::kernels::cpu::set_isa(isa).unwrap();
            for n_tok in 2..=9 {
                let x = pattern(k * n_tok, 0.7 + n_tok as f32);
                batched_vs_single(GgmlType::Q4_0, k, n, &wq, &x, isa.name());
            }
        }
        crate::kernels::cpu::set_isa(crate::kernels::cpu::Isa::detect()).unwrap();
    }

    /// The product of `wq` (n rows of `ty`, k columns) with every token of `x` at once, asserted
    /// bit-equal to the products token by token; returns it.
    fn batched_vs_single(
        ty: GgmlType,
        k: usize,
        n: usize,
        wq: &[u8],
        x: &[f32],
        what: &str,
    ) -> Vec<f32> {
        let w = MatRef::rows(ty, k, n, wq);
        let n_tok = x.len() / k;
        let mut batched = vec![0f32; n * n_tok];
        matmul(&w, x, &mut batched).unwrap();
        for t in 0..n_tok {
            let mut single = vec![0f32; n];
            matmul(&w, &x[t * k..(t + 1) * k], &mut single).unwrap();
            for r in 0..n {
                assert_eq!(
                    batched[t * n + r].to_bits(),
                    single[r].to_bits(),
                    "{what} {ty} token {t} row {r} of {n}"
                );
            }
        }
        batched
    }

    fn batched_equals_token_by_token_with(n: usize) {
        // k = 104 gives the plain-float types a tail after their 32-element steps.
        for k in [96, 104] {
            batched_equals_token_by_token_k(n, k);
        }
    }

    fn batched_equals_token_by_token_k(n: usize, k: usize) {
        let n_tok = 9;
        for ty in [
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q5_0,
            GgmlType::Q5_1,
            GgmlType::Q8_0,
            GgmlType::F16,
            GgmlType::BF16,
            GgmlType::F32,
        ] {
            if ty.row_bytes(k).is_err() {
                continue;
            }
            let wf = pattern(k * n, 0.0);
            let mut wq = vec![0u8; ty.row_bytes(k).unwrap() * n];
            for (src, dst) in wf.chunks(k).zip(wq.chunks_mut(ty.row_bytes(k).unwrap())) {
                quantize_row(ty, src, dst).unwrap();
            }
            let x = pattern(k * n_tok, 1.7);
            let batched = batched_vs_single(ty, k, n, &wq, &x, "");
            // Against the exact product of the dequantised weights and f32 inputs.
            let mut deq = vec![0f32; k];
            let mut worst = 0f32;
            for r in 0..n {
                crate::quant::dequantize_row(
                    ty,
                    &wq[r * wq.len() / n..(r + 1) * wq.len() / n],
                    &mut deq,
                )
                .unwrap();
                for t in 0..n_tok {
                    let exact: f32 = deq
                        .iter()
                        .zip(&x[t * k..(t + 1) * k])
                        .map(|(a, b)| a * b)
                        .sum();
                    worst = worst.max((exact - batched[t * n + r]).abs() / k as f32);
                }
            }
            assert!(worst < 0.02, "{ty}: normalised error {worst}");
        }
    }
}

#[cfg(test)]
mod interleaved_tests {
    use super::*;
    use crate::kernels::cpu::repack;

    /// Q4_0 (and the K-quants) interleaved by sixteen rows gives the file layout's bits: 1 to 9
    /// tokens (the kernel's four, two and one at a time, and the prefill sizes) and 24 and 64
    /// (the K-quants' panels unpacked from the interleaved groups), fused after a matrix whose
    /// 37 rows put every group across a task boundary (groups computed by two tasks, each
    /// writing its own rows), under every variant (off AVX-512, the rows are read back into the
    /// file's layout).
    #[test]
    fn interleaved_q4_0_equals_rows() {
        interleaved_equals_rows(GgmlType::Q4_0, 320, 160);
        // An odd number of blocks: the last one unpaired.
        interleaved_equals_rows(GgmlType::Q4_0, 352, 160);
        // Rows longer than a slab (`repack::SLAB`): 64 blocks, then one (odd, unpaired) in a
        // slab of its own, every output carried from the first slab to the second; 512 rows.
        interleaved_equals_rows(GgmlType::Q4_0, 32 * 65, 512);
        // Three slabs, the last one of two blocks.
        interleaved_equals_rows(GgmlType::Q4_0, 2 * repack::SLAB + 64, 160);
    }

    /// As for Q4_0, Q4_K (random blocks with small finite super-block scales).
    #[test]
    fn interleaved_q4_k_equals_rows() {
        interleaved_equals_rows(GgmlType::Q4_K, 512, 160);
        // Two slabs (eight super-blocks and two), in decode and in the panels.
        interleaved_equals_rows(GgmlType::Q4_K, repack::SLAB + 512, 160);
    }

    /// As for Q4_0, Q6_K (random blocks with small finite super-block scales): the layout's
    /// `d` after the group's blocks, the 6-bit quants put together from two words.
    #[test]
    fn interleaved_q6_k_equals_rows() {
        interleaved_equals_rows(GgmlType::Q6_K, 768, 160);
        // Two slabs (eight super-blocks and three).
        interleaved_equals_rows(GgmlType::Q6_K, repack::SLAB + 768, 160);
    }

    /// As for Q4_0, the other K-quants: Q2_K (mins in 16-bit pairs), Q3_K (the layout's `d`
    /// after the group's blocks, the high bit from `hmask`), Q5_K (the fifth bit from `qh`);
    /// the panels from the rows put back in the file's layout.
    #[test]
    fn interleaved_k_quants_equal_rows() {
        for ty in [GgmlType::Q2_K, GgmlType::Q3_K, GgmlType::Q5_K] {
            interleaved_equals_rows(ty, 768, 160);
            interleaved_equals_rows(ty, repack::SLAB + 512, 160);
        }
    }

    /// As for Q4_0, the i-quants: IQ4_NL (Q4_0's layout, its quants through a table), IQ4_XS
    /// (the K-quants' word layout, signed 6-bit scales).
    #[test]
    fn interleaved_i_quants_equal_rows() {
        interleaved_equals_rows(GgmlType::IQ4_NL, 352, 160);
        interleaved_equals_rows(GgmlType::IQ4_NL, repack::SLAB + 64, 160);
        interleaved_equals_rows(GgmlType::IQ4_XS, 768, 160);
        interleaved_equals_rows(GgmlType::IQ4_XS, repack::SLAB + 512, 160);
    }

    fn interleaved_equals_rows(ty: GgmlType, k: usize, n_rows: usize) {
        // Ten groups (160 rows): decode reads Q6_K two side by side (from separate parts of a
        // task's groups), the rest one at a time.
        let mut rng = crate::rng::SplitMix64::new(11);
        let first = super::super::random_rows(ty, k, 37, &mut rng);
        let w = super::super::random_rows(ty, k, n_rows, &mut rng);
        let packed = repack::pack(ty, &w, k, n_rows, 2, &repack::Arena::default()).unwrap();
        let a = MatRef::rows(ty, k, 37, &first);
        let rows = MatRef::rows(ty, k, n_rows, &w);
        let inter = MatRef {
            layout: Layout::Interleaved,
            data: packed.bytes(),
            ..rows
        };
        for isa in crate::kernels::cpu::Isa::all_supported() {
            crate::kernels::cpu::set_isa(isa).unwrap();
            for n_tok in (1..=9).chain([24, 64]) {
                let x: Vec<f32> = (0..k * n_tok)
                    .map(|i| (i as f32 * 0.61 + n_tok as f32).sin())
                    .collect();
                let acts = QuantizedActs::new(ty, &x, k).unwrap();
                let mut want = vec![0f32; n_rows * n_tok];
                matmul_quantized(&rows, &acts, &mut want).unwrap();
                assert!(
                    want.iter().all(|v| v.is_finite() && *v != 0.0),
                    "{ty}: {want:?}"
                );
                let mut got = vec![0f32; n_rows * n_tok];
                matmul_quantized(&inter, &acts, &mut got).unwrap();
                let mut first_out = vec![0f32; 37 * n_tok];
                let mut fused = vec![0f32; n_rows * n_tok];
                matmul_quantized_many(&mut [(a, &mut first_out), (inter, &mut fused)], &acts)
                    .unwrap();
                for (i, ((w, g), f)) in want.iter().zip(&got).zip(&fused).enumerate() {
                    let what = format!("{} {n_tok} tokens, output {i}", isa.name());
                    assert_eq!(w.to_bits(), g.to_bits(), "{what}");
                    assert_eq!(w.to_bits(), f.to_bits(), "{what}, fused");
                }
            }
        }
        crate::kernels::cpu::set_isa(crate::kernels::cpu::Isa::detect()).unwrap();
    }

    /// An interleaved matrix of another type or with a partial group is refused.
    #[test]
    fn interleaved_needs_whole_q4_0_groups() {
        let k = 64;
        let data = vec![0u8; GgmlType::Q4_0.row_bytes(k).unwrap() * 8];
        let w = MatRef {
            layout: Layout::Interleaved,
            ..MatRef::rows(GgmlType::Q4_0, k, 8, &data)
        };
        let err = matmul(&w, &[0.5; 64], &mut [0f32; 8]).unwrap_err();
        assert!(err.to_string().contains("Interleaved"), "{err}");
    }
}

#[cfg(test)]
mod fused_tests {
    use super::*;
    use crate::quant::quantize_row;

    /// Fused matrices (different row counts, one shared input) give exactly what each gives alone.
    #[test]
    fn fused_equals_separate() {
        let (k, n_tok, ty) = (64, 5, GgmlType::Q4_1);
        let rb = ty.row_bytes(k).unwrap();
        let make = |n: usize, off: f32| {
            let mut q = vec![0u8; rb * n];
            for (r, dst) in q.chunks_mut(rb).enumerate() {
                let src: Vec<f32> = (0..k)
                    .map(|i| ((r * k + i) as f32 * 0.13 + off).sin())
                    .collect();
                quantize_row(ty, &src, dst).unwrap();
            }
            q
        };
        let (a, b, c) = (make(37, 0.0), make(6, 1.0), make(90, 2.0));
        let mats = [(&a, 37), (&b, 6), (&c, 90)].map(|(d, n)| MatRef::rows(ty, k, n, d));
        let x: Vec<f32> = (0..k * n_tok).map(|i| (i as f32 * 0.29).cos()).collect();
        let acts = QuantizedActs::new(ty, &x, k).unwrap();
        let mut fused: Vec<Vec<f32>> = mats.iter().map(|m| vec![0f32; m.n * n_tok]).collect();
        {
            let [f0, f1, f2] = &mut fused[..] else {
                unreachable!()
            };
            let mut parts = [
                (mats[0], &mut f0[..]),
                (mats[1], &mut f1[..]),
                (mats[2], &mut f2[..]),
            ];
            matmul_quantized_many(&mut parts, &acts).unwrap();
        }
        for (m, f) in mats.iter().zip(&fused) {
            let mut alone = vec![0f32; m.n * n_tok];
            matmul_quantized(m, &acts, &mut alone).unwrap();
            assert!(
                alone.iter().zip(f).all(|(p, q)| p.to_bits() == q.to_bits()),
                "{} rows",
                m.n
            );
            assert!(alone.iter().any(|&v| v != 0.0));
        }
    }
}

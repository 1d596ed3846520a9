//! F16 prefill on AVX-512 CPUs. The f16 activations are widened to f32 once per operator, laid out
//! in the order the tile reads them, and each block of weight rows is widened once per block of
//! tokens into a buffer that stays in L1, so the tile's inner loop is loads and FMAs only.
//!
//! Every output is computed as `avx2::vec_dot_f16` computes it (`scalar::dot_wide`'s order): lane
//! (c, l) of four 8-lane FMA chains takes the elements `i % 32 == 8c + l` as `fma(w, a, acc)`,
//! then `(c0 + c1) + (c2 + c3)` lane-wise, `hsum8`, then the `k % 32` tail elements by FMA in
//! order. A 512-bit register holds two tokens' 8 lanes of one chain (tokens 2p and 2p + 1 of a
//! quad), so tiled and single-row results are bit-identical.

#![allow(unsafe_op_in_unsafe_fn)]

use std::arch::x86_64::*;
use std::ops::Range;

use crate::kernels::cpu::avx2::hsum8;
use crate::kernels::cpu::matmul::QuantizedActs;
use crate::kernels::cpu::pool;
use crate::quant::blocks::f16_bits_to_f32;

/// Sixteen f32 lanes, aligned as a 512-bit register.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub struct Lanes16([f32; 16]);

const ZERO: Lanes16 = Lanes16([0.0; 16]);

/// Weight rows per tile: three rows x four tokens is 24 accumulators of the 32 registers.
const MAX_ROWS: usize = 3;

/// Bytes of widened activations per block of tokens (each weight row block is widened once per
/// token block and runs against every quad in it): small enough to stay in L2 beside the weights.
const TOKEN_BLOCK_BYTES: usize = 256 << 10;

/// f16 activations widened to f32, four tokens (a quad) at a time: `[quad][step][pair][chunk]`
/// of [`Lanes16`], where step s is elements 32s..32s + 32 and entry (p, c) holds elements
/// 32s + 8c..32s + 8c + 8 of token 4q + 2p (lanes 0..8) and of token 4q + 2p + 1 (lanes 8..16).
/// Tokens after the last whole quad and elements after the last whole step are not widened.
pub struct WideActs {
    data: Vec<Lanes16>,
    steps: usize,
    n_quads: usize,
}

impl WideActs {
    /// Widens F16 activations when the AVX-512 tiles will use them (`None` otherwise: another
    /// type, another instruction set, or fewer than four tokens).
    pub fn new(acts: &QuantizedActs) -> Option<WideActs> {
        use crate::kernels::cpu::{Isa, isa};
        use crate::quant::GgmlType;
        if acts.ty != GgmlType::F16 || acts.n_tok < 4 || isa() != Isa::Avx512 {
            return None;
        }
        Some(Self::widen(acts))
    }

    /// Widens the whole quads of `acts` (F16, on a CPU with AVX-512).
    fn widen(acts: &QuantizedActs) -> WideActs {
        assert!(
            acts.ty == crate::quant::GgmlType::F16 && crate::kernels::cpu::Isa::Avx512.supported()
        );
        let steps = acts.k / 32;
        let n_quads = acts.n_tok / 4;
        let per_quad = steps * 8;
        let mut data = vec![ZERO; n_quads * per_quad];
        let out = SharedLanes(data.as_mut_ptr());
        pool::global().for_chunks(n_quads, 8, |quads| {
            let out = &out;
            for q in quads {
                // SAFETY: quad q owns data[q * per_quad..(q + 1) * per_quad], disjoint across
                // tasks, and `data` outlives the job.
                let dst =
                    unsafe { std::slice::from_raw_parts_mut(out.0.add(q * per_quad), per_quad) };
                let rows = std::array::from_fn(|j| acts.row(4 * q + j));
                // SAFETY: this CPU has AVX-512 (asserted above).
                unsafe { widen_quad(rows, dst) };
            }
        });
        WideActs {
            data,
            steps,
            n_quads,
        }
    }

    /// Tokens the tiles cover: 0..4 * n_quads.
    pub fn n_tok(&self) -> usize {
        4 * self.n_quads
    }

    fn quad(&self, q: usize) -> &[Lanes16] {
        let n = self.steps * 8;
        &self.data[q * n..(q + 1) * n]
    }
}

/// Output pointer for tasks that write disjoint quads.
struct SharedLanes(*mut Lanes16);
// SAFETY: tasks write disjoint ranges of the buffer, which outlives the parallel loop.
unsafe impl Sync for SharedLanes {}

/// Eight f16 values from element i of a row of f16 bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn load8(b: &[u8], i: usize) -> __m128i {
    debug_assert!(2 * (i + 8) <= b.len());
    _mm_loadu_si128(b.as_ptr().add(2 * i).cast())
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn widen_quad(rows: [&[u8]; 4], dst: &mut [Lanes16]) {
    let steps = dst.len() / 8;
    assert!(rows.iter().all(|r| r.len() >= 64 * steps));
    for s in 0..steps {
        for p in 0..2 {
            for c in 0..4 {
                let i = 32 * s + 8 * c;
                let two = _mm256_inserti128_si256::<1>(
                    _mm256_castsi128_si256(load8(rows[2 * p], i)),
                    load8(rows[2 * p + 1], i),
                );
                _mm512_store_ps(dst[8 * s + 4 * p + c].0.as_mut_ptr(), _mm512_cvtph_ps(two));
            }
        }
    }
}

/// Widens `R` weight rows (f16 bytes) into `dst`: row r's elements 0..32 * steps from
/// `dst[r * 2 * steps]` on, sixteen per entry.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn widen_rows<const R: usize>(rows: [&[u8]; R], steps: usize, dst: &mut [Lanes16]) {
    assert!(dst.len() >= R * 2 * steps && rows.iter().all(|r| r.len() >= 64 * steps));
    for (r, row) in rows.iter().enumerate() {
        for e in 0..2 * steps {
            let h = _mm256_loadu_si256(row.as_ptr().add(32 * e).cast());
            _mm512_store_ps(dst[r * 2 * steps + e].0.as_mut_ptr(), _mm512_cvtph_ps(h));
        }
    }
}

/// `R` widened weight rows (`w`, as [`widen_rows`] lays them out) against one widened quad `a`,
/// over `steps` whole 32-element steps; the lanes reduced to one sum per (row, token).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn tile<const R: usize>(w: &[Lanes16], a: &[Lanes16], steps: usize) -> [[f32; 4]; R] {
    assert!(w.len() >= R * 2 * steps && a.len() >= 8 * steps);
    let wp = w.as_ptr().cast::<f32>();
    let ap = a.as_ptr().cast::<f32>();
    let mut acc = [[[_mm512_setzero_ps(); 4]; 2]; R];
    for s in 0..steps {
        for c in 0..4 {
            // SAFETY (all loads): s < steps, so every offset is inside `a` and `w` (checked above).
            let y0 = _mm512_load_ps(ap.add(16 * (8 * s + c)));
            let y1 = _mm512_load_ps(ap.add(16 * (8 * s + 4 + c)));
            for (r, acc_r) in acc.iter_mut().enumerate() {
                let w8 = _mm256_load_pd(wp.add(r * 32 * steps + 32 * s + 8 * c).cast());
                let wz = _mm512_castpd_ps(_mm512_broadcast_f64x4(w8));
                acc_r[0][c] = _mm512_fmadd_ps(wz, y0, acc_r[0][c]);
                acc_r[1][c] = _mm512_fmadd_ps(wz, y1, acc_r[1][c]);
            }
        }
    }
    let mut out = [[0f32; 4]; R];
    for r in 0..R {
        for p in 0..2 {
            let a4 = &acc[r][p];
            let s = _mm512_add_ps(_mm512_add_ps(a4[0], a4[1]), _mm512_add_ps(a4[2], a4[3]));
            let lo = _mm512_castps512_ps256(s);
            let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(s)));
            out[r][2 * p] = hsum8(lo);
            out[r][2 * p + 1] = hsum8(hi);
        }
    }
    out
}

fn elem(b: &[u8], i: usize) -> f32 {
    f16_bits_to_f32(u16::from_le_bytes([b[2 * i], b[2 * i + 1]]))
}

/// Rows `rows` of an F16 weight (`row(r)`: its bytes) against the tokens `wide` covers, written
/// through `put(token, row, value)`: token blocks of about [`TOKEN_BLOCK_BYTES`].
pub(crate) fn run_rows<'w>(
    wide: &WideActs,
    acts: &QuantizedActs,
    row: impl Fn(usize) -> &'w [u8],
    rows: Range<usize>,
    put: impl Fn(usize, usize, f32),
) {
    let quads_per_block = TOKEN_BLOCK_BYTES / (wide.steps * size_of::<Lanes16>() * 8).max(1);
    run_blocks(wide, acts, row, rows, quads_per_block.max(1), put)
}

/// [`run_rows`] with `quads_per_block` quads per token block: in each block, the rows three (then
/// two, then one) at a time against every quad.
fn run_blocks<'w>(
    wide: &WideActs,
    acts: &QuantizedActs,
    row: impl Fn(usize) -> &'w [u8],
    rows: Range<usize>,
    quads_per_block: usize,
    put: impl Fn(usize, usize, f32),
) {
    let mut wbuf = vec![ZERO; MAX_ROWS * 2 * wide.steps];
    let mut q0 = 0;
    while q0 < wide.n_quads {
        let quads = q0..(q0 + quads_per_block).min(wide.n_quads);
        let mut r = rows.start;
        while r + 3 <= rows.end {
            block::<3>(wide, acts, &row, r, quads.clone(), &mut wbuf, &put);
            r += 3;
        }
        if r + 2 <= rows.end {
            block::<2>(wide, acts, &row, r, quads.clone(), &mut wbuf, &put);
            r += 2;
        }
        if r < rows.end {
            block::<1>(wide, acts, &row, r, quads.clone(), &mut wbuf, &put);
        }
        q0 = quads.end;
    }
}

/// Rows `r..r + R` against quads `quads`.
fn block<'w, const R: usize>(
    wide: &WideActs,
    acts: &QuantizedActs,
    row: &impl Fn(usize) -> &'w [u8],
    r: usize,
    quads: Range<usize>,
    wbuf: &mut [Lanes16],
    put: &impl Fn(usize, usize, f32),
) {
    let steps = wide.steps;
    let full = 32 * steps;
    let w: [&[u8]; R] = std::array::from_fn(|i| row(r + i));
    // SAFETY: `WideActs::new` is `Some` only on CPUs with AVX-512.
    unsafe { widen_rows(w, steps, wbuf) };
    for q in quads {
        // SAFETY: as above.
        let mut out = unsafe { tile::<R>(wbuf, wide.quad(q), steps) };
        for (i, o) in out.iter_mut().enumerate() {
            for (j, v) in o.iter_mut().enumerate() {
                let a = acts.row(4 * q + j);
                for e in full..acts.k {
                    *v = elem(w[i], e).mul_add(elem(a, e), *v);
                }
                put(4 * q + j, r + i, *v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu::Isa;
    use crate::quant::{GgmlType, quantize_row};

    /// Every (token, row) over several token blocks, with row blocks of three, two and one and a
    /// `k % 32` tail, equals the single-row F16 dot bit for bit.
    #[test]
    fn tiles_equal_single_row_dots() {
        if !Isa::Avx512.supported() {
            return;
        }
        let val = |i: usize, o: f32| 0.1 + 2.0 * (i as f32 * 0.37 + o).cos();
        for (k, n_tok) in [(96, 23), (104, 12), (64 + 13, 8)] {
            let n = 12;
            let rb = GgmlType::F16.row_bytes(k).unwrap();
            let mut w = vec![0u8; rb * n];
            for (r, dst) in w.chunks_mut(rb).enumerate() {
                let src: Vec<f32> = (0..k).map(|i| val(r * k + i, 0.0)).collect();
                quantize_row(GgmlType::F16, &src, dst).unwrap();
            }
            let x: Vec<f32> = (0..k * n_tok).map(|i| val(i, 1.7)).collect();
            let acts = QuantizedActs::new(GgmlType::F16, &x, k).unwrap();
            let wide = WideActs::widen(&acts);
            assert_eq!(wide.n_tok(), n_tok / 4 * 4);
            // Rows 1..n: blocks of three, then two (n - 1 = 11); and 1..n - 1: three, then one.
            for (rows, quads_per_block) in [(1..n, 1), (1..n - 1, 2), (0..n, 100)] {
                let got = std::sync::Mutex::new(vec![f32::NAN; n_tok * n]);
                run_blocks(
                    &wide,
                    &acts,
                    |r| &w[r * rb..(r + 1) * rb],
                    rows.clone(),
                    quads_per_block,
                    |t, r, v| {
                        got.lock().unwrap()[t * n + r] = v;
                    },
                );
                let got = got.into_inner().unwrap();
                for t in 0..wide.n_tok() {
                    for r in rows.clone() {
                        // SAFETY: the CPU has AVX2 (it has AVX-512).
                        let want = unsafe {
                            crate::kernels::cpu::avx2::vec_dot_f16(
                                &w[r * rb..(r + 1) * rb],
                                acts.row(t),
                                k,
                            )
                        };
                        assert_eq!(
                            got[t * n + r].to_bits(),
                            want.to_bits(),
                            "k={k} token {t} row {r}: {} vs {want}",
                            got[t * n + r]
                        );
                    }
                }
            }
        }
    }
}

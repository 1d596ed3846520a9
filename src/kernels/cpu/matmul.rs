//! Matrix multiplication with a weight in its GGUF format: activations are quantised once per
//! operator to the weight type's dot-product format, then rows are split over the thread pool.

use crate::error::{Error, Result};
use crate::kernels::cpu::pool;
use crate::kernels::cpu::{dot_fn, isa};
use crate::quant::{GgmlType, quantize_act_row};

/// A weight matrix view: `n` rows of `k` elements of type `ty`, rows contiguous.
#[derive(Clone, Copy)]
pub struct MatRef<'a> {
    pub ty: GgmlType,
    pub k: usize,
    pub n: usize,
    pub data: &'a [u8],
}

/// Activations already converted to a weight type's `vec_dot_type`: `n_tok` rows of `row_bytes`.
pub struct QuantizedActs {
    pub ty: GgmlType,
    pub k: usize,
    pub n_tok: usize,
    pub row_bytes: usize,
    pub data: Vec<u8>,
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
                        std::slice::from_raw_parts_mut(out.0.cast::<u8>().add(t * row_bytes), row_bytes)
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

/// Rows handed to one task: enough work that scheduling does not dominate.
fn rows_per_task(w: &MatRef, n_tok: usize) -> usize {
    let threads = pool::global().n_threads();
    let by_threads = w.n.div_ceil(threads * 4);
    // Aim for at least ~64 KiB of weight bytes x tokens per task.
    let row_bytes = w.data.len() / w.n.max(1);
    let min_rows = (65536 / (row_bytes * n_tok).max(1)).max(1);
    by_threads.max(min_rows).min(w.n).max(1)
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

/// As [`matmul`], with activations quantised beforehand (shared by operators with one input).
pub fn matmul_quantized(w: &MatRef, acts: &QuantizedActs, y: &mut [f32]) -> Result<()> {
    let n_tok = acts.n_tok;
    let wrb = w.ty.row_bytes(w.k)?;
    if acts.k != w.k
        || acts.ty != w.ty.vec_dot_type()
        || y.len() != n_tok * w.n
        || w.data.len() != wrb * w.n
    {
        return Err(Error::Msg(format!(
            "matmul: shapes do not agree (weight {} [{}x{}] {} bytes, acts {} k={} x{}, out {})",
            w.ty,
            w.n,
            w.k,
            w.data.len(),
            acts.ty,
            acts.k,
            n_tok,
            y.len()
        )));
    }
    let dot = dot_fn(isa(), w.ty);
    let chunk = rows_per_task(w, n_tok);
    let out = SharedOut(y.as_mut_ptr());
    let n = w.n;
    pool::global().for_chunks(n, chunk, |rows| {
        let out = &out;
        for r in rows {
            let wrow = &w.data[r * wrb..(r + 1) * wrb];
            for t in 0..n_tok {
                // SAFETY: dot_fn returns only variants this CPU supports.
                let v = unsafe { dot(wrow, acts.row(t), w.k) };
                // SAFETY: t < n_tok and r < n, so the index is inside y (checked above); each (t, r)
                // is written by exactly one task because r ranges are disjoint.
                unsafe { *out.0.add(t * n + r) = v };
            }
        }
    });
    Ok(())
}

//! Causal grouped-query attention over an f16 KV cache on the CPU, rounding as ggml's non-flash path
//! does: queries and attention weights are rounded to f16 before their products with the cache.
//! Query·key dots use the engine's F16 dot (`dot_fn(isa, F16)`); the weighted sum of values is one
//! FMA per element and position, in position order, so every ISA variant gives identical results.

use half::f16;

use crate::kernels::cpu::matmul::SharedOut;
use crate::kernels::cpu::{Isa, dot_fn, isa, pool};
use crate::quant::GgmlType;

/// Shapes of one attention call.
#[derive(Clone, Copy)]
pub struct AttnShape {
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
}

fn f16_bytes(x: &[f16]) -> &[u8] {
    // SAFETY: f16 is a 2-byte plain-old-data type with no padding; u8 has alignment 1.
    unsafe { std::slice::from_raw_parts(x.as_ptr().cast(), std::mem::size_of_val(x)) }
}

/// `o[d] = fma(p, v[d], o[d])` for every d.
fn axpy_f16(isa: Isa, o: &mut [f32], p: f32, v: &[f16]) {
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Scalar && isa.supported() {
        // SAFETY: AVX2, FMA and F16C are present (checked just above).
        unsafe { simd::axpy_f16(o, p, v) };
        return;
    }
    let _ = isa;
    for (a, x) in o.iter_mut().zip(v) {
        *a = p.mul_add(x.to_f32(), *a);
    }
}

#[cfg(target_arch = "x86_64")]
mod simd {
    #![allow(unsafe_op_in_unsafe_fn)]
    use half::f16;
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn axpy_f16(o: &mut [f32], p: f32, v: &[f16]) {
        let n = o.len().min(v.len());
        let pv = _mm256_set1_ps(p);
        let mut i = 0;
        while i + 8 <= n {
            let x = _mm256_cvtph_ps(_mm_loadu_si128(v.as_ptr().add(i).cast()));
            let a = _mm256_loadu_ps(o.as_ptr().add(i));
            _mm256_storeu_ps(o.as_mut_ptr().add(i), _mm256_fmadd_ps(pv, x, a));
            i += 8;
        }
        for j in i..n {
            o[j] = p.mul_add(v[j].to_f32(), o[j]);
        }
    }
}

/// `q`: [n_tok, n_head * head_dim] (after RoPE); `k_cache`, `v_cache`: [n_ctx, n_head_kv * head_dim] f16
/// holding positions 0..pos0 + n_tok; token t sits at `pos0 + t` and sees positions 0..=pos0 + t.
/// Writes `out`: [n_tok, n_head * head_dim].
pub fn attention(
    s: AttnShape,
    q: &[f32],
    k_cache: &[f16],
    v_cache: &[f16],
    pos0: usize,
    out: &mut [f32],
) {
    let isa = isa();
    let dot = dot_fn(isa, GgmlType::F16);
    let hd = s.head_dim;
    let q_dim = s.n_head * hd;
    let kv_dim = s.n_head_kv * hd;
    let group = s.n_head / s.n_head_kv;
    let scale = 1.0 / (hd as f32).sqrt();
    let items = out.len() / hd;
    let shared = SharedOut(out.as_mut_ptr());
    // Work per item grows with the position; small chunks keep the threads balanced.
    pool::global().for_chunks(items, 2, |range| {
        let shared = &shared;
        let mut qh = vec![f16::ZERO; hd];
        let mut scores = Vec::new();
        for idx in range {
            let (t, h) = (idx / s.n_head, idx % s.n_head);
            let kvh = h / group;
            let n_kv = pos0 + t + 1;
            for (d, &v) in qh
                .iter_mut()
                .zip(&q[t * q_dim + h * hd..t * q_dim + (h + 1) * hd])
            {
                *d = f16::from_f32(v);
            }
            scores.clear();
            for j in 0..n_kv {
                let kj = &k_cache[j * kv_dim + kvh * hd..j * kv_dim + (kvh + 1) * hd];
                // SAFETY: dot_fn returns only variants this CPU supports.
                let dotp = unsafe { dot(f16_bytes(kj), f16_bytes(&qh), hd) };
                scores.push(dotp * scale);
            }
            super::ops::softmax(&mut scores);
            // SAFETY: item idx owns out[idx * hd..(idx + 1) * hd]; items are disjoint across tasks
            // and `out` outlives the job.
            let o = unsafe { std::slice::from_raw_parts_mut(shared.0.add(idx * hd), hd) };
            o.fill(0.0);
            for (j, &p) in scores.iter().enumerate() {
                let p = f16::from_f32(p).to_f32();
                let vj = &v_cache[j * kv_dim + kvh * hd..j * kv_dim + (kvh + 1) * hd];
                axpy_f16(isa, o, p, vj);
            }
        }
    });
}

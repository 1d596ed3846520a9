//! Causal grouped-query attention over an f16 KV cache on the CPU, rounding as ggml's non-flash path
//! does: queries and attention weights are rounded to f16 before their dot products with the cache.

use half::f16;
use rayon::prelude::*;

/// Shapes of one attention call.
#[derive(Clone, Copy)]
pub struct AttnShape {
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
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
    let hd = s.head_dim;
    let q_dim = s.n_head * hd;
    let kv_dim = s.n_head_kv * hd;
    let group = s.n_head / s.n_head_kv;
    let scale = 1.0 / (hd as f32).sqrt();
    out.par_chunks_mut(hd).enumerate().for_each(|(idx, o)| {
        let (t, h) = (idx / s.n_head, idx % s.n_head);
        let kvh = h / group;
        let n_kv = pos0 + t + 1;
        let qh: Vec<f16> = q[t * q_dim + h * hd..t * q_dim + (h + 1) * hd]
            .iter()
            .map(|&v| f16::from_f32(v))
            .collect();
        let mut scores = Vec::with_capacity(n_kv);
        for j in 0..n_kv {
            let kj = &k_cache[j * kv_dim + kvh * hd..j * kv_dim + (kvh + 1) * hd];
            let mut dot = 0f32;
            for (a, b) in qh.iter().zip(kj) {
                dot += a.to_f32() * b.to_f32();
            }
            scores.push(dot * scale);
        }
        super::ops::softmax(&mut scores);
        o.fill(0.0);
        for (j, &p) in scores.iter().enumerate() {
            let p = f16::from_f32(p).to_f32();
            let vj = &v_cache[j * kv_dim + kvh * hd..j * kv_dim + (kvh + 1) * hd];
            for (acc, v) in o.iter_mut().zip(vj) {
                *acc += p * v.to_f32();
            }
        }
    });
}

//! Non-weight operators on the CPU: RMSNorm, RoPE, SwiGLU, residual adds, softmax.

use crate::model::RopeParams;

/// In place: `x = x / sqrt(mean(x^2) + eps) * w`, row by row ([n_tok, n]).
pub fn rms_norm(x: &mut [f32], w: &[f32], eps: f32) {
    let n = w.len();
    for row in x.chunks_mut(n) {
        let sum: f64 = row.iter().map(|&v| (v * v) as f64).sum();
        let scale = 1.0 / ((sum / n as f64) as f32 + eps).sqrt();
        for (v, &g) in row.iter_mut().zip(w) {
            *v = *v * scale * g;
        }
    }
}

/// `out = rms_norm(x) * w` without touching `x`.
pub fn rms_norm_into(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    out.copy_from_slice(x);
    rms_norm(out, w, eps);
}

/// Adds `b` to every row of `x`.
pub fn add_bias(x: &mut [f32], b: &[f32]) {
    for row in x.chunks_mut(b.len()) {
        for (v, &bb) in row.iter_mut().zip(b) {
            *v += bb;
        }
    }
}

pub fn add_inplace(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// `gate = silu(gate) * up`, elementwise.
pub fn swiglu_inplace(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// Rotary position embedding in place on `x` = [n_tok, n_heads, head_dim], token t at `pos0 + t`.
/// `freq_factors` (Llama 3.1's rope_freqs) divide each pair's angle when present.
pub fn rope(
    x: &mut [f32],
    n_heads: usize,
    head_dim: usize,
    pos0: usize,
    p: &RopeParams,
    freq_factors: Option<&[f32]>,
) {
    let half = p.n_dims / 2;
    let theta_scale = p.freq_base.powf(-2.0 / p.n_dims as f32);
    let mut cos_sin = vec![(0f32, 0f32); half];
    for (t, tok) in x.chunks_mut(n_heads * head_dim).enumerate() {
        let mut theta = (pos0 + t) as f32 * p.freq_scale;
        for (i, cs) in cos_sin.iter_mut().enumerate() {
            let ff = freq_factors.map_or(1.0, |f| f[i]);
            let a = theta / ff;
            *cs = (a.cos(), a.sin());
            theta *= theta_scale;
        }
        for head in tok.chunks_mut(head_dim) {
            for (i, &(c, s)) in cos_sin.iter().enumerate() {
                let (a, b) = if p.neox {
                    (i, i + half)
                } else {
                    (2 * i, 2 * i + 1)
                };
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0 * c - x1 * s;
                head[b] = x0 * s + x1 * c;
            }
        }
    }
}

/// Softmax in place over `x`.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f64;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v as f64;
    }
    let inv = (1.0 / sum) as f32;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

//! Perplexity over a text as llama.cpp's llama-perplexity computes it: windows of n_ctx tokens,
//! each run from an empty cache, scoring only the second half of each window.

use crate::error::{Error, Result};
use crate::runtime::forward::{Logits, Session};

#[derive(Debug, Clone, serde::Serialize)]
pub struct Perplexity {
    pub ppl: f64,
    /// Standard error of the estimate (llama.cpp's "+/-").
    pub stderr: f64,
    /// Tokens in the text.
    pub tokens: usize,
    pub windows: usize,
    /// Tokens scored.
    pub scored: usize,
    pub n_ctx: usize,
    /// Running estimate after each window.
    pub per_window: Vec<f64>,
}

/// `-log p(target)` from one row of logits.
pub fn nll(logits: &[f32], target: u32) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&l| (l as f64 - max).exp()).sum();
    -(logits[target as usize] as f64 - max - sum.ln())
}

/// `bos`: replaces each window's first token when the model adds BOS (as llama.cpp does).
pub fn perplexity(
    session: &mut Session,
    tokens: &[u32],
    n_ctx: usize,
    bos: Option<u32>,
) -> Result<Perplexity> {
    if n_ctx < 4 || n_ctx > session.n_ctx {
        return Err(Error::Usage(format!(
            "--ctx {n_ctx} must be between 4 and the cache size {}",
            session.n_ctx
        )));
    }
    let windows = tokens.len() / n_ctx;
    if windows == 0 {
        return Err(Error::Usage(format!(
            "the text has {} tokens, fewer than one window of --ctx {n_ctx}",
            tokens.len()
        )));
    }
    let n_vocab = session.model.hp.n_vocab;
    let first = n_ctx / 2;
    let (mut sum, mut sum2, mut count) = (0f64, 0f64, 0usize);
    let mut per_window = Vec::with_capacity(windows);
    for w in 0..windows {
        let mut chunk = tokens[w * n_ctx..(w + 1) * n_ctx].to_vec();
        if let Some(b) = bos {
            chunk[0] = b;
        }
        session.reset();
        let logits = session.forward(&chunk, Logits::From(first))?;
        for i in first..n_ctx - 1 {
            let target = tokens[w * n_ctx + i + 1];
            let row = i - first;
            let v = nll(&logits[row * n_vocab..(row + 1) * n_vocab], target);
            sum += v;
            sum2 += v * v;
            count += 1;
        }
        per_window.push((sum / count as f64).exp());
    }
    let mean = sum / count as f64;
    let ppl = mean.exp();
    let var = sum2 / count as f64 - mean * mean;
    let stderr = if var > 0.0 && count > 1 {
        (var / (count - 1) as f64).sqrt() * ppl
    } else {
        0.0
    };
    Ok(Perplexity {
        ppl,
        stderr,
        tokens: tokens.len(),
        windows,
        scored: count,
        n_ctx,
        per_window,
    })
}

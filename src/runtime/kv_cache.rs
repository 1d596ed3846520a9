//! The KV cache: per layer, keys and values of every past position, in f16.

use half::f16;

use crate::error::{Error, Result};

pub struct KvCache {
    pub n_ctx: usize,
    pub kv_dim: usize,
    /// Per layer: [n_ctx, kv_dim].
    pub k: Vec<Vec<f16>>,
    pub v: Vec<Vec<f16>>,
}

impl KvCache {
    pub fn new(n_layer: usize, n_ctx: usize, kv_dim: usize) -> Self {
        KvCache {
            n_ctx,
            kv_dim,
            k: (0..n_layer)
                .map(|_| vec![f16::ZERO; n_ctx * kv_dim])
                .collect(),
            v: (0..n_layer)
                .map(|_| vec![f16::ZERO; n_ctx * kv_dim])
                .collect(),
        }
    }

    /// Bytes per token of context, all layers, K and V.
    pub fn bytes_per_token(n_layer: usize, kv_dim: usize) -> usize {
        2 * n_layer * kv_dim * std::mem::size_of::<f16>()
    }

    /// Stores `k`, `v` ([n_tok, kv_dim]) of layer `il` at positions pos0.. .
    pub fn store(&mut self, il: usize, pos0: usize, k: &[f32], v: &[f32]) -> Result<()> {
        let n_tok = k.len() / self.kv_dim;
        if pos0 + n_tok > self.n_ctx {
            return Err(Error::Msg(format!(
                "context full: {} tokens do not fit in a context of {}",
                pos0 + n_tok,
                self.n_ctx
            )));
        }
        let at = pos0 * self.kv_dim;
        for (d, s) in self.k[il][at..at + k.len()].iter_mut().zip(k) {
            *d = f16::from_f32(*s);
        }
        for (d, s) in self.v[il][at..at + v.len()].iter_mut().zip(v) {
            *d = f16::from_f32(*s);
        }
        Ok(())
    }
}

//! The forward pass on the CPU: embedding, transformer blocks, output head, over a KV cache.

use crate::error::{Error, Result};
use crate::kernels::cpu::attention::{AttnShape, attention};
use crate::kernels::cpu::matmul::{MatRef, QuantizedActs, matmul, matmul_quantized_many};
use crate::kernels::cpu::ops;
use crate::model::{Model, WeightRef};
use crate::runtime::kv_cache::KvCache;

/// Which positions' logits a forward call returns.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Logits {
    /// Only the last token's (generation).
    Last,
    /// Every token's.
    All,
    /// Tokens `i..` of the batch (perplexity scores only the second half of a window).
    From(usize),
}

/// A model with its KV cache and the number of positions already processed.
pub struct Session<'m> {
    pub model: &'m Model,
    pub cache: KvCache,
    pub n_past: usize,
}

impl<'m> Session<'m> {
    pub fn new(model: &'m Model, n_ctx: usize) -> Self {
        let hp = &model.hp;
        Session {
            model,
            cache: KvCache::new(hp.n_layer, n_ctx, hp.kv_dim()),
            n_past: 0,
        }
    }

    /// Forgets every position (the cache is overwritten from position 0).
    pub fn reset(&mut self) {
        self.n_past = 0;
    }

    fn mat(&self, w: &WeightRef) -> MatRef<'m> {
        MatRef {
            ty: w.ty,
            k: w.k,
            n: w.n,
            data: self.model.data(w),
        }
    }

    /// Matrices that read the same input `x` ([n_tok, k]): the input is quantised once and those
    /// whose types take that format run as one pool job; any other type runs on its own.
    fn shared_input(
        &self,
        x: &[f32],
        k: usize,
        parts: &mut [(&WeightRef, &mut Vec<f32>)],
    ) -> Result<()> {
        let acts = QuantizedActs::new(parts[0].0.ty, x, k)?;
        let mut same = Vec::with_capacity(parts.len());
        for (w, out) in parts.iter_mut() {
            if w.ty.vec_dot_type() == acts.ty {
                same.push((self.mat(w), out.as_mut_slice()));
            } else {
                matmul(&self.mat(w), x, out)?;
            }
        }
        matmul_quantized_many(&mut same, &acts)
    }

    /// Runs `tokens` as one batch at positions n_past.. and returns the logits `want` names
    /// ([rows, n_vocab]).
    pub fn forward(&mut self, tokens: &[u32], want: Logits) -> Result<Vec<f32>> {
        let model = self.model;
        let hp = &model.hp;
        let n_tok = tokens.len();
        if n_tok == 0 {
            return Err(Error::Msg("forward: no tokens".into()));
        }
        let pos0 = self.n_past;
        if pos0 + n_tok > self.cache.n_ctx {
            return Err(Error::Msg(format!(
                "context full: {} + {} tokens exceed --ctx {}",
                pos0, n_tok, self.cache.n_ctx
            )));
        }
        let (e, qd, kvd, ff) = (hp.n_embd, hp.q_dim(), hp.kv_dim(), hp.n_ff);
        // [n_tok, n_embd]
        let mut x = vec![0f32; n_tok * e];
        for (t, &tok) in tokens.iter().enumerate() {
            model.embedding_row(tok, &mut x[t * e..(t + 1) * e])?;
        }
        let mut h = vec![0f32; n_tok * e];
        let mut q = vec![0f32; n_tok * qd];
        let mut k = vec![0f32; n_tok * kvd];
        let mut v = vec![0f32; n_tok * kvd];
        let mut att = vec![0f32; n_tok * qd];
        let mut gate = vec![0f32; n_tok * ff];
        let mut up = vec![0f32; n_tok * ff];
        let shape = AttnShape {
            n_head: hp.n_head,
            n_head_kv: hp.n_head_kv,
            head_dim: hp.head_dim,
        };
        let freqs = model.rope_freqs.as_deref();
        for (il, l) in model.layers.iter().enumerate() {
            ops::rms_norm_into(&x, &l.attn_norm, hp.rms_eps, &mut h);
            // q, k and v share one quantised input when their types agree.
            self.shared_input(
                &h,
                e,
                &mut [(&l.wq, &mut q), (&l.wk, &mut k), (&l.wv, &mut v)],
            )?;
            for (out, b) in [(&mut q, &l.bq), (&mut k, &l.bk), (&mut v, &l.bv)] {
                if let Some(b) = b {
                    ops::add_bias(out, b);
                }
            }
            ops::rope(&mut q, hp.n_head, hp.head_dim, pos0, &hp.rope, freqs);
            ops::rope(&mut k, hp.n_head_kv, hp.head_dim, pos0, &hp.rope, freqs);
            self.cache.store(il, pos0, &k, &v)?;
            attention(
                shape,
                &q,
                &self.cache.k[il],
                &self.cache.v[il],
                pos0,
                &mut att,
            );
            matmul(&self.mat(&l.wo), &att, &mut h)?;
            ops::add_inplace(&mut x, &h);

            ops::rms_norm_into(&x, &l.ffn_norm, hp.rms_eps, &mut h);
            self.shared_input(&h, e, &mut [(&l.w_gate, &mut gate), (&l.w_up, &mut up)])?;
            ops::swiglu_inplace(&mut gate, &up);
            matmul(&self.mat(&l.w_down), &gate, &mut h)?;
            ops::add_inplace(&mut x, &h);
        }
        let from = match want {
            Logits::Last => n_tok - 1,
            Logits::All => 0,
            Logits::From(i) => i.min(n_tok - 1),
        };
        let rows = &mut x[from * e..];
        ops::rms_norm(rows, &model.output_norm, hp.rms_eps);
        let mut logits = vec![0f32; rows.len() / e * hp.n_vocab];
        matmul(&self.mat(&model.output), rows, &mut logits)?;
        self.n_past += n_tok;
        Ok(logits)
    }
}

//! Hyper-parameters read from GGUF metadata, per architecture.

use crate::error::{Error, Result};
use crate::gguf::GgufFile;

/// Architectures the forward pass knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// Llama 2/3, Mistral, SmolLM2: normal RoPE, no attention biases.
    Llama,
    /// Qwen2 / QwQ: q/k/v biases, NeoX RoPE.
    Qwen2,
}

impl Arch {
    pub fn from_name(name: &str) -> Result<Self> {
        match name {
            "llama" => Ok(Arch::Llama),
            "qwen2" => Ok(Arch::Qwen2),
            other => Err(Error::Model(format!(
                "architecture {other:?} is not supported (supported: llama, qwen2)"
            ))),
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
        }
    }
    /// NeoX-style RoPE rotates pairs (i, i + d/2) instead of (2i, 2i + 1).
    pub fn rope_neox(self) -> bool {
        matches!(self, Arch::Qwen2)
    }
}

/// RoPE parameters after scaling is resolved.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeParams {
    /// Dimensions rotated per head (the rest pass through).
    pub n_dims: usize,
    pub freq_base: f32,
    /// Position multiplier: 1 / linear scaling factor.
    pub freq_scale: f32,
    pub neox: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub struct HParams {
    pub arch: Arch,
    pub n_vocab: usize,
    pub n_embd: usize,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub n_ff: usize,
    pub rms_eps: f32,
    pub n_ctx_train: usize,
    pub rope: RopeParams,
}

impl HParams {
    pub fn from_gguf(f: &GgufFile) -> Result<Self> {
        let arch_name = f
            .get_str("general.architecture")
            .ok_or_else(|| Error::Model("metadata has no general.architecture".into()))?;
        let arch = Arch::from_name(arch_name)?;
        let key = |k: &str| format!("{arch_name}.{k}");
        let req = |k: &str| -> Result<usize> {
            let full = key(k);
            let v = f
                .get_u64(&full)?
                .ok_or_else(|| Error::Model(format!("metadata has no {full}")))?;
            usize::try_from(v)
                .ok()
                .filter(|&v| v > 0 && v < (1 << 31))
                .ok_or_else(|| Error::Model(format!("metadata {full} = {v} is out of range")))
        };
        let n_embd = req("embedding_length")?;
        let n_layer = req("block_count")?;
        let n_head = req("attention.head_count")?;
        let n_ff = req("feed_forward_length")?;
        let n_head_kv = match f.get_u64(&key("attention.head_count_kv"))? {
            Some(v) => v as usize,
            None => n_head,
        };
        if n_head_kv == 0 || n_head % n_head_kv != 0 {
            return Err(Error::Model(format!(
                "attention.head_count {n_head} is not a multiple of head_count_kv {n_head_kv}"
            )));
        }
        let head_dim = match f.get_u64(&key("attention.key_length"))? {
            Some(v) => v as usize,
            None => {
                if n_embd % n_head != 0 {
                    return Err(Error::Model(format!(
                        "embedding_length {n_embd} is not a multiple of head_count {n_head}"
                    )));
                }
                n_embd / n_head
            }
        };
        if head_dim == 0 || head_dim % 2 != 0 || head_dim > 1024 {
            return Err(Error::Model(format!(
                "head dimension {head_dim} is not usable"
            )));
        }
        let rms_eps = f
            .get_f64(&key("attention.layer_norm_rms_epsilon"))?
            .unwrap_or(1e-5) as f32;
        let n_ctx_train = f.get_u64(&key("context_length"))?.unwrap_or(2048) as usize;
        let rope_dims = f
            .get_u64(&key("rope.dimension_count"))?
            .map(|v| v as usize)
            .unwrap_or(head_dim);
        if rope_dims > head_dim || rope_dims % 2 != 0 {
            return Err(Error::Model(format!(
                "rope.dimension_count {rope_dims} does not fit head dimension {head_dim}"
            )));
        }
        let freq_base = f.get_f64(&key("rope.freq_base"))?.unwrap_or(10000.0) as f32;
        let freq_scale = rope_freq_scale(f, arch_name)?;
        // Filled in from the embedding tensor by the caller; metadata may omit it.
        let n_vocab = f.get_u64(&key("vocab_size"))?.unwrap_or(0) as usize;
        Ok(HParams {
            arch,
            n_vocab,
            n_embd,
            n_layer,
            n_head,
            n_head_kv,
            head_dim,
            n_ff,
            rms_eps,
            n_ctx_train,
            rope: RopeParams {
                n_dims: rope_dims,
                freq_base,
                freq_scale,
                neox: arch.rope_neox(),
            },
        })
    }

    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }
    pub fn kv_dim(&self) -> usize {
        self.n_head_kv * self.head_dim
    }
}

/// Linear RoPE scaling (`rope.scaling.type = linear`, or the older `rope.scale_linear`).
fn rope_freq_scale(f: &GgufFile, arch: &str) -> Result<f32> {
    let ty = f
        .get_str(&format!("{arch}.rope.scaling.type"))
        .unwrap_or("none");
    let factor = f.get_f64(&format!("{arch}.rope.scaling.factor"))?;
    let legacy = f.get_f64(&format!("{arch}.rope.scale_linear"))?;
    match ty {
        "none" => match legacy {
            Some(s) if s > 0.0 => Ok((1.0 / s) as f32),
            _ => Ok(1.0),
        },
        "linear" => match factor.or(legacy) {
            Some(s) if s > 0.0 => Ok((1.0 / s) as f32),
            _ => Ok(1.0),
        },
        other => Err(Error::Model(format!(
            "rope scaling type {other:?} is not supported"
        ))),
    }
}

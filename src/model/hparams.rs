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
    /// MiniCPM3: multi-head latent attention (low-rank q and kv projections, a RoPE key shared
    /// by the heads), NeoX RoPE on each head's trailing dimensions with LongRoPE factors, and
    /// scaled embeddings, residual branches and logits.
    MiniCpm3,
}

impl Arch {
    pub fn from_name(name: &str) -> Result<Self> {
        match name {
            "llama" => Ok(Arch::Llama),
            "qwen2" => Ok(Arch::Qwen2),
            "minicpm3" => Ok(Arch::MiniCpm3),
            other => Err(Error::Model(format!(
                "architecture {other:?} is not supported (supported: llama, qwen2, minicpm3)"
            ))),
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::MiniCpm3 => "minicpm3",
        }
    }
    /// NeoX-style RoPE rotates pairs (i, i + d/2) instead of (2i, 2i + 1).
    pub fn rope_neox(self) -> bool {
        matches!(self, Arch::Qwen2 | Arch::MiniCpm3)
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
    /// Dimensions of each head before the rotated ones (MLA rotates a head's trailing
    /// dimensions: its first `qk_nope` pass through).
    pub dim_offset: usize,
}

/// Multi-head latent attention's dimensions (MiniCPM3; llama.cpp's `n_lora_q`, `n_lora_kv`,
/// `n_rot`, `n_embd_head_k - n_rot`, `n_embd_head_v`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MlaDims {
    /// `attention.q_lora_rank`: width of the compressed query.
    pub q_lora: usize,
    /// `attention.kv_lora_rank`: width of the compressed key/value.
    pub kv_lora: usize,
    /// Per-head key/query dimensions without RoPE (`key_length - rope.dimension_count`).
    pub nope: usize,
    /// Per-head key/query dimensions with RoPE; the key's are shared by every head.
    pub rope: usize,
    /// Per-head value dimensions (`attention.value_length`, else `embedding_length / head_count`).
    pub v: usize,
}

impl MlaDims {
    /// Output width of `attn_kv_a_mqa`: the compressed key/value and the shared RoPE key.
    pub fn kv_a(&self) -> usize {
        self.kv_lora + self.rope
    }
    /// Per-head width of `attn_kv_b`'s output: the key's non-RoPE part, then the value.
    pub fn kv_b_head(&self) -> usize {
        self.nope + self.v
    }
}

/// Scalings of the residual stream (1 where an architecture has none). MiniCPM3's are fixed in
/// llama.cpp's graph, not read from metadata: `scale_emb` 12, `scale_depth` 1.4, `dim_model_base`
/// 256.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scales {
    /// Multiplies the embedding rows.
    pub embd: f32,
    /// Multiplies each attention and FFN output before it is added to the residual stream
    /// (`scale_depth / sqrt(n_layer)`).
    pub residual: f32,
    /// Multiplies the output norm's result before the head (`dim_model_base / n_embd`).
    pub logits: f32,
}

impl Scales {
    pub const NONE: Scales = Scales {
        embd: 1.0,
        residual: 1.0,
        logits: 1.0,
    };
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
    /// Multi-head latent attention (MiniCPM3); `None` for q/k/v attention.
    pub mla: Option<MlaDims>,
    pub scales: Scales,
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
        let (mla, scales) = match arch {
            Arch::MiniCpm3 => {
                let v = match f.get_u64(&key("attention.value_length"))? {
                    Some(v) => v as usize,
                    None => n_embd / n_head,
                };
                let dims = MlaDims {
                    q_lora: req("attention.q_lora_rank")?,
                    kv_lora: req("attention.kv_lora_rank")?,
                    nope: head_dim - rope_dims,
                    rope: rope_dims,
                    v,
                };
                if v == 0 || v > head_dim || rope_dims == 0 {
                    return Err(Error::Model(format!(
                        "minicpm3: value length {v} and rope dimensions {rope_dims} do not fit \
                         key length {head_dim}"
                    )));
                }
                let scales = Scales {
                    embd: 12.0,
                    residual: 1.4 / (n_layer as f32).sqrt(),
                    logits: 256.0 / n_embd as f32,
                };
                (Some(dims), scales)
            }
            _ => (None, Scales::NONE),
        };
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
                dim_offset: mla.map_or(0, |m| m.nope),
            },
            mla,
            scales,
        })
    }

    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }
    pub fn kv_dim(&self) -> usize {
        self.n_head_kv * self.head_dim
    }
    /// Width of the attention output (`attn_output`'s input): the heads' values.
    pub fn att_dim(&self) -> usize {
        self.n_head * self.mla.map_or(self.head_dim, |m| m.v)
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

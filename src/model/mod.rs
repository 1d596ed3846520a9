//! A loaded model: hyper-parameters, and every tensor the forward pass uses, checked against the
//! shapes the architecture needs. Weights stay in the GGUF memory map.

pub mod hparams;
pub mod synth;

use std::path::Path;
use std::sync::Arc;

pub use hparams::{Arch, HParams, MlaDims, RopeParams, Scales};

use crate::error::{Error, Result};
use crate::gguf::{GgufFile, TensorInfo};
use crate::quant::{GgmlType, dequantize_row};

/// A weight matrix in its GGUF format: `n` rows of `k` elements (`y = W x` maps k to n).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WeightRef {
    pub name: String,
    pub ty: GgmlType,
    /// Row length (input features).
    pub k: usize,
    /// Number of rows (output features).
    pub n: usize,
    /// Byte range in the file's data section.
    pub offset: usize,
    pub n_bytes: usize,
}

impl WeightRef {
    pub fn row_bytes(&self) -> usize {
        self.n_bytes / self.n
    }

    /// The weight's bytes in `file`'s memory map; an error when they run past its end.
    pub fn bytes<'f>(&self, file: &'f GgufFile) -> Result<&'f [u8]> {
        let start = file.data_offset as usize + self.offset;
        start
            .checked_add(self.n_bytes)
            .and_then(|end| file.bytes().get(start..end))
            .ok_or_else(|| {
                Error::Model(format!(
                    "tensor {:?} runs past the end of the file",
                    self.name
                ))
            })
    }
}

/// Kinds of a layer's target weights by slot (the tensor name's part after `blk.N.`): q/k/v
/// attention uses slots 0..7, multi-head latent attention 3..11 (its four projections in place
/// of q, k and v). The output head is slot [`N_SLOTS`].
pub const SLOT_KINDS: [&str; N_SLOTS] = [
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
    "attn_q_a",
    "attn_q_b",
    "attn_kv_a_mqa",
    "attn_kv_b",
];

/// Target weight slots per layer (see [`SLOT_KINDS`]).
pub const N_SLOTS: usize = 11;

/// Slot numbers of the target weights (see [`SLOT_KINDS`]).
pub mod slot {
    pub const Q: usize = 0;
    pub const K: usize = 1;
    pub const V: usize = 2;
    pub const O: usize = 3;
    pub const GATE: usize = 4;
    pub const UP: usize = 5;
    pub const DOWN: usize = 6;
    pub const Q_A: usize = 7;
    pub const Q_B: usize = 8;
    pub const KV_A: usize = 9;
    pub const KV_B: usize = 10;
}

/// Multi-head latent attention's tensors (MiniCPM3).
#[derive(Debug, Clone)]
pub struct MlaWeights {
    /// [n_embd] -> [q_lora]
    pub wq_a: WeightRef,
    pub q_a_norm: Vec<f32>,
    /// [q_lora] -> [n_head * (nope + rope)]
    pub wq_b: WeightRef,
    /// [n_embd] -> [kv_lora + rope]
    pub wkv_a: WeightRef,
    pub kv_a_norm: Vec<f32>,
    /// [kv_lora] -> [n_head * (nope + v)]
    pub wkv_b: WeightRef,
}

/// The tensors of one transformer block.
#[derive(Debug, Clone)]
pub struct LayerWeights {
    pub attn_norm: Vec<f32>,
    /// q/k/v projections; `None` with multi-head latent attention.
    pub wq: Option<WeightRef>,
    pub wk: Option<WeightRef>,
    pub wv: Option<WeightRef>,
    pub mla: Option<MlaWeights>,
    pub wo: WeightRef,
    pub bq: Option<Vec<f32>>,
    pub bk: Option<Vec<f32>>,
    pub bv: Option<Vec<f32>>,
    pub ffn_norm: Vec<f32>,
    pub w_gate: WeightRef,
    pub w_up: WeightRef,
    pub w_down: WeightRef,
}

impl LayerWeights {
    /// The layer's target weights with their slots, in execution order.
    pub fn targets(&self) -> Vec<(usize, &WeightRef)> {
        let mut v = Vec::with_capacity(8);
        if let Some(m) = &self.mla {
            v.extend([
                (slot::Q_A, &m.wq_a),
                (slot::KV_A, &m.wkv_a),
                (slot::Q_B, &m.wq_b),
                (slot::KV_B, &m.wkv_b),
            ]);
        }
        for (s, w) in [
            (slot::Q, &self.wq),
            (slot::K, &self.wk),
            (slot::V, &self.wv),
        ] {
            if let Some(w) = w {
                v.push((s, w));
            }
        }
        v.extend([
            (slot::O, &self.wo),
            (slot::GATE, &self.w_gate),
            (slot::UP, &self.w_up),
            (slot::DOWN, &self.w_down),
        ]);
        v
    }
}

/// A model ready to run: the open file, its hyper-parameters and its tensors.
pub struct Model {
    pub file: Arc<GgufFile>,
    pub hp: HParams,
    pub token_embd: WeightRef,
    pub output_norm: Vec<f32>,
    /// The output head: `output.weight`, or `token_embd.weight` when tied.
    pub output: WeightRef,
    pub layers: Vec<LayerWeights>,
    /// Llama 3.1 style per-dimension RoPE frequency divisors (`rope_freqs.weight`).
    pub rope_freqs: Option<Vec<f32>>,
    /// LongRoPE's divisors (`rope_factors_long.weight`, `rope_factors_short.weight`), MiniCPM3.
    pub rope_long_short: Option<(Vec<f32>, Vec<f32>)>,
}

impl Model {
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        Self::from_gguf(GgufFile::open(path)?)
    }

    pub fn from_gguf(file: GgufFile) -> Result<Self> {
        let mut hp = HParams::from_gguf(&file)?;
        let (q, kv, e, ff) = (hp.q_dim(), hp.kv_dim(), hp.n_embd, hp.n_ff);
        let token_embd = {
            let t = need(&file, "token_embd.weight")?;
            if t.dims.len() != 2 || t.dims[0] as usize != e {
                return Err(shape_err(t, &format!("[{e}, n_vocab]")));
            }
            weight_ref(t)
        };
        if hp.n_vocab != 0 && hp.n_vocab != token_embd.n {
            return Err(Error::Model(format!(
                "vocab_size {} does not match token_embd.weight's {} rows",
                hp.n_vocab, token_embd.n
            )));
        }
        hp.n_vocab = token_embd.n;
        let output = match file.tensor("output.weight") {
            Some(_) => matrix(&file, "output.weight", e, hp.n_vocab)?,
            None => token_embd.clone(),
        };
        let output_norm = vector(&file, "output_norm.weight", e)?;
        let bias = |name: &str, n: usize| -> Result<Option<Vec<f32>>> {
            match file.tensor(name) {
                Some(_) => vector(&file, name, n).map(Some),
                None => Ok(None),
            }
        };
        if let Some(m) = hp.mla
            && hp.n_head_kv != hp.n_head
        {
            return Err(Error::Model(format!(
                "minicpm3: head_count_kv {} differs from head_count {} (latent attention \
                 expands the keys to every head; v head dim {})",
                hp.n_head_kv, hp.n_head, m.v
            )));
        }
        // Not with_capacity(n_layer): block_count comes from the file (the fuzzer's 2^32 layers
        // asked for 600 GB and aborted); a layer that is not there fails at its first tensor.
        let mut layers = Vec::with_capacity(hp.n_layer.min(file.tensors.len()));
        for i in 0..hp.n_layer {
            let n = |s: &str| format!("blk.{i}.{s}");
            let (wq, wk, wv, mla) = match hp.mla {
                None => (
                    Some(matrix(&file, &n("attn_q.weight"), e, q)?),
                    Some(matrix(&file, &n("attn_k.weight"), e, kv)?),
                    Some(matrix(&file, &n("attn_v.weight"), e, kv)?),
                    None,
                ),
                Some(m) => {
                    let nh = hp.n_head;
                    let mla = MlaWeights {
                        wq_a: matrix(&file, &n("attn_q_a.weight"), e, m.q_lora)?,
                        q_a_norm: vector(&file, &n("attn_q_a_norm.weight"), m.q_lora)?,
                        wq_b: matrix(&file, &n("attn_q_b.weight"), m.q_lora, q)?,
                        wkv_a: matrix(&file, &n("attn_kv_a_mqa.weight"), e, m.kv_a())?,
                        kv_a_norm: vector(&file, &n("attn_kv_a_norm.weight"), m.kv_lora)?,
                        wkv_b: matrix(
                            &file,
                            &n("attn_kv_b.weight"),
                            m.kv_lora,
                            nh * m.kv_b_head(),
                        )?,
                    };
                    (None, None, None, Some(mla))
                }
            };
            layers.push(LayerWeights {
                attn_norm: vector(&file, &n("attn_norm.weight"), e)?,
                wq,
                wk,
                wv,
                mla,
                wo: matrix(&file, &n("attn_output.weight"), hp.att_dim(), e)?,
                bq: bias(&n("attn_q.bias"), q)?,
                bk: bias(&n("attn_k.bias"), kv)?,
                bv: bias(&n("attn_v.bias"), kv)?,
                ffn_norm: vector(&file, &n("ffn_norm.weight"), e)?,
                w_gate: matrix(&file, &n("ffn_gate.weight"), e, ff)?,
                w_up: matrix(&file, &n("ffn_up.weight"), e, ff)?,
                w_down: matrix(&file, &n("ffn_down.weight"), ff, e)?,
            });
        }
        if hp.arch == Arch::Qwen2 && layers.iter().any(|l| l.bq.is_none()) {
            return Err(Error::Model(
                "qwen2 model without attn_q.bias tensors".into(),
            ));
        }
        let rope_freqs = match file.tensor("rope_freqs.weight") {
            Some(_) => Some(vector(&file, "rope_freqs.weight", hp.rope.n_dims / 2)?),
            None => None,
        };
        let rope_long_short = match (
            file.tensor("rope_factors_long.weight"),
            file.tensor("rope_factors_short.weight"),
        ) {
            (None, None) => None,
            _ => {
                let half = hp.rope.n_dims / 2;
                Some((
                    vector(&file, "rope_factors_long.weight", half)?,
                    vector(&file, "rope_factors_short.weight", half)?,
                ))
            }
        };
        Ok(Model {
            file: Arc::new(file),
            hp,
            token_embd,
            output_norm,
            output,
            layers,
            rope_freqs,
            rope_long_short,
        })
    }
}

impl Model {
    /// The RoPE frequency divisors for a context of `n_ctx` positions: `rope_freqs`, or
    /// LongRoPE's long factors when the context exceeds the training context and its short ones
    /// otherwise (llama.cpp's `get_rope_factors`).
    pub fn rope_factors(&self, n_ctx: usize) -> Option<&[f32]> {
        if let Some(f) = &self.rope_freqs {
            return Some(f);
        }
        let (long, short) = self.rope_long_short.as_ref()?;
        Some(if n_ctx > self.hp.n_ctx_train {
            long
        } else {
            short
        })
    }
}

fn need<'a>(f: &'a GgufFile, name: &str) -> Result<&'a TensorInfo> {
    f.tensor(name)
        .ok_or_else(|| Error::Model(format!("{}: tensor {name:?} is missing", f.path.display())))
}

fn shape_err(t: &TensorInfo, want: &str) -> Error {
    Error::Model(format!(
        "tensor {:?} has shape {}, expected {want}",
        t.name,
        t.shape_string()
    ))
}

fn weight_ref(t: &TensorInfo) -> WeightRef {
    WeightRef {
        name: t.name.clone(),
        ty: t.ty,
        k: t.dims[0] as usize,
        n: t.n_rows(),
        offset: t.offset as usize,
        n_bytes: t.n_bytes as usize,
    }
}

/// A 2-D weight of `n` rows of `k`, in a type the matmul can read.
fn matrix(f: &GgufFile, name: &str, k: usize, n: usize) -> Result<WeightRef> {
    let t = need(f, name)?;
    if t.dims.len() != 2 || t.dims[0] as usize != k || t.dims[1] as usize != n {
        return Err(shape_err(t, &format!("[{k}, {n}]")));
    }
    if matches!(t.ty, GgmlType::Q8_1 | GgmlType::Q8_K | GgmlType::F64)
        || t.ty.id() >= 24 && t.ty != GgmlType::BF16
    {
        return Err(Error::UnsupportedType(format!(
            "{} as the type of weight {name:?}",
            t.ty
        )));
    }
    Ok(weight_ref(t))
}

/// A 1-D f32-convertible vector of length `n` (norm weights, biases).
fn vector(f: &GgufFile, name: &str, n: usize) -> Result<Vec<f32>> {
    let t = need(f, name)?;
    if t.n_elements as usize != n || t.dims[0] as usize != n {
        return Err(shape_err(t, &format!("[{n}]")));
    }
    let mut out = vec![0f32; n];
    dequantize_row(t.ty, f.data_of(t), &mut out)
        .map_err(|e| Error::Model(format!("tensor {name:?}: {e}")))?;
    Ok(out)
}

//! Synthetic models for timing (`oato synth`): the tensor table of LLaMA3-8B, Llama-3.2-1B,
//! QwQ-32B or MiniCPM3-4B (names, ggml shapes, and the per-tensor types llama-quantize chooses) with seeded random
//! weights and a made-up SentencePiece vocabulary of the real size, written as GGUF v3 one tensor at
//! a time. Timings on them are real; their text is not.
//!
//! Types follow llama-quantize (llama.cpp's `llama_tensor_get_type`) rather than one type for
//! every matrix, so that a synthetic file times like a quantised download:
//! - the output head (`output.weight`, or `token_embd.weight` when the embeddings are tied) is
//!   Q6_K for Q4_0 and the K-quant mixes, Q8_0 for Q8_0;
//! - Q4_K_M: `attn_v` (latent attention's `attn_kv_b`, which llama-quantize counts as one) and
//!   `ffn_down` are Q6_K in the layers [`use_more_bits`] picks, the other matrices and an untied
//!   `token_embd` Q4_K; Q5_K_M likewise with Q5_K;
//! - Q6_K: every matrix Q6_K;
//! - Q3_K_M: `attn_v` Q5_K in the first two layers and Q4_K after, `ffn_down` Q5_K in the first
//!   sixteenth of the layers and Q4_K after, `attn_output` Q4_K, the others Q3_K;
//! - Q2_K: `attn_v` Q4_K (Q3_K with fewer than four query heads per key/value head),
//!   `ffn_down` and `attn_output` Q3_K, the others Q2_K;
//! - F16, BF16: every matrix F16 (BF16), as llama.cpp's converter writes it.
//!
//! Norm weights are F32 near 1, biases F32 of spread 0.02, matrices of spread 0.02 (see
//! [`crate::quant::random`]): activations stay finite through 64 layers.

use std::path::Path;

use crate::cache::fnv1a;
use crate::error::{Error, Result};
use crate::gguf::{GgufWriter, TensorEntry, Value, ValueType};
use crate::model::{Arch, MlaDims};
use crate::quant::GgmlType;
use crate::quant::random::fill_random;
use crate::rng::SplitMix64;

/// Standard deviation of the random matrix weights (token embeddings included).
pub const WEIGHT_STD: f32 = 0.02;
/// Standard deviation of the random q/k/v biases.
pub const BIAS_STD: f32 = 0.02;

/// A model shape `oato synth` can make.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum SynthShape {
    /// Meta LLaMA3-8B (llama, untied output).
    #[value(name = "llama3-8b")]
    Llama3_8B,
    /// Meta Llama-3.2-1B (llama, tied embeddings).
    #[value(name = "llama3.2-1b")]
    Llama3_2_1B,
    /// Qwen QwQ-32B (qwen2: q/k/v biases, untied output).
    #[value(name = "qwq-32b")]
    QwQ32B,
    /// LLaMA3's structure with small dimensions, for tests.
    #[value(name = "tiny", hide = true)]
    Tiny,
    /// QwQ's structure with small dimensions, for tests.
    #[value(name = "tiny-qwen2", hide = true)]
    TinyQwen2,
    /// OpenBMB MiniCPM3-4B (minicpm3: multi-head latent attention, untied output).
    #[value(name = "minicpm3-4b")]
    MiniCpm3_4B,
    /// MiniCPM3's structure with small dimensions, for tests.
    #[value(name = "tiny-minicpm3", hide = true)]
    TinyMiniCpm3,
}

/// The hyper-parameters of a synthetic model.
#[derive(Clone, Debug, PartialEq)]
pub struct ShapeSpec {
    /// The model's name, as its makers write it.
    pub name: &'static str,
    pub arch: Arch,
    pub n_layer: usize,
    pub n_embd: usize,
    pub n_ff: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub n_vocab: usize,
    /// `{arch}.context_length`.
    pub n_ctx: usize,
    pub rope_base: f32,
    pub rms_eps: f32,
    /// No `output.weight`: the head reads `token_embd.weight`.
    pub tied: bool,
    /// Multi-head latent attention's dimensions (MiniCPM3; `head_dim` is then nope + rope).
    pub mla: Option<MlaDims>,
}

impl SynthShape {
    pub fn spec(self) -> ShapeSpec {
        let llama3 = ShapeSpec {
            name: "LLaMA3-8B",
            arch: Arch::Llama,
            n_layer: 32,
            n_embd: 4096,
            n_ff: 14336,
            n_head: 32,
            n_head_kv: 8,
            head_dim: 128,
            n_vocab: 128256,
            n_ctx: 8192,
            rope_base: 500000.0,
            rms_eps: 1e-5,
            tied: false,
            mla: None,
        };
        let qwq = ShapeSpec {
            name: "QwQ-32B",
            arch: Arch::Qwen2,
            n_layer: 64,
            n_embd: 5120,
            n_ff: 27648,
            n_head: 40,
            n_head_kv: 8,
            head_dim: 128,
            n_vocab: 152064,
            n_ctx: 32768,
            rope_base: 1000000.0,
            ..llama3
        };
        // Small enough to write and run in milliseconds; rows stay whole K-quant blocks (256).
        // llama.cpp's loader and converter (conversion/minicpm.py): 62 layers, q_lora_rank 768,
        // kv_lora_rank 256, qk_nope 64 + qk_rope 32 = key_length 96, value head 2560 / 40 = 64.
        let minicpm3 = ShapeSpec {
            name: "MiniCPM3-4B",
            arch: Arch::MiniCpm3,
            n_layer: 62,
            n_embd: 2560,
            n_ff: 6400,
            n_head: 40,
            n_head_kv: 40,
            head_dim: 96,
            n_vocab: 73448,
            n_ctx: 32768,
            rope_base: 10000.0,
            mla: Some(MlaDims {
                q_lora: 768,
                kv_lora: 256,
                nope: 64,
                rope: 32,
                v: 64,
            }),
            ..llama3.clone()
        };
        let tiny = ShapeSpec {
            n_layer: 2,
            n_embd: 256,
            n_ff: 512,
            n_head: 4,
            n_head_kv: 2,
            head_dim: 64,
            n_vocab: 512,
            n_ctx: 2048,
            ..llama3.clone()
        };
        match self {
            SynthShape::Llama3_8B => llama3,
            SynthShape::Llama3_2_1B => ShapeSpec {
                name: "Llama-3.2-1B",
                n_layer: 16,
                n_embd: 2048,
                n_ff: 8192,
                head_dim: 64,
                tied: true,
                ..llama3
            },
            SynthShape::QwQ32B => qwq,
            SynthShape::Tiny => ShapeSpec {
                name: "tiny-llama",
                ..tiny
            },
            SynthShape::TinyQwen2 => ShapeSpec {
                name: "tiny-qwen2",
                arch: Arch::Qwen2,
                rope_base: qwq.rope_base,
                ..tiny
            },
            SynthShape::MiniCpm3_4B => minicpm3,
            // Latent ranks of a whole K-quant block (256) each, as the real model's are.
            SynthShape::TinyMiniCpm3 => ShapeSpec {
                name: "tiny-minicpm3",
                n_head_kv: 4,
                head_dim: 96,
                mla: Some(MlaDims {
                    q_lora: 256,
                    kv_lora: 256,
                    nope: 64,
                    rope: 32,
                    v: 64,
                }),
                ..minicpm3.with_dims_of(&tiny)
            },
        }
    }
}

impl ShapeSpec {
    /// This architecture with `small`'s sizes (layers, widths, heads, vocabulary, context).
    fn with_dims_of(self, small: &ShapeSpec) -> ShapeSpec {
        ShapeSpec {
            n_layer: small.n_layer,
            n_embd: small.n_embd,
            n_ff: small.n_ff,
            n_head: small.n_head,
            n_vocab: small.n_vocab,
            n_ctx: small.n_ctx,
            ..self
        }
    }

    /// Query and key/value widths of the q/k/v projections (latent attention: of the expanded
    /// heads).
    fn q_kv(&self) -> (usize, usize) {
        (self.n_head * self.head_dim, self.n_head_kv * self.head_dim)
    }
}

/// The quantisation `oato synth` can make, named as llama-quantize names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
#[allow(non_camel_case_types)]
pub enum SynthType {
    #[value(name = "Q2_K")]
    Q2_K,
    #[value(name = "Q3_K_M")]
    Q3_K_M,
    #[value(name = "Q4_0")]
    Q4_0,
    #[value(name = "Q4_K_M")]
    Q4_K_M,
    #[value(name = "Q5_K_M")]
    Q5_K_M,
    #[value(name = "Q6_K")]
    Q6_K,
    #[value(name = "IQ4_NL")]
    IQ4_NL,
    #[value(name = "IQ4_XS")]
    IQ4_XS,
    #[value(name = "Q8_0")]
    Q8_0,
    #[value(name = "F16")]
    F16,
    #[value(name = "BF16")]
    BF16,
}

/// What a matrix is for, as far as llama-quantize's type choice goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Matrix {
    TokenEmbd,
    Output,
    AttnQ,
    AttnK,
    AttnV,
    AttnOutput,
    FfnGate,
    FfnUp,
    FfnDown,
    /// Latent attention's projections; llama-quantize counts `attn_kv_b` as an `attn_v`.
    AttnQA,
    AttnQB,
    AttnKvA,
    AttnKvB,
}

/// llama-quantize's "use more bits" layers: the first and last eighth, and every third in between.
pub fn use_more_bits(layer: usize, n_layer: usize) -> bool {
    layer < n_layer / 8 || layer >= 7 * n_layer / 8 || (layer - n_layer / 8) % 3 == 2
}

impl SynthType {
    pub fn name(self) -> &'static str {
        match self {
            SynthType::Q2_K => "Q2_K",
            SynthType::Q3_K_M => "Q3_K_M",
            SynthType::Q4_0 => "Q4_0",
            SynthType::Q4_K_M => "Q4_K_M",
            SynthType::Q5_K_M => "Q5_K_M",
            SynthType::Q6_K => "Q6_K",
            SynthType::IQ4_NL => "IQ4_NL",
            SynthType::IQ4_XS => "IQ4_XS",
            SynthType::Q8_0 => "Q8_0",
            SynthType::F16 => "F16",
            SynthType::BF16 => "BF16",
        }
    }

    /// llama.cpp's `llama_ftype` number, for `general.file_type`.
    pub fn file_type(self) -> u32 {
        match self {
            SynthType::Q2_K => 10,
            SynthType::Q3_K_M => 12,
            SynthType::Q4_0 => 2,
            SynthType::Q4_K_M => 15,
            SynthType::Q5_K_M => 17,
            SynthType::Q6_K => 18,
            SynthType::IQ4_NL => 25,
            SynthType::IQ4_XS => 30,
            SynthType::Q8_0 => 7,
            SynthType::F16 => 1,
            SynthType::BF16 => 32,
        }
    }

    /// The type llama-quantize gives matrix `m` of layer `layer` (of `n_layer`); `tied` when the
    /// token embeddings are also the output head; `gqa` query heads per key/value head.
    pub fn matrix_type(
        self,
        m: Matrix,
        layer: usize,
        n_layer: usize,
        tied: bool,
        gqa: usize,
    ) -> GgmlType {
        use GgmlType::*;
        let head = m == Matrix::Output || (tied && m == Matrix::TokenEmbd);
        let attn_v = matches!(m, Matrix::AttnV | Matrix::AttnKvB);
        let more = use_more_bits(layer, n_layer);
        match self {
            SynthType::F16 => F16,
            SynthType::BF16 => BF16,
            SynthType::Q8_0 => Q8_0,
            _ if head => Q6_K,
            SynthType::Q4_0 => Q4_0,
            SynthType::Q6_K => Q6_K,
            SynthType::Q2_K => match m {
                _ if attn_v && gqa >= 4 => Q4_K,
                _ if attn_v => Q3_K,
                Matrix::FfnDown | Matrix::AttnOutput => Q3_K,
                _ => Q2_K,
            },
            SynthType::Q3_K_M => match m {
                _ if attn_v && layer < 2 => Q5_K,
                _ if attn_v => Q4_K,
                Matrix::FfnDown if layer < n_layer / 16 => Q5_K,
                Matrix::FfnDown | Matrix::AttnOutput => Q4_K,
                _ => Q3_K,
            },
            SynthType::Q4_K_M if (attn_v || m == Matrix::FfnDown) && more => Q6_K,
            SynthType::Q4_K_M => Q4_K,
            SynthType::Q5_K_M if (attn_v || m == Matrix::FfnDown) && more => Q6_K,
            SynthType::Q5_K_M => Q5_K,
            // Without an importance matrix, as `oato synth` has none.
            SynthType::IQ4_NL | SynthType::IQ4_XS => match m {
                _ if attn_v && gqa >= 4 => Q5_K,
                Matrix::FfnDown if layer < n_layer / 8 => Q5_K,
                _ if self == SynthType::IQ4_NL => IQ4_NL,
                _ => IQ4_XS,
            },
        }
    }
}

/// How a tensor's values are made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fill {
    /// Random, spread [`WEIGHT_STD`].
    Weights,
    /// 1 ± 0.1, uniform.
    Norm,
    /// Random, spread [`BIAS_STD`].
    Bias,
}

/// One tensor of a synthetic model.
#[derive(Clone, Debug, PartialEq)]
pub struct SynthTensor {
    pub entry: TensorEntry,
    pub ty: GgmlType,
    pub fill: Fill,
}

impl SynthTensor {
    fn new(name: &str, dims: &[usize], ty: GgmlType, fill: Fill) -> Result<Self> {
        let dims: Vec<u64> = dims.iter().map(|&d| d as u64).collect();
        Ok(SynthTensor {
            entry: TensorEntry::new(name, &dims, ty)?,
            ty,
            fill,
        })
    }
}

/// Every tensor of `spec` quantised as `ty`, in the order llama.cpp's converter writes them per
/// layer, with ggml dims (row length first).
pub fn tensor_table(spec: &ShapeSpec, ty: SynthType) -> Result<Vec<SynthTensor>> {
    let (e, ff, n) = (spec.n_embd, spec.n_ff, spec.n_layer);
    let (q, kv) = spec.q_kv();
    let matrix = |name: &str, m: Matrix, layer: usize, k: usize, rows: usize| {
        let t = ty.matrix_type(m, layer, n, spec.tied, spec.n_head / spec.n_head_kv.max(1));
        SynthTensor::new(name, &[k, rows], t, Fill::Weights)
    };
    let vector =
        |name: &str, len: usize, fill: Fill| SynthTensor::new(name, &[len], GgmlType::F32, fill);
    let mut out = Vec::with_capacity(n * 12 + 5);
    // LongRoPE's factors (the converter writes them first, from the config's rope_scaling).
    if let Some(m) = spec.mla {
        for name in ["rope_factors_long.weight", "rope_factors_short.weight"] {
            out.push(vector(name, m.rope / 2, Fill::Norm)?);
        }
    }
    out.push(matrix(
        "token_embd.weight",
        Matrix::TokenEmbd,
        0,
        e,
        spec.n_vocab,
    )?);
    let biases = spec.arch == Arch::Qwen2;
    for i in 0..n {
        let name = |s: &str| format!("blk.{i}.{s}");
        out.push(vector(&name("attn_norm.weight"), e, Fill::Norm)?);
        let att = match spec.mla {
            Some(m) => {
                out.extend([
                    matrix(&name("attn_q_a.weight"), Matrix::AttnQA, i, e, m.q_lora)?,
                    vector(&name("attn_q_a_norm.weight"), m.q_lora, Fill::Norm)?,
                    matrix(&name("attn_q_b.weight"), Matrix::AttnQB, i, m.q_lora, q)?,
                    matrix(
                        &name("attn_kv_a_mqa.weight"),
                        Matrix::AttnKvA,
                        i,
                        e,
                        m.kv_a(),
                    )?,
                    vector(&name("attn_kv_a_norm.weight"), m.kv_lora, Fill::Norm)?,
                    matrix(
                        &name("attn_kv_b.weight"),
                        Matrix::AttnKvB,
                        i,
                        m.kv_lora,
                        spec.n_head * m.kv_b_head(),
                    )?,
                ]);
                spec.n_head * m.v
            }
            None => {
                for (proj, m, rows) in [
                    ("attn_q", Matrix::AttnQ, q),
                    ("attn_k", Matrix::AttnK, kv),
                    ("attn_v", Matrix::AttnV, kv),
                ] {
                    out.push(matrix(&name(&format!("{proj}.weight")), m, i, e, rows)?);
                    if biases {
                        out.push(vector(&name(&format!("{proj}.bias")), rows, Fill::Bias)?);
                    }
                }
                q
            }
        };
        out.push(matrix(
            &name("attn_output.weight"),
            Matrix::AttnOutput,
            i,
            att,
            e,
        )?);
        out.push(vector(&name("ffn_norm.weight"), e, Fill::Norm)?);
        out.push(matrix(&name("ffn_gate.weight"), Matrix::FfnGate, i, e, ff)?);
        out.push(matrix(&name("ffn_up.weight"), Matrix::FfnUp, i, e, ff)?);
        out.push(matrix(&name("ffn_down.weight"), Matrix::FfnDown, i, ff, e)?);
    }
    out.push(vector("output_norm.weight", e, Fill::Norm)?);
    if !spec.tied {
        out.push(matrix("output.weight", Matrix::Output, n, e, spec.n_vocab)?);
    }
    Ok(out)
}

/// Token ids of the synthetic vocabulary's special tokens.
pub const UNK_ID: u32 = 0;
pub const BOS_ID: u32 = 1;
pub const EOS_ID: u32 = 2;
/// Ids before the first ordinary piece: `<unk>`, `<s>`, `</s>` and the 256 byte tokens.
const FIRST_PIECE: usize = 3 + 256;

/// A SentencePiece-style vocabulary of `n` tokens: `<unk>`, `<s>`, `</s>`, the byte tokens
/// `<0x00>`..`<0xFF>`, then distinct pieces `▁w259`, `▁w260`, … of falling score. As arrays for
/// `tokenizer.ggml.tokens`, `.scores` and `.token_type`.
fn vocabulary(n: usize) -> Result<[Value; 3]> {
    if n <= FIRST_PIECE {
        return Err(Error::Usage(format!(
            "a vocabulary of {n} tokens is too small: the special and byte tokens take {FIRST_PIECE}"
        )));
    }
    let (mut texts, mut scores, mut types) = (
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
    );
    // llama.cpp's token types: 1 normal, 2 unknown, 3 control, 6 byte.
    for (text, ty) in [("<unk>", 2), ("<s>", 3), ("</s>", 3)] {
        texts.push(Value::String(text.into()));
        scores.push(Value::F32(0.0));
        types.push(Value::I32(ty));
    }
    for b in 0..256 {
        texts.push(Value::String(format!("<0x{b:02X}>")));
        scores.push(Value::F32(0.0));
        types.push(Value::I32(6));
    }
    for i in FIRST_PIECE..n {
        texts.push(Value::String(format!("▁w{i}")));
        scores.push(Value::F32(-((i - FIRST_PIECE) as f32)));
        types.push(Value::I32(1));
    }
    Ok([
        Value::Array(ValueType::String, texts),
        Value::Array(ValueType::F32, scores),
        Value::Array(ValueType::I32, types),
    ])
}

/// A writer holding the metadata llama.cpp and oato need for `spec` as `ty`.
pub fn metadata(spec: &ShapeSpec, ty: SynthType, seed: u64) -> Result<GgufWriter> {
    let mut w = GgufWriter::new();
    let arch = spec.arch.name();
    let u32_of = |what: &str, v: usize| {
        u32::try_from(v)
            .map(Value::U32)
            .map_err(|_| Error::Usage(format!("{what} {v} does not fit a GGUF u32")))
    };
    w.set("general.architecture", Value::String(arch.into()))
        .set(
            "general.name",
            Value::String(format!(
                "{} {} (oato synth, seed {seed}, random weights)",
                spec.name,
                ty.name()
            )),
        )
        .set("general.file_type", Value::U32(ty.file_type()))
        .set("general.quantization_version", Value::U32(2))
        .set("general.alignment", Value::U32(32));
    for (key, v) in [
        ("context_length", spec.n_ctx),
        ("embedding_length", spec.n_embd),
        ("block_count", spec.n_layer),
        ("feed_forward_length", spec.n_ff),
        ("attention.head_count", spec.n_head),
        ("attention.head_count_kv", spec.n_head_kv),
        (
            "rope.dimension_count",
            spec.mla.map_or(spec.head_dim, |m| m.rope),
        ),
        ("vocab_size", spec.n_vocab),
    ] {
        w.set(&format!("{arch}.{key}"), u32_of(key, v)?);
    }
    // Latent attention as llama.cpp's converter writes it: the ranks and the key length (no
    // value_length: the value head is n_embd / n_head).
    if let Some(m) = spec.mla {
        for (key, v) in [
            ("attention.q_lora_rank", m.q_lora),
            ("attention.kv_lora_rank", m.kv_lora),
            ("attention.key_length", spec.head_dim),
        ] {
            w.set(&format!("{arch}.{key}"), u32_of(key, v)?);
        }
    }
    w.set(
        &format!("{arch}.attention.layer_norm_rms_epsilon"),
        Value::F32(spec.rms_eps),
    )
    .set(
        &format!("{arch}.rope.freq_base"),
        Value::F32(spec.rope_base),
    );
    let [tokens, scores, types] = vocabulary(spec.n_vocab)?;
    w.set("tokenizer.ggml.model", Value::String("llama".into()))
        .set("tokenizer.ggml.tokens", tokens)
        .set("tokenizer.ggml.scores", scores)
        .set("tokenizer.ggml.token_type", types)
        .set("tokenizer.ggml.unknown_token_id", Value::U32(UNK_ID))
        .set("tokenizer.ggml.bos_token_id", Value::U32(BOS_ID))
        .set("tokenizer.ggml.eos_token_id", Value::U32(EOS_ID))
        .set("tokenizer.ggml.add_bos_token", Value::Bool(true))
        .set("tokenizer.ggml.add_eos_token", Value::Bool(false));
    Ok(w)
}

/// Fills `out` with tensor `t`'s bytes on `threads` threads. Row `r` draws from its own generator,
/// seeded by `seed`, the tensor's name and `r`, so the bytes do not depend on the thread count.
pub fn fill_tensor(t: &SynthTensor, seed: u64, out: &mut [u8], threads: usize) -> Result<()> {
    let row_bytes = t.ty.row_bytes(t.entry.dims[0] as usize)?;
    if row_bytes == 0 || out.len() as u64 != t.entry.n_bytes {
        return Err(Error::Msg(format!(
            "tensor {:?}: {} bytes given for {}",
            t.entry.name,
            out.len(),
            t.entry.n_bytes
        )));
    }
    let base = seed ^ fnv1a(&[t.entry.name.as_bytes()]);
    let n_rows = out.len() / row_bytes;
    let rows_per_thread = n_rows.div_ceil(threads.max(1));
    let fill_rows = |first_row: usize, chunk: &mut [u8]| -> Result<()> {
        for (r, row) in chunk.chunks_mut(row_bytes).enumerate() {
            let mut rng =
                SplitMix64::new(SplitMix64::new(base ^ (first_row + r) as u64).next_u64());
            match t.fill {
                Fill::Weights => fill_random(t.ty, WEIGHT_STD, &mut rng, row)?,
                Fill::Bias => fill_random(t.ty, BIAS_STD, &mut rng, row)?,
                Fill::Norm => {
                    for c in row.as_chunks_mut::<4>().0 {
                        *c = (0.9 + 0.2 * rng.next_f32()).to_le_bytes();
                    }
                }
            }
        }
        Ok(())
    };
    std::thread::scope(|s| {
        let handles: Vec<_> = out
            .chunks_mut(rows_per_thread * row_bytes)
            .enumerate()
            .map(|(i, chunk)| s.spawn(move || fill_rows(i * rows_per_thread, chunk)))
            .collect();
        handles.into_iter().try_for_each(|h| {
            h.join().map_err(|_| {
                Error::Msg(format!(
                    "tensor {:?}: a generator thread panicked",
                    t.entry.name
                ))
            })?
        })
    })
}

/// What [`write_synth`] wrote.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SynthSummary {
    pub tensors: usize,
    /// Weights, norms and biases: elements over all tensors.
    pub params: u64,
    /// The file's size.
    pub bytes: u64,
}

/// Writes the synthetic model `spec` as `ty` with weights from `seed` to `path`, one tensor in
/// memory at a time, generating each on `threads` threads.
pub fn write_synth(
    path: &Path,
    spec: &ShapeSpec,
    ty: SynthType,
    seed: u64,
    threads: usize,
) -> Result<SynthSummary> {
    let tensors = tensor_table(spec, ty)?;
    let w = metadata(spec, ty, seed)?;
    let entries: Vec<TensorEntry> = tensors.iter().map(|t| t.entry.clone()).collect();
    let bytes = w.write_streamed(path, &entries, |i, buf| {
        fill_tensor(&tensors[i], seed, buf, threads)
    })?;
    Ok(SynthSummary {
        tensors: tensors.len(),
        params: entries.iter().map(|t| t.dims.iter().product::<u64>()).sum(),
        bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn more_bits_layers_are_llama_quantizes() {
        // 32 layers: the first 4, the last 4, and 6, 9, …, 27.
        let picked: Vec<usize> = (0..32).filter(|&i| use_more_bits(i, 32)).collect();
        assert_eq!(
            picked,
            [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
        );
        assert_eq!((0..64).filter(|&i| use_more_bits(i, 64)).count(), 32);
        // One layer: 7 * 1 / 8 = 0, so layer 0 is in the last eighth.
        assert!(use_more_bits(0, 1));
    }

    #[test]
    fn vocabulary_has_the_special_and_byte_tokens_where_the_metadata_says() {
        let [tokens, _, types] = vocabulary(300).unwrap();
        let (Value::Array(_, tokens), Value::Array(_, types)) = (tokens, types) else {
            panic!("arrays")
        };
        assert_eq!(tokens.len(), 300);
        assert_eq!(tokens[BOS_ID as usize], Value::String("<s>".into()));
        assert_eq!(tokens[EOS_ID as usize], Value::String("</s>".into()));
        assert_eq!(tokens[3 + 0x0A], Value::String("<0x0A>".into()));
        assert_eq!(types[3 + 0xFF], Value::I32(6));
        assert_eq!(tokens[299], Value::String("▁w299".into()));
        assert!(vocabulary(259).is_err());
    }

    #[test]
    fn filled_bytes_do_not_depend_on_the_thread_count() {
        let spec = SynthShape::Tiny.spec();
        let table = tensor_table(&spec, SynthType::Q4_K_M).unwrap();
        let t = table
            .iter()
            .find(|t| t.entry.name == "blk.1.ffn_down.weight")
            .unwrap();
        let fill = |threads| {
            let mut b = vec![0u8; t.entry.n_bytes as usize];
            fill_tensor(t, 42, &mut b, threads).unwrap();
            b
        };
        let one = fill(1);
        assert_eq!(fill(3), one);
        assert_ne!(one, vec![0u8; one.len()]);
        let mut short = vec![0u8; 10];
        assert!(fill_tensor(t, 42, &mut short, 1).is_err());
    }
}

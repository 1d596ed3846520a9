//! `oato synth --shape S --type T [--seed N] -o FILE.gguf`: a GGUF file with a real model's tensor
//! table and seeded random weights, for timing (see `oato::model::synth`).

use std::path::PathBuf;
use std::time::Instant;

use clap::Args;

use oato::error::Result;
use oato::model::synth::{SynthShape, SynthType, write_synth};
use oato::scheduler::mib;

#[derive(Args)]
pub struct SynthArgs {
    /// The model whose tensor names, shapes and types to copy.
    #[arg(long, value_enum)]
    pub shape: SynthShape,
    /// Quantisation, with llama-quantize's per-tensor mix (Q4_K_M: Q6_K attn_v / ffn_down in some
    /// layers; Q4_0, Q4_K_M: Q6_K output head).
    #[arg(long = "type", value_name = "TYPE", value_enum, ignore_case = true)]
    pub ty: SynthType,
    /// Seed of the random weights: the same seed gives the same file.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Number of transformer blocks instead of the shape's own.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub layers: Option<u32>,
    /// Threads generating the weights (0: all cores).
    #[arg(short = 't', long, default_value_t = 0)]
    pub threads: usize,
    /// Where to write the GGUF file.
    #[arg(short = 'o', long)]
    pub output: PathBuf,
}

pub fn run(a: SynthArgs) -> Result<()> {
    let mut spec = a.shape.spec();
    if let Some(n) = a.layers {
        spec.n_layer = n as usize;
    }
    let threads = match a.threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    let t0 = Instant::now();
    let sum = write_synth(&a.output, &spec, a.ty, a.seed, threads)?;
    let secs = t0.elapsed().as_secs_f64();
    eprintln!(
        "synth: wrote {}: {} ({}, {} layers, n_embd {}, n_ff {}, {}/{} heads, vocab {}), {}, seed \
         {}, {} tensors, {:.1}M params, {} bytes ({}) in {secs:.1} s ({:.2} GB/s, {threads} \
         threads)",
        a.output.display(),
        spec.name,
        spec.arch.name(),
        spec.n_layer,
        spec.n_embd,
        spec.n_ff,
        spec.n_head,
        spec.n_head_kv,
        spec.n_vocab,
        a.ty.name(),
        a.seed,
        sum.tensors,
        sum.params as f64 / 1e6,
        sum.bytes,
        mib(sum.bytes),
        sum.bytes as f64 / secs.max(1e-9) / 1e9,
    );
    Ok(())
}

//! The options `run`, `chat` and `serve` share: where the model goes (the whole model on a
//! device, a VRAM budget, a placement file) and how tokens are sampled.

use std::path::PathBuf;

use clap::Args;

use oato::engine::{PlaceOptions, Split};
use oato::error::{Error, Result};
use oato::runtime::sampler::SamplerConfig;
use oato::scheduler::Policy;

/// Where the model runs.
#[derive(Args, Clone, Debug)]
pub struct PlaceArgs {
    /// Run the whole model on the CPU, the GPU, or the GPU when there is one (auto); with
    /// --vram-budget or --placement, the GPU the placement uses.
    #[arg(long, value_enum, default_value = "auto")]
    pub device: super::DeviceArg,
    /// Split the model between the CPU and the GPU under this much GPU memory (bytes with a
    /// binary unit, 12G, or a share of the target weights, 75%): profile (or reuse the cached
    /// profile), plan, place, run.
    #[arg(long = "vram-budget", conflicts_with = "placement", group = "split_by")]
    pub vram_budget: Option<String>,
    /// llama.cpp's -ngl, counted as llama.cpp counts it: the output head and the last N-1 layers on
    /// the GPU (99: everything), the rest on the CPU, without a profile or plan. Prefill batches of
    /// 32 tokens or more multiply the CPU's weights on the GPU, as llama.cpp's op offload does
    /// (--no-stream: never; --stream-min-tokens: from another batch size).
    #[arg(
        long = "n-gpu-layers",
        visible_alias = "ngl",
        value_name = "N",
        conflicts_with_all = ["placement", "vram_budget"],
        group = "split_by"
    )]
    pub n_gpu_layers: Option<usize>,
    /// Placement policy for --vram-budget.
    #[arg(long, value_enum, default_value = "oato", requires = "vram_budget")]
    pub policy: Policy,
    /// Run with this placement file (oato.placement/v1) instead of planning one.
    #[arg(long)]
    pub placement: Option<PathBuf>,
    /// No prefill streaming (rule 5) with --vram-budget or -ngl: CPU-resident weights compute on
    /// the CPU in prefill too.
    #[arg(long = "no-stream", requires = "split_by")]
    pub no_stream: bool,
    /// Stream the placement's prefill operators (rule 5) for batches of at least this many
    /// tokens (default: the placement's, derived from the profile).
    #[arg(long = "stream-min-tokens", value_name = "N")]
    pub stream_min_tokens: Option<usize>,
    /// Re-profile even when a cached profile exists (with --vram-budget).
    #[arg(long = "force-profile", requires = "vram_budget")]
    pub force_profile: bool,
    #[command(flatten)]
    pub load: super::LoadArgs,
}

impl PlaceArgs {
    /// The split these flags ask for.
    pub fn split(&self) -> Split {
        if let Some(n) = self.n_gpu_layers {
            return Split::Layers {
                n,
                stream_min_tokens: (!self.no_stream).then_some(oato::engine::OP_OFFLOAD_MIN_BATCH),
            };
        }
        match (&self.placement, &self.vram_budget) {
            (Some(f), _) => Split::File(f.clone()),
            (None, Some(budget)) => Split::Budget {
                budget: budget.clone(),
                policy: self.policy,
                stream: !self.no_stream,
                force_profile: self.force_profile,
            },
            (None, None) => Split::Whole,
        }
    }

    /// The engine's placement options: a plan for `prompt_tokens` then `gen_tokens` in `ctx`.
    pub fn options(
        &self,
        threads: usize,
        ctx: usize,
        prompt_tokens: usize,
        gen_tokens: usize,
    ) -> PlaceOptions {
        PlaceOptions {
            split: self.split(),
            threads,
            ctx,
            seqs: 1,
            prompt_tokens,
            gen_tokens,
            stream_min_tokens: self.stream_min_tokens,
        }
    }
}

/// How tokens are sampled (llama.cpp's defaults).
#[derive(Args, Clone, Debug)]
pub struct SamplingArgs {
    /// Temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.8, allow_negative_numbers = true)]
    pub temp: f32,
    #[arg(long = "top-k", default_value_t = 40)]
    pub top_k: usize,
    #[arg(long = "top-p", default_value_t = 0.95)]
    pub top_p: f32,
    #[arg(long = "min-p", default_value_t = 0.05)]
    pub min_p: f32,
    #[arg(long = "repeat-penalty", default_value_t = 1.0)]
    pub repeat_penalty: f32,
    #[arg(long = "repeat-last-n", default_value_t = 64)]
    pub repeat_last_n: usize,
    /// Random seed for sampling.
    #[arg(short = 's', long, default_value_t = 0x5EED)]
    pub seed: u64,
}

impl SamplingArgs {
    /// The sampler's settings, or an error naming the flag out of range.
    pub fn config(&self) -> Result<SamplerConfig> {
        let cfg = SamplerConfig {
            temperature: self.temp,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            repeat_last_n: self.repeat_last_n,
            seed: self.seed,
        };
        cfg.check().map_err(|e| {
            let flag = match e.field {
                "temperature" => "temp".to_string(),
                f => f.replace('_', "-"),
            };
            Error::Usage(format!(
                "sampling setting out of range: --{flag} {} (must be {})",
                e.value, e.range
            ))
        })?;
        Ok(cfg)
    }
}

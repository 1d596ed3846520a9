//! `oato plan --profile P --vram-budget B [--policy …] [-o placement.json] [--llama-ot]`: the
//! scheduler on a profile file alone; prints the placement table and writes the placement.

use std::path::PathBuf;

use clap::Args;

use oato::error::{Error, Result};
use oato::profiler::profile::Profile;
use oato::scheduler::{
    DEFAULT_CTX_TOKENS, DEFAULT_GEN_TOKENS, DEFAULT_PROMPT_TOKENS, PlanRequest, Policy, llama_ot,
    parse_budget, plan, render_table,
};

#[derive(Args)]
pub struct PlanArgs {
    /// The profile (oato.profile/v1) from `oato profile`.
    #[arg(long)]
    pub profile: PathBuf,
    /// GPU memory to use: bytes with a binary unit (12G, 800M) or a share of the model's target
    /// weights (75%).
    #[arg(long = "vram-budget")]
    pub vram_budget: String,
    /// How the weights are placed.
    #[arg(long, value_enum, default_value = "oato")]
    pub policy: Policy,
    /// Workload: prompt tokens (prefill batch).
    #[arg(long = "prompt-tokens", default_value_t = DEFAULT_PROMPT_TOKENS)]
    pub prompt_tokens: usize,
    /// Workload: generated tokens.
    #[arg(long = "gen-tokens", default_value_t = DEFAULT_GEN_TOKENS)]
    pub gen_tokens: usize,
    /// Context the KV cache is reserved for.
    #[arg(long = "ctx", default_value_t = DEFAULT_CTX_TOKENS)]
    pub ctx: usize,
    /// Where to write the placement.
    #[arg(short = 'o', long, default_value = "placement.json")]
    pub output: PathBuf,
    /// Also print the placement as llama.cpp arguments (-ngl 999 -ot "regex=CPU").
    #[arg(long = "llama-ot")]
    pub llama_ot: bool,
    /// No prefill streaming (rule 5): CPU-resident weights compute on the CPU in prefill too.
    #[arg(long = "no-stream")]
    pub no_stream: bool,
}

pub fn run(a: PlanArgs) -> Result<()> {
    let text = std::fs::read_to_string(&a.profile).map_err(|e| Error::io(&a.profile, e))?;
    let profile = Profile::from_json(&text, &a.profile.display().to_string())?;
    let req = PlanRequest {
        policy: a.policy,
        budget: parse_budget(&a.vram_budget)?,
        prompt_tokens: a.prompt_tokens,
        gen_tokens: a.gen_tokens,
        ctx_tokens: a.ctx,
        stream: !a.no_stream,
    };
    let p = plan(&profile, &req)?;
    print!("{}", render_table(&p));
    if a.llama_ot {
        println!("llama.cpp: {}", llama_ot(&p));
        if !p.prefill_stream.is_empty() {
            println!(
                "llama.cpp has no per-operator streaming choice: the {} operators this plan \
                 streams in prefill stay resident on the CPU there (its op offload copies every \
                 CPU weight for batches of 32 tokens or more)",
                p.prefill_stream.len()
            );
        }
    }
    std::fs::write(&a.output, p.to_json()?).map_err(|e| Error::io(&a.output, e))?;
    eprintln!("wrote {}", a.output.display());
    Ok(())
}

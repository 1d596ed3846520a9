//! `oato run [MODEL] -p PROMPT`: load, generate with streaming, report timings.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use clap::Args;
use serde_json::json;

use oato::error::{Error, Result};
use oato::model::Model;
use std::sync::Arc;

use oato::placer::{check, device_map};
use oato::profiler::{ProfileOptions, load_or_profile};
use oato::runtime::backend::Backend;
use oato::runtime::forward::{DeviceMap, Logits, Session, target_weights};
use oato::runtime::generate::{Utf8Stream, generate};
use oato::runtime::sampler::{Sampler, SamplerConfig};
use oato::scheduler::{Placement, PlanRequest, Policy, mib, parse_budget, plan};
use oato::tokenizer::Tokenizer;
use oato::tokenizer::chat::{ChatMessage, render_chat};

#[derive(Args)]
pub struct RunArgs {
    /// GGUF model (default: models/SmolLM2-135M-Instruct.Q4_1.gguf, or $OATO_MODEL).
    pub model: Option<PathBuf>,
    /// Prompt text.
    #[arg(short, long)]
    pub prompt: Option<String>,
    /// Read the prompt from a file.
    #[arg(short = 'f', long, conflicts_with = "prompt")]
    pub file: Option<PathBuf>,
    /// Tokens to generate.
    #[arg(short = 'n', long = "n-predict", default_value_t = 128)]
    pub n_predict: usize,
    /// Context size in tokens (prompt + generated).
    #[arg(short = 'c', long = "ctx", default_value_t = 4096)]
    pub ctx: usize,
    /// Threads (0: all cores).
    #[arg(short = 't', long, default_value_t = 0)]
    pub threads: usize,
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
    /// Wrap the prompt in the model's own chat template (tokenizer.chat_template).
    #[arg(long)]
    pub chat: bool,
    /// System message for --chat.
    #[arg(long, requires = "chat")]
    pub system: Option<String>,
    /// Keep generating past end-of-generation tokens.
    #[arg(long = "ignore-eos")]
    pub ignore_eos: bool,
    /// Print one JSON object (ids, text, timings) instead of streaming the text.
    #[arg(long)]
    pub json: bool,
    /// Use exactly this many prompt tokens: the encoded prompt cut, or repeated (after its
    /// first token) until it is long enough; for timing at a fixed prompt length.
    #[arg(long = "prompt-tokens")]
    pub prompt_tokens: Option<usize>,
    /// Run the whole model on the CPU, the GPU, or the GPU when there is one (auto); with
    /// --vram-budget or --placement, the GPU the placement uses.
    #[arg(long, value_enum, default_value = "auto")]
    pub device: super::DeviceArg,
    /// Split the model between the CPU and the GPU under this much GPU memory (bytes with a
    /// binary unit, 12G, or a share of the target weights, 75%): profile (or reuse the cached
    /// profile), plan, place, run.
    #[arg(long = "vram-budget", conflicts_with = "placement")]
    pub vram_budget: Option<String>,
    /// Placement policy for --vram-budget.
    #[arg(long, value_enum, default_value = "oato", requires = "vram_budget")]
    pub policy: Policy,
    /// Run with this placement file (oato.placement/v1) instead of planning one.
    #[arg(long)]
    pub placement: Option<PathBuf>,
    /// No prefill streaming (rule 5) with --vram-budget: CPU-resident weights compute on the
    /// CPU in prefill too.
    #[arg(long = "no-stream", requires = "vram_budget")]
    pub no_stream: bool,
    /// Stream the placement's prefill operators (rule 5) for batches of at least this many
    /// tokens (default: the placement's, derived from the profile).
    #[arg(long = "stream-min-tokens", value_name = "N")]
    pub stream_min_tokens: Option<usize>,
    /// Run the prompt in micro-batches of at most this many tokens, one after the other (0: the
    /// whole prompt as one batch). Each micro-batch streams the prefill weights again (rule 5).
    #[arg(long = "ubatch", default_value_t = 0, value_name = "N")]
    pub ubatch: usize,
    /// Re-profile even when a cached profile exists (with --vram-budget).
    #[arg(long = "force-profile", requires = "vram_budget")]
    pub force_profile: bool,
}

/// The device map for --vram-budget (profile or cached profile, plan) or --placement (read),
/// checked against the model and the GPU's free memory.
fn placed_map(
    a: &RunArgs,
    model: &Model,
    path: &std::path::Path,
    backends: &[Arc<dyn Backend>],
    dev: usize,
    threads: usize,
    prompt_tokens: usize,
) -> Result<(DeviceMap, Placement)> {
    let gpu = (dev != 0).then(|| &*backends[dev]);
    let placement = match (&a.placement, &a.vram_budget) {
        (Some(f), _) => {
            let text = std::fs::read_to_string(f).map_err(|e| Error::io(f, e))?;
            Placement::from_json(&text, &f.display().to_string())?
        }
        (None, Some(budget)) => {
            let req = PlanRequest {
                policy: a.policy,
                budget: parse_budget(budget)?,
                prompt_tokens,
                gen_tokens: a.n_predict,
                ctx_tokens: a.ctx,
                stream: !a.no_stream,
            };
            let opts = ProfileOptions::for_prompt(prompt_tokens);
            let name = super::file_name(path);
            let (prof, cached) =
                load_or_profile(model, &name, &*backends[0], gpu, threads, &opts, false)?;
            eprintln!(
                "profile: {} ({} operators, {:.1} s)",
                if cached { "cached" } else { "measured" },
                prof.operators.len(),
                prof.profiling_s
            );
            plan(&prof, &req)?
        }
        (None, None) => return Err(Error::Usage("no placement to apply".into())),
    };
    let free = match gpu {
        Some(g) => Ok(g.memory()?.free as u64),
        None => Err(
            "none is usable here (see above); plan with --policy cpu to run without one"
                .to_string(),
        ),
    };
    let s = check(&placement, model, free)?;
    let b = &placement.budget;
    eprintln!(
        "plan: {} policy, {} of weights for the GPU ({}/{} operators), budget {}, reserved {}, cap {}, predicted TTFT {:.1} ms, TPOT {:.2} ms",
        placement.policy,
        mib(s.gpu_weight_bytes),
        s.gpu_ops,
        s.ops,
        mib(b.vram_budget_bytes),
        mib(b.reserved_bytes),
        mib(b.cap_bytes),
        placement.predicted.ttft_ms,
        placement.predicted.tpot_ms
    );
    if !placement.prefill_stream.is_empty() {
        eprintln!(
            "plan: {} CPU-resident operators streamed to the GPU for prompt batches of {} tokens \
             or more ({} reserved for two layers of them)",
            placement.prefill_stream.len(),
            a.stream_min_tokens
                .or(placement.stream_min_tokens)
                .map_or("no".to_string(), |n| n.to_string()),
            mib(b.stream_bytes)
        );
    }
    let mut map = device_map(&placement, model, 0, dev);
    if let Some(n) = a.stream_min_tokens {
        map.stream_min_tokens = n;
    }
    Ok((map, placement))
}

/// The model's weight type as results name it: the most common type among its target weights.
fn model_dtype(model: &Model) -> String {
    let mut count: std::collections::BTreeMap<&str, usize> = Default::default();
    for w in target_weights(model) {
        *count.entry(w.ty.name()).or_default() += w.n_bytes;
    }
    count
        .into_iter()
        .max_by_key(|&(_, n)| n)
        .map(|(t, _)| t.to_string())
        .unwrap_or_default()
}

pub fn run(a: RunArgs) -> Result<()> {
    let path = super::model_path(a.model.clone())?;
    let threads = super::init_threads(a.threads)?;
    let prompt = match (&a.prompt, &a.file) {
        (Some(p), _) => p.clone(),
        (None, Some(f)) => std::fs::read_to_string(f).map_err(|e| Error::io(f, e))?,
        (None, None) => return Err(Error::Usage("give a prompt with -p TEXT or -f FILE".into())),
    };
    if a.temp.is_nan()
        || a.temp < 0.0
        || a.top_p <= 0.0
        || a.top_p > 1.0
        || a.min_p < 0.0
        || a.min_p > 1.0
        || a.repeat_penalty <= 0.0
    {
        return Err(Error::Usage(format!(
            "sampling settings out of range: --temp {} (>= 0), --top-p {} (0..1], --min-p {} [0..1], --repeat-penalty {} (> 0)",
            a.temp, a.top_p, a.min_p, a.repeat_penalty
        )));
    }

    let (mut backends, mut dev) = super::open_backends(a.device)?;
    let t_load = Instant::now();
    let model = Model::open(&path)?;
    let tokenizer = Tokenizer::from_gguf(&model.file)?;
    let text = if a.chat {
        let template = model
            .file
            .get_str("tokenizer.chat_template")
            .ok_or_else(|| {
                Error::Template(format!(
                    "{} has no tokenizer.chat_template; run without --chat",
                    path.display()
                ))
            })?;
        let mut messages = Vec::new();
        if let Some(s) = &a.system {
            messages.push(ChatMessage {
                role: "system".into(),
                content: s.clone(),
            });
        }
        messages.push(ChatMessage {
            role: "user".into(),
            content: prompt.clone(),
        });
        let name = |id: Option<u32>| {
            id.and_then(|i| tokenizer.token_text(i))
                .unwrap_or("")
                .to_string()
        };
        render_chat(
            template,
            &messages,
            true,
            &name(tokenizer.bos()),
            &name(tokenizer.eos()),
        )?
    } else {
        prompt
    };
    let mut prompt_ids = tokenizer.encode(&text, true, true)?;
    if prompt_ids.is_empty() {
        return Err(Error::Usage("the prompt encodes to no tokens".into()));
    }
    if let Some(want) = a.prompt_tokens {
        if want == 0 {
            return Err(Error::Usage("--prompt-tokens must be at least 1".into()));
        }
        let body: Vec<u32> = if prompt_ids.len() > 1 {
            prompt_ids[1..].to_vec()
        } else {
            prompt_ids.clone()
        };
        while prompt_ids.len() < want {
            let more = want - prompt_ids.len();
            prompt_ids.extend(body.iter().take(more));
        }
        prompt_ids.truncate(want);
    }
    let ctx = a.ctx.max(1);
    if prompt_ids.len() + a.n_predict > ctx {
        return Err(Error::Usage(format!(
            "prompt ({} tokens) + -n {} exceed --ctx {ctx}",
            prompt_ids.len(),
            a.n_predict
        )));
    }
    // The whole model on the GPU only when it fits; auto falls back to the CPU, saying why.
    if dev != 0
        && a.vram_budget.is_none()
        && a.placement.is_none()
        && let Err(why) = super::fits_whole(&model, ctx, prompt_ids.len(), &*backends[dev])
    {
        if a.device == super::DeviceArg::Gpu {
            return Err(Error::Usage(format!(
                "--device gpu: {why}; split it with --vram-budget"
            )));
        }
        eprintln!("oato: {why}; running on the CPU (split it with --vram-budget)");
        backends.truncate(1);
        dev = 0;
    }
    let device = backends[dev].describe();
    let (map, placement) = if a.vram_budget.is_some() || a.placement.is_some() {
        let (m, p) = placed_map(&a, &model, &path, &backends, dev, threads, prompt_ids.len())?;
        (m, Some(p))
    } else {
        (DeviceMap::uniform(&model, dev), None)
    };
    let mut session = Session::with_devices(&model, ctx, backends.clone(), &map)?;
    session.ubatch = a.ubatch;
    if a.vram_budget.is_some() || a.placement.is_some() {
        let u = backends[dev].usage();
        eprintln!(
            "placement: {:.1} MiB of weights on {}, {}/{} operators there, {} crossings in the \
             prefill, {} per decode step",
            u.weights as f64 / (1u64 << 20) as f64,
            backends[dev].describe(),
            map.weights
                .values()
                .filter(|&&d| d == dev && dev != 0)
                .count(),
            map.weights.len(),
            map.crossings(&model, 0, prompt_ids.len()),
            map.crossings(&model, 0, 1)
        );
    }
    // Warm-up: the whole prompt, so the timed prefill pays no page faults, buffer growth or
    // first-GEMM set-up (DESIGN.md: TTFT starts with the engine warmed up).
    session.forward(&prompt_ids, Logits::Last)?;
    session.reset();
    let load_ms = t_load.elapsed().as_secs_f64() * 1e3;

    let mut sampler = Sampler::new(SamplerConfig {
        temperature: a.temp,
        top_k: a.top_k,
        top_p: a.top_p,
        min_p: a.min_p,
        repeat_penalty: a.repeat_penalty,
        repeat_last_n: a.repeat_last_n,
        seed: a.seed,
    });
    let mut stream = Utf8Stream::default();
    let mut stdout = std::io::stdout().lock();
    let json = a.json;
    let g = generate(
        &mut session,
        &tokenizer,
        a.ignore_eos,
        &mut sampler,
        &prompt_ids,
        a.n_predict,
        |b| {
            if !json {
                let _ = write!(stdout, "{}", stream.push(b));
                let _ = stdout.flush();
            }
        },
    )?;
    if !json {
        let _ = writeln!(stdout, "{}", stream.finish());
    }
    drop(stdout);

    let model_name = super::file_name(&path);
    let targets = target_weights(&model);
    let target_bytes: u64 = targets.iter().map(|w| w.n_bytes as u64).sum();
    // Weights resident on the GPU (streamed ones are not).
    let gpu_weight_bytes: u64 = targets
        .iter()
        .filter(|w| dev != 0 && map.weights.get(&w.name) == Some(&dev))
        .filter(|w| !map.streamed.contains(&w.name))
        .map(|w| w.n_bytes as u64)
        .sum();
    if json {
        let out = json!({
            "model": model_name,
            "threads": threads,
            "device": device,
            "host_cpu": oato::kernels::cpu::cpu_name(),
            "model_dtype": model_dtype(&model),
            "policy": placement.as_ref().map_or(
                if dev == 0 { "cpu" } else { "gpu" }.to_string(),
                |p| p.policy.to_string()
            ),
            "vram_budget_bytes": placement.as_ref().map_or(0, |p| p.budget.vram_budget_bytes),
            "gpu_weight_bytes": gpu_weight_bytes,
            "target_weight_bytes": target_bytes,
            "prompt_ids": g.prompt_ids,
            "output_ids": g.output_ids,
            "text": g.text,
            "stopped_on_eog": g.stopped_on_eog,
            "load_ms": load_ms,
            "ttft_ms": g.ttft_ms,
            "tpot_ms": g.tpot_ms,
            "e2e_ms": g.e2e_ms,
            "prompt_tokens_per_s": g.prompt_tps(),
            "predicted_ttft_ms": placement.as_ref().map(|p| p.predicted.ttft_ms),
            "predicted_tpot_ms": placement.as_ref().map(|p| p.predicted.tpot_ms),
            "crossings_prefill": map.crossings(&model, 0, g.prompt_ids.len()),
            "crossings_decode": map.crossings(&model, 0, 1),
            "gen_tokens_per_s": g.decode_tps(),
        });
        println!(
            "{}",
            serde_json::to_string_pretty(&out).expect("JSON values serialise")
        );
    } else {
        eprintln!();
        eprintln!(
            "model:   {model_name} ({}, {} layers), {threads} threads, {device}",
            model.hp.arch.name(),
            model.hp.n_layer
        );
        eprintln!("load:    {load_ms:.1} ms");
        eprintln!(
            "prompt:  {} tokens, TTFT {:.2} ms ({:.1} tokens/s)",
            g.prompt_ids.len(),
            g.ttft_ms,
            g.prompt_tps()
        );
        eprintln!(
            "decode:  {} tokens, TPOT {:.2} ms ({:.1} tokens/s), e2e {:.1} ms{}",
            g.output_ids.len(),
            g.tpot_ms,
            g.decode_tps(),
            g.e2e_ms,
            if g.stopped_on_eog {
                ", stopped on end-of-generation"
            } else {
                ""
            }
        );
    }
    Ok(())
}

//! `oato run [MODEL] -p PROMPT`: load, generate with streaming, report timings.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use clap::Args;
use serde_json::json;

use oato::engine::{Engine, Opened};
use oato::error::{Error, Result};
use oato::model::Model;
use oato::runtime::forward::{Logits, target_weights};
use oato::runtime::generate::{Utf8Stream, generate};
use oato::runtime::sampler::Sampler;
use oato::tokenizer::chat::ChatMessage;

#[derive(Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub model: super::ModelArg,
    /// Prompt text.
    #[arg(short, long)]
    pub prompt: Option<String>,
    /// Read the prompt from a file.
    #[arg(short = 'f', long, conflicts_with = "prompt")]
    pub file: Option<PathBuf>,
    /// Tokens to generate.
    #[arg(short = 'n', long = "n-predict", default_value_t = 128)]
    pub n_predict: usize,
    /// Context size in tokens (prompt + generated; 0: the model's training context).
    #[arg(short = 'c', long = "ctx", default_value_t = 4096)]
    pub ctx: usize,
    /// Threads (0: all cores).
    #[arg(short = 't', long, default_value_t = 0)]
    pub threads: usize,
    #[command(flatten)]
    pub sampling: super::options::SamplingArgs,
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
    #[command(flatten)]
    pub place: super::options::PlaceArgs,
    /// Run the prompt in micro-batches of at most this many tokens, one after the other (0: the
    /// whole prompt as one batch). Each micro-batch streams the prefill weights again (rule 5).
    #[arg(long = "ubatch", default_value_t = 0, value_name = "N")]
    pub ubatch: usize,
    /// Skip the warm-up run of the whole prompt before the timed one (llama.cpp's
    /// --no-warmup): the first token's time then includes first-use costs (page faults, buffer
    /// growth, the first GEMM's set-up).
    #[arg(long = "no-warmup")]
    pub no_warmup: bool,
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
    let path = a.model.path()?;
    let threads = super::init_threads(a.threads)?;
    a.place.load.apply();
    let prompt = match (&a.prompt, &a.file) {
        (Some(p), _) => p.clone(),
        (None, Some(f)) => std::fs::read_to_string(f).map_err(|e| Error::io(f, e))?,
        (None, None) => return Err(Error::Usage("give a prompt with -p TEXT or -f FILE".into())),
    };
    let sampling = a.sampling.config()?;

    let t_load = Instant::now();
    let opened = Opened::open(&path, a.place.device)?;
    let (model, tokenizer) = (&opened.model, &opened.tokenizer);
    let text = if a.chat {
        let mut messages = Vec::new();
        if let Some(s) = &a.system {
            messages.push(ChatMessage::new("system", s.clone()));
        }
        messages.push(ChatMessage::new("user", prompt.clone()));
        opened.render_chat(&messages)?
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
    let ctx = super::ctx_or_model(a.ctx, &model.hp);
    if prompt_ids.len() + a.n_predict > ctx {
        return Err(Error::Usage(format!(
            "prompt ({} tokens) + -n {} exceed --ctx {ctx}",
            prompt_ids.len(),
            a.n_predict
        )));
    }
    let engine = opened.place(&a.place.options(threads, ctx, prompt_ids.len(), a.n_predict))?;
    let policy = engine.policy_name();
    let Engine {
        backends,
        dev,
        map,
        placement,
        gpu_layers,
        mut session,
    } = engine;
    let device = backends[dev].describe();
    session.ubatch = a.ubatch;
    if placement.is_some() || gpu_layers.is_some() {
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
            map.crossings(model, 0, prompt_ids.len()),
            map.crossings(model, 0, 1)
        );
    }
    // Warm-up: the whole prompt, so the timed prefill pays no page faults, buffer growth or
    // first-GEMM set-up (DESIGN.md: TTFT starts with the engine warmed up).
    if !a.no_warmup {
        session.forward(&prompt_ids, Logits::Last)?;
        session.reset();
    }
    let load_ms = t_load.elapsed().as_secs_f64() * 1e3;

    let mut sampler = Sampler::new(sampling);
    let mut stream = Utf8Stream::default();
    let mut stdout = std::io::stdout().lock();
    let json = a.json;
    let g = generate(
        &mut session,
        tokenizer,
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
    let targets = target_weights(model);
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
            "model_dtype": model_dtype(model),
            "policy": policy,
            "vram_budget_bytes": placement.as_ref().map_or(0, |p| p.budget.vram_budget_bytes),
            "gpu_weight_bytes": gpu_weight_bytes,
            "target_weight_bytes": target_bytes,
            "prompt_ids": g.prompt_ids,
            "output_ids": g.output_ids,
            "text": g.text,
            "stopped_on_eog": g.stopped_on_eog,
            "load_ms": load_ms,
            "warmup": !a.no_warmup,
            "ttft_ms": g.ttft_ms,
            "tpot_ms": g.tpot_ms,
            "e2e_ms": g.e2e_ms,
            "prompt_tokens_per_s": g.prompt_tps(),
            "predicted_ttft_ms": placement.as_ref().map(|p| p.predicted.ttft_ms),
            "predicted_tpot_ms": placement.as_ref().map(|p| p.predicted.tpot_ms),
            "crossings_prefill": map.crossings(model, 0, g.prompt_ids.len()),
            "crossings_decode": map.crossings(model, 0, 1),
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

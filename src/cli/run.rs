//! `oato run [MODEL] -p PROMPT`: load, generate with streaming, report timings.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use clap::Args;
use serde_json::json;

use oato::error::{Error, Result};
use oato::model::Model;
use oato::runtime::forward::{DeviceMap, Logits, Session};
use oato::runtime::generate::{Utf8Stream, generate};
use oato::runtime::sampler::{Sampler, SamplerConfig};
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
    /// Run the whole model on the CPU, the GPU, or the GPU when there is one (auto).
    #[arg(long, value_enum, default_value = "auto")]
    pub device: super::DeviceArg,
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

    let (backends, dev) = super::open_backends(a.device)?;
    let device = backends[dev].describe();
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
    let prompt_ids = tokenizer.encode(&text, true, true)?;
    if prompt_ids.is_empty() {
        return Err(Error::Usage("the prompt encodes to no tokens".into()));
    }
    let ctx = a.ctx.max(1);
    if prompt_ids.len() + a.n_predict > ctx {
        return Err(Error::Usage(format!(
            "prompt ({} tokens) + -n {} exceed --ctx {ctx}",
            prompt_ids.len(),
            a.n_predict
        )));
    }
    let map = DeviceMap::uniform(&model, dev);
    let mut session = Session::with_devices(&model, ctx, backends, &map)?;
    // Warm-up: one token through every layer, so the first timed step does not pay page faults.
    session.forward(&prompt_ids[..1], Logits::Last)?;
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

    let model_name = path
        .file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    if json {
        let out = json!({
            "model": model_name,
            "threads": threads,
            "device": device,
            "prompt_ids": g.prompt_ids,
            "output_ids": g.output_ids,
            "text": g.text,
            "stopped_on_eog": g.stopped_on_eog,
            "load_ms": load_ms,
            "ttft_ms": g.ttft_ms,
            "tpot_ms": g.tpot_ms,
            "e2e_ms": g.e2e_ms,
            "prompt_tokens_per_s": g.prompt_tps(),
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

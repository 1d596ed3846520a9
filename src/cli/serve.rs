//! `oato serve [MODEL]`: the OpenAI-compatible HTTP server (see `oato::server`).

use clap::Args;

use oato::error::{Error, Result};
use oato::server::worker::EngineSpec;
use oato::server::{ServeConfig, serve};

#[derive(Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: super::ModelArg,
    /// Address to listen on (loopback by default; 0.0.0.0 exposes the server to the network).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: a free one; the address is printed on stdout).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Context size in tokens (prompt + generated) of each request (0: the model's training
    /// context).
    #[arg(short = 'c', long = "ctx", default_value_t = 4096)]
    pub ctx: usize,
    /// Requests that generate at once, decoding together in one batch (llama-server's -np,
    /// Ollama's OLLAMA_NUM_PARALLEL); each has its own KV cache of --ctx tokens. 1: one at a
    /// time.
    #[arg(long = "parallel", visible_alias = "np", default_value_t = 4)]
    pub parallel: usize,
    /// Threads (0: all cores).
    #[arg(short = 't', long, default_value_t = 0)]
    pub threads: usize,
    /// Requests that may wait while --parallel run; more are refused with 503 and Retry-After.
    #[arg(long, default_value_t = 64)]
    pub queue: usize,
    /// Prefill prompts in pieces of at most this many tokens: between two decode steps each
    /// prompt still prefilling runs one piece, so long prompts hold the others up by at most
    /// one piece each (llama-server's -ub; 0: each prompt at once).
    #[arg(long = "ubatch", default_value_t = 512, value_name = "N")]
    pub ubatch: usize,
    /// Seconds a refused client is told to wait (Retry-After).
    #[arg(long = "retry-after", default_value_t = 1)]
    pub retry_after: u64,
    /// The prompt length the plan is made for (with --vram-budget).
    #[arg(long = "plan-prompt-tokens", default_value_t = 512)]
    pub plan_prompt_tokens: usize,
    #[command(flatten)]
    pub place: super::options::PlaceArgs,
}

pub fn run(a: ServeArgs) -> Result<()> {
    let path = a.model.path()?;
    let threads = super::init_threads(a.threads)?;
    a.place.load.apply();
    // 0: the model's training context, read from the file's metadata (the workers load it).
    let ctx = match a.ctx {
        0 => super::ctx_or_model(
            0,
            &oato::model::HParams::from_gguf(&oato::gguf::GgufFile::open(&path)?)?,
        ),
        c => c,
    };
    if ctx < 2 {
        return Err(Error::Usage(format!("--ctx {ctx}: give at least 2 tokens")));
    }
    if a.parallel == 0 {
        return Err(Error::Usage(
            "--parallel 0: give at least 1 request at a time".into(),
        ));
    }
    let prompt = a.plan_prompt_tokens.clamp(1, ctx - 1);
    let mut place = a
        .place
        .options(threads, ctx, prompt, (ctx - prompt).min(128));
    place.seqs = a.parallel;
    let engine = EngineSpec {
        ubatch: a.ubatch,
        path: path.clone(),
        device: a.place.device,
        place,
    };
    serve(ServeConfig {
        engine,
        model_name: super::file_name(&path),
        host: a.host,
        port: a.port,
        queue: a.queue,
        retry_after_s: a.retry_after,
    })
}

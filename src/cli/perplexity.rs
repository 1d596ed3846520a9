//! `oato perplexity [MODEL] -f TEXT [--ctx 512]`.

use std::path::PathBuf;

use clap::Args;

use oato::error::{Error, Result};
use oato::model::Model;
use oato::runtime::forward::Session;
use oato::runtime::perplexity::perplexity;
use oato::tokenizer::Tokenizer;

#[derive(Args)]
pub struct PerplexityArgs {
    #[command(flatten)]
    pub model: super::ModelArg,
    /// Text file to score.
    #[arg(short = 'f', long)]
    pub file: PathBuf,
    /// Window size in tokens; the second half of each window is scored (0: the model's training
    /// context).
    #[arg(short = 'c', long = "ctx", default_value_t = 512)]
    pub ctx: usize,
    /// Threads (0: all cores).
    #[arg(short = 't', long, default_value_t = 0)]
    pub threads: usize,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub load: super::LoadArgs,
}

pub fn run(a: PerplexityArgs) -> Result<()> {
    let path = a.model.path()?;
    super::init_threads(a.threads)?;
    a.load.apply();
    let text = std::fs::read_to_string(&a.file).map_err(|e| Error::io(&a.file, e))?;
    let model = Model::open(&path)?;
    let tokenizer = Tokenizer::from_gguf(&model.file)?;
    let tokens = tokenizer.encode(&text, true, false)?;
    let bos = if tokenizer.add_bos() {
        tokenizer.bos()
    } else {
        None
    };
    let ctx = super::ctx_or_model(a.ctx, &model.hp);
    let mut session = Session::new(&model, ctx)?;
    let t0 = std::time::Instant::now();
    let p = perplexity(&mut session, &tokens, ctx, bos)?;
    let secs = t0.elapsed().as_secs_f64();
    if a.json {
        let mut v = serde_json::to_value(&p).expect("JSON values serialise");
        v["seconds"] = serde_json::json!(secs);
        println!(
            "{}",
            serde_json::to_string_pretty(&v).expect("JSON values serialise")
        );
    } else {
        for (i, r) in p.per_window.iter().enumerate() {
            eprint!("[{}]{:.4},", i + 1, r);
        }
        eprintln!();
        println!(
            "Final estimate: PPL = {:.4} +/- {:.5}  ({} tokens, {} windows of {}, {} scored, {:.1} s)",
            p.ppl, p.stderr, p.tokens, p.windows, p.n_ctx, p.scored, secs
        );
    }
    Ok(())
}

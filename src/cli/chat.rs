//! `oato chat [MODEL]`: a conversation in the terminal. Each turn is rendered with the model's
//! chat template over the whole history, and only the tokens the session's cache does not hold
//! yet are run (the earlier turns' keys and values are reused). Answers stream; Ctrl-C stops an
//! answer and keeps the conversation; `/bye` or the end of input leaves.

use std::io::{BufRead, IsTerminal, Write};
use std::sync::atomic::{AtomicBool, Ordering};

use clap::Args;

use oato::engine::Opened;
use oato::error::{Error, Result};
use oato::runtime::generate::{CachedTokens, Finish, Utf8Stream, generate_cached};
use oato::runtime::sampler::Sampler;
use oato::tokenizer::chat::ChatMessage;

#[derive(Args)]
pub struct ChatArgs {
    #[command(flatten)]
    pub model: super::ModelArg,
    /// System message.
    #[arg(long)]
    pub system: Option<String>,
    /// Most tokens per answer (0: until the context is full).
    #[arg(short = 'n', long = "n-predict", default_value_t = 512)]
    pub n_predict: usize,
    /// Context size in tokens: the whole conversation must fit (0: the model's training context).
    #[arg(short = 'c', long = "ctx", default_value_t = 4096)]
    pub ctx: usize,
    /// Threads (0: all cores).
    #[arg(short = 't', long, default_value_t = 0)]
    pub threads: usize,
    /// After each answer, one line on stderr: the turn's prompt tokens, how many were reused
    /// from the cache and how many were computed, and the tokens generated.
    #[arg(short = 'v', long)]
    pub verbose: bool,
    /// Keep generating past end-of-generation tokens (for tests of Ctrl-C and a full context).
    #[arg(long = "ignore-eos", hide = true)]
    pub ignore_eos: bool,
    #[command(flatten)]
    pub sampling: super::options::SamplingArgs,
    #[command(flatten)]
    pub place: super::options::PlaceArgs,
}

/// Set by Ctrl-C while an answer is generated: stop it.
static STOP: AtomicBool = AtomicBool::new(false);
/// A turn is being answered or reported (Ctrl-C stops the answer rather than printing the hint).
static ANSWERING: AtomicBool = AtomicBool::new(false);

#[cfg(unix)]
extern "C" fn on_sigint(_: libc::c_int) {
    if ANSWERING.load(Ordering::SeqCst) {
        STOP.store(true, Ordering::SeqCst);
    } else {
        const HINT: &[u8] = b"\n(Ctrl-C stops an answer; /bye or Ctrl-D leaves)\n";
        // SAFETY: write(2) is async-signal-safe and HINT outlives the call.
        unsafe { libc::write(2, HINT.as_ptr().cast(), HINT.len()) };
    }
}

/// Ctrl-C stops an answer; at the prompt it says how to leave (as `ollama run` does).
fn catch_ctrl_c() {
    #[cfg(unix)]
    // SAFETY: the handler only touches atomics and calls write(2), both async-signal-safe.
    unsafe {
        libc::signal(
            libc::SIGINT,
            on_sigint as extern "C" fn(libc::c_int) as libc::sighandler_t,
        );
    }
}

pub fn run(a: ChatArgs) -> Result<()> {
    let path = a.model.path()?;
    let threads = super::init_threads(a.threads)?;
    a.place.load.apply();
    let sampling = a.sampling.config()?;
    let opened = Opened::open(&path, a.place.device)?;
    let ctx = super::ctx_or_model(a.ctx, &opened.model.hp).max(2);
    let mut messages = Vec::new();
    if let Some(s) = &a.system {
        messages.push(ChatMessage::new("system", s.clone()));
    }
    // Fails early, before loading weights, when the model has no template.
    opened.render_chat(&[ChatMessage::new("user", "")])?;
    let plan_prompt = 512.min(ctx - 1);
    let engine = opened.place(&a.place.options(threads, ctx, plan_prompt, 128))?;
    let device = engine.backends[engine.dev].describe();
    let mut session = engine.session;
    let tokenizer = &opened.tokenizer;
    let interactive = std::io::stdin().is_terminal();
    eprintln!(
        "oato chat: {} on {device}, context {ctx} tokens. /bye or Ctrl-D leaves, Ctrl-C stops \
         an answer, /clear forgets the conversation.",
        super::file_name(&path)
    );
    catch_ctrl_c();
    let mut sampler = Sampler::new(sampling);
    let mut cached = CachedTokens::default();
    let mut stdout = std::io::stdout();
    let mut stdin = std::io::stdin().lock();
    let mut turn = 0;
    loop {
        if interactive {
            let _ = write!(stdout, ">>> ");
            let _ = stdout.flush();
        }
        let mut line = String::new();
        match stdin.read_line(&mut line) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) => return Err(Error::Msg(format!("reading standard input: {e}"))),
        }
        let line = line.trim();
        match line {
            "" => continue,
            "/bye" | "/exit" | "/quit" => break,
            "/clear" => {
                messages.truncate(usize::from(a.system.is_some()));
                eprintln!("(conversation cleared)");
                continue;
            }
            _ => {}
        }
        messages.push(ChatMessage::new("user", line));
        let ids = tokenizer.encode(&opened.render_chat(&messages)?, true, true)?;
        if ids.len() >= ctx {
            messages.pop();
            eprintln!(
                "oato: the context is full: this turn would make the conversation {} tokens, \
                 --ctx is {ctx}. /clear starts over (or restart with a larger --ctx).",
                ids.len()
            );
            continue;
        }
        turn += 1;
        let room = ctx - ids.len();
        let n = if a.n_predict == 0 {
            room
        } else {
            a.n_predict.min(room)
        };
        let mut utf8 = Utf8Stream::default();
        STOP.store(false, Ordering::SeqCst);
        ANSWERING.store(true, Ordering::SeqCst);
        let g = generate_cached(
            &mut session,
            tokenizer,
            a.ignore_eos,
            &mut sampler,
            &mut cached,
            &ids,
            n,
            |b| {
                let _ = write!(stdout, "{}", utf8.push(b));
                let _ = stdout.flush();
                !STOP.load(Ordering::SeqCst)
            },
        );
        let g = g?;
        let _ = writeln!(stdout, "{}", utf8.finish());
        let _ = stdout.flush();
        match g.finish {
            Finish::Stopped => eprintln!("(answer stopped)"),
            Finish::ContextFull => eprintln!(
                "oato: the context is full ({ctx} tokens): the answer was cut. /clear starts \
                 over (or restart with a larger --ctx)."
            ),
            Finish::Length if n < a.n_predict || a.n_predict == 0 => eprintln!(
                "oato: the context is full ({ctx} tokens): the answer was cut. /clear starts \
                 over (or restart with a larger --ctx)."
            ),
            _ => {}
        }
        if a.verbose {
            eprintln!(
                "turn {turn}: prompt {} tokens ({} reused from the cache, {} computed), {} \
                 generated, TTFT {:.1} ms, {:.1} tokens/s",
                ids.len(),
                g.cached_tokens,
                ids.len() - g.cached_tokens,
                g.output_ids.len(),
                g.ttft_ms,
                g.decode_tps()
            );
        }
        // Only now back at the prompt: a Ctrl-C before this point sets STOP (cleared when the
        // next answer starts) instead of writing the hint into the middle of the lines above.
        ANSWERING.store(false, Ordering::SeqCst);
        messages.push(ChatMessage::new("assistant", g.text));
    }
    Ok(())
}

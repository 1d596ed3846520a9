//! The engine thread: opens and places the model once, then runs the queued requests one after
//! the other on its session, keeping the cache's tokens so that a request that starts as the
//! previous one did (a shared system prompt, a conversation's earlier turns) runs only the rest.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Receiver;
use std::time::Instant;

use tokio::sync::mpsc::UnboundedSender;

use crate::engine::DeviceChoice;
use crate::engine::{Opened, PlaceOptions};
use crate::error::Result;
use crate::runtime::generate::{CachedTokens, Finish, Utf8Stream, generate_cached};
use crate::runtime::sampler::{Sampler, SamplerConfig};
use crate::tokenizer::chat::ChatMessage;

use super::metrics::{Metrics, PlacementSummary};
use super::stop::StopFilter;

/// What a request asks to continue.
#[derive(Debug, Clone)]
pub enum Prompt {
    /// Chat messages, rendered with the model's template.
    Chat(Vec<ChatMessage>),
    /// Text, tokenised as it is.
    Text(String),
}

/// A request waiting for the engine.
pub struct Job {
    pub prompt: Prompt,
    pub sampling: SamplerConfig,
    /// At most this many tokens; `None`: until the context is full.
    pub max_tokens: Option<usize>,
    pub stop: Vec<String>,
    /// Keep generating past end-of-generation tokens.
    pub ignore_eos: bool,
    /// Set when the client has gone: the generation stops at its next token.
    pub cancel: Arc<AtomicBool>,
    pub events: UnboundedSender<Event>,
    pub enqueued: Instant,
}

/// What the engine tells a waiting request, in order: `Started` (or `Rejected`), then `Text`
/// pieces, then `Done` (or `Failed`).
#[derive(Debug)]
pub enum Event {
    Started {
        prompt_tokens: usize,
    },
    /// The request cannot run: its prompt and `max_tokens` do not fit the context, or the
    /// template rejected the messages. An invalid-request error with the reason.
    Rejected {
        message: String,
        param: Option<&'static str>,
        code: Option<&'static str>,
    },
    Text(String),
    Done(Outcome),
    Failed(String),
}

/// How a finished request went.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub finish: Finish,
    /// A stop string ended it.
    pub stopped_by_string: bool,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub cached_tokens: usize,
}

impl Outcome {
    /// OpenAI's `finish_reason`.
    pub fn finish_reason(&self) -> &'static str {
        match self.finish {
            Finish::Eog => "stop",
            Finish::Stopped if self.stopped_by_string => "stop",
            Finish::Stopped => "cancelled",
            Finish::Length | Finish::ContextFull => "length",
        }
    }
}

/// What the engine thread needs to open the model.
pub struct EngineSpec {
    pub path: std::path::PathBuf,
    pub device: DeviceChoice,
    pub place: PlaceOptions,
}

/// Opens and places the model (reporting `ready` to `metrics`), then serves `jobs` until every
/// sender is gone; once `shutdown` is set, the running generation stops and the waiting jobs
/// fail. An error when the model cannot be opened or placed.
pub fn run(
    spec: EngineSpec,
    jobs: Receiver<Job>,
    metrics: Arc<Metrics>,
    shutdown: Arc<AtomicBool>,
) -> Result<()> {
    let opened = Opened::open(&spec.path, spec.device)?;
    let engine = opened.place(&spec.place)?;
    let mut session = engine.session;
    let dev = engine.dev;
    let gpu = (dev != 0).then(|| engine.backends[dev].clone());
    let placement = PlacementSummary {
        device: engine.backends[dev].describe(),
        policy: engine
            .placement
            .as_ref()
            .map_or(if dev == 0 { "cpu" } else { "gpu" }.to_string(), |p| {
                p.policy.to_string()
            }),
        gpu_weights: engine
            .map
            .weights
            .values()
            .filter(|&&d| d == dev && dev != 0)
            .count(),
        weights: engine.map.weights.len(),
        gpu_weight_bytes: gpu.as_ref().map_or(0, |g| g.usage().weights),
    };
    metrics.set_ready(placement, gpu);
    let mut cached = CachedTokens::default();
    let n_ctx = session.n_ctx;
    for job in jobs {
        metrics.dequeued();
        let waited = job.enqueued.elapsed().as_secs_f64();
        if shutdown.load(Ordering::Relaxed) {
            let _ = job
                .events
                .send(Event::Failed("the server is shutting down".into()));
            continue;
        }
        if job.cancel.load(Ordering::Relaxed) {
            metrics.cancelled();
            continue;
        }
        let ids = match tokenize(&opened, &job.prompt) {
            Ok(ids) => ids,
            Err(message) => {
                let _ = job.events.send(Event::Rejected {
                    message,
                    param: Some(prompt_param(&job.prompt)),
                    code: None,
                });
                continue;
            }
        };
        let prompt_param = prompt_param(&job.prompt);
        let room = n_ctx.saturating_sub(ids.len());
        let want = job.max_tokens.unwrap_or(room).max(1);
        if ids.len() + want > n_ctx {
            let _ = job.events.send(Event::Rejected {
                message: format!(
                    "This model's maximum context length is {n_ctx} tokens. However, you \
                     requested {} tokens ({} in the prompt, {want} for the completion). Please \
                     reduce the prompt or max_tokens.",
                    ids.len() + want,
                    ids.len()
                ),
                param: Some(if job.max_tokens.is_some() && ids.len() < n_ctx {
                    "max_tokens"
                } else {
                    prompt_param
                }),
                code: Some("context_length_exceeded"),
            });
            continue;
        }
        let _ = job.events.send(Event::Started {
            prompt_tokens: ids.len(),
        });
        metrics.started(waited);
        let mut sampler = Sampler::new(job.sampling.clone());
        let mut utf8 = Utf8Stream::default();
        let mut stops = StopFilter::new(job.stop.clone());
        let mut stopped_by_string = false;
        let events = &job.events;
        let cancel = &job.cancel;
        // A bug that panics fails this request, not the server: the cache is then forgotten.
        let g = catch_unwind(AssertUnwindSafe(|| {
            generate_cached(
                &mut session,
                &opened.tokenizer,
                job.ignore_eos,
                &mut sampler,
                &mut cached,
                &ids,
                want,
                |b| {
                    let (text, stop) = stops.push(&utf8.push(b));
                    if !text.is_empty() && events.send(Event::Text(text)).is_err() {
                        cancel.store(true, Ordering::Relaxed);
                    }
                    stopped_by_string = stop;
                    !stop && !cancel.load(Ordering::Relaxed) && !shutdown.load(Ordering::Relaxed)
                },
            )
        }))
        .unwrap_or_else(|p| {
            cached.clear();
            session.reset();
            let why = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            Err(crate::error::Error::Msg(format!(
                "internal error (the generation panicked: {why})"
            )))
        });
        match g {
            Ok(g) => {
                if !stopped_by_string {
                    let (rest, _) = stops.push(&utf8.finish());
                    let rest = rest + &stops.finish();
                    if !rest.is_empty() {
                        let _ = events.send(Event::Text(rest));
                    }
                }
                let outcome = Outcome {
                    finish: g.finish,
                    stopped_by_string,
                    prompt_tokens: ids.len(),
                    completion_tokens: g.output_ids.len(),
                    cached_tokens: g.cached_tokens,
                };
                let cancelled = g.finish == Finish::Stopped && !stopped_by_string;
                metrics.finished(&g, cancelled);
                let _ = events.send(Event::Done(outcome));
            }
            Err(e) => {
                metrics.failed();
                let _ = events.send(Event::Failed(e.to_string()));
            }
        }
    }
    Ok(())
}

/// The request field that holds the prompt.
fn prompt_param(p: &Prompt) -> &'static str {
    match p {
        Prompt::Chat(_) => "messages",
        Prompt::Text(_) => "prompt",
    }
}

/// The prompt's token ids, or why it cannot be tokenised (a template error).
fn tokenize(opened: &Opened, prompt: &Prompt) -> std::result::Result<Vec<u32>, String> {
    let text = match prompt {
        Prompt::Chat(m) => opened.render_chat(m).map_err(|e| e.to_string())?,
        Prompt::Text(t) => t.clone(),
    };
    let ids = opened
        .tokenizer
        .encode(&text, true, true)
        .map_err(|e| e.to_string())?;
    if ids.is_empty() {
        return Err("the prompt encodes to no tokens".into());
    }
    Ok(ids)
}

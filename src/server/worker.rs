//! The engine thread: opens and places the model once, then runs the queued requests on its
//! session, up to `--parallel` at once decoding together (continuous batching), each on a KV
//! slot that keeps its cache's tokens so that a request that starts as an earlier one did (a
//! shared system prompt, a conversation's earlier turns) runs only the rest.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, TryRecvError};
use std::time::Instant;

use tokio::sync::mpsc::UnboundedSender;

use crate::engine::DeviceChoice;
use crate::engine::{Opened, PlaceOptions};
use crate::error::{Error, Result};
use crate::runtime::forward::{SeqPart, Session};
use crate::runtime::generate::{Finish, Utf8Stream};
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
    /// A prompt runs in pieces of at most this many tokens, one piece per step, so the
    /// requests decoding meanwhile wait for one piece at a time (0: the whole prompt at once).
    pub ubatch: usize,
    pub path: std::path::PathBuf,
    pub device: DeviceChoice,
    pub place: PlaceOptions,
}

/// One request generating on a KV slot.
struct Seq {
    job: Job,
    sampler: Sampler,
    utf8: Utf8Stream,
    stops: StopFilter,
    stopped_by_string: bool,
    prompt: Vec<u32>,
    /// The prompt and the tokens generated so far (the sampler's repeat penalty reads it).
    history: Vec<u32>,
    output: Vec<u32>,
    /// At most this many tokens.
    want: usize,
    /// Prompt tokens whose keys and values were already in the slot.
    reused: usize,
    start: Instant,
    ttft_ms: f64,
}

/// A KV slot: the tokens its cache holds, position by position (kept after its request ends,
/// so that a request that starts as an earlier one did runs only the rest), and the request
/// generating on it.
#[derive(Default)]
struct Slot {
    cached: Vec<u32>,
    seq: Option<Seq>,
    /// When it last took a request, for choosing among slots that share nothing.
    used: u64,
}

/// The engine thread's state between steps.
struct Engine<'a, 'm> {
    opened: &'a Opened,
    session: Session<'m>,
    slots: Vec<Slot>,
    metrics: Arc<Metrics>,
    shutdown: Arc<AtomicBool>,
    /// Requests started so far: the clock of `Slot::used`.
    taken: u64,
    /// Largest piece of a prompt one step runs (0: the whole prompt).
    ubatch: usize,
}

/// Opens and places the model (reporting `ready` to `metrics`), then serves `jobs` until every
/// sender is gone: up to `--parallel` requests at once, each on its own KV slot, each decode step
/// one forward pass over all of them (continuous batching: a request joins between steps, its
/// prompt prefilled, and leaves when it ends). Once `shutdown` is set, the running generations
/// stop and the waiting jobs fail. An error when the model cannot be opened or placed.
pub fn run(
    spec: EngineSpec,
    jobs: Receiver<Job>,
    metrics: Arc<Metrics>,
    shutdown: Arc<AtomicBool>,
) -> Result<()> {
    let opened = Opened::open(&spec.path, spec.device)?;
    let engine = opened.place(&spec.place)?;
    let policy = engine.policy_name();
    let session = engine.session;
    let dev = engine.dev;
    let gpu = (dev != 0).then(|| engine.backends[dev].clone());
    let placement = PlacementSummary {
        device: engine.backends[dev].describe(),
        policy,
        gpu_weights: engine
            .map
            .weights
            .values()
            .filter(|&&d| d == dev && dev != 0)
            .count(),
        weights: engine.map.weights.len(),
        gpu_weight_bytes: gpu.as_ref().map_or(0, |g| g.usage().weights),
    };
    metrics.parallel.store(session.slots(), Ordering::Relaxed);
    metrics.set_ready(placement, gpu);
    let mut e = Engine {
        opened: &opened,
        slots: (0..session.slots()).map(|_| Slot::default()).collect(),
        session,
        metrics,
        shutdown,
        taken: 0,
        ubatch: spec.ubatch,
    };
    let mut open = true;
    loop {
        // New requests take the free slots: wait for one when nothing runs.
        while open && e.slots.iter().any(|s| s.seq.is_none()) {
            let job = if e.slots.iter().all(|s| s.seq.is_none()) {
                e.metrics.idle();
                match jobs.recv() {
                    Ok(j) => j,
                    Err(_) => {
                        open = false;
                        break;
                    }
                }
            } else {
                match jobs.try_recv() {
                    Ok(j) => j,
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        open = false;
                        break;
                    }
                }
            };
            e.admit(job);
        }
        // (The loop above ends with every slot free only once the queue is closed.)
        if e.slots.iter().all(|s| s.seq.is_none()) {
            return Ok(());
        }
        e.step();
    }
}

impl Engine<'_, '_> {
    /// Checks a job, and starts it on the free slot that holds the longest start of its prompt
    /// (that part reused); `step` then prefills the rest and samples its tokens. `run` calls it
    /// only while a slot is free.
    fn admit(&mut self, job: Job) {
        let metrics = &self.metrics;
        metrics.dequeued();
        let waited = job.enqueued.elapsed().as_secs_f64();
        if self.shutdown.load(Ordering::Relaxed) {
            let _ = job
                .events
                .send(Event::Failed("the server is shutting down".into()));
            return;
        }
        if job.cancel.load(Ordering::Relaxed) {
            metrics.cancelled();
            return;
        }
        let ids = match tokenize(self.opened, &job.prompt) {
            Ok(ids) => ids,
            Err(message) => {
                let _ = job.events.send(Event::Rejected {
                    message,
                    param: Some(prompt_param(&job.prompt)),
                    code: None,
                });
                return;
            }
        };
        let n_ctx = self.session.n_ctx;
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
            return;
        }
        let _ = job.events.send(Event::Started {
            prompt_tokens: ids.len(),
        });
        metrics.started(waited);
        // The free slot whose cache shares the longest start with the prompt; among equals,
        // the one used longest ago.
        let common = |c: &[u32]| c.iter().zip(&ids).take_while(|(a, b)| a == b).count();
        let Some(i) = (0..self.slots.len())
            .filter(|&i| self.slots[i].seq.is_none())
            .max_by_key(|&i| {
                let s = &self.slots[i];
                (common(&s.cached), std::cmp::Reverse(s.used))
            })
        else {
            let _ = job
                .events
                .send(Event::Failed("internal error: no free slot".into()));
            self.metrics.failed();
            return;
        };
        self.taken += 1;
        let slot = &mut self.slots[i];
        slot.used = self.taken;
        let start = Instant::now();
        // Every prompt keeps its last token to run, for the logits.
        let reused = common(&slot.cached).min(ids.len() - 1);
        slot.cached.truncate(reused);
        slot.seq = Some(Seq {
            sampler: Sampler::new(job.sampling.clone()),
            stops: StopFilter::new(job.stop.clone()),
            job,
            utf8: Utf8Stream::default(),
            stopped_by_string: false,
            history: ids.clone(),
            output: Vec::new(),
            want,
            reused,
            prompt: ids,
            start,
            ttft_ms: 0.0,
        });
    }

    /// One step: a piece of at most `ubatch` tokens of each prompt not yet in its slot's cache
    /// (the whole rest when `ubatch` is 0), each as its own forward pass (a prompt whose last
    /// piece ran samples its first token); then one forward pass over the last token of every
    /// request that is decoding.
    fn step(&mut self) {
        for i in 0..self.slots.len() {
            let s = &self.slots[i];
            let Some(seq) = &s.seq else { continue };
            // Past the prompt: decoding.
            let (at, len) = (s.cached.len(), seq.prompt.len());
            if at >= len {
                continue;
            }
            // A client gone during its prefill stops it before the next piece.
            if seq.job.cancel.load(Ordering::Relaxed) || self.shutdown.load(Ordering::Relaxed) {
                if let Some(seq) = self.slots[i].seq.take() {
                    finish_seq(seq, Finish::Stopped, &self.metrics);
                }
                continue;
            }
            let end = match self.ubatch {
                0 => len,
                u => (at + u).min(len),
            };
            let piece = seq.prompt[at..end].to_vec();
            if let Some(l) = self.forward(&[(i, piece)])
                && end == len
            {
                self.next_token(i, &l[0]);
            }
        }
        let decoding: Vec<(usize, Vec<u32>)> = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                let seq = s.seq.as_ref()?;
                (s.cached.len() >= seq.prompt.len())
                    .then(|| (i, seq.history[seq.history.len() - 1..].to_vec()))
            })
            .collect();
        if decoding.is_empty() {
            self.metrics.idle();
            return;
        }
        self.metrics.decode_step(decoding.len());
        if let Some(logits) = self.forward(&decoding) {
            for ((i, _), l) in decoding.iter().zip(&logits) {
                self.next_token(*i, l);
            }
        }
    }

    /// Runs each `(slot, tokens)` at its slot's next position as one batch and returns each
    /// one's last-token logits, the slots' caches then holding the tokens; a failure (or a
    /// panic, which fails these requests rather than the server) ends those requests, forgets
    /// their slots' caches and returns `None`.
    fn forward(&mut self, fed: &[(usize, Vec<u32>)]) -> Option<Vec<Vec<f32>>> {
        let parts: Vec<SeqPart> = fed
            .iter()
            .map(|(i, t)| SeqPart {
                slot: *i,
                pos0: self.slots[*i].cached.len(),
                tokens: t,
            })
            .collect();
        let session = &mut self.session;
        let r =
            catch_unwind(AssertUnwindSafe(|| session.forward_seqs(&parts))).unwrap_or_else(|p| {
                let why = p
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| p.downcast_ref::<String>().cloned())
                    .unwrap_or_default();
                Err(Error::Msg(format!(
                    "internal error (the generation panicked: {why})"
                )))
            });
        match r {
            Ok(logits) => {
                for (i, t) in fed {
                    self.slots[*i].cached.extend_from_slice(t);
                }
                Some(logits)
            }
            Err(e) => {
                for (i, _) in fed {
                    let slot = &mut self.slots[*i];
                    slot.cached.clear();
                    if let Some(seq) = slot.seq.take() {
                        self.metrics.failed();
                        let _ = seq.job.events.send(Event::Failed(e.to_string()));
                    }
                }
                None
            }
        }
    }

    /// Samples slot `i`'s next token from `logits` and sends its text; ends the request when
    /// it is an end-of-generation token, a stop string, the client gone, `max_tokens` reached
    /// or the context full (the order `generate` checks them in).
    fn next_token(&mut self, i: usize, logits: &[f32]) {
        let n_ctx = self.session.n_ctx;
        let slot = &mut self.slots[i];
        let Some(seq) = slot.seq.as_mut() else {
            return;
        };
        let tok = seq.sampler.sample(logits, &seq.history);
        if seq.output.is_empty() {
            seq.ttft_ms = seq.start.elapsed().as_secs_f64() * 1e3;
        }
        seq.output.push(tok);
        seq.history.push(tok);
        let tokenizer = &self.opened.tokenizer;
        let finish = if !seq.job.ignore_eos && tokenizer.is_eog(tok) {
            Some(Finish::Eog)
        } else {
            let bytes = tokenizer.token_bytes(tok, false);
            let (text, stop) = seq.stops.push(&seq.utf8.push(&bytes));
            let cancel = &seq.job.cancel;
            if !text.is_empty() && seq.job.events.send(Event::Text(text)).is_err() {
                cancel.store(true, Ordering::Relaxed);
            }
            seq.stopped_by_string = stop;
            if stop || cancel.load(Ordering::Relaxed) || self.shutdown.load(Ordering::Relaxed) {
                Some(Finish::Stopped)
            } else if seq.output.len() >= seq.want {
                Some(Finish::Length)
            } else if slot.cached.len() >= n_ctx {
                Some(Finish::ContextFull)
            } else {
                None
            }
        };
        if let Some(f) = finish
            && let Some(seq) = slot.seq.take()
        {
            finish_seq(seq, f, &self.metrics);
        }
    }
}

/// Sends a finished request's last text and its outcome, and counts it.
fn finish_seq(mut seq: Seq, finish: Finish, metrics: &Metrics) {
    let events = &seq.job.events;
    if !seq.stopped_by_string {
        let (rest, _) = seq.stops.push(&seq.utf8.finish());
        let rest = rest + &seq.stops.finish();
        if !rest.is_empty() {
            let _ = events.send(Event::Text(rest));
        }
    }
    let e2e_ms = seq.start.elapsed().as_secs_f64() * 1e3;
    let n = seq.output.len();
    let tpot_ms = if n > 1 {
        (e2e_ms - seq.ttft_ms) / (n - 1) as f64
    } else {
        0.0
    };
    let outcome = Outcome {
        finish,
        stopped_by_string: seq.stopped_by_string,
        prompt_tokens: seq.prompt.len(),
        completion_tokens: n,
        cached_tokens: seq.reused,
    };
    let cancelled = finish == Finish::Stopped && !seq.stopped_by_string;
    metrics.finished(&outcome, seq.ttft_ms, tpot_ms, cancelled);
    let _ = events.send(Event::Done(outcome));
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

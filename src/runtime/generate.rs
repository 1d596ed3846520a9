//! Text generation: prefill the prompt as one batch, then decode token by token, streaming the
//! bytes of each token and timing TTFT and TPOT as DESIGN.md defines them.

use std::time::Instant;

use crate::error::Result;
use crate::runtime::forward::{Logits, Session};
use crate::runtime::sampler::Sampler;
use crate::tokenizer::Tokenizer;

/// What one generation produced and how long it took.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Generation {
    pub prompt_ids: Vec<u32>,
    /// Generated ids; ends with the end-of-generation token when generation stopped on one.
    pub output_ids: Vec<u32>,
    pub text: String,
    pub stopped_on_eog: bool,
    pub finish: Finish,
    /// Prompt tokens whose keys and values were already in the cache ([`generate_cached`]).
    pub cached_tokens: usize,
    /// Prefill: prompt ready to first token sampled.
    pub ttft_ms: f64,
    /// Mean of the later decode steps: (e2e - ttft) / (G - 1); 0 when G < 2.
    pub tpot_ms: f64,
    pub e2e_ms: f64,
}

impl Generation {
    /// Tokens per second of the prompt (llama-bench's pp) and of decoding (tg).
    pub fn prompt_tps(&self) -> f64 {
        if self.ttft_ms > 0.0 {
            self.prompt_ids.len() as f64 / (self.ttft_ms / 1e3)
        } else {
            0.0
        }
    }
    pub fn decode_tps(&self) -> f64 {
        let n = self.output_ids.len().saturating_sub(1);
        if n == 0 {
            0.0
        } else {
            n as f64 / ((self.e2e_ms - self.ttft_ms) / 1e3)
        }
    }
}

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Finish {
    /// An end-of-generation token was sampled.
    Eog,
    /// `n_predict` tokens were generated.
    Length,
    /// The caller's `on_bytes` said stop (a stop string, a cancelled request, Ctrl-C).
    Stopped,
    /// The session's context had no room for another token.
    ContextFull,
}

/// The token ids whose keys and values a session's cache holds, position by position, so that a
/// generation whose prompt starts with them (the earlier turns of a chat) runs only the rest.
#[derive(Debug, Default, Clone)]
pub struct CachedTokens {
    ids: Vec<u32>,
}

impl CachedTokens {
    pub fn len(&self) -> usize {
        self.ids.len()
    }
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }
    /// Forgets them (and so the next generation recomputes its whole prompt).
    pub fn clear(&mut self) {
        self.ids.clear();
    }
}

/// Generates up to `n_predict` tokens after `prompt_ids`, stopping at an end-of-generation token
/// unless `ignore_eog`; `on_bytes` receives each token's bytes.
pub fn generate(
    session: &mut Session,
    tokenizer: &Tokenizer,
    ignore_eog: bool,
    sampler: &mut Sampler,
    prompt_ids: &[u32],
    n_predict: usize,
    mut on_bytes: impl FnMut(&[u8]),
) -> Result<Generation> {
    run(
        session,
        tokenizer,
        ignore_eog,
        sampler,
        None,
        prompt_ids,
        n_predict,
        |b| {
            on_bytes(b);
            true
        },
    )
}

/// As [`generate`], reusing the cache: the longest common prefix of `cached` and `prompt_ids`
/// (all but the prompt's last token at most) stays in the session, only the rest of the prompt is
/// run (`Generation::cached_tokens` says how many were reused), and `cached` then holds what
/// the cache holds. `on_bytes` returns false to stop; generation also stops, with
/// [`Finish::ContextFull`], when the context has no room left.
#[allow(clippy::too_many_arguments)]
pub fn generate_cached(
    session: &mut Session,
    tokenizer: &Tokenizer,
    ignore_eog: bool,
    sampler: &mut Sampler,
    cached: &mut CachedTokens,
    prompt_ids: &[u32],
    n_predict: usize,
    on_bytes: impl FnMut(&[u8]) -> bool,
) -> Result<Generation> {
    run(
        session,
        tokenizer,
        ignore_eog,
        sampler,
        Some(cached),
        prompt_ids,
        n_predict,
        on_bytes,
    )
}

#[allow(clippy::too_many_arguments)]
fn run(
    session: &mut Session,
    tokenizer: &Tokenizer,
    ignore_eog: bool,
    sampler: &mut Sampler,
    mut cached: Option<&mut CachedTokens>,
    prompt_ids: &[u32],
    n_predict: usize,
    mut on_bytes: impl FnMut(&[u8]) -> bool,
) -> Result<Generation> {
    let start = Instant::now();
    let mut history = prompt_ids.to_vec();
    let mut output = Vec::with_capacity(n_predict);
    let mut ttft_ms = 0.0;
    let mut finish = Finish::Length;
    let mut text_bytes = Vec::new();
    let mut reused = 0;
    if let Some(c) = cached.as_deref_mut() {
        if c.ids.len() != session.n_past {
            c.ids.clear();
            session.reset();
        }
        reused = c
            .ids
            .iter()
            .zip(prompt_ids)
            .take_while(|(a, b)| a == b)
            .count()
            .min(prompt_ids.len().saturating_sub(1));
        c.ids.truncate(reused);
        session.n_past = reused;
    }
    if n_predict > 0 {
        let fed = &prompt_ids[reused..];
        let mut logits = forward_recorded(session, cached.as_deref_mut(), fed)?;
        loop {
            let tok = sampler.sample(&logits, &history);
            if output.is_empty() {
                ttft_ms = start.elapsed().as_secs_f64() * 1e3;
            }
            output.push(tok);
            history.push(tok);
            if !ignore_eog && tokenizer.is_eog(tok) {
                finish = Finish::Eog;
                break;
            }
            let bytes = tokenizer.token_bytes(tok, false);
            text_bytes.extend_from_slice(&bytes);
            if !on_bytes(&bytes) {
                finish = Finish::Stopped;
                break;
            }
            if output.len() >= n_predict {
                break;
            }
            if session.n_past >= session.n_ctx {
                finish = Finish::ContextFull;
                break;
            }
            logits = forward_recorded(session, cached.as_deref_mut(), &[tok])?;
        }
    }
    let e2e_ms = start.elapsed().as_secs_f64() * 1e3;
    let tpot_ms = if output.len() > 1 {
        (e2e_ms - ttft_ms) / (output.len() - 1) as f64
    } else {
        0.0
    };
    Ok(Generation {
        prompt_ids: prompt_ids.to_vec(),
        output_ids: output,
        text: String::from_utf8_lossy(&text_bytes).into_owned(),
        stopped_on_eog: finish == Finish::Eog,
        finish,
        cached_tokens: reused,
        ttft_ms,
        tpot_ms,
        e2e_ms,
    })
}

/// A forward call for the last token's logits that keeps `cached` in step with the session
/// (cleared when the call fails part-way, since the cache's state is then unknown).
fn forward_recorded(
    session: &mut Session,
    cached: Option<&mut CachedTokens>,
    tokens: &[u32],
) -> Result<Vec<f32>> {
    let r = session.forward(tokens, Logits::Last);
    if let Some(c) = cached {
        match &r {
            Ok(_) => c.ids.extend_from_slice(tokens),
            Err(_) => {
                c.ids.clear();
                session.reset();
            }
        }
    }
    r
}

/// Splits a byte stream into complete UTF-8 text, holding back an unfinished character.
#[derive(Default)]
pub struct Utf8Stream {
    pending: Vec<u8>,
}

impl Utf8Stream {
    /// Returns the text that is complete after adding `bytes`.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        match std::str::from_utf8(&self.pending) {
            Ok(s) => {
                let s = s.to_string();
                self.pending.clear();
                s
            }
            Err(e) if e.error_len().is_none() => {
                // An unfinished character at the end: emit what precedes it.
                let good = e.valid_up_to();
                let s = String::from_utf8_lossy(&self.pending[..good]).into_owned();
                self.pending.drain(..good);
                s
            }
            Err(_) => {
                let s = String::from_utf8_lossy(&self.pending).into_owned();
                self.pending.clear();
                s
            }
        }
    }

    /// Whatever is left, lossily.
    pub fn finish(&mut self) -> String {
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }
}

#[cfg(test)]
mod tests {
    use super::Utf8Stream;

    #[test]
    fn utf8_stream_holds_back_split_characters() {
        let mut s = Utf8Stream::default();
        let e = "é".as_bytes();
        assert_eq!(s.push(b"a"), "a");
        assert_eq!(s.push(&e[..1]), "");
        assert_eq!(s.push(&e[1..]), "é");
        assert_eq!(s.push(&[0xF0, 0x9F]), "");
        assert_eq!(s.finish(), "\u{FFFD}");
    }
}

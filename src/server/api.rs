//! The OpenAI request bodies this server takes, read field by field so that every bad input
//! (malformed JSON, an unknown field, a wrong type, a value out of range) is a 400 whose error
//! names the field, and the response bodies it writes.

use serde::de::DeserializeOwned;
use serde_json::{Map, Value, json};

use crate::runtime::sampler::SamplerConfig;
use crate::tokenizer::chat::ChatMessage;

use super::worker::{Outcome, Prompt};

/// An error as the OpenAI API writes it: an HTTP status and
/// `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<String>,
}

impl ApiError {
    /// A 400 `invalid_request_error`.
    pub fn invalid(message: impl Into<String>, param: Option<&str>) -> Self {
        ApiError {
            status: 400,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(str::to_string),
            code: None,
        }
    }

    pub fn with_code(mut self, code: &str) -> Self {
        self.code = Some(code.to_string());
        self
    }

    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

/// Which endpoint a body is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completion,
}

/// A validated generation request.
#[derive(Debug, Clone)]
pub struct Request {
    pub prompt: Prompt,
    pub sampling: SamplerConfig,
    pub max_tokens: Option<usize>,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    /// Keep generating past end-of-generation tokens (llama.cpp's server has it too).
    pub ignore_eos: bool,
}

/// Fields accepted and ignored (they change nothing oato does, or only say who asks).
const IGNORED: [&str; 3] = ["model", "user", "name"];

/// Reads a request body for `endpoint`. `n_ctx` bounds `max_tokens`.
pub fn parse(body: &[u8], endpoint: Endpoint, n_ctx: usize) -> Result<Request, ApiError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::invalid(
            format!("We could not parse the JSON body of your request: {e}"),
            None,
        )
    })?;
    let Value::Object(obj) = v else {
        return Err(ApiError::invalid(
            "The request body must be a JSON object",
            None,
        ));
    };
    let known: &[&str] = &[
        "messages",
        "prompt",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "repeat_penalty",
        "repeat_last_n",
        "stream",
        "stream_options",
        "n",
        "presence_penalty",
        "frequency_penalty",
        "logprobs",
        "echo",
        "ignore_eos",
    ];
    for k in obj.keys() {
        let wrong_endpoint = match endpoint {
            Endpoint::Chat => k == "prompt" || k == "echo",
            Endpoint::Completion => k == "messages",
        };
        if wrong_endpoint || (!known.contains(&k.as_str()) && !IGNORED.contains(&k.as_str())) {
            return Err(ApiError::invalid(
                format!("Unrecognized request argument supplied: {k}"),
                Some(k),
            ));
        }
    }
    let prompt = match endpoint {
        Endpoint::Chat => Prompt::Chat(messages(&obj)?),
        Endpoint::Completion => Prompt::Text(prompt_text(&obj)?),
    };
    let d = SamplerConfig::default();
    let sampling = SamplerConfig {
        temperature: field(&obj, "temperature")?.unwrap_or(1.0),
        top_k: field(&obj, "top_k")?.unwrap_or(0),
        top_p: field(&obj, "top_p")?.unwrap_or(1.0),
        min_p: field(&obj, "min_p")?.unwrap_or(0.0),
        repeat_penalty: field(&obj, "repeat_penalty")?.unwrap_or(d.repeat_penalty),
        repeat_last_n: field(&obj, "repeat_last_n")?.unwrap_or(d.repeat_last_n),
        seed: field(&obj, "seed")?.unwrap_or_else(fresh_seed),
    };
    if let Err(e) = sampling.check() {
        return Err(ApiError::invalid(
            format!("{} is {}: it must be {}", e.field, e.value, e.range),
            Some(e.field),
        ));
    }
    let max_tokens: Option<usize> = match field(&obj, "max_completion_tokens")? {
        Some(n) => Some(n),
        None => field(&obj, "max_tokens")?,
    };
    if let Some(n) = max_tokens {
        let param = if obj.contains_key("max_completion_tokens") {
            "max_completion_tokens"
        } else {
            "max_tokens"
        };
        if n == 0 {
            return Err(ApiError::invalid(
                format!("{param} must be at least 1"),
                Some(param),
            ));
        }
        if n > n_ctx {
            return Err(ApiError::invalid(
                format!(
                    "{param} is {n}, but this model's maximum context length is {n_ctx} tokens"
                ),
                Some(param),
            )
            .with_code("context_length_exceeded"));
        }
    }
    let stop = match obj.get("stop") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(_) => {
            let v: Vec<String> = field(&obj, "stop")?.unwrap_or_default();
            if v.len() > 4 {
                return Err(ApiError::invalid(
                    "stop takes at most 4 sequences",
                    Some("stop"),
                ));
            }
            v
        }
    };
    if field::<u32>(&obj, "n")?.is_some_and(|n| n != 1) {
        return Err(ApiError::invalid("only n = 1 is supported", Some("n")));
    }
    for p in ["presence_penalty", "frequency_penalty"] {
        if field::<f32>(&obj, p)?.is_some_and(|v| v != 0.0) {
            return Err(ApiError::invalid(
                format!("{p} is not supported (use repeat_penalty)"),
                Some(p),
            ));
        }
    }
    for p in ["logprobs", "echo"] {
        let on = match obj.get(p) {
            Some(Value::Bool(b)) => *b,
            Some(Value::Number(n)) => n.as_u64() != Some(0),
            Some(Value::Null) | None => false,
            Some(_) => return Err(type_error(p, "a boolean")),
        };
        if on {
            return Err(ApiError::invalid(format!("{p} is not supported"), Some(p)));
        }
    }
    let stream = field(&obj, "stream")?.unwrap_or(false);
    let ignore_eos = field(&obj, "ignore_eos")?.unwrap_or(false);
    let include_usage = match obj.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(o)) => match o.get("include_usage") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(_) => return Err(type_error("stream_options.include_usage", "a boolean")),
        },
        Some(_) => return Err(type_error("stream_options", "an object")),
    };
    Ok(Request {
        prompt,
        sampling,
        max_tokens,
        stop,
        stream,
        include_usage,
        ignore_eos,
    })
}

/// A seed for a request that gives none: the clock's nanoseconds.
fn fresh_seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

fn type_error(param: &str, want: &str) -> ApiError {
    ApiError::invalid(format!("'{param}' must be {want}"), Some(param))
}

/// Field `key` as a `T` (absent or null: `None`), or a 400 naming it.
fn field<T: DeserializeOwned>(obj: &Map<String, Value>, key: &str) -> Result<Option<T>, ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => serde_json::from_value(v.clone())
            .map(Some)
            .map_err(|e| ApiError::invalid(format!("Invalid value for '{key}': {e}"), Some(key))),
    }
}

/// The chat messages: each `{role, content}` with content a string or a list of text parts.
fn messages(obj: &Map<String, Value>) -> Result<Vec<ChatMessage>, ApiError> {
    let bad =
        |i: usize, why: &str| ApiError::invalid(format!("messages[{i}]: {why}"), Some("messages"));
    let Some(Value::Array(list)) = obj.get("messages") else {
        return Err(ApiError::invalid(
            "messages is required: a list of {role, content} objects",
            Some("messages"),
        ));
    };
    if list.is_empty() {
        return Err(ApiError::invalid(
            "messages must hold at least one message",
            Some("messages"),
        ));
    }
    let mut out = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let Value::Object(m) = m else {
            return Err(bad(
                i,
                "each message must be an object with role and content",
            ));
        };
        let Some(Value::String(role)) = m.get("role") else {
            return Err(bad(i, "role must be a string"));
        };
        if !["system", "developer", "user", "assistant"].contains(&role.as_str()) {
            return Err(bad(
                i,
                &format!("role {role:?} is not one of system, developer, user, assistant"),
            ));
        }
        let content = match m.get("content") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(parts)) => {
                let mut s = String::new();
                for p in parts {
                    match (p.get("type").and_then(Value::as_str), p.get("text")) {
                        (Some("text"), Some(Value::String(t))) => s.push_str(t),
                        _ => return Err(bad(i, "only text content parts are supported")),
                    }
                }
                s
            }
            Some(Value::Null) | None if role == "assistant" => String::new(),
            _ => return Err(bad(i, "content must be a string or a list of text parts")),
        };
        for k in m.keys() {
            if !["role", "content", "name"].contains(&k.as_str()) {
                return Err(bad(i, &format!("unrecognized field {k}")));
            }
        }
        let role = if role == "developer" { "system" } else { role };
        out.push(ChatMessage::new(role, content));
    }
    Ok(out)
}

/// The completion prompt: a string, or a list of one string.
fn prompt_text(obj: &Map<String, Value>) -> Result<String, ApiError> {
    match obj.get("prompt") {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
            Ok(a[0].as_str().unwrap_or_default().to_string())
        }
        Some(Value::Array(_)) => Err(ApiError::invalid(
            "prompt: only one prompt string per request is supported",
            Some("prompt"),
        )),
        None | Some(Value::Null) => Err(ApiError::invalid("prompt is required", Some("prompt"))),
        Some(_) => Err(type_error("prompt", "a string")),
    }
}

/// The `usage` object.
pub fn usage(o: &Outcome) -> Value {
    json!({
        "prompt_tokens": o.prompt_tokens,
        "completion_tokens": o.completion_tokens,
        "total_tokens": o.prompt_tokens + o.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": o.cached_tokens},
    })
}

/// A whole (not streamed) response.
pub fn response(
    endpoint: Endpoint,
    id: &str,
    created: u64,
    model: &str,
    text: &str,
    o: &Outcome,
) -> Value {
    let choice = match endpoint {
        Endpoint::Chat => json!({
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": null,
            "finish_reason": o.finish_reason(),
        }),
        Endpoint::Completion => json!({
            "index": 0,
            "text": text,
            "logprobs": null,
            "finish_reason": o.finish_reason(),
        }),
    };
    json!({
        "id": id,
        "object": match endpoint {
            Endpoint::Chat => "chat.completion",
            Endpoint::Completion => "text_completion",
        },
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage(o),
    })
}

/// One streamed chunk: a piece of text (`delta`), the first chunk's role, or the last one's
/// finish reason.
pub fn chunk(
    endpoint: Endpoint,
    id: &str,
    created: u64,
    model: &str,
    text: Option<&str>,
    finish: Option<&str>,
) -> Value {
    let choice = match endpoint {
        Endpoint::Chat => {
            let delta = match (text, finish) {
                (Some(t), _) => json!({"content": t}),
                (None, None) => json!({"role": "assistant", "content": ""}),
                (None, Some(_)) => json!({}),
            };
            json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish})
        }
        Endpoint::Completion => {
            json!({"index": 0, "text": text.unwrap_or(""), "logprobs": null, "finish_reason": finish})
        }
    };
    json!({
        "id": id,
        "object": match endpoint {
            Endpoint::Chat => "chat.completion.chunk",
            Endpoint::Completion => "text_completion",
        },
        "created": created,
        "model": model,
        "choices": [choice],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(body: &str) -> ApiError {
        parse(body.as_bytes(), Endpoint::Chat, 100).unwrap_err()
    }

    #[test]
    fn bad_bodies_name_the_field() {
        assert_eq!(err("{").param, None);
        assert!(err("{").message.contains("parse the JSON"));
        assert!(err("[1]").message.contains("JSON object"));
        let e = err(r#"{"messages":[{"role":"user","content":"x"}],"bogus":1}"#);
        assert_eq!(e.param.as_deref(), Some("bogus"));
        let e = err(r#"{"messages":[{"role":"user","content":"x"}],"max_tokens":"ten"}"#);
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        let e = err(r#"{"messages":[{"role":"user","content":"x"}],"max_tokens":101}"#);
        assert_eq!(e.code.as_deref(), Some("context_length_exceeded"));
        assert!(e.message.contains("100 tokens"), "{}", e.message);
        let e = err(r#"{"messages":[{"role":"user","content":"x"}],"max_tokens":-1}"#);
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        let e = err(r#"{"messages":[{"role":"user","content":"x"}],"temperature":-2}"#);
        assert_eq!(e.param.as_deref(), Some("temperature"));
        let e = err(r#"{"messages":[{"role":"wizard","content":"x"}]}"#);
        assert_eq!(e.param.as_deref(), Some("messages"));
        assert_eq!(err(r#"{"messages":[]}"#).status, 400);
        assert_eq!(err(r#"{"prompt":"x"}"#).param.as_deref(), Some("prompt"));
    }

    #[test]
    fn a_good_body_reads_every_setting() {
        let r = parse(
            br#"{"model":"m","messages":[{"role":"system","content":"s"},{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}],
                 "max_tokens":7,"temperature":0,"top_k":5,"top_p":0.5,"min_p":0.1,"seed":3,"stop":["x","y"],
                 "repeat_penalty":1.1,"stream":true,"stream_options":{"include_usage":true}}"#,
            Endpoint::Chat,
            100,
        )
        .unwrap();
        let Prompt::Chat(m) = &r.prompt else {
            panic!("not a chat prompt")
        };
        assert_eq!(m[1], ChatMessage::new("user", "ab"));
        assert_eq!(r.max_tokens, Some(7));
        assert_eq!(
            (r.sampling.temperature, r.sampling.top_k, r.sampling.seed),
            (0.0, 5, 3)
        );
        assert_eq!(r.stop, vec!["x", "y"]);
        assert!(r.stream && r.include_usage);
        let r = parse(
            br#"{"prompt":["hi"],"stop":"\n"}"#,
            Endpoint::Completion,
            100,
        )
        .unwrap();
        assert!(matches!(r.prompt, Prompt::Text(ref t) if t == "hi"));
        assert_eq!((r.stop.len(), r.max_tokens, r.stream), (1, None, false));
    }
}

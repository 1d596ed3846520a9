//! Chat templates: renders a GGUF `tokenizer.chat_template` (Jinja, as Hugging Face writes them) with
//! minijinja, set up as transformers sets up Jinja2: `trim_blocks`, `lstrip_blocks`, loop controls,
//! Python string/dict methods (`.strip()`, `.startswith()`, `.items()`, ...), `raise_exception`,
//! `strftime_now` and a `tojson` that writes what Python's `json.dumps` writes.

use std::sync::Arc;

use minijinja::value::{Enumerator, Kwargs, Object, ObjectRepr, ValueKind};
use minijinja::{Environment, ErrorKind, Value};

use crate::error::{Error, Result};

/// One turn of a conversation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// Renders `template` for `messages`. The template sees `messages` (a list of `{role, content}`),
/// `add_generation_prompt`, `bos_token` and `eos_token`.
pub fn render_chat(
    template: &str,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
    bos_token: &str,
    eos_token: &str,
) -> Result<String> {
    let mut env = Environment::new();
    let syntax = minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build()
        .map_err(template_error)?;
    env.set_syntax(syntax);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env.add_filter("tojson", tojson);
    let tmpl = env.template_from_str(template).map_err(template_error)?;
    let messages: Vec<Value> = messages
        .iter()
        .map(|m| {
            Value::from_object(MessageValue {
                role: Value::from(m.role.as_str()),
                content: Value::from(m.content.as_str()),
            })
        })
        .collect();
    let ctx = minijinja::context! {
        messages => messages,
        add_generation_prompt => add_generation_prompt,
        bos_token => bos_token,
        eos_token => eos_token,
    };
    tmpl.render(ctx).map_err(template_error)
}

/// A message as the template sees it: a map with keys `role` and `content`, in that order (so
/// `tojson` and `.items()` list them as Python would).
#[derive(Debug)]
struct MessageValue {
    role: Value,
    content: Value,
}

impl Object for MessageValue {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Map
    }

    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        match key.as_str()? {
            "role" => Some(self.role.clone()),
            "content" => Some(self.content.clone()),
            _ => None,
        }
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        Enumerator::Str(&["role", "content"])
    }
}

fn template_error(e: minijinja::Error) -> Error {
    let mut msg = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        msg.push_str(&format!(": {s}"));
        source = s.source();
    }
    Error::Template(msg)
}

/// `raise_exception(msg)`: the template refuses the conversation.
fn raise_exception(msg: String) -> std::result::Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(
        ErrorKind::InvalidOperation,
        format!("template raised: {msg}"),
    ))
}

/// `strftime_now(format)`: the current UTC time, formatted with the common `strftime` fields.
fn strftime_now(format: String) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    strftime(&format, secs)
}

/// Formats Unix time `secs` (UTC) with `%Y %y %m %d %e %H %I %M %S %p %b %B %a %A %j %%`; other
/// fields are kept as written.
pub(crate) fn strftime(format: &str, secs: i64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
    ];
    let days = secs.div_euclid(86_400);
    let tod = secs.rem_euclid(86_400);
    let (h, mi, s) = (tod / 3600, tod % 3600 / 60, tod % 60);
    // civil date from days since 1970-01-01 (Howard Hinnant's algorithm)
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy_mar = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy_mar + 2) / 153;
    let d = doy_mar - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let cum = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cum[(m - 1) as usize] + d + i64::from(leap && m > 2);
    let weekday = DAYS[days.rem_euclid(7) as usize];
    let month = MONTHS[(m - 1) as usize];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&format!("{:02}", y.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('e') => out.push_str(&format!("{d:2}")),
            Some('H') => out.push_str(&format!("{h:02}")),
            Some('I') => out.push_str(&format!("{:02}", if h % 12 == 0 { 12 } else { h % 12 })),
            Some('M') => out.push_str(&format!("{mi:02}")),
            Some('S') => out.push_str(&format!("{s:02}")),
            Some('p') => out.push_str(if h < 12 { "AM" } else { "PM" }),
            Some('b') => out.push_str(&month[..3]),
            Some('B') => out.push_str(month),
            Some('a') => out.push_str(&weekday[..3]),
            Some('A') => out.push_str(weekday),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// `tojson`: JSON as Python's `json.dumps(x, ensure_ascii=False)` writes it (`", "` and `": "`
/// separators, or `indent=N`), which is what transformers' templates get.
fn tojson(value: &Value, kwargs: Kwargs) -> std::result::Result<Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    // accepted for compatibility; keys keep the order the template built them in
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    let _: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_json(value, indent, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

fn write_json(
    v: &Value,
    indent: Option<usize>,
    depth: usize,
    out: &mut String,
) -> std::result::Result<(), minijinja::Error> {
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    };
    let (item_sep, key_sep) = if indent.is_some() {
        (",", ": ")
    } else {
        (", ", ": ")
    };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => match (v.as_i64(), f64::try_from(v.clone())) {
            (Some(i), _) => out.push_str(&i.to_string()),
            (None, Ok(f)) if f.is_nan() => out.push_str("NaN"),
            (None, Ok(f)) if f.is_infinite() => {
                out.push_str(if f > 0.0 { "Infinity" } else { "-Infinity" })
            }
            (None, Ok(f)) => out.push_str(&format!("{f:?}")),
            (None, Err(_)) => out.push_str(&v.to_string()),
        },
        ValueKind::String => {
            out.push_str(&serde_json::to_string(v.as_str().unwrap_or_default()).unwrap_or_default())
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                write_json(item, indent, depth + 1, out)?;
            }
            if !items.is_empty() {
                newline(out, depth);
            }
            out.push(']');
        }
        ValueKind::Map => {
            let keys: Vec<Value> = v.try_iter()?.collect();
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                let key = match k.as_str() {
                    Some(s) => s.to_string(),
                    None => k.to_string(),
                };
                out.push_str(&serde_json::to_string(&key).unwrap_or_default());
                out.push_str(key_sep);
                write_json(&v.get_item(k)?, indent, depth + 1, out)?;
            }
            if !keys.is_empty() {
                newline(out, depth);
            }
            out.push('}');
        }
        _ => out.push_str(&serde_json::to_string(&v.to_string()).unwrap_or_default()),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHATML: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are helpful<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    #[test]
    fn chatml_with_default_system_prompt() {
        let msgs = [ChatMessage::new("user", "Hi!")];
        let out = render_chat(CHATML, &msgs, true, "", "").unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nYou are helpful<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
        );
        let msgs = [
            ChatMessage::new("system", "S"),
            ChatMessage::new("user", "U"),
        ];
        let out = render_chat(CHATML, &msgs, false, "", "").unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
        );
    }

    #[test]
    fn hf_extras() {
        // trim_blocks / lstrip_blocks, python methods, bos_token, tojson; expected output from Jinja2
        let t = "{{ bos_token }}\n  {% for m in messages %}\n    {{ m.role.upper() }}:{{ m['content'].strip() }}|{% if m.content.startswith(' a') %}yes{% endif %}\n  {% endfor %}{{ messages[0] | tojson }}{{ eos_token }}";
        let msgs = [ChatMessage::new("user", " a \"q\" é ")];
        let out = render_chat(t, &msgs, false, "<s>", "</s>").unwrap();
        assert_eq!(
            out,
            "<s>\n    USER:a \"q\" é|yes{\"role\": \"user\", \"content\": \" a \\\"q\\\" é \"}</s>"
        );
        let t = "{{ {'a': [1, 2.5, none, true], 'b': {}} | tojson(indent=2) }}";
        let out = render_chat(t, &[], false, "", "").unwrap();
        assert_eq!(
            out,
            "{\n  \"a\": [\n    1,\n    2.5,\n    null,\n    true\n  ],\n  \"b\": {}\n}"
        );
    }

    #[test]
    fn raise_exception_and_syntax_errors_are_template_errors() {
        let t = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('needs a system prompt') }}{% endif %}";
        let err = render_chat(t, &[ChatMessage::new("user", "x")], false, "", "").unwrap_err();
        assert!(matches!(err, Error::Template(_)));
        assert!(err.to_string().contains("needs a system prompt"), "{err}");
        let err = render_chat("{% for %}", &[], false, "", "").unwrap_err();
        assert!(matches!(err, Error::Template(_)), "{err}");
    }

    #[test]
    fn strftime_fields() {
        // 2024-02-29 13:05:09 UTC, a Thursday
        let t = 1_709_211_909;
        assert_eq!(strftime("%Y-%m-%d %H:%M:%S", t), "2024-02-29 13:05:09");
        assert_eq!(
            strftime("%d %b %Y, %A %j %I%p %%", t),
            "29 Feb 2024, Thursday 060 01PM %"
        );
        assert_eq!(strftime("%B %e", 0), "January  1");
    }
}

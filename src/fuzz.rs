//! A mutation fuzzer that runs on stable Rust, for the readers and validators of the files users
//! give oato: a GGUF file (reader, model, tokenizer, a few encodes), a profile (parse and check,
//! then plan from it) and a placement (parse, check against the model, device map). The seeds are
//! valid files made by the project's own writers (a tiny llama model from [`GgufWriter`], its
//! profile on the CPU-backed test device, the plan from that profile); each input is a seed with
//! a few random mutations (bit flips, boundary integers, byte runs inserted, deleted or copied,
//! JSON numbers and strings swapped for awkward ones), run under `catch_unwind`. A fourth target is
//! the server's request bodies (`oato serve`'s field-by-field reader). A panic is a
//! bug: the report keeps the input that caused it.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::Instant;

use crate::error::{Error, Result};
use crate::gguf::{GgufFile, GgufWriter, Value, ValueType};
use crate::model::Model;
use crate::placer::{check, device_map};
use crate::profiler::profile::Profile;
use crate::profiler::{ProfileOptions, profile_model};
use crate::quant::GgmlType;
use crate::rng::SplitMix64;
use crate::runtime::cpu_backend::CpuBackend;
use crate::runtime::test_device::TestDevice;
use crate::scheduler::{Budget, Placement, PlanRequest, Policy, plan};
use crate::tokenizer::Tokenizer;

/// What is fuzzed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    Gguf,
    Profile,
    Placement,
    /// A request body of `oato serve` (chat and completion).
    Request,
}

impl Target {
    pub const ALL: [Target; 4] = [
        Target::Gguf,
        Target::Profile,
        Target::Placement,
        Target::Request,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Target::Gguf => "gguf",
            Target::Profile => "profile",
            Target::Placement => "placement",
            Target::Request => "request",
        }
    }
}

/// Valid inputs to start from, and the model the placement is checked against.
pub struct Seeds {
    /// GGUF files: the tiny model with a SentencePiece (llama) and a BPE (gpt2) vocabulary.
    pub gguf: Vec<Vec<u8>>,
    pub profile: String,
    pub placement: String,
    /// A chat completion request that sets every field the server reads.
    pub request: String,
    pub model: Model,
}

/// A panicking input.
#[derive(Debug, Clone)]
pub struct Found {
    pub input: Vec<u8>,
    pub message: String,
}

/// What a run did.
#[derive(Debug, Clone)]
pub struct Report {
    pub target: Target,
    pub inputs: u64,
    /// Inputs the target accepted (a valid file), and rejected with an error.
    pub accepted: u64,
    pub rejected: u64,
    pub panics: Vec<Found>,
    pub secs: f64,
}

/// Tokens of the seed vocabulary (SentencePiece style): unknown, BOS, EOS, the chat markers,
/// then pieces.
const PIECES: [&str; 24] = [
    "<unk>",
    "<s>",
    "</s>",
    "<|im_start|>",
    "<|im_end|>",
    "▁",
    "a",
    "b",
    "c",
    "h",
    "i",
    "▁a",
    "▁b",
    "ab",
    "hi",
    "▁hi",
    "▁the",
    "t",
    "e",
    "he",
    "the",
    "<0x0A>",
    "user",
    "assistant",
];
const N_EMBD: u64 = 32;
const N_FF: u64 = 64;

fn tensor(w: &mut GgufWriter, name: &str, dims: &[u64], ty: GgmlType) -> Result<()> {
    let n: u64 = dims.iter().product();
    let bytes = ty.row_bytes(n as usize)?;
    // The readers take any bytes as a weight, so a repeating ramp will do.
    let data = (0..bytes).map(|i| (i % 251) as u8 / 4).collect();
    w.add_tensor(name, dims, ty, data)
}

/// The tiny llama model as GGUF bytes, with a `spm` (llama) or `bpe` (gpt2) tokenizer.
fn tiny_gguf(bpe: bool) -> Result<Vec<u8>> {
    let mut w = GgufWriter::new();
    let s = |t: &str| Value::String(t.into());
    w.set("general.architecture", s("llama"));
    w.set("general.name", s("oato fuzz seed"));
    for (k, v) in [
        ("embedding_length", N_EMBD as u32),
        ("block_count", 1),
        ("feed_forward_length", N_FF as u32),
        ("attention.head_count", 2),
        ("attention.head_count_kv", 1),
        ("context_length", 128),
    ] {
        w.set(&format!("llama.{k}"), Value::U32(v));
    }
    w.set("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5));
    w.set("llama.rope.freq_base", Value::F32(10000.0));
    let pieces: Vec<String> = PIECES
        .iter()
        .map(|p| {
            if bpe {
                p.replace('▁', "Ġ")
            } else {
                p.to_string()
            }
        })
        .collect();
    let n_vocab = pieces.len() as u64;
    let strings = |v: &[String]| Value::Array(ValueType::String, v.iter().map(|t| s(t)).collect());
    w.set("tokenizer.ggml.tokens", strings(&pieces));
    let types = (0..pieces.len())
        .map(|i| Value::I32(if i < 5 { if i == 0 { 2 } else { 3 } } else { 1 }))
        .collect();
    w.set(
        "tokenizer.ggml.token_type",
        Value::Array(ValueType::I32, types),
    );
    if bpe {
        w.set("tokenizer.ggml.model", s("gpt2"));
        w.set("tokenizer.ggml.pre", s("smollm"));
        let merges: Vec<String> = [
            "a b", "h i", "Ġ a", "Ġ b", "Ġ hi", "t h", "th e", "h e", "Ġ the",
        ]
        .iter()
        .map(|m| m.to_string())
        .collect();
        w.set("tokenizer.ggml.merges", strings(&merges));
    } else {
        w.set("tokenizer.ggml.model", s("llama"));
        let scores = (0..pieces.len()).map(|i| Value::F32(-(i as f32))).collect();
        w.set(
            "tokenizer.ggml.scores",
            Value::Array(ValueType::F32, scores),
        );
    }
    w.set("tokenizer.ggml.bos_token_id", Value::U32(1));
    w.set("tokenizer.ggml.eos_token_id", Value::U32(4));
    w.set(
        "tokenizer.chat_template",
        s("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\
           {% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    );
    let (e, ff, kv) = (N_EMBD, N_FF, N_EMBD / 2);
    tensor(&mut w, "token_embd.weight", &[e, n_vocab], GgmlType::Q8_0)?;
    tensor(&mut w, "output_norm.weight", &[e], GgmlType::F32)?;
    tensor(&mut w, "output.weight", &[e, n_vocab], GgmlType::Q4_0)?;
    tensor(&mut w, "blk.0.attn_norm.weight", &[e], GgmlType::F32)?;
    tensor(&mut w, "blk.0.attn_q.weight", &[e, e], GgmlType::Q4_0)?;
    tensor(&mut w, "blk.0.attn_k.weight", &[e, kv], GgmlType::Q4_1)?;
    tensor(&mut w, "blk.0.attn_v.weight", &[e, kv], GgmlType::F16)?;
    tensor(&mut w, "blk.0.attn_output.weight", &[e, e], GgmlType::Q5_0)?;
    tensor(&mut w, "blk.0.ffn_norm.weight", &[e], GgmlType::F32)?;
    tensor(&mut w, "blk.0.ffn_gate.weight", &[e, ff], GgmlType::Q8_0)?;
    tensor(&mut w, "blk.0.ffn_up.weight", &[e, ff], GgmlType::Q5_1)?;
    tensor(&mut w, "blk.0.ffn_down.weight", &[ff, e], GgmlType::F32)?;
    Ok(w.to_bytes())
}

/// A plan request for the tiny model under `budget`.
fn request(policy: Policy, budget: Budget) -> PlanRequest {
    PlanRequest {
        policy,
        budget,
        prompt_tokens: 16,
        gen_tokens: 8,
        ctx_tokens: 128,
        stream: true,
    }
}

impl Seeds {
    /// Writes the seed model, profiles it on the CPU and a CPU-backed test device (a second
    /// or so) and plans it at half its weights.
    pub fn new() -> Result<Seeds> {
        let gguf = vec![tiny_gguf(false)?, tiny_gguf(true)?];
        let model = Model::from_gguf(GgufFile::from_bytes("seed.gguf", &gguf[0])?)?;
        Tokenizer::from_gguf(&model.file)?;
        Tokenizer::from_gguf(&GgufFile::from_bytes("seed-bpe.gguf", &gguf[1])?)?;
        let cpu = CpuBackend::new();
        let gpu = TestDevice::new(1 << 30);
        let mut opts = ProfileOptions::for_prompt(16);
        opts.reps = opts.reps.min(3);
        let prof = profile_model(&model, "seed.gguf", &cpu, Some(&gpu), 1, &opts)?;
        let profile = serde_json::to_string_pretty(&prof)
            .map_err(|e| Error::Msg(format!("the seed profile: {e}")))?;
        let placement = plan(&prof, &request(Policy::Oato, Budget::Percent(50.0)))?.to_json()?;
        let request = serde_json::json!({
            "model": "m",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "Name a colour.", "name": "u"}
            ],
            "max_tokens": 16, "max_completion_tokens": 16, "temperature": 0.7, "top_p": 0.9,
            "top_k": 40, "min_p": 0.05, "seed": 3, "stop": ["\n\n", "END"],
            "repeat_penalty": 1.1, "repeat_last_n": 64, "stream": true,
            "stream_options": {"include_usage": true}, "n": 1, "presence_penalty": 0,
            "frequency_penalty": 0, "logprobs": false, "ignore_eos": false,
            "user": "x"
        })
        .to_string();
        Ok(Seeds {
            gguf,
            profile,
            placement,
            request,
            model,
        })
    }
}

/// Runs one input through `target`: Ok when accepted, Err when rejected.
fn run_one(target: Target, seeds: &Seeds, input: &[u8]) -> Result<()> {
    match target {
        Target::Gguf => {
            let file = GgufFile::from_bytes("fuzz.gguf", input)?;
            let tok = Tokenizer::from_gguf(&file);
            let model = Model::from_gguf(file)?;
            let tok = tok?;
            for text in ["hi the", "<|im_start|>user\nab c<|im_end|>", "\u{0}é\n  x"] {
                let ids = tok.encode(text, true, true)?;
                tok.decode(&ids, true);
            }
            let _ = crate::profiler::target_ops(&model);
            let _ = crate::profiler::model_info(&model, "fuzz.gguf");
            Ok(())
        }
        Target::Profile => {
            let text = String::from_utf8_lossy(input);
            let prof = Profile::from_json(&text, "fuzz profile")?;
            for (policy, budget) in [
                (Policy::Oato, Budget::Percent(50.0)),
                (Policy::Oato, Budget::Bytes(1 << 20)),
                (Policy::LayerSplit, Budget::Percent(30.0)),
                (Policy::Flexgen, Budget::Percent(80.0)),
            ] {
                let _ = plan(&prof, &request(policy, budget));
            }
            Ok(())
        }
        Target::Placement => {
            let text = String::from_utf8_lossy(input);
            let p = Placement::from_json(&text, "fuzz placement")?;
            check(&p, &seeds.model, Ok(1 << 30))?;
            let map = device_map(&p, &seeds.model, 0, 1);
            let _ = map.crossings(&seeds.model, 0, 16);
            Ok(())
        }
        Target::Request => {
            use crate::server::api::{Endpoint, parse};
            // Read as both: a mutation that turns `messages` into `prompt` reaches the other.
            let chat = parse(input, Endpoint::Chat, 4096);
            let completion = parse(input, Endpoint::Completion, 4096);
            match (chat, completion) {
                (Err(e), Err(_)) => Err(Error::Msg(e.message)),
                _ => Ok(()),
            }
        }
    }
}

/// Integers worth writing over others: zero, one, the edges of each width.
const INTERESTING: [u64; 12] = [
    0,
    1,
    2,
    0x7f,
    0xff,
    0x7fff,
    0xffff,
    0x7fff_ffff,
    0xffff_ffff,
    0x8000_0000_0000_0000,
    u64::MAX,
    u64::MAX - 1,
];

/// Texts worth writing over a JSON number or string.
const JSON_SWAPS: [&str; 14] = [
    "0",
    "-1",
    "1e308",
    "-1e308",
    "1e-320",
    "18446744073709551615",
    "18446744073709551616",
    "4294967296",
    "null",
    "\"\"",
    "[]",
    "{}",
    "true",
    "\"x\"",
];

fn below(rng: &mut SplitMix64, n: usize) -> usize {
    (rng.next_u64() % n.max(1) as u64) as usize
}

/// One random change to `buf`; `json` adds JSON-aware swaps.
fn mutate(rng: &mut SplitMix64, buf: &mut Vec<u8>, json: bool) {
    let len = buf.len();
    let at = below(rng, len);
    match below(rng, if json { 8 } else { 7 }) {
        0 if len > 0 => buf[at] ^= 1 << below(rng, 8),
        1 if len > 0 => buf[at] = rng.next_u64() as u8,
        2 => {
            // An interesting integer, little-endian, 1/2/4/8 bytes wide.
            let v = INTERESTING[below(rng, INTERESTING.len())];
            let w = 1 << below(rng, 4);
            for (i, b) in v.to_le_bytes().iter().take(w).enumerate() {
                if let Some(x) = buf.get_mut(at + i) {
                    *x = *b;
                }
            }
        }
        3 if len > 0 => {
            let n = 1 + below(rng, 16.min(len - at));
            buf.drain(at..at + n);
        }
        4 => {
            let n = 1 + below(rng, 16);
            let fill = rng.next_u64() as u8;
            buf.splice(at..at, std::iter::repeat_n(fill, n));
        }
        5 if len > 1 => {
            // Copy a run from elsewhere over this place.
            let from = below(rng, len);
            let n = 1 + below(rng, 32.min(len - from));
            let run: Vec<u8> = buf[from..from + n].to_vec();
            for (i, b) in run.into_iter().enumerate() {
                if let Some(x) = buf.get_mut(at + i) {
                    *x = b;
                }
            }
        }
        6 => buf.truncate(at),
        7 => {
            // Replace the JSON token (number or string) at or after `at` with an awkward one.
            let Some(start) = buf[at..]
                .iter()
                .position(|c| c.is_ascii_digit() || *c == b'"' || *c == b'-')
                .map(|p| at + p)
            else {
                return;
            };
            let end = if buf[start] == b'"' {
                buf[start + 1..]
                    .iter()
                    .position(|&c| c == b'"')
                    .map_or(buf.len(), |p| start + p + 2)
            } else {
                buf[start..]
                    .iter()
                    .position(|c| !(c.is_ascii_digit() || b"-+.eE".contains(c)))
                    .map_or(buf.len(), |p| start + p)
            };
            let swap = JSON_SWAPS[below(rng, JSON_SWAPS.len())];
            buf.splice(start..end, swap.bytes());
        }
        _ => {}
    }
}

/// JSON Pointers of every value in `v`.
fn pointers(v: &serde_json::Value, at: String, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, x) in m {
                pointers(
                    x,
                    format!("{at}/{}", k.replace('~', "~0").replace('/', "~1")),
                    out,
                );
            }
        }
        serde_json::Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                pointers(x, format!("{at}/{i}"), out);
            }
        }
        _ => {}
    }
    out.push(at);
}

/// One structural change to a JSON document, which stays valid JSON: a value replaced by an
/// awkward one or by another value of the document, an object key removed, an array element
/// removed or repeated.
fn mutate_json(rng: &mut SplitMix64, doc: &mut serde_json::Value) {
    use serde_json::Value as J;
    let mut ptrs = Vec::new();
    pointers(doc, String::new(), &mut ptrs);
    let at = &ptrs[below(rng, ptrs.len())];
    let other = doc.pointer(&ptrs[below(rng, ptrs.len())]).cloned();
    let awkward = match below(rng, 10) {
        0 => J::from(0),
        1 => J::from(-1),
        2 => J::from(u64::MAX),
        3 => J::from(1e300),
        4 => J::from(-1e-300),
        5 => J::from(1u64 << 32),
        6 => J::Null,
        7 => J::from(""),
        8 => J::from(vec![J::from(1)]),
        _ => other.unwrap_or(J::Null),
    };
    let (parent, key) = at.rsplit_once('/').unwrap_or(("", ""));
    match (below(rng, 4), doc.pointer_mut(parent)) {
        (0, Some(J::Object(m))) => {
            m.remove(&key.replace("~1", "/").replace("~0", "~"));
        }
        (1, Some(J::Array(a))) if !a.is_empty() => {
            let i = key.parse::<usize>().unwrap_or(0).min(a.len() - 1);
            if below(rng, 2) == 0 {
                a.remove(i);
            } else {
                let x = a[i].clone();
                a.insert(i, x);
            }
        }
        _ => {
            if let Some(slot) = doc.pointer_mut(at) {
                *slot = awkward;
            }
        }
    }
}

/// A panic's message.
fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

/// Runs `inputs` mutated inputs through `target`, seeded by `seed`: each a seed file with 1 to 8
/// byte mutations, fewer more often (GGUF mutations land in the header and metadata 7 times in
/// 8; half the JSON inputs get structural changes instead, which keep them valid JSON). Panics are caught
/// and kept (with the panic hook silenced while the run lasts).
pub fn fuzz(target: Target, seeds: &Seeds, inputs: u64, seed: u64) -> Report {
    let mut rng = SplitMix64::new(seed ^ (target as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let started = Instant::now();
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let mut report = Report {
        target,
        inputs: 0,
        accepted: 0,
        rejected: 0,
        panics: Vec::new(),
        secs: 0.0,
    };
    // The GGUF header (everything before the tensor data) of each seed.
    let header_len: Vec<usize> = seeds
        .gguf
        .iter()
        .map(|g| GgufFile::from_bytes("seed.gguf", g).map_or(g.len(), |f| f.header_bytes().len()))
        .collect();
    let parse = |t: &str| serde_json::from_str(t).unwrap_or(serde_json::Value::Null);
    let (profile_doc, placement_doc) = (parse(&seeds.profile), parse(&seeds.placement));
    let request_doc = parse(&seeds.request);
    for _ in 0..inputs {
        let (mut buf, json, focus) = match target {
            Target::Gguf => {
                let i = below(&mut rng, seeds.gguf.len());
                (seeds.gguf[i].clone(), false, header_len[i])
            }
            Target::Profile | Target::Placement | Target::Request => {
                let (doc, text) = match target {
                    Target::Profile => (&profile_doc, &seeds.profile),
                    Target::Placement => (&placement_doc, &seeds.placement),
                    _ => (&request_doc, &seeds.request),
                };
                // Half the inputs: structural changes that keep the JSON valid, so that the
                // checks past the parser see them.
                if below(&mut rng, 2) == 0 {
                    let mut d = doc.clone();
                    for _ in 0..1 + below(&mut rng, 3) {
                        mutate_json(&mut rng, &mut d);
                    }
                    (d.to_string().into_bytes(), true, usize::MAX)
                } else {
                    (text.as_bytes().to_vec(), true, 0)
                }
            }
        };
        // 1 to 8 mutations, fewer more often: most inputs stay close to a valid file.
        let n_mut = 1 + (rng.next_u64() | 0x80).trailing_zeros().min(7) as usize;
        // (`focus` MAX: a structural JSON input, left as it is.)
        for _ in 0..if focus == usize::MAX { 0 } else { n_mut } {
            if focus > 0 && below(&mut rng, 8) != 0 {
                // Mutate within the header: cut it off, mutate, put the data back.
                let tail = buf.split_off(focus.min(buf.len()));
                mutate(&mut rng, &mut buf, json);
                buf.extend_from_slice(&tail);
            } else {
                mutate(&mut rng, &mut buf, json);
            }
        }
        report.inputs += 1;
        match catch_unwind(AssertUnwindSafe(|| run_one(target, seeds, &buf))) {
            Ok(Ok(())) => report.accepted += 1,
            Ok(Err(_)) => report.rejected += 1,
            Err(p) => {
                if report.panics.len() < 16 {
                    report.panics.push(Found {
                        input: buf,
                        message: panic_message(&*p),
                    });
                }
            }
        }
    }
    std::panic::set_hook(hook);
    report.secs = started.elapsed().as_secs_f64();
    report
}

/// Runs `input` through `target` once, panics propagating: to replay a found input.
pub fn replay(target: Target, seeds: &Seeds, input: &[u8]) -> Result<()> {
    run_one(target, seeds, input)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_seeds_are_valid_inputs() {
        let s = Seeds::new().unwrap();
        for g in &s.gguf {
            replay(Target::Gguf, &s, g).unwrap();
        }
        replay(Target::Profile, &s, s.profile.as_bytes()).unwrap();
        replay(Target::Placement, &s, s.placement.as_bytes()).unwrap();
        replay(Target::Request, &s, s.request.as_bytes()).unwrap();
    }

    #[test]
    fn mutations_change_the_input_and_stay_reproducible() {
        let base = b"{\"a\": 12, \"b\": \"text\"}".to_vec();
        let run = |seed| {
            let mut rng = SplitMix64::new(seed);
            let mut b = base.clone();
            for _ in 0..4 {
                mutate(&mut rng, &mut b, true);
            }
            b
        };
        assert_eq!(run(7), run(7));
        let changed = (0..32).filter(|&s| run(s) != base).count();
        assert!(
            changed >= 28,
            "{changed} of 32 mutated inputs differ from the seed"
        );
    }
}

//! Unit tests of the whole tokenizer on tiny hand-made vocabularies (expected ids worked out by hand).

use std::collections::HashMap;

use super::*;
use crate::gguf::{Value, ValueType};

fn strings(items: &[&str]) -> Value {
    Value::Array(
        ValueType::String,
        items.iter().map(|s| Value::String(s.to_string())).collect(),
    )
}

fn meta_from(pairs: Vec<(&str, Value)>) -> HashMap<String, Value> {
    pairs.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
}

fn build(meta: &HashMap<String, Value>) -> Result<Tokenizer> {
    Tokenizer::from_metadata(|k| meta.get(k))
}

/// A SentencePiece vocabulary: <unk> <s> </s>, 256 byte tokens (ids 3 + byte), then a few pieces.
fn spm_meta() -> HashMap<String, Value> {
    let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
    let mut scores = vec![0.0f32; 3];
    let mut types = vec![2, 3, 3];
    for b in 0..256 {
        tokens.push(format!("<0x{b:02X}>"));
        scores.push(0.0);
        types.push(6);
    }
    // 259      260   261   262   263     264    265     266    267         268
    for (t, s, ty) in [
        ("▁", -1.0, 1),
        ("a", -2.0, 1),
        ("b", -2.0, 1),
        ("c", -2.0, 1),
        ("▁a", -0.5, 1),
        ("ab", -0.3, 1),
        ("▁ab", -0.1, 1),
        ("bc", -0.2, 1),
        ("<|user|>", 0.0, 4),
        ("<ctl>", 0.0, 3),
    ] {
        tokens.push(t.into());
        scores.push(s);
        types.push(ty);
    }
    let toks: Vec<&str> = tokens.iter().map(String::as_str).collect();
    meta_from(vec![
        ("tokenizer.ggml.model", Value::String("llama".into())),
        ("tokenizer.ggml.tokens", strings(&toks)),
        (
            "tokenizer.ggml.scores",
            Value::Array(ValueType::F32, scores.into_iter().map(Value::F32).collect()),
        ),
        (
            "tokenizer.ggml.token_type",
            Value::Array(ValueType::I32, types.into_iter().map(Value::I32).collect()),
        ),
    ])
}

#[test]
fn spm_merges_by_score_with_space_prefix() {
    let t = build(&spm_meta()).unwrap();
    assert_eq!((t.bos(), t.eos(), t.add_bos()), (Some(1), Some(2), true));
    // "▁ab▁c": "ab" (-0.3) beats "▁a" (-0.5), then "▁ab" (-0.1); "▁" and "c" stay alone
    assert_eq!(t.encode("ab c", true, false).unwrap(), [1, 265, 259, 262]);
    assert_eq!(t.encode("ab c", false, false).unwrap(), [265, 259, 262]);
    assert_eq!(t.encode("", true, false).unwrap(), [1]);
    assert_eq!(t.encode("", false, false).unwrap(), Vec::<u32>::new());
    // the space prefix is dropped from the first token only when no BOS precedes it (llama.cpp)
    assert_eq!(t.decode(&[265, 259, 262], false), "ab c");
    assert_eq!(t.decode(&[1, 265, 259, 262], false), " ab c");
    assert_eq!(t.decode(&[1, 265, 259, 262], true), "<s> ab c");
}

#[test]
fn spm_byte_fallback() {
    let t = build(&spm_meta()).unwrap();
    // é = C3 A9, no token for it
    assert_eq!(
        t.encode("é", false, false).unwrap(),
        [259, 3 + 0xC3, 3 + 0xA9]
    );
    assert_eq!(t.decode(&[259, 3 + 0xC3, 3 + 0xA9], false), "é");
    assert_eq!(t.token_bytes(3 + 0xC3, false), [0xC3]);
    assert_eq!(t.token_bytes(263, false), b" a");
}

#[test]
fn spm_special_tokens() {
    let t = build(&spm_meta()).unwrap();
    // user-defined tokens are always cut out; the text after one gets a space prefix again
    assert_eq!(
        t.encode("a<|user|>b", false, false).unwrap(),
        [263, 267, 259, 261]
    );
    // control tokens only with parse_special; otherwise their text is spelt out
    assert_eq!(t.encode("a<ctl>", false, true).unwrap(), [263, 268]);
    assert_eq!(
        t.encode("a<ctl>", false, false).unwrap(),
        [
            263,
            3 + b'<' as u32,
            262,
            3 + b't' as u32,
            3 + b'l' as u32,
            3 + b'>' as u32
        ]
    );
    assert_eq!(t.token_bytes(268, false), b"");
    assert_eq!(t.token_bytes(268, true), b"<ctl>");
    assert_eq!(t.token_bytes(267, false), b"<|user|>");
    assert!(t.is_eog(2) && !t.is_eog(1) && !t.is_eog(268));
}

#[test]
fn spm_metadata_overrides() {
    let mut m = spm_meta();
    m.insert("tokenizer.ggml.add_space_prefix".into(), Value::Bool(false));
    m.insert("tokenizer.ggml.add_bos_token".into(), Value::Bool(false));
    m.insert("tokenizer.ggml.add_eos_token".into(), Value::Bool(true));
    let t = build(&m).unwrap();
    // no prefix: "ab" then "▁c" -> "ab", "▁", "c"
    assert_eq!(t.encode("ab c", true, false).unwrap(), [264, 259, 262, 2]);
    assert_eq!(t.decode(&[259, 262], false), " c");
}

/// A byte-level BPE vocabulary.
fn bpe_meta(pre: Option<&str>) -> HashMap<String, Value> {
    //            0                1               2             3    4    5    6     7      8    9    10   11    12
    let toks = [
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "h",
        "i",
        "Ġ",
        "hi",
        "Ġhi",
        "1",
        "2",
        "Ċ",
        "12",
        ".",
    ];
    let mut types = vec![1; toks.len()];
    types[..3].fill(3);
    let mut m = meta_from(vec![
        ("tokenizer.ggml.model", Value::String("gpt2".into())),
        ("tokenizer.ggml.tokens", strings(&toks)),
        (
            "tokenizer.ggml.token_type",
            Value::Array(ValueType::I32, types.into_iter().map(Value::I32).collect()),
        ),
        ("tokenizer.ggml.merges", strings(&["h i", "Ġ hi", "1 2"])),
        ("tokenizer.ggml.eos_token_id", Value::U32(2)),
    ]);
    if let Some(p) = pre {
        m.insert("tokenizer.ggml.pre".into(), Value::String(p.into()));
    }
    m
}

#[test]
fn bpe_gpt2_and_smollm_pretokenisers() {
    let t = build(&bpe_meta(Some("gpt-2"))).unwrap();
    // words "hi", " hi", " 12", "\n"; " 12" has no "Ġ1" merge
    assert_eq!(
        t.encode("hi hi 12\n", false, false).unwrap(),
        [6, 7, 5, 11, 10]
    );
    let t = build(&bpe_meta(Some("smollm"))).unwrap();
    // digits are split one by one first, so "12" never forms
    assert_eq!(
        t.encode("hi hi 12\n", false, false).unwrap(),
        [6, 7, 5, 8, 9, 10]
    );
    assert_eq!(t.decode(&[6, 7, 5, 8, 9, 10], false), "hi hi 12\n");
    // no add_bos_token: BPE defaults to no BOS; the default BOS id (11) is llama.cpp's
    assert!(!t.add_bos());
    assert_eq!(t.encode("hi", true, false).unwrap(), [6]);
}

#[test]
fn bpe_special_tokens_and_eog() {
    let t = build(&bpe_meta(Some("smollm"))).unwrap();
    assert_eq!(
        t.encode("<|im_start|>hi<|im_end|>", false, true).unwrap(),
        [1, 6, 2]
    );
    assert_eq!(t.decode(&[1, 6, 7, 2], false), "hi hi");
    assert_eq!(t.decode(&[1, 6, 7, 2], true), "<|im_start|>hi hi<|im_end|>");
    assert_eq!(t.eog_ids(), [0, 2]);
    assert_eq!(t.eos(), Some(2));
    assert!(
        t.summary().contains("pre smollm, 13 tokens, 3 merges"),
        "{}",
        t.summary()
    );
}

#[test]
fn bpe_missing_pre_is_default_and_unknown_pre_errors() {
    let t = build(&bpe_meta(None)).unwrap();
    assert_eq!(t.encode("hi 12", false, false).unwrap(), [6, 5, 11]);
    let err = build(&bpe_meta(Some("no-such-pre")))
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("\"no-such-pre\""), "{err}");
}

#[test]
fn bad_metadata_is_an_error_naming_the_key() {
    let mut m = bpe_meta(Some("gpt-2"));
    m.insert(
        "tokenizer.ggml.token_type".into(),
        Value::Array(ValueType::I32, vec![Value::I32(1)]),
    );
    let err = build(&m).err().unwrap().to_string();
    assert!(
        err.contains("token_type has 1 entries for 13 tokens"),
        "{err}"
    );
    let mut m = bpe_meta(Some("gpt-2"));
    m.remove("tokenizer.ggml.merges");
    assert!(
        build(&m)
            .err()
            .unwrap()
            .to_string()
            .contains("tokenizer.ggml.merges")
    );
    let mut m = bpe_meta(Some("gpt-2"));
    m.insert("tokenizer.ggml.model".into(), Value::String("bert".into()));
    assert!(build(&m).err().unwrap().to_string().contains("\"bert\""));
    let mut m = bpe_meta(Some("gpt-2"));
    m.insert("tokenizer.ggml.bos_token_id".into(), Value::U32(999));
    let t = build(&m).unwrap();
    assert_eq!(t.bos(), Some(11));
    assert_eq!(t.warnings().len(), 1);
    // ids past the vocabulary print nothing instead of panicking
    assert_eq!(t.token_bytes(999, true), b"");
    assert_eq!(t.decode(&[999, 6], false), "hi");
}

#[test]
fn clean_up_spaces_as_llama_cpp() {
    let c = |s: &str| String::from_utf8(clean_up_spaces(s.as_bytes())).unwrap();
    assert_eq!(c("Hello , world . Yes ?"), "Hello, world. Yes?");
    assert_eq!(c("it ' s"), "it's");
    assert_eq!(c("we 're here , he 's"), "we're here, he's");
    assert_eq!(c("don 't"), "don 't");
    assert_eq!(c(""), "");
}

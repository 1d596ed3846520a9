//! Reading a GGUF vocabulary: token texts, scores and types, the model kind and its pre-tokeniser,
//! special token ids with llama.cpp's defaults per model kind, and the special tokens llama.cpp finds
//! by their text (end of turn, fill-in-the-middle, end of generation).

use std::collections::HashMap;

use super::pretok;
use super::{
    ATTR_BYTE, ATTR_CONTROL, ATTR_NORMAL, ATTR_RSTRIP, ATTR_UNKNOWN, ATTR_UNUSED,
    ATTR_USER_DEFINED, Model, Tokenizer, bpe,
};
use crate::error::{Error, Result};
use crate::gguf::{GgufFile, Value};

/// Texts that mark end-of-turn tokens when the metadata names none (llama.cpp's list).
const EOT_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
];

/// Texts of tokens that end generation (llama.cpp's list).
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

// Fill-in-the-middle tokens found by text: (metadata key, texts, ends generation).
const FIM_TEXTS: &[(&str, &[&str], bool)] = &[
    (
        "fim_pre",
        &[
            "<|fim_prefix|>",
            "<fim-prefix>",
            "<fim_prefix>",
            "<｜fim▁begin｜>",
            "<PRE>",
            "▁<PRE>",
            "<|code_prefix|>",
            "<|prefix|>",
        ],
        false,
    ),
    (
        "fim_suf",
        &[
            "<|fim_suffix|>",
            "<fim-suffix>",
            "<fim_suffix>",
            "<｜fim▁hole｜>",
            "<SUF>",
            "▁<SUF>",
            "<|code_suffix|>",
            "<|suffix|>",
        ],
        false,
    ),
    (
        "fim_mid",
        &[
            "<|fim_middle|>",
            "<fim-middle>",
            "<fim_middle>",
            "<｜fim▁end｜>",
            "<MID>",
            "▁<MID>",
            "<|code_middle|>",
            "<|middle|>",
        ],
        false,
    ),
    (
        "fim_pad",
        &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"],
        true,
    ),
    (
        "fim_rep",
        &[
            "<|fim_repo|>",
            "<|repo_name|>",
            "<fim-repo>",
            "<REPO>",
            "<reponame>",
        ],
        true,
    ),
    ("fim_sep", &["<|file_sep|>"], true),
];

/// Metadata access with errors that name the key.
struct Meta<'a, F: Fn(&str) -> Option<&'a Value>>(F);

impl<'a, F: Fn(&str) -> Option<&'a Value>> Meta<'a, F> {
    fn str(&self, key: &str) -> Result<Option<&'a str>> {
        match (self.0)(key) {
            None => Ok(None),
            Some(v) => v.as_str().map(Some).ok_or_else(|| bad(key, "a string", v)),
        }
    }
    fn bool(&self, key: &str) -> Result<Option<bool>> {
        match (self.0)(key) {
            None => Ok(None),
            Some(v) => v.as_bool().map(Some).ok_or_else(|| bad(key, "a bool", v)),
        }
    }
    fn uint(&self, key: &str) -> Result<Option<u64>> {
        match (self.0)(key) {
            None => Ok(None),
            Some(v) => match v.as_int() {
                Some(i) if i >= 0 && i <= u64::MAX as i128 => Ok(Some(i as u64)),
                _ => Err(bad(key, "a non-negative integer", v)),
            },
        }
    }
    fn array(&self, key: &str) -> Result<Option<&'a [Value]>> {
        match (self.0)(key) {
            None => Ok(None),
            Some(v) => v
                .as_array()
                .map(Some)
                .ok_or_else(|| bad(key, "an array", v)),
        }
    }
}

fn bad(key: &str, want: &str, v: &Value) -> Error {
    Error::Tokenizer(format!(
        "metadata {key:?} should be {want}, found {}",
        v.summary()
    ))
}

impl Tokenizer {
    /// The tokenizer of a GGUF file's `tokenizer.*` metadata.
    pub fn from_gguf(f: &GgufFile) -> Result<Self> {
        Self::from_metadata(|k| f.get(k))
    }

    /// The tokenizer described by metadata `get(key)` (the same keys as in a GGUF file).
    pub fn from_metadata<'a>(get: impl Fn(&str) -> Option<&'a Value>) -> Result<Self> {
        let meta = Meta(get);
        let mut warnings = Vec::new();
        let kind = meta
            .str("tokenizer.ggml.model")?
            .ok_or_else(|| Error::Tokenizer("no tokenizer.ggml.model in the metadata".into()))?;
        let pre_name = meta.str("tokenizer.ggml.pre")?.unwrap_or("");

        let (texts, scores, mut attrs) = read_tokens(&meta)?;
        let n = texts.len();
        let mut token_to_id = HashMap::with_capacity(n);
        for (i, t) in texts.iter().enumerate() {
            token_to_id.insert(t.clone(), i as u32);
        }

        // model kind and its defaults
        let pre = match kind {
            "gpt2" => Some(pretok::pre_config(pre_name).ok_or_else(|| {
                Error::Tokenizer(format!(
                    "unknown pre-tokenizer tokenizer.ggml.pre = {pre_name:?}; supported: {}",
                    pretok::SUPPORTED_PRE
                ))
            })?),
            "llama" => None,
            other => {
                return Err(Error::Tokenizer(format!(
                    "tokenizer.ggml.model = {other:?} is not supported (supported: gpt2, llama)"
                )));
            }
        };
        let (mut bos, mut eos, mut unk, mut add_bos, mut add_space_prefix, clean_spaces) =
            match &pre {
                Some(p) => (
                    if p.no_bos { None } else { Some(11) },
                    Some(11),
                    None,
                    p.add_bos,
                    false,
                    p.clean_spaces,
                ),
                None => (Some(1), Some(2), Some(0), true, true, false),
            };
        let in_range = |id: Option<u64>| id.filter(|&i| (i as usize) < n);
        for slot in [&mut bos, &mut eos, &mut unk] {
            *slot = in_range(slot.map(u64::from)).map(|i| i as u32);
        }
        let mut read_id = |key: &str, slot: &mut Option<u32>| -> Result<()> {
            let full = format!("tokenizer.ggml.{key}_token_id");
            if let Some(id) = meta.uint(&full)? {
                if (id as usize) < n {
                    *slot = Some(id as u32);
                } else {
                    warnings.push(format!(
                        "{full} = {id} is out of the vocabulary ({n} tokens); ignored"
                    ));
                }
            }
            Ok(())
        };
        let (mut eot, mut eom) = (None, None);
        read_id("bos", &mut bos)?;
        read_id("eos", &mut eos)?;
        read_id("eot", &mut eot)?;
        read_id("eom", &mut eom)?;
        read_id("unknown", &mut unk)?;
        let mut fim: Vec<Option<u32>> = vec![None; FIM_TEXTS.len()];
        for ((key, _, _), slot) in FIM_TEXTS.iter().zip(fim.iter_mut()) {
            read_id(key, slot)?;
        }
        // deprecated names of the first three
        for (key, slot) in ["prefix", "suffix", "middle"].iter().zip(fim.iter_mut()) {
            read_id(key, slot)?;
        }
        add_bos = meta
            .bool("tokenizer.ggml.add_bos_token")?
            .unwrap_or(add_bos);
        let add_eos = meta.bool("tokenizer.ggml.add_eos_token")?.unwrap_or(false);
        add_space_prefix = meta
            .bool("tokenizer.ggml.add_space_prefix")?
            .unwrap_or(add_space_prefix);

        let eog = find_special_tokens(&texts, &mut attrs, eos, eot, eom, fim);

        let mut special_cache: Vec<u32> = (0..n as u32)
            .filter(|&i| attrs[i as usize] & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN) != 0)
            .collect();
        special_cache.sort_by_key(|&i| std::cmp::Reverse(texts[i as usize].len()));

        // Phi-3: special tokens swallow the whitespace after them
        let name = meta
            .str("general.name")
            .ok()
            .flatten()
            .unwrap_or("")
            .to_lowercase();
        if name.contains("phi-3") || name.contains("phi3") {
            for &i in &special_cache {
                attrs[i as usize] |= ATTR_RSTRIP;
            }
            for (t, on) in [
                ("</s>", true),
                ("<unk>", false),
                ("<s>", false),
                ("<|endoftext|>", false),
            ] {
                if let Some(&i) = token_to_id.get(t) {
                    if on {
                        attrs[i as usize] |= ATTR_RSTRIP;
                    } else {
                        attrs[i as usize] &= !ATTR_RSTRIP;
                    }
                }
            }
        }

        let model = match pre {
            Some(pre) => {
                let merges = meta.array("tokenizer.ggml.merges")?.ok_or_else(|| {
                    Error::Tokenizer("no tokenizer.ggml.merges in the metadata".into())
                })?;
                let merge_texts = merges
                    .iter()
                    .enumerate()
                    .map(|(i, m)| {
                        m.as_str().ok_or_else(|| {
                            Error::Tokenizer(format!(
                                "tokenizer.ggml.merges[{i}] should be a string, found {}",
                                m.summary()
                            ))
                        })
                    })
                    .collect::<Result<Vec<&str>>>()?;
                let bpe = bpe::Bpe::new(
                    &token_to_id,
                    n,
                    merge_texts.iter().copied(),
                    pre.ignore_merges,
                )?;
                Model::Bpe {
                    bpe: Box::new(bpe),
                    pre,
                    pre_name: pre_name.to_string(),
                    n_merges: merges.len(),
                }
            }
            None => {
                let mut byte_tokens = Box::new([None; 256]);
                for (b, slot) in byte_tokens.iter_mut().enumerate() {
                    let one = [b as u8];
                    *slot = token_to_id
                        .get(&format!("<0x{b:02X}>"))
                        .or_else(|| {
                            std::str::from_utf8(&one)
                                .ok()
                                .and_then(|s| token_to_id.get(s))
                        })
                        .copied()
                        .or(unk);
                }
                Model::Spm { byte_tokens }
            }
        };

        let mut tok = Tokenizer {
            model,
            texts,
            scores,
            attrs,
            token_to_id,
            pieces: Vec::new(),
            special_cache,
            bos,
            eos,
            eog,
            add_bos,
            add_eos,
            add_space_prefix,
            clean_spaces,
            warnings,
        };
        tok.pieces = (0..n).map(|i| tok.piece(i).into_boxed_slice()).collect();
        Ok(tok)
    }
}

/// Token texts (empty ones named `[EMPTY_i]`, as llama.cpp does), scores (empty when absent) and
/// attributes (all normal when `tokenizer.ggml.token_type` is absent).
fn read_tokens<'a, F: Fn(&str) -> Option<&'a Value>>(
    meta: &Meta<'a, F>,
) -> Result<(Vec<String>, Vec<f32>, Vec<u16>)> {
    let tokens = meta
        .array("tokenizer.ggml.tokens")?
        .ok_or_else(|| Error::Tokenizer("no tokenizer.ggml.tokens in the metadata".into()))?;
    if tokens.is_empty() {
        return Err(Error::Tokenizer("tokenizer.ggml.tokens is empty".into()));
    }
    let n = tokens.len();
    if n >= (u32::MAX / 2) as usize {
        return Err(Error::Tokenizer(format!(
            "tokenizer.ggml.tokens has {n} entries, too many"
        )));
    }
    let mut texts = Vec::with_capacity(n);
    for (i, t) in tokens.iter().enumerate() {
        let s = t.as_str().ok_or_else(|| {
            Error::Tokenizer(format!(
                "tokenizer.ggml.tokens[{i}] should be a string, found {}",
                t.summary()
            ))
        })?;
        texts.push(if s.is_empty() {
            format!("[EMPTY_{i}]")
        } else {
            s.to_string()
        });
    }
    let scores = match meta.array("tokenizer.ggml.scores")? {
        None => Vec::new(),
        Some(a) if a.len() < n => {
            return Err(Error::Tokenizer(format!(
                "tokenizer.ggml.scores has {} entries for {n} tokens",
                a.len()
            )));
        }
        Some(a) => a
            .iter()
            .take(n)
            .enumerate()
            .map(|(i, v)| {
                v.as_f64().map(|x| x as f32).ok_or_else(|| {
                    Error::Tokenizer(format!(
                        "tokenizer.ggml.scores[{i}] should be a number, found {}",
                        v.summary()
                    ))
                })
            })
            .collect::<Result<_>>()?,
    };
    let attrs = match meta.array("tokenizer.ggml.token_type")? {
        None => vec![ATTR_NORMAL; n],
        Some(a) if a.len() < n => {
            return Err(Error::Tokenizer(format!(
                "tokenizer.ggml.token_type has {} entries for {n} tokens",
                a.len()
            )));
        }
        Some(a) => a
            .iter()
            .take(n)
            .enumerate()
            .map(|(i, v)| match v.as_int() {
                Some(1) => Ok(ATTR_NORMAL),
                Some(2) => Ok(ATTR_UNKNOWN),
                Some(3) => Ok(ATTR_CONTROL),
                Some(4) => Ok(ATTR_USER_DEFINED),
                Some(5) => Ok(ATTR_UNUSED),
                Some(6) => Ok(ATTR_BYTE),
                Some(_) => Ok(0),
                None => Err(Error::Tokenizer(format!(
                    "tokenizer.ggml.token_type[{i}] should be an integer, found {}",
                    v.summary()
                ))),
            })
            .collect::<Result<_>>()?,
    };
    Ok((texts, scores, attrs))
}

/// The special tokens llama.cpp finds by their text when the metadata names none (end of turn,
/// end of message, fill-in-the-middle; they become control tokens), and from them the sorted list of
/// end-of-generation tokens.
fn find_special_tokens(
    texts: &[String],
    attrs: &mut [u16],
    eos: Option<u32>,
    mut eot: Option<u32>,
    mut eom: Option<u32>,
    mut fim: Vec<Option<u32>>,
) -> Vec<u32> {
    let n = texts.len();
    let find = |list: &[&str]| (0..n as u32).find(|&i| list.contains(&texts[i as usize].as_str()));
    let mut eog: Vec<u32> = Vec::new();
    if eot.is_none() {
        eot = find(EOT_TEXTS);
        if let Some(i) = eot {
            attrs[i as usize] |= ATTR_CONTROL;
        }
    }
    if eom.is_none() {
        eom = find(&["<|eom_id|>"]);
        if let Some(i) = eom {
            attrs[i as usize] |= ATTR_CONTROL;
        }
    }
    for ((_, list, ends), slot) in FIM_TEXTS.iter().zip(fim.iter_mut()) {
        if slot.is_none() {
            *slot = find(list);
            if let Some(i) = *slot {
                attrs[i as usize] |= ATTR_CONTROL;
            }
        }
        if let (true, Some(i)) = (*ends, *slot) {
            eog.push(i);
        }
    }
    for (i, t) in texts.iter().enumerate() {
        if EOG_TEXTS.contains(&t.as_str()) {
            eog.push(i as u32);
            attrs[i] |= ATTR_CONTROL;
        }
        // gpt-oss: always printed
        if matches!(
            t.as_str(),
            "<|channel|>" | "<|message|>" | "<|start|>" | "<|constrain|>"
        ) {
            attrs[i] = ATTR_USER_DEFINED;
        }
    }
    eog.extend([eos, eot, eom].into_iter().flatten());
    eog.sort_unstable();
    eog.dedup();
    let has = |eog: &[u32], text: &str| eog.iter().any(|&i| texts[i as usize] == text);
    // o200k_harmony / solar-open: "<|end|>" ends a message, not the generation
    let call = has(&eog, "<|call|>") || has(&eog, "<|calls|>");
    if call
        && has(&eog, "<|end|>")
        && (has(&eog, "<|return|>") || has(&eog, "<|flush|>"))
        && let Some(pos) = eog.iter().position(|&i| texts[i as usize] == "<|end|>")
    {
        attrs[eog[pos] as usize] = ATTR_USER_DEFINED;
        eog.remove(pos);
    }
    // gemma4 / plamo: "</s>" is an ordinary token
    if (has(&eog, "<|tool_response>") || has(&eog, "<|plamo:eos|>"))
        && let Some(pos) = eog.iter().position(|&i| texts[i as usize] == "</s>")
    {
        attrs[eog[pos] as usize] = ATTR_NORMAL;
        eog.remove(pos);
    }

    eog
}

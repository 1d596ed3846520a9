//! Tokenizers built from GGUF vocabularies, giving the token ids llama.cpp gives; chat templates.
//!
//! Two vocabulary kinds (`tokenizer.ggml.model`):
//! * `gpt2`: byte-level BPE with a pre-tokeniser chosen by `tokenizer.ggml.pre` (`pretok.rs`,
//!   `bpe.rs`);
//! * `llama`: SentencePiece-style BPE over scores, with `<0xNN>` byte fallback (`spm.rs`).
//!
//! Special tokens (control, user-defined) are cut out of the text before either runs. `load.rs`
//! reads the metadata with llama.cpp's defaults (BOS/EOS, which tokens end generation); `chat.rs`
//! renders chat templates.

mod bpe;
pub mod chat;
mod load;
mod pretok;
mod spm;
mod unicode;

use std::collections::HashMap;
use std::ops::Range;

pub use chat::{ChatMessage, render_chat};

use crate::error::{Error, Result};
use pretok::PreConfig;

// Token attributes, as llama.cpp derives them from `tokenizer.ggml.token_type`.
const ATTR_UNKNOWN: u16 = 1 << 0;
const ATTR_UNUSED: u16 = 1 << 1;
const ATTR_NORMAL: u16 = 1 << 2;
const ATTR_CONTROL: u16 = 1 << 3;
const ATTR_USER_DEFINED: u16 = 1 << 4;
const ATTR_BYTE: u16 = 1 << 5;
const ATTR_LSTRIP: u16 = 1 << 6;
const ATTR_RSTRIP: u16 = 1 << 7;

/// The vocabulary kind and what its encoder needs.
enum Model {
    /// Byte-level BPE and its pre-tokeniser.
    Bpe {
        bpe: Box<bpe::Bpe>,
        pre: PreConfig,
        pre_name: String,
        n_merges: usize,
    },
    /// SentencePiece-style: scores, and the token of each byte for fallback.
    Spm {
        byte_tokens: Box<[Option<u32>; 256]>,
    },
}

/// A piece of the input: raw text (byte range) or a special token cut out of it.
enum Fragment {
    Text(Range<usize>),
    Token(u32),
}

/// A GGUF vocabulary, ready to encode text and print tokens.
pub struct Tokenizer {
    model: Model,
    texts: Vec<String>,
    scores: Vec<f32>,
    attrs: Vec<u16>,
    token_to_id: HashMap<String, u32>,
    /// What each token prints as when special tokens are shown.
    pieces: Vec<Box<[u8]>>,
    /// Control, user-defined and unknown tokens, longest text first: matched in this order.
    special_cache: Vec<u32>,
    bos: Option<u32>,
    eos: Option<u32>,
    eog: Vec<u32>,
    add_bos: bool,
    add_eos: bool,
    add_space_prefix: bool,
    clean_spaces: bool,
    warnings: Vec<String>,
}

impl Tokenizer {
    /// Token ids of `text`. `add_special`: prepend BOS / append EOS where the vocabulary asks for
    /// them (`tokenizer.ggml.add_bos_token` / `add_eos_token`). `parse_special`: control tokens
    /// written in the text (`<|im_start|>`) become those tokens; user-defined tokens always do.
    pub fn encode(&self, text: &str, add_special: bool, parse_special: bool) -> Result<Vec<u32>> {
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if add_special && self.add_bos {
            out.push(self.bos.ok_or_else(|| {
                Error::Tokenizer("add_bos_token is set but the vocabulary has no BOS token".into())
            })?);
        }
        let fragments = self.partition(text, parse_special);
        match &self.model {
            Model::Bpe { bpe, pre, .. } => {
                let mut scratch = bpe::Scratch::default();
                for f in &fragments {
                    match f {
                        Fragment::Token(id) => out.push(*id),
                        Fragment::Text(r) => {
                            let t = &text[r.clone()];
                            for w in pretok::split(t, &pre.splits) {
                                bpe.encode_word(
                                    &t.as_bytes()[w],
                                    &self.token_to_id,
                                    &mut scratch,
                                    &mut out,
                                );
                            }
                        }
                    }
                }
            }
            Model::Spm { byte_tokens } => {
                let mut prev_special = true; // the first piece gets the space prefix
                let mut buf = String::new();
                for f in &fragments {
                    match f {
                        Fragment::Token(id) => {
                            out.push(*id);
                            prev_special = true;
                        }
                        Fragment::Text(r) => {
                            buf.clear();
                            if self.add_space_prefix && prev_special {
                                buf.push('▁');
                            }
                            for c in text[r.clone()].chars() {
                                buf.push(if c == ' ' { '▁' } else { c });
                            }
                            spm::encode(
                                &buf,
                                &self.token_to_id,
                                &self.scores,
                                |b| byte_tokens[b as usize],
                                &mut out,
                            );
                            prev_special = false;
                        }
                    }
                }
            }
        }
        if add_special && self.add_eos {
            out.push(self.eos.ok_or_else(|| {
                Error::Tokenizer("add_eos_token is set but the vocabulary has no EOS token".into())
            })?);
        }
        Ok(out)
    }

    /// Cuts special tokens out of `text`, longest token text first, as llama.cpp does. Without
    /// `parse_special` only user-defined tokens are cut out.
    fn partition(&self, text: &str, parse_special: bool) -> Vec<Fragment> {
        if text.is_empty() {
            return Vec::new();
        }
        let bytes = text.as_bytes();
        let mut frags = vec![Fragment::Text(0..text.len())];
        for &id in &self.special_cache {
            let attr = self.attrs[id as usize];
            if !parse_special && attr & (ATTR_CONTROL | ATTR_UNKNOWN) != 0 {
                continue;
            }
            let pat = self.texts[id as usize].as_str();
            let hit =
                |f: &Fragment| matches!(f, Fragment::Text(r) if text[r.clone()].contains(pat));
            if !frags.iter().any(hit) {
                continue;
            }
            let mut out = Vec::with_capacity(frags.len() + 2);
            for f in frags {
                let Fragment::Text(r) = f else {
                    out.push(f);
                    continue;
                };
                let (mut start, end) = (r.start, r.end);
                while let Some(at) = text[start..end].find(pat) {
                    let m = start + at;
                    let mut left_end = m;
                    if attr & ATTR_LSTRIP != 0 {
                        while left_end > start && bytes[left_end - 1].is_ascii_whitespace() {
                            left_end -= 1;
                        }
                    }
                    if left_end > start {
                        out.push(Fragment::Text(start..left_end));
                    }
                    out.push(Fragment::Token(id));
                    start = m + pat.len();
                    if attr & ATTR_RSTRIP != 0 {
                        while start < end && is_c_space(bytes[start]) {
                            start += 1;
                        }
                    }
                }
                if start < end {
                    out.push(Fragment::Text(start..end));
                }
            }
            frags = out;
        }
        frags
    }

    /// What token `id` prints as with special tokens shown (llama.cpp's `token_to_piece`).
    fn piece(&self, id: usize) -> Vec<u8> {
        let attr = self.attrs[id];
        let text = &self.texts[id];
        if attr & (ATTR_UNKNOWN | ATTR_CONTROL | ATTR_USER_DEFINED) != 0 {
            return text.as_bytes().to_vec();
        }
        if attr & ATTR_NORMAL != 0 {
            return match self.model {
                Model::Spm { .. } => text.replace('▁', " ").into_bytes(),
                Model::Bpe { .. } => {
                    let mut out = Vec::with_capacity(text.len());
                    for c in text.chars() {
                        match unicode::char_to_byte(c) {
                            Some(b) => out.push(b),
                            None => {
                                let mut buf = [0u8; 4];
                                let hex: String = c
                                    .encode_utf8(&mut buf)
                                    .bytes()
                                    .map(|b| format!("{b:02x}"))
                                    .collect();
                                out.extend_from_slice(
                                    format!("[UNK_BYTE_0x{hex}{text}]").as_bytes(),
                                );
                            }
                        }
                    }
                    out
                }
            };
        }
        if attr & ATTR_BYTE != 0 {
            return text
                .get(3..5)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .map(|b| vec![b])
                .unwrap_or_default();
        }
        Vec::new()
    }

    /// The bytes token `id` stands for when printed: byte-level BPE decoded to raw bytes, SPM `▁` as
    /// a space, `<0xNN>` as that byte; control tokens print nothing unless `special`. For streaming:
    /// a token may end inside a UTF-8 character.
    pub fn token_bytes(&self, id: u32, special: bool) -> Vec<u8> {
        let i = id as usize;
        match self.pieces.get(i) {
            Some(_) if !special && self.attrs[i] & (ATTR_UNKNOWN | ATTR_CONTROL) != 0 => Vec::new(),
            Some(p) => p.to_vec(),
            None => Vec::new(),
        }
    }

    /// The text of `ids` (invalid UTF-8 replaced), as llama.cpp's `llama_detokenize` gives it: the
    /// first token's leading space dropped when the vocabulary adds a space prefix, and
    /// `clean_up_tokenization_spaces` applied where the pre-tokeniser asks for it.
    pub fn decode(&self, ids: &[u32], special: bool) -> String {
        let mut out = Vec::with_capacity(ids.len() * 4);
        let mut strip_space = self.add_space_prefix;
        for &id in ids {
            let piece = self.token_bytes(id, special);
            let piece = match piece.split_first() {
                Some((b' ', rest)) if strip_space => rest,
                _ => &piece[..],
            };
            out.extend_from_slice(piece);
            strip_space = false;
        }
        if self.clean_spaces {
            out = clean_up_spaces(&out);
        }
        String::from_utf8_lossy(&out).into_owned()
    }

    pub fn n_vocab(&self) -> usize {
        self.texts.len()
    }

    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    pub fn eos(&self) -> Option<u32> {
        self.eos
    }

    /// Whether `encode(.., add_special = true, ..)` prepends BOS.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// Whether `encode(.., add_special = true, ..)` appends EOS.
    pub fn add_eos(&self) -> bool {
        self.add_eos
    }

    /// Whether `id` ends generation: EOS, EOT, EOM, and control tokens such as `<|im_end|>`,
    /// `<|eot_id|>`, `<|endoftext|>`, `</s>` (llama.cpp's list).
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.binary_search(&id).is_ok()
    }

    /// All end-of-generation token ids, ascending.
    pub fn eog_ids(&self) -> &[u32] {
        &self.eog
    }

    /// The vocabulary text of `id` (byte-level BPE texts are in GPT-2's alphabet, `Ġ` for a space).
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.texts.get(id as usize).map(String::as_str)
    }

    /// The id of the token whose vocabulary text is exactly `text`.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.token_to_id.get(text).copied()
    }

    /// Whether `id` is a control token (printed only with `special`).
    pub fn is_control(&self, id: u32) -> bool {
        self.attrs
            .get(id as usize)
            .is_some_and(|a| a & ATTR_CONTROL != 0)
    }

    /// Things in the metadata that were ignored (out-of-range token ids).
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }

    /// One line for `oato inspect`: model type, pre-tokeniser, vocabulary size, merges, BOS/EOS.
    pub fn summary(&self) -> String {
        let kind = match &self.model {
            Model::Bpe {
                pre_name, n_merges, ..
            } => {
                let pre = if pre_name.is_empty() {
                    "default (missing)"
                } else {
                    pre_name.as_str()
                };
                format!(
                    "gpt2 byte-level BPE, pre {pre}, {} tokens, {n_merges} merges",
                    self.n_vocab()
                )
            }
            Model::Spm { .. } => format!("llama SentencePiece, {} tokens", self.n_vocab()),
        };
        let name = |id: Option<u32>| match id {
            Some(i) => format!("{i} {:?}", self.texts[i as usize]),
            None => "none".to_string(),
        };
        format!(
            "{kind}, bos {}, eos {}, add_bos {}, eog {:?}",
            name(self.bos),
            name(self.eos),
            self.add_bos,
            self.eog
        )
    }
}

/// C's `isspace`.
fn is_c_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | 0x0B | 0x0C | b'\r')
}

/// `clean_up_tokenization_spaces` as llama.cpp does it: drop the space before `?!.,`, around a lone
/// `'`, and before `'s`, `'m`, `'re`, `'ve`.
fn clean_up_spaces(text: &[u8]) -> Vec<u8> {
    fn pass(
        src: &[u8],
        mut keep: impl FnMut(&mut Vec<u8>, &mut Vec<u8>, usize) -> usize,
    ) -> Vec<u8> {
        let mut src = src.to_vec();
        let mut out = Vec::with_capacity(src.len());
        if let Some(&first) = src.first() {
            out.push(first);
        }
        let mut i = 1;
        while i < src.len() {
            i = keep(&mut src, &mut out, i);
        }
        out
    }
    // " ?", " !", " .", " ,"
    let t = pass(text, |src, out, i| {
        if src[i - 1] == b' ' && matches!(src[i], b'?' | b'!' | b'.' | b',') {
            out.pop();
        }
        out.push(src[i]);
        i + 1
    });
    // " ' " -> "'"
    let t = pass(&t, |src, out, i| {
        if src[i] == b'\'' && i + 1 < src.len() && src[i - 1] == b' ' && src[i + 1] == b' ' {
            out.pop();
            out.push(b'\'');
            src[i + 1] = 0; // the removed space no longer counts as one
            return i + 2;
        }
        out.push(src[i]);
        i + 1
    });
    // " 's", " 'm", " 're", " 've"
    pass(&t, |src, out, i| {
        if src[i - 1] == b' ' && src[i] == b'\'' && i + 1 < src.len() {
            let x1 = src[i + 1];
            let x2 = src.get(i + 2).copied().filter(|_| i + 2 < src.len());
            if matches!(x1, b's' | b'm')
                || matches!((x1, x2), (b'r', Some(b'e')) | (b'v', Some(b'e')))
            {
                out.pop();
            }
        }
        out.push(src[i]);
        i + 1
    })
}

#[cfg(test)]
mod tests;

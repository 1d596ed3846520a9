//! Byte-level BPE (`tokenizer.ggml.model = "gpt2"`): each word from the pre-tokeniser is spelt in
//! GPT-2's byte alphabet, one symbol per byte, and adjacent symbols are merged lowest merge rank
//! first (leftmost first on ties) until no listed merge applies, as llama.cpp does.
//!
//! Strings are interned once: a vocabulary text's symbol is its token id; texts that only merges
//! produce get ids past the vocabulary. A merge is then one hash lookup on a pair of symbols.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

use super::unicode::byte_to_char;
use crate::error::{Error, Result};

const NO_SYM: u32 = u32::MAX;

/// A multiplicative hasher for the pair table (keys are small integers; SipHash is needlessly slow).
#[derive(Default, Clone, Copy)]
pub(crate) struct PairHasher(u64);

impl Hasher for PairHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(b as u64);
        }
    }
    fn write_u32(&mut self, i: u32) {
        self.write_u64(i as u64);
    }
    fn write_u64(&mut self, i: u64) {
        self.0 = (self.0.rotate_left(26) ^ i).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

type PairMap = HashMap<(u32, u32), (u32, u32), BuildHasherDefault<PairHasher>>;

/// The merge table of one vocabulary.
pub(crate) struct Bpe {
    n_vocab: u32,
    /// Texts of symbols `n_vocab + i` (merge sides and results that are not tokens).
    extra: Vec<String>,
    /// (left symbol, right symbol) -> (rank, merged symbol).
    merges: PairMap,
    /// The symbol of each byte's one-character text, `NO_SYM` if no token or merge has it.
    byte_sym: [u32; 256],
    ignore_merges: bool,
}

/// Reusable buffers for [`Bpe::encode_word`].
#[derive(Default)]
pub(crate) struct Scratch {
    syms: Vec<Symbol>,
    heap: BinaryHeap<Reverse<Candidate>>,
    text: String,
}

/// A queued merge: (rank, left index, right index, merged symbol, right symbol when queued).
type Candidate = (u32, u32, u32, u32, u32);

#[derive(Clone, Copy)]
struct Symbol {
    id: u32,
    /// The byte this symbol started as (for symbols that never merged and are not tokens).
    byte: u8,
    prev: u32,
    next: u32,
    alive: bool,
}

impl Bpe {
    /// Builds the table from merges written `"left right"` (split at the first space after the first
    /// byte, as llama.cpp does); a repeated pair keeps its first rank.
    pub(crate) fn new<'a>(
        token_to_id: &HashMap<String, u32>,
        n_vocab: usize,
        merges: impl IntoIterator<Item = &'a str>,
        ignore_merges: bool,
    ) -> Result<Self> {
        let n_vocab = u32::try_from(n_vocab)
            .ok()
            .filter(|&n| n < NO_SYM / 2)
            .ok_or_else(|| {
                Error::Tokenizer(format!("vocabulary of {n_vocab} tokens is too large"))
            })?;
        let mut extra: Vec<String> = Vec::new();
        let mut extra_ids: HashMap<String, u32> = HashMap::new();
        let mut intern = |s: &str, extra: &mut Vec<String>| -> u32 {
            if let Some(&id) = token_to_id.get(s) {
                return id;
            }
            if let Some(&id) = extra_ids.get(s) {
                return id;
            }
            let id = n_vocab + extra.len() as u32;
            extra.push(s.to_string());
            extra_ids.insert(s.to_string(), id);
            id
        };
        let mut table = PairMap::default();
        let mut joined = String::new();
        for (rank, m) in merges.into_iter().enumerate() {
            let space = m.as_bytes().iter().skip(1).position(|&b| b == b' ');
            let (left, right) = match space {
                Some(i) => (&m[..i + 1], &m[i + 2..]),
                None => ("", ""),
            };
            let l = intern(left, &mut extra);
            let r = intern(right, &mut extra);
            joined.clear();
            joined.push_str(left);
            joined.push_str(right);
            let merged = intern(&joined, &mut extra);
            table.entry((l, r)).or_insert((rank as u32, merged));
        }
        let mut byte_sym = [NO_SYM; 256];
        let mut buf = [0u8; 4];
        for (b, &c) in byte_to_char().iter().enumerate() {
            let s: &str = c.encode_utf8(&mut buf);
            byte_sym[b] = token_to_id
                .get(s)
                .copied()
                .or_else(|| extra_ids.get(s).copied())
                .unwrap_or(NO_SYM);
        }
        Ok(Bpe {
            n_vocab,
            extra,
            merges: table,
            byte_sym,
            ignore_merges,
        })
    }

    /// Distinct merge pairs.
    #[cfg(test)]
    pub(crate) fn n_merges(&self) -> usize {
        self.merges.len()
    }

    /// Appends the tokens of one pre-tokenised word (raw UTF-8 bytes) to `out`.
    pub(crate) fn encode_word(
        &self,
        word: &[u8],
        token_to_id: &HashMap<String, u32>,
        scratch: &mut Scratch,
        out: &mut Vec<u32>,
    ) {
        if word.is_empty() {
            return;
        }
        if self.ignore_merges {
            let text = &mut scratch.text;
            text.clear();
            text.extend(word.iter().map(|&b| byte_to_char()[b as usize]));
            if let Some(&id) = token_to_id.get(text.as_str()) {
                out.push(id);
                return;
            }
        }
        let syms = &mut scratch.syms;
        syms.clear();
        let n = word.len() as u32;
        syms.extend(word.iter().enumerate().map(|(i, &b)| Symbol {
            id: self.byte_sym[b as usize],
            byte: b,
            prev: if i == 0 { NO_SYM } else { i as u32 - 1 },
            next: if i as u32 + 1 == n {
                NO_SYM
            } else {
                i as u32 + 1
            },
            alive: true,
        }));
        let heap = &mut scratch.heap;
        heap.clear();
        let push = |heap: &mut BinaryHeap<_>, syms: &[Symbol], l: u32, r: u32| {
            if l == NO_SYM || r == NO_SYM {
                return;
            }
            let (a, b) = (syms[l as usize].id, syms[r as usize].id);
            if let Some(&(rank, merged)) = self.merges.get(&(a, b)) {
                heap.push(Reverse((rank, l, r, merged, b)));
            }
        };
        for i in 1..n {
            push(heap, syms, i - 1, i);
        }
        while let Some(Reverse((_, l, r, merged, right_id))) = heap.pop() {
            let (li, ri) = (l as usize, r as usize);
            // stale: one side has merged since this pair was queued
            if !syms[li].alive || !syms[ri].alive || syms[li].next != r || syms[ri].id != right_id {
                continue;
            }
            syms[li].id = merged;
            syms[ri].alive = false;
            let after = syms[ri].next;
            syms[li].next = after;
            if after != NO_SYM {
                syms[after as usize].prev = l;
            }
            push(heap, syms, syms[li].prev, l);
            push(heap, syms, l, after);
        }
        let mut i = 0u32;
        while i != NO_SYM {
            let s = syms[i as usize];
            if s.id < self.n_vocab {
                out.push(s.id);
            } else {
                // Not a token: llama.cpp looks up each byte of the symbol's text alone and drops
                // the bytes that are no token.
                let mut buf = [0u8; 4];
                let text: &str = if s.id == NO_SYM {
                    byte_to_char()[s.byte as usize].encode_utf8(&mut buf)
                } else {
                    &self.extra[(s.id - self.n_vocab) as usize]
                };
                for b in text.bytes().filter(u8::is_ascii) {
                    let one = [b];
                    let one = std::str::from_utf8(&one).unwrap_or_default();
                    if let Some(&id) = token_to_id.get(one) {
                        out.push(id);
                    }
                }
            }
            i = s.next;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vocab(tokens: &[&str]) -> HashMap<String, u32> {
        tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.to_string(), i as u32))
            .collect()
    }

    fn encode(bpe: &Bpe, t2i: &HashMap<String, u32>, word: &str) -> Vec<u32> {
        let mut out = Vec::new();
        bpe.encode_word(word.as_bytes(), t2i, &mut Scratch::default(), &mut out);
        out
    }

    #[test]
    fn merges_by_rank_not_by_position() {
        //            0    1    2    3     4     5      6
        let toks = ["a", "b", "c", "ab", "bc", "abc", "Ġ"];
        let t2i = vocab(&toks);
        // "b c" ranks before "a b": "abc" -> a + bc, then no merge "a bc" -> [a, bc]
        let bpe = Bpe::new(&t2i, toks.len(), ["b c", "a b"], false).unwrap();
        assert_eq!(encode(&bpe, &t2i, "abc"), [0, 4]);
        // with "a bc" listed as well, the result is one token
        let bpe = Bpe::new(&t2i, toks.len(), ["b c", "a b", "a bc"], false).unwrap();
        assert_eq!(encode(&bpe, &t2i, "abc"), [5]);
        assert_eq!(bpe.n_merges(), 3);
        // ties: "a b" on "abab" merges the left pair first, then the right one
        let bpe = Bpe::new(&t2i, toks.len(), ["a b"], false).unwrap();
        assert_eq!(encode(&bpe, &t2i, "abab"), [3, 3]);
        // a space byte is spelt Ġ
        assert_eq!(encode(&bpe, &t2i, " a"), [6, 0]);
    }

    #[test]
    fn merge_results_outside_the_vocabulary_fall_back_to_bytes() {
        let toks = ["x", "y", "z", "xyz"];
        let t2i = vocab(&toks);
        // "xy" is no token, but it is a step to "xyz"
        let bpe = Bpe::new(&t2i, toks.len(), ["x y", "xy z"], false).unwrap();
        assert_eq!(encode(&bpe, &t2i, "xyz"), [3]);
        // alone, "xy" is spelt out byte by byte
        assert_eq!(encode(&bpe, &t2i, "xy"), [0, 1]);
        // a byte with no token is dropped (as llama.cpp does)
        assert_eq!(encode(&bpe, &t2i, "xqz"), [0, 2]);
    }

    #[test]
    fn ignore_merges_takes_whole_words() {
        let toks = ["a", "b", "ab", "abab"];
        let t2i = vocab(&toks);
        let bpe = Bpe::new(&t2i, toks.len(), ["a b"], true).unwrap();
        assert_eq!(encode(&bpe, &t2i, "abab"), [3]);
        let bpe = Bpe::new(&t2i, toks.len(), ["a b"], false).unwrap();
        assert_eq!(encode(&bpe, &t2i, "abab"), [2, 2]);
    }
}

//! SentencePiece-style BPE (`tokenizer.ggml.model = "llama"`), as llama.cpp runs it: the text (spaces
//! already written `▁`) starts as one symbol per character; the adjacent pair whose concatenation is
//! the highest-scoring vocabulary token merges first (leftmost on ties), until no pair is a token.
//! Symbols that are no token come out as `<0xNN>` byte tokens.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

/// A candidate merge of symbols `left` and `right` into a token of `score` and `size` bytes.
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    size: usize,
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Bigram {}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Bigram {
    /// The max-heap pops the highest score, then the leftmost pair.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then(other.left.cmp(&self.left))
    }
}

#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

/// Appends the tokens of `text` to `out`. `byte_token` gives the token of one byte (its `<0xNN>`
/// token, or `None` when the vocabulary has no way to write it).
pub(crate) fn encode(
    text: &str,
    token_to_id: &HashMap<String, u32>,
    scores: &[f32],
    byte_token: impl Fn(u8) -> Option<u32>,
    out: &mut Vec<u32>,
) {
    if text.is_empty() {
        return;
    }
    let mut syms: Vec<Symbol> = Vec::with_capacity(text.len());
    for (i, c) in text.char_indices() {
        let k = syms.len();
        syms.push(Symbol {
            start: i,
            len: c.len_utf8(),
            prev: k.checked_sub(1),
            next: Some(k + 1),
        });
    }
    if let Some(last) = syms.last_mut() {
        last.next = None;
    }
    let mut heap = BinaryHeap::new();
    let try_add = |heap: &mut BinaryHeap<Bigram>,
                   syms: &[Symbol],
                   left: Option<usize>,
                   right: Option<usize>| {
        let (Some(l), Some(r)) = (left, right) else {
            return;
        };
        let (a, b) = (syms[l], syms[r]);
        let piece = &text[a.start..b.start + b.len];
        if let Some(&id) = token_to_id.get(piece) {
            let score = scores.get(id as usize).copied().unwrap_or(0.0);
            heap.push(Bigram {
                score,
                left: l,
                right: r,
                size: piece.len(),
            });
        }
    };
    for i in 1..syms.len() {
        try_add(&mut heap, &syms, Some(i - 1), Some(i));
    }
    while let Some(bg) = heap.pop() {
        let (l, r) = (syms[bg.left], syms[bg.right]);
        // stale: one of the two has merged with something else since
        if l.len == 0 || r.len == 0 || l.len + r.len != bg.size {
            continue;
        }
        syms[bg.left].len += r.len;
        syms[bg.right].len = 0;
        syms[bg.left].next = r.next;
        if let Some(n) = r.next {
            syms[n].prev = Some(bg.left);
        }
        try_add(&mut heap, &syms, syms[bg.left].prev, Some(bg.left));
        try_add(&mut heap, &syms, Some(bg.left), syms[bg.left].next);
    }
    let mut at = Some(0);
    while let Some(i) = at {
        let s = syms[i];
        let piece = &text[s.start..s.start + s.len];
        match token_to_id.get(piece) {
            Some(&id) => out.push(id),
            None => out.extend(piece.bytes().filter_map(&byte_token)),
        }
        at = s.next;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn highest_score_merges_first() {
        //   0    1    2     3     4
        let toks = ["a", "b", "c", "ab", "bc"];
        let t2i: HashMap<String, u32> = toks
            .iter()
            .enumerate()
            .map(|(i, t)| (t.to_string(), i as u32))
            .collect();
        let byte = |_b: u8| None;
        let mut out = Vec::new();
        encode("abc", &t2i, &[0.0, 0.0, 0.0, -1.0, -2.0], byte, &mut out);
        assert_eq!(out, [3, 2]); // "ab" scores higher than "bc"
        out.clear();
        encode("abc", &t2i, &[0.0, 0.0, 0.0, -2.0, -1.0], byte, &mut out);
        assert_eq!(out, [0, 4]);
        out.clear();
        // equal scores: the leftmost pair wins
        encode("abc", &t2i, &[0.0, 0.0, 0.0, -1.0, -1.0], byte, &mut out);
        assert_eq!(out, [3, 2]);
    }

    #[test]
    fn unknown_characters_become_bytes() {
        let t2i: HashMap<String, u32> = [("a".to_string(), 0)].into_iter().collect();
        let mut out = Vec::new();
        encode("aé", &t2i, &[0.0], |b| Some(100 + b as u32), &mut out);
        assert_eq!(out, [0, 100 + 0xC3, 100 + 0xA9]);
    }
}

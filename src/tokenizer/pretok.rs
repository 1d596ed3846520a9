//! Pre-tokenisers of byte-level BPE vocabularies: the text is cut into words before BPE, by the
//! regexes llama.cpp uses for each `tokenizer.ggml.pre` value. Several regexes apply in sequence, each
//! cutting the pieces the previous one left (so a look-ahead never sees past a piece's end).
//!
//! The regexes are hand-written scanners with the regexes' leftmost-first semantics:
//!
//! * GPT-2: `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`
//! * Llama 3 (`max_digits` 3) and Qwen2 (`max_digits` 1):
//!   `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
//! * `\p{N}` (each number character alone), `[\p{P}$+<=>^~|]+` / `\p{N}+` (runs of a class), and
//!   `[0-9][0-9][0-9]` (ASCII digits in threes from the left).

use std::ops::Range;

use super::unicode::{self, LETTER, NUMBER, PUNCT, SPACE};

/// One regex of a pre-tokeniser; the pieces it does not match are kept as pieces too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Split {
    Gpt2,
    Llama3 {
        max_digits: usize,
    },
    /// `\p{N}`: every number character is its own piece.
    EachNumber,
    /// `X+` for a character class X.
    Runs(RunClass),
    /// `[0-9][0-9][0-9]`.
    AsciiDigitTriples,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RunClass {
    /// `[\p{P}\$\+<=>\^~\|]` (with the backtick too for Falcon).
    PunctSymbols { backtick: bool },
    /// `\p{N}`.
    Numbers,
}

/// What a `tokenizer.ggml.pre` value means, as llama.cpp reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PreConfig {
    pub splits: Vec<Split>,
    /// A word that is itself a vocabulary token is taken whole, without merges.
    pub ignore_merges: bool,
    /// Default for `tokenizer.ggml.add_bos_token`.
    pub add_bos: bool,
    /// Decoding removes spaces before `?!.,` and some contractions (`clean_up_tokenization_spaces`).
    pub clean_spaces: bool,
    /// This pre-tokeniser has no BOS token unless the metadata names one.
    pub no_bos: bool,
}

const GPT2_DEFAULT: &[Split] = &[
    Split::Runs(RunClass::PunctSymbols { backtick: false }),
    Split::Gpt2,
    Split::Runs(RunClass::Numbers),
    Split::AsciiDigitTriples,
];

/// The pre-tokeniser for a `tokenizer.ggml.pre` value (`""` when the key is absent, which llama.cpp
/// reads as `default`); `None` for a value this crate does not implement.
pub(crate) fn pre_config(pre: &str) -> Option<PreConfig> {
    let cfg = |splits: &[Split], ignore_merges, add_bos, clean_spaces| PreConfig {
        splits: splits.to_vec(),
        ignore_merges,
        add_bos,
        clean_spaces,
        no_bos: false,
    };
    let llama3 = [Split::Llama3 { max_digits: 3 }];
    let qwen2 = [Split::Llama3 { max_digits: 1 }];
    let gpt2 = [Split::Gpt2];
    let digits_gpt2 = [Split::EachNumber, Split::Gpt2];
    Some(match pre {
        "" | "default" => cfg(GPT2_DEFAULT, false, false, true),
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0"
        | "lfm2" | "jina-v5-nano" => cfg(&llama3, true, true, true),
        "dbrx" | "smaug-bpe" => cfg(&llama3, false, false, true),
        "chatglm-bpe" | "glm4" | "glm5" => PreConfig {
            no_bos: true,
            ..cfg(&llama3, pre != "chatglm-bpe", false, true)
        },
        // "gpt2" is not a name llama.cpp knows ("gpt-2" is); accepted as the same.
        "gpt-2" | "gpt2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v2-es"
        | "jina-v2-de" | "a.x-4.0" | "mellum" | "modern-bert" | "jina-v1-en" | "jina-v2-code"
        | "roberta-bpe" | "exaone4" | "mpt" | "olmo" | "jais" => cfg(&gpt2, false, false, true),
        "trillion" | "granite-docling" => cfg(&gpt2, false, false, false),
        "starcoder" | "refact" | "codeshell" | "exaone" | "minerva-7b" | "mellum2" => {
            cfg(&digits_gpt2, false, false, true)
        }
        "smollm" | "command-r" => cfg(&digits_gpt2, false, false, false),
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "hunyuan" | "solar-open" => {
            cfg(&qwen2, false, false, false)
        }
        "stablelm2" | "megrez" => cfg(&qwen2, false, false, true),
        "falcon" => cfg(
            &[
                Split::Runs(RunClass::PunctSymbols { backtick: true }),
                Split::Gpt2,
                Split::AsciiDigitTriples,
            ],
            false,
            false,
            true,
        ),
        _ => return None,
    })
}

/// The `tokenizer.ggml.pre` values [`pre_config`] knows, for error messages.
pub(crate) const SUPPORTED_PRE: &str = "default, llama-bpe/llama3 (and falcon3, pixtral, lfm2, ...), \
     dbrx, smaug-bpe, chatglm-bpe, glm4, gpt-2 (and phi-2, mpt, olmo, jais, ...), smollm, starcoder, \
     refact, command-r, codeshell, exaone, qwen2 (and deepseek-r1-qwen, stablelm2, hunyuan, ...), falcon";

/// Cuts `text` into words (byte ranges, in order, covering all of `text`).
pub(crate) fn split(text: &str, splits: &[Split]) -> Vec<Range<usize>> {
    let mut chars = Vec::with_capacity(text.len());
    let mut offsets = Vec::with_capacity(text.len() + 1);
    for (i, c) in text.char_indices() {
        chars.push(c);
        offsets.push(i);
    }
    offsets.push(text.len());
    let mut pieces: Vec<Range<usize>> = std::iter::once(0..chars.len()).collect();
    for &s in splits {
        let mut out = Vec::with_capacity(pieces.len() * 2);
        for p in pieces {
            let mut cut = Cutter {
                out: &mut out,
                prev: p.start,
            };
            match s {
                Split::Gpt2 => gpt2(&chars, p, &mut cut),
                Split::Llama3 { max_digits } => llama3(&chars, p, max_digits.max(1), &mut cut),
                Split::EachNumber => isolate(
                    &chars,
                    p,
                    &mut cut,
                    |c| unicode::flags(c) & NUMBER != 0,
                    false,
                ),
                Split::Runs(RunClass::Numbers) => isolate(
                    &chars,
                    p,
                    &mut cut,
                    |c| unicode::flags(c) & NUMBER != 0,
                    true,
                ),
                Split::Runs(RunClass::PunctSymbols { backtick }) => isolate(
                    &chars,
                    p,
                    &mut cut,
                    |c| {
                        unicode::flags(c) & PUNCT != 0
                            || matches!(c, '$' | '+' | '<' | '=' | '>' | '^' | '~' | '|')
                            || (backtick && c == '`')
                    },
                    true,
                ),
                Split::AsciiDigitTriples => digit_triples(&chars, p, &mut cut),
            }
        }
        pieces = out;
    }
    pieces
        .into_iter()
        .map(|p| offsets[p.start]..offsets[p.end])
        .collect()
}

/// Collects the pieces of one input piece: `to(end)` closes the piece that began where the last ended.
struct Cutter<'a> {
    out: &'a mut Vec<Range<usize>>,
    prev: usize,
}

impl Cutter<'_> {
    fn to(&mut self, end: usize) -> usize {
        if end > self.prev {
            self.out.push(self.prev..end);
        }
        self.prev = end;
        end
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Letter,
    Number,
    Space,
    Other,
}

fn kind(c: char) -> Kind {
    let f = unicode::flags(c);
    if f & LETTER != 0 {
        Kind::Letter
    } else if f & NUMBER != 0 {
        Kind::Number
    } else if f & SPACE != 0 {
        Kind::Space
    } else {
        Kind::Other
    }
}

/// Length of the contraction (`'s`, `'t`, `'re`, `'ve`, `'m`, `'ll`, `'d`) at `pos`, or 0.
fn contraction(chars: &[char], pos: usize, end: usize, any_case: bool) -> usize {
    if chars[pos] != '\'' || pos + 1 >= end {
        return 0;
    }
    let lower = |c: char| if any_case { c.to_ascii_lowercase() } else { c };
    let c1 = lower(chars[pos + 1]);
    if matches!(c1, 's' | 't' | 'm' | 'd') {
        return 2;
    }
    if pos + 2 < end
        && matches!(
            (c1, lower(chars[pos + 2])),
            ('r', 'e') | ('v', 'e') | ('l', 'l')
        )
    {
        return 3;
    }
    0
}

/// End of the run of `k` characters from `pos`.
fn run_end(chars: &[char], mut pos: usize, end: usize, k: Kind) -> usize {
    while pos < end && kind(chars[pos]) == k {
        pos += 1;
    }
    pos
}

/// `\s+(?!\S)|\s+` at a whitespace character: all of the run, less its last character when a
/// non-space follows inside the piece.
fn whitespace_end(chars: &[char], pos: usize, end: usize) -> usize {
    let ws_end = run_end(chars, pos, end, Kind::Space);
    if ws_end - pos > 1 && ws_end < end {
        ws_end - 1
    } else {
        ws_end.max(pos + 1)
    }
}

fn gpt2(chars: &[char], piece: Range<usize>, cut: &mut Cutter) {
    let (mut pos, end) = (piece.start, piece.end);
    while pos < end {
        let n = contraction(chars, pos, end, false);
        if n > 0 {
            pos = cut.to(pos + n);
            continue;
        }
        let c = chars[pos];
        // ` ?X+` looks at the character after an optional space.
        let body = if c == ' ' && pos + 1 < end {
            pos + 1
        } else {
            pos
        };
        pos = match kind(chars[body]) {
            k @ (Kind::Letter | Kind::Number | Kind::Other) => cut.to(run_end(chars, body, end, k)),
            Kind::Space => cut.to(whitespace_end(chars, pos, end)),
        };
    }
}

fn llama3(chars: &[char], piece: Range<usize>, max_digits: usize, cut: &mut Cutter) {
    let (mut pos, end) = (piece.start, piece.end);
    while pos < end {
        let n = contraction(chars, pos, end, true);
        if n > 0 {
            pos = cut.to(pos + n);
            continue;
        }
        let c = chars[pos];
        let k = kind(c);
        // [^\r\n\p{L}\p{N}]?\p{L}+
        if c != '\r'
            && c != '\n'
            && k != Kind::Number
            && (k == Kind::Letter || (pos + 1 < end && kind(chars[pos + 1]) == Kind::Letter))
        {
            pos = cut.to(run_end(chars, pos + 1, end, Kind::Letter));
            continue;
        }
        // \p{N}{1,max}
        if k == Kind::Number {
            let run = run_end(chars, pos, end, Kind::Number);
            while pos < run {
                pos = cut.to((pos + max_digits).min(run));
            }
            continue;
        }
        // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
        let body = if c == ' ' { pos + 1 } else { pos };
        if body < end && kind(chars[body]) == Kind::Other {
            let mut e = run_end(chars, body, end, Kind::Other);
            while e < end && matches!(chars[e], '\r' | '\n') {
                e += 1;
            }
            pos = cut.to(e);
            continue;
        }
        // \s*[\r\n]+ : whitespace up to its last newline
        let ws_end = run_end(chars, pos, end, Kind::Space);
        if let Some(nl) = (pos..ws_end)
            .rev()
            .find(|&i| matches!(chars[i], '\r' | '\n'))
        {
            pos = cut.to(nl + 1);
            continue;
        }
        pos = cut.to(whitespace_end(chars, pos, end));
    }
}

/// Isolates each character (`runs` false) or each maximal run (`runs` true) of the class `is`.
fn isolate(
    chars: &[char],
    piece: Range<usize>,
    cut: &mut Cutter,
    is: impl Fn(char) -> bool,
    runs: bool,
) {
    let (mut pos, end) = (piece.start, piece.end);
    while pos < end {
        if is(chars[pos]) {
            cut.to(pos);
            pos += 1;
            while runs && pos < end && is(chars[pos]) {
                pos += 1;
            }
            cut.to(pos);
        } else {
            pos += 1;
        }
    }
    cut.to(end);
}

fn digit_triples(chars: &[char], piece: Range<usize>, cut: &mut Cutter) {
    let (mut pos, end) = (piece.start, piece.end);
    while pos < end {
        if pos + 3 <= end && chars[pos..pos + 3].iter().all(char::is_ascii_digit) {
            cut.to(pos);
            pos = cut.to(pos + 3);
        } else {
            pos += 1;
        }
    }
    cut.to(end);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words<'a>(text: &'a str, pre: &str) -> Vec<&'a str> {
        let cfg = pre_config(pre).unwrap();
        split(text, &cfg.splits)
            .into_iter()
            .map(|r| &text[r])
            .collect()
    }

    #[test]
    fn gpt2_words() {
        assert_eq!(
            words("Hello world's  end\n\n", "gpt-2"),
            ["Hello", " world", "'s", " ", " end", "\n\n"]
        );
        // case-sensitive contractions; punctuation runs with one leading space
        assert_eq!(
            words("I'M ok ...!! x", "gpt-2"),
            ["I", "'", "M", " ok", " ...!!", " x"]
        );
        assert_eq!(words("a 42b", "gpt-2"), ["a", " 42", "b"]);
        assert_eq!(words(" ", "gpt-2"), [" "]);
        // only a plain space joins the word after it
        assert_eq!(words("x \u{3000}y", "gpt-2"), ["x", " ", "\u{3000}", "y"]);
    }

    #[test]
    fn smollm_splits_digits_first() {
        // the digit split leaves "abc " as its own piece, so its trailing space stays alone
        assert_eq!(
            words("abc 123x", "smollm"),
            ["abc", " ", "1", "2", "3", "x"]
        );
        assert_eq!(words("v2.0", "smollm"), ["v", "2", ".", "0"]);
    }

    #[test]
    fn llama3_words() {
        assert_eq!(
            words("I'M 12345 ok\r\n\n  x", "llama-bpe"),
            ["I", "'M", " ", "123", "45", " ok", "\r\n\n", " ", " x"]
        );
        assert_eq!(words(".Hello\n", "llama-bpe"), [".Hello", "\n"]);
        assert_eq!(words("a ...\n\nb", "llama-bpe"), ["a", " ...\n\n", "b"]);
        assert_eq!(words("x \n y", "llama-bpe"), ["x", " \n", " y"]);
    }

    #[test]
    fn qwen2_single_digits() {
        assert_eq!(
            words("abc 12345", "qwen2"),
            ["abc", " ", "1", "2", "3", "4", "5"]
        );
    }

    #[test]
    fn default_pretokenizer() {
        assert_eq!(
            words("a+b=1234!?", "default"),
            ["a", "+", "b", "=", "123", "4", "!?"]
        );
        assert_eq!(words("", "default"), Vec::<&str>::new());
    }

    #[test]
    fn pieces_cover_the_text() {
        let text = "Ünïcödé 😀😀 tabs\t\tand 123,456.78 'quotes' \r\n end  ";
        for pre in ["default", "gpt-2", "smollm", "llama-bpe", "qwen2", "falcon"] {
            let ranges = split(text, &pre_config(pre).unwrap().splits);
            let mut at = 0;
            for r in &ranges {
                assert_eq!(r.start, at, "{pre}: gap before {r:?}");
                assert!(r.end > r.start, "{pre}: empty piece");
                at = r.end;
            }
            assert_eq!(at, text.len(), "{pre}");
        }
    }

    #[test]
    fn unknown_pre_is_none() {
        assert!(pre_config("no-such-pre").is_none());
    }
}

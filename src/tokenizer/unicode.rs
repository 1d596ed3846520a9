//! Unicode facts the tokenisers need: per-codepoint classes (`\p{L}`, `\p{N}`, `\p{P}`, `\s`) as the
//! pre-tokeniser regexes see them, and GPT-2's byte <-> printable-character map.
//!
//! The general categories come from `regex-syntax`'s Unicode tables (the same data `\p{..}` means in
//! Rust regexes); whitespace is Unicode's White_Space property, the set llama.cpp uses for `\s`.

use std::sync::OnceLock;

/// `\p{L}`: a letter.
pub(crate) const LETTER: u8 = 1;
/// `\p{N}`: a number (decimal digit, letter number, other number).
pub(crate) const NUMBER: u8 = 2;
/// `\p{P}`: punctuation.
pub(crate) const PUNCT: u8 = 4;
/// `\s`: Unicode White_Space.
pub(crate) const SPACE: u8 = 8;

const N_CODEPOINTS: usize = 0x11_0000;

/// One byte of class bits per codepoint (1.1 MB, built once on first use).
fn table() -> &'static [u8] {
    static TABLE: OnceLock<Vec<u8>> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut t = vec![0u8; N_CODEPOINTS];
        for (pattern, bit) in [(r"\p{L}", LETTER), (r"\p{N}", NUMBER), (r"\p{P}", PUNCT)] {
            for (lo, hi) in class_ranges(pattern) {
                for f in &mut t[lo as usize..=hi as usize] {
                    *f |= bit;
                }
            }
        }
        for (cp, f) in t.iter_mut().enumerate().take(0x3001) {
            if char::from_u32(cp as u32).is_some_and(char::is_whitespace) {
                *f |= SPACE;
            }
        }
        t
    })
}

/// The codepoint ranges of a one-class regex such as `\p{L}`.
fn class_ranges(pattern: &str) -> Vec<(u32, u32)> {
    use regex_syntax::hir::{Class, HirKind};
    let Ok(hir) = regex_syntax::Parser::new().parse(pattern) else {
        debug_assert!(false, "bad class pattern {pattern}");
        return Vec::new();
    };
    match hir.kind() {
        HirKind::Class(Class::Unicode(c)) => c
            .ranges()
            .iter()
            .map(|r| (r.start() as u32, r.end() as u32))
            .collect(),
        _ => Vec::new(),
    }
}

/// Class bits of `c` (a combination of [`LETTER`], [`NUMBER`], [`PUNCT`], [`SPACE`]).
#[inline]
pub(crate) fn flags(c: char) -> u8 {
    table()[c as usize]
}

/// GPT-2's byte-level alphabet: byte -> the printable character that stands for it in the vocabulary.
pub(crate) fn byte_to_char() -> &'static [char; 256] {
    static MAP: OnceLock<[char; 256]> = OnceLock::new();
    MAP.get_or_init(|| {
        let mut map = ['\0'; 256];
        let mut next = 256u32;
        for b in 0..256u32 {
            let printable = (0x21..=0x7E).contains(&b)
                || (0xA1..=0xAC).contains(&b)
                || (0xAE..=0xFF).contains(&b);
            let cp = if printable {
                b
            } else {
                next += 1;
                next - 1
            };
            map[b as usize] = char::from_u32(cp).unwrap_or('\u{FFFD}');
        }
        map
    })
}

/// The inverse of [`byte_to_char`]: the byte a vocabulary character stands for, if any.
pub(crate) fn char_to_byte(c: char) -> Option<u8> {
    static MAP: OnceLock<[i16; 324]> = OnceLock::new();
    let map = MAP.get_or_init(|| {
        let mut m = [-1i16; 324];
        for (b, &c) in byte_to_char().iter().enumerate() {
            m[c as usize] = b as i16;
        }
        m
    });
    map.get(c as usize).and_then(|&b| u8::try_from(b).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_of_sample_characters() {
        assert_eq!(flags('a'), LETTER);
        assert_eq!(flags('Ж'), LETTER);
        assert_eq!(flags('中'), LETTER);
        assert_eq!(flags('7'), NUMBER);
        assert_eq!(flags('²'), NUMBER); // No
        assert_eq!(flags('٣'), NUMBER); // Arabic-Indic digit three
        assert_eq!(flags('!'), PUNCT);
        assert_eq!(flags('«'), PUNCT);
        assert_eq!(flags('$'), 0); // Sc, a symbol
        assert_eq!(flags('😀'), 0); // So
        assert_eq!(flags('\u{0301}'), 0); // Mn, a combining accent
        assert_eq!(flags(' '), SPACE);
        assert_eq!(flags('\n'), SPACE);
        assert_eq!(flags('\u{3000}'), SPACE); // ideographic space: Zs, not P
        assert_eq!(flags('\u{00A0}'), SPACE);
        assert_eq!(flags('\u{200B}'), 0); // zero-width space is not White_Space
    }

    #[test]
    fn gpt2_byte_alphabet() {
        let m = byte_to_char();
        assert_eq!(m[b'a' as usize], 'a');
        assert_eq!(m[b' ' as usize], 'Ġ'); // U+0120
        assert_eq!(m[b'\n' as usize], 'Ċ'); // U+010A
        assert_eq!(m[0xAD], 'Ń'); // U+0143, the last of the remapped bytes
        assert_eq!(m[0x00], 'Ā');
        for b in 0..=255u8 {
            assert_eq!(char_to_byte(m[b as usize]), Some(b));
        }
        assert_eq!(char_to_byte('€'), None);
    }
}

//! The ggml tensor types: ids as GGUF stores them, block geometry, and the activation format each
//! weight type's dot product takes.

use crate::error::{Error, Result};

/// A ggml tensor type, numbered as in GGUF's tensor table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[allow(non_camel_case_types)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    IQ4_NL,
    IQ4_XS,
    I8,
    I16,
    I32,
    I64,
    F64,
    BF16,
}

/// (id, type, name, elements per block, bytes per block)
const TABLE: &[(u32, GgmlType, &str, usize, usize)] = &[
    (0, GgmlType::F32, "F32", 1, 4),
    (1, GgmlType::F16, "F16", 1, 2),
    (2, GgmlType::Q4_0, "Q4_0", 32, 18),
    (3, GgmlType::Q4_1, "Q4_1", 32, 20),
    (6, GgmlType::Q5_0, "Q5_0", 32, 22),
    (7, GgmlType::Q5_1, "Q5_1", 32, 24),
    (8, GgmlType::Q8_0, "Q8_0", 32, 34),
    (9, GgmlType::Q8_1, "Q8_1", 32, 36),
    (10, GgmlType::Q2_K, "Q2_K", 256, 84),
    (11, GgmlType::Q3_K, "Q3_K", 256, 110),
    (12, GgmlType::Q4_K, "Q4_K", 256, 144),
    (13, GgmlType::Q5_K, "Q5_K", 256, 176),
    (14, GgmlType::Q6_K, "Q6_K", 256, 210),
    (15, GgmlType::Q8_K, "Q8_K", 256, 292),
    (20, GgmlType::IQ4_NL, "IQ4_NL", 32, 18),
    (23, GgmlType::IQ4_XS, "IQ4_XS", 256, 136),
    (24, GgmlType::I8, "I8", 1, 1),
    (25, GgmlType::I16, "I16", 1, 2),
    (26, GgmlType::I32, "I32", 1, 4),
    (27, GgmlType::I64, "I64", 1, 8),
    (28, GgmlType::F64, "F64", 1, 8),
    (30, GgmlType::BF16, "BF16", 1, 2),
];

/// Names of ggml type ids that exist but oato does not read, for clearer errors.
const KNOWN_UNSUPPORTED: &[(u32, &str)] = &[
    (4, "Q4_2 (removed)"),
    (5, "Q4_3 (removed)"),
    (16, "IQ2_XXS"),
    (17, "IQ2_XS"),
    (18, "IQ3_XXS"),
    (19, "IQ1_S"),
    (21, "IQ3_S"),
    (22, "IQ2_S"),
    (29, "IQ1_M"),
    (34, "TQ1_0"),
    (35, "TQ2_0"),
    (39, "MXFP4"),
];

impl GgmlType {
    fn entry(self) -> &'static (u32, GgmlType, &'static str, usize, usize) {
        TABLE
            .iter()
            .find(|e| e.1 == self)
            .expect("every GgmlType is in TABLE")
    }

    /// The type with GGUF id `id`, or an error naming the id (and the type, when ggml has one).
    pub fn from_id(id: u32) -> Result<Self> {
        if let Some(e) = TABLE.iter().find(|e| e.0 == id) {
            return Ok(e.1);
        }
        match KNOWN_UNSUPPORTED.iter().find(|e| e.0 == id) {
            Some((_, name)) => Err(Error::UnsupportedType(format!(
                "{name} (ggml type id {id})"
            ))),
            None => Err(Error::UnsupportedType(format!("unknown ggml type id {id}"))),
        }
    }

    pub fn from_name(name: &str) -> Result<Self> {
        TABLE
            .iter()
            .find(|e| e.2.eq_ignore_ascii_case(name))
            .map(|e| e.1)
            .ok_or_else(|| Error::UnsupportedType(format!("unknown type name {name:?}")))
    }

    pub fn id(self) -> u32 {
        self.entry().0
    }
    pub fn name(self) -> &'static str {
        self.entry().2
    }
    /// Elements per block (1 for plain types, 32 or 256 for quantised ones).
    pub fn block_size(self) -> usize {
        self.entry().3
    }
    /// Bytes per block.
    pub fn type_size(self) -> usize {
        self.entry().4
    }
    pub fn is_quantized(self) -> bool {
        self.block_size() > 1
    }

    /// Bytes of a row of `n` elements; an error when `n` is not a whole number of blocks.
    pub fn row_bytes(self, n: usize) -> Result<usize> {
        let bs = self.block_size();
        if !n.is_multiple_of(bs) {
            return Err(Error::Model(format!(
                "a row of {n} elements is not a whole number of {}-element {} blocks",
                bs,
                self.name()
            )));
        }
        (n / bs)
            .checked_mul(self.type_size())
            .ok_or_else(|| Error::Model(format!("row of {n} {} elements overflows", self.name())))
    }

    /// The format activations take for this weight type's dot product (as ggml's `vec_dot_type`).
    pub fn vec_dot_type(self) -> GgmlType {
        use GgmlType::*;
        match self {
            Q4_0 | Q5_0 | Q8_0 | IQ4_NL => Q8_0,
            Q4_1 | Q5_1 => Q8_1,
            Q2_K | Q3_K | Q4_K | Q5_K | Q6_K | IQ4_XS => Q8_K,
            F16 => F16,
            BF16 => BF16,
            _ => F32,
        }
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_unknown_ids_are_named() {
        for e in TABLE {
            assert_eq!(GgmlType::from_id(e.0).unwrap(), e.1);
            assert_eq!(e.1.id(), e.0);
        }
        let err = GgmlType::from_id(16).unwrap_err().to_string();
        assert!(err.contains("IQ2_XXS"), "{err}");
        let err = GgmlType::from_id(999).unwrap_err().to_string();
        assert!(err.contains("999"), "{err}");
    }

    #[test]
    fn row_bytes_checks_whole_blocks() {
        assert_eq!(GgmlType::Q4_1.row_bytes(576).unwrap(), 18 * 20);
        assert_eq!(GgmlType::Q6_K.row_bytes(512).unwrap(), 420);
        assert!(GgmlType::Q4_K.row_bytes(576).is_err());
    }
}

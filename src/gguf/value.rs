//! GGUF metadata values: the thirteen value types, nested arrays, typed getters.

use serde_json::json;

/// A GGUF value type, numbered as in the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValueType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    String = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

impl ValueType {
    pub fn from_id(id: u32) -> Option<Self> {
        use ValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    /// Bytes a value of this type takes at the least (strings: their length prefix).
    pub fn min_size(self) -> u64 {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 | String => 8,
            Array => 12,
        }
    }

    pub fn name(self) -> &'static str {
        use ValueType::*;
        match self {
            U8 => "u8",
            I8 => "i8",
            U16 => "u16",
            I16 => "i16",
            U32 => "u32",
            I32 => "i32",
            F32 => "f32",
            Bool => "bool",
            String => "string",
            Array => "array",
            U64 => "u64",
            I64 => "i64",
            F64 => "f64",
        }
    }
}

/// One metadata value. Arrays keep their element type so an empty array round-trips.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(ValueType, Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    pub fn value_type(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::F32(_) => ValueType::F32,
            Value::Bool(_) => ValueType::Bool,
            Value::String(_) => ValueType::String,
            Value::Array(..) => ValueType::Array,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F64(_) => ValueType::F64,
        }
    }

    /// Any integer value as i128 (so every GGUF integer type fits), else None.
    pub fn as_int(&self) -> Option<i128> {
        Some(match *self {
            Value::U8(v) => v as i128,
            Value::I8(v) => v as i128,
            Value::U16(v) => v as i128,
            Value::I16(v) => v as i128,
            Value::U32(v) => v as i128,
            Value::I32(v) => v as i128,
            Value::U64(v) => v as i128,
            Value::I64(v) => v as i128,
            _ => return None,
        })
    }

    /// Any numeric value as f64.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v as f64),
            Value::F64(v) => Some(v),
            _ => self.as_int().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(_, v) => Some(v),
            _ => None,
        }
    }

    /// JSON form; arrays longer than `max_array` are summarised as type, length and first items.
    pub fn to_json(&self, max_array: usize) -> serde_json::Value {
        match self {
            Value::U8(v) => json!(v),
            Value::I8(v) => json!(v),
            Value::U16(v) => json!(v),
            Value::I16(v) => json!(v),
            Value::U32(v) => json!(v),
            Value::I32(v) => json!(v),
            Value::U64(v) => json!(v),
            Value::I64(v) => json!(v),
            Value::F32(v) => json!(v),
            Value::F64(v) => json!(v),
            Value::Bool(v) => json!(v),
            Value::String(v) => json!(v),
            Value::Array(t, items) if items.len() > max_array => json!({
                "type": format!("array[{}]", t.name()),
                "len": items.len(),
                "head": items.iter().take(8).map(|v| v.to_json(max_array)).collect::<Vec<_>>(),
            }),
            Value::Array(_, items) => {
                serde_json::Value::Array(items.iter().map(|v| v.to_json(max_array)).collect())
            }
        }
    }

    /// Short human form for tables: long strings and arrays are cut.
    pub fn summary(&self) -> String {
        match self {
            Value::String(s) => {
                let one_line = s.replace('\n', "\\n");
                if one_line.chars().count() > 60 {
                    let cut: String = one_line.chars().take(57).collect();
                    format!("{cut:?}… ({} chars)", s.chars().count())
                } else {
                    format!("{one_line:?}")
                }
            }
            Value::Array(t, items) if items.len() > 6 => {
                format!("[{}; {}]", t.name(), items.len())
            }
            Value::Array(_, items) => {
                let parts: Vec<String> = items.iter().map(|v| v.summary()).collect();
                format!("[{}]", parts.join(", "))
            }
            other => other.to_json(0).to_string(),
        }
    }
}

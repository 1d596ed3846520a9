//! oato: operator-aware tensor offloading for GGUF language models.

pub mod error;
pub mod gguf;
pub mod quant;
pub mod tokenizer;

pub use error::{Error, Result};

//! oato: operator-aware tensor offloading for GGUF language models.

pub mod cache;
pub mod engine;
pub mod error;
pub mod fuzz;
pub mod gguf;
pub mod kernels;
pub mod model;
pub mod placer;
pub mod profiler;
pub mod quant;
pub mod rng;
pub mod runtime;
pub mod scheduler;
pub mod server;
pub mod tokenizer;

pub use error::{Error, Result};

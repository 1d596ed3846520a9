//! Running a model: KV cache, forward pass, sampling, generation with metrics, perplexity.

pub mod forward;
pub mod generate;
pub mod kv_cache;
pub mod perplexity;
pub mod sampler;

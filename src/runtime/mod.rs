//! Running a model: backends (CPU, CUDA), KV cache, the forward pass over backends, sampling,
//! generation with metrics, perplexity.

pub mod backend;
pub mod cpu_backend;
pub mod cuda_backend;
pub mod cuda_graphs;
pub mod cuda_host;
pub mod cuda_mmq;
pub mod forward;
pub mod generate;
pub mod kv_cache;
pub mod perplexity;
pub mod plan;
pub mod sampler;
pub mod test_device;

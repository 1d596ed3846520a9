//! The KV cache's size: per layer, keys and values of every position in f16. The caches themselves
//! are tensors of the backend that runs each layer (see `forward`).

/// Bytes per token of context, all layers, K and V, in f16.
pub fn bytes_per_token(n_layer: usize, kv_dim: usize) -> usize {
    2 * n_layer * kv_dim * std::mem::size_of::<half::f16>()
}

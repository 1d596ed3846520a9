//! Quantisation formats: block layouts, scalar reference dequantisation, quantisation and dot
//! products (the oracle every fast kernel is tested against).
//!
//! Everything here is bit-exact with ggml's reference C (`dequantize_row_*`,
//! `quantize_row_*_ref`, `ggml_vec_dot_*_generic`): same block layouts, same rounding, same order
//! of float operations, no fused multiply-adds. Raw tensor bytes are viewed in place as block
//! slices; every block type has alignment 1 (see [`blocks`]), so any byte offset is fine.

pub mod blocks;
pub mod dequantize;
pub mod dot;
pub mod quantize;
pub mod random;
pub mod types;

pub mod testdata;
#[cfg(test)]
mod tests;

pub use blocks::{
    Block, BlockIQ4NL, BlockIQ4XS, BlockQ2K, BlockQ3K, BlockQ4_0, BlockQ4_1, BlockQ4K, BlockQ5_0,
    BlockQ5_1, BlockQ5K, BlockQ6K, BlockQ8_0, BlockQ8_1, BlockQ8K, F16Le, F32Le, I16Le, as_blocks,
    as_blocks_mut, blocks_as_bytes,
};
pub use dequantize::dequantize_row;
pub use dot::{has_vec_dot, vec_dot, vec_dot_checked, vec_dot_f32_ref};
pub use quantize::{quantize_act_row, quantize_row};
pub use types::GgmlType;

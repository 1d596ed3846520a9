//! CPU kernels: weight matmuls, attention, and the small operators between them.

pub mod attention;
pub mod matmul;
pub mod ops;
pub mod scalar;

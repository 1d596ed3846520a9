//! Compute kernels per backend.

pub mod cpu;
pub mod cuda;

//! Compute kernels per backend.

pub mod cpu;

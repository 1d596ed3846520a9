//! Quantisation formats: block layouts, scalar reference dequantisation, quantisation and dot
//! products (the oracle every fast kernel is tested against).

pub mod types;

pub use types::GgmlType;

//! GGUF files: a checked reader over a memory map, and a writer.

pub mod reader;
pub mod value;
pub mod writer;

pub use reader::{GgufFile, Load, TensorInfo, set_load};
pub use value::{Value, ValueType};
pub use writer::{GgufWriter, TensorEntry};

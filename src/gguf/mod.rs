//! GGUF files: a checked reader over a memory map, and a writer.

pub mod reader;
pub mod value;
pub mod writer;

pub use reader::{AUTO_MIN_BYTES, GgufFile, Load, TensorInfo, auto_copies, set_load};
pub use value::{Value, ValueType};
pub use writer::{GgufWriter, TensorEntry};

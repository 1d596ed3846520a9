//! The crate's one error type: every failure names the file, tensor, shape or flag at fault.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A GGUF file that cannot be read: what is wrong and where.
    #[error("{path}: invalid GGUF: {msg}")]
    Gguf { path: PathBuf, msg: String },
    /// A tensor type the engine does not know or cannot use here.
    #[error("unsupported tensor type: {0}")]
    UnsupportedType(String),
    /// A model whose metadata or tensors do not make a runnable model.
    #[error("model: {0}")]
    Model(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    Template(String),
    /// Bad flags or arguments, named.
    #[error("{0}")]
    Usage(String),
    #[error("{0}")]
    Msg(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }
}

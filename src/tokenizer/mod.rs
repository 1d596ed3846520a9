//! Tokenizers built from GGUF vocabularies; chat templates.

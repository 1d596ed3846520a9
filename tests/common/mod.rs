//! Shared helpers for the integration tests: the real test model and the golden file.

#![allow(dead_code)]

use std::path::PathBuf;

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The real test model; fails with the command that fetches it when absent.
pub fn model_path() -> PathBuf {
    let p = repo().join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.exists(),
        "{} is missing: run scripts/fetch-models.sh",
        p.display()
    );
    p
}

/// Reference outputs of llama.cpp (copied from ../shared/golden into the repository).
pub fn golden_dir() -> PathBuf {
    repo().join("tests/data/golden")
}

pub fn golden() -> serde_json::Value {
    let p = golden_dir().join("smollm2-q4_1.json");
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
}

pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

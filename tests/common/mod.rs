//! Shared helpers for the integration tests: the real test model and the golden file.

#![allow(dead_code)]

pub mod numpy_ref;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Runs the oato binary in `cwd` (without `$OATO_MODEL`).
pub fn oato(args: &[&str], cwd: &Path) -> Output {
    oato_env(args, cwd, &[])
}

/// As [`oato`], with extra environment variables.
pub fn oato_env(args: &[&str], cwd: &Path, env: &[(&str, &str)]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_oato"))
        .args(args)
        .current_dir(cwd)
        .env_remove("OATO_MODEL")
        .envs(env.iter().copied())
        .output()
        .expect("the oato binary runs")
}

/// The oato binary with `args`, in the repository, without `$OATO_MODEL`, its standard input,
/// output and error piped: for a test that talks to it while it runs.
pub fn oato_piped(args: &[&str]) -> std::process::Command {
    use std::process::Stdio;
    let mut c = Command::new(env!("CARGO_BIN_EXE_oato"));
    c.args(args)
        .current_dir(repo())
        .env_remove("OATO_MODEL")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The stdout of a command that must have succeeded (its stdout and stderr in the failure).
pub fn ok(out: &Output) -> String {
    assert!(
        out.status.success(),
        "{}\n{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    text(&out.stdout)
}

/// A folder for case `name` of test file `tag`, under the temp dir, one per process.
pub fn tmp_dir(tag: &str, name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("oato-{tag}-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

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

/// Greedy continuation of `prompt` for `n` tokens on slot 0 of `session`, from position 0.
pub fn greedy(session: &mut oato::runtime::forward::Session, prompt: &[u32], n: usize) -> Vec<u32> {
    use oato::runtime::forward::Logits;
    use oato::runtime::sampler::argmax;
    session.reset();
    let mut logits = session.forward(prompt, Logits::Last).unwrap();
    let mut out = Vec::new();
    for i in 0..n {
        let t = argmax(&logits);
        out.push(t);
        if i + 1 < n {
            logits = session.forward(&[t], Logits::Last).unwrap();
        }
    }
    out
}

/// How a greedy continuation compares with llama.cpp's under the parity rule.
#[derive(Debug)]
#[allow(dead_code)] // the fields are printed through Debug
pub enum Parity {
    Equal,
    /// Diverged at step `d` at an allowed near-tie.
    NearTie {
        d: usize,
        margin: f64,
    },
}

/// The golden file's rule: equal up to the first difference d; at d our token must be among
/// llama.cpp's top choices there (`top[d]`: `per_step_top5`, or the original `per_step_top2`
/// when the file has no top five) with a logit within 0.5 of the top one.
pub fn check_parity(
    ours: &[u32],
    theirs: &[u32],
    top: &serde_json::Value,
) -> Result<Parity, String> {
    for (d, (&a, &b)) in ours.iter().zip(theirs).enumerate() {
        if a == b {
            continue;
        }
        let choices = top[d].as_array().cloned().unwrap_or_default();
        let first = choices
            .first()
            .and_then(|c| c[1].as_f64())
            .unwrap_or(f64::NAN);
        let ours_logit = choices
            .iter()
            .find(|c| c[0].as_u64() == Some(a as u64))
            .and_then(|c| c[1].as_f64());
        if let Some(l) = ours_logit {
            let margin = first - l;
            if margin < 0.5 {
                return Ok(Parity::NearTie { d, margin });
            }
            return Err(format!(
                "step {d}: ours {a}, llama.cpp {b}: our token's logit is {margin:.3} below its top"
            ));
        }
        return Err(format!(
            "step {d}: ours {a}, llama.cpp {b}: our token is not among its top {}",
            choices.len()
        ));
    }
    if ours.len() != theirs.len() {
        return Err(format!(
            "lengths differ: ours {}, llama.cpp {}",
            ours.len(),
            theirs.len()
        ));
    }
    Ok(Parity::Equal)
}

/// The per-step top choices the rule reads: the top five when the file has them.
pub fn top_choices(p: &serde_json::Value) -> &serde_json::Value {
    if p["per_step_top5"].is_array() {
        &p["per_step_top5"]
    } else {
        &p["per_step_top2"]
    }
}

/// Every weight and layer home of `map` on backend 0 or 1 at random.
#[allow(dead_code)]
pub fn scatter(map: &mut oato::runtime::forward::DeviceMap, rng: &mut oato::quant::testdata::Rng) {
    for d in map.weights.values_mut() {
        *d = (rng.next() & 1) as usize;
    }
    for h in map.layer_home.iter_mut() {
        *h = (rng.next() & 1) as usize;
    }
}

/// A random half of the weights `map` puts on backend `dev` (each with probability 1/2).
#[allow(dead_code)]
pub fn random_half(
    map: &oato::runtime::forward::DeviceMap,
    dev: usize,
    rng: &mut oato::quant::testdata::Rng,
) -> std::collections::HashSet<String> {
    map.weights
        .iter()
        .filter(|&(_, &d)| d == dev)
        .map(|(n, _)| n.clone())
        .filter(|_| rng.next() & 1 == 1)
        .collect()
}

//! The GPU backend's prefill GEMM paths for quantised weights, end to end on the stand-in CUDA
//! driver (scripts/fake-gpu.sh: the emulator's kernels behind the driver and cuBLAS calls):
//! `OATO_CUDA_MMQ=1` (int8 GEMM, mmq.cu), `=0` (dequantisation + cuBLAS) and `auto` (both timed
//! once per shape, then the faster) each give greedy ids within the golden parity rule for the
//! golden prompt whose 9 tokens make a prefill batch, and the driver's launch log shows that each
//! run took the path it names. Skipped, saying why, where scripts/check-cuda-kernels.sh has not
//! made the NVRTC environment the stand-in driver needs. Slow: the emulator runs every kernel.

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::{check_parity, golden, ids, model_path, repo, text, top_choices};

/// The virtual environment scripts/fake-gpu.sh takes NVRTC from, if it is there.
fn cuda_venv() -> Option<PathBuf> {
    let p = std::env::var_os("OATO_CUDA_VENV")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/oato/cuda-venv"))
        })?;
    p.join("bin/python").exists().then_some(p)
}

/// Greedy ids of `prompt` under `OATO_CUDA_MMQ=mode` with the whole model on the stand-in GPU,
/// and how many times the int8 GEMM (either tile size), the Q4_1 dequantisation kernels and the
/// stopwatch's lead-in (`gpu_sleep`, one per timing) were launched.
fn run(mode: &str, prompt: &str, n: usize) -> (Vec<u32>, usize, usize, usize) {
    let out = Command::new(repo().join("scripts/fake-gpu.sh"))
        .arg(env!("CARGO_BIN_EXE_oato"))
        .args(["run", &model_path().display().to_string(), "-p", prompt])
        .args([
            "-n",
            &n.to_string(),
            "--temp",
            "0",
            "--ignore-eos",
            "--json",
            "-c",
            "256",
        ])
        .args(["--device", "gpu"])
        .current_dir(repo())
        .env_remove("OATO_MODEL")
        .env("OATO_CUDA_MMQ", mode)
        .env("OATO_FAKE_CUDA_LOG", "1")
        .output()
        .expect("scripts/fake-gpu.sh runs");
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(
        out.status.success(),
        "OATO_CUDA_MMQ={mode}: {stdout}\n{}",
        stderr
            .lines()
            .filter(|l| !l.starts_with("fake-cuda: "))
            .collect::<Vec<_>>()
            .join("\n")
    );
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).expect("run --json output");
    let launches = |k: &str| {
        stderr
            .lines()
            .filter(|l| l.starts_with(&format!("fake-cuda: launch {k}")))
            .count()
    };
    (
        ids(&v["output_ids"]),
        launches("mmq_q4_1"),
        launches("dequant_q4_1_f16"),
        launches("gpu_sleep"),
    )
}

#[test]
fn prefill_by_int8_gemm_and_by_cublas_keep_golden_parity_on_the_stand_in_driver() {
    if cuda_venv().is_none() {
        println!("skipped: no NVRTC venv (run scripts/check-cuda-kernels.sh first)");
        return;
    }
    let g = golden();
    let p = g["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["prompt_ids"].as_array().unwrap().len() > 8)
        .expect("a golden prompt longer than a decode batch");
    let prompt = p["prompt"].as_str().unwrap();
    let want: Vec<u32> = ids(&p["output_ids"]).into_iter().take(3).collect();
    // 30 layers x 7 Q4_1 weights, each multiplied once per prefill batch.
    let per_prefill = 30 * 7;
    // Weight products of the whole run, as OATO_CUDA_MMQ=1 counts them (the first mode).
    let mut products = 0;
    for mode in ["1", "0", "auto"] {
        let (got, mmq, deq, sleeps) = run(mode, prompt, want.len());
        println!(
            "OATO_CUDA_MMQ={mode}: {got:?}; {mmq} mmq_q4_1, {deq} dequant_q4_1_f16, {sleeps} \
             gpu_sleep launches"
        );
        if let Err(e) = check_parity(&got, &want, top_choices(p)) {
            panic!("OATO_CUDA_MMQ={mode}: {e}\n  ours: {got:?}\n  llama.cpp: {want:?}");
        }
        match mode {
            "1" => {
                assert!(mmq >= per_prefill && deq == 0, "{mmq} mmq, {deq} dequant");
                assert_eq!(sleeps, 0, "nothing timed");
                products = mmq;
            }
            "0" => {
                assert!(mmq == 0 && deq == products, "{mmq} mmq, {deq} dequant");
                assert_eq!(sleeps, 0, "nothing timed");
            }
            // Each of the 4 weight shapes (q and o, k and v, gate and up, down) runs both ways
            // twice (untimed, timed) instead of once when first seen (3 more launches), once
            // more where the int8 kernel wins, then the faster for every layer: a shape timed
            // twice would exceed the bound.
            // Every timing (2 per shape) starts behind the stopwatch's lead-in.
            _ => {
                assert!(
                    mmq >= 8 && deq >= 8 && (products + 12..=products + 16).contains(&(mmq + deq)),
                    "{mmq} mmq, {deq} dequant"
                );
                assert_eq!(sleeps, 8, "one gpu_sleep per timing");
            }
        }
    }
    // A value the switch does not know: an error that names it, not a panic.
    let out = Command::new(repo().join("scripts/fake-gpu.sh"))
        .arg(env!("CARGO_BIN_EXE_oato"))
        .args(["run", "-p", "hi", "-n", "1", "--device", "gpu"])
        .current_dir(repo())
        .env_remove("OATO_MODEL")
        .env("OATO_CUDA_MMQ", "yes")
        .output()
        .expect("scripts/fake-gpu.sh runs");
    let err = text(&out.stderr);
    assert!(
        !out.status.success() && err.contains("OATO_CUDA_MMQ=\"yes\"") && !err.contains("panicked"),
        "{err}"
    );
}

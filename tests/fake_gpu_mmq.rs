//! The GPU backend's prefill GEMM paths for quantised weights, end to end on the stand-in CUDA
//! driver (scripts/fake-gpu.sh: the emulator's kernels behind the driver and cuBLAS calls):
//! `OATO_CUDA_MMQ=1` (int8 GEMM, mmq.cu: on tensor cores, as the stand-in device is sm_90, with
//! and without split-K, and with `OATO_CUDA_MMA=0` on `__dp4a`), `=0` (dequantisation + cuBLAS) and `auto` (both timed
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

/// What one run launched: the int8 GEMM on tensor cores and on `__dp4a` (either tile size), the
/// Q4_1 dequantisation kernels and the stopwatch's lead-in (`gpu_sleep`, one per timing).
struct Launches {
    mma: usize,
    dp4a: usize,
    deq: usize,
    sleeps: usize,
    /// Split-K partial sums added up (`mmq_splitk_sum`).
    sums: usize,
}

/// Greedy ids of `prompt` under `OATO_CUDA_MMQ=mode` (and `OATO_CUDA_MMA=mma`,
/// `OATO_CUDA_MMQ_SPLITK=splitk`) with the whole model on the stand-in GPU, and what it launched.
fn run(mode: &str, mma: &str, splitk: &str, prompt: &str, n: usize) -> (Vec<u32>, Launches) {
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
            // One prefill a run, not two: the emulator's prefill is most of a run's time.
            "--no-warmup",
        ])
        .args(["--device", "gpu"])
        .current_dir(repo())
        .env_remove("OATO_MODEL")
        .env("OATO_CUDA_MMQ", mode)
        .env("OATO_CUDA_MMA", mma)
        .env("OATO_CUDA_MMQ_SPLITK", splitk)
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
        Launches {
            mma: launches("mmq_mma_q4_1"),
            dp4a: launches("mmq_q4_1"),
            deq: launches("dequant_q4_1_f16"),
            sleeps: launches("gpu_sleep"),
            sums: launches("mmq_splitk_sum"),
        },
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
    let mut dp4a_ids = Vec::new();
    for (mode, mma, splitk) in [
        ("1", "0", "1"),
        ("1", "1", "0"),
        ("1", "1", "1"),
        ("0", "1", "1"),
        ("auto", "1", "1"),
    ] {
        let (got, l) = run(mode, mma, splitk, prompt, want.len());
        let Launches {
            mma: tc,
            dp4a,
            deq,
            sleeps,
            sums,
        } = l;
        println!(
            "OATO_CUDA_MMQ={mode} OATO_CUDA_MMA={mma} OATO_CUDA_MMQ_SPLITK={splitk}: {got:?}; \
             {tc} mmq_mma_q4_1, {dp4a} mmq_q4_1, {sums} mmq_splitk_sum, {deq} dequant_q4_1_f16, \
             {sleeps} gpu_sleep launches"
        );
        if let Err(e) = check_parity(&got, &want, top_choices(p)) {
            panic!("OATO_CUDA_MMQ={mode}: {e}\n  ours: {got:?}\n  llama.cpp: {want:?}");
        }
        // Only one of the two int8 kernels runs in a process.
        assert!(tc == 0 || dp4a == 0, "{tc} mma, {dp4a} dp4a");
        let mmq = tc + dp4a;
        match (mode, mma, splitk) {
            ("1", "0", _) => {
                assert!(
                    dp4a >= per_prefill && tc == 0 && deq == 0,
                    "{dp4a} mmq, {deq} dequant"
                );
                assert_eq!((sleeps, sums), (0, 0), "nothing timed, nothing split");
                products = dp4a;
                dp4a_ids = got;
            }
            ("1", _, "0") => {
                // The same sums in the same order: the same tokens.
                assert!(tc == products && deq == 0, "{tc} mma, {deq} dequant");
                assert_eq!((sleeps, sums), (0, 0), "nothing timed, nothing split");
                assert_eq!(got, dp4a_ids, "tensor cores and __dp4a");
            }
            ("1", _, _) => {
                // ffn_down (k = 1536, 6 steps; 18 blocks of 32 rows on the stand-in's 132
                // multiprocessors) splits k in 3, once a layer and prefill; k = 576 (3 steps)
                // does not split.
                assert!(tc == products && deq == 0, "{tc} mma, {deq} dequant");
                assert_eq!(sums, products / 7, "one split product a layer and prefill");
                assert_eq!(sleeps, 0, "nothing timed");
            }
            ("0", _, _) => {
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

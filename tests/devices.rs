//! Backends through the binary: `oato selftest` checks every operator and weight type on the CPU
//! against the reference; without a GPU, `--device gpu` is a clear error and the default device
//! falls back to the CPU saying so in one line; with one, the GPU selftest passes.

mod common;

use oato::runtime::cuda_backend;

use common::{oato, repo, text};

/// Every case line of a selftest report, and how many say OK.
fn cases(stdout: &str) -> (usize, usize) {
    let lines: Vec<&str> = stdout
        .lines()
        .filter(|l| l.ends_with(" OK") || l.ends_with(" FAIL"))
        .collect();
    let ok = lines.iter().filter(|l| l.ends_with(" OK")).count();
    (lines.len(), ok)
}

#[test]
fn cpu_selftest_passes_every_operator_and_type() {
    let out = oato(&["selftest", "--device", "cpu", "-t", "2"], &repo());
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    let (n, ok) = cases(&stdout);
    // 15 weight types x 5 batch sizes, a shared-input pair, and the other operators.
    assert!(n >= 89, "only {n} cases:\n{stdout}");
    assert_eq!(ok, n, "{stdout}");
    for ty in [
        "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL",
        "IQ4_XS", "F16", "BF16", "F32",
    ] {
        assert!(
            stdout.contains(&format!("matmul     {ty} ")),
            "no {ty} case:\n{stdout}"
        );
    }
}

/// `selftest --perf` on the CPU times the test model's shapes to its last table; the K-quants,
/// whose 256-element blocks do not divide the test model's 576, get a line saying so (they were
/// an error that ended the run at Q2_K).
#[test]
fn cpu_selftest_perf_reaches_its_last_table() {
    let out = oato(
        &["selftest", "--device", "cpu", "-t", "2", "--perf"],
        &repo(),
    );
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    for want in [
        "Q4_0   576x1536 ",
        "Q2_K   576x576      (rows of 576 are no whole number of 256-element blocks)",
        "IQ4_NL 576x1536 ",
        "rms_norm 4096 x 64: ",
        "attention prefill, 32/8 heads x 128, 64 tokens: ",
    ] {
        assert!(stdout.contains(want), "no {want:?} in:\n{stdout}");
    }
}

#[test]
fn gpu_device_without_a_gpu_is_a_clear_error() {
    let Err(why) = cuda_backend::probe() else {
        println!("skipped: this machine has a GPU");
        return;
    };
    for args in [
        &["run", "--device", "gpu", "-p", "hi", "-n", "2"][..],
        &["selftest", "--device", "gpu"][..],
        &["bench", "--device", "gpu", "-p", "8", "-n", "0", "-r", "1"][..],
    ] {
        let out = oato(args, &repo());
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(
            err.contains("--device gpu: ") && err.contains(&why),
            "{args:?}: {err}"
        );
        assert!(!err.contains("panicked"), "{err}");
    }
}

#[test]
fn default_device_falls_back_to_the_cpu_in_one_line() {
    if cuda_backend::probe().is_ok() {
        println!("skipped: this machine has a GPU");
        return;
    }
    let out = oato(
        &[
            "run",
            "-p",
            "The capital of France is",
            "-n",
            "3",
            "--temp",
            "0",
            "-t",
            "2",
        ],
        &repo(),
    );
    let err = text(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert_eq!(err.matches("no GPU (").count(), 1, "{err}");
    assert!(err.contains("running on the CPU"), "{err}");
    assert!(text(&out.stdout).contains("Paris"), "{}", text(&out.stdout));
}

#[test]
fn gpu_selftest_passes_when_there_is_a_gpu() {
    if let Err(why) = cuda_backend::probe() {
        println!("skipped: {why}");
        return;
    }
    let out = oato(&["selftest", "--device", "gpu"], &repo());
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    let (n, ok) = cases(&stdout);
    assert!(n >= 79 && ok == n, "{stdout}");
}

#[test]
fn compile_only_without_nvrtc_says_what_is_missing() {
    if oato::kernels::cuda::nvrtc_present() {
        println!(
            "skipped: libnvrtc is on the library path (scripts/check-cuda-kernels.sh covers it)"
        );
        return;
    }
    let out = oato(&["selftest", "--compile-only"], &repo());
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("libnvrtc not found"), "{err}");
}

/// `--source` names kernel sources; one that is not among them is an error naming it and the
/// sources there are, before NVRTC is asked for (so it holds with or without libnvrtc).
#[test]
fn compile_only_names_an_unknown_source() {
    let out = oato(
        &["selftest", "--compile-only", "--source", "ops.cu,nope.cu"],
        &repo(),
    );
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("--source nope.cu") && err.contains("ops.cu, flash_decode.cu"),
        "{err}"
    );
}

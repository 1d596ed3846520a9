//! The lease's analysis scripts check their own arithmetic on made-up input (they run for real
//! only on a GPU machine, where a parsing mistake would cost a lease's figures).

use std::process::Command;

/// Runs `python3 experiments/SCRIPT --check` and asserts it succeeds and prints `SCRIPT --check: OK`.
fn checks_itself(script: &str) {
    let out = Command::new("python3")
        .args([&format!("experiments/{script}"), "--check"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains(&format!("{script} --check: OK")),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// experiments/ncu_step.py --check: an Nsight Compute CSV with log lines, a repeated header,
/// thousands separators and a forward cut off is read into the right launches, the whole
/// forwards between output heads are kept, and the per-kernel and per-forward figures add up.
#[test]
fn ncu_step_summary_checks_itself() {
    checks_itself("ncu_step.py");
}

/// experiments/pick_variant.py --check: the lease's choice of CUDA settings for its later stages
/// (the fastest decode whose prefill holds, beyond the noise, else the defaults; a failed
/// variant skipped; no default figures an error) on made-up `oato bench` files.
#[test]
fn pick_variant_checks_itself() {
    checks_itself("pick_variant.py");
}

//! The lease's analysis scripts check their own arithmetic on made-up input (they run for real
//! only on a GPU machine, where a parsing mistake would cost a lease's figures).

use std::process::Command;

/// experiments/ncu_step.py --check: an Nsight Compute CSV with log lines, a repeated header,
/// thousands separators and a forward cut off is read into the right launches, the whole
/// forwards between output heads are kept, and the per-kernel and per-forward figures add up.
#[test]
fn ncu_step_summary_checks_itself() {
    let out = Command::new("python3")
        .args(["experiments/ncu_step.py", "--check"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("OK"),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

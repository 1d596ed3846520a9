//! Embeds the git commit (`OATO_BUILD_COMMIT`, short hash) and the number of commits
//! (`OATO_BUILD_NUMBER`) for `oato bench`'s `build_commit` / `build_number`, as llama.cpp embeds
//! its own. Without git, or outside a repository, they are "unknown" and 0; the build never fails.

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let s = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (!s.is_empty()).then_some(s)
}

fn main() {
    let commit = git(&["rev-parse", "--short", "HEAD"]).unwrap_or_else(|| "unknown".into());
    let number = git(&["rev-list", "--count", "HEAD"])
        .and_then(|s| s.parse::<u64>().ok())
        .unwrap_or(0);
    println!("cargo:rustc-env=OATO_BUILD_COMMIT={commit}");
    println!("cargo:rustc-env=OATO_BUILD_NUMBER={number}");

    // Run again when HEAD moves: HEAD itself (branch switches), the branch's ref (commits) and
    // packed-refs (after `git gc`). Only paths that exist: cargo reruns the script on every
    // build while a watched path is missing.
    println!("cargo:rerun-if-changed=build.rs");
    let mut watch = vec!["HEAD".to_string(), "packed-refs".to_string()];
    watch.extend(git(&["symbolic-ref", "-q", "HEAD"]));
    for name in watch {
        if let Some(p) = git(&["rev-parse", "--git-path", &name])
            && std::path::Path::new(&p).exists()
        {
            println!("cargo:rerun-if-changed={p}");
        }
    }
}

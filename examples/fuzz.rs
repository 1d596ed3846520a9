//! The long fuzz run, outside CI: `cargo run --release --example fuzz -- [INPUTS] [SEED]
//! [TARGET...]` runs INPUTS (default 1,000,000) mutated inputs through each target (gguf,
//! profile, placement; default all), prints each target's figures, and writes any panicking
//! input to target/fuzz-found/TARGET-N.bin with its message on stderr. Exits 1 if any panicked.
//! `-- replay TARGET FILE` runs one input, a panic propagating (with RUST_BACKTRACE=1, where).

use oato::fuzz::{Seeds, Target, fuzz, replay};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("replay") {
        let target = Target::ALL
            .into_iter()
            .find(|t| args.get(1) == Some(&t.name().to_string()));
        let (Some(t), Some(f)) = (target, args.get(2)) else {
            eprintln!("usage: fuzz replay gguf|profile|placement FILE");
            std::process::exit(2);
        };
        let input = std::fs::read(f).unwrap_or_else(|e| panic!("{f}: {e}"));
        let seeds = Seeds::new().unwrap_or_else(|e| panic!("the seeds: {e}"));
        println!("{:?}", replay(t, &seeds, &input));
        return;
    }
    let inputs: u64 = args
        .first()
        .and_then(|a| a.parse().ok())
        .unwrap_or(1_000_000);
    let seed: u64 = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(1);
    let targets: Vec<Target> = match args.get(2..) {
        Some(names) if !names.is_empty() => Target::ALL
            .into_iter()
            .filter(|t| names.iter().any(|n| n == t.name()))
            .collect(),
        _ => Target::ALL.to_vec(),
    };
    let seeds = match Seeds::new() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: the seeds: {e}");
            std::process::exit(1);
        }
    };
    let out = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/fuzz-found");
    let mut found = 0;
    for t in targets {
        let r = fuzz(t, &seeds, inputs, seed);
        println!(
            "{:<9} {} inputs in {:.1} s ({:.0}/s): {} accepted, {} rejected with an error, {} panicked",
            t.name(),
            r.inputs,
            r.secs,
            r.inputs as f64 / r.secs.max(1e-9),
            r.accepted,
            r.rejected,
            r.panics.len()
        );
        for (i, p) in r.panics.iter().enumerate() {
            let _ = std::fs::create_dir_all(&out);
            let f = out.join(format!("{}-{i}.bin", t.name()));
            let _ = std::fs::write(&f, &p.input);
            eprintln!("  panic: {} (input: {})", p.message, f.display());
        }
        found += r.panics.len();
    }
    if found > 0 {
        std::process::exit(1);
    }
}

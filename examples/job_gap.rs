//! What a decode matmul job costs on the CPU pool after the caller has waited a while, as a
//! hybrid decode does between its CPU jobs (the GPU's part of a layer, the caller spinning on an
//! event): `cargo run --release --example job_gap -- [THREADS] [TYPE K N] [ROUNDS]` (default 2
//! threads, Q4_0 4096 x 14336: LLaMA3-8B's ffn_up, interleaved where the type has it). For
//! each gap (`GAPS`, microseconds, comma-separated; default 0,50,200,500,1000,2000,5000,20000)
//! the caller spins that long, then times one product; copies of the weight fill 256 MiB and
//! the products go round them (so each reads DRAM). Gaps alternate within a round, so a drifting
//! machine moves all alike. Prints per gap the median and mean job time and their excess over the
//! back-to-back (gap 0) median. `AWAKE=1` takes the pool's `stay_awake` guard before each wait
//! (as a hybrid forward pass takes it before its steps); `AWAKE=both` runs each gap both ways in
//! turn.

use std::time::{Duration, Instant};

use oato::kernels::cpu::matmul::{Layout, MatRef, QuantizedActs, matmul_quantized};
use oato::kernels::cpu::repack;
use oato::quant::GgmlType;

fn spin(d: Duration) {
    let t0 = Instant::now();
    while t0.elapsed() < d {
        std::hint::spin_loop();
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize, default: &str| args.get(i).cloned().unwrap_or(default.to_string());
    let threads: usize = arg(0, "2").parse().expect("THREADS: a number");
    let ty = GgmlType::from_name(&arg(1, "Q4_0")).expect("TYPE: a GGML type name");
    let k: usize = arg(2, "4096").parse().expect("K: a number");
    let n: usize = arg(3, "14336").parse().expect("N: a number");
    let rounds: usize = arg(4, "40").parse().expect("ROUNDS: a number");
    let gaps: Vec<u64> = std::env::var("GAPS")
        .unwrap_or("0,50,200,500,1000,2000,5000,20000".into())
        .split(',')
        .map(|g| {
            g.trim()
                .parse()
                .expect("GAPS: microseconds, comma-separated")
        })
        .collect();
    oato::kernels::cpu::pool::set_threads(threads);
    let mut data = vec![0u8; ty.row_bytes(k).expect("K fits the type") * n];
    let mut rng = oato::rng::SplitMix64::new(0x9E37_79B9_7F4A_7C15);
    oato::kernels::cpu::random_blocks(ty, &mut data, &mut rng, |_| 0.002);
    let arena = repack::Arena::default();
    let copies = (256usize << 20).div_ceil(data.len());
    let interleaved = repack::repacks(ty, k, n);
    let held: Vec<_> = (0..copies)
        .map(|_| {
            if interleaved {
                repack::pack(ty, &data, k, n, threads, &arena).expect("an interleaved copy")
            } else {
                arena.copy(&data, threads).expect("a plain copy")
            }
        })
        .collect();
    let mats: Vec<MatRef> = held
        .iter()
        .map(|p| MatRef {
            layout: if interleaved {
                Layout::Interleaved
            } else {
                Layout::Rows
            },
            data: p.bytes(),
            ..MatRef::rows(ty, k, n, p.bytes())
        })
        .collect();
    let x = oato::kernels::cpu::random_acts(k, &mut oato::rng::SplitMix64::new(7));
    let acts = QuantizedActs::new(ty, &x, k).expect("the activations");
    let mut y = vec![0f32; n];
    for m in &mats {
        matmul_quantized(m, &acts, &mut y).expect("a product"); // warm the pool and the pages
    }
    let awake = std::env::var("AWAKE").unwrap_or_default();
    let modes: &[bool] = match awake.as_str() {
        "1" => &[true],
        "both" => &[false, true],
        _ => &[false],
    };
    // times[mode][gap]: each round takes every gap, and at each gap every mode in turn.
    let mut times = vec![vec![Vec::new(); gaps.len()]; modes.len()];
    let copies = mats.len();
    let mut at = 0;
    for _ in 0..rounds {
        for (i, &g) in gaps.iter().enumerate() {
            for (m, &hold) in modes.iter().enumerate() {
                // Taken before the wait, as a forward pass takes it before its first step.
                let guard = hold.then(|| oato::kernels::cpu::pool::global().stay_awake());
                spin(Duration::from_micros(g));
                let t0 = Instant::now();
                matmul_quantized(&mats[at % copies], &acts, &mut y).expect("a product");
                times[m][i].push(t0.elapsed().as_secs_f64() * 1e6);
                drop(guard);
                at += 1;
            }
        }
    }
    let median = |t: &mut Vec<f64>| {
        t.sort_by(f64::total_cmp);
        t[t.len() / 2]
    };
    let m0 = &mats[0];
    for (m, &hold) in modes.iter().enumerate() {
        let base = median(&mut times[m][0].clone());
        println!(
            "{} {}x{} ({:?}), {threads} threads, {rounds} rounds, {} MiB a product, {}",
            m0.ty,
            m0.n,
            m0.k,
            m0.layout,
            m0.data.len() >> 20,
            if hold {
                "pool kept awake"
            } else {
                "pool free to park"
            }
        );
        for (g, t) in gaps.iter().zip(&mut times[m]) {
            let mean = t.iter().sum::<f64>() / t.len() as f64;
            let med = median(t);
            println!(
                "gap {g:>6} us: median {med:8.1} us (+{:6.1}), mean {mean:8.1} us (+{:6.1}), max {:8.1} us",
                med - base,
                mean - base,
                t[t.len() - 1]
            );
        }
    }
}

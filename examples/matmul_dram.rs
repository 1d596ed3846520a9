//! One weight matrix far larger than the caches, in the file's layout and interleaved by sixteen
//! rows (`repack`), against one token (decode) or a few, on the CPU pool:
//! `cargo run --release --example matmul_dram -- TYPE K N [THREADS] [TOKENS] [ROUNDS]`
//! (default the Llama-3.2-1B head, Q6_K 2048 x 128256, 2 threads, 1 token, 8 rounds). A matrix
//! smaller than 256 MiB is copied until the copies fill that, and the products go round the
//! copies, so each reads its weights from DRAM as decode does (not from the last level cache;
//! `OATO_DRAM_MIB` sets that fill, a few MiB keeping the copies in cache; `OATO_DRAM_KIB` in KiB).
//! Rounds alternate the layouts (the file's, and `repack`'s where the type has it) and a plain
//! read of the same copies on the same pool (`read`: the memory's rate at that moment), so a
//! machine whose memory rate drifts moves all alike; prints each round's GB/s of weights and the
//! median. The activations are random (`kernels::cpu::random_acts`), or with `ACTS=sin` a
//! smooth sine whose blocks share one scale.

use std::time::Instant;

use oato::kernels::cpu::matmul::{Layout, MatRef, QuantizedActs, matmul_quantized};
use oato::kernels::cpu::repack;
use oato::quant::GgmlType;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize, default: &str| args.get(i).cloned().unwrap_or(default.to_string());
    let ty = GgmlType::from_name(&arg(0, "Q6_K")).expect("TYPE: a GGML type name");
    let k: usize = arg(1, "2048").parse().expect("K: a number");
    let n: usize = arg(2, "128256").parse().expect("N: a number");
    let threads: usize = arg(3, "2").parse().expect("THREADS: a number");
    let n_tok: usize = arg(4, "1").parse().expect("TOKENS: a number");
    let rounds: usize = arg(5, "8").parse().expect("ROUNDS: a number");
    oato::kernels::cpu::pool::set_threads(threads);
    // Random quants, every block's f16 scales 0.002 (so the f16 table stays in cache; real
    // weights' scales do not: `examples/decode_mix`).
    let mut data = vec![0u8; ty.row_bytes(k).expect("K fits the type") * n];
    let mut rng = oato::rng::SplitMix64::new(0x9E37_79B9_7F4A_7C15);
    oato::kernels::cpu::random_blocks(ty, &mut data, &mut rng, |_| 0.002);
    let arena = repack::Arena::default();
    // OATO_DRAM_MIB: the bytes the copies fill (default 256 MiB; a few MiB keeps them in cache);
    // OATO_DRAM_KIB instead, for a fill inside a core's L2.
    let var = |name: &str| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
    };
    let fill =
        var("OATO_DRAM_KIB").map_or_else(|| var("OATO_DRAM_MIB").unwrap_or(256) << 20, |k| k << 10);
    let copies = fill.div_ceil(data.len());
    let packed: Vec<_> = (0..copies)
        .filter(|_| repack::repacks(ty, k, n))
        .map(|_| repack::pack(ty, &data, k, n, threads, &arena).expect("an interleaved copy"))
        .collect();
    let plain: Vec<_> = (0..copies)
        .map(|_| arena.copy(&data, threads).expect("a plain copy"))
        .collect();
    let bytes = data.len();
    drop(data);
    // Activations without a pattern, as decode's (`ACTS=sin`: the smooth sine).
    let x: Vec<f32> = if std::env::var("ACTS").is_ok_and(|v| v == "sin") {
        (0..k * n_tok).map(|i| (i as f32 * 0.37).sin()).collect()
    } else {
        oato::kernels::cpu::random_acts(k * n_tok, &mut oato::rng::SplitMix64::new(7))
    };
    let acts = QuantizedActs::new(ty, &x, k).expect("the activations");
    let mut y = vec![0f32; n * n_tok];
    let rows: Vec<MatRef> = plain
        .iter()
        .map(|p| MatRef::rows(ty, k, n, p.bytes()))
        .collect();
    let interleaved: Vec<MatRef> = packed
        .iter()
        .map(|p| MatRef {
            layout: Layout::Interleaved,
            data: p.bytes(),
            ..MatRef::rows(ty, k, n, p.bytes())
        })
        .collect();
    // OATO_DRAM_PREFETCH: a comma-separated list of the interleaved kernels' prefetch distances
    // in bytes, each a variant of its own (default: the kernels' own).
    let distances: Vec<Option<usize>> = match std::env::var("OATO_DRAM_PREFETCH") {
        Ok(v) => v
            .split(',')
            .map(|d| {
                Some(
                    d.trim()
                        .parse()
                        .expect("OATO_DRAM_PREFETCH: bytes, comma-separated"),
                )
            })
            .collect(),
        Err(_) => vec![None],
    };
    // (name, matrices, whether a product or a plain read of them, prefetch distance)
    let mut variants = vec![
        ("read".to_string(), &rows, false, None),
        ("rows".to_string(), &rows, true, None),
    ];
    if !interleaved.is_empty() {
        for &d in &distances {
            let name = d.map_or("interleaved".to_string(), |d| format!("interleaved@{d}"));
            variants.push((name, &interleaved, true, d));
        }
    }
    let read = |m: &MatRef| {
        std::hint::black_box(oato::kernels::cpu::plain_read(m.data));
    };
    let mut rates = vec![Vec::new(); variants.len()];
    for _ in 0..rounds {
        for (i, &(_, ws, product, ahead)) in variants.iter().enumerate() {
            #[cfg(target_arch = "x86_64")]
            repack::set_prefetch_ahead(ahead);
            #[cfg(not(target_arch = "x86_64"))]
            let _ = ahead;
            let mut run = |m: &MatRef| {
                if product {
                    matmul_quantized(m, &acts, &mut y).expect("a product")
                } else {
                    read(m)
                }
            };
            run(&ws[0]); // warm the pool
            let reps = 5 * copies;
            let t0 = Instant::now();
            for r in 1..=reps {
                run(&ws[r % copies]);
            }
            let s = t0.elapsed().as_secs_f64() / reps as f64;
            rates[i].push(bytes as f64 / s / 1e9);
        }
    }
    for ((name, _, _, _), r) in variants.iter().zip(&mut rates) {
        let each: Vec<String> = r.iter().map(|v| format!("{v:.2}")).collect();
        r.sort_by(f64::total_cmp);
        let median = r[r.len() / 2];
        // With several tokens, also the multiply-adds a second (weights x tokens).
        let macs = if n_tok > 1 {
            let per_byte = k as f64 * n as f64 / bytes as f64;
            format!(", {:.1} GMAC/s", median * per_byte * n_tok as f64)
        } else {
            String::new()
        };
        println!(
            "{ty} {n}x{k}, {n_tok} token(s), {threads} threads, {name}: [{}] median {median:.2} GB/s{macs}",
            each.join(" "),
        );
    }
}

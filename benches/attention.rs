//! Criterion benches of CPU decode attention (one token over an f16 KV cache) at the
//! Llama-3.2-1B and LLaMA3-8B head shapes, at several cache positions: `attention` as the engine
//! calls it (the decode path from 256 positions) against the one-(token, head)-per-task path.
//! Throughput is the KV cache's bytes read.
//!
//! Run: `cargo bench --bench attention`; `OATO_BENCH_THREADS=N` sets the pool size (default:
//! every core), `OATO_CPU_ISA` forces an ISA.

use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use half::f16;

use oato::kernels::cpu::attention::{AttnShape, attention, attention_per_head};
use oato::kernels::cpu::{isa, pool};

fn bench(c: &mut Criterion) {
    if let Some(n) = std::env::var("OATO_BENCH_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        pool::set_threads(n);
    }
    // (name, heads, KV heads, head size): 1B has 32 heads of 64, 8B 32 of 128; both 8 KV heads.
    let shapes = [("1b", 32, 8, 64), ("8b", 32, 8, 128)];
    let mut g = c.benchmark_group(format!("attention-decode/{}", isa().name()));
    g.measurement_time(Duration::from_secs(2));
    g.warm_up_time(Duration::from_millis(300));
    g.sample_size(20);
    for (name, n_head, n_head_kv, head_dim) in shapes {
        let s = AttnShape {
            n_head,
            n_head_kv,
            head_dim,
        };
        for pos in [128usize, 1024, 4096] {
            let kv_dim = n_head_kv * head_dim;
            let n = (pos + 1) * kv_dim;
            let k: Vec<f16> = (0..n)
                .map(|i| f16::from_f32((i as f32 * 0.37).sin()))
                .collect();
            let v: Vec<f16> = (0..n)
                .map(|i| f16::from_f32((i as f32 * 0.11).cos()))
                .collect();
            let q: Vec<f32> = (0..n_head * head_dim)
                .map(|i| (i as f32 * 0.7).sin())
                .collect();
            let mut out = vec![0f32; q.len()];
            g.throughput(Throughput::Bytes(2 * 2 * n as u64));
            let id = format!("{name}@{pos}");
            g.bench_function(BenchmarkId::new("engine", &id), |b| {
                b.iter(|| attention(s, black_box(&q), &k, &v, pos, &mut out))
            });
            g.bench_function(BenchmarkId::new("per-head", &id), |b| {
                b.iter(|| attention_per_head(s, black_box(&q), &k, &v, pos, &mut out))
            });
        }
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);

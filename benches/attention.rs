//! Criterion benches of CPU decode attention (one token over an f16 KV cache) at the
//! Llama-3.2-1B and LLaMA3-8B head shapes, at several cache positions: `attention` as the engine
//! calls it (the decode path) against the per-head path, and the engine's call with the cache
//! out of the CPU's caches, as a decode step finds it (`engine-cold`). Throughput is the KV
//! cache's bytes read.
//!
//! Run: `cargo bench --bench attention`; `OATO_BENCH_THREADS=N` sets the pool size (default:
//! every core), `OATO_CPU_ISA` forces an ISA.

use std::hint::black_box;
use std::time::Duration;

use criterion::{BatchSize, BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
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
    let mut flush = vec![0u64; 8 << 20];
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
            // As in a decode step, where the weights streamed since the last call have pushed
            // the cache out of the CPU's caches: a read of 64 MiB before each (untimed) call.
            g.bench_function(BenchmarkId::new("engine-cold", &id), |b| {
                b.iter_batched(
                    || evict(&mut flush),
                    |_| attention(s, black_box(&q), &k, &v, pos, &mut out),
                    BatchSize::PerIteration,
                )
            });
        }
    }
    g.finish();
}

/// Writes every cache line of `buf`, evicting the caches' earlier contents; on the pool, so its
/// workers are awake for the timed call as they are in a decode step.
fn evict(buf: &mut [u64]) {
    const CHUNK: usize = 1 << 16;
    let base = buf.as_mut_ptr() as usize;
    let n = buf.len();
    pool::global().for_chunks(n, CHUNK, |r| {
        // SAFETY: chunks are disjoint ranges of `buf`, which outlives the job.
        let part =
            unsafe { std::slice::from_raw_parts_mut((base as *mut u64).add(r.start), r.len()) };
        for x in part.iter_mut().step_by(8) {
            *x = x.wrapping_add(1);
        }
    });
    black_box(&buf[0]);
}

criterion_group!(benches, bench);
criterion_main!(benches);

//! Criterion benches of the CPU weight kernels at SmolLM2-135M's shapes, for every weight type
//! oato reads: `matmul` (activation quantisation + row dots over the thread pool) with 1 token
//! (decode) and 64 tokens (prefill), and a single-row `vec_dot` on one thread. Throughput is in
//! multiply-adds (k x n x tokens).
//!
//! Run: `cargo bench --bench dot` (filter: `cargo bench --bench dot -- Q4_1`). The ISA in use
//! (`OATO_CPU_ISA=scalar|avx2|avx512` forces one) is part of each name, so runs compare across
//! variants; `OATO_BENCH_THREADS=N` sets the pool size (default: every core).

use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};

use oato::kernels::cpu::matmul::{MatRef, QuantizedActs, matmul, matmul_quantized};
use oato::kernels::cpu::{isa, pool, vec_dot};
use oato::quant::{
    BlockQ2K, BlockQ3K, BlockQ4K, BlockQ5K, BlockQ6K, F16Le, GgmlType, as_blocks_mut,
    quantize_act_row, quantize_row,
};

/// (operator, k, n) of SmolLM2-135M: n_embd 576, kv_dim 192, n_ff 1536.
const SHAPES: &[(&str, usize, usize)] = &[
    ("attn_q", 576, 576),
    ("attn_k", 576, 192),
    ("ffn_up", 576, 1536),
    ("ffn_down", 1536, 576),
];
/// The tied output head (token_embd, Q8_0 in the test model): k = n_embd, n = n_vocab.
const HEAD: (&str, usize, usize) = ("output", 576, 49152);
const TOKENS: &[usize] = &[1, 64];

/// Types `quantize_row` makes from f32.
const QUANTISED: &[GgmlType] = &[
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::F32,
];
/// K-quant types, filled with random valid blocks. Their 256-element super-blocks fit only rows
/// whose length is a multiple of 256, so of the model's shapes only ffn_down (k = 1536).
const K_QUANTS: &[GgmlType] = &[
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
];

/// ggml's test pattern, shifted per row.
fn pattern(n: usize, offset: f32) -> Vec<f32> {
    (0..n)
        .map(|i| 0.1 + 2.0 * (i as f32 * 0.7 + offset).cos())
        .collect()
}

/// xorshift64*: reproducible random bytes for the K-quant blocks.
fn random_bytes(n: usize, mut seed: u64) -> Vec<u8> {
    (0..n)
        .map(|_| {
            seed ^= seed >> 12;
            seed ^= seed << 25;
            seed ^= seed >> 27;
            (seed.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 56) as u8
        })
        .collect()
}

/// `n` rows of `k` weights of type `ty`: patterned and quantised, or random K-quant blocks with
/// small finite scales (any quant and sub-scale bits are valid).
fn weights(ty: GgmlType, k: usize, n: usize) -> Vec<u8> {
    let row_bytes = ty.row_bytes(k).expect("k fits the type's blocks");
    if K_QUANTS.contains(&ty) {
        let mut data = random_bytes(row_bytes * n, 0x9E37_79B9_7F4A_7C15 ^ ty.id() as u64);
        let (d, dmin) = (F16Le::from_f32(0.01), F16Le::from_f32(0.002));
        match ty {
            GgmlType::Q2_K => as_blocks_mut::<BlockQ2K>(&mut data)
                .unwrap()
                .iter_mut()
                .for_each(|b| (b.d, b.dmin) = (d, dmin)),
            GgmlType::Q3_K => as_blocks_mut::<BlockQ3K>(&mut data)
                .unwrap()
                .iter_mut()
                .for_each(|b| b.d = d),
            GgmlType::Q4_K => as_blocks_mut::<BlockQ4K>(&mut data)
                .unwrap()
                .iter_mut()
                .for_each(|b| (b.d, b.dmin) = (d, dmin)),
            GgmlType::Q5_K => as_blocks_mut::<BlockQ5K>(&mut data)
                .unwrap()
                .iter_mut()
                .for_each(|b| (b.d, b.dmin) = (d, dmin)),
            GgmlType::Q6_K => as_blocks_mut::<BlockQ6K>(&mut data)
                .unwrap()
                .iter_mut()
                .for_each(|b| b.d = d),
            _ => unreachable!("K_QUANTS lists only these"),
        }
        return data;
    }
    let mut data = vec![0u8; row_bytes * n];
    for (r, dst) in data.chunks_mut(row_bytes).enumerate() {
        quantize_row(ty, &pattern(k, r as f32 * 0.37), dst).expect("quantisable type");
    }
    data
}

fn configure() -> Criterion {
    Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(200))
        .measurement_time(Duration::from_millis(600))
}

fn set_threads() -> usize {
    let n = std::env::var("OATO_BENCH_THREADS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    pool::set_threads(n)
}

/// `matmul` of one weight type at each shape, 1 and 64 tokens.
fn bench_matmul(c: &mut Criterion, ty: GgmlType, shapes: &[(&str, usize, usize)], threads: usize) {
    let mut g = c.benchmark_group(format!("matmul/{}/{ty}", isa().name()));
    for &(op, k, n) in shapes {
        let data = weights(ty, k, n);
        let w = MatRef::rows(ty, k, n, &data);
        for &t in TOKENS {
            let x = pattern(t * k, 0.5);
            let mut y = vec![0f32; t * n];
            g.throughput(Throughput::Elements((k * n * t) as u64));
            let id = BenchmarkId::new(format!("{op} k{k} n{n} {threads}thr"), format!("t{t}"));
            g.bench_function(id, |b| {
                b.iter(|| matmul(black_box(&w), black_box(&x), &mut y).unwrap())
            });
        }
    }
    g.finish();
}

/// One row dot product on the calling thread: the kernel alone, activations quantised once.
fn bench_vec_dot(c: &mut Criterion, ty: GgmlType, k: usize) {
    let mut g = c.benchmark_group(format!("vec_dot/{}/{ty}", isa().name()));
    let w = weights(ty, k, 1);
    let aty = ty.vec_dot_type();
    let mut a = vec![0u8; aty.row_bytes(k).unwrap()];
    quantize_act_row(aty, &pattern(k, 0.5), &mut a).unwrap();
    g.throughput(Throughput::Elements(k as u64));
    g.bench_function(BenchmarkId::from_parameter(format!("k{k}")), |b| {
        b.iter(|| vec_dot(ty, black_box(&w), black_box(&a), k))
    });
    g.finish();
}

/// Four rows against one token: the four-row decode kernel against four single-row dots, in
/// cache (the kernels' own speed, not the memory's).
#[cfg(target_arch = "x86_64")]
fn bench_rows4(c: &mut Criterion, ty: GgmlType, k: usize) {
    use oato::kernels::cpu::avx512::rows_fn;
    use oato::kernels::cpu::{Isa, dot_fn};
    let (Some(rows4), true) = (rows_fn(ty), Isa::Avx512.supported()) else {
        return;
    };
    let mut g = c.benchmark_group(format!("rows4/{ty}"));
    let w = weights(ty, k, 4);
    let rb = ty.row_bytes(k).unwrap();
    let rows: [&[u8]; 4] = std::array::from_fn(|r| &w[r * rb..(r + 1) * rb]);
    let mut a = vec![0u8; ty.vec_dot_type().row_bytes(k).unwrap()];
    quantize_act_row(ty.vec_dot_type(), &pattern(k, 0.5), &mut a).unwrap();
    g.throughput(Throughput::Bytes(4 * rb as u64));
    // SAFETY: both are handed out for this CPU only (checked above).
    g.bench_function(format!("k{k} rows4"), |b| {
        b.iter(|| unsafe { rows4(black_box(rows), black_box(&a)) })
    });
    let dot = dot_fn(Isa::Avx512, ty);
    g.bench_function(format!("k{k} 4x dot"), |b| {
        b.iter(|| rows.map(|r| unsafe { dot(black_box(r), black_box(&a), k) }))
    });
    g.finish();
}

/// Q4_0, Q4_K or Q6_K in the file's layout and interleaved by sixteen rows (`repack`), one token and four
/// (activations quantised beforehand), a matrix that stays in L2: the kernels' own speed, in
/// bytes of weights per second.
fn bench_interleaved(c: &mut Criterion, ty: GgmlType, k: usize, n: usize) {
    use oato::kernels::cpu::matmul::Layout;
    use oato::kernels::cpu::repack;
    if !repack::repacks(ty, k, n) {
        return;
    }
    let mut g = c.benchmark_group(format!("interleaved/{}/{ty}", isa().name()));
    let data = weights(ty, k, n);
    let arena = repack::Arena::default();
    let packed = repack::pack(ty, &data, k, n, 1, &arena).unwrap();
    for (name, w) in [
        ("rows", MatRef::rows(ty, k, n, &data)),
        (
            "interleaved",
            MatRef {
                layout: Layout::Interleaved,
                data: packed.bytes(),
                ..MatRef::rows(ty, k, n, &data)
            },
        ),
    ] {
        for t in [1, 4] {
            let acts = QuantizedActs::new(ty, &pattern(t * k, 0.5), k).unwrap();
            let mut y = vec![0f32; t * n];
            g.throughput(Throughput::Bytes(data.len() as u64));
            let id = BenchmarkId::new(format!("k{k} n{n} {name}"), format!("t{t}"));
            g.bench_function(id, |b| {
                b.iter(|| matmul_quantized(black_box(&w), black_box(&acts), &mut y).unwrap())
            });
        }
    }
    g.finish();
}

fn benches(c: &mut Criterion) {
    bench_interleaved(c, GgmlType::Q4_0, 2048, 128);
    bench_interleaved(c, GgmlType::Q4_K, 2048, 128);
    bench_interleaved(c, GgmlType::Q6_K, 2048, 128);
    #[cfg(target_arch = "x86_64")]
    for ty in [
        GgmlType::Q4_0,
        GgmlType::Q8_0,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
    ] {
        bench_rows4(c, ty, 2048);
    }
    let threads = set_threads();
    for &ty in QUANTISED {
        bench_vec_dot(c, ty, 576);
        bench_matmul(c, ty, SHAPES, threads);
    }
    for &ty in K_QUANTS {
        bench_vec_dot(c, ty, 1536);
        bench_matmul(c, ty, &SHAPES[3..], threads);
    }
    bench_matmul(c, GgmlType::Q8_0, &[HEAD], threads);
}

criterion_group! {
    name = dot;
    config = configure();
    targets = benches
}
criterion_main!(dot);

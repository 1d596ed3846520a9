//! `oato selftest [--device cpu|gpu] [--perf] [--compile-only]`: every operator and weight type on
//! a backend against a plain f64 reference on patterned data (ggml's test-backend-ops is the
//! model), with the normalised error and where the largest error is; `--perf` prints GB/s and
//! TFLOP/s per kernel; `--compile-only` compiles every CUDA kernel with NVRTC (no GPU needed).

use std::time::Instant;

use clap::Args;
use half::f16;

use oato::error::{Error, Result};
use oato::kernels::cpu::attention::AttnShape;
use oato::kernels::cuda as kc;
use oato::model::RopeParams;
use oato::profiler::{host_wall_median_us, median_us, wall_median_us};
use oato::quant::testdata::{Rng, pattern, random_k_row};
use oato::quant::{GgmlType, dequantize_row, quantize_row};
use oato::runtime::backend::DeviceKind;
use oato::runtime::backend::{
    AttnCall, Backend, Category, ColCopy, DType, HostBuf, Tensor, Weight,
};
use oato::runtime::cuda_backend::{
    MMVQ_MAX_TOKENS, MmvqMode, attn_split_force, flash_mma, flash_prefill, missing_kernels,
    mmvq_max_tokens, mmvq_mode, mmvq_multi, norm_threads, pipe_blocks, set_attn_split,
    set_flash_mma, set_flash_prefill, set_mmvq_max_tokens, set_mmvq_mode, set_mmvq_multi,
    set_norm_threads, set_pipe_blocks, set_weight_split, split_kernels, weight_split,
};
use oato::runtime::cuda_graphs::{graph_stats, graphs_on, set_graphs};
use oato::runtime::cuda_mmq::{
    MmqMode, has_mmq, mma_enabled, mmq_mode, mmq_splitk, set_mma, set_mmq_mode, set_mmq_splitk,
};

use super::DeviceArg;

#[derive(Args)]
pub struct SelftestArgs {
    /// Backend to test: cpu, gpu, or auto (the GPU when there is one).
    #[arg(long, value_enum, default_value = "auto")]
    pub device: DeviceArg,
    /// Also time the kernels on large shapes and print GB/s and TFLOP/s.
    #[arg(long)]
    pub perf: bool,
    /// Only compile every CUDA kernel source with NVRTC (works without a GPU); each CUBIN also
    /// goes into the kernel cache, where a start on a GPU of that architecture looks.
    #[arg(long = "compile-only")]
    pub compile_only: bool,
    /// Architectures for --compile-only, as compute capabilities (sm_XY → XY).
    #[arg(long, value_delimiter = ',', default_values_t = [75u32, 80, 86, 89, 90, 100, 120])]
    pub arch: Vec<u32>,
    /// Only these kernel sources for --compile-only (file names: ops.cu,mmvq.cu; default all).
    #[arg(long = "source", value_delimiter = ',', requires = "compile_only")]
    pub sources: Vec<String>,
    /// With --compile-only, also write each CUBIN to DIR/<source>-sm<arch>.cubin (for
    /// scripts/cuda-sass.sh: registers, spills and the machine code without a GPU).
    #[arg(long = "cubin-dir", requires = "compile_only")]
    pub cubin_dir: Option<std::path::PathBuf>,
    /// CPU threads (0: all cores).
    #[arg(short = 't', long, default_value_t = 0)]
    pub threads: usize,
}

const WEIGHT_TYPES: [GgmlType; 15] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::IQ4_NL,
    GgmlType::IQ4_XS,
];

pub fn run(a: SelftestArgs) -> Result<()> {
    if a.compile_only {
        return compile_only(&a.arch, &a.sources, a.cubin_dir.as_deref());
    }
    super::init_threads(a.threads)?;
    let (backends, dev) = super::open_backends(a.device)?;
    let be = &*backends[dev];
    println!("selftest on {}", be.describe());
    let cases = correctness(be)?;
    let failed = cases.iter().filter(|c| !c.ok()).count();
    println!(
        "{:<10} {:<6} {:<24} {:>10} {:>10} {:>8} {:>10}  ",
        "op", "type", "shape", "nmse", "max |err|", "at", "bound"
    );
    for c in &cases {
        println!(
            "{:<10} {:<6} {:<24} {:>10.2e} {:>10.2e} {:>8} {:>10.0e}  {}",
            c.op,
            c.ty,
            c.shape,
            c.nmse,
            c.max_err,
            c.at,
            c.bound,
            if c.ok() { "OK" } else { "FAIL" }
        );
    }
    println!("{}/{} cases passed", cases.len() - failed, cases.len());
    if a.perf {
        perf(be)?;
    }
    if failed > 0 {
        return Err(Error::Msg(format!("selftest: {failed} case(s) failed")));
    }
    Ok(())
}

/// Compiles every kernel source for each architecture through the engine's NVRTC path and
/// checks that each kernel the backend launches is in the CUBIN; `only`: these sources (by file
/// name) rather than all; `cubin_dir`: where to write each CUBIN as well.
fn compile_only(archs: &[u32], only: &[String], cubin_dir: Option<&std::path::Path>) -> Result<()> {
    if let Some(bad) = only
        .iter()
        .find(|n| !kc::SOURCES.iter().any(|s| s.name == n.as_str()))
    {
        let names: Vec<&str> = kc::SOURCES.iter().map(|s| s.name).collect();
        return Err(Error::Msg(format!(
            "--source {bad}: no such kernel source (the sources: {})",
            names.join(", ")
        )));
    }
    if let Some(d) = cubin_dir {
        std::fs::create_dir_all(d)
            .map_err(|e| Error::Msg(format!("--cubin-dir {}: {e}", d.display())))?;
    }
    let (major, minor) = kc::nvrtc_version()?;
    println!(
        "NVRTC {major}.{minor}; include dirs: {:?}",
        kc::include_dirs()
    );
    // Every (architecture, source) on its own thread of a few (NVRTC compiles programs
    // concurrently), the longest sources first so that no long one is left for the end: one at
    // a time, the seven architectures took about 4 minutes of CI's 2-core machine, mmvq.cu
    // alone 20-26 s each. Reported in order when all are done.
    let jobs: Vec<(u32, &kc::Source)> = archs
        .iter()
        .flat_map(|&a| kc::SOURCES.iter().map(move |s| (a, s)))
        .filter(|(_, s)| only.is_empty() || only.iter().any(|n| n == s.name))
        .collect();
    let workers = kc::compile_threads().min(jobs.len()).max(1);
    let wall = Instant::now();
    // Each job's CUBIN or error, and its milliseconds; a worker's panic reaches this thread.
    let done = kc::parallel_map(
        jobs.len(),
        workers,
        |i| jobs[i].1.code.len(),
        |i| {
            let (arch, src) = jobs[i];
            let t = Instant::now();
            (kc::compile(src, arch), t.elapsed().as_secs_f64() * 1e3)
        },
    );
    let mut failures = Vec::new();
    for ((arch, src), (r, ms)) in jobs.iter().copied().zip(done) {
        match r {
            Ok(bin) => {
                // Into the kernel cache too, as a start on a GPU of that architecture would put
                // it (the same options): the stand-in driver's runs (scripts/fake-gpu.sh, an
                // sm_90 device) then load it instead of compiling it again.
                kc::store_cached(src, arch, &bin)?;
                if let Some(d) = cubin_dir {
                    let stem = src.name.trim_end_matches(".cu");
                    let f = d.join(format!("{stem}-sm{arch}.cubin"));
                    std::fs::write(&f, &bin)
                        .map_err(|e| Error::Msg(format!("{}: {e}", f.display())))?;
                }
                let missing = missing_kernels(src.name, &bin);
                println!(
                    "sm_{arch:<4} {:<12} {:>8} bytes {:>7.0} ms {}",
                    src.name,
                    bin.len(),
                    ms,
                    if missing.is_empty() {
                        "OK".to_string()
                    } else {
                        format!("MISSING {missing:?}")
                    }
                );
                if !missing.is_empty() {
                    failures.push(format!(
                        "{} sm_{arch}: kernels missing: {missing:?}",
                        src.name
                    ));
                }
            }
            Err(e) => {
                println!("sm_{arch:<4} {:<12} FAILED", src.name);
                failures.push(e.to_string());
            }
        }
    }
    println!(
        "{} compilations on {workers} threads in {:.1} s",
        jobs.len(),
        wall.elapsed().as_secs_f64()
    );
    if failures.is_empty() {
        Ok(())
    } else {
        Err(Error::Msg(failures.join("\n")))
    }
}

/// One comparison: the backend's output against the f64 reference.
struct Case {
    op: &'static str,
    ty: String,
    shape: String,
    nmse: f64,
    max_err: f64,
    at: usize,
    bound: f64,
}

impl Case {
    fn ok(&self) -> bool {
        self.nmse.is_finite() && self.nmse <= self.bound
    }
}

fn compare(
    op: &'static str,
    ty: &str,
    shape: String,
    got: &[f32],
    want: &[f64],
    bound: f64,
) -> Case {
    let (mut num, mut den, mut max_err, mut at) = (0f64, 0f64, 0f64, 0usize);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let d = g as f64 - w;
        num += d * d;
        den += w * w;
        if d.abs() > max_err || d.is_nan() {
            max_err = d.abs();
            at = i;
        }
    }
    let nmse = if got.len() != want.len() {
        f64::NAN
    } else if den > 0.0 {
        num / den
    } else {
        num
    };
    Case {
        op,
        ty: ty.to_string(),
        shape,
        nmse,
        max_err,
        at,
        bound,
    }
}

/// A tensor on `be` holding `v`.
/// A perf weight uploaded in the split layout of split.cu (`split`) or the file's, whatever
/// `OATO_CUDA_SPLIT` says for the rest of the run.
fn upload_as(
    be: &dyn Backend,
    split: bool,
    ty: GgmlType,
    k: usize,
    n: usize,
    bytes: &[u8],
) -> Result<Weight> {
    let was = weight_split();
    set_weight_split(split);
    let w = be.upload_weight(if split { "perf split" } else { "perf" }, ty, k, n, bytes);
    set_weight_split(was);
    w
}

fn put(be: &dyn Backend, v: &[f32]) -> Result<Tensor> {
    let mut t = be.alloc(DType::F32, v.len(), Category::Workspace)?;
    be.write(&mut t, 0, v)?;
    Ok(t)
}

fn get(be: &dyn Backend, t: &Tensor, n: usize) -> Result<Vec<f32>> {
    let mut v = vec![0f32; n];
    be.read(t, 0, &mut v)?;
    Ok(v)
}

/// `n` rows of `k` patterned weights in `ty` (random blocks with sane scales for the K-quants
/// and i-quants, which oato does not quantise to).
fn weight_bytes(ty: GgmlType, k: usize, n: usize, seed: u64) -> Result<Vec<u8>> {
    let mut rng = Rng(seed | 1);
    let mut out = Vec::with_capacity(ty.row_bytes(k)? * n);
    for r in 0..n {
        let row = if matches!(
            ty,
            GgmlType::Q2_K
                | GgmlType::Q3_K
                | GgmlType::Q4_K
                | GgmlType::Q5_K
                | GgmlType::Q6_K
                | GgmlType::IQ4_NL
                | GgmlType::IQ4_XS
        ) {
            random_k_row(ty, k, &mut rng)
        } else {
            let mut b = vec![0u8; ty.row_bytes(k)?];
            quantize_row(ty, &pattern(k, r as f32 * 0.37 + seed as f32), &mut b)?;
            b
        };
        out.extend_from_slice(&row);
    }
    Ok(out)
}

/// The weights as f32, row by row (the reference's view).
fn dequantized(ty: GgmlType, k: usize, bytes: &[u8]) -> Result<Vec<f32>> {
    let rb = ty.row_bytes(k)?;
    let mut out = vec![0f32; bytes.len() / rb * k];
    for (row, b) in out.chunks_mut(k).zip(bytes.chunks(rb)) {
        dequantize_row(ty, b, row)?;
    }
    Ok(out)
}

/// RMSNorm of one row with weights `g`, in f64.
fn rms_norm_ref(row: &[f32], g: &[f32], eps: f64) -> Vec<f64> {
    let ms = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / row.len() as f64;
    let s = 1.0 / (ms + eps).sqrt();
    row.iter()
        .zip(g)
        .map(|(&v, &gg)| v as f64 * s * gg as f64)
        .collect()
}

fn correctness(be: &dyn Backend) -> Result<Vec<Case>> {
    let mut cases = Vec::new();
    // matmul: every weight type, matrix-vector (1..8 tokens) and GEMM (more) paths, an odd
    // row count; on a GPU also the direct and the pipelined matrix-vector kernels ("matmul-d",
    // "matmul-p"; then 1027 rows with k = 4608, two items a row block, one thread block per
    // multiprocessor, so that each walks two or more of the 257 row blocks) and the int8 prefill GEMM where the type has one
    // ("matmul-q": partial 64-token tiles; 67 rows take 32-row tiles, 4224 rows enough 64-row
    // tiles to fill an H100 or the stand-in device, k = 1536 tensor cores' split-K; on tensor
    // cores where the device has them, "matmul-qd" the same on __dp4a); "matmul" then forces
    // dequantisation + cuBLAS. "matmul-g": decode-sized batches through the prefill GEMM
    // (`OATO_CUDA_MMVQ_MAX_TOKENS=0`: the int8 GEMM where the type has one, k = 1536 split,
    // else dequantisation + cuBLAS).
    let (k, n) = (512, 67);
    let gpu = be.kind() == DeviceKind::Gpu;
    let chosen = mmvq_mode();
    let chosen_mmq = mmq_mode();
    let chosen_mma = mma_enabled();
    let chosen_blocks = pipe_blocks();
    let chosen_tokens = mmvq_max_tokens();
    use MmvqMode::{Direct, Pipe, Staged};
    let runs: &[(&str, MmvqMode, usize, usize, &[usize])] = if gpu {
        &[
            ("matmul", Staged, k, n, &[1, 3, 8, 9, 40]),
            ("matmul-d", Direct, k, n, &[1, 3, 8]),
            ("matmul-p", Pipe, k, n, &[1, 3, 8]),
            ("matmul-p", Pipe, 4608, 1027, &[1]),
            ("matmul-q", Staged, k, n, &[9, 40, 70]),
            ("matmul-q", Staged, k, 4224, &[70]),
            // Six 256-element steps of k: split-K on tensor cores (3 parts).
            ("matmul-q", Staged, 1536, n, &[70]),
            ("matmul-qd", Staged, k, n, &[9, 40, 70]),
            ("matmul-qd", Staged, k, 4224, &[70]),
            ("matmul-g", Staged, k, n, &[1, 3, 8]),
            ("matmul-g", Staged, 1536, n, &[1]),
        ]
    } else {
        &[("matmul", chosen, k, n, &[1, 3, 8, 9, 40])]
    };
    for (ty, &(op, mode, k, n, toks)) in WEIGHT_TYPES
        .into_iter()
        .flat_map(|ty| runs.iter().map(move |r| (ty, r)))
    {
        let mmq = op.starts_with("matmul-q");
        if mmq && !has_mmq(ty) || op == "matmul-qd" && !be.int8_tensor_cores() {
            continue;
        }
        set_mma(op != "matmul-qd");
        set_mmvq_mode(mode);
        // The large pipelined case at one block a multiprocessor, so that blocks walk rows.
        set_pipe_blocks(if mode == Pipe && n > 1000 {
            1
        } else {
            chosen_blocks
        });
        let gemm = op == "matmul-g";
        set_mmvq_max_tokens(if gemm { 0 } else { chosen_tokens });
        set_mmq_mode(if mmq || gemm {
            MmqMode::On
        } else {
            MmqMode::Off
        });
        let bytes = weight_bytes(ty, k, n, 3)?;
        let wf = dequantized(ty, k, &bytes)?;
        let w = be.upload_weight("selftest.weight", ty, k, n, &bytes)?;
        for &n_tok in toks {
            let x = pattern(n_tok * k, 0.5);
            let xt = put(be, &x)?;
            let mut yt = be.alloc(DType::F32, n_tok * n, Category::Workspace)?;
            be.matmul(&[&w], &xt, n_tok, &mut [&mut yt])?;
            let got = get(be, &yt, n_tok * n)?;
            let mut want = vec![0f64; n_tok * n];
            for t in 0..n_tok {
                for r in 0..n {
                    want[t * n + r] = (0..k)
                        .map(|i| wf[r * k + i] as f64 * x[t * k + i] as f64)
                        .sum();
                }
            }
            cases.push(compare(
                op,
                ty.name(),
                format!("{k}x{n}, {n_tok} tok"),
                &got,
                &want,
                5e-4,
            ));
        }
    }
    set_mmvq_mode(chosen);
    set_pipe_blocks(chosen_blocks);
    set_mmq_mode(chosen_mmq);
    set_mma(chosen_mma);
    set_mmvq_max_tokens(chosen_tokens);
    // The backend's start-up check: tensor cores and __dp4a gave the same bits (else prefill
    // quietly keeps __dp4a, and "matmul-q" above checked that).
    if let Some(agrees) = be.int8_mma_agrees() {
        cases.push(Case {
            op: "mma-check",
            ty: "q4_0".into(),
            shape: "32x256, 8 tok: mmq_mma = mmq bits".into(),
            nmse: if agrees { 0.0 } else { f64::INFINITY },
            max_err: 0.0,
            at: 0,
            bound: 0.0,
        });
    }
    // Shared input, several matrices in one call: two of other types, and three (q, k, v) or
    // two (gate, up) of one type, which a GPU runs as one launch (mmvq_multi; the last with rows
    // that do not fill a thread block); on a GPU with the staged and the pipelined kernels.
    use GgmlType as T;
    let modes: &[MmvqMode] = if gpu { &[Staged, Pipe] } else { &[chosen] };
    let sets = [
        &[(T::Q4_1, n), (T::Q8_0, 33)][..],
        &[(T::Q4_K, 64), (T::Q4_K, 16), (T::Q4_K, 67)],
        &[(T::Q4_K, 32), (T::Q4_K, 33)],
    ];
    for (&mode, set) in modes.iter().flat_map(|m| sets.map(|set| (m, set))) {
        set_mmvq_mode(mode);
        let mut ws = Vec::new();
        let mut fs = Vec::new();
        for (i, &(ty, r)) in set.iter().enumerate() {
            let b = weight_bytes(ty, k, r, 5 + 2 * i as u64)?;
            fs.push(dequantized(ty, k, &b)?);
            ws.push(be.upload_weight("m", ty, k, r, &b)?);
        }
        for n_tok in [1usize, 3] {
            let x = pattern(n_tok * k, 1.5);
            let xt = put(be, &x)?;
            let mut ys = set
                .iter()
                .map(|&(_, r)| be.alloc(DType::F32, n_tok * r, Category::Workspace))
                .collect::<Result<Vec<_>>>()?;
            let wr: Vec<&Weight> = ws.iter().collect();
            let mut yr: Vec<&mut Tensor> = ys.iter_mut().collect();
            be.matmul(&wr, &xt, n_tok, &mut yr)?;
            let (mut got, mut want) = (Vec::new(), Vec::new());
            for ((f, &(_, r)), y) in fs.iter().zip(set).zip(&ys) {
                got.extend(get(be, y, n_tok * r)?);
                for t in 0..n_tok {
                    for row in 0..r {
                        want.push(
                            (0..k)
                                .map(|i| f[row * k + i] as f64 * x[t * k + i] as f64)
                                .sum(),
                        );
                    }
                }
            }
            let join = |f: &dyn Fn(&(T, usize)) -> String, sep: &str| {
                set.iter().map(f).collect::<Vec<_>>().join(sep)
            };
            cases.push(compare(
                match (set.len(), mode) {
                    (3, Pipe) => "matmul3-p",
                    (3, _) => "matmul3",
                    (_, Pipe) => "matmul2-p",
                    _ => "matmul2",
                },
                &join(&|(ty, _)| ty.name().to_string(), "+"),
                format!("{k}x({}), {n_tok} tok", join(&|(_, r)| r.to_string(), "+")),
                &got,
                &want,
                5e-4,
            ));
        }
    }
    set_mmvq_mode(chosen);
    // The residual add, then the RMSNorm of its result (decode: one launch on a GPU,
    // add_rms_norm_q8_1): both the stream and the norm.
    for rows in [1usize, 3] {
        let w = 576;
        let x = pattern(rows * w, 0.3);
        let r = pattern(rows * w, 7.0);
        let g = pattern(w, 2.0);
        let (mut xt, rt, gt) = (put(be, &x)?, put(be, &r)?, put(be, &g)?);
        let mut yt = be.alloc(DType::F32, rows * w, Category::Workspace)?;
        be.add(&mut xt, &rt, rows * w)?;
        be.rms_norm(&xt, 0, rows, w, &gt, 1e-5, &mut yt)?;
        let mut got = get(be, &xt, rows * w)?;
        got.extend(get(be, &yt, rows * w)?);
        let sum: Vec<f32> = x.iter().zip(&r).map(|(a, b)| a + b).collect();
        let mut want: Vec<f64> = sum.iter().map(|&v| v as f64).collect();
        for row in sum.chunks(w) {
            want.extend(rms_norm_ref(row, &g, 1e-5));
        }
        cases.push(compare(
            "add+norm",
            "f32",
            format!("{w}x{rows}"),
            &got,
            &want,
            1e-6,
        ));
    }
    // rms_norm over rows 1..4 of 4: packed rows, and rows inside wider ones (latent
    // attention's compressed kv, normed in place in its projection's output).
    for stride in [576, 608] {
        let (w, rows) = (576, 4);
        let x = pattern(rows * stride, 0.2);
        let g = pattern(w, 2.0);
        let (xt, gt) = (put(be, &x)?, put(be, &g)?);
        let mut yt = be.alloc(DType::F32, 3 * w, Category::Workspace)?;
        be.rms_norm(&xt, 1, 3, stride, &gt, 1e-5, &mut yt)?;
        let got = get(be, &yt, 3 * w)?;
        let mut want = Vec::new();
        for r in 1..rows {
            want.extend(rms_norm_ref(&x[r * stride..r * stride + w], &g, 1e-5));
        }
        cases.push(compare(
            "rms_norm",
            "f32",
            format!("{w} at stride {stride}, rows 1..{rows}"),
            &got,
            &want,
            1e-6,
        ));
    }
    // add_bias, add, swiglu.
    {
        let (w, rows) = (320, 3);
        let x = pattern(rows * w, 0.1);
        let b = pattern(w, 4.0);
        let mut xt = put(be, &x)?;
        be.add_bias(&mut xt, &put(be, &b)?, rows)?;
        let want: Vec<f64> = (0..rows * w)
            .map(|i| x[i] as f64 + b[i % w] as f64)
            .collect();
        cases.push(compare(
            "add_bias",
            "f32",
            format!("{w}x{rows}"),
            &get(be, &xt, rows * w)?,
            &want,
            1e-10,
        ));
        let y = pattern(rows * w, 9.0);
        let mut xt = put(be, &x)?;
        be.add(&mut xt, &put(be, &y)?, rows * w)?;
        let want: Vec<f64> = x
            .iter()
            .zip(&y)
            .map(|(&a, &b)| a as f64 + b as f64)
            .collect();
        cases.push(compare(
            "add",
            "f32",
            format!("{}", rows * w),
            &get(be, &xt, rows * w)?,
            &want,
            1e-10,
        ));
        let mut gt = put(be, &x)?;
        be.swiglu(&mut gt, &put(be, &y)?, rows, w)?;
        let want: Vec<f64> = x
            .iter()
            .zip(&y)
            .map(|(&g, &u)| g as f64 / (1.0 + (-(g as f64)).exp()) * u as f64)
            .collect();
        cases.push(compare(
            "swiglu",
            "f32",
            format!("{}", rows * w),
            &get(be, &gt, rows * w)?,
            &want,
            1e-6,
        ));
        let mut st = put(be, &x)?;
        be.scale(&mut st, 0.17677669, rows * w)?;
        let want: Vec<f64> = x.iter().map(|&v| (v * 0.17677669) as f64).collect();
        cases.push(compare(
            "scale",
            "f32",
            format!("{}", rows * w),
            &get(be, &st, rows * w)?,
            &want,
            0.0,
        ));
    }
    // copy_cols: latent attention's key assembly (each head's columns, then one row repeated
    // for every head into the same rows' other columns).
    {
        let (n_tok, n_head, nope, rope, v, lora) = (3, 5, 16, 8, 12, 20);
        let hd = nope + rope;
        let kv = pattern(n_tok * n_head * (nope + v), 0.6);
        let kva = pattern(n_tok * (lora + rope), 1.1);
        let mut kt = be.alloc(DType::F32, n_tok * n_head * hd, Category::Workspace)?;
        let rows = n_tok * n_head;
        let c1 = ColCopy {
            rows,
            width: nope,
            src_stride: nope + v,
            src_col: 0,
            src_rep: 1,
            dst_stride: hd,
            dst_col: 0,
        };
        let c2 = ColCopy {
            width: rope,
            src_stride: lora + rope,
            src_col: lora,
            src_rep: n_head,
            dst_col: nope,
            ..c1
        };
        be.copy_cols(&put(be, &kv)?, &mut kt, c1)?;
        be.copy_cols(&put(be, &kva)?, &mut kt, c2)?;
        let mut want = Vec::with_capacity(rows * hd);
        for t in 0..n_tok {
            for h in 0..n_head {
                let at = (t * n_head + h) * (nope + v);
                want.extend(kv[at..at + nope].iter().map(|&x| x as f64));
                let at = t * (lora + rope) + lora;
                want.extend(kva[at..at + rope].iter().map(|&x| x as f64));
            }
        }
        cases.push(compare(
            "copy_cols",
            "f32",
            format!("{n_tok}x{n_head} heads of {nope}+{rope}"),
            &get(be, &kt, rows * hd)?,
            &want,
            0.0,
        ));
    }
    // RoPE: normal and NeoX, with and without frequency factors, partial rotation of a head's
    // leading dimensions and (latent attention) of its trailing ones.
    for (neox, partial, factors, off) in [
        (false, false, false, 0),
        (true, false, false, 0),
        (true, true, true, 0),
        (true, true, true, 32),
    ] {
        let (n_tok, n_heads, hd, pos0) = (3, 4, 64, 37);
        let n_dims = if partial { 32 } else { hd };
        let p = RopeParams {
            n_dims,
            freq_base: 10000.0,
            freq_scale: 0.5,
            neox,
            dim_offset: off,
        };
        let ff: Vec<f32> = (0..n_dims / 2).map(|i| 1.0 + i as f32 * 0.25).collect();
        let x = pattern(n_tok * n_heads * hd, 0.3);
        let mut xt = put(be, &x)?;
        let fft = put(be, &ff)?;
        be.rope(
            &mut xt,
            n_tok,
            n_heads,
            hd,
            pos0,
            &p,
            factors.then_some(&fft),
        )?;
        let got = get(be, &xt, x.len())?;
        let mut want: Vec<f64> = x.iter().map(|&v| v as f64).collect();
        for t in 0..n_tok {
            for h in 0..n_heads {
                let base = (t * n_heads + h) * hd + off;
                for (i, &f) in ff.iter().enumerate() {
                    let theta = (pos0 + t) as f64
                        * p.freq_scale as f64
                        * (p.freq_base as f64).powf(-2.0 * i as f64 / n_dims as f64)
                        / if factors { f as f64 } else { 1.0 };
                    let (a, b) = if neox {
                        (i, i + n_dims / 2)
                    } else {
                        (2 * i, 2 * i + 1)
                    };
                    let (x0, x1) = (x[base + a] as f64, x[base + b] as f64);
                    want[base + a] = x0 * theta.cos() - x1 * theta.sin();
                    want[base + b] = x0 * theta.sin() + x1 * theta.cos();
                }
            }
        }
        let label = format!(
            "{}{}{}{}",
            if neox { "neox" } else { "norm" },
            if partial { ",part" } else { "" },
            if factors { ",ff" } else { "" },
            if off > 0 { ",trailing" } else { "" }
        );
        cases.push(compare("rope", "f32", label, &got, &want, 1e-6));
    }
    // Attention: prefill after a few cached positions, and decode steps over a long cache (on a
    // GPU, 256 positions and more take the split kernel of flash_decode.cu, prefill batches of
    // more than 8 tokens the tiled kernel of flash_prefill.cu, on tensor cores from sm_80: 70
    // tokens are two of its query tiles).
    for (n_tok, pos0, hd) in [
        (4usize, 5usize, 64usize),
        (1, 300, 64),
        (5, 0, 128),
        (3, 400, 128),
        (24, 5, 64),
        (20, 0, 128),
        (70, 30, 96),
    ] {
        let shape = AttnShape {
            n_head: 6,
            n_head_kv: 2,
            head_dim: hd,
        };
        let (qd, kvd) = (6 * hd, 2 * hd);
        let n_ctx = pos0 + n_tok + 3;
        let mut ck = be.alloc(DType::F16, n_ctx * kvd, Category::KvCache)?;
        let mut cv = be.alloc(DType::F16, n_ctx * kvd, Category::KvCache)?;
        let mut att = be.alloc(DType::F32, n_tok.max(pos0) * qd, Category::Workspace)?;
        // Earlier positions go in through the same operator.
        let past_k = pattern(pos0.max(1) * kvd, 0.7)
            .iter()
            .map(|v| v * 0.5)
            .collect::<Vec<_>>();
        let past_v = pattern(pos0.max(1) * kvd, 2.9);
        if pos0 > 0 {
            let call = AttnCall {
                shape,
                n_tok: pos0,
                pos0: 0,
            };
            let q0 = put(be, &pattern(pos0 * qd, 0.0))?;
            be.attention(
                call,
                &q0,
                &put(be, &past_k)?,
                &put(be, &past_v)?,
                &mut ck,
                &mut cv,
                &mut att,
            )?;
        }
        let q = pattern(n_tok * qd, 1.1)
            .iter()
            .map(|v| v * 0.3)
            .collect::<Vec<_>>();
        let k_new = pattern(n_tok * kvd, 3.3);
        let v_new = pattern(n_tok * kvd, 5.7);
        let call = AttnCall { shape, n_tok, pos0 };
        let mut out = be.alloc(DType::F32, n_tok * qd, Category::Workspace)?;
        be.attention(
            call,
            &put(be, &q)?,
            &put(be, &k_new)?,
            &put(be, &v_new)?,
            &mut ck,
            &mut cv,
            &mut out,
        )?;
        let got = get(be, &out, n_tok * qd)?;
        // Reference: the cache as f16, everything else in f64.
        let h16 = |v: f32| f16::from_f32(v).to_f64();
        let key = |j: usize, i: usize| {
            if j < pos0 {
                h16(past_k[j * kvd + i])
            } else {
                h16(k_new[(j - pos0) * kvd + i])
            }
        };
        let val = |j: usize, i: usize| {
            if j < pos0 {
                h16(past_v[j * kvd + i])
            } else {
                h16(v_new[(j - pos0) * kvd + i])
            }
        };
        let mut want = vec![0f64; n_tok * qd];
        let scale = 1.0 / (hd as f64).sqrt();
        for t in 0..n_tok {
            for h in 0..6 {
                let kvh = h / 3;
                let qv = &q[t * qd + h * hd..t * qd + (h + 1) * hd];
                let n_kv = pos0 + t + 1;
                let s: Vec<f64> = (0..n_kv)
                    .map(|j| {
                        scale
                            * (0..hd)
                                .map(|i| qv[i] as f64 * key(j, kvh * hd + i))
                                .sum::<f64>()
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|v| (v - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for i in 0..hd {
                    want[t * qd + h * hd + i] =
                        (0..n_kv).map(|j| e[j] / z * val(j, kvh * hd + i)).sum();
                }
            }
        }
        cases.push(compare(
            "attention",
            "f16kv",
            format!("hd {hd}, {n_tok} tok at {pos0}"),
            &got,
            &want,
            1e-4,
        ));
    }
    // Embedding rows.
    for ty in [GgmlType::Q8_0, GgmlType::F16, GgmlType::Q4_K] {
        let (k, n) = (256, 50);
        let bytes = weight_bytes(ty, k, n, 11)?;
        let f = dequantized(ty, k, &bytes)?;
        let w = be.upload_weight("selftest.embd", ty, k, n, &bytes)?;
        let ids = [3u32, 0, 49, 3, 17];
        let mut out = be.alloc(DType::F32, ids.len() * k, Category::Workspace)?;
        be.embed_rows(&w, &ids, &mut out)?;
        let got = get(be, &out, ids.len() * k)?;
        let want: Vec<f64> = ids
            .iter()
            .flat_map(|&id| {
                f[id as usize * k..(id as usize + 1) * k]
                    .iter()
                    .map(|&v| v as f64)
            })
            .collect();
        cases.push(compare(
            "get_rows",
            ty.name(),
            format!("{k}x{n}, 5 ids"),
            &got,
            &want,
            1e-6,
        ));
    }
    be.synchronize()?;
    Ok(cases)
}

/// The sizes `selftest --perf` times. On a GPU LLaMA3-8B's, on a CPU the test model's; on a GPU
/// with `OATO_SELFTEST_PERF_SMALL=1` small ones, so that the stand-in driver runs every GPU
/// table's code in CI (scripts/fake-gpu-checks.sh: its times mean nothing, but a lease's perf
/// stage no longer runs code that never ran).
struct PerfSizes {
    /// Weight shapes (k, n) of the main table: attn_q, attn_k / attn_v, ffn_up, ffn_down.
    shapes: Vec<(usize, usize)>,
    /// The back-to-back table's shapes besides those: attn_k / attn_v and the output head.
    more_shapes: Vec<(usize, usize)>,
    /// The shared-input table's k and row sets (q / k / v, gate / up).
    shared: (usize, [Vec<usize>; 2]),
    /// The prefill batch, and the batches of the prefill GEMM table.
    batch: usize,
    gemm_tokens: Vec<usize>,
    reps: usize,
    /// At most this many copies of a weight cycled through against the cache.
    max_copies: usize,
    /// Decode attention's cached positions (and whether split attention is forced).
    ctxs: Vec<(usize, Option<bool>)>,
    /// Activation copies' f32 lengths, and the pinned copy's bytes.
    act_copies: Vec<usize>,
    pinned: usize,
}

impl PerfSizes {
    fn of(gpu: bool) -> PerfSizes {
        let small = gpu && std::env::var("OATO_SELFTEST_PERF_SMALL").is_ok_and(|v| v == "1");
        if small {
            return PerfSizes {
                shapes: vec![(256, 64), (512, 32)],
                more_shapes: vec![(256, 40)],
                shared: (256, [vec![64, 16, 16], vec![96, 96]]),
                batch: 16,
                gemm_tokens: vec![1, 8, 16],
                reps: 1,
                max_copies: 3,
                ctxs: vec![(8, Some(false)), (8, Some(true)), (24, None)],
                act_copies: vec![4096, 64 << 10],
                pinned: 1 << 20,
            };
        }
        PerfSizes {
            shapes: if gpu {
                vec![(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096)]
            } else {
                vec![(576, 576), (576, 1536)]
            },
            more_shapes: vec![(4096, 1024), (4096, 128256)],
            shared: (4096, [vec![4096, 1024, 1024], vec![14336, 14336]]),
            batch: if gpu { 512 } else { 64 },
            gemm_tokens: vec![1, 8, 64, 512],
            reps: if gpu { 20 } else { 5 },
            max_copies: 64,
            // On a GPU also 128 positions (llama-bench's tg128 stays under the split threshold)
            // by both kernels, and 1024 by the one-block-per-head kernel.
            ctxs: if gpu {
                vec![
                    (128, Some(false)),
                    (128, Some(true)),
                    (1024, Some(false)),
                    (1024, None),
                    (4096, None),
                ]
            } else {
                vec![(1024, None)]
            },
            act_copies: vec![4096, 256 << 10, 16 << 20],
            pinned: 64 << 20,
        }
    }
}

fn perf(be: &dyn Backend) -> Result<()> {
    let gpu = be.kind() == oato::runtime::backend::DeviceKind::Gpu;
    let sz = PerfSizes::of(gpu);
    let (shapes, batch, reps) = (&sz.shapes[..], sz.batch, sz.reps);
    println!();
    if be.cache_bytes() > 0 {
        println!(
            "one product a timing, the same weight each time (in the {:.0} MiB cache where it \
             fits; the back-to-back tables below read device memory):",
            be.cache_bytes() as f64 / (1 << 20) as f64
        );
    }
    // Decode: the staged matrix-vector kernels with 1 token, then on a GPU the pipelined ones
    // with 1 token and the direct ones with 1 and 8 tokens (GB/s of weight bytes; each time
    // includes the activations' quantisation).
    println!(
        "{:<6} {:<12} {:>10} {:>8} {:>10} {:>8} {:>10} {:>8} {:>10} {:>8} {:>12} {:>9}",
        "type",
        "k x n",
        "decode us",
        "GB/s",
        "pipe us",
        "GB/s",
        "direct us",
        "GB/s",
        "d x8 us",
        "GB/s",
        format!("pp{batch} us"),
        "TFLOP/s"
    );
    let chosen = mmvq_mode();
    let mut mmq_lines = Vec::new();
    for ty in WEIGHT_TYPES {
        for &(k, n) in shapes {
            if !k.is_multiple_of(ty.block_size()) {
                // The test model's 576 on a CPU is no whole number of 256-element blocks.
                println!(
                    "{:<6} {:<12} (rows of {k} are no whole number of {}-element blocks)",
                    ty.name(),
                    format!("{k}x{n}"),
                    ty.block_size()
                );
                continue;
            }
            let bytes = weight_bytes(ty, k, n, 1)?;
            // The file's layout: these columns are mmvq.cu's kernels.
            let w = upload_as(be, false, ty, k, n, &bytes)?;
            let gbs = |t: f64| bytes.len() as f64 / t / 1e3;
            let decode = |n_tok: usize, mode: MmvqMode| -> Result<String> {
                if mode != MmvqMode::Staged && !(gpu && ty.is_quantized()) {
                    return Ok(format!("{:>10} {:>8}", "-", "-"));
                }
                set_mmvq_mode(mode);
                let x = put(be, &pattern(n_tok * k, 0.0))?;
                let mut y = be.alloc(DType::F32, n_tok * n, Category::Workspace)?;
                let t = median_us(be, reps, || be.matmul(&[&w], &x, n_tok, &mut [&mut y]))?;
                Ok(format!("{t:>10.1} {:>8.1}", gbs(t)))
            };
            use MmvqMode::{Direct, Pipe, Staged};
            let (staged, pipe) = (decode(1, Staged)?, decode(1, Pipe)?);
            let (direct, direct8) = (decode(1, Direct)?, decode(8, Direct)?);
            set_mmvq_mode(chosen);
            let xb = put(be, &pattern(batch * k, 0.0))?;
            let mut yb = be.alloc(DType::F32, batch * n, Category::Workspace)?;
            let tb = median_us(be, reps, || be.matmul(&[&w], &xb, batch, &mut [&mut yb]))?;
            println!(
                "{:<6} {:<12} {staged} {pipe} {direct} {direct8} {:>12.1} {:>9.2}",
                ty.name(),
                format!("{k}x{n}"),
                tb,
                2.0 * (k * n * batch) as f64 / tb / 1e6
            );
            if gpu && has_mmq(ty) {
                mmq_lines.extend(prefill_gemm_lines(be, &w, k, n, &sz)?);
            }
        }
    }
    if !mmq_lines.is_empty() {
        // Quantised prefill GEMMs: the int8 kernels (__dp4a; tensor cores where the device has
        // them) against dequantisation + cuBLAS.
        println!();
        // mma us: tensor cores (k split where the grid is small), mma 1 part: never split.
        println!(
            "{:<6} {:<12} {:>6} {:>9} {:>10} {:>9} {:>10} {:>9} {:>10} {:>10} {:>9} {:>7}",
            "type",
            "k x n",
            "tokens",
            "mmvq us",
            "mmq us",
            "TFLOP/s",
            "mma us",
            "TFLOP/s",
            "mma 1 part",
            "cuBLAS us",
            "TFLOP/s",
            "fastest"
        );
        for l in &mmq_lines {
            println!("{l}");
        }
    }
    if gpu {
        pipe_blocks_perf(be, &sz)?;
        shared_input_perf(be, &sz)?;
    }
    // Non-weight operators at a decode-sized and a prefill-sized batch.
    let e = 4096usize;
    let x = put(be, &pattern(batch * e, 0.0))?;
    let g = put(be, &pattern(e, 1.0))?;
    let mut y = be.alloc(DType::F32, batch * e, Category::Workspace)?;
    let t = median_us(be, reps, || be.rms_norm(&x, 0, batch, e, &g, 1e-5, &mut y))?;
    println!(
        "rms_norm {e} x {batch}: {t:.1} us, {:.1} GB/s",
        (2 * batch * e * 4) as f64 / t / 1e3
    );
    if gpu {
        decode_norm_perf(be, reps)?;
    }
    // Decode attention (LLaMA3-8B's heads) over 1024 and 4096 cached positions (on a GPU the
    // split kernel; the K / V rows of the new token are stored by the same call).
    let shape = AttnShape {
        n_head: 32,
        n_head_kv: 8,
        head_dim: 128,
    };
    let (qd, kvd) = (32 * 128, 8 * 128);
    let split_chosen = attn_split_force();
    for &(ctx, force) in &sz.ctxs {
        set_attn_split(force.or(split_chosen));
        let mut ck = be.alloc(DType::F16, ctx * kvd, Category::KvCache)?;
        let mut cv = be.alloc(DType::F16, ctx * kvd, Category::KvCache)?;
        let q = put(be, &pattern(qd, 0.0))?;
        let kv = put(be, &pattern(kvd, 0.5))?;
        let mut out = be.alloc(DType::F32, qd, Category::Workspace)?;
        let call = AttnCall {
            shape,
            n_tok: 1,
            pos0: ctx - 1,
        };
        let t = median_us(be, reps, || {
            be.attention(call, &q, &kv, &kv, &mut ck, &mut cv, &mut out)
        })?;
        println!(
            "attention decode{}, 32/8 heads x 128 at position {}: {t:.1} us, {:.1} GB/s of KV cache",
            match force {
                Some(true) => " (split)",
                Some(false) => " (a block per head)",
                None => "",
            },
            ctx - 1,
            (2 * ctx * kvd * 2) as f64 / t / 1e3
        );
    }
    set_attn_split(split_chosen);
    // Prefill attention of `batch` tokens from position 0 (on a GPU the tiled kernel, then the
    // one-block-per-(head, token) kernel it replaced); causal: batch (batch + 1) / 2 scores per
    // head, each a dot product and a weighted sum over 128 dims.
    let mut ck = be.alloc(DType::F16, batch * kvd, Category::KvCache)?;
    let mut cv = be.alloc(DType::F16, batch * kvd, Category::KvCache)?;
    let q = put(be, &pattern(batch * qd, 0.0))?;
    let kv = put(be, &pattern(batch * kvd, 0.5))?;
    let mut out = be.alloc(DType::F32, batch * qd, Category::Workspace)?;
    let call = AttnCall {
        shape,
        n_tok: batch,
        pos0: 0,
    };
    let flops = 4.0 * 32.0 * 128.0 * (batch * (batch + 1) / 2) as f64;
    let (chosen, chosen_mma) = (flash_prefill(), flash_mma());
    // On a GPU: tiled on tensor cores (sm_80 and later), tiled on the f32 lanes, per token.
    let kinds: &[(bool, bool, &str)] = if gpu {
        &[
            (true, true, " (tiled, tensor cores)"),
            (true, false, " (tiled, f32)"),
            (false, false, " (per token)"),
        ]
    } else {
        &[(true, true, "")]
    };
    for &(tiled, mma, label) in kinds {
        set_flash_prefill(tiled);
        set_flash_mma(mma);
        let t = median_us(be, reps, || {
            be.attention(call, &q, &kv, &kv, &mut ck, &mut cv, &mut out)
        })?;
        println!(
            "attention prefill{label}, 32/8 heads x 128, {batch} tokens: {t:.1} us, {:.2} TFLOP/s",
            flops / t / 1e6
        );
    }
    set_flash_prefill(chosen);
    set_flash_mma(chosen_mma);
    if gpu {
        launch_overhead(be, reps)?;
    }
    link_perf(be, &sz)
}

/// The prefill GEMM of quantised weight `w` ([n, k]) at 64 and 512 tokens by the int8 kernel
/// (mmq.cu) and by dequantisation + cuBLAS, each with its activations' quantisation: what
/// `OATO_CUDA_MMQ=auto` chooses between. Also at decode's 1 and 8 tokens, beside the
/// matrix-vector kernels that take those batches by default (`mmvq us`): what
/// `OATO_CUDA_MMVQ_MAX_TOKENS` would trade. One table line per batch.
fn prefill_gemm_lines(
    be: &dyn Backend,
    w: &Weight,
    k: usize,
    n: usize,
    sz: &PerfSizes,
) -> Result<Vec<String>> {
    let reps = sz.reps;
    let chosen = mmq_mode();
    let chosen_mma = mma_enabled();
    let chosen_splitk = mmq_splitk();
    let chosen_tokens = mmvq_max_tokens();
    let mut lines = Vec::new();
    for &n_tok in &sz.gemm_tokens {
        let x = put(be, &pattern(n_tok * k, 0.0))?;
        let mut y = be.alloc(DType::F32, n_tok * n, Category::Workspace)?;
        let tv = if n_tok <= MMVQ_MAX_TOKENS {
            set_mmvq_max_tokens(MMVQ_MAX_TOKENS);
            Some(median_us(be, reps, || {
                be.matmul(&[w], &x, n_tok, &mut [&mut y])
            })?)
        } else {
            None
        };
        // The GEMMs take every batch.
        set_mmvq_max_tokens(0);
        let mut time = |mode: MmqMode, mma: bool, splitk: bool| -> Result<f64> {
            set_mmq_mode(mode);
            set_mma(mma);
            set_mmq_splitk(splitk);
            median_us(be, reps, || be.matmul(&[w], &x, n_tok, &mut [&mut y]))
        };
        let tq = time(MmqMode::On, false, chosen_splitk)?;
        let (tm, tm1) = if be.int8_tensor_cores() {
            (
                Some(time(MmqMode::On, true, true)?),
                Some(time(MmqMode::On, true, false)?),
            )
        } else {
            (None, None)
        };
        let tb = time(MmqMode::Off, chosen_mma, chosen_splitk)?;
        let tflops = |t: f64| 2.0 * (k * n * n_tok) as f64 / t / 1e6;
        let best = [
            ("mmvq", tv),
            ("mmq", Some(tq)),
            ("mma", tm),
            ("cuBLAS", Some(tb)),
        ]
        .into_iter()
        .filter_map(|(name, t)| Some((name, t?)))
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .map_or("", |(name, _)| name);
        let us = |t: Option<f64>| t.map_or("-".to_string(), |t| format!("{t:.1}"));
        lines.push(format!(
            "{:<6} {:<12} {n_tok:>6} {:>9} {tq:>10.1} {:>9.2} {:>10} {:>9} {:>10} {tb:>10.1} \
             {:>9.2} {best:>7}",
            w.ty.name(),
            format!("{k}x{n}"),
            us(tv),
            tflops(tq),
            us(tm),
            tm.map_or("-".to_string(), |t| format!("{:.2}", tflops(t))),
            us(tm1),
            tflops(tb),
        ));
    }
    set_mmq_mode(chosen);
    set_mma(chosen_mma);
    set_mmq_splitk(chosen_splitk);
    set_mmvq_max_tokens(chosen_tokens);
    Ok(lines)
}

/// How many copies of a weight of `bytes` bytes a timing cycles through so that every product
/// reads its weight from device memory, as a decode step does, and not from the cache the
/// previous product left it in: together they pass twice `be.cache_bytes()` (an H200's L2 is
/// 60 MB, and LLaMA3-8B's 4096 x 14336 Q4_0 is 33 MB: timed on one copy, it never left the
/// cache). At least 1, at most `sz.max_copies` (64).
fn cold_copies(be: &dyn Backend, bytes: usize, sz: &PerfSizes) -> usize {
    (2 * be.cache_bytes())
        .div_ceil(bytes.max(1))
        .clamp(1, sz.max_copies)
}

/// Products a back-to-back timing queues: at least 8, and every one of `copies` copies once.
const BACK_TO_BACK: usize = 8;

/// Median microseconds of one product in timings of `BACK_TO_BACK.max(copies)` products queued
/// back to back, product i by `product(i % copies)` (the copy it reads).
fn cycled_us(
    be: &dyn Backend,
    reps: usize,
    copies: usize,
    mut product: impl FnMut(usize) -> Result<()>,
) -> Result<f64> {
    let n = BACK_TO_BACK.max(copies);
    let t = median_us(be, reps, || {
        (0..n).try_for_each(|i| product(i % copies.max(1)))
    })?;
    Ok(t / n as f64)
}

/// The staged matrix-vector kernels, split.cu's (`OATO_CUDA_SPLIT`: Q4_0, Q8_0, Q4_K, Q6_K), then the
/// pipelined ones at 1 to 16 thread blocks per
/// multiprocessor (`OATO_CUDA_MMVQ_PIPE_BLOCKS`), 1 token, GB/s of weight bytes; on the shapes
/// above and a decode step's others: LLaMA3-8B's attn_k / attn_v (4096 x 1024) and its output
/// head (4096 x 128256); F16 (the float kernel) beside them as what the memory gives a plain
/// stream. Each time covers at least `BACK_TO_BACK` products queued one after the other (each
/// with its activations' quantisation), as a decode step queues them, so the host's launch gaps
/// (which a single timed call includes, as in the table above) stay out of the figure; and each
/// product reads the next of [`cold_copies`] copies of the weight, so the figure is the device
/// memory's, not the cache's (the table above times one weight again and again).
fn pipe_blocks_perf(be: &dyn Backend, sz: &PerfSizes) -> Result<()> {
    let reps = sz.reps;
    let counts = [1usize, 2, 4, 5, 8, 16];
    println!();
    println!(
        "decode, {BACK_TO_BACK} or more products back to back per timing, each on the next of \
         enough copies of the weight to pass twice the {:.0} MiB cache (\"copies\"), GB/s of \
         weight bytes:",
        be.cache_bytes() as f64 / (1 << 20) as f64
    );
    print!(
        "{:<6} {:<12} {:>6} {:>9} {:>9}",
        "type", "k x n", "copies", "staged", "split"
    );
    for b in counts {
        print!(" {:>9}", format!("pipe {b}"));
    }
    println!();
    let (mode, blocks) = (mmvq_mode(), pipe_blocks());
    let mut all = sz.shapes.clone();
    all.extend(&sz.more_shapes);
    for ty in [
        GgmlType::F16,
        GgmlType::Q4_0,
        GgmlType::Q8_0,
        GgmlType::Q4_K,
        GgmlType::Q6_K,
    ] {
        for &(k, n) in &all {
            let bytes = weight_bytes(ty, k, n, 1)?;
            let copies = cold_copies(be, bytes.len(), sz);
            let ws = (0..copies)
                .map(|_| upload_as(be, false, ty, k, n, &bytes))
                .collect::<Result<Vec<_>>>()?;
            let x = put(be, &pattern(k, 0.0))?;
            let mut y = be.alloc(DType::F32, n, Category::Workspace)?;
            print!("{:<6} {:<12} {copies:>6}", ty.name(), format!("{k}x{n}"));
            let mut time = |ws: &[Weight], m: MmvqMode, b: usize| -> Result<f64> {
                set_mmvq_mode(m);
                set_pipe_blocks(b);
                let t = cycled_us(be, reps, ws.len(), |c| {
                    be.matmul(&[&ws[c]], &x, 1, &mut [&mut y])
                })?;
                Ok(bytes.len() as f64 / t / 1e3)
            };
            print!(" {:>9.1}", time(&ws, MmvqMode::Staged, blocks)?);
            // The same weight held for split.cu's kernels, read by mmvq_split1_*.
            if split_kernels(ty) {
                let split = (0..copies)
                    .map(|_| upload_as(be, true, ty, k, n, &bytes))
                    .collect::<Result<Vec<_>>>()?;
                print!(" {:>9.1}", time(&split, MmvqMode::Staged, blocks)?);
            } else {
                print!(" {:>9}", "-");
            }
            for b in counts {
                if ty.is_quantized() {
                    print!(" {:>9.1}", time(&ws, MmvqMode::Pipe, b)?);
                } else {
                    print!(" {:>9}", "-");
                }
            }
            println!();
        }
    }
    set_mmvq_mode(mode);
    set_pipe_blocks(blocks);
    Ok(())
}

/// Decode matmuls of weights that read one input (LLaMA3-8B's q/k/v and gate/up), one token:
/// a launch per weight against one launch for all (`mmvq_multi`), the pipelined kernels' one
/// launch, and split.cu's one launch; GB/s of weight bytes, each time with the activations'
/// quantisation. As in [`pipe_blocks_perf`], a timing runs products back to back
/// ([`cycled_us`]), each on the next of [`cold_copies`] copies of the weights.
fn shared_input_perf(be: &dyn Backend, sz: &PerfSizes) -> Result<()> {
    let reps = sz.reps;
    println!();
    println!(
        "{:<6} {:<28} {:>6} {:>12} {:>8} {:>12} {:>8} {:>12} {:>8} {:>12} {:>8}",
        "type",
        "k x (n + ..)",
        "copies",
        "apart us",
        "GB/s",
        "one launch",
        "GB/s",
        "pipe, one",
        "GB/s",
        "split, one",
        "GB/s"
    );
    let chosen = mmvq_multi();
    let mode = mmvq_mode();
    for ty in [GgmlType::Q4_0, GgmlType::Q4_K] {
        for rows in &sz.shared.1 {
            let k = sz.shared.0;
            let bytes = rows
                .iter()
                .enumerate()
                .map(|(i, &r)| weight_bytes(ty, k, r, 21 + i as u64))
                .collect::<Result<Vec<_>>>()?;
            let total: usize = bytes.iter().map(Vec::len).sum();
            let copies = cold_copies(be, total, sz);
            // One copy of the weights, in the file's layout (false) or split (true).
            let set = |split: bool| -> Result<Vec<Weight>> {
                rows.iter()
                    .zip(&bytes)
                    .map(|(&r, b)| upload_as(be, split, ty, k, r, b))
                    .collect()
            };
            let ws = (0..copies)
                .map(|_| set(false))
                .collect::<Result<Vec<_>>>()?;
            let split = if split_kernels(ty) {
                (0..copies).map(|_| set(true)).collect::<Result<Vec<_>>>()?
            } else {
                Vec::new()
            };
            let x = put(be, &pattern(k, 0.0))?;
            let mut ys = rows
                .iter()
                .map(|&r| be.alloc(DType::F32, r, Category::Workspace))
                .collect::<Result<Vec<_>>>()?;
            // Microseconds a product of all the weights.
            let mut time = |sets: &[Vec<Weight>], multi: bool, m: MmvqMode| -> Result<f64> {
                set_mmvq_multi(multi);
                set_mmvq_mode(m);
                let refs: Vec<Vec<&Weight>> = sets.iter().map(|s| s.iter().collect()).collect();
                cycled_us(be, reps, refs.len(), |c| {
                    let mut yr: Vec<&mut Tensor> = ys.iter_mut().collect();
                    be.matmul(&refs[c], &x, 1, &mut yr)
                })
            };
            let (apart, one) = (
                time(&ws, false, MmvqMode::Staged)?,
                time(&ws, true, MmvqMode::Staged)?,
            );
            let pipe = time(&ws, true, MmvqMode::Pipe)?;
            let gbs = |t: f64| total as f64 / t / 1e3;
            let split = if split.is_empty() {
                format!("{:>12} {:>8}", "-", "-")
            } else {
                let t = time(&split, true, MmvqMode::Staged)?;
                format!("{t:>12.1} {:>8.1}", gbs(t))
            };
            let shape = rows
                .iter()
                .map(|r| r.to_string())
                .collect::<Vec<_>>()
                .join(" + ");
            println!(
                "{:<6} {:<28} {copies:>6} {apart:>12.1} {:>8.1} {one:>12.1} {:>8.1} {pipe:>12.1} \
                 {:>8.1} {split}",
                ty.name(),
                format!("{k} x ({shape})"),
                gbs(apart),
                gbs(one),
                gbs(pipe)
            );
        }
    }
    set_mmvq_multi(chosen);
    set_mmvq_mode(mode);
    Ok(())
}

/// Decode's RMSNorms of one 4096 row by the GPU's clock: alone (with the Q8_1 blocks the next
/// matrix-vector product reads, as decode runs it) and with the residual add before it (decode's
/// `add` then `rms_norm`, one fused kernel), at 256 threads a block (the block before four
/// values a thread) and at the default block.
fn decode_norm_perf(be: &dyn Backend, reps: usize) -> Result<()> {
    let e = 4096usize;
    let x = put(be, &pattern(e, 0.0))?;
    let r = put(be, &pattern(e, 0.5))?;
    let g = put(be, &pattern(e, 1.0))?;
    let mut z = put(be, &pattern(e, 0.25))?;
    let mut y = be.alloc(DType::F32, e, Category::Workspace)?;
    let chosen = norm_threads();
    for threads in [256, 0] {
        set_norm_threads(threads);
        let alone = median_us(be, reps, || be.rms_norm(&x, 0, 1, e, &g, 1e-5, &mut y))?;
        let fused = median_us(be, reps, || {
            be.add(&mut z, &r, e)?;
            be.rms_norm(&z, 0, 1, e, &g, 1e-5, &mut y)
        })?;
        println!(
            "rms_norm {e} x 1 (decode, Q8_1 blocks), {}: {alone:.1} us; with the residual add \
             before it: {fused:.1} us",
            if threads == 0 {
                "default block".to_string()
            } else {
                format!("{threads} threads")
            }
        );
    }
    set_norm_threads(chosen);
    Ok(())
}

/// Wall time of 128 decode-sized kernels (64 x RMSNorm of one 4096 row + add), launched one by
/// one and replayed as a CUDA graph (src/runtime/cuda_graphs.rs): what graphs save per launch.
fn launch_overhead(be: &dyn Backend, reps: usize) -> Result<()> {
    let e = 4096;
    let x = put(be, &pattern(e, 0.0))?;
    let g = put(be, &pattern(e, 1.0))?;
    let mut y = be.alloc(DType::F32, e, Category::Workspace)?;
    let mut z = be.alloc(DType::F32, e, Category::Workspace)?;
    let mut run = || -> Result<()> {
        for _ in 0..64 {
            be.rms_norm(&x, 0, 1, e, &g, 1e-5, &mut y)?;
            be.add(&mut z, &y, e)?;
        }
        Ok(())
    };
    let chosen = graphs_on();
    for on in [false, true] {
        set_graphs(on);
        let before = graph_stats();
        let (host, t) = host_wall_median_us(be, reps, &mut run)?;
        let after = graph_stats();
        println!(
            "128 decode-sized kernels (RMSNorm + add of {e}), {}: {t:.1} us, the host's calls \
             {host:.1} us of it{}",
            if on { "CUDA graph" } else { "one launch each" },
            if on {
                format!(
                    " ({} graphs built, {} graph launches)",
                    after.built - before.built,
                    after.launches - before.launches
                )
            } else {
                String::new()
            }
        );
    }
    set_graphs(chosen);
    Ok(())
}

/// Activation copies through the backend's own `write` / `read` at a decode, a prefill and a
/// bulk size (wall time, median of 9), from and into ordinary host memory (staged) and the
/// device's page-locked memory for the CPU's activation buffers (direct, rule 8), beside a plain
/// pinned copy's GB/s.
fn link_perf(be: &dyn Backend, sz: &PerfSizes) -> Result<()> {
    if be.kind() != oato::runtime::backend::DeviceKind::Gpu {
        return Ok(());
    }
    let pinned = be.pinned_copy_gbps(sz.pinned)?;
    if let Some((h, d)) = pinned {
        println!(
            "pinned copy {} MiB: host→device {h:.1} GB/s, device→host {d:.1} GB/s",
            sz.pinned >> 20
        );
    }
    let mem = be.host_memory();
    for &n in &sz.act_copies {
        let mut t = be.alloc(DType::F32, n, Category::Workspace)?;
        let gb = |us: f64| (n * 4) as f64 / us / 1e3;
        let mut time = |how: &str, host: &mut [f32]| -> Result<()> {
            host.copy_from_slice(&pattern(n, 0.0));
            let w = wall_median_us(be, 9, &mut || {
                be.write(&mut t, 0, host)?;
                be.host_reads_done()
            })?;
            let r = wall_median_us(be, 9, &mut || be.read(&t, 0, host))?;
            println!(
                "activation copy {} KiB, {how}: write {w:.1} us ({:.1} GB/s), read {r:.1} us \
                 ({:.1} GB/s)",
                n * 4 / 1024,
                gb(w),
                gb(r)
            );
            Ok(())
        };
        time("staged", &mut vec![0f32; n])?;
        match mem.as_ref().and_then(|m| HostBuf::new(m, n)) {
            Some(mut b) => time("direct", &mut b)?,
            None => println!(
                "activation copy {} KiB, direct: no page-locked memory",
                n * 4 / 1024
            ),
        }
    }
    Ok(())
}

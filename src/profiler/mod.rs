//! The operator parser and the profiler: the model's target operators (DESIGN.md's words) with
//! their shapes and bytes, the median time of each on every backend at each batch size, and the
//! host↔device link, written as `oato.profile/v1`.

pub mod profile;

use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::kernels::cpu::{cpu_name, isa};
use crate::model::{Model, WeightRef};
use crate::quant::testdata::pattern;
use crate::runtime::backend::{Backend, Category, DType, DeviceKind};
use crate::runtime::forward::target_weights;
use crate::runtime::kv_cache;
use crate::scheduler::mib;
use profile::{
    GpuInfo, HostInfo, LinkInfo, ModelInfo, OtherTensor, PROFILE_SCHEMA, Profile, ProfileEntry,
};

/// One target operator: a matmul whose left operand is a weight of the file.
#[derive(Clone, Debug, PartialEq)]
pub struct TargetOp {
    /// The tensor name without `.weight`, e.g. `blk.3.ffn_up`.
    pub op: String,
    pub weight: WeightRef,
    /// `None` for the output head.
    pub layer: Option<usize>,
    /// attn_q attn_k attn_v attn_output ffn_gate ffn_up ffn_down output
    pub kind: &'static str,
    /// f32 activations in and out, per token.
    pub in_bytes_per_token: u64,
    pub out_bytes_per_token: u64,
}

const LAYER_KINDS: [&str; 7] = [
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
];

/// The model's target operators in execution order, the output head last.
pub fn target_ops(model: &Model) -> Vec<TargetOp> {
    let ws = target_weights(model);
    let n_layer = model.layers.len();
    ws.into_iter()
        .enumerate()
        .map(|(i, w)| {
            let (layer, kind) = if i < n_layer * 7 {
                (Some(i / 7), LAYER_KINDS[i % 7])
            } else {
                (None, "output")
            };
            // DESIGN.md: the tensor name without `.weight` (`token_embd` for a tied head).
            let op = w
                .name
                .strip_suffix(".weight")
                .unwrap_or(&w.name)
                .to_string();
            TargetOp {
                op,
                layer,
                kind,
                in_bytes_per_token: 4 * w.k as u64,
                out_bytes_per_token: 4 * w.n as u64,
                weight: w.clone(),
            }
        })
        .collect()
}

/// The layer of a `blk.N.…` tensor name.
pub fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("blk.")?.split('.').next()?.parse().ok()
}

/// Every tensor of the file that is not a target weight, with the bytes it takes on a GPU (f32
/// for norms and biases; its file size for the embedding table).
pub fn other_tensors(model: &Model) -> Vec<OtherTensor> {
    let targets: std::collections::HashSet<&str> = target_weights(model)
        .into_iter()
        .map(|w| w.name.as_str())
        .collect();
    model
        .file
        .tensors
        .iter()
        .filter(|t| !targets.contains(t.name.as_str()))
        .map(|t| OtherTensor {
            name: t.name.clone(),
            layer: layer_of(&t.name),
            bytes: if t.name == "token_embd.weight" {
                t.n_bytes
            } else {
                4 * t.n_elements
            },
        })
        .collect()
}

/// FNV-1a (64-bit) of the GGUF header and tensor table, as 16 hex digits.
pub fn fingerprint(file: &GgufFile) -> String {
    format!("{:016x}", crate::cache::fnv1a(&[file.header_bytes()]))
}

/// The `model` section of a profile.
pub fn model_info(model: &Model, file_name: &str) -> ModelInfo {
    let hp = &model.hp;
    let others = other_tensors(model);
    ModelInfo {
        file: file_name.to_string(),
        bytes: model.file.bytes().len() as u64,
        arch: hp.arch.name().to_string(),
        n_layer: hp.n_layer,
        fingerprint: fingerprint(&model.file),
        kv_bytes_per_token: kv_cache::bytes_per_token(hp.n_layer, hp.kv_dim()) as u64,
        other_weight_bytes: others
            .iter()
            .filter(|t| t.name != "token_embd.weight")
            .map(|t| t.bytes)
            .sum(),
        other_tensors: others,
        n_embd: hp.n_embd,
        n_vocab: hp.n_vocab,
    }
}

/// How a profile is measured.
#[derive(Clone, Debug)]
pub struct ProfileOptions {
    pub batches: Vec<usize>,
    /// Timed repetitions per (operator, backend, batch), after warm-up; the median is kept.
    pub reps: usize,
    /// Show a progress bar on stderr (when it is a terminal).
    pub progress: bool,
}

impl Default for ProfileOptions {
    /// Decode (1) and the paper's prompt (64), 5 repetitions, a progress bar.
    fn default() -> Self {
        ProfileOptions {
            batches: vec![1, 64],
            reps: 5,
            progress: true,
        }
    }
}

/// Median of `reps` timed runs after two warm-ups, in microseconds (the backend's stopwatch).
pub fn median_us(be: &dyn Backend, reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..2 {
        f()?;
    }
    be.synchronize()?;
    let mut sw = be.stopwatch()?;
    let mut v = Vec::with_capacity(reps.max(1));
    for _ in 0..reps.max(1) {
        sw.start()?;
        f()?;
        v.push(sw.stop()?);
    }
    v.sort_by(f64::total_cmp);
    Ok(v[v.len() / 2])
}

/// Times `op` on `be` at every batch size; the weight is loaded for the measurement only (a GPU
/// uploads it and frees it after, so models larger than the GPU can be profiled).
fn time_op(
    be: &dyn Backend,
    file: &Arc<GgufFile>,
    op: &TargetOp,
    opts: &ProfileOptions,
) -> Result<BTreeMap<String, f64>> {
    let w = be.load_weight(file, &op.weight)?;
    let mut out = BTreeMap::new();
    for &b in &opts.batches {
        let (k, n) = (op.weight.k, op.weight.n);
        let mut x = be.alloc(DType::F32, b * k, Category::Workspace)?;
        be.write(&mut x, 0, &pattern(b * k, 0.25))?;
        let mut y = be.alloc(DType::F32, b * n, Category::Workspace)?;
        let t = median_us(be, opts.reps, || be.matmul(&[&w], &x, b, &mut [&mut y]))?;
        out.insert(b.to_string(), t);
    }
    Ok(out)
}

/// Host→device and device→host bandwidth (64 MiB copies, less on a nearly full device) and the
/// latency of a 4-byte copy, through the backend's pinned staging.
pub fn measure_link(gpu: &dyn Backend) -> Result<LinkInfo> {
    // 64 MiB, or a quarter of the free memory on a small or busy device.
    let free = gpu.memory()?.free;
    if free < 4 << 20 {
        return Err(Error::Msg(format!(
            "{}: only {} free, too little to measure the link",
            gpu.describe(),
            mib(free as u64)
        )));
    }
    let n = (16 << 20).min(free / 16); // f32 elements
    let host = pattern(n, 0.0);
    let mut back = vec![0f32; n];
    let mut t = gpu.alloc(DType::F32, n, Category::Workspace)?;
    let wall = |f: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
        let mut v = Vec::new();
        for _ in 0..5 {
            gpu.synchronize()?;
            let t0 = Instant::now();
            f()?;
            gpu.synchronize()?;
            v.push(t0.elapsed().as_secs_f64());
        }
        v.sort_by(f64::total_cmp);
        Ok(v[v.len() / 2])
    };
    let h2d = wall(&mut || gpu.write(&mut t, 0, &host))?;
    let d2h = wall(&mut || gpu.read(&t, 0, &mut back))?;
    let mut one = [0f32; 1];
    let lat_w = wall(&mut || gpu.write(&mut t, 0, &one))?;
    let lat_r = wall(&mut || gpu.read(&t, 0, &mut one))?;
    let bytes = (n * 4) as f64;
    Ok(LinkInfo {
        h2d_gbps: bytes / h2d / 1e9,
        d2h_gbps: bytes / d2h / 1e9,
        latency_us: (lat_w + lat_r) / 2.0 * 1e6,
    })
}

/// A one-line progress bar on stderr.
struct Progress {
    on: bool,
    total: usize,
    done: usize,
    start: Instant,
}

impl Progress {
    fn step(&mut self, what: &str) {
        self.done += 1;
        if !self.on {
            return;
        }
        let width = 30;
        let fill = self.done * width / self.total.max(1);
        eprint!(
            "\rprofiling [{}{}] {}/{} {:<24} {:>5.1}s",
            "#".repeat(fill),
            " ".repeat(width - fill),
            self.done,
            self.total,
            what,
            self.start.elapsed().as_secs_f64()
        );
        if self.done == self.total {
            eprintln!();
        }
    }
}

/// Profiles every target operator of `model` on the CPU backend `cpu` and, when given, the GPU
/// backend `gpu`, and measures the link.
pub fn profile_model(
    model: &Model,
    file_name: &str,
    cpu: &dyn Backend,
    gpu: Option<&dyn Backend>,
    threads: usize,
    opts: &ProfileOptions,
) -> Result<Profile> {
    if opts.batches.is_empty() || opts.batches.contains(&0) {
        return Err(Error::Usage(
            "--batches: give one or more batch sizes of at least 1".into(),
        ));
    }
    if cpu.kind() != DeviceKind::Cpu {
        return Err(Error::Msg(
            "profile: the first backend must be the CPU".into(),
        ));
    }
    let t0 = Instant::now();
    let ops = target_ops(model);
    let mut progress = Progress {
        on: opts.progress && std::io::stderr().is_terminal(),
        total: ops.len() * (1 + gpu.is_some() as usize),
        done: 0,
        start: t0,
    };
    let mut entries = Vec::with_capacity(ops.len());
    for op in &ops {
        let cpu_us = time_op(cpu, &model.file, op, opts)?;
        progress.step(&format!("{} cpu", op.op));
        let gpu_us = match gpu {
            Some(g) => {
                let t = time_op(g, &model.file, op, opts).map_err(|e| {
                    let free = g.memory().map_or(0, |m| m.free);
                    Error::Msg(format!(
                        "profiling {} ({} of {}) on {}, {} free: {e}",
                        op.op,
                        mib(op.weight.n_bytes as u64),
                        op.weight.ty.name(),
                        g.describe(),
                        mib(free as u64)
                    ))
                })?;
                progress.step(&format!("{} gpu", op.op));
                Some(t)
            }
            None => None,
        };
        entries.push(ProfileEntry {
            op: op.op.clone(),
            tensor: op.weight.name.clone(),
            layer: op.layer,
            kind: op.kind.to_string(),
            dtype: op.weight.ty.name().to_string(),
            k: op.weight.k,
            n: op.weight.n,
            weight_bytes: op.weight.n_bytes as u64,
            in_bytes_per_token: op.in_bytes_per_token,
            out_bytes_per_token: op.out_bytes_per_token,
            cpu_us,
            gpu_us,
        });
    }
    let (gpu_info, link) = match gpu {
        Some(g) => {
            let m = g.memory()?;
            (
                Some(GpuInfo {
                    name: g.device_name(),
                    total_bytes: m.total as u64,
                    free_bytes: m.free as u64,
                }),
                Some(measure_link(g)?),
            )
        }
        None => (None, None),
    };
    Ok(Profile {
        schema: PROFILE_SCHEMA.to_string(),
        model: model_info(model, file_name),
        host: HostInfo {
            cpu: cpu_name(),
            threads,
            isa: isa().name().to_string(),
        },
        gpu: gpu_info,
        link,
        batches: opts.batches.clone(),
        operators: entries,
        profiling_s: t0.elapsed().as_secs_f64(),
    })
}

/// Where the cached profile for this model, host and GPU lives: `<cache root>/profiles`, named
/// by the model fingerprint and a hash of the CPU, ISA, threads, GPU, batch sizes and repetitions.
pub fn cache_path(
    fingerprint: &str,
    threads: usize,
    gpu_name: Option<&str>,
    opts: &ProfileOptions,
) -> Option<PathBuf> {
    let key = format!(
        "{}|{}|{threads}|{}|{:?}|{}",
        cpu_name(),
        isa().name(),
        gpu_name.unwrap_or("-"),
        opts.batches,
        opts.reps
    );
    let h = crate::cache::fnv1a(&[fingerprint.as_bytes(), key.as_bytes()]);
    Some(
        crate::cache::root()?
            .join("profiles")
            .join(format!("{fingerprint}-{h:016x}.json")),
    )
}

/// The profile for `model` on these backends: the cached one when it exists (unless `force`),
/// else a new measurement, stored in the cache. The flag says whether it came from the cache.
#[allow(clippy::too_many_arguments)]
pub fn load_or_profile(
    model: &Model,
    file_name: &str,
    cpu: &dyn Backend,
    gpu: Option<&dyn Backend>,
    threads: usize,
    opts: &ProfileOptions,
    force: bool,
) -> Result<(Profile, bool)> {
    let gpu_name = gpu.map(|g| g.device_name());
    let cache = cache_path(
        &fingerprint(&model.file),
        threads,
        gpu_name.as_deref(),
        opts,
    );
    if !force
        && let Some(p) = &cache
        && let Ok(text) = std::fs::read_to_string(p)
        && let Ok(prof) = Profile::from_json(&text, &p.display().to_string())
    {
        return Ok((prof, true));
    }
    let prof = profile_model(model, file_name, cpu, gpu, threads, opts)?;
    if let Some(p) = &cache {
        // A cache that cannot be written only costs a re-profile next time.
        if let Some(d) = p.parent() {
            let _ = std::fs::create_dir_all(d);
        }
        if let Ok(text) = serde_json::to_string_pretty(&prof) {
            let _ = std::fs::write(p, text);
        }
    }
    Ok((prof, false))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::test_device::TestDevice;

    #[test]
    fn the_link_is_measured_within_a_small_devices_free_memory() {
        // 8 MiB free: the copies shrink to a quarter of it instead of failing at 64 MiB.
        let small = TestDevice::new(8 << 20);
        let link = measure_link(&small).unwrap();
        assert!(link.h2d_gbps > 0.0 && link.d2h_gbps > 0.0 && link.latency_us > 0.0);
        assert_eq!(
            small.usage().total(),
            0,
            "the measurement's buffer is freed"
        );
        // Under 4 MiB: a clear error naming the free memory.
        let tiny = TestDevice::new(3 << 20);
        let e = measure_link(&tiny).unwrap_err().to_string();
        assert!(e.contains("3.0 MiB free"), "{e}");
    }
}

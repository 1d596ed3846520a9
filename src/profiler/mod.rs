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
use crate::kernels::cpu::attention::AttnShape;
use crate::kernels::cpu::{cpu_name, isa};
use crate::model::{Model, WeightRef};
use crate::quant::testdata::pattern;
use crate::runtime::backend::{AttnCall, Backend, Category, DType, DeviceKind, Weight, transfer};
use crate::runtime::forward::{target_slots, target_weights};
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

/// A layer's target operator kinds by slot (`model::SLOT_KINDS`).
pub const LAYER_KINDS: [&str; crate::model::N_SLOTS] = crate::model::SLOT_KINDS;

/// The model's target operators in execution order, the output head last.
pub fn target_ops(model: &Model) -> Vec<TargetOp> {
    target_slots(model)
        .into_iter()
        .map(|(layer, slot, w)| {
            let kind = match layer {
                Some(_) => LAYER_KINDS[slot],
                None => "output",
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

/// Batch sizes above this are long prompts' (rule 5's streaming and TTFT at length P): there the
/// matmuls are compute-bound and the same for every layer, so they are timed on one operator per
/// (kind, type, shape), the middle layer's, and the time is given to the group. The output head
/// is not timed there: a prompt batch computes one row of logits.
pub const SAMPLED_ABOVE: usize = 64;

impl ProfileOptions {
    /// The default batches, plus a prompt longer than [`SAMPLED_ABOVE`] tokens rounded up to a
    /// power of two (the non-target operators, attention included, are timed at that length,
    /// decode at that position): what `oato run` plans a prompt of `prompt_tokens` with.
    pub fn for_prompt(prompt_tokens: usize) -> ProfileOptions {
        let mut o = ProfileOptions::default();
        if prompt_tokens > SAMPLED_ABOVE {
            o.batches.push(prompt_tokens.next_power_of_two());
        }
        o
    }

    /// These options with the batches timed on every operator only, and the sampled batches.
    fn split_sampled(&self) -> (ProfileOptions, Vec<usize>) {
        let (full, sampled): (Vec<usize>, Vec<usize>) =
            self.batches.iter().partition(|&&b| b <= SAMPLED_ABOVE);
        (
            ProfileOptions {
                batches: full,
                ..self.clone()
            },
            sampled,
        )
    }
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

/// Median wall time in microseconds of `reps` runs of `f` (at least one), `be` synchronised
/// before and after each: for work that is partly host-side (copies), which a device's
/// stopwatch would not see whole.
pub fn wall_median_us(
    be: &dyn Backend,
    reps: usize,
    f: &mut dyn FnMut() -> Result<()>,
) -> Result<f64> {
    Ok(host_wall_median_us(be, reps, f)?.1)
}

/// Over the same `reps` runs as [`wall_median_us`] takes: the median of the host's time inside
/// `f` (issuing the work, or recording it for a CUDA graph) and the median wall time until `be`
/// has done it. When the two are close, the host sets the pace, not the device.
pub fn host_wall_median_us(
    be: &dyn Backend,
    reps: usize,
    f: &mut dyn FnMut() -> Result<()>,
) -> Result<(f64, f64)> {
    let (mut host, mut wall) = (Vec::new(), Vec::new());
    for _ in 0..reps.max(1) {
        be.synchronize()?;
        let t0 = Instant::now();
        f()?;
        host.push(t0.elapsed().as_secs_f64() * 1e6);
        be.synchronize()?;
        wall.push(t0.elapsed().as_secs_f64() * 1e6);
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    Ok((median(host), median(wall)))
}

/// Times `op` on `be` at every batch size; the weight is loaded for the measurement only (a GPU
/// uploads it and frees it after, so models larger than the GPU can be profiled).
fn time_op(
    be: &dyn Backend,
    file: &Arc<GgufFile>,
    op: &TargetOp,
    opts: &ProfileOptions,
) -> Result<BTreeMap<String, f64>> {
    let w = be.load_matmul_weight(file, &op.weight)?;
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

/// The layer operators (not the head) grouped by kind, weight type and shape, as indices into
/// `ops` in their order: operators of one group cost the same (up to noise).
fn layer_groups(ops: &[TargetOp]) -> Vec<Vec<usize>> {
    let mut groups: BTreeMap<(&str, &str, usize, usize), Vec<usize>> = BTreeMap::new();
    for (i, op) in ops.iter().enumerate() {
        if op.layer.is_some() {
            let key = (op.kind, op.weight.ty.name(), op.weight.k, op.weight.n);
            groups.entry(key).or_default().push(i);
        }
    }
    groups.into_values().collect()
}

/// Times at the sampled `batches` (see [`SAMPLED_ABOVE`]) the middle layer's operator of each
/// (kind, type, shape) and adds its times to every operator of the group in `out` (by operator).
fn time_sampled(
    be: &dyn Backend,
    file: &Arc<GgufFile>,
    ops: &[TargetOp],
    batches: &[usize],
    reps: usize,
    out: &mut [BTreeMap<String, f64>],
) -> Result<()> {
    if batches.is_empty() {
        return Ok(());
    }
    let opts = ProfileOptions {
        batches: batches.to_vec(),
        reps,
        progress: false,
    };
    for members in layer_groups(ops) {
        let times = time_op(be, file, &ops[members[members.len() / 2]], &opts)?;
        for &i in &members {
            out[i].extend(times.iter().map(|(k, v)| (k.clone(), *v)));
        }
    }
    Ok(())
}

/// Times every operator on a backend whose weights are views of the memory map (the CPU) the way
/// a forward pass meets them: at each batch size, passes over all operators in execution order
/// (one untimed, then `reps` timed), each operator timed alone, so a weight is as cold in the
/// caches as in a real pass (timing one weight over and over would measure the cache, not the
/// memory). `ws`: the operators' weights on `be`, by operator. The median of each operator's
/// passes, by operator.
fn time_in_order(
    be: &dyn Backend,
    ops: &[TargetOp],
    ws: &[Weight],
    opts: &ProfileOptions,
) -> Result<Vec<BTreeMap<String, f64>>> {
    let mut out = vec![BTreeMap::new(); ops.len()];
    let mut sw = be.stopwatch()?;
    let widest_in = ops.iter().map(|o| o.weight.k).max().unwrap_or(0);
    let widest_out = ops.iter().map(|o| o.weight.n).max().unwrap_or(0);
    for &b in &opts.batches {
        let mut x = be.alloc(DType::F32, b * widest_in, Category::Workspace)?;
        be.write(&mut x, 0, &pattern(b * widest_in, 0.25))?;
        let mut y = be.alloc(DType::F32, b * widest_out, Category::Workspace)?;
        let mut times = vec![Vec::with_capacity(opts.reps); ops.len()];
        for pass in 0..=opts.reps.max(1) {
            for (i, w) in ws.iter().enumerate() {
                sw.start()?;
                be.matmul(&[w], &x, b, &mut [&mut y])?;
                let t = sw.stop()?;
                if pass > 0 {
                    times[i].push(t);
                }
            }
        }
        for (i, mut t) in times.into_iter().enumerate() {
            t.sort_by(f64::total_cmp);
            out[i].insert(b.to_string(), t[t.len() / 2]);
        }
    }
    Ok(out)
}

/// The fixed cost of one decode matmul job on `be` (the CPU), in microseconds: every layer's
/// gate and up, out of cache as decode meets them, as two jobs and as one (`Backend::matmul` of
/// both, as the executor runs weights that read one input); passes over all layers, `reps`
/// rounds of each way, the order of the two ways swapped each round; per round the saving per
/// layer over all layers (a mean: a job's occasional wait for a slow thread is part of what it
/// costs), then the median round (one disturbed round does not decide), at least 0. `None` when
/// no layer has both.
/// `ws`: the operators' weights on `be`, by operator (as [`time_in_order`] takes them).
fn cpu_job_us(
    be: &dyn Backend,
    ops: &[TargetOp],
    ws: &[Weight],
    reps: usize,
) -> Result<Option<f64>> {
    let pairs: Vec<(&Weight, &Weight)> = ops
        .iter()
        .zip(ws)
        .filter(|(o, _)| o.kind == "ffn_gate")
        .filter_map(|(g, gw)| {
            let u = ops
                .iter()
                .position(|o| o.layer == g.layer && o.kind == "ffn_up")?;
            (ws[u].k == gw.k).then_some((gw, &ws[u]))
        })
        .collect();
    let Some(&(g0, _)) = pairs.first() else {
        return Ok(None);
    };
    let k = g0.k;
    let ng = pairs.iter().map(|p| p.0.n).max().unwrap_or(0);
    let nu = pairs.iter().map(|p| p.1.n).max().unwrap_or(0);
    let mut x = be.alloc(DType::F32, k, Category::Workspace)?;
    be.write(&mut x, 0, &pattern(k, 0.25))?;
    let mut yg = be.alloc(DType::F32, ng, Category::Workspace)?;
    let mut yu = be.alloc(DType::F32, nu, Category::Workspace)?;
    let mut sw = be.stopwatch()?;
    // Each round's saving per layer (both ways summed over every layer).
    let mut savings = Vec::with_capacity(reps.max(1));
    for round in 0..=reps.max(1) {
        let (mut apart, mut joined) = (0.0, 0.0);
        for way in [round % 2 == 0, round % 2 == 1] {
            let mut t = 0.0;
            for &(g, u) in &pairs {
                if way {
                    sw.start()?;
                    be.matmul(&[g, u], &x, 1, &mut [&mut yg, &mut yu])?;
                    t += sw.stop()?;
                } else {
                    sw.start()?;
                    be.matmul(&[g], &x, 1, &mut [&mut yg])?;
                    t += sw.stop()?;
                    sw.start()?;
                    be.matmul(&[u], &x, 1, &mut [&mut yu])?;
                    t += sw.stop()?;
                }
            }
            if way {
                joined += t;
            } else {
                apart += t;
            }
        }
        // The first round warms the pool and the caches' state; it is not counted.
        if round > 0 {
            savings.push((apart - joined) / pairs.len() as f64);
        }
    }
    savings.sort_by(f64::total_cmp);
    Ok(Some(savings[savings.len() / 2].max(0.0)))
}

/// Median times of one layer's non-target operators on `be`, by name and batch size: at 1
/// (decode, attention at position `p`, after a prompt of `p`) and at `p` (prefill from 0).
fn time_non_target(
    be: &dyn Backend,
    model: &Model,
    p: usize,
    reps: usize,
) -> Result<BTreeMap<String, BTreeMap<String, f64>>> {
    let hp = &model.hp;
    let (e, qd, kvd, ff) = (hp.n_embd, hp.q_dim(), hp.kv_dim(), hp.n_ff);
    let ctx = p + 2;
    let f32s = |n: usize, off: f32| -> Result<crate::runtime::backend::Tensor> {
        let mut t = be.alloc(DType::F32, n, Category::Workspace)?;
        be.write(&mut t, 0, &pattern(n, off))?;
        Ok(t)
    };
    let norm_w = f32s(e, 0.5)?;
    let bias = f32s(qd, 0.1)?;
    let mut out: BTreeMap<String, BTreeMap<String, f64>> = BTreeMap::new();
    let mut cache_k = be.alloc(DType::F16, ctx * kvd, Category::Workspace)?;
    let mut cache_v = be.alloc(DType::F16, ctx * kvd, Category::Workspace)?;
    for (b, pos0) in [(1usize, p), (p, 0)] {
        let x = f32s(b * e, 0.25)?;
        let mut h = f32s(b * e, 0.0)?;
        let mut q = f32s(b * qd, 0.3)?;
        let mut k = f32s(b * kvd, 0.2)?;
        let v = f32s(b * kvd, 0.1)?;
        let mut att = f32s(b * qd, 0.0)?;
        let mut g = f32s(b * ff, 0.4)?;
        let u = f32s(b * ff, 0.6)?;
        let mut xx = f32s(b * e, 0.7)?;
        let key = b.to_string();
        let mut put = |name: &str, t: f64| {
            out.entry(name.to_string())
                .or_default()
                .insert(key.clone(), t);
        };
        let (nh, nkv, hd) = (hp.n_head, hp.n_head_kv, hp.head_dim);
        put(
            "rms_norm",
            median_us(be, reps, || {
                be.rms_norm(&x, 0, b, e, &norm_w, hp.rms_eps, &mut h)
            })?,
        );
        put(
            "bias",
            median_us(be, reps, || be.add_bias(&mut q, &bias, b))?,
        );
        put(
            "rope_q",
            median_us(be, reps, || {
                be.rope(&mut q, b, nh, hd, pos0, &hp.rope, None)
            })?,
        );
        put(
            "rope_k",
            median_us(be, reps, || {
                be.rope(&mut k, b, nkv, hd, pos0, &hp.rope, None)
            })?,
        );
        let call = AttnCall {
            shape: AttnShape {
                n_head: nh,
                n_head_kv: nkv,
                head_dim: hd,
            },
            n_tok: b,
            pos0,
        };
        put(
            "attention",
            median_us(be, reps, || {
                be.attention(call, &q, &k, &v, &mut cache_k, &mut cache_v, &mut att)
            })?,
        );
        put("add", median_us(be, reps, || be.add(&mut xx, &h, b * e))?);
        put(
            "swiglu",
            median_us(be, reps, || be.swiglu(&mut g, &u, b, ff))?,
        );
    }
    Ok(out)
}

/// The link as the executor uses it (DESIGN.md rule 8 and 4): `h2d_gbps`, uploads of the
/// model's largest weights through `load_weight` (the registered memory map, or staging), when a
/// model is given, else of an activation buffer; `act_h2d_gbps` and `d2h_gbps`, activation copies
/// from and into a CPU activation buffer through the executor's transfer path (64 MiB, less on
/// a small device); `latency_us`, a 4-byte copy; `pinned_*`, a plain pinned copy (the
/// hardware's figure); `crossing_us`, one decode-sized activation crossing through the
/// executor's own transfer path (half of a GPU→CPU→GPU round trip).
pub fn measure_link(
    gpu: &dyn Backend,
    cpu: &dyn Backend,
    model: Option<&Model>,
) -> Result<LinkInfo> {
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
    let mut t = gpu.alloc(DType::F32, n, Category::Workspace)?;
    // An activation buffer of the CPU's, as the executor has them (in the device's page-locked
    // memory where it gives some), and the executor's transfer path both ways.
    let mut c = cpu.alloc(DType::F32, n, Category::Workspace)?;
    if let Some(h) = cpu.host_f32_mut(&mut c) {
        h.copy_from_slice(&pattern(n, 0.0));
    }
    let mut staging = Vec::new();
    let wall = |f: &mut dyn FnMut() -> Result<()>| Ok(wall_median_us(gpu, 5, f)? / 1e6);
    let bytes = (n * 4) as f64;
    let act_h2d = wall(&mut || {
        transfer(cpu, &c, gpu, &mut t, n, &mut staging)?;
        gpu.host_reads_done()
    })?;
    let d2h = wall(&mut || transfer(gpu, &t, cpu, &mut c, n, &mut staging))?;
    drop(c);
    let h2d_gbps = match model {
        Some(m) => weight_upload_gbps(gpu, m, free / 4)?,
        None => None,
    };
    let h2d_gbps = h2d_gbps.unwrap_or(bytes / act_h2d / 1e9);
    let mut one = [0f32; 1];
    let lat_w = wall(&mut || gpu.write(&mut t, 0, &one))?;
    let lat_r = wall(&mut || gpu.read(&t, 0, &mut one))?;
    let crossing_us = crossing_us(gpu, cpu, model.map_or(4096, |m| m.hp.n_embd))?;
    let pinned = gpu.pinned_copy_gbps(n * 4)?;
    Ok(LinkInfo {
        h2d_gbps,
        d2h_gbps: bytes / d2h / 1e9,
        latency_us: (lat_w + lat_r) / 2.0 * 1e6,
        pinned_h2d_gbps: pinned.map(|p| p.0),
        pinned_d2h_gbps: pinned.map(|p| p.1),
        crossing_us: Some(crossing_us),
        act_h2d_gbps: Some(bytes / act_h2d / 1e9),
    })
}

/// Prefill streaming's copy time (rule 5) of every layer operator: for each kind, shape and
/// type, the largest weight copied as the executor streams it (`prefetch_weight`, the best of
/// three after one untimed copy), scaled to each member's bytes.
fn stream_times(
    gpu: &dyn Backend,
    file: &Arc<GgufFile>,
    ops: &[TargetOp],
    entries: &mut [ProfileEntry],
) -> Result<()> {
    for members in layer_groups(ops) {
        let Some(&big) = members.iter().max_by_key(|&&i| ops[i].weight.n_bytes) else {
            continue;
        };
        let w = &ops[big].weight;
        gpu.synchronize()?;
        gpu.release_weight(gpu.prefetch_weight(file, w)?)?;
        let mut best = f64::MAX;
        for _ in 0..3 {
            gpu.synchronize()?;
            let t0 = Instant::now();
            let copy = gpu.prefetch_weight(file, w)?;
            gpu.synchronize()?;
            best = best.min(t0.elapsed().as_secs_f64() * 1e6);
            gpu.release_weight(copy)?;
        }
        gpu.synchronize()?;
        for &i in &members {
            let scale = ops[i].weight.n_bytes as f64 / w.n_bytes.max(1) as f64;
            entries[i].stream_us = Some(best * scale);
        }
    }
    Ok(())
}

/// GB/s of weight uploads as the executor makes them: the largest target weights, up to
/// `limit` bytes together (at least one), loaded with `load_weight` and freed; the first load
/// (which may register the memory map with the driver) is not timed. `None` if no weight fits.
fn weight_upload_gbps(gpu: &dyn Backend, model: &Model, limit: usize) -> Result<Option<f64>> {
    let mut ws = target_weights(model);
    ws.sort_by_key(|w| std::cmp::Reverse(w.n_bytes));
    let Some(first) = ws.last() else {
        return Ok(None);
    };
    drop(gpu.load_weight(&model.file, first)?);
    gpu.synchronize()?;
    let mut chosen = Vec::new();
    let mut total = 0usize;
    for w in &ws {
        if total + w.n_bytes > limit && !chosen.is_empty() {
            break;
        }
        if w.n_bytes > limit {
            continue;
        }
        total += w.n_bytes;
        chosen.push(*w);
        if total >= 512 << 20 {
            break;
        }
    }
    if chosen.is_empty() {
        return Ok(None);
    }
    let mut best = f64::MAX;
    for _ in 0..3 {
        gpu.synchronize()?;
        let t0 = Instant::now();
        let mut held = Vec::with_capacity(chosen.len());
        for w in &chosen {
            held.push(gpu.load_weight(&model.file, w)?);
        }
        gpu.synchronize()?;
        best = best.min(t0.elapsed().as_secs_f64());
        drop(held);
    }
    Ok(Some(total as f64 / best / 1e9))
}

/// One decode-sized crossing through the executor's transfer path: the mean of 100 round trips
/// of `width` f32 (GPU→CPU, then CPU→GPU, each waiting for the one before), halved.
pub fn crossing_us(gpu: &dyn Backend, cpu: &dyn Backend, width: usize) -> Result<f64> {
    let mut g = gpu.alloc(DType::F32, width, Category::Workspace)?;
    let mut c = cpu.alloc(DType::F32, width, Category::Workspace)?;
    gpu.write(&mut g, 0, &pattern(width, 0.5))?;
    let mut staging = Vec::new();
    let mut round = |n: usize| -> Result<f64> {
        gpu.synchronize()?;
        let t0 = Instant::now();
        for _ in 0..n {
            transfer(gpu, &g, cpu, &mut c, width, &mut staging)?;
            transfer(cpu, &c, gpu, &mut g, width, &mut staging)?;
        }
        gpu.synchronize()?;
        Ok(t0.elapsed().as_secs_f64() * 1e6)
    };
    round(10)?;
    let n = 100;
    Ok(round(n)? / (2 * n) as f64)
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
    let (full, sampled) = opts.split_sampled();
    // The CPU's weights (views of the map, or interleaved copies), loaded once for the in-order
    // times and the job's fixed cost.
    let cpu_ws = ops
        .iter()
        .map(|op| cpu.load_matmul_weight(&model.file, &op.weight))
        .collect::<Result<Vec<_>>>()?;
    let mut cpu_times = time_in_order(cpu, &ops, &cpu_ws, &full)?;
    let job_us = cpu_job_us(cpu, &ops, &cpu_ws, opts.reps)?;
    drop(cpu_ws);
    time_sampled(cpu, &model.file, &ops, &sampled, opts.reps, &mut cpu_times)?;
    for op in &ops {
        progress.step(&format!("{} cpu", op.op));
    }
    let mut gpu_times = match gpu {
        Some(g) => {
            let mut times = Vec::with_capacity(ops.len());
            for op in &ops {
                times.push(time_op(g, &model.file, op, &full).map_err(|e| {
                    let free = g.memory().map_or(0, |m| m.free);
                    Error::Msg(format!(
                        "profiling {} ({} of {}) on {}, {} free: {e}",
                        op.op,
                        mib(op.weight.n_bytes as u64),
                        op.weight.ty.name(),
                        g.describe(),
                        mib(free as u64)
                    ))
                })?);
                progress.step(&format!("{} gpu", op.op));
            }
            time_sampled(g, &model.file, &ops, &sampled, opts.reps, &mut times)?;
            Some(times.into_iter())
        }
        None => None,
    };
    let mut entries: Vec<ProfileEntry> = ops
        .iter()
        .zip(cpu_times)
        .map(|(op, cpu_us)| ProfileEntry {
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
            gpu_us: gpu_times.as_mut().and_then(|t| t.next()),
            stream_us: None,
        })
        .collect();
    if let Some(g) = gpu {
        stream_times(g, &model.file, &ops, &mut entries)?;
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
                Some(measure_link(g, cpu, Some(model))?),
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
            job_us,
        },
        gpu: gpu_info,
        link,
        batches: opts.batches.clone(),
        operators: entries,
        non_target_us: {
            let mut m = BTreeMap::new();
            let p = opts.batches.iter().copied().max().unwrap_or(1);
            m.insert(
                "cpu".to_string(),
                time_non_target(cpu, model, p, opts.reps)?,
            );
            if let Some(g) = gpu {
                m.insert("gpu".to_string(), time_non_target(g, model, p, opts.reps)?);
            }
            m
        },
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
    // The GPU's weight layout (OATO_CUDA_SPLIT) changes its decode kernels, so its profile;
    // the stopwatch's lead-in (OATO_CUDA_TIMER_LEAD_US) what its times include; the tensor-core
    // int8 GEMM (OATO_CUDA_MMA) its prefill kernels.
    let layout = match gpu_name {
        Some(_) => format!(
            "{}|lead{}{}",
            if crate::runtime::cuda_backend::weight_split() {
                "|split"
            } else {
                ""
            },
            crate::runtime::cuda_backend::timer_lead_us(),
            if crate::runtime::cuda_mmq::mma_enabled() {
                "|mma"
            } else {
                ""
            }
        ),
        None => String::new(),
    };
    let key = format!(
        "{}|{}|{threads}|{}|{:?}|{}{layout}",
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
        let cpu = crate::runtime::cpu_backend::CpuBackend::new();
        let link = measure_link(&small, &cpu, None).unwrap();
        assert!(link.h2d_gbps > 0.0 && link.d2h_gbps > 0.0 && link.latency_us > 0.0);
        assert!(link.crossing_us.is_some_and(|c| c > 0.0));
        assert!(link.pinned_h2d_gbps.is_some_and(|g| g > 0.0));
        assert_eq!(
            small.usage().total(),
            0,
            "the measurement's buffer is freed"
        );
        // Under 4 MiB: a clear error naming the free memory.
        let tiny = TestDevice::new(3 << 20);
        let e = measure_link(&tiny, &cpu, None).unwrap_err().to_string();
        assert!(e.contains("3.0 MiB free"), "{e}");
    }
}

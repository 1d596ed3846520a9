//! The policies OATO is compared with, written in the same placement format: everything on the
//! CPU, everything on the GPU, llama.cpp's split by whole layers (`-ngl`), and FlexGen's
//! resident-then-streamed weights (placement rule 5). Their `order` is OATO's round-one order.

use std::collections::BTreeMap;

use crate::error::{Error, Result};
use crate::profiler::profile::Profile;

use super::cost::{
    CAP_FRACTION, CostModel, Reservations, WeightCap, check_percent, mib, weight_cap,
    workspace_bytes,
};
use super::oato::predict_with_crossings;
use super::oato::{Fill, Fit, Ranking};
use super::placement::{BudgetReport, Device, Placement};
use super::{Budget, PlanParts, PlanRequest, Policy, gpu_info, is_head_norm};

/// `cpu`: every weight on the CPU; nothing is reserved on a GPU.
pub(crate) fn plan_cpu(
    profile: &Profile,
    req: &PlanRequest,
    model: &CostModel,
) -> Result<Placement> {
    let n = model.ops.len();
    let devices = vec![Device::Cpu; n];
    let nothing = WeightCap {
        vram_budget_bytes: match req.budget {
            Budget::Bytes(b) => b,
            Budget::Percent(_) => 0,
        },
        cap_bytes: 0,
        notes: Vec::new(),
    };
    let budget = BudgetReport::new(req.budget, &nothing, &Reservations::default(), CAP_FRACTION);
    let mut notes = Vec::new();
    if !model.has_gpu() {
        notes.push("the profile has no GPU timings: every benefit is 0".to_string());
    }
    let (predicted, crossings) = predict_with_crossings(model, &devices);
    Ok(PlanParts {
        prefill_stream: Vec::new(),
        stream_min_tokens: usize::MAX,
        policy: Policy::Cpu,
        ranking: Ranking::new(model, None),
        predicted,
        crossings,
        devices,
        rules: vec!["policy cpu".to_string(); n],
        budget,
        rounds: 1,
        notes,
    }
    .into_placement(profile, req, model))
}

/// `gpu`: every weight on the GPU, refused with the numbers when they and the reservations do
/// not fit the budget or the GPU's free memory. The cap is the whole room left (fraction 1.0).
pub(crate) fn plan_gpu(
    profile: &Profile,
    req: &PlanRequest,
    model: &CostModel,
) -> Result<Placement> {
    let gpu = gpu_info(profile, req.policy)?;
    let reservations = Reservations::for_request(profile, req);
    let weights = model.total_target_bytes();
    let needed = weights.saturating_add(reservations.total());
    let items: Vec<String> = reservations
        .parts(req.ctx_tokens)
        .iter()
        .map(|(name, b)| format!("{name} {}", mib(*b)))
        .collect();
    let refuse = |limit: String| {
        Error::Usage(format!(
            "--policy gpu: the target weights {} + reservations ({}) = {} exceed {limit}",
            mib(weights),
            items.join(" + "),
            mib(needed)
        ))
    };
    let vram_budget_bytes = match req.budget {
        Budget::Bytes(b) => {
            if needed > b {
                return Err(refuse(format!("--vram-budget {}", mib(b))));
            }
            b
        }
        Budget::Percent(pct) => {
            check_percent(pct)?;
            if pct < 100.0 {
                return Err(Error::Usage(format!(
                    "--policy gpu puts every weight on the GPU; --vram-budget {pct}% holds only \
                     part of them (use 100% or --policy oato)"
                )));
            }
            needed
        }
    };
    if needed > gpu.free_bytes {
        return Err(refuse(format!(
            "the GPU's free memory {}",
            mib(gpu.free_bytes)
        )));
    }
    let n = model.ops.len();
    let devices = vec![Device::Gpu; n];
    let cap = WeightCap {
        vram_budget_bytes,
        cap_bytes: vram_budget_bytes
            .min(gpu.free_bytes)
            .saturating_sub(reservations.total()),
        notes: Vec::new(),
    };
    let budget = BudgetReport::new(req.budget, &cap, &reservations, 1.0);
    let (predicted, crossings) = predict_with_crossings(model, &devices);
    Ok(PlanParts {
        prefill_stream: Vec::new(),
        stream_min_tokens: usize::MAX,
        policy: Policy::Gpu,
        ranking: Ranking::new(model, None),
        predicted,
        crossings,
        devices,
        rules: vec!["policy gpu".to_string(); n],
        budget,
        rounds: 1,
        notes: Vec::new(),
    }
    .into_placement(profile, req, model))
}

/// What one layer puts on the GPU under `layer-split`.
#[derive(Clone, Copy, Debug, Default)]
struct LayerBytes {
    target: u64,
    other: u64,
    kv: u64,
}

/// `layer-split` (llama.cpp's `-ngl`): the last N whole layers on the GPU with their non-target
/// tensors and KV cache, N the most that fit; the output head there only when every layer is and
/// it still fits. With bytes, `Σ (layer weights + layer tensors + layer KV) ≤ 0.90 ×
/// (min(budget, free) − workspace − non-layer tensors)`; with a percentage, the layers' target
/// weights within that share of all target weights.
pub(crate) fn plan_layer_split(
    profile: &Profile,
    req: &PlanRequest,
    model: &CostModel,
) -> Result<Placement> {
    let gpu = gpu_info(profile, req.policy)?;
    let info = &profile.model;
    let workspace = workspace_bytes(profile, req.prompt_tokens);

    let mut layers: BTreeMap<usize, LayerBytes> = BTreeMap::new();
    let mut head_target = 0u64;
    for op in &model.ops {
        match op.layer {
            Some(l) => layers.entry(l).or_default().target += op.weight_bytes,
            None => head_target += op.weight_bytes,
        }
    }
    let n_kv_layers = if info.n_layer > 0 {
        info.n_layer
    } else {
        layers.len().max(1)
    } as u64;
    let kv_per_layer = info
        .kv_bytes_per_token
        .saturating_mul(req.ctx_tokens as u64)
        / n_kv_layers;
    let mut head_norm = 0u64;
    let mut global_other = 0u64;
    for t in &info.other_tensors {
        match t.layer {
            Some(l) => layers.entry(l).or_default().other += t.bytes,
            None if is_head_norm(&t.name) => head_norm += t.bytes,
            None if t.name == super::TOKEN_EMBD => {}
            None => global_other += t.bytes,
        }
    }
    let n_layers = layers.len() as u64;
    for bytes in layers.values_mut() {
        bytes.kv = kv_per_layer;
        if info.other_tensors.is_empty() && n_layers > 0 {
            bytes.other = info.other_weight_bytes / n_layers;
        }
    }

    // Bytes each layer and the head take against the cap, and the cap.
    let mut notes = Vec::new();
    let (cap_bytes, counts_memory) = match req.budget {
        Budget::Bytes(_) => {
            let parts = [
                ("workspace".to_string(), workspace),
                ("non-layer tensors".to_string(), global_other),
            ];
            let cap = weight_cap(req.budget, &parts, 0, gpu)?;
            notes.extend(cap.notes);
            (cap.cap_bytes, true)
        }
        Budget::Percent(pct) => {
            check_percent(pct)?;
            let cap = (pct / 100.0 * model.total_target_bytes() as f64).floor() as u64;
            (cap, false)
        }
    };
    let layer_cost = |b: &LayerBytes| {
        if counts_memory {
            b.target.saturating_add(b.other).saturating_add(b.kv)
        } else {
            b.target
        }
    };
    let head_cost = if counts_memory {
        head_target + head_norm
    } else {
        head_target
    };

    // Whatever the budget, the GPU layers with their KV cache and tensors stay within 90% of
    // the free memory left after the workspace and the non-layer tensors (DESIGN.md: never more
    // than the free memory); with bytes the cap already says so.
    let memory_room = (CAP_FRACTION
        * gpu
            .free_bytes
            .saturating_sub(workspace.saturating_add(global_other)) as f64)
        .floor() as u64;
    let memory = |b: &LayerBytes| b.target.saturating_add(b.other).saturating_add(b.kv);
    // Walk the layers from the last, stop at the first that does not fit the cap or the memory.
    let mut fill = Fill::new([cap_bytes, memory_room]);
    let mut on_gpu: BTreeMap<usize, bool> = BTreeMap::new();
    let mut misfit: Option<(usize, u64)> = None;
    for (&l, b) in layers.iter().rev() {
        let fit = fill.offer([layer_cost(b), memory(b)]);
        if let Fit::FirstMisfit([cum, _]) = fit {
            if cum <= cap_bytes {
                notes.push(format!(
                    "layer {l} fits the cap but not the GPU's free memory; the layers stop there"
                ));
            }
            misfit = Some((l, cum));
        }
        on_gpu.insert(l, matches!(fit, Fit::Fits(_)));
    }
    let [used, used_memory] = fill.used;
    let gpu_layers = on_gpu.values().filter(|&&g| g).count();
    let all_layers = gpu_layers == layers.len();
    let head_cum = used.saturating_add(head_cost);
    let head_memory = used_memory.saturating_add(head_target + head_norm);
    let head_on_gpu =
        head_target > 0 && all_layers && head_cum <= cap_bytes && head_memory <= memory_room;

    let mut devices = Vec::with_capacity(model.ops.len());
    let mut rules = Vec::with_capacity(model.ops.len());
    for op in &model.ops {
        let (device, rule) = match op.layer {
            Some(l) if on_gpu.get(&l) == Some(&true) => {
                (Device::Gpu, format!("layer {l} (last {gpu_layers} fit)"))
            }
            Some(l) => match misfit {
                Some((m, cum)) if m == l => (
                    Device::Cpu,
                    format!("layer {l}: first misfit (cum {} > cap)", mib(cum)),
                ),
                _ => (
                    Device::Cpu,
                    format!("layer {l}: below the last {gpu_layers}"),
                ),
            },
            None if head_on_gpu => (Device::Gpu, "head: all layers on GPU and fits".to_string()),
            None if all_layers => (
                Device::Cpu,
                format!("head: does not fit (cum {} > cap)", mib(head_cum)),
            ),
            None => (Device::Cpu, "head: not all layers on GPU".to_string()),
        };
        devices.push(device);
        rules.push(rule);
    }

    // What the GPU holds besides the target weights.
    let gpu_in_use = devices.contains(&Device::Gpu);
    let gpu_layer_bytes = layers
        .iter()
        .filter(|(l, _)| on_gpu.get(l) == Some(&true))
        .fold(LayerBytes::default(), |acc, (_, b)| LayerBytes {
            target: acc.target + b.target,
            other: acc.other + b.other,
            kv: acc.kv + b.kv,
        });
    let reservations = Reservations {
        kv_bytes: gpu_layer_bytes.kv,
        workspace_bytes: if gpu_in_use { workspace } else { 0 },
        other_weight_bytes: if gpu_in_use {
            gpu_layer_bytes.other + global_other + if head_on_gpu { head_norm } else { 0 }
        } else {
            0
        },
        stream_bytes: if gpu_in_use && req.streams() {
            super::cost::prefill_stream_bytes(profile)
        } else {
            0
        },
    };
    let reserved_bytes = reservations.total();
    let gpu_weights = gpu_layer_bytes.target + if head_on_gpu { head_target } else { 0 };

    let vram_budget_bytes = match req.budget {
        Budget::Bytes(b) => b,
        Budget::Percent(pct) => {
            let total = reserved_bytes.saturating_add(gpu_weights);
            if total > gpu.total_bytes {
                return Err(Error::Usage(format!(
                    "--vram-budget {pct}% with --policy layer-split: {} of layers plus their KV \
                     cache, tensors and the workspace ({}) exceed the GPU's memory {}",
                    mib(gpu_weights),
                    mib(reserved_bytes),
                    mib(gpu.total_bytes)
                )));
            }
            if total > gpu.free_bytes {
                notes.push(format!(
                    "the GPU layers and their reservations ({}) exceed the GPU's free memory {} \
                     at profiling time",
                    mib(total),
                    mib(gpu.free_bytes)
                ));
            }
            reserved_bytes.saturating_add((cap_bytes as f64 / CAP_FRACTION).round() as u64)
        }
    };
    if counts_memory {
        notes.push(
            "layer-split counts each GPU layer's KV cache and tensors against the cap with its \
             weights"
                .to_string(),
        );
    }
    let cap = WeightCap {
        vram_budget_bytes,
        cap_bytes,
        notes: Vec::new(),
    };
    let budget = BudgetReport::new(req.budget, &cap, &reservations, CAP_FRACTION);
    let (predicted, crossings, prefill_stream, stream_min_tokens) =
        layer_split_prediction(model, &devices, req.streams());
    Ok(PlanParts {
        prefill_stream,
        stream_min_tokens,
        policy: Policy::LayerSplit,
        ranking: Ranking::new(model, None),
        predicted,
        crossings,
        devices,
        rules,
        budget,
        rounds: 1,
        notes,
    }
    .into_placement(profile, req, model))
}

/// `flexgen`: every operator computes on the GPU; weights are resident in layer order (layer 0
/// first, the head last) while they fit under the cap, the rest streamed for each use
/// (`Device::Cpu` in the file). Reservations and cap as for `oato`.
pub(crate) fn plan_flexgen(
    profile: &Profile,
    req: &PlanRequest,
    model: &CostModel,
) -> Result<Placement> {
    let gpu = gpu_info(profile, req.policy)?;
    let mut reservations = Reservations::for_request(profile, req);
    // Streamed weights need room for two layers at a time: the two largest stages.
    let mut stages: Vec<u64> = model
        .stages()
        .iter()
        .map(|s| s.iter().map(|&i| model.ops[i].weight_bytes).sum())
        .collect();
    stages.sort_unstable_by(|a, b| b.cmp(a));
    reservations.stream_bytes = stages.iter().take(2).sum();
    let cap = weight_cap(
        req.budget,
        &reservations.parts(req.ctx_tokens),
        model.total_target_bytes(),
        gpu,
    )?;
    let mut walk: Vec<usize> = (0..model.ops.len()).collect();
    walk.sort_by_key(|&i| (model.ops[i].layer.is_none(), model.ops[i].layer, i));
    let mut devices = vec![Device::Cpu; model.ops.len()];
    let mut rules = vec![String::new(); model.ops.len()];
    let mut fill = Fill::new([cap.cap_bytes]);
    for i in walk {
        rules[i] = match fill.offer([model.ops[i].weight_bytes]) {
            Fit::Fits([cum]) => {
                devices[i] = Device::Gpu;
                format!("resident (cum {} ≤ cap)", mib(cum))
            }
            Fit::FirstMisfit([cum]) => format!("streamed: first misfit (cum {} > cap)", mib(cum)),
            Fit::AfterStop => "streamed".to_string(),
        };
    }
    let budget = BudgetReport::new(req.budget, &cap, &reservations, CAP_FRACTION);
    let (predicted, crossings) =
        model.predict_plan(&devices, &vec![Device::Gpu; model.ops.len()], true, &[]);
    Ok(PlanParts {
        prefill_stream: Vec::new(),
        stream_min_tokens: usize::MAX,
        policy: Policy::Flexgen,
        ranking: Ranking::new(model, None),
        predicted,
        crossings,
        devices,
        rules,
        budget,
        rounds: 1,
        notes: cap.notes,
    }
    .into_placement(profile, req, model))
}

/// Layer-split's prediction: each layer's attention where its weights are (its home); with
/// prefill streaming's choice when `stream`.
fn layer_split_prediction(
    model: &CostModel,
    devices: &[Device],
    stream: bool,
) -> (super::cost::PerPass, [usize; 2], Vec<bool>, usize) {
    let mut homes = vec![Device::Cpu; model.n_layer];
    for (o, &d) in model.ops.iter().zip(devices) {
        if let Some(l) = o.layer
            && d == Device::Gpu
            && l < homes.len()
        {
            homes[l] = Device::Gpu;
        }
    }
    model.predict_streaming(devices, &homes, stream)
}

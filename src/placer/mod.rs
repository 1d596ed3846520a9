//! The placer: checks a placement file against the model it is applied to and the GPU it will
//! use, with errors that name the offending tensor and the numbers, and turns it into the
//! executor's device map (GPU weights are uploaded, CPU weights stay in the memory map).

use std::collections::HashSet;

use crate::error::{Error, Result};
use crate::model::Model;
use crate::profiler::fingerprint;
use crate::runtime::forward::{DeviceMap, target_weights};
use crate::runtime::plan::CrossCost;
use crate::scheduler::{Device, Placement, Policy};

const MIB: f64 = (1u64 << 20) as f64;

/// What a checked placement puts on the GPU.
#[derive(Clone, Debug, PartialEq)]
pub struct PlacementSummary {
    pub gpu_weight_bytes: u64,
    pub gpu_ops: usize,
    pub ops: usize,
}

/// Checks `p` against `model` and the GPU's free memory (`None`: no GPU, with the reason):
/// the same model (fingerprint), every tensor named and no unknown names, the GPU weights within
/// the plan's cap, and weights plus reservations within the device's free memory.
pub fn check(
    p: &Placement,
    model: &Model,
    gpu_free: Result<u64, String>,
) -> Result<PlacementSummary> {
    let file = model.file.path.display().to_string();
    let fp = fingerprint(&model.file);
    if p.model.fingerprint != fp {
        return Err(Error::Usage(format!(
            "the placement is for {} (fingerprint {}), not {file} (fingerprint {fp})",
            p.model.file, p.model.fingerprint
        )));
    }
    let names: HashSet<&str> = model.file.tensors.iter().map(|t| t.name.as_str()).collect();
    if let Some(unknown) = p.tensors.keys().find(|n| !names.contains(n.as_str())) {
        return Err(Error::Usage(format!(
            "the placement names tensor {unknown:?}, which {file} does not have"
        )));
    }
    if let Some(missing) = model
        .file
        .tensors
        .iter()
        .find(|t| !p.tensors.contains_key(&t.name))
    {
        return Err(Error::Usage(format!(
            "the placement names no device for tensor {:?} of {file}",
            missing.name
        )));
    }
    let on_gpu = |name: &str| p.tensors.get(name) == Some(&Device::Gpu);
    let targets = target_weights(model);
    let gpu_weight_bytes: u64 = targets
        .iter()
        .filter(|w| on_gpu(&w.name))
        .map(|w| w.n_bytes as u64)
        .sum();
    let flexgen = p.policy == Policy::Flexgen;
    let gpu_ops = if flexgen {
        targets.len()
    } else {
        targets.iter().filter(|w| on_gpu(&w.name)).count()
    };
    let prefill: HashSet<&str> = p.prefill_stream.iter().map(String::as_str).collect();
    if let Some(unknown) = prefill.iter().find(|n| !names.contains(**n)) {
        return Err(Error::Usage(format!(
            "the placement streams tensor {unknown:?} in prefill, which {file} does not have"
        )));
    }
    // FlexGen, and prefill streaming, hold two layers of streamed weights at once (the one
    // computing, the next).
    let streams = |name: &str| !on_gpu(name) && (flexgen || prefill.contains(name));
    let mut per_layer: std::collections::BTreeMap<Option<usize>, u64> = Default::default();
    for w in targets.iter().filter(|w| streams(&w.name)) {
        let layer = crate::profiler::layer_of(&w.name);
        *per_layer.entry(layer).or_default() += w.n_bytes as u64;
    }
    let mut streamed: Vec<u64> = per_layer.into_values().collect();
    streamed.sort_unstable_by(|a, b| b.cmp(a));
    // What the plan reserved for them already counts in its reserved bytes.
    let stream_bytes: u64 = streamed
        .iter()
        .take(2)
        .sum::<u64>()
        .saturating_sub(p.budget.stream_bytes);
    let any_gpu = flexgen || !prefill.is_empty() || p.tensors.values().any(|d| *d == Device::Gpu);
    if any_gpu {
        let free = gpu_free.map_err(|why| {
            Error::Usage(format!(
                "the placement puts {gpu_ops} operators ({:.1} MiB) on the GPU, but there is no \
                 GPU: {why}",
                gpu_weight_bytes as f64 / MIB
            ))
        })?;
        // One byte of slack per operator for rounding in the plan's arithmetic.
        if gpu_weight_bytes > p.budget.cap_bytes + targets.len() as u64 {
            let worst = targets
                .iter()
                .filter(|w| on_gpu(&w.name))
                .max_by_key(|w| w.n_bytes)
                .map(|w| w.name.clone())
                .unwrap_or_default();
            return Err(Error::Usage(format!(
                "the placement puts {:.1} MiB of weights on the GPU, over its cap of {:.1} MiB \
                 (budget {:.1} MiB); the largest is {worst:?}",
                gpu_weight_bytes as f64 / MIB,
                p.budget.cap_bytes as f64 / MIB,
                p.budget.vram_budget_bytes as f64 / MIB
            )));
        }
        let need = gpu_weight_bytes + p.budget.reserved_bytes + stream_bytes;
        if need > free {
            return Err(Error::Usage(format!(
                "the placement needs {:.1} MiB on the GPU ({:.1} MiB of weights + {:.1} MiB \
                 reserved + {:.1} MiB for streamed layers), but only {:.1} MiB are free",
                need as f64 / MIB,
                gpu_weight_bytes as f64 / MIB,
                p.budget.reserved_bytes as f64 / MIB,
                stream_bytes as f64 / MIB,
                free as f64 / MIB
            )));
        }
    }
    Ok(PlacementSummary {
        gpu_weight_bytes,
        gpu_ops,
        ops: targets.len(),
    })
}

/// The executor's map for a checked placement: backend `cpu` or `gpu` (indices into the
/// session's backends) for every target weight; each layer's attention and KV cache where its
/// `attn_norm` is; the other non-target operators as rule 2 places them, with the link figures
/// the plan was made with. Under `flexgen`
/// everything computes on the GPU and the weights marked `cpu` are streamed to it.
pub fn device_map(p: &Placement, model: &Model, cpu: usize, gpu: usize) -> DeviceMap {
    let flexgen = p.policy == Policy::Flexgen;
    let idx = |name: &str| match p.tensors.get(name) {
        Some(Device::Gpu) => gpu,
        _ if flexgen && name != "token_embd.weight" => gpu,
        _ => cpu,
    };
    let weights = target_weights(model);
    DeviceMap {
        streamed: weights
            .iter()
            .filter(|w| flexgen && p.tensors.get(&w.name) != Some(&Device::Gpu))
            .map(|w| w.name.clone())
            .collect(),
        weights: weights
            .iter()
            .map(|w| (w.name.clone(), if flexgen { gpu } else { idx(&w.name) }))
            .collect(),
        layer_home: (0..model.hp.n_layer)
            .map(|i| idx(&format!("blk.{i}.attn_norm.weight")))
            .collect(),
        link: p.link.map_or_else(CrossCost::default, |l| CrossCost {
            fixed_us: l.crossing_us,
            h2d_gbps: l.h2d_gbps,
            d2h_gbps: l.d2h_gbps,
        }),
        prefill_stream: if flexgen {
            Default::default()
        } else {
            p.prefill_stream
                .iter()
                .filter(|n| p.tensors.get(n.as_str()) != Some(&Device::Gpu))
                .cloned()
                .collect()
        },
        stream_dev: gpu,
        stream_min_tokens: p.stream_min_tokens.unwrap_or(usize::MAX),
    }
}

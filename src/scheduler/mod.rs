//! The scheduler: from a profile (`oato.profile/v1`) and a VRAM budget, decides which target
//! weights live on the GPU and writes the `oato.placement/v1` file (DESIGN.md, "The OATO
//! scheduler", "Budget", "Files"). Besides OATO itself it plans the baselines (layer split,
//! FlexGen, all-CPU, all-GPU) in the same format, and renders any placement as a table or as
//! llama.cpp arguments.

mod baselines;
mod cost;
pub use cost::mib;
mod oato;
mod placement;
mod report;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::profiler::profile::{GpuInfo, Profile};

use cost::{CostModel, MIB, PerPass, Reservations, WeightCap};
use oato::Ranking;

pub use cost::workspace_for;
pub use oato::MAX_ROUNDS;
pub use placement::{
    BudgetReport, Device, OrderEntry, PLACEMENT_SCHEMA, Placement, PlacementModel, Predicted,
    Workload,
};
pub use report::{llama_ot, render_table};

/// The paper's workload: prompt length, generated tokens, and the context the KV cache holds.
pub const DEFAULT_PROMPT_TOKENS: usize = 64;
pub const DEFAULT_GEN_TOKENS: usize = 32;
pub const DEFAULT_CTX_TOKENS: usize = 1024;

/// The embedding table: read on the CPU by the lookup (placement rule 3) unless it is also the
/// tied output head's weight.
const TOKEN_EMBD: &str = "token_embd.weight";

/// A non-target tensor that belongs to the output head (it follows the head under
/// `layer-split`).
fn is_head_norm(name: &str) -> bool {
    name.starts_with("output_norm.")
}

/// How the weights are placed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Policy {
    /// Operator-aware tensor offloading, improved: shared costs per shape, rule-2 crossings.
    Oato,
    /// The paper's Algorithm 1 exactly as first built (each operator's own cost).
    OatoPaper,
    /// llama.cpp's `-ngl`: the last whole layers on the GPU.
    LayerSplit,
    /// Resident weights in layer order, the rest streamed; all compute on the GPU.
    Flexgen,
    /// Everything on the CPU.
    Cpu,
    /// Everything on the GPU.
    Gpu,
}

impl Policy {
    pub const ALL: [Policy; 6] = [
        Policy::Oato,
        Policy::OatoPaper,
        Policy::LayerSplit,
        Policy::Flexgen,
        Policy::Cpu,
        Policy::Gpu,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Policy::Oato => "oato",
            Policy::OatoPaper => "oato-paper",
            Policy::LayerSplit => "layer-split",
            Policy::Flexgen => "flexgen",
            Policy::Cpu => "cpu",
            Policy::Gpu => "gpu",
        }
    }
}

impl std::fmt::Display for Policy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(self.name())
    }
}

/// `--vram-budget`: bytes, or a percentage of the model's target-weight bytes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Budget {
    Bytes(u64),
    Percent(f64),
}

impl Budget {
    /// The percentage, when the budget is one.
    pub fn percent(self) -> Option<f64> {
        match self {
            Budget::Percent(p) => Some(p),
            Budget::Bytes(_) => None,
        }
    }
}

impl std::fmt::Display for Budget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Budget::Bytes(b) => write!(f, "{}", cost::mib(*b)),
            Budget::Percent(p) => write!(f, "{p}%"),
        }
    }
}

/// Parses `--vram-budget`: a byte count with an optional binary unit (`123456`, `512K`, `800M`,
/// `1.5G`, `12GiB`, `1T`; `K`/`KB`/`KiB` are all 1024) or a percentage in (0, 100] (`75%`).
pub fn parse_budget(text: &str) -> Result<Budget> {
    let bad = |why: &str| Error::Usage(format!("--vram-budget {text:?}: {why}"));
    let s = text.trim();
    if s.is_empty() {
        return Err(bad(
            "empty; give bytes with a unit (12G, 800M) or a percentage (75%)",
        ));
    }
    if s.starts_with('-') {
        return Err(bad("must not be negative"));
    }
    if let Some(number) = s.strip_suffix('%') {
        let number = number.trim();
        let pct: f64 = number
            .parse()
            .ok()
            .filter(|_| number.chars().all(|c| c.is_ascii_digit() || c == '.'))
            .ok_or_else(|| bad("not a number before the %"))?;
        if !(pct > 0.0 && pct <= 100.0) {
            return Err(bad("a percentage must be above 0 and at most 100"));
        }
        return Ok(Budget::Percent(pct));
    }
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (number, unit) = s.split_at(split);
    let unit = unit.trim();
    let shift = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => {
            return Err(bad(&format!(
                "unknown unit {unit:?} (use K, M, G or T, binary: 12G = 12 GiB; or a \
                 percentage like 75%)"
            )));
        }
    };
    if number.is_empty() {
        return Err(bad("no number"));
    }
    let too_large = || bad("too large");
    if let Ok(whole) = number.parse::<u64>() {
        return whole
            .checked_mul(1u64 << shift)
            .map(Budget::Bytes)
            .ok_or_else(too_large);
    }
    if shift == 0 {
        return Err(bad("a byte count must be a whole number (or give a unit)"));
    }
    let value: f64 = number.parse().map_err(|_| bad("not a number"))?;
    let bytes = (value * (1u64 << shift) as f64).round();
    if !bytes.is_finite() || bytes >= u64::MAX as f64 {
        return Err(too_large());
    }
    Ok(Budget::Bytes(bytes as u64))
}

/// What `oato plan` is asked.
#[derive(Clone, Debug, PartialEq)]
pub struct PlanRequest {
    pub policy: Policy,
    pub budget: Budget,
    /// P: the prefill batch.
    pub prompt_tokens: usize,
    /// G: decode steps, one token each.
    pub gen_tokens: usize,
    /// Context the KV cache is reserved for (`--ctx`).
    pub ctx_tokens: usize,
    /// Prefill streaming allowed (rule 5; `--no-stream` turns it off). `oato-paper`, `flexgen`,
    /// `cpu` and `gpu` never stream.
    pub stream: bool,
}

impl PlanRequest {
    /// A request with the paper's workload (P=64, G=32, ctx 1024).
    pub fn new(policy: Policy, budget: Budget) -> PlanRequest {
        PlanRequest {
            policy,
            budget,
            prompt_tokens: DEFAULT_PROMPT_TOKENS,
            gen_tokens: DEFAULT_GEN_TOKENS,
            ctx_tokens: DEFAULT_CTX_TOKENS,
            stream: true,
        }
    }

    /// Whether this request's policy may stream weights in prefill (rule 5).
    pub fn streams(&self) -> bool {
        self.stream && matches!(self.policy, Policy::Oato | Policy::LayerSplit)
    }

    fn check(&self) -> Result<()> {
        if self.prompt_tokens == 0 {
            return Err(Error::Usage("--prompt-tokens must be at least 1".into()));
        }
        let needed = self.prompt_tokens.saturating_add(self.gen_tokens);
        if self.ctx_tokens < needed {
            return Err(Error::Usage(format!(
                "--ctx {} is smaller than the prompt and generated tokens ({} + {})",
                self.ctx_tokens, self.prompt_tokens, self.gen_tokens
            )));
        }
        Ok(())
    }
}

/// Plans where every weight of the profiled model lives under `req`'s policy and budget.
pub fn plan(profile: &Profile, req: &PlanRequest) -> Result<Placement> {
    req.check()?;
    let model = CostModel::new(profile, req)?;
    if req.policy != Policy::Cpu && !model.has_gpu() {
        return Err(no_gpu(req.policy));
    }
    match req.policy {
        Policy::Oato | Policy::OatoPaper => oato::plan_oato(profile, req, &model),
        Policy::LayerSplit => baselines::plan_layer_split(profile, req, &model),
        Policy::Flexgen => baselines::plan_flexgen(profile, req, &model),
        Policy::Cpu => baselines::plan_cpu(profile, req, &model),
        Policy::Gpu => baselines::plan_gpu(profile, req, &model),
    }
}

fn no_gpu(policy: Policy) -> Error {
    Error::Usage(format!(
        "--policy {policy}: the profile has no GPU timings (profiled without a GPU); only \
         --policy cpu can be planned from it"
    ))
}

/// The profile's GPU, or the error a GPU policy gives without one.
fn gpu_info(profile: &Profile, policy: Policy) -> Result<&GpuInfo> {
    profile.gpu.as_ref().ok_or_else(|| no_gpu(policy))
}

impl BudgetReport {
    /// The budget section for a cap from `weight_cap` and the reservations it was given.
    fn new(
        budget: Budget,
        cap: &WeightCap,
        reservations: &Reservations,
        cap_fraction: f64,
    ) -> BudgetReport {
        BudgetReport {
            vram_budget_bytes: cap.vram_budget_bytes,
            reserved_bytes: reservations.total(),
            cap_fraction,
            cap_bytes: cap.cap_bytes,
            kv_bytes: reservations.kv_bytes,
            workspace_bytes: reservations.workspace_bytes,
            other_weight_bytes: reservations.other_weight_bytes,
            stream_bytes: reservations.stream_bytes,
            percent: budget.percent(),
        }
    }
}

/// A policy's decision, before it is written as a placement.
struct PlanParts {
    policy: Policy,
    /// The order written (for `oato`, the round that produced the kept placement).
    ranking: Ranking,
    /// Device and rule of every operator, by operator index.
    devices: Vec<Device>,
    rules: Vec<String>,
    budget: BudgetReport,
    rounds: usize,
    predicted: PerPass,
    /// Copies in the prefill and in a decode step (as the executor makes them).
    crossings: [usize; 2],
    /// By operator: streamed to the GPU in prefill (rule 5); empty: none.
    prefill_stream: Vec<bool>,
    stream_min_tokens: usize,
    notes: Vec<String>,
}

impl PlanParts {
    fn into_placement(self, profile: &Profile, req: &PlanRequest, model: &CostModel) -> Placement {
        let order = self
            .ranking
            .order
            .iter()
            .map(|&i| {
                let op = &model.ops[i];
                OrderEntry {
                    op: op.op.clone(),
                    affinity: self.ranking.affinities[i],
                    benefit_us_per_mib: self.ranking.benefits[i] * MIB,
                    device: self.devices[i],
                    tensor: op.tensor.clone(),
                    layer: op.layer,
                    weight_bytes: op.weight_bytes,
                    rule: self.rules[i].clone(),
                }
            })
            .collect();
        let weight_on = |device: Device| -> u64 {
            model
                .ops
                .iter()
                .zip(&self.devices)
                .filter(|(_, d)| **d == device)
                .map(|(op, _)| op.weight_bytes)
                .sum()
        };
        Placement {
            schema: PLACEMENT_SCHEMA.to_string(),
            policy: self.policy,
            model: PlacementModel {
                file: profile.model.file.clone(),
                fingerprint: profile.model.fingerprint.clone(),
            },
            workload: Workload {
                prompt_tokens: req.prompt_tokens,
                gen_tokens: req.gen_tokens,
                ctx_tokens: req.ctx_tokens,
            },
            budget: self.budget,
            rounds: self.rounds,
            order,
            tensors: tensor_map(profile, model, self.policy, &self.devices),
            gpu_weight_bytes: weight_on(Device::Gpu),
            cpu_weight_bytes: weight_on(Device::Cpu),
            predicted: Predicted {
                prefill_crossings: self.crossings[0],
                decode_crossings: self.crossings[1],
                ..self.predicted.to_predicted()
            },
            link: model.has_gpu().then_some(placement::PlacementLink {
                crossing_us: model.cross.fixed_us,
                h2d_gbps: model.cross.h2d_gbps,
                d2h_gbps: model.cross.d2h_gbps,
            }),
            prefill_stream: model
                .ops
                .iter()
                .zip(&self.prefill_stream)
                .filter(|(_, s)| **s)
                .map(|(o, _)| o.tensor.clone())
                .collect(),
            stream_min_tokens: (self.prefill_stream.iter().any(|&s| s))
                .then_some(self.stream_min_tokens),
            notes: self.notes,
        }
    }
}

/// Every tensor's device: a target weight goes with its operator; the non-target tensors live
/// on the GPU whenever it is in use (rule 2) — under `layer-split` with their layer, the output
/// norm with the head — except the embedding table, which stays on the CPU (rule 3) unless it is
/// the tied head's weight placed on the GPU.
fn tensor_map(
    profile: &Profile,
    model: &CostModel,
    policy: Policy,
    devices: &[Device],
) -> BTreeMap<String, Device> {
    let gpu_in_use = match policy {
        Policy::Cpu => false,
        Policy::Flexgen => true,
        _ => devices.contains(&Device::Gpu),
    };
    let on_gpu_where = |layer: Option<usize>| {
        let any = model
            .ops
            .iter()
            .zip(devices)
            .any(|(op, d)| op.layer == layer && *d == Device::Gpu);
        if any { Device::Gpu } else { Device::Cpu }
    };
    let mut tensors = BTreeMap::new();
    for t in &profile.model.other_tensors {
        let device = if !gpu_in_use || t.name == TOKEN_EMBD {
            Device::Cpu
        } else if policy == Policy::LayerSplit {
            match t.layer {
                Some(l) => on_gpu_where(Some(l)),
                None if is_head_norm(&t.name) => on_gpu_where(None),
                None => Device::Gpu,
            }
        } else {
            Device::Gpu
        };
        tensors.insert(t.name.clone(), device);
    }
    for (op, &d) in model.ops.iter().zip(devices) {
        tensors.insert(op.tensor.clone(), d);
    }
    tensors
}

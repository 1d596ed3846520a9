//! The `oato.placement/v1` file (DESIGN.md, "Files"): where every tensor of the model lives, the
//! order and rule that put it there, the budget it was planned under and the predicted times.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

use super::Policy;

fn is_zero(v: &u64) -> bool {
    *v == 0
}

pub const PLACEMENT_SCHEMA: &str = "oato.placement/v1";

/// Where a weight lives. Under `flexgen`, `Cpu` means streamed to the GPU for each use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Device {
    Gpu,
    Cpu,
}

impl Device {
    pub fn name(self) -> &'static str {
        match self {
            Device::Gpu => "gpu",
            Device::Cpu => "cpu",
        }
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(self.name())
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Placement {
    pub schema: String,
    pub policy: Policy,
    pub model: PlacementModel,
    pub workload: Workload,
    pub budget: BudgetReport,
    /// Rounds of the OATO iteration computed (1 for the other policies).
    pub rounds: usize,
    /// Every target operator, best first.
    pub order: Vec<OrderEntry>,
    /// Every tensor of the model (as far as the profile names them) and its device.
    pub tensors: BTreeMap<String, Device>,
    /// Target weight bytes on each device.
    pub gpu_weight_bytes: u64,
    pub cpu_weight_bytes: u64,
    pub predicted: Predicted,
    /// Extra: the link's measured cost, which places the non-target operators (rule 2) as the
    /// scheduler predicted them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link: Option<PlacementLink>,
    /// CPU-resident target tensors streamed to the GPU for a prompt batch of at least
    /// `stream_min_tokens` tokens (placement rule 5); empty or absent: none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub prefill_stream: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_min_tokens: Option<usize>,
    /// Extra: what a reader should know about this plan (a cycle, a budget past free memory).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlacementModel {
    pub file: String,
    pub fingerprint: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Workload {
    pub prompt_tokens: usize,
    pub gen_tokens: usize,
    /// Extra: the context the KV cache is reserved for.
    #[serde(default)]
    pub ctx_tokens: usize,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BudgetReport {
    /// The budget given, or `reserved + cap / cap_fraction` for a percentage.
    pub vram_budget_bytes: u64,
    /// GPU memory held besides the target weights.
    pub reserved_bytes: u64,
    pub cap_fraction: f64,
    /// What the target weights on the GPU may take.
    pub cap_bytes: u64,
    /// Extra: the parts of `reserved_bytes`.
    #[serde(default)]
    pub kv_bytes: u64,
    #[serde(default)]
    pub workspace_bytes: u64,
    #[serde(default)]
    pub other_weight_bytes: u64,
    /// Extra (flexgen): room for two layers of streamed weights.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub stream_bytes: u64,
    /// Extra: the percentage given, when the budget was one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub percent: Option<f64>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OrderEntry {
    pub op: String,
    pub affinity: f64,
    pub benefit_us_per_mib: f64,
    pub device: Device,
    /// Extra: the weight tensor, its layer (`null` for the head), its bytes, and why it went
    /// where it did.
    #[serde(default)]
    pub tensor: String,
    #[serde(default)]
    pub layer: Option<usize>,
    #[serde(default)]
    pub weight_bytes: u64,
    #[serde(default)]
    pub rule: String,
}

impl OrderEntry {
    /// The weight tensor's name (older files without `tensor`: the op id plus `.weight`).
    pub fn tensor_name(&self) -> String {
        if self.tensor.is_empty() {
            format!("{}.weight", self.op)
        } else {
            self.tensor.clone()
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Predicted {
    pub ttft_ms: f64,
    pub tpot_ms: f64,
    /// Extra: activation copies over the link in the prefill and in each decode step.
    #[serde(default)]
    pub prefill_crossings: usize,
    #[serde(default)]
    pub decode_crossings: usize,
}

/// The link figures a placement was planned with.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlacementLink {
    pub crossing_us: f64,
    pub h2d_gbps: f64,
    pub d2h_gbps: f64,
}

impl Placement {
    /// Parses and checks a placement file's text; `what` names it in errors.
    pub fn from_json(text: &str, what: &str) -> Result<Placement> {
        let v: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| Error::Msg(format!("{what}: not valid JSON: {e}")))?;
        match v.get("schema").and_then(|s| s.as_str()) {
            Some(PLACEMENT_SCHEMA) => {}
            Some(s) => {
                return Err(Error::Msg(format!(
                    "{what}: schema {s:?}, expected {PLACEMENT_SCHEMA:?}"
                )));
            }
            None => return Err(Error::Msg(format!("{what}: no \"schema\" field"))),
        }
        let is_device = |d: &serde_json::Value| matches!(d.as_str(), Some("gpu" | "cpu"));
        if let Some(tensors) = v.get("tensors").and_then(|t| t.as_object()) {
            for (name, device) in tensors {
                if !is_device(device) {
                    return Err(Error::Msg(format!(
                        "{what}: tensor {name}: device {device}, expected \"gpu\" or \"cpu\""
                    )));
                }
            }
        }
        if let Some(order) = v.get("order").and_then(|o| o.as_array()) {
            for entry in order {
                if let Some(device) = entry.get("device")
                    && !is_device(device)
                {
                    let op = entry.get("op").and_then(|o| o.as_str()).unwrap_or("?");
                    return Err(Error::Msg(format!(
                        "{what}: order entry {op}: device {device}, expected \"gpu\" or \"cpu\""
                    )));
                }
            }
        }
        serde_json::from_value(v)
            .map_err(|e| Error::Msg(format!("{what}: not a valid {PLACEMENT_SCHEMA} file: {e}")))
    }

    /// The file's text: pretty JSON, the same bytes for the same placement.
    pub fn to_json(&self) -> Result<String> {
        serde_json::to_string_pretty(self)
            .map(|mut s| {
                s.push('\n');
                s
            })
            .map_err(|e| Error::Msg(format!("placement: cannot write JSON: {e}")))
    }
}

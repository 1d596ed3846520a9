//! The `oato.profile/v1` file (DESIGN.md, "Files"): what the profiler measured and everything the
//! scheduler needs, so `oato plan` reads only this file.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

pub const PROFILE_SCHEMA: &str = "oato.profile/v1";

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    pub schema: String,
    pub model: ModelInfo,
    pub host: HostInfo,
    pub gpu: Option<GpuInfo>,
    pub link: Option<LinkInfo>,
    pub batches: Vec<usize>,
    pub operators: Vec<ProfileEntry>,
    /// Seconds the profiling took (an extra field).
    #[serde(default)]
    pub profiling_s: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelInfo {
    pub file: String,
    pub bytes: u64,
    pub arch: String,
    pub n_layer: usize,
    /// Hex digest of the GGUF header and tensor table.
    pub fingerprint: String,
    /// KV cache bytes per token of context, all layers, K and V, at the cache's type (f16).
    pub kv_bytes_per_token: u64,
    /// Non-target weights the GPU holds when it runs the non-target operators (norms, biases).
    pub other_weight_bytes: u64,
    /// Extra: every tensor that is not a target operator's weight, so a placement can name
    /// every tensor of the model from the profile alone.
    #[serde(default)]
    pub other_tensors: Vec<OtherTensor>,
    /// Extra: activation widths the workspace reservation needs.
    #[serde(default)]
    pub n_embd: usize,
    #[serde(default)]
    pub n_vocab: usize,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OtherTensor {
    pub name: String,
    /// The layer it belongs to; `null` for the embedding, output norm and rope_freqs.
    pub layer: Option<usize>,
    /// Bytes it takes on the GPU (f32 for norms and biases).
    pub bytes: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HostInfo {
    pub cpu: String,
    pub threads: usize,
    pub isa: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GpuInfo {
    pub name: String,
    pub total_bytes: u64,
    pub free_bytes: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LinkInfo {
    pub h2d_gbps: f64,
    pub d2h_gbps: f64,
    pub latency_us: f64,
}

/// One target operator and its median times in microseconds, by batch size (keys are the batch
/// sizes as strings, as in the file).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ProfileEntry {
    pub op: String,
    pub tensor: String,
    pub layer: Option<usize>,
    pub kind: String,
    pub dtype: String,
    pub k: usize,
    pub n: usize,
    pub weight_bytes: u64,
    pub in_bytes_per_token: u64,
    pub out_bytes_per_token: u64,
    pub cpu_us: BTreeMap<String, f64>,
    pub gpu_us: Option<BTreeMap<String, f64>>,
}

/// A time at batch `b` from a `{"1": .., "64": ..}` table: exact when measured, else linear
/// between the nearest measured batches (extrapolated from the nearest two outside them).
pub fn time_at(table: &BTreeMap<String, f64>, b: usize) -> Result<f64> {
    let mut pts: Vec<(f64, f64)> = table
        .iter()
        .map(|(k, &v)| {
            k.parse::<usize>()
                .map(|k| (k as f64, v))
                .map_err(|_| Error::Msg(format!("profile: batch key {k:?} is not a number")))
        })
        .collect::<Result<_>>()?;
    pts.sort_by(|a, b| a.0.total_cmp(&b.0));
    let x = b as f64;
    match pts.len() {
        0 => Err(Error::Msg("profile: an operator has no timings".into())),
        1 => Ok(pts[0].1 * x / pts[0].0),
        _ => {
            if let Some(&(_, v)) = pts.iter().find(|p| p.0 == x) {
                return Ok(v);
            }
            let i = pts
                .iter()
                .position(|p| p.0 > x)
                .unwrap_or(pts.len() - 1)
                .max(1);
            let ((x0, y0), (x1, y1)) = (pts[i - 1], pts[i]);
            Ok((y0 + (y1 - y0) * (x - x0) / (x1 - x0)).max(0.0))
        }
    }
}

impl Profile {
    /// Parses and checks a profile file's text.
    pub fn from_json(text: &str, what: &str) -> Result<Profile> {
        let v: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| Error::Msg(format!("{what}: not valid JSON: {e}")))?;
        match v.get("schema").and_then(|s| s.as_str()) {
            Some(PROFILE_SCHEMA) => {}
            Some(s) => {
                return Err(Error::Msg(format!(
                    "{what}: schema {s:?}, expected {PROFILE_SCHEMA:?}"
                )));
            }
            None => return Err(Error::Msg(format!("{what}: no \"schema\" field"))),
        }
        let p: Profile = serde_json::from_value(v)
            .map_err(|e| Error::Msg(format!("{what}: not a valid {PROFILE_SCHEMA} file: {e}")))?;
        for o in &p.operators {
            if o.weight_bytes == 0 {
                return Err(Error::Msg(format!(
                    "{what}: operator {} has no weight bytes",
                    o.op
                )));
            }
            if o.cpu_us.is_empty() || o.cpu_us.values().any(|t| !t.is_finite() || *t < 0.0) {
                return Err(Error::Msg(format!(
                    "{what}: operator {} has bad CPU times",
                    o.op
                )));
            }
            if let Some(g) = &o.gpu_us
                && (g.is_empty() || g.values().any(|t| !t.is_finite() || *t < 0.0))
            {
                return Err(Error::Msg(format!(
                    "{what}: operator {} has bad GPU times",
                    o.op
                )));
            }
        }
        Ok(p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_interpolate_between_batches() {
        let t: BTreeMap<String, f64> = [("1".to_string(), 10.0), ("64".to_string(), 73.0)].into();
        assert_eq!(time_at(&t, 1).unwrap(), 10.0);
        assert_eq!(time_at(&t, 64).unwrap(), 73.0);
        assert_eq!(time_at(&t, 32).unwrap(), 41.0);
        assert_eq!(time_at(&t, 127).unwrap(), 136.0);
    }
}

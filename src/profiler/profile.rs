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
    /// Extra: non-target operators' median times in microseconds on each device (`cpu`, `gpu`),
    /// by operator (`rms_norm`, `rope_q`, `rope_k`, `attention`, `add`, `swiglu`, `bias`) and
    /// batch size (decode attention at the position after a prompt of the largest batch).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub non_target_us: BTreeMap<String, BTreeMap<String, BTreeMap<String, f64>>>,
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
    /// Extra: the fixed cost of one decode matmul job on the CPU pool, in microseconds: what a
    /// layer's gate and up (two weights that read one input) save when they run as one job
    /// rather than two, over the model's layers out of cache (waking the pool, the memory's
    /// ramp, the wait for the slowest thread). The cost model takes it off every weight that
    /// joins another's job. Absent in older profiles: 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job_us: Option<f64>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GpuInfo {
    pub name: String,
    pub total_bytes: u64,
    pub free_bytes: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LinkInfo {
    /// Weight uploads through the executor's own path (from the registered memory map, or
    /// staged), and activation reads back into the CPU's activation buffers.
    pub h2d_gbps: f64,
    pub d2h_gbps: f64,
    pub latency_us: f64,
    /// Extra: a plain pinned-memory copy, the hardware's figure (DESIGN.md rule 8).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pinned_h2d_gbps: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pinned_d2h_gbps: Option<f64>,
    /// Extra: one decode-sized activation crossing (GPU→CPU→GPU, half of the round trip)
    /// through the executor's own path, in microseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub crossing_us: Option<f64>,
    /// Extra: activation copies host→device through the executor's own path (from the CPU's
    /// activation buffers); crossings cost this direction at this rate. Absent in older
    /// profiles: `h2d_gbps` stands in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub act_h2d_gbps: Option<f64>,
}

impl LinkInfo {
    /// GB/s of an activation crossing host→device.
    pub fn act_h2d(&self) -> f64 {
        self.act_h2d_gbps
            .filter(|g| g.is_finite() && *g > 0.0)
            .unwrap_or(self.h2d_gbps)
    }
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
    /// Microseconds to copy the weight to the GPU as prefill streaming does (rule 5): measured
    /// on the largest weight of its kind, shape and type, scaled to this one's bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_us: Option<f64>,
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
        // Bounds that keep the scheduler's arithmetic finite and exact.
        const MAX_DIM: usize = 1 << 32;
        const MAX_US: f64 = 1e12;
        let bad = |m: String| Error::Msg(format!("{what}: {m}"));
        let m = &p.model;
        if m.n_embd > MAX_DIM || m.n_vocab > MAX_DIM || m.kv_bytes_per_token > 1 << 40 {
            return Err(bad("model sizes out of range".into()));
        }
        // The scheduler makes a slot per layer (the fuzzer's 2^32 layers asked for 300 GB).
        const MAX_LAYERS: usize = 1 << 16;
        if m.n_layer > MAX_LAYERS {
            return Err(bad(format!(
                "n_layer {} is out of range (at most {MAX_LAYERS})",
                m.n_layer
            )));
        }
        // With n_layer 0 the scheduler counts the layers from the operators' (so a layer of 2^32
        // did the same).
        let layers = if m.n_layer > 0 { m.n_layer } else { MAX_LAYERS };
        if let Some(o) = p
            .operators
            .iter()
            .find(|o| o.layer.is_some_and(|l| l >= layers))
        {
            return Err(bad(format!(
                "operator {} is in layer {:?}, past the model's {} layers",
                o.op, o.layer, m.n_layer
            )));
        }
        let times = |t: &BTreeMap<String, f64>, dev: &str, op: &str| -> Result<()> {
            let mut seen = std::collections::BTreeSet::new();
            for (k, v) in t {
                let b: usize = k.parse().map_err(|_| {
                    bad(format!(
                        "operator {op}: {dev} batch key {k:?} is not a whole number"
                    ))
                })?;
                if b == 0 || !seen.insert(b) {
                    return Err(bad(format!(
                        "operator {op}: {dev} batch key {k:?} is 0 or repeated"
                    )));
                }
                if !v.is_finite() || *v < 0.0 || *v > MAX_US {
                    return Err(bad(format!(
                        "operator {op}: {dev} time {v} at batch {k} is not a time"
                    )));
                }
            }
            if t.is_empty() {
                return Err(bad(format!("operator {op} has no {dev} times")));
            }
            Ok(())
        };
        let mut total = 0u64;
        for o in &p.operators {
            if o.weight_bytes == 0 || o.weight_bytes > m.bytes || o.k > MAX_DIM || o.n > MAX_DIM {
                return Err(bad(format!(
                    "operator {} has {} weight bytes and shape {}x{} (model file {} bytes)",
                    o.op, o.weight_bytes, o.k, o.n, m.bytes
                )));
            }
            // The scheduler indexes a layer's weights by kind: a layer's operator must be one of
            // the seven matmuls, the head's the output.
            let kind_ok = match o.layer {
                Some(_) => crate::profiler::LAYER_KINDS.contains(&o.kind.as_str()),
                None => o.kind == "output",
            };
            if !kind_ok {
                return Err(bad(format!(
                    "operator {}: kind {:?} {} (a layer's kinds: {}; the head's: output)",
                    o.op,
                    o.kind,
                    match o.layer {
                        Some(l) => format!("in layer {l}"),
                        None => "outside a layer".to_string(),
                    },
                    crate::profiler::LAYER_KINDS.join(", ")
                )));
            }
            total = total.saturating_add(o.weight_bytes);
            times(&o.cpu_us, "CPU", &o.op)?;
            if let Some(g) = &o.gpu_us {
                times(g, "GPU", &o.op)?;
            }
        }
        if total > m.bytes {
            return Err(bad(format!(
                "the operators' weights ({total} bytes) exceed the model file ({} bytes)",
                m.bytes
            )));
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

    fn profile_json(edit: impl Fn(&mut serde_json::Value)) -> String {
        let mut v = serde_json::json!({
            "schema": PROFILE_SCHEMA,
            "model": {"file": "m.gguf", "bytes": 1000, "arch": "llama", "n_layer": 1,
                      "fingerprint": "00", "kv_bytes_per_token": 16, "other_weight_bytes": 8},
            "host": {"cpu": "c", "threads": 2, "isa": "avx2"},
            "gpu": null, "link": null, "batches": [1, 64],
            "operators": [{"op": "blk.0.attn_q", "tensor": "blk.0.attn_q.weight", "layer": 0,
                           "kind": "attn_q", "dtype": "Q4_0", "k": 32, "n": 32,
                           "weight_bytes": 576, "in_bytes_per_token": 128,
                           "out_bytes_per_token": 128, "cpu_us": {"1": 1.0, "64": 9.0},
                           "gpu_us": null}]
        });
        edit(&mut v);
        v.to_string()
    }

    #[test]
    fn bad_profiles_are_refused_with_the_reason() {
        assert!(Profile::from_json(&profile_json(|_| {}), "p").is_ok());
        type Edit<'a> = &'a dyn Fn(&mut serde_json::Value);
        let cases: [(Edit, &str); 11] = [
            (
                &|v| v["model"]["n_layer"] = (1u64 << 32).into(),
                "n_layer 4294967296",
            ),
            (
                &|v| v["operators"][0]["layer"] = 3.into(),
                "past the model's 1 layers",
            ),
            (
                &|v| {
                    v["model"]["n_layer"] = 0.into();
                    v["operators"][0]["layer"] = (1u64 << 32).into();
                },
                "in layer Some(4294967296)",
            ),
            // Found by the fuzzer: an unknown kind indexed past a layer's seven weights.
            (
                &|v| v["operators"][0]["kind"] = "5attn_v".into(),
                "kind \"5attn_v\" in layer 0",
            ),
            (
                &|v| v["operators"][0]["layer"] = serde_json::Value::Null,
                "outside a layer",
            ),
            (
                &|v| v["operators"][0]["cpu_us"]["0"] = 1.0.into(),
                "is 0 or repeated",
            ),
            (
                &|v| v["operators"][0]["cpu_us"]["01"] = 1.0.into(),
                "is 0 or repeated",
            ),
            (
                &|v| v["operators"][0]["cpu_us"]["x"] = 1.0.into(),
                "not a whole number",
            ),
            (
                &|v| v["operators"][0]["cpu_us"]["1"] = 1e300.into(),
                "is not a time",
            ),
            (
                &|v| v["operators"][0]["weight_bytes"] = 5000.into(),
                "weight bytes",
            ),
            (&|v| v["schema"] = "oato.placement/v1".into(), "schema"),
        ];
        for (edit, want) in cases {
            let e = Profile::from_json(&profile_json(edit), "p")
                .unwrap_err()
                .to_string();
            assert!(e.contains(want), "{e}");
        }
        let e = Profile::from_json("{", "p").unwrap_err().to_string();
        assert!(e.contains("not valid JSON"), "{e}");
    }
}

//! The cost model every policy shares: each target operator's time on both devices at the
//! workload's batch sizes, the link time of the activations it moves when it runs on the CPU while
//! the rest runs on the GPU (placement rule 2), predicted TTFT/TPOT, and the GPU memory reserved
//! before any weight is placed (DESIGN.md, "Budget").

use std::collections::BTreeMap;

use crate::error::{Error, Result};
use crate::profiler::profile::{GpuInfo, LinkInfo, Profile, time_at};
use crate::runtime::cuda_backend::GEMM_SLICE_BYTES;
use crate::runtime::cuda_mmq::{MMQ_MAX_SPLITS, MMQ_PART_BYTES};
use crate::runtime::plan::{
    self, CrossCost, HEAD, LayerTargets, N_SLOTS, OpKind, Step, Validity, Widths, head_steps,
    layer_steps, place_non_target,
};

use super::placement::{Device, Predicted};
use super::{Budget, PlanRequest};

/// The share of the available GPU memory the weights may take (DESIGN.md, "Fill").
pub(crate) const CAP_FRACTION: f64 = 0.90;

pub(crate) const MIB: f64 = 1048576.0;

/// Bytes as MiB with one decimal, the unit of every message and table.
pub fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / MIB)
}

/// Microseconds for one forward pass at each of the workload's two batch sizes: the prefill of
/// P prompt tokens and one decode step of 1 token.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct PerPass {
    pub prefill: f64,
    pub decode: f64,
}

impl PerPass {
    /// Time over the whole workload: prefill once, then one decode step per generated token.
    pub fn total(self, gen_tokens: f64) -> f64 {
        self.prefill + gen_tokens * self.decode
    }

    pub fn add(&mut self, other: PerPass) {
        self.prefill += other.prefill;
        self.decode += other.decode;
    }

    fn max(self, other: PerPass) -> PerPass {
        PerPass {
            prefill: self.prefill.max(other.prefill),
            decode: self.decode.max(other.decode),
        }
    }

    pub fn to_predicted(self) -> Predicted {
        Predicted {
            ttft_ms: self.prefill / 1e3,
            tpot_ms: self.decode / 1e3,
            prefill_crossings: 0,
            decode_crossings: 0,
        }
    }
}

/// One target operator, as the scheduler sees it.
#[derive(Clone, Debug)]
pub(crate) struct OpCost {
    pub op: String,
    pub tensor: String,
    pub layer: Option<usize>,
    pub weight_bytes: u64,
    pub cpu: PerPass,
    /// Zero when the profile has no GPU timings ([`CostModel::has_gpu`]): then only the `cpu`
    /// policy plans, and nothing asks for a GPU time.
    pub gpu: PerPass,
    /// GPU→CPU copy of the operator's input activation.
    pub input_copy: PerPass,
    /// CPU→GPU copy of its output activation.
    pub output_copy: PerPass,
    /// Operators with the same group read the same activation (q/k/v, gate/up of one layer) and
    /// share one input copy (placement rule 4).
    pub input_group: usize,
    /// The weight's slot in its layer (q k v o gate up down = 0..7; the head `plan::HEAD`).
    pub slot: usize,
    /// (kind, k, n, dtype): operators with the same key share one cost under `oato`.
    pub shape_key: String,
    /// Copy of the weight to the GPU for prefill streaming (rule 5); 0 without a GPU.
    pub stream_us: f64,
}

/// Direction of a copy over the link.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Direction {
    HostToDevice,
    DeviceToHost,
}

/// The target operators of a profile with their times at the request's workload.
#[derive(Clone, Debug)]
pub(crate) struct CostModel {
    pub ops: Vec<OpCost>,
    pub gen_tokens: f64,
    prompt_tokens: usize,
    /// `None` without a GPU: nothing crosses.
    link: Option<LinkInfo>,
    /// The crossing cost the executor's rule 2 and the prediction use.
    pub cross: CrossCost,
    widths: Widths,
    /// Every layer has latent attention (MiniCPM3), and scales its residual branches.
    mla: bool,
    res_scale: bool,
    pub n_layer: usize,
    /// Layers with q/k/v biases.
    biases: std::collections::BTreeSet<(usize, usize)>,
    /// Non-target operator times by device (0 = CPU, 1 = GPU) and name (`rms_norm`, `rope_q`,
    /// `rope_k`, `attention`, `add`, `swiglu`, `bias`), per pass; absent ones cost nothing.
    non_target: [BTreeMap<String, PerPass>; 2],
    /// Benefits count a CPU-resident operator's prefill as `min(Tc(P), stream + Tg(P))`
    /// (rule 5; the improved `oato` policy when streaming is allowed).
    pub stream_prefill: bool,
    /// The fixed cost of one CPU matmul job (the profile's `host.job_us`, 0 when absent): a
    /// CPU part of several weights (q/k/v, gate/up) runs as one job, so it costs the sum of
    /// their times (each measured as a job of its own) less this for each weight after the
    /// first.
    pub job_us: f64,
}

/// Which activation an operator reads, for the shared-copy rule: q/k/v (latent attention's
/// q_a and kv_a) of a layer read one, gate and up read another; every other operator reads its
/// own.
fn input_family(kind: &str) -> Option<&'static str> {
    match kind {
        "attn_q" | "attn_k" | "attn_v" | "attn_q_a" | "attn_kv_a_mqa" => Some("attn_in"),
        "ffn_gate" | "ffn_up" => Some("ffn_in"),
        _ => None,
    }
}

impl CostModel {
    pub fn new(profile: &Profile, req: &PlanRequest) -> Result<CostModel> {
        if profile.operators.is_empty() {
            return Err(Error::Msg("profile: no target operators".into()));
        }
        let has_gpu = profile.gpu.is_some()
            && profile.link.is_some()
            && profile.operators.iter().all(|o| o.gpu_us.is_some());
        let link = match (&profile.link, has_gpu) {
            (Some(l), true) => {
                let ok = |g: f64| g.is_finite() && g > 0.0;
                if !ok(l.h2d_gbps) || !ok(l.d2h_gbps) || !l.latency_us.is_finite() {
                    return Err(Error::Msg(format!(
                        "profile: bad link measurement (h2d {} GB/s, d2h {} GB/s, latency {} us)",
                        l.h2d_gbps, l.d2h_gbps, l.latency_us
                    )));
                }
                Some(LinkInfo {
                    h2d_gbps: l.h2d_gbps,
                    d2h_gbps: l.d2h_gbps,
                    latency_us: l.latency_us.max(0.0),
                    ..l.clone()
                })
            }
            _ => None,
        };
        let cross = link
            .as_ref()
            .map_or_else(CrossCost::default, |l| CrossCost {
                fixed_us: l
                    .crossing_us
                    .filter(|c| c.is_finite() && *c >= 0.0)
                    .unwrap_or(l.latency_us),
                h2d_gbps: l.act_h2d(),
                d2h_gbps: l.d2h_gbps,
            });
        let widths = profile_widths(profile);
        let mla = widths.kv_b > 0;
        let res_scale = profile.model.arch == crate::model::Arch::MiniCpm3.name();
        let biases = profile
            .model
            .other_tensors
            .iter()
            .filter_map(|t| {
                let i = ["attn_q.bias", "attn_k.bias", "attn_v.bias"]
                    .iter()
                    .position(|b| t.name.ends_with(b))?;
                Some((t.layer?, i))
            })
            .collect();
        let mut non_target: [BTreeMap<String, PerPass>; 2] = Default::default();
        for (d, name) in ["cpu", "gpu"].iter().enumerate() {
            if d == 1 && !has_gpu {
                continue;
            }
            if let Some(table) = profile.non_target_us.get(*name) {
                for (op, times) in table {
                    let pp = PerPass {
                        prefill: time_at(times, req.prompt_tokens).unwrap_or(0.0),
                        decode: time_at(times, 1).unwrap_or(0.0),
                    };
                    non_target[d].insert(op.clone(), pp);
                }
            }
        }
        let mut model = CostModel {
            ops: Vec::with_capacity(profile.operators.len()),
            gen_tokens: req.gen_tokens as f64,
            prompt_tokens: req.prompt_tokens,
            link,
            cross,
            widths,
            mla,
            res_scale,
            n_layer: profile.model.n_layer,
            biases,
            non_target,
            stream_prefill: false,
            job_us: profile
                .host
                .job_us
                .filter(|j| j.is_finite() && *j > 0.0)
                .unwrap_or(0.0),
        };
        let mut seen = std::collections::BTreeSet::new();
        // One entry per input group: the (layer, family) of a shared input, `None` for an
        // operator that reads its own.
        let mut groups: Vec<Option<(Option<usize>, &str)>> = Vec::new();
        for e in &profile.operators {
            let what = |msg: String| Error::Msg(format!("profile: operator {}: {msg}", e.op));
            if !seen.insert(e.tensor.as_str()) {
                return Err(what(format!("tensor {} appears twice", e.tensor)));
            }
            if e.weight_bytes == 0 {
                return Err(what("no weight bytes".into()));
            }
            let at = |table, batch| -> Result<f64> {
                let t = time_at(table, batch).map_err(|err| what(err.to_string()))?;
                if t.is_finite() && t >= 0.0 {
                    Ok(t)
                } else {
                    Err(what(format!("bad time {t} us at batch {batch}")))
                }
            };
            let per_pass = |table| -> Result<PerPass> {
                Ok(PerPass {
                    prefill: at(table, req.prompt_tokens)?,
                    decode: at(table, 1)?,
                })
            };
            // The head computes only the last token's logits in a prompt batch (generation), so
            // its prefill costs one row.
            let head = e.layer.is_none();
            let per_pass = |table| -> Result<PerPass> {
                let p = per_pass(table)?;
                Ok(if head {
                    PerPass {
                        prefill: p.decode,
                        ..p
                    }
                } else {
                    p
                })
            };
            let cpu = per_pass(&e.cpu_us)?;
            let gpu = match (&e.gpu_us, has_gpu) {
                (Some(t), true) => per_pass(t)?,
                _ => PerPass::default(),
            };
            let stream_us = match &model.link {
                None => 0.0,
                Some(l) => e
                    .stream_us
                    .filter(|t| t.is_finite() && *t >= 0.0)
                    .unwrap_or(l.latency_us + e.weight_bytes as f64 / (l.h2d_gbps * 1e3)),
            };
            let key = input_family(&e.kind).map(|family| (e.layer, family));
            let input_group = match groups.iter().position(|g| key.is_some() && *g == key) {
                Some(g) => g,
                None => {
                    groups.push(key);
                    groups.len() - 1
                }
            };
            model.ops.push(OpCost {
                op: e.op.clone(),
                tensor: e.tensor.clone(),
                layer: e.layer,
                weight_bytes: e.weight_bytes,
                cpu,
                gpu,
                input_copy: model.copy(e.in_bytes_per_token, Direction::DeviceToHost),
                output_copy: model.copy(e.out_bytes_per_token, Direction::HostToDevice),
                input_group,
                slot: crate::profiler::LAYER_KINDS
                    .iter()
                    .position(|k| *k == e.kind)
                    .unwrap_or(HEAD),
                shape_key: format!("{}|{}|{}|{}", e.kind, e.k, e.n, e.dtype),
                stream_us,
            });
        }
        if model.n_layer == 0 {
            model.n_layer = model
                .ops
                .iter()
                .filter_map(|o| o.layer)
                .max()
                .map_or(0, |l| l + 1);
        }
        Ok(model)
    }

    /// Operators of the same kind, shape and type share one cost: the median over the layers
    /// (DESIGN.md, "The OATO scheduler"), so measurement noise cannot scatter the plan.
    pub fn with_shared_costs(mut self) -> CostModel {
        let mut groups: BTreeMap<String, Vec<usize>> = BTreeMap::new();
        for (i, o) in self.ops.iter().enumerate() {
            groups.entry(o.shape_key.clone()).or_default().push(i);
        }
        let median = |mut v: Vec<f64>| {
            v.sort_by(f64::total_cmp);
            let m = v.len() / 2;
            if v.len() % 2 == 1 {
                v[m]
            } else {
                (v[m - 1] + v[m]) / 2.0
            }
        };
        for members in groups.values() {
            let pick = |f: &dyn Fn(&OpCost) -> f64| {
                median(members.iter().map(|&i| f(&self.ops[i])).collect())
            };
            let shared_cpu = PerPass {
                prefill: pick(&|o| o.cpu.prefill),
                decode: pick(&|o| o.cpu.decode),
            };
            let shared_gpu = PerPass {
                prefill: pick(&|o| o.gpu.prefill),
                decode: pick(&|o| o.gpu.decode),
            };
            for &i in members {
                self.ops[i].cpu = shared_cpu;
                self.ops[i].gpu = shared_gpu;
            }
        }
        self
    }

    /// The layers' placement inputs for `devices` (0 = CPU, 1 = GPU): each layer's attention on
    /// `attn[l]`; with `all_gpu`, every weight computes on the GPU (streamed ones too).
    fn layer_targets(
        &self,
        devices: &[Device],
        attn: &[Device],
        all_gpu: bool,
    ) -> (Vec<LayerTargets>, usize) {
        let id = |d: Device| {
            if all_gpu {
                1
            } else {
                (d == Device::Gpu) as usize
            }
        };
        let mut layers: Vec<LayerTargets> = (0..self.n_layer)
            .map(|l| LayerTargets {
                w: [0; N_SLOTS],
                attn: attn.get(l).map_or(0, |&d| (d == Device::Gpu) as usize),
                bias: std::array::from_fn(|i| self.biases.contains(&(l, i))),
                mla: self.mla,
                res_scale: self.res_scale,
            })
            .collect();
        let mut head = 0;
        for (op, &d) in self.ops.iter().zip(devices) {
            match op.layer {
                Some(l) if l < layers.len() && op.slot < N_SLOTS => layers[l].w[op.slot] = id(d),
                None => head = id(d),
                _ => {}
            }
        }
        (layers, head)
    }

    /// Time of one step on `n` tokens (`pass` picks the prefill or decode figure): a matmul
    /// group takes the longest of its devices' parts (they run at the same time, rule 6).
    fn step_us(
        &self,
        s: &Step,
        layer: Option<usize>,
        index: &BTreeMap<(Option<usize>, usize), usize>,
        prefill: bool,
    ) -> f64 {
        let pick = |p: PerPass| if prefill { p.prefill } else { p.decode };
        let nt = |d: usize, name: &str| {
            self.non_target[d.min(1)]
                .get(name)
                .map_or(0.0, |&p| pick(p))
        };
        match &s.op {
            OpKind::Matmul { parts } => parts
                .iter()
                .map(|(d, slots)| {
                    let ops: Vec<usize> = slots
                        .iter()
                        .filter_map(|&(sl, _)| index.get(&(layer, sl)).copied())
                        .collect();
                    let sum: f64 = ops
                        .iter()
                        .map(|&i| {
                            pick(if *d == 0 {
                                self.ops[i].cpu
                            } else {
                                self.ops[i].gpu
                            })
                        })
                        .sum();
                    // The CPU runs its part as one job: one job's fixed cost, not one each.
                    let joined = if *d == 0 {
                        ops.len().saturating_sub(1)
                    } else {
                        0
                    };
                    (sum - joined as f64 * self.job_us).max(0.0)
                })
                .fold(0.0, f64::max),
            OpKind::Embed => 0.0,
            OpKind::AttnNorm | OpKind::FfnNorm | OpKind::HeadNorm => nt(s.dev, "rms_norm"),
            // Latent attention's norms are over narrower rows than the profiled n_embd ones;
            // its column copies and the residual scale move as many bytes as an add or less.
            OpKind::QaNorm | OpKind::KvaNorm => nt(s.dev, "rms_norm"),
            OpKind::RopeKpe => nt(s.dev, "rope_k"),
            OpKind::MlaK | OpKind::MlaV | OpKind::AttnCompact | OpKind::ResidualScale => {
                nt(s.dev, "add")
            }
            OpKind::Bias(_) => nt(s.dev, "bias"),
            OpKind::RopeQ => nt(s.dev, "rope_q"),
            OpKind::RopeK => nt(s.dev, "rope_k"),
            OpKind::Attention => nt(s.dev, "attention"),
            OpKind::Residual => nt(s.dev, "add"),
            OpKind::Swiglu => nt(s.dev, "swiglu"),
        }
    }

    /// Predicted prefill and decode-step time of a placement, by costing the very steps the
    /// executor runs (`runtime::plan`): every operator on its device, the non-target operators
    /// placed by rule 2, each copy at the measured crossing cost, parts of a matmul group on
    /// different devices at the same time, the logits read back. `attn`: each layer's
    /// attention device. `streamed`: every weight computes on the GPU and the ones on `Cpu` are
    /// uploaded for each pass. `prefill_stream` (by operator; empty: none): CPU-resident
    /// weights computed on the GPU in the prefill, uploaded as `streamed` ones are (rule 5).
    /// Uploads are timed as the executor queues them (`runtime::forward`), by [`Pipeline`].
    /// Returns the times and the copies of the prefill and of a decode step.
    pub fn predict_plan(
        &self,
        devices: &[Device],
        attn: &[Device],
        streamed: bool,
        prefill_stream: &[bool],
    ) -> (PerPass, [usize; 2]) {
        let is_streamed = |i: usize, prefill: bool| {
            devices[i] == Device::Cpu
                && (streamed || (prefill && prefill_stream.get(i).copied().unwrap_or(false)))
        };
        let with_stream: Vec<Device> = (0..devices.len())
            .map(|i| {
                if is_streamed(i, true) {
                    Device::Gpu
                } else {
                    devices[i]
                }
            })
            .collect();
        let index: BTreeMap<(Option<usize>, usize), usize> = self
            .ops
            .iter()
            .enumerate()
            .map(|(i, o)| ((o.layer, o.slot), i))
            .collect();
        let mut out = PerPass::default();
        let mut crossings = [0usize; 2];
        for (k, (prefill, n_tok)) in [(true, self.prompt_tokens), (false, 1)]
            .into_iter()
            .enumerate()
        {
            let (layers, head_out) = if prefill {
                self.layer_targets(&with_stream, attn, streamed)
            } else {
                self.layer_targets(devices, attn, streamed)
            };
            let (devs, norm) =
                place_non_target(&layers, head_out, &self.widths, n_tok, &self.cross, 0, 0);
            let mut v = Validity::only(plan::Val::X, 0);
            let mut pipe = Pipeline::new(prefill);
            let run = |steps: Vec<Step>,
                       layer: Option<usize>,
                       v: &mut Validity,
                       crossings: &mut usize|
             -> f64 {
                let mut t = 0.0;
                for s in &steps {
                    v.run(s, |c| {
                        *crossings += 1;
                        t += self.cross.of(c, n_tok, &self.widths, 0);
                    });
                    t += self.step_us(s, layer, &index, prefill);
                }
                t
            };
            let upload = |layer: Option<usize>| -> f64 {
                (0..self.ops.len())
                    .filter(|&i| self.ops[i].layer == layer && is_streamed(i, prefill))
                    .map(|i| self.ops[i].stream_us)
                    .sum()
            };
            for (l, (t, d)) in layers.iter().zip(&devs).enumerate() {
                let steps = layer_steps(t, d, 0);
                let host = steps.iter().any(on_host);
                let compute = run(steps, Some(l), &mut v, &mut crossings[k]);
                pipe.layer(upload(Some(l)), compute, host);
            }
            let steps = head_steps(norm, head_out, 0);
            let host = steps.iter().any(on_host);
            let head = run(steps, None, &mut v, &mut crossings[k]);
            pipe.layer(upload(None), head, host);
            let mut total = pipe.done;
            if head_out != 0 {
                // The logits of the last token come back to the host for sampling.
                total += self.cross.copy_us(4 * self.widths.vocab, head_out, 0, 0);
            }
            if prefill {
                out.prefill = total;
            } else {
                out.decode = total;
            }
        }
        (out, crossings)
    }

    /// A placement's prediction with prefill streaming's choice when `stream` (rule 5): the
    /// times, the copies of a prefill and a decode step, the operators streamed (by operator;
    /// empty: none) and from how many tokens a batch streams (`usize::MAX`: none does).
    ///
    /// Per operator it streams when the copy plus the GPU's time is below the CPU's time at P
    /// (`min(Tc(P), stream + Tg(P))`); that choice, streaming every CPU-resident layer operator,
    /// and none are predicted as the executor runs them and the fastest prefill kept. The head
    /// never streams: a prompt batch computes one row of logits.
    pub fn predict_streaming(
        &self,
        devices: &[Device],
        attn: &[Device],
        stream: bool,
    ) -> (PerPass, [usize; 2], Vec<bool>, usize) {
        let none = self.predict_plan(devices, attn, false, &[]);
        if !stream || !self.has_gpu() || self.prompt_tokens < 2 {
            return (none.0, none.1, Vec::new(), usize::MAX);
        }
        let candidate = |i: usize| devices[i] == Device::Cpu && self.ops[i].layer.is_some();
        let per_op: Vec<bool> = (0..self.ops.len())
            .map(|i| {
                let o = &self.ops[i];
                candidate(i) && o.stream_us + o.gpu.prefill < o.cpu.prefill
            })
            .collect();
        let all: Vec<bool> = (0..self.ops.len()).map(candidate).collect();
        let mut best = (none, Vec::new());
        for c in [per_op, all] {
            if c.iter().any(|&b| b) {
                let p = self.predict_plan(devices, attn, false, &c);
                if p.0.prefill < best.0.0.prefill {
                    best = (p, c);
                }
            }
        }
        let ((pass, copies), chosen) = best;
        if chosen.is_empty() {
            return (pass, copies, chosen, usize::MAX);
        }
        // The smallest batch at which the chosen operators are faster streamed, their times
        // linear between the decode (1 token) and prefill (P tokens) figures.
        let p = self.prompt_tokens as f64;
        let at = |t: PerPass, n: f64| t.decode + (t.prefill - t.decode) * (n - 1.0) / (p - 1.0);
        let min_tokens = (2..=self.prompt_tokens)
            .find(|&n| {
                let (mut cpu, mut gpu) = (0.0, 0.0);
                for (o, _) in self.ops.iter().zip(&chosen).filter(|(_, c)| **c) {
                    cpu += at(o.cpu, n as f64);
                    gpu += o.stream_us + at(o.gpu, n as f64);
                }
                gpu < cpu
            })
            .unwrap_or(self.prompt_tokens);
        (pass, copies, chosen, min_tokens)
    }

    /// The link part of placing operator `i` on the CPU rather than the GPU under `devices`
    /// (`ΔX_i(π)` of the improved `oato` policy), over the workload: the difference in the
    /// copies' cost of its layer (or the head), each placed by rule 2, less what it saves by
    /// joining a CPU job of its input's partners ([`CostModel::job_share`]).
    /// The layer's attention is on the GPU (as under `oato`).
    pub fn link_delta(&self, i: usize, devices: &[Device]) -> f64 {
        if !self.has_gpu() {
            return 0.0;
        }
        let op = &self.ops[i];
        let attn = 1;
        let mut t = LayerTargets {
            w: [attn; N_SLOTS],
            attn,
            bias: [false; 3],
            mla: self.mla,
            res_scale: self.res_scale,
        };
        let mut head_out = attn;
        for (o, &d) in self.ops.iter().zip(devices) {
            if o.layer == op.layer {
                match o.layer {
                    Some(_) if o.slot < N_SLOTS => t.w[o.slot] = (d == Device::Gpu) as usize,
                    None => head_out = (d == Device::Gpu) as usize,
                    _ => {}
                }
            }
        }
        let cost = |t: &LayerTargets, head_out: usize, n_tok: usize| -> f64 {
            // The layer alone, the residual stream arriving at and leaving for the attention
            // device (the neighbouring layers' attention).
            let layers: Vec<LayerTargets> = if op.layer.is_some() { vec![*t] } else { vec![] };
            let (devs, norm) =
                place_non_target(&layers, head_out, &self.widths, n_tok, &self.cross, 0, attn);
            let mut v = Validity::only(plan::Val::X, attn);
            let mut total = 0.0;
            let steps: Vec<Step> = match op.layer {
                Some(_) => layer_steps(t, &devs[0], 0),
                None => head_steps(norm, head_out, 0),
            };
            for s in &steps {
                v.run(s, |c| total += self.cross.of(c, n_tok, &self.widths, 0));
            }
            if op.layer.is_some() && !v.on(plan::Val::X, attn) {
                total += self.cross.copy_us(
                    4 * n_tok * self.widths.embd,
                    v.source(plan::Val::X).unwrap_or(0),
                    attn,
                    0,
                );
            }
            total
        };
        let on = |dev: usize| {
            let mut t2 = t;
            let mut h2 = head_out;
            match op.layer {
                Some(_) => t2.w[op.slot] = dev,
                None => h2 = dev,
            }
            cost(&t2, h2, self.prompt_tokens) + self.gen_tokens * cost(&t2, h2, 1)
        };
        on(0) - on(1) - self.job_share(i, devices)
    }

    /// What operator `i` saves on the CPU under `devices` by joining the job of another CPU
    /// operator that reads its input (q/k/v, gate/up: one job's fixed cost, `job_us`), over the
    /// workload; the prefill's share only when prefills are not streamed (then the CPU's
    /// operators may run on the GPU in prefill).
    pub fn job_share(&self, i: usize, devices: &[Device]) -> f64 {
        let op = &self.ops[i];
        let partner = op.layer.is_some()
            && self
                .ops
                .iter()
                .zip(devices)
                .enumerate()
                .any(|(j, (o, &d))| j != i && d == Device::Cpu && o.input_group == op.input_group);
        if !partner {
            return 0.0;
        }
        let passes = self.gen_tokens + if self.stream_prefill { 0.0 } else { 1.0 };
        passes * self.job_us
    }

    /// GPU info, link and every operator's GPU timings are present.
    pub fn has_gpu(&self) -> bool {
        self.link.is_some()
    }

    /// Link time of `bytes_per_token` for each pass (zero without a link):
    /// `latency + bytes / (gbps * 1e3)` microseconds.
    fn copy(&self, bytes_per_token: u64, direction: Direction) -> PerPass {
        let Some(link) = &self.link else {
            return PerPass::default();
        };
        let gbps = match direction {
            Direction::HostToDevice => link.act_h2d(),
            Direction::DeviceToHost => link.d2h_gbps,
        };
        let one =
            |tokens: usize| link.latency_us + bytes_per_token as f64 * tokens as f64 / (gbps * 1e3);
        PerPass {
            prefill: one(self.prompt_tokens),
            decode: one(1),
        }
    }

    pub fn total_target_bytes(&self) -> u64 {
        self.ops.iter().map(|o| o.weight_bytes).sum()
    }

    /// `ΔX_i(π)`: the link time placing operator `i` on the CPU costs over the GPU, over the
    /// workload, given the others' devices in `placement` (`None`: round one, `ΔX = 0`). Its
    /// output always crosses back; its input crosses unless an operator that reads the same
    /// activation is already on the CPU.
    pub fn transfer_penalty(&self, i: usize, placement: Option<&[Device]>) -> f64 {
        let Some(devices) = placement else {
            return 0.0;
        };
        let op = &self.ops[i];
        let input_shared = self
            .ops
            .iter()
            .zip(devices)
            .enumerate()
            .any(|(j, (other, &d))| {
                j != i && other.input_group == op.input_group && d == Device::Cpu
            });
        let input = if input_shared {
            0.0
        } else {
            op.input_copy.total(self.gen_tokens)
        };
        input + op.output_copy.total(self.gen_tokens)
    }

    /// `B_i = (Tc_i - Tg_i + ΔX_i(π)) / M_i` in microseconds per byte for every operator.
    /// Without GPU timings every benefit is 0.
    pub fn benefits(&self, placement: Option<&[Device]>) -> Vec<f64> {
        if !self.has_gpu() {
            return vec![0.0; self.ops.len()];
        }
        let g = self.gen_tokens;
        (0..self.ops.len())
            .map(|i| {
                let op = &self.ops[i];
                let mut cpu = op.cpu;
                if self.stream_prefill && op.layer.is_some() {
                    // Rule 5: on the CPU, its prefill may be streamed to the GPU instead.
                    cpu.prefill = cpu.prefill.min(op.stream_us + op.gpu.prefill);
                }
                (cpu.total(g) - op.gpu.total(g) + self.transfer_penalty(i, placement))
                    / op.weight_bytes as f64
            })
            .collect()
    }

    /// The paper's own estimate (`oato-paper` scores its rounds by it): every operator on its device,
    /// the non-target operators on the GPU when any target operator is there, and the link
    /// copies of the CPU-placed operators (a shared input copied once).
    pub fn predict_paper(&self, devices: &[Device]) -> PerPass {
        let mut pass = PerPass::default();
        for (op, &d) in self.ops.iter().zip(devices) {
            pass.add(match d {
                Device::Gpu => op.gpu,
                Device::Cpu => op.cpu,
            });
        }
        if !devices.contains(&Device::Gpu) {
            return pass;
        }
        let mut group_input: Vec<PerPass> = Vec::new();
        for (op, &d) in self.ops.iter().zip(devices) {
            if d != Device::Cpu {
                continue;
            }
            pass.add(op.output_copy);
            if group_input.len() <= op.input_group {
                group_input.resize(op.input_group + 1, PerPass::default());
            }
            group_input[op.input_group] = group_input[op.input_group].max(op.input_copy);
        }
        for copy in group_input {
            pass.add(copy);
        }
        pass
    }

    /// Stages in execution order: each layer's operators (by index), then the head's.
    pub(crate) fn stages(&self) -> Vec<Vec<usize>> {
        let mut order: Vec<usize> = (0..self.ops.len()).collect();
        order.sort_by_key(|&i| (self.ops[i].layer.is_none(), self.ops[i].layer, i));
        let mut stages: Vec<Vec<usize>> = Vec::new();
        for i in order {
            match stages.last_mut() {
                Some(s) if self.ops[s[0]].layer == self.ops[i].layer => s.push(i),
                _ => stages.push(vec![i]),
            }
        }
        stages
    }
}

/// GPU memory held besides the target weights when the GPU is in use (placement rule 2).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct Reservations {
    pub kv_bytes: u64,
    pub workspace_bytes: u64,
    pub other_weight_bytes: u64,
    /// flexgen: room for two layers of streamed weights (the one computing, the next).
    pub stream_bytes: u64,
}

impl Reservations {
    pub fn for_request(profile: &Profile, req: &PlanRequest) -> Reservations {
        Reservations {
            kv_bytes: profile
                .model
                .kv_bytes_per_token
                .saturating_mul(req.ctx_tokens as u64),
            workspace_bytes: workspace_bytes(profile, req.prompt_tokens),
            other_weight_bytes: profile.model.other_weight_bytes,
            stream_bytes: if req.streams() {
                prefill_stream_bytes(profile)
            } else {
                0
            },
        }
    }

    pub fn total(&self) -> u64 {
        self.kv_bytes
            .saturating_add(self.workspace_bytes)
            .saturating_add(self.other_weight_bytes)
            .saturating_add(self.stream_bytes)
    }

    /// The named parts, for messages.
    pub fn parts(&self, ctx_tokens: usize) -> Vec<(String, u64)> {
        let mut v = vec![
            (format!("KV cache for {ctx_tokens} tokens"), self.kv_bytes),
            ("workspace".to_string(), self.workspace_bytes),
            ("non-target weights".to_string(), self.other_weight_bytes),
        ];
        if self.stream_bytes > 0 {
            v.push(("two streamed layers".to_string(), self.stream_bytes));
        }
        v
    }
}

/// Whether the host takes part in step `s` (device 0 is the CPU): it computes there, so it
/// waits for the step's inputs and queues nothing meanwhile.
fn on_host(s: &Step) -> bool {
    match &s.op {
        OpKind::Matmul { parts } => parts.iter().any(|p| p.0 == 0),
        _ => s.dev == 0,
    }
}

/// One pass's timeline with streamed weights, as the executor (`runtime::forward`) queues their
/// copies: the copy stream runs the uploads back to back in layer order, each from the moment
/// the host queues it (in a prefill, layer l + 1's when the host starts layer l; in a streamed
/// decode, when the host has queued layer l), and a layer's work starts when the previous
/// layer's is done and its own weights are in. The host runs ahead of the GPU's queue except
/// in a layer with a step of its own (a CPU step waits for its inputs), which it leaves when
/// that layer is done. A pass without uploads is the sum of its layers' times.
pub(crate) struct Pipeline {
    prefill: bool,
    /// When the copies queued so far are done.
    copies: f64,
    /// When the last layer's work is done.
    pub(crate) done: f64,
    /// When the host started the last layer, and when it left it (0 before the first: its
    /// copies are queued at the start).
    host_start: f64,
    host_end: f64,
}

impl Pipeline {
    pub(crate) fn new(prefill: bool) -> Pipeline {
        Pipeline {
            prefill,
            copies: 0.0,
            done: 0.0,
            host_start: 0.0,
            host_end: 0.0,
        }
    }

    /// The next layer (or the head): `upload` us of its weights' copies, `compute` us of work,
    /// `host`: a step of it runs on the host.
    pub(crate) fn layer(&mut self, upload: f64, compute: f64, host: bool) {
        let queued = if self.prefill {
            self.host_start
        } else {
            self.host_end
        };
        let start = if upload > 0.0 {
            self.copies = self.copies.max(queued) + upload;
            self.done.max(self.copies)
        } else {
            self.done
        };
        self.done = start + compute;
        self.host_start = self.host_end;
        if host {
            self.host_end = self.done;
        }
    }
}

/// Room for prefill streaming (rule 5): two layers' target weights (the layer computing and the
/// next, whose copies are under way), the largest layer's.
pub(crate) fn prefill_stream_bytes(profile: &Profile) -> u64 {
    let mut per_layer: BTreeMap<usize, u64> = BTreeMap::new();
    for o in &profile.operators {
        if let Some(l) = o.layer {
            *per_layer.entry(l).or_default() += o.weight_bytes;
        }
    }
    2 * per_layer.values().copied().max().unwrap_or(0)
}

/// The workspace the GPU needs: the f16 dequantisation buffer of the prefill GEMM (the largest
/// weight, or one slice of `GEMM_SLICE_BYTES` when it is larger: the backend dequantises big
/// matrices a slice at a time) plus f32 activations for the prompt batch,
/// `4 P (4 n_embd + 2 n_ff + n_vocab)`.
/// The activations' widths, from the profile's operator shapes (and its model section).
fn profile_widths(profile: &Profile) -> Widths {
    let ops = &profile.operators;
    let find = |kind: &str| ops.iter().find(|o| o.kind == kind);
    let embd = match profile.model.n_embd {
        0 => find("attn_q").map_or(0, |o| o.k),
        n => n,
    };
    // Latent attention (MiniCPM3): its projections' shapes give its activations' widths; the
    // keys and (padded) values are as wide as the queries.
    let mla = find("attn_q_a").is_some();
    let q = find("attn_q").or(find("attn_q_b")).map_or(embd, |o| o.n);
    let n_of = |kind: &str| find(kind).map_or(0, |o| o.n);
    Widths {
        embd,
        q,
        kv: if mla {
            q
        } else {
            find("attn_k").map_or(embd, |o| o.n)
        },
        ff: find("ffn_up").map_or(embd, |o| o.n),
        vocab: match profile.model.n_vocab {
            0 => find("output").map_or(0, |o| o.n),
            n => n,
        },
        att: find("attn_output").map_or(q, |o| o.k),
        q_lora: n_of("attn_q_a"),
        kv_a: n_of("attn_kv_a_mqa"),
        kv_lora: find("attn_kv_b").map_or(0, |o| o.k),
        kv_b: n_of("attn_kv_b"),
    }
}

pub(crate) fn workspace_bytes(profile: &Profile, prompt_tokens: usize) -> u64 {
    let ops = &profile.operators;
    let largest_weight = ops
        .iter()
        .map(|o| (o.k as u64).saturating_mul(o.n as u64))
        .max()
        .unwrap_or(0);
    let n_embd = match profile.model.n_embd {
        0 => ops
            .iter()
            .find(|o| o.kind == "attn_q")
            .map_or(0, |o| o.k as u64),
        n => n as u64,
    };
    let n_ff = ops
        .iter()
        .filter(|o| o.kind == "ffn_up")
        .map(|o| o.n as u64)
        .max()
        .unwrap_or(0);
    let n_vocab = match profile.model.n_vocab {
        0 => ops
            .iter()
            .find(|o| o.kind == "output")
            .map_or(0, |o| o.n as u64),
        n => n as u64,
    };
    let latent = profile_widths(profile).latent_extra() as u64;
    workspace_for(largest_weight, n_embd, n_ff, n_vocab, prompt_tokens)
        .saturating_add((4 * prompt_tokens as u64).saturating_mul(latent))
}

/// [`workspace_bytes`] from the shapes: the largest weight's k×n, the widths, the prompt length.
pub fn workspace_for(
    largest_kn: u64,
    n_embd: u64,
    n_ff: u64,
    n_vocab: u64,
    prompt_tokens: usize,
) -> u64 {
    // f32 per token: the hidden state and attention buffers, the FFN's gate and up, the logits;
    // then the two f16 copies of the widest GEMM input (plain, and rounded to 8 bits). A model
    // whose GEMM inputs feed only quantised weights has no plain copy, and the int8 GEMM's Q8_1
    // quants and scales of that input (1.25 bytes an element) fit in its room. Last the
    // tensor-core GEMM's split-K partial sums: at most MMQ_MAX_SPLITS f32 parts of the widest
    // output, never more than MMQ_PART_BYTES (the backend cuts its splits to that). (The backend
    // allocates each scratch in whole MiB; like the others, this is counted unrounded.)
    let activations = 4 * n_embd + 2 * n_ff + n_vocab + n_ff.max(n_embd);
    let widest = n_embd.max(n_ff).max(n_vocab);
    let partials = (4 * MMQ_MAX_SPLITS as u64 * prompt_tokens as u64)
        .saturating_mul(widest)
        .min(MMQ_PART_BYTES as u64);
    largest_kn
        .saturating_mul(2)
        .min(GEMM_SLICE_BYTES as u64)
        .saturating_add((4 * prompt_tokens as u64).saturating_mul(activations))
        .saturating_add(partials)
}

/// What the weights may take on the GPU, and the budget as reported.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct WeightCap {
    pub vram_budget_bytes: u64,
    pub cap_bytes: u64,
    pub notes: Vec<String>,
}

/// `cap` from the budget (DESIGN.md, "Budget"): with bytes, `0.90 × (min(budget, free) -
/// reserved)`, refused when nothing is left; with a percentage, that share of `target_bytes`,
/// the budget reported being `reserved + cap / 0.90`, refused only past the GPU's total memory.
/// `reserved` names each reservation for the messages.
pub(crate) fn weight_cap(
    budget: Budget,
    reserved: &[(String, u64)],
    target_bytes: u64,
    gpu: &GpuInfo,
) -> Result<WeightCap> {
    let reserved_total: u64 = reserved.iter().map(|r| r.1).sum();
    let itemised = || {
        let items: Vec<String> = reserved
            .iter()
            .map(|(n, b)| format!("{n} {}", mib(*b)))
            .collect();
        format!("{} = {}", items.join(" + "), mib(reserved_total))
    };
    match budget {
        Budget::Bytes(bytes) => {
            let usable = bytes.min(gpu.free_bytes);
            let mut notes = Vec::new();
            if bytes > gpu.free_bytes {
                notes.push(format!(
                    "the budget {} exceeds the GPU's free memory {}; planned within the free memory",
                    mib(bytes),
                    mib(gpu.free_bytes)
                ));
            }
            if usable <= reserved_total {
                let free = if bytes > gpu.free_bytes {
                    format!(" (the GPU has {} free)", mib(gpu.free_bytes))
                } else {
                    String::new()
                };
                return Err(Error::Usage(format!(
                    "--vram-budget {}{free} leaves no room for weights after the reservations: {}",
                    mib(bytes),
                    itemised()
                )));
            }
            Ok(WeightCap {
                vram_budget_bytes: bytes,
                cap_bytes: (CAP_FRACTION * (usable - reserved_total) as f64).floor() as u64,
                notes,
            })
        }
        Budget::Percent(pct) => {
            check_percent(pct)?;
            let cap_bytes = (pct / 100.0 * target_bytes as f64).floor() as u64;
            let needed = reserved_total.saturating_add(cap_bytes);
            if needed > gpu.total_bytes {
                return Err(Error::Usage(format!(
                    "--vram-budget {pct}%: {} of weights plus the reservations ({}) exceed the GPU's \
                     memory {}",
                    mib(cap_bytes),
                    itemised(),
                    mib(gpu.total_bytes)
                )));
            }
            let mut notes = Vec::new();
            let mut cap_bytes = cap_bytes;
            // Never more than the device's free memory, whatever the budget (DESIGN.md): the cap
            // is at most what a byte budget of all the free memory would give.
            if gpu.free_bytes <= reserved_total {
                return Err(Error::Usage(format!(
                    "--vram-budget {pct}%: the GPU's free memory {} leaves no room for weights \
                     after the reservations: {}",
                    mib(gpu.free_bytes),
                    itemised()
                )));
            }
            let fits = (CAP_FRACTION * (gpu.free_bytes - reserved_total) as f64).floor() as u64;
            if cap_bytes > fits {
                notes.push(format!(
                    "reservations {} + {pct}% of the weights ({}) go past 90% of the GPU's free \
                     memory {} after the reservations; cap clamped to {}",
                    mib(reserved_total),
                    mib(cap_bytes),
                    mib(gpu.free_bytes),
                    mib(fits)
                ));
                cap_bytes = fits;
            }
            Ok(WeightCap {
                vram_budget_bytes: reserved_total
                    .saturating_add((cap_bytes as f64 / CAP_FRACTION).round() as u64),
                cap_bytes,
                notes,
            })
        }
    }
}

pub(crate) fn check_percent(pct: f64) -> Result<()> {
    if pct.is_finite() && pct > 0.0 && pct <= 100.0 {
        Ok(())
    } else {
        Err(Error::Usage(format!(
            "--vram-budget {pct}%: a percentage must be above 0 and at most 100"
        )))
    }
}

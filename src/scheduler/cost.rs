//! The cost model every policy shares: each target operator's time on both devices at the
//! workload's batch sizes, the link time of the activations it moves when it runs on the CPU while
//! the rest runs on the GPU (placement rule 2), predicted TTFT/TPOT, and the GPU memory reserved
//! before any weight is placed (DESIGN.md, "Budget").

use crate::error::{Error, Result};
use crate::profiler::profile::{GpuInfo, LinkInfo, Profile, time_at};
use crate::runtime::cuda_backend::GEMM_SLICE_BYTES;

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
    pub in_bytes_per_token: u64,
    /// GPU→CPU copy of the operator's input activation.
    pub input_copy: PerPass,
    /// CPU→GPU copy of its output activation.
    pub output_copy: PerPass,
    /// Operators with the same group read the same activation (q/k/v, gate/up of one layer) and
    /// share one input copy (placement rule 4).
    pub input_group: usize,
}

impl OpCost {
    /// Time on `device`.
    fn time_on(&self, device: Device) -> PerPass {
        match device {
            Device::Gpu => self.gpu,
            Device::Cpu => self.cpu,
        }
    }
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
}

/// Which activation an operator reads, for the shared-copy rule: q/k/v of a layer read one, gate
/// and up read another; every other operator reads its own.
fn input_family(kind: &str) -> Option<&'static str> {
    match kind {
        "attn_q" | "attn_k" | "attn_v" => Some("attn_in"),
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
                })
            }
            _ => None,
        };
        let mut model = CostModel {
            ops: Vec::with_capacity(profile.operators.len()),
            gen_tokens: req.gen_tokens as f64,
            prompt_tokens: req.prompt_tokens,
            link,
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
            let cpu = per_pass(&e.cpu_us)?;
            let gpu = match (&e.gpu_us, has_gpu) {
                (Some(t), true) => per_pass(t)?,
                _ => PerPass::default(),
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
                in_bytes_per_token: e.in_bytes_per_token,
                input_copy: model.copy(e.in_bytes_per_token, Direction::DeviceToHost),
                output_copy: model.copy(e.out_bytes_per_token, Direction::HostToDevice),
                input_group,
            });
        }
        Ok(model)
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
            Direction::HostToDevice => link.h2d_gbps,
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
                (op.cpu.total(g) - op.gpu.total(g) + self.transfer_penalty(i, placement))
                    / op.weight_bytes as f64
            })
            .collect()
    }

    /// Predicted prefill (TTFT) and decode-step (TPOT) time with every operator on its device,
    /// the non-target operators on the GPU when any target operator is there, and the link
    /// copies of the CPU-placed operators (a shared input copied once).
    pub fn predict(&self, devices: &[Device]) -> PerPass {
        let mut pass = PerPass::default();
        for (op, &d) in self.ops.iter().zip(devices) {
            pass.add(op.time_on(d));
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

    /// Predicted times when every operator computes on the GPU and the non-resident weights
    /// (`Device::Cpu`) are uploaded for each pass, one stage (a layer, then the head)
    /// overlapping its upload with its compute (placement rule 5): a stage costs the longer.
    pub fn predict_streamed(&self, resident: &[Device]) -> PerPass {
        let mut pass = PerPass::default();
        for stage in self.stages() {
            let mut compute = PerPass::default();
            let mut streamed_bytes = 0u64;
            for &i in &stage {
                compute.add(self.ops[i].time_on(Device::Gpu));
                if resident[i] == Device::Cpu {
                    streamed_bytes += self.ops[i].weight_bytes;
                }
            }
            let upload = match &self.link {
                Some(l) if streamed_bytes > 0 => {
                    l.latency_us + streamed_bytes as f64 / (l.h2d_gbps * 1e3)
                }
                _ => 0.0,
            };
            pass.add(PerPass {
                prefill: compute.prefill.max(upload),
                decode: compute.decode.max(upload),
            });
        }
        pass
    }

    /// Predicted times for a split by whole layers: every operator on its device, and one copy
    /// of the hidden state (the input of the first operator on the new device) each time
    /// execution moves between devices, layers in order and the head last.
    pub fn predict_layer_split(&self, devices: &[Device]) -> PerPass {
        let mut pass = PerPass::default();
        let mut previous: Option<Device> = None;
        for i in self.stages().into_iter().flatten() {
            let (op, d) = (&self.ops[i], devices[i]);
            if previous.is_some_and(|p| p != d) {
                let direction = match d {
                    Device::Gpu => Direction::HostToDevice,
                    Device::Cpu => Direction::DeviceToHost,
                };
                pass.add(self.copy(op.in_bytes_per_token, direction));
            }
            pass.add(op.time_on(d));
            previous = Some(d);
        }
        pass
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
            stream_bytes: 0,
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

/// The workspace the GPU needs: the f16 dequantisation buffer of the prefill GEMM (the largest
/// weight, or one slice of `GEMM_SLICE_BYTES` when it is larger: the backend dequantises big
/// matrices a slice at a time) plus f32 activations for the prompt batch,
/// `4 P (4 n_embd + 2 n_ff + n_vocab)`.
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
    workspace_for(largest_weight, n_embd, n_ff, n_vocab, prompt_tokens)
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
    // then the two f16 copies of the widest GEMM input (plain, and rounded to 8 bits).
    let activations = 4 * n_embd + 2 * n_ff + n_vocab + n_ff.max(n_embd);
    largest_kn
        .saturating_mul(2)
        .min(GEMM_SLICE_BYTES as u64)
        .saturating_add((4 * prompt_tokens as u64).saturating_mul(activations))
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

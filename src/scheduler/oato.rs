//! The OATO iteration (DESIGN.md, "The OATO scheduler"; the paper's Algorithm 1): benefit per
//! byte with the link correction of the previous round's placement, min-max affinity, order, and
//! the fill that stops at the first operator that does not fit; repeated until the order stops
//! changing, a cycle shows, or 50 rounds pass.

use crate::error::Result;
use crate::profiler::profile::Profile;

use super::cost::{CAP_FRACTION, CostModel, PerPass, Reservations, mib, weight_cap};
use super::placement::{BudgetReport, Device, Placement};
use super::{PlanParts, PlanRequest, Policy, gpu_info};

/// The most rounds computed before keeping the best placement seen.
pub const MAX_ROUNDS: usize = 50;

/// The operators ranked by affinity for one round.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Ranking {
    /// Operator indices, best first.
    pub order: Vec<usize>,
    /// `B_i` in microseconds per byte, by operator index.
    pub benefits: Vec<f64>,
    /// `G_i` in [0, 1], by operator index.
    pub affinities: Vec<f64>,
}

impl Ranking {
    /// Benefits with the transfer correction for `placement` (`None`: round one, no
    /// correction), affinities, and the order: affinity descending, ties by tensor name.
    pub fn new(model: &CostModel, placement: Option<&[Device]>) -> Ranking {
        Self::with(model, placement, false)
    }

    /// `improved` (the `oato` policy): ΔX is what the crossings of the operator's layer cost
    /// under rule 2 (`CostModel::link_delta`), and ties in affinity go to the operator whose
    /// GPU placement saves more link time. Otherwise the paper's (`oato-paper`).
    pub fn with(model: &CostModel, placement: Option<&[Device]>, improved: bool) -> Ranking {
        let (benefits, deltas) = if improved && model.has_gpu() {
            let g = model.gen_tokens;
            let deltas: Vec<f64> = (0..model.ops.len())
                .map(|i| placement.map_or(0.0, |p| model.link_delta(i, p)))
                .collect();
            let b = model
                .ops
                .iter()
                .zip(&deltas)
                .map(|(o, dx)| (o.cpu.total(g) - o.gpu.total(g) + dx) / o.weight_bytes as f64)
                .collect();
            (b, deltas)
        } else {
            (model.benefits(placement), vec![0.0; model.ops.len()])
        };
        let affinities = affinities(&benefits);
        let mut order: Vec<usize> = (0..model.ops.len()).collect();
        order.sort_by(|&a, &b| {
            affinities[b]
                .total_cmp(&affinities[a])
                .then_with(|| deltas[b].total_cmp(&deltas[a]))
                .then_with(|| model.ops[a].tensor.cmp(&model.ops[b].tensor))
        });
        Ranking {
            order,
            benefits,
            affinities,
        }
    }
}

/// Min-max normalised benefits: `(B_i - B_min) / (B_max - B_min)`, all 1.0 when they are equal.
pub(crate) fn affinities(benefits: &[f64]) -> Vec<f64> {
    let min = benefits.iter().copied().fold(f64::INFINITY, f64::min);
    let max = benefits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let range = max - min;
    benefits
        .iter()
        .map(|&b| if range > 0.0 { (b - min) / range } else { 1.0 })
        .collect()
}

/// How one item fared in a [`Fill`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Fit<const N: usize> {
    /// Taken: the cumulative bytes with it, against each cap.
    Fits([u64; N]),
    /// The first item that did not fit: the cumulative bytes it would have made. The fill stops.
    FirstMisfit([u64; N]),
    /// Not tried: an earlier item did not fit.
    AfterStop,
}

/// The fill every policy shares: items are offered in order and taken while the cumulative bytes
/// stay within every one of the `N` caps (the weight cap; for `layer-split` also the GPU's free
/// memory); the first that does not fit stops it, and it and every later item are left out.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Fill<const N: usize> {
    caps: [u64; N],
    /// The cumulative bytes taken so far, against each cap.
    pub used: [u64; N],
    stopped: bool,
}

impl<const N: usize> Fill<N> {
    pub fn new(caps: [u64; N]) -> Fill<N> {
        Fill {
            caps,
            used: [0; N],
            stopped: false,
        }
    }

    /// Offers an item that takes `bytes` against each cap.
    pub fn offer(&mut self, bytes: [u64; N]) -> Fit<N> {
        if self.stopped {
            return Fit::AfterStop;
        }
        let cum: [u64; N] = std::array::from_fn(|k| self.used[k].saturating_add(bytes[k]));
        if cum.iter().zip(&self.caps).all(|(c, cap)| c <= cap) {
            self.used = cum;
            Fit::Fits(cum)
        } else {
            self.stopped = true;
            Fit::FirstMisfit(cum)
        }
    }
}

/// OATO's fill: walk the order, put each operator on the GPU while the cumulative weight bytes
/// stay within `cap_bytes`; at the first that does not fit stop, leaving it and all after it on
/// the CPU. An operator whose benefit is not positive stays on the CPU (and is not offered).
/// Returns each operator's device and the rule that placed it, by operator index.
pub(crate) fn fill(
    model: &CostModel,
    ranking: &Ranking,
    cap_bytes: u64,
) -> (Vec<Device>, Vec<String>) {
    let n = model.ops.len();
    let mut devices = vec![Device::Cpu; n];
    let mut rules = vec![String::new(); n];
    let mut walk = Fill::new([cap_bytes]);
    for &i in &ranking.order {
        let positive = ranking.benefits[i] > 0.0; // NaN is not positive
        rules[i] = if !positive {
            "benefit ≤ 0".to_string()
        } else {
            match walk.offer([model.ops[i].weight_bytes]) {
                Fit::Fits([cum]) => {
                    devices[i] = Device::Gpu;
                    format!("fits (cum {} ≤ cap)", mib(cum))
                }
                Fit::FirstMisfit([cum]) => format!("first misfit (cum {} > cap): stop", mib(cum)),
                Fit::AfterStop => "after stop".to_string(),
            }
        };
    }
    (devices, rules)
}

/// One round: its ranking, the placement its fill gave, and that placement's predicted times.
#[derive(Clone, Debug)]
pub(crate) struct Round {
    pub ranking: Ranking,
    pub devices: Vec<Device>,
    pub rules: Vec<String>,
    pub predicted: PerPass,
}

impl Round {
    fn new(
        model: &CostModel,
        previous: Option<&[Device]>,
        cap_bytes: u64,
        improved: bool,
    ) -> Round {
        let ranking = Ranking::with(model, previous, improved);
        let (devices, rules) = fill(model, &ranking, cap_bytes);
        let predicted = if improved {
            predict_resident(model, &devices)
        } else {
            model.predict_paper(&devices)
        };
        Round {
            ranking,
            devices,
            rules,
            predicted,
        }
    }

    /// The whole workload's predicted time, TTFT + G × TPOT, in microseconds.
    fn score(&self, gen_tokens: f64) -> f64 {
        self.predicted.total(gen_tokens)
    }
}

/// What the iteration ended with.
#[derive(Clone, Debug)]
pub(crate) struct Outcome {
    /// Every round computed, in order.
    pub rounds: Vec<Round>,
    /// Index into `rounds` of the placement kept.
    pub kept: usize,
    /// How it ended, for the notes: `None` when the order converged.
    pub note: Option<String>,
}

/// Rounds until the order repeats the previous round's (converged: keep that placement), repeats
/// an earlier one (a cycle) or `MAX_ROUNDS` pass (then keep the visited placement with the lowest
/// predicted time, the earliest on a tie).
pub(crate) fn iterate(model: &CostModel, cap_bytes: u64, improved: bool) -> Outcome {
    let mut rounds = vec![Round::new(model, None, cap_bytes, improved)];
    let best = |rounds: &[Round]| {
        let mut kept = 0;
        for (i, r) in rounds.iter().enumerate() {
            if r.score(model.gen_tokens) < rounds[kept].score(model.gen_tokens) {
                kept = i;
            }
        }
        kept
    };
    loop {
        if rounds.len() >= MAX_ROUNDS {
            let kept = best(&rounds);
            let note = format!(
                "the order did not settle in {MAX_ROUNDS} rounds; kept round {}, the lowest \
                 predicted time",
                kept + 1
            );
            return Outcome {
                rounds,
                kept,
                note: Some(note),
            };
        }
        let previous = &rounds[rounds.len() - 1];
        let next = Round::new(model, Some(&previous.devices), cap_bytes, improved);
        let converged = next.ranking.order == previous.ranking.order;
        let repeats = rounds[..rounds.len() - 1]
            .iter()
            .position(|r| r.ranking.order == next.ranking.order);
        rounds.push(next);
        if converged {
            let kept = rounds.len() - 1;
            return Outcome {
                rounds,
                kept,
                note: None,
            };
        }
        if let Some(earlier) = repeats {
            let kept = best(&rounds);
            let note = format!(
                "the order cycles (round {} repeats round {}); kept round {}, the lowest \
                 predicted time",
                rounds.len(),
                earlier + 1,
                kept + 1
            );
            return Outcome {
                rounds,
                kept,
                note: Some(note),
            };
        }
    }
}

/// The improved policy's last step, a local search on the predicted time that the per-operator
/// ranking cannot make: an operator alone on the CPU among those that read its input (ffn_up
/// with its layer's ffn_gate on the GPU) takes a partner of the same shape and type along, and a
/// lone CPU operator of that shape and type in another layer goes to the GPU in its place. The
/// bytes on each device stay the same; what changes is the CPU's jobs (one fixed cost,
/// `CostModel::job_us`, instead of two), the crossings (one pair of copies fewer) and the
/// GPU's work beside the CPU's (a lone CPU operator's partner runs on the GPU at the same
/// time). A swap is made when it lowers the predicted workload time, the first such swap each
/// time, until none does. Returns the swaps made.
pub(crate) fn pair_cpu_operators(model: &CostModel, devices: &mut [Device]) -> usize {
    let n = devices.len();
    let score = |d: &[Device]| predict_resident(model, d).total(model.gen_tokens);
    let shape = |i: usize| {
        let o = &model.ops[i];
        // "kind|k|n|dtype" without the kind: gate and up of one layer share a shape.
        o.shape_key.split_once('|').map_or("", |(_, rest)| rest)
    };
    // Each operator's partners: the others that read its input.
    let members: Vec<Vec<usize>> = (0..n)
        .map(|i| {
            (0..n)
                .filter(|&j| j != i && model.ops[j].input_group == model.ops[i].input_group)
                .collect()
        })
        .collect();
    let alone = |d: &[Device], i: usize| {
        d[i] == Device::Cpu
            && model.ops[i].layer.is_some()
            && members[i].iter().all(|&j| d[j] == Device::Gpu)
    };
    let mut best = score(devices);
    let mut swaps = 0;
    while swaps < n {
        let mut found = None;
        'search: for a in (0..n).filter(|&a| alone(devices, a)) {
            for &p in &members[a] {
                // One candidate per partner: the first lone CPU operator of its shape elsewhere
                // (under shared costs the others would predict alike).
                let Some(s) = (0..n).find(|&s| {
                    model.ops[s].layer != model.ops[a].layer
                        && shape(s) == shape(p)
                        && model.ops[s].weight_bytes == model.ops[p].weight_bytes
                        && alone(devices, s)
                }) else {
                    continue;
                };
                let mut d = devices.to_vec();
                d[p] = Device::Cpu;
                d[s] = Device::Gpu;
                let t = score(&d);
                if t < best * (1.0 - 1e-9) {
                    found = Some((p, s, t));
                    break 'search;
                }
            }
        }
        let Some((p, s, t)) = found else { break };
        devices[p] = Device::Cpu;
        devices[s] = Device::Gpu;
        best = t;
        swaps += 1;
    }
    swaps
}

/// Predicted times of a placement whose attention (and KV cache) is on the GPU whenever any
/// weight is (the `oato` policies), with rule 5's prefill streaming where the model streams
/// (`stream_prefill`: the improved policy when streaming is allowed), as the placement will
/// run: what the improved policy's rounds and swaps are scored by.
pub(crate) fn predict_resident(model: &CostModel, devices: &[Device]) -> PerPass {
    model
        .predict_streaming(devices, &homes(model, devices), model.stream_prefill)
        .0
}

pub(crate) fn predict_with_crossings(
    model: &CostModel,
    devices: &[Device],
) -> (PerPass, [usize; 2]) {
    model.predict_plan(devices, &homes(model, devices), false, &[])
}

/// Every layer's attention device under the `oato` policies: the GPU whenever any weight is.
fn homes(model: &CostModel, devices: &[Device]) -> Vec<Device> {
    let home = if devices.contains(&Device::Gpu) {
        Device::Gpu
    } else {
        Device::Cpu
    };
    vec![home; model.n_layer]
}

/// The `oato` and `oato-paper` policies: reservations, cap, iteration; the non-target weights
/// on the GPU when any target weight is there. `oato` (improved) shares one cost per operator
/// shape, weighs crossings by rule 2, and keeps layer-split's placement when that is predicted
/// faster; `oato-paper` is the paper's Algorithm 1 as first built.
pub(crate) fn plan_oato(
    profile: &Profile,
    req: &PlanRequest,
    model: &CostModel,
) -> Result<Placement> {
    let improved = req.policy == Policy::Oato;
    let shared;
    let model = if improved {
        let mut m = model.clone().with_shared_costs();
        m.stream_prefill = req.streams();
        shared = m;
        &shared
    } else {
        model
    };
    let gpu = gpu_info(profile, req.policy)?;
    let reservations = Reservations::for_request(profile, req);
    let cap = weight_cap(
        req.budget,
        &reservations.parts(req.ctx_tokens),
        model.total_target_bytes(),
        gpu,
    )?;
    let mut outcome = iterate(model, cap.cap_bytes, improved);
    let rounds = outcome.rounds.len();
    let mut notes = cap.notes.clone();
    notes.extend(outcome.note.clone());
    if improved && model.has_gpu() {
        let kept = &mut outcome.rounds[outcome.kept];
        let before = kept.devices.clone();
        let swaps = pair_cpu_operators(model, &mut kept.devices);
        if swaps > 0 {
            for (i, (b, a)) in before.iter().zip(&kept.devices).enumerate() {
                if b != a {
                    kept.rules[i] = if *a == Device::Cpu {
                        "paired: to the CPU beside the operators that read its input \
                         (predicted faster)"
                    } else {
                        "paired: to the GPU in place of one that joined its partners on the \
                         CPU (predicted faster)"
                    }
                    .to_string();
                }
            }
            notes.push(format!(
                "{swaps} swap(s) after the order: CPU operators joined others that read their \
                 input (one CPU job, fewer crossings), predicted faster"
            ));
        }
    }
    let kept = &outcome.rounds[outcome.kept];
    let budget = BudgetReport::new(req.budget, &cap, &reservations, CAP_FRACTION);
    let (predicted, crossings, prefill_stream, stream_min_tokens) = model.predict_streaming(
        &kept.devices,
        &homes(model, &kept.devices),
        improved && req.streams(),
    );
    if improved {
        let mut ls_req = req.clone();
        ls_req.policy = Policy::LayerSplit;
        if let Ok(mut ls) = super::baselines::plan_layer_split(profile, &ls_req, model) {
            let g = model.gen_tokens;
            let score = |p: &super::placement::Predicted| p.ttft_ms + g * p.tpot_ms;
            let ours = predicted.to_predicted();
            if score(&ls.predicted) < score(&ours) {
                ls.policy = Policy::Oato;
                ls.notes.push(format!(
                    "layer-split's placement is predicted faster ({:.1} ms vs {:.1} ms for the \
                     workload than the OATO order's); kept it",
                    score(&ls.predicted),
                    score(&ours)
                ));
                ls.rounds = rounds;
                return Ok(ls);
            }
        }
    }
    Ok(PlanParts {
        prefill_stream,
        stream_min_tokens,
        policy: req.policy,
        ranking: kept.ranking.clone(),
        devices: kept.devices.clone(),
        rules: kept.rules.clone(),
        budget,
        rounds,
        predicted,
        crossings,
        notes,
    }
    .into_placement(profile, req, model))
}

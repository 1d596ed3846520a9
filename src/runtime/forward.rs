//! The executor: runs the steps `plan` lowers from a `DeviceMap` (embedding, transformer blocks,
//! output head, each operator on its backend), moving activations only where a step reads a value
//! on a backend that does not hold it. With every operator on the CPU this is the CPU engine.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::kernels::cpu::attention::AttnShape;
use crate::model::{Model, N_SLOTS, WeightRef};
use crate::runtime::backend::{
    AttnCall, Backend, Category, ColCopy, DType, DeviceKind, Tensor, Weight, transfer,
};
use crate::runtime::cpu_backend::CpuBackend;
use crate::runtime::plan::{
    self, CrossCost, LayerTargets, OpKind, Step, Val, Widths, forward_steps, head_steps,
    layer_steps, place_non_target,
};

/// Which positions' logits a forward call returns.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Logits {
    /// Only the last token's (generation).
    Last,
    /// Every token's.
    All,
    /// Tokens `i..` of the batch (perplexity scores only the second half of a window).
    From(usize),
}

/// One sequence's part of a batched forward call ([`Session::forward_seqs`]): its tokens, at
/// positions `pos0..` of KV slot `slot`.
#[derive(Clone, Copy, Debug)]
pub struct SeqPart<'a> {
    pub slot: usize,
    pub pos0: usize,
    pub tokens: &'a [u32],
}

/// Where each part of the model runs, as indices into the session's backends.
#[derive(Clone, Debug, PartialEq)]
pub struct DeviceMap {
    /// Backend of each target weight (matmul), by tensor name.
    pub weights: HashMap<String, usize>,
    /// Target weights that stay in host memory and are copied to their backend for each use,
    /// the next layer's while the current one computes (the `flexgen` policy).
    pub streamed: HashSet<String>,
    /// Backend of each layer's KV cache, RoPE, biases and attention. The other non-target
    /// operators (norms, SwiGLU, residual adds) go where the fewest bytes cross (placement
    /// rule 2, `plan::place_non_target`).
    pub layer_home: Vec<usize>,
    /// The link's cost, for the rule-2 decision.
    pub link: CrossCost,
    /// CPU-resident target weights that a forward call of at least `stream_min_tokens` tokens
    /// copies to `stream_dev` and multiplies there (placement rule 5, prefill streaming); the
    /// next layer's copies overlap the current layer's work. Decode never streams.
    pub prefill_stream: HashSet<String>,
    pub stream_dev: usize,
    pub stream_min_tokens: usize,
}

impl DeviceMap {
    /// Everything on backend `dev`.
    pub fn uniform(model: &Model, dev: usize) -> Self {
        DeviceMap {
            weights: target_weights(model)
                .into_iter()
                .map(|w| (w.name.clone(), dev))
                .collect(),
            layer_home: vec![dev; model.hp.n_layer],
            streamed: HashSet::new(),
            link: CrossCost::default(),
            prefill_stream: HashSet::new(),
            stream_dev: dev,
            stream_min_tokens: usize::MAX,
        }
    }

    /// llama.cpp's `-ngl n` on backend `dev`, counted as its `load_tensors` counts (the output
    /// layer first, then repeating layers from the last down): the head for `n` >= 1 and the last
    /// `n - 1` layers (their weights, KV cache and attention), the rest on the CPU (backend 0).
    /// With `stream_min_tokens` (llama.cpp's op offload: 32), a forward call of at least that many
    /// tokens copies the CPU's target weights to `dev` and multiplies them there (rule 5).
    pub fn last_layers(
        model: &Model,
        n: usize,
        dev: usize,
        stream_min_tokens: Option<usize>,
    ) -> Self {
        let n_layer = model.hp.n_layer;
        // llama.cpp's i_gpu_start: layers (the output being layer n_layer) from here on.
        let first = (n_layer + 1).saturating_sub(n);
        let at = |layer: Option<usize>| match layer {
            Some(l) if l >= first => dev,
            None if n >= 1 => dev,
            _ => 0,
        };
        let weights: HashMap<String, usize> = target_slots(model)
            .into_iter()
            .map(|(l, _, w)| (w.name.clone(), at(l)))
            .collect();
        let prefill_stream = match stream_min_tokens {
            Some(_) if dev != 0 => weights
                .iter()
                .filter(|(_, d)| **d == 0)
                .map(|(w, _)| w.clone())
                .collect(),
            _ => HashSet::new(),
        };
        DeviceMap {
            weights,
            layer_home: (0..n_layer).map(|l| at(Some(l))).collect(),
            streamed: HashSet::new(),
            link: CrossCost::default(),
            prefill_stream,
            stream_dev: dev,
            stream_min_tokens: stream_min_tokens.unwrap_or(usize::MAX),
        }
    }

    /// The smallest forward call (at least 2 tokens: decode never streams) that streams the
    /// `prefill_stream` weights, when there are any.
    pub fn stream_from(&self) -> Option<usize> {
        (!self.prefill_stream.is_empty()).then_some(self.stream_min_tokens.max(2))
    }

    /// Whether a forward call of `n_tok` tokens streams the `prefill_stream` weights.
    pub fn streams(&self, n_tok: usize) -> bool {
        self.stream_from().is_some_and(|from| n_tok >= from)
    }

    /// Each layer's target devices and attention device, and the head's device, in a forward
    /// call of `n_tok` tokens (streamed weights compute on `stream_dev` when it streams).
    pub fn targets(&self, model: &Model, cpu: usize, n_tok: usize) -> (Vec<LayerTargets>, usize) {
        let streams = self.streams(n_tok);
        let dev = |w: &WeightRef| {
            if streams && self.prefill_stream.contains(&w.name) {
                return self.stream_dev;
            }
            self.weights.get(&w.name).copied().unwrap_or(cpu)
        };
        let layers = model
            .layers
            .iter()
            .zip(&self.layer_home)
            .map(|(l, &home)| {
                let mut w = [cpu; N_SLOTS];
                for (s, r) in l.targets() {
                    w[s] = dev(r);
                }
                LayerTargets {
                    w,
                    attn: home,
                    bias: [l.bq.is_some(), l.bk.is_some(), l.bv.is_some()],
                    mla: l.mla.is_some(),
                    res_scale: model.hp.scales.residual != 1.0,
                }
            })
            .collect();
        (layers, dev(&model.output))
    }

    /// The steps of a forward call of `n_tok` tokens, as the executor runs them. `cpu` is where
    /// the embedding lookup runs.
    pub fn steps(&self, model: &Model, cpu: usize, n_tok: usize) -> Vec<Step> {
        let (layers, out) = self.targets(model, cpu, n_tok);
        let (devs, norm) =
            place_non_target(&layers, out, &widths(model), n_tok, &self.link, cpu, cpu);
        forward_steps(&layers, &devs, norm, out, cpu)
    }

    /// Activation copies between backends in one forward call of `n_tok` tokens, as the
    /// executor makes them (the logits' read to the host is not counted).
    pub fn crossings(&self, model: &Model, cpu: usize, n_tok: usize) -> usize {
        plan::copies(&self.steps(model, cpu, n_tok)).len()
    }
}

/// The activations' widths of `model`.
pub fn widths(model: &Model) -> Widths {
    let hp = &model.hp;
    let m = hp.mla;
    Widths {
        embd: hp.n_embd,
        q: hp.q_dim(),
        kv: hp.kv_dim(),
        ff: hp.n_ff,
        vocab: hp.n_vocab,
        att: hp.att_dim(),
        q_lora: m.map_or(0, |m| m.q_lora),
        kv_a: m.map_or(0, |m| m.kv_a()),
        kv_lora: m.map_or(0, |m| m.kv_lora),
        kv_b: m.map_or(0, |m| hp.n_head * m.kv_b_head()),
    }
}

/// The model's target weights (DESIGN.md's target operators) in execution order; the output head
/// last.
pub fn target_weights(model: &Model) -> Vec<&WeightRef> {
    target_slots(model).into_iter().map(|t| t.2).collect()
}

/// [`target_weights`] with each weight's layer and slot (`plan::HEAD` for the head).
pub fn target_slots(model: &Model) -> Vec<(Option<usize>, usize, &WeightRef)> {
    let mut v = Vec::with_capacity(model.layers.len() * 8 + 1);
    for (il, l) in model.layers.iter().enumerate() {
        v.extend(l.targets().into_iter().map(|(s, w)| (Some(il), s, w)));
    }
    v.push((None, plan::HEAD, &model.output));
    v
}

/// One activation, present on one or more backends; writing it on one invalidates the others.
struct Value {
    width: usize,
    per: Vec<Option<Tensor>>,
    valid: Vec<bool>,
    /// For each backend's copy, the backends (a bit each) that may still be reading it by DMA: a
    /// `write` from host memory returns before the device has read it (rule 8), so that copy is
    /// not written again before [`Backend::host_reads_done`] of each.
    lent: Vec<u64>,
}

/// What crossed between backends.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TransferStats {
    pub copies: usize,
    pub bytes: usize,
}

/// The backends and a host staging buffer, borrowed apart from the activations.
struct Ctx<'a> {
    bes: &'a [Arc<dyn Backend>],
    staging: &'a mut Vec<f32>,
    stats: &'a mut TransferStats,
}

impl Value {
    fn new(width: usize, n_dev: usize) -> Self {
        Value {
            width,
            per: (0..n_dev).map(|_| None).collect(),
            valid: vec![false; n_dev],
            lent: vec![0; n_dev],
        }
    }

    fn alloc(&mut self, dev: usize, rows: usize, be: &dyn Backend) -> Result<()> {
        let need = rows * self.width;
        if self.per[dev].as_ref().is_none_or(|t| t.len < need) {
            self.per[dev] = None;
            self.per[dev] = Some(be.alloc(DType::F32, need, Category::Workspace)?);
            self.valid[dev] = false;
        }
        Ok(())
    }

    /// Makes the value's first `rows` rows present on `dev`, copying from where they are.
    fn need(&mut self, dev: usize, rows: usize, cx: &mut Ctx) -> Result<()> {
        if self.valid[dev] {
            return Ok(());
        }
        let src =
            self.valid.iter().position(|&v| v).ok_or_else(|| {
                Error::Msg("executor: activation read before it was written".into())
            })?;
        self.alloc(dev, rows, &*cx.bes[dev])?;
        let n = rows * self.width;
        let (a, b) = if src < dev {
            let (l, r) = self.per.split_at_mut(dev);
            (l[src].as_ref(), r[0].as_mut())
        } else {
            let (l, r) = self.per.split_at_mut(src);
            (r[0].as_ref(), l[dev].as_mut())
        };
        let (Some(a), Some(b)) = (a, b) else {
            return Err(Error::Msg("executor: missing activation buffer".into()));
        };
        settle(&mut self.lent[dev], cx.bes)?;
        transfer(&*cx.bes[src], a, &*cx.bes[dev], b, n, cx.staging)?;
        if cx.bes[src].host_f32(a).is_some() {
            self.lent[src] |= 1 << dev;
        }
        cx.stats.copies += 1;
        cx.stats.bytes += n * 4;
        self.valid[dev] = true;
        Ok(())
    }

    fn get(&self, dev: usize) -> Result<&Tensor> {
        match (&self.per[dev], self.valid[dev]) {
            (Some(t), true) => Ok(t),
            _ => Err(Error::Msg(
                "executor: activation not on this backend".into(),
            )),
        }
    }

    /// A buffer on `dev` for the value's new contents; copies elsewhere become stale.
    fn out(&mut self, dev: usize, rows: usize, bes: &[Arc<dyn Backend>]) -> Result<&mut Tensor> {
        settle(&mut self.lent[dev], bes)?;
        self.alloc(dev, rows, &*bes[dev])?;
        self.valid.fill(false);
        self.valid[dev] = true;
        self.per[dev]
            .as_mut()
            .ok_or_else(|| Error::Msg("executor: missing activation buffer".into()))
    }

    /// The value on `dev`, to be changed in place.
    fn modify(&mut self, dev: usize, rows: usize, cx: &mut Ctx) -> Result<&mut Tensor> {
        self.need(dev, rows, cx)?;
        self.out(dev, rows, cx.bes)
    }
}

/// Waits for each backend in `lent` (a bit each) to finish its DMA reads of host memory, then
/// clears it.
fn settle(lent: &mut u64, bes: &[Arc<dyn Backend>]) -> Result<()> {
    while *lent != 0 {
        let d = lent.trailing_zeros() as usize;
        bes[d].host_reads_done()?;
        *lent &= !(1 << d);
    }
    Ok(())
}

/// A target weight on the backend the map names: resident for the session, or (streamed) copied
/// there before each use and given back after.
struct Slot {
    dev: usize,
    r: WeightRef,
    w: Option<Weight>,
    streamed: bool,
    /// Prefill streaming (rule 5): the backend this CPU-resident weight is copied to for a
    /// forward call that streams, and the copy while that call holds it.
    prefill: Option<usize>,
    pw: Option<Weight>,
}

impl Slot {
    fn weight(&self) -> Result<&Weight> {
        self.w
            .as_ref()
            .ok_or_else(|| Error::Msg(format!("executor: weight {:?} not fetched", self.r.name)))
    }

    /// The weight as backend `dev` holds it: its own, or its prefill copy there.
    fn weight_on(&self, dev: usize) -> Result<&Weight> {
        if dev == self.dev {
            return self.weight();
        }
        match (&self.pw, self.prefill) {
            (Some(w), Some(d)) if d == dev => Ok(w),
            _ => Err(Error::Msg(format!(
                "executor: weight {:?} is not on backend #{dev} (not streamed there)",
                self.r.name
            ))),
        }
    }
}

/// Starts the prefill copy of every weight of `slots` streamed in prefill (rule 5) that is not
/// on its stream backend yet.
fn fetch_prefill(slots: &mut [Slot], bes: &[Arc<dyn Backend>], file: &Arc<GgufFile>) -> Result<()> {
    for s in slots.iter_mut().filter(|s| s.pw.is_none()) {
        if let Some(d) = s.prefill {
            s.pw = Some(bes[d].prefetch_weight(file, &s.r)?);
        }
    }
    Ok(())
}

/// Gives back the prefill copies of `slots` (after the work queued on them).
fn release_prefill(slots: &mut [Slot], bes: &[Arc<dyn Backend>]) -> Result<()> {
    for s in slots.iter_mut() {
        if let (Some(w), Some(d)) = (s.pw.take(), s.prefill) {
            bes[d].release_weight(w)?;
        }
    }
    Ok(())
}

/// Starts the copy of every streamed weight of `slots` that is not on its backend yet.
fn fetch(slots: &mut [Slot], bes: &[Arc<dyn Backend>], file: &Arc<GgufFile>) -> Result<()> {
    for s in slots.iter_mut().filter(|s| s.streamed && s.w.is_none()) {
        s.w = Some(bes[s.dev].prefetch_weight(file, &s.r)?);
    }
    Ok(())
}

/// Gives back the streamed weights of `slots` (after the work queued on them).
fn release(slots: &mut [Slot], bes: &[Arc<dyn Backend>]) -> Result<()> {
    for s in slots.iter_mut().filter(|s| s.streamed) {
        if let Some(w) = s.w.take() {
            bes[s.dev].release_weight(w)?;
        }
    }
    Ok(())
}

/// One layer's tensors, each on its backend.
struct Layer {
    /// The norms' weights on every backend (rule 2 may run a norm on either).
    attn_norm: Vec<Tensor>,
    ffn_norm: Vec<Tensor>,
    bias: [Option<Tensor>; 3],
    /// The layer's target weights, in execution order; `at[slot]` is each one's index.
    w: Vec<Slot>,
    at: [Option<usize>; N_SLOTS],
    /// Latent attention's q_a and kv_a norm weights, on the layer's home.
    mla_norms: Option<(Tensor, Tensor)>,
    /// The keys and values of each KV slot (one per sequence of a batch; `forward` uses
    /// slot 0), on the layer's home.
    kv: Vec<(Tensor, Tensor)>,
}

impl Layer {
    fn slot(&self, s: usize) -> Result<&Slot> {
        self.at[s]
            .map(|i| &self.w[i])
            .ok_or_else(|| Error::Msg(format!("executor: the layer has no weight in slot {s}")))
    }
}

/// A model placed on backends, with its KV caches and the number of positions already processed.
pub struct Session<'m> {
    pub model: &'m Model,
    pub n_ctx: usize,
    pub n_past: usize,
    backends: Vec<Arc<dyn Backend>>,
    cpu: usize,
    embd: Weight,
    layers: Vec<Layer>,
    output_norm: Vec<Tensor>,
    output: Slot,
    /// rope_freqs on each backend that is some layer's home.
    rope_freqs: Vec<Option<Tensor>>,
    vals: Vec<Value>,
    /// Scratch values a per-sequence step of a batch of several sequences runs on
    /// ([`Session::exec_seqs`]).
    seq_vals: Vec<Value>,
    staging: Vec<f32>,
    link: CrossCost,
    /// Each layer's target and attention devices, and the head's, from the map.
    targets: Vec<LayerTargets>,
    head_out: usize,
    /// From how many tokens a forward call streams (rule 5), and its targets and head's device.
    stream: Option<(usize, Vec<LayerTargets>, usize)>,
    /// The lowered steps per batch size (rule 2 weighs bytes, so prefill may differ).
    lowered: HashMap<usize, Arc<Lowered>>,
    pub transfers: TransferStats,
    /// Largest batch a prompt runs in (0: the whole prompt at once); `oato run --ubatch`.
    pub ubatch: usize,
    /// `OATO_TRACE_STEPS=1`: wall time per (op, device, batch size), each step waited for;
    /// printed to stderr when the session is dropped. A diagnostic: waiting serialises devices.
    /// `OATO_TRACE_STEPS=gpu`: a step that runs on one GPU alone is timed by that device's own
    /// clock (events around it: its kernels' time, without the host's wait for them); the others
    /// as with `1`. Either way a launch held for a fusion with the next step's (RoPE with the KV
    /// store, the residual add with the next RMSNorm) is issued at its own step's end: a traced
    /// run times the unfused kernels.
    trace: Option<StepTrace>,
}

/// Accumulated step times of a traced session.
#[derive(Default)]
struct StepTrace {
    /// (op, device, n) -> (seconds, calls).
    times: HashMap<(String, usize, usize), (f64, usize)>,
    forwards: HashMap<usize, usize>,
    /// GPU steps by the device's clock (`OATO_TRACE_STEPS=gpu`).
    device_clock: bool,
}

impl StepTrace {
    fn add(&mut self, op: String, dev: usize, n: usize, secs: f64) {
        let e = self.times.entry((op, dev, n)).or_default();
        e.0 += secs;
        e.1 += 1;
    }
}

impl Session<'_> {
    /// The step times traced since the last call (op name, seconds summed over its calls),
    /// emptied; `None` unless `OATO_TRACE_STEPS` is set. For tools that time steps per token
    /// (`examples/decode_mix`).
    pub fn take_step_times(&mut self) -> Option<Vec<(String, f64)>> {
        let t = self.trace.as_mut()?;
        t.forwards.clear();
        Some(
            t.times
                .drain()
                .map(|((op, _, _), (s, _))| (op, s))
                .collect(),
        )
    }
}

impl Drop for Session<'_> {
    fn drop(&mut self) {
        let Some(t) = self.trace.take() else {
            return;
        };
        let mut rows: Vec<_> = t.times.into_iter().collect();
        rows.sort_by(|a, b| (a.0.2, a.0.1, &a.0.0).cmp(&(b.0.2, b.0.1, &b.0.0)));
        eprintln!(
            "step trace (OATO_TRACE_STEPS): ms per forward call, by batch size, device, op{}",
            if t.device_clock {
                " (steps on one GPU by its own clock)"
            } else {
                ""
            }
        );
        for ((op, dev, n), (secs, calls)) in rows {
            let per = t.forwards.get(&n).copied().unwrap_or(1).max(1);
            eprintln!(
                "  n={n:<5} dev={dev} {op:<24} {:>9.3} ms/forward ({} calls)",
                secs * 1e3 / per as f64,
                calls
            );
        }
    }
}

/// Whether a hybrid forward pass keeps the CPU pool awake (`Pool::stay_awake`): unless
/// `OATO_CPU_AWAKE=0` (for timing both ways); read once.
fn keep_pool_awake() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| crate::kernels::cpu::matmul::env_on("OATO_CPU_AWAKE"))
}

/// A forward call's steps: each layer's, then the head's; and where the logits are made.
struct Lowered {
    layers: Vec<Vec<Step>>,
    head: Vec<Step>,
    head_out: usize,
    /// Steps on the CPU and on another device ([`plan::hybrid`]): the pass keeps the CPU
    /// pool awake (`Pool::stay_awake`), its jobs coming between waits for the other device.
    hybrid: bool,
}

fn vector_on(be: &dyn Backend, v: &[f32]) -> Result<Tensor> {
    let mut t = be.alloc(DType::F32, v.len(), Category::Weights)?;
    be.write(&mut t, 0, v)?;
    Ok(t)
}

fn on_all(bes: &[Arc<dyn Backend>], v: &[f32]) -> Result<Vec<Tensor>> {
    bes.iter().map(|b| vector_on(&**b, v)).collect()
}

/// The latent attention dimensions of a model that has them.
fn mla(hp: &crate::model::HParams) -> Result<crate::model::MlaDims> {
    hp.mla
        .ok_or_else(|| Error::Msg("executor: latent attention step in a model without it".into()))
}

/// One KV slot's keys and values for `len` elements on `be`.
fn kv_slot(be: &dyn Backend, len: usize) -> Result<(Tensor, Tensor)> {
    Ok((
        be.alloc(DType::F16, len, Category::KvCache)?,
        be.alloc(DType::F16, len, Category::KvCache)?,
    ))
}

/// Whether a step works per sequence (its positions, its KV slot) rather than row by row.
fn per_sequence(op: &OpKind) -> bool {
    matches!(
        op,
        OpKind::RopeQ | OpKind::RopeK | OpKind::RopeKpe | OpKind::Attention
    )
}

/// Copies `rows` rows of `width` from row `src_row` of `src` to row `dst_row` of `dst` on
/// `be`, as one [`ColCopy`] row.
fn copy_rows(
    be: &dyn Backend,
    src: &Tensor,
    src_row: usize,
    dst: &mut Tensor,
    dst_row: usize,
    (rows, width): (usize, usize),
) -> Result<()> {
    let c = ColCopy {
        rows: 1,
        width: rows * width,
        src_stride: (src_row + rows) * width,
        src_col: src_row * width,
        src_rep: 1,
        dst_stride: (dst_row + rows) * width,
        dst_col: dst_row * width,
    };
    be.copy_cols(src, dst, c)
}

/// Splits `vals` into the value at `i` and the rest (the slot at `i` left empty until put back).
fn take(vals: &mut [Value], v: Val) -> Value {
    std::mem::replace(&mut vals[v.index()], Value::new(0, 0))
}

impl<'m> Session<'m> {
    /// The whole model on the CPU.
    pub fn new(model: &'m Model, n_ctx: usize) -> Result<Self> {
        let cpu: Arc<dyn Backend> = Arc::new(CpuBackend::new());
        Self::with_devices(model, n_ctx, vec![cpu], &DeviceMap::uniform(model, 0))
    }

    /// The model on `backends` as `map` says; one backend must be a CPU (the embedding lookup
    /// reads the memory map there).
    pub fn with_devices(
        model: &'m Model,
        n_ctx: usize,
        backends: Vec<Arc<dyn Backend>>,
        map: &DeviceMap,
    ) -> Result<Self> {
        let hp = &model.hp;
        let nd = backends.len();
        let cpu = backends
            .iter()
            .position(|b| b.kind() == DeviceKind::Cpu)
            .ok_or_else(|| Error::Msg("no CPU backend for the embedding lookup".into()))?;
        if map.layer_home.len() != hp.n_layer {
            return Err(Error::Msg(format!(
                "device map has {} layer homes for {} layers",
                map.layer_home.len(),
                hp.n_layer
            )));
        }
        let check = |d: usize, what: &str| -> Result<usize> {
            if d < nd {
                Ok(d)
            } else {
                Err(Error::Msg(format!("{what}: backend #{d} does not exist")))
            }
        };
        let file = model.file.clone();
        let place = |w: &WeightRef| -> Result<Slot> {
            let d = *map.weights.get(&w.name).ok_or_else(|| {
                Error::Msg(format!("device map names no device for {:?}", w.name))
            })?;
            let d = check(d, &w.name)?;
            let streamed = map.streamed.contains(&w.name);
            let prefill = map
                .prefill_stream
                .contains(&w.name)
                .then(|| check(map.stream_dev, "stream device"))
                .transpose()?
                .filter(|&s| s != d);
            Ok(Slot {
                prefill,
                pw: None,
                dev: d,
                w: if streamed {
                    None
                } else {
                    Some(backends[d].load_matmul_weight(&file, w)?)
                },
                r: w.clone(),
                streamed,
            })
        };
        let kvd = hp.kv_dim();
        let mut layers = Vec::with_capacity(hp.n_layer);
        let mut rope_freqs: Vec<Option<Tensor>> = (0..nd).map(|_| None).collect();
        for (il, l) in model.layers.iter().enumerate() {
            let home = check(map.layer_home[il], "layer home")?;
            let be = &*backends[home];
            if let (Some(f), None) = (model.rope_factors(n_ctx), &rope_freqs[home]) {
                rope_freqs[home] = Some(vector_on(be, f)?);
            }
            let bias = |b: &Option<Vec<f32>>| b.as_deref().map(|b| vector_on(be, b)).transpose();
            let mut at = [None; N_SLOTS];
            let mut w = Vec::with_capacity(8);
            for (i, (s, r)) in l.targets().into_iter().enumerate() {
                at[s] = Some(i);
                w.push(place(r)?);
            }
            let mla_norms = match &l.mla {
                Some(m) => Some((vector_on(be, &m.q_a_norm)?, vector_on(be, &m.kv_a_norm)?)),
                None => None,
            };
            layers.push(Layer {
                attn_norm: on_all(&backends, &l.attn_norm)?,
                ffn_norm: on_all(&backends, &l.ffn_norm)?,
                bias: [bias(&l.bq)?, bias(&l.bk)?, bias(&l.bv)?],
                w,
                at,
                mla_norms,
                kv: vec![kv_slot(be, n_ctx * kvd)?],
            });
        }
        let (targets, head_out) = map.targets(model, cpu, 1);
        let stream = map.stream_from().map(|from| {
            let (t, h) = map.targets(model, cpu, from);
            (from, t, h)
        });
        let wd = widths(model);
        let vals = [
            Val::X,
            Val::H,
            Val::Q,
            Val::K,
            Val::V,
            Val::Att,
            Val::G,
            Val::U,
            Val::O,
            Val::Logits,
            Val::Qa,
            Val::Qn,
            Val::Kva,
            Val::Ckv,
            Val::Kv,
            Val::AttPad,
        ]
        .iter()
        .map(|&v| Value::new(Widths::of(v, &wd), nd))
        .collect::<Vec<_>>();
        let seq_vals = vals.iter().map(|v| Value::new(v.width, nd)).collect();
        Ok(Session {
            model,
            n_ctx,
            n_past: 0,
            embd: backends[cpu].load_weight(&file, &model.token_embd)?,
            output_norm: on_all(&backends, &model.output_norm)?,
            output: place(&model.output)?,
            layers,
            rope_freqs,
            vals,
            seq_vals,
            staging: Vec::new(),
            link: map.link,
            targets,
            head_out,
            stream,
            lowered: HashMap::new(),
            transfers: TransferStats::default(),
            ubatch: 0,
            trace: match std::env::var("OATO_TRACE_STEPS").as_deref() {
                Ok("1") => Some(StepTrace::default()),
                Ok("gpu") => Some(StepTrace {
                    device_clock: true,
                    ..StepTrace::default()
                }),
                _ => None,
            },
            cpu,
            backends,
        })
    }

    /// Forgets every position (the cache is overwritten from position 0).
    pub fn reset(&mut self) {
        self.n_past = 0;
    }

    /// KV slots: sequences that can decode together in one [`Session::forward_seqs`] call.
    pub fn slots(&self) -> usize {
        self.layers.first().map_or(1, |l| l.kv.len())
    }

    /// Gives the session `n` (at least 1) KV slots of `n_ctx` positions each, on each layer's
    /// home; slot 0, the one [`Session::forward`] uses, is kept.
    pub fn set_slots(&mut self, n: usize) -> Result<()> {
        let len = self.n_ctx * self.model.hp.kv_dim();
        for (l, t) in self.layers.iter_mut().zip(&self.targets) {
            l.kv.truncate(n.max(1));
            while l.kv.len() < n {
                l.kv.push(kv_slot(&*self.backends[t.attn], len)?);
            }
        }
        Ok(())
    }

    /// The steps of a batch of `n` tokens, lowered once per batch size.
    fn lowered(&mut self, n: usize) -> Arc<Lowered> {
        if let Some(l) = self.lowered.get(&n) {
            return l.clone();
        }
        let cpu = self.cpu;
        let (targets, head_out) = match &self.stream {
            Some((from, t, h)) if n >= *from => (t, *h),
            _ => (&self.targets, self.head_out),
        };
        let (devs, norm) = place_non_target(
            targets,
            head_out,
            &widths(self.model),
            n,
            &self.link,
            cpu,
            cpu,
        );
        let layers: Vec<Vec<Step>> = targets
            .iter()
            .zip(&devs)
            .map(|(t, d)| layer_steps(t, d, cpu))
            .collect();
        let head = head_steps(norm, head_out, cpu);
        let l = Arc::new(Lowered {
            hybrid: crate::runtime::plan::hybrid(layers.iter().flatten().chain(&head), cpu),
            layers,
            head,
            head_out,
        });
        if self.lowered.len() > 64 {
            self.lowered.clear();
        }
        self.lowered.insert(n, l.clone());
        l
    }

    /// Runs `tokens` at positions n_past.. and returns the logits `want` names ([rows,
    /// n_vocab]): as one batch, or, when `ubatch` is set and only the last token's logits are
    /// wanted, in micro-batches of at most `ubatch` tokens one after the other.
    pub fn forward(&mut self, tokens: &[u32], want: Logits) -> Result<Vec<f32>> {
        if self.ubatch > 0 && tokens.len() > self.ubatch && want == Logits::Last {
            let mut logits = Vec::new();
            for part in tokens.chunks(self.ubatch) {
                logits = self.forward_batch(part, want)?;
            }
            return Ok(logits);
        }
        self.forward_batch(tokens, want)
    }

    /// Runs `tokens` as one batch at positions n_past.. of slot 0 and returns the logits `want`
    /// names.
    fn forward_batch(&mut self, tokens: &[u32], want: Logits) -> Result<Vec<f32>> {
        let part = SeqPart {
            slot: 0,
            pos0: self.n_past,
            tokens,
        };
        let logits = self.forward_parts(&[part], want)?;
        self.n_past += tokens.len();
        Ok(logits)
    }

    /// Runs several sequences as one batch, each part on its own KV slot (distinct) and
    /// positions, and returns each part's last-token logits. Every target matmul runs once
    /// over the rows of all parts; RoPE, the KV store and attention run per part. Neither
    /// `n_past` nor anything about slot positions is kept: the caller tracks them.
    pub fn forward_seqs(&mut self, parts: &[SeqPart]) -> Result<Vec<Vec<f32>>> {
        let first = parts
            .first()
            .ok_or_else(|| Error::Msg("forward: no sequences".into()))?;
        let from = first.tokens.len().saturating_sub(1);
        let logits = self.forward_parts(parts, Logits::From(from))?;
        let nv = self.model.hp.n_vocab;
        let mut end = 0;
        Ok(parts
            .iter()
            .map(|p| {
                end += p.tokens.len();
                let r = end - 1 - from;
                logits[r * nv..(r + 1) * nv].to_vec()
            })
            .collect())
    }

    /// Runs `parts` (one, or several on distinct slots) as one batch and returns the logits
    /// `want` names, counting rows over the parts in order.
    fn forward_parts(&mut self, parts: &[SeqPart], want: Logits) -> Result<Vec<f32>> {
        let n: usize = parts.iter().map(|p| p.tokens.len()).sum();
        let slots = self.slots();
        for (i, p) in parts.iter().enumerate() {
            if p.tokens.is_empty() {
                return Err(Error::Msg("forward: no tokens".into()));
            }
            if p.slot >= slots || parts[..i].iter().any(|q| q.slot == p.slot) {
                return Err(Error::Msg(format!(
                    "forward: KV slot {} is not one of {slots} or is used twice",
                    p.slot
                )));
            }
            if p.pos0 + p.tokens.len() > self.n_ctx {
                return Err(Error::Msg(format!(
                    "context full: {} + {} tokens exceed --ctx {}",
                    p.pos0,
                    p.tokens.len(),
                    self.n_ctx
                )));
            }
        }
        let joined;
        let tokens = match parts {
            [p] => p.tokens,
            _ => {
                joined = parts
                    .iter()
                    .flat_map(|p| p.tokens)
                    .copied()
                    .collect::<Vec<_>>();
                &joined[..]
            }
        };
        let plan = self.lowered(n);
        // A hybrid pass's CPU jobs come between waits for the GPU, often longer than the pool's
        // spin: kept awake, its workers need no wake-up a job (`OATO_CPU_AWAKE=0`: not kept).
        let _awake = (plan.hybrid && keep_pool_awake())
            .then(|| crate::kernels::cpu::pool::global().stay_awake());
        let started = std::time::Instant::now();
        if let Some(t) = self.trace.as_mut() {
            *t.forwards.entry(n).or_default() += 1;
        }
        let cpu = self.cpu;
        let file = self.model.file.clone();
        let bes = self.backends.clone();
        {
            let x = &mut self.vals[Val::X.index()];
            let xt = x.out(cpu, n, &bes)?;
            bes[cpu].embed_rows(&self.embd, tokens, xt)?;
            let s = self.model.hp.scales.embd;
            if s != 1.0 {
                bes[cpu].scale(xt, s, n * self.model.hp.n_embd)?;
            }
        }
        let n_layer = self.layers.len();
        let streaming = self.stream.as_ref().is_some_and(|s| n >= s.0);
        for il in 0..n_layer {
            // Streamed weights: this layer's (if not prefetched), then the next layer's copy
            // starts once this layer's work is queued, then this layer's are given back.
            fetch(&mut self.layers[il].w, &bes, &file)?;
            if streaming {
                // Prefill streaming: this layer's copies (if not started), and the next
                // layer's queued behind them before this layer's work, so the copy engine
                // stays busy while the CPU computes its part.
                fetch_prefill(&mut self.layers[il].w, &bes, &file)?;
                match self.layers.get_mut(il + 1) {
                    Some(next) => fetch_prefill(&mut next.w, &bes, &file)?,
                    None => fetch_prefill(std::slice::from_mut(&mut self.output), &bes, &file)?,
                }
            }
            for s in &plan.layers[il] {
                match parts {
                    [p] => self.exec(s, Some(il), n, 0, (p.pos0, p.slot))?,
                    _ if per_sequence(&s.op) => self.exec_seqs(s, il, n, parts)?,
                    _ => self.exec(s, Some(il), n, 0, (0, 0))?,
                }
            }
            match self.layers.get_mut(il + 1) {
                Some(next) => fetch(&mut next.w, &bes, &file)?,
                None => fetch(std::slice::from_mut(&mut self.output), &bes, &file)?,
            }
            release(&mut self.layers[il].w, &bes)?;
            release_prefill(&mut self.layers[il].w, &bes)?;
        }
        if n_layer == 0 {
            fetch(std::slice::from_mut(&mut self.output), &bes, &file)?;
            if streaming {
                fetch_prefill(std::slice::from_mut(&mut self.output), &bes, &file)?;
            }
        }
        let from = match want {
            Logits::Last => n - 1,
            Logits::All => 0,
            Logits::From(i) => i.min(n - 1),
        };
        for s in &plan.head {
            self.exec(s, None, n, from, (0, 0))?;
        }
        let od = plan.head_out;
        release(std::slice::from_mut(&mut self.output), &bes)?;
        release_prefill(std::slice::from_mut(&mut self.output), &bes)?;
        // The next call starts with layer 0: its streamed weights' copy starts now.
        if let Some(first) = self.layers.first_mut() {
            fetch(&mut first.w, &bes, &file)?;
        }
        let rows = n - from;
        let mut logits = vec![0f32; rows * self.model.hp.n_vocab];
        bes[od].read(self.vals[Val::Logits.index()].get(od)?, 0, &mut logits)?;
        if let Some(t) = self.trace.as_mut() {
            t.add(
                "(whole forward)".into(),
                cpu,
                n,
                started.elapsed().as_secs_f64(),
            );
        }
        Ok(logits)
    }

    /// Runs a per-sequence step (RoPE, attention) of layer `il` in a batch of `n` rows made of
    /// several sequences: each part's rows are copied to the start of the scratch values, the
    /// step runs there as that sequence's own batch (its positions, its KV slot), and the rows
    /// it wrote are copied back. Only `copy_cols` and the step's own operation are used, so
    /// every backend can.
    fn exec_seqs(&mut self, s: &Step, il: usize, n: usize, parts: &[SeqPart]) -> Result<()> {
        let d = s.dev;
        let bes = self.backends.clone();
        let be = &*bes[d];
        let w = s.writes[0];
        let mut row0 = 0;
        for p in parts {
            let m = p.tokens.len();
            let mut cx = Ctx {
                bes: &bes,
                staging: &mut self.staging,
                stats: &mut self.transfers,
            };
            for &r in &s.reads {
                let src = &mut self.vals[r.index()];
                src.need(d, n, &mut cx)?;
                let dst = self.seq_vals[r.index()].out(d, m, &bes)?;
                copy_rows(be, src.get(d)?, row0, dst, 0, (m, src.width))?;
            }
            std::mem::swap(&mut self.vals, &mut self.seq_vals);
            let res = self.exec(s, Some(il), m, 0, (p.pos0, p.slot));
            std::mem::swap(&mut self.vals, &mut self.seq_vals);
            res?;
            let mut cx = Ctx {
                bes: &bes,
                staging: &mut self.staging,
                stats: &mut self.transfers,
            };
            let dst = &mut self.vals[w.index()];
            let width = dst.width;
            let dst = if s.reads.contains(&w) {
                dst.modify(d, n, &mut cx)?
            } else {
                dst.out(d, n, &bes)?
            };
            copy_rows(
                be,
                self.seq_vals[w.index()].get(d)?,
                0,
                dst,
                row0,
                (m, width),
            )?;
            row0 += m;
        }
        Ok(())
    }

    /// Runs one step of layer `layer` (the head when `None`) on `n` tokens at `at` (the first
    /// one's position, and the KV slot); the head computes rows `from..n` only.
    fn exec(
        &mut self,
        s: &Step,
        layer: Option<usize>,
        n: usize,
        from: usize,
        at: (usize, usize),
    ) -> Result<()> {
        let Some(device_clock) = self.trace.as_ref().map(|t| t.device_clock) else {
            return self.exec_step(s, layer, n, from, at);
        };
        for b in &self.backends {
            b.synchronize()?;
        }
        let one_gpu = match &s.op {
            OpKind::Matmul { parts } => parts.iter().all(|(d, _)| *d == s.dev),
            _ => true,
        } && self.backends[s.dev].kind() == crate::runtime::backend::DeviceKind::Gpu;
        let be = self.backends[s.dev].clone();
        let mut clock = (device_clock && one_gpu)
            .then(|| be.stopwatch())
            .transpose()?;
        if let Some(c) = clock.as_mut() {
            c.start()?;
        }
        let t0 = std::time::Instant::now();
        self.exec_step(s, layer, n, from, at)?;
        let device_us = clock.as_mut().map(|c| c.stop()).transpose()?;
        for b in &self.backends {
            b.synchronize()?;
        }
        let dt = device_us.map_or_else(|| t0.elapsed().as_secs_f64(), |us| us / 1e6);
        let name = match &s.op {
            OpKind::Matmul { parts } => {
                // The weights' kinds (the head: `output`) and the values they write.
                let kind = |s: usize| crate::model::SLOT_KINDS.get(s).copied().unwrap_or("output");
                let (mut kinds, mut vals): (Vec<&str>, Vec<String>) = parts
                    .iter()
                    .flat_map(|(_, ss)| ss.iter().map(|&(s, v)| (kind(s), format!("{v:?}"))))
                    .unzip();
                kinds.dedup();
                vals.dedup();
                format!("matmul {}->{}", kinds.join(","), vals.join(","))
            }
            op => format!("{op:?}"),
        };
        if let Some(t) = self.trace.as_mut() {
            t.add(name, s.dev, n, dt);
        }
        Ok(())
    }

    fn exec_step(
        &mut self,
        s: &Step,
        layer: Option<usize>,
        n: usize,
        from: usize,
        (pos0, slot): (usize, usize),
    ) -> Result<()> {
        let hp = &self.model.hp;
        let bes = &self.backends;
        let mut cx = Ctx {
            bes,
            staging: &mut self.staging,
            stats: &mut self.transfers,
        };
        let vals = &mut self.vals;
        // Rows of each value: the head's norm output and logits cover `from..n` only.
        let rows = |v: Val| {
            if layer.is_none() && v != Val::X {
                n - from
            } else {
                n
            }
        };
        let d = s.dev;
        let be = &*bes[d];
        if let OpKind::Matmul { parts } = &s.op {
            let input = s.reads[0];
            let r = rows(input);
            // Every copy of the input first, so a copy to the CPU does not wait for the kernels
            // of the GPU's part (placement rule 6); then each device's part, the GPU's first.
            for (pd, _) in parts {
                vals[input.index()].need(*pd, r, &mut cx)?;
            }
            for (pd, ss) in parts {
                let pbe = &*bes[*pd];
                let mut outs: Vec<(Val, Value)> = Vec::with_capacity(ss.len());
                let mut weights = Vec::with_capacity(ss.len());
                for &(slot, v) in ss {
                    let w = match layer {
                        Some(il) => self.layers[il].slot(slot)?,
                        None => &self.output,
                    };
                    weights.push(w.weight_on(*pd)?);
                    outs.push((v, take(vals, v)));
                }
                let x = vals[input.index()].get(*pd)?;
                let mut ys = Vec::with_capacity(outs.len());
                for (v, val) in outs.iter_mut() {
                    ys.push(val.out(*pd, rows(*v), bes)?);
                }
                let res = pbe.matmul(&weights, x, r, &mut ys);
                drop(ys);
                for (v, val) in outs {
                    vals[v.index()] = val;
                }
                res?;
            }
            return Ok(());
        }
        for &r in &s.reads {
            vals[r.index()].need(d, rows(r), &mut cx)?;
        }
        let w = s.writes[0];
        let mut out = take(vals, w);
        let res = (|| -> Result<()> {
            let in_place = s.reads.contains(&w);
            let y = if in_place {
                out.modify(d, rows(w), &mut cx)?
            } else {
                out.out(d, rows(w), bes)?
            };
            let get = |v: Val| vals[v.index()].get(d);
            match (&s.op, layer) {
                (OpKind::AttnNorm | OpKind::FfnNorm, Some(il)) => {
                    let l = &self.layers[il];
                    let nw = if s.op == OpKind::AttnNorm {
                        &l.attn_norm[d]
                    } else {
                        &l.ffn_norm[d]
                    };
                    be.rms_norm(get(Val::X)?, 0, n, hp.n_embd, nw, hp.rms_eps, y)
                }
                (OpKind::HeadNorm, None) => {
                    let rows = n - from;
                    let nw = &self.output_norm[d];
                    be.rms_norm(get(Val::X)?, from, rows, hp.n_embd, nw, hp.rms_eps, y)?;
                    match hp.scales.logits {
                        1.0 => Ok(()),
                        s => be.scale(y, s, rows * hp.n_embd),
                    }
                }
                (OpKind::Bias(i), Some(il)) => match &self.layers[il].bias[*i] {
                    Some(b) => be.add_bias(y, b, n),
                    None => Ok(()),
                },
                (OpKind::RopeQ | OpKind::RopeK, Some(_)) => {
                    let heads = if s.op == OpKind::RopeQ {
                        hp.n_head
                    } else {
                        hp.n_head_kv
                    };
                    let freqs = self.rope_freqs[d].as_ref();
                    be.rope(y, n, heads, hp.head_dim, pos0, &hp.rope, freqs)
                }
                (OpKind::RopeKpe, Some(_)) => {
                    let m = mla(hp)?;
                    // One "head" per token: the shared key sits after the compressed kv.
                    let p = crate::model::RopeParams {
                        dim_offset: m.kv_lora,
                        ..hp.rope.clone()
                    };
                    let freqs = self.rope_freqs[d].as_ref();
                    be.rope(y, n, 1, m.kv_a(), pos0, &p, freqs)
                }
                (OpKind::QaNorm | OpKind::KvaNorm, Some(il)) => {
                    let m = mla(hp)?;
                    let (qn, kvn) = self.layers[il].mla_norms.as_ref().ok_or_else(|| {
                        Error::Msg(format!("executor: layer {il} has no latent attention"))
                    })?;
                    if s.op == OpKind::QaNorm {
                        be.rms_norm(get(Val::Qa)?, 0, n, m.q_lora, qn, hp.rms_eps, y)
                    } else {
                        be.rms_norm(get(Val::Kva)?, 0, n, m.kv_a(), kvn, hp.rms_eps, y)
                    }
                }
                (OpKind::MlaK | OpKind::MlaV | OpKind::AttnCompact, Some(_)) => {
                    let m = mla(hp)?;
                    let (hd, kvb, rows) = (hp.head_dim, m.kv_b_head(), n * hp.n_head);
                    let cc = |width, src_stride, src_col, src_rep, dst_stride, dst_col| ColCopy {
                        rows,
                        width,
                        src_stride,
                        src_col,
                        src_rep,
                        dst_stride,
                        dst_col,
                    };
                    match s.op {
                        // [n, n_head, nope] from Kv, the shared [n, rope] from Kva to every head.
                        OpKind::MlaK => {
                            be.copy_cols(get(Val::Kv)?, y, cc(m.nope, kvb, 0, 1, hd, 0))?;
                            let kpe = cc(m.rope, m.kv_a(), m.kv_lora, hp.n_head, hd, m.nope);
                            be.copy_cols(get(Val::Kva)?, y, kpe)
                        }
                        // The value, then (finite, never read back) padding from the key.
                        OpKind::MlaV => {
                            be.copy_cols(get(Val::Kv)?, y, cc(m.v, kvb, m.nope, 1, hd, 0))?;
                            match hd - m.v {
                                0 => Ok(()),
                                pad => be.copy_cols(get(Val::K)?, y, cc(pad, hd, 0, 1, hd, m.v)),
                            }
                        }
                        _ => be.copy_cols(get(Val::AttPad)?, y, cc(m.v, hd, 0, 1, m.v, 0)),
                    }
                }
                (OpKind::Attention, Some(il)) => {
                    let (cache_k, cache_v) = self.layers[il]
                        .kv
                        .get_mut(slot)
                        .ok_or_else(|| Error::Msg(format!("executor: no KV slot {slot}")))?;
                    let call = AttnCall {
                        shape: AttnShape {
                            n_head: hp.n_head,
                            n_head_kv: hp.n_head_kv,
                            head_dim: hp.head_dim,
                        },
                        n_tok: n,
                        pos0,
                    };
                    be.attention(
                        call,
                        get(Val::Q)?,
                        get(Val::K)?,
                        get(Val::V)?,
                        cache_k,
                        cache_v,
                        y,
                    )
                }
                (OpKind::Residual, _) => be.add(y, get(Val::O)?, n * hp.n_embd),
                (OpKind::ResidualScale, _) => be.scale(y, hp.scales.residual, n * hp.n_embd),
                (OpKind::Swiglu, _) => be.swiglu(y, get(Val::U)?, n, hp.n_ff),
                (op, _) => Err(Error::Msg(format!(
                    "executor: step {op:?} does not belong to {}",
                    layer.map_or("the head".to_string(), |l| format!("layer {l}"))
                ))),
            }
        })();
        vals[w.index()] = out;
        res
    }
}

//! The forward pass over backends: embedding, transformer blocks and output head, each operator on
//! the backend a `DeviceMap` names, activations moved only where consecutive operators run on
//! different backends. With every operator on the CPU this is the CPU engine.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::kernels::cpu::attention::AttnShape;
use crate::model::{Model, WeightRef};
use crate::runtime::backend::{
    AttnCall, Backend, Category, DType, DeviceKind, Tensor, Weight, transfer,
};
use crate::runtime::cpu_backend::CpuBackend;

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

/// Where each part of the model runs, as indices into the session's backends.
#[derive(Clone, Debug, PartialEq)]
pub struct DeviceMap {
    /// Backend of each target weight (matmul), by tensor name.
    pub weights: HashMap<String, usize>,
    /// Target weights that stay in host memory and are copied to their backend for each use,
    /// the next layer's while the current one computes (the `flexgen` policy).
    pub streamed: HashSet<String>,
    /// Backend of each layer's non-target operators (norms, RoPE, attention, adds) and KV cache.
    pub layer_home: Vec<usize>,
    /// Backend of the output norm.
    pub head_home: usize,
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
            head_home: dev,
            streamed: HashSet::new(),
        }
    }

    /// Activation copies between backends in one forward call, as the executor makes them: the
    /// residual stream follows the layer homes; an input crosses once to each other backend that
    /// runs operators on it; each output crosses back to the home. `cpu` is where the embedding
    /// lookup runs.
    pub fn crossings(&self, model: &Model, cpu: usize) -> usize {
        let dev = |w: &WeightRef| self.weights.get(&w.name).copied().unwrap_or(cpu);
        let mut n = 0;
        let mut x_at = cpu;
        for (l, &home) in model.layers.iter().zip(&self.layer_home) {
            n += (x_at != home) as usize;
            x_at = home;
            for group in [&[&l.wq, &l.wk, &l.wv][..], &[&l.w_gate, &l.w_up][..]] {
                let mut devs: Vec<usize> = group.iter().map(|w| dev(w)).collect();
                // Each output that was computed away from home comes back.
                n += devs.iter().filter(|&&d| d != home).count();
                devs.sort_unstable();
                devs.dedup();
                // The input goes once to each other backend.
                n += devs.iter().filter(|&&d| d != home).count();
            }
            for w in [&l.wo, &l.w_down] {
                n += 2 * (dev(w) != home) as usize;
            }
        }
        n += (x_at != self.head_home) as usize;
        n += (dev(&model.output) != self.head_home) as usize;
        n
    }
}

/// The model's target weights (DESIGN.md's target operators) in execution order; the output head
/// last.
pub fn target_weights(model: &Model) -> Vec<&WeightRef> {
    let mut v = Vec::with_capacity(model.layers.len() * 7 + 1);
    for l in &model.layers {
        v.extend([&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down]);
    }
    v.push(&model.output);
    v
}

/// One activation, present on one or more backends; writing it on one invalidates the others.
struct Value {
    width: usize,
    per: Vec<Option<Tensor>>,
    valid: Vec<bool>,
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
        transfer(&*cx.bes[src], a, &*cx.bes[dev], b, n, cx.staging)?;
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
    fn out(&mut self, dev: usize, rows: usize, be: &dyn Backend) -> Result<&mut Tensor> {
        self.alloc(dev, rows, be)?;
        self.valid.fill(false);
        self.valid[dev] = true;
        self.per[dev]
            .as_mut()
            .ok_or_else(|| Error::Msg("executor: missing activation buffer".into()))
    }

    /// The value on `dev`, to be changed in place.
    fn modify(&mut self, dev: usize, rows: usize, cx: &mut Ctx) -> Result<&mut Tensor> {
        self.need(dev, rows, cx)?;
        self.out(dev, rows, &*cx.bes[dev])
    }
}

struct Acts {
    x: Value,
    h: Value,
    q: Value,
    k: Value,
    v: Value,
    att: Value,
    g: Value,
    u: Value,
    o: Value,
    logits: Value,
}

/// A target weight on the backend the map names: resident for the session, or (streamed) copied
/// there before each use and given back after.
struct Slot {
    dev: usize,
    r: WeightRef,
    w: Option<Weight>,
    streamed: bool,
}

impl Slot {
    fn weight(&self) -> Result<&Weight> {
        self.w
            .as_ref()
            .ok_or_else(|| Error::Msg(format!("executor: weight {:?} not fetched", self.r.name)))
    }
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
    home: usize,
    attn_norm: Tensor,
    ffn_norm: Tensor,
    bias: [Option<Tensor>; 3],
    /// q, k, v, o, gate, up, down.
    w: [Slot; 7],
    cache_k: Tensor,
    cache_v: Tensor,
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
    head_home: usize,
    output_norm: Tensor,
    output: Slot,
    /// rope_freqs on each backend that is some layer's home.
    rope_freqs: Vec<Option<Tensor>>,
    acts: Acts,
    staging: Vec<f32>,
    pub transfers: TransferStats,
}

fn vector_on(be: &dyn Backend, v: &[f32]) -> Result<Tensor> {
    let mut t = be.alloc(DType::F32, v.len(), Category::Weights)?;
    be.write(&mut t, 0, v)?;
    Ok(t)
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
            Ok(Slot {
                dev: d,
                w: if streamed {
                    None
                } else {
                    Some(backends[d].load_weight(&file, w)?)
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
            if let (Some(f), None) = (&model.rope_freqs, &rope_freqs[home]) {
                rope_freqs[home] = Some(vector_on(be, f)?);
            }
            let bias = |b: &Option<Vec<f32>>| b.as_deref().map(|b| vector_on(be, b)).transpose();
            layers.push(Layer {
                home,
                attn_norm: vector_on(be, &l.attn_norm)?,
                ffn_norm: vector_on(be, &l.ffn_norm)?,
                bias: [bias(&l.bq)?, bias(&l.bk)?, bias(&l.bv)?],
                w: [
                    place(&l.wq)?,
                    place(&l.wk)?,
                    place(&l.wv)?,
                    place(&l.wo)?,
                    place(&l.w_gate)?,
                    place(&l.w_up)?,
                    place(&l.w_down)?,
                ],
                cache_k: be.alloc(DType::F16, n_ctx * kvd, Category::KvCache)?,
                cache_v: be.alloc(DType::F16, n_ctx * kvd, Category::KvCache)?,
            });
        }
        let head_home = check(map.head_home, "head home")?;
        let (e, qd) = (hp.n_embd, hp.q_dim());
        let val = |w| Value::new(w, nd);
        Ok(Session {
            model,
            n_ctx,
            n_past: 0,
            embd: backends[cpu].load_weight(&file, &model.token_embd)?,
            output_norm: vector_on(&*backends[head_home], &model.output_norm)?,
            output: place(&model.output)?,
            head_home,
            layers,
            rope_freqs,
            acts: Acts {
                x: val(e),
                h: val(e),
                q: val(qd),
                k: val(kvd),
                v: val(kvd),
                att: val(qd),
                g: val(hp.n_ff),
                u: val(hp.n_ff),
                o: val(e),
                logits: val(hp.n_vocab),
            },
            staging: Vec::new(),
            transfers: TransferStats::default(),
            cpu,
            backends,
        })
    }

    /// Forgets every position (the cache is overwritten from position 0).
    pub fn reset(&mut self) {
        self.n_past = 0;
    }

    /// Runs `tokens` as one batch at positions n_past.. and returns the logits `want` names
    /// ([rows, n_vocab]).
    pub fn forward(&mut self, tokens: &[u32], want: Logits) -> Result<Vec<f32>> {
        let hp = &self.model.hp;
        let n = tokens.len();
        if n == 0 {
            return Err(Error::Msg("forward: no tokens".into()));
        }
        let pos0 = self.n_past;
        if pos0 + n > self.n_ctx {
            return Err(Error::Msg(format!(
                "context full: {} + {} tokens exceed --ctx {}",
                pos0, n, self.n_ctx
            )));
        }
        let bes = &self.backends;
        let a = &mut self.acts;
        let mut cx = Ctx {
            bes,
            staging: &mut self.staging,
            stats: &mut self.transfers,
        };
        let (e, ff) = (hp.n_embd, hp.n_ff);
        let shape = AttnShape {
            n_head: hp.n_head,
            n_head_kv: hp.n_head_kv,
            head_dim: hp.head_dim,
        };
        // [n, n_embd], looked up on the CPU from the memory map.
        let cpu = &*bes[self.cpu];
        cpu.embed_rows(&self.embd, tokens, a.x.out(self.cpu, n, cpu)?)?;
        let file = &self.model.file;
        let n_layer = self.layers.len();
        for il in 0..n_layer {
            // Streamed weights: this layer's (if not prefetched), then the next layer's copy
            // starts once this layer's work is queued, then this layer's are given back.
            fetch(&mut self.layers[il].w, bes, file)?;
            let l = &mut self.layers[il];
            let hm = l.home;
            let be = &*bes[hm];
            a.x.need(hm, n, &mut cx)?;
            be.rms_norm(
                a.x.get(hm)?,
                0,
                n,
                &l.attn_norm,
                hp.rms_eps,
                a.h.out(hm, n, be)?,
            )?;
            matmul_group(
                &mut cx,
                &mut a.h,
                n,
                &l.w[..3],
                [&mut a.q, &mut a.k, &mut a.v],
            )?;
            for (val, b) in [&mut a.q, &mut a.k, &mut a.v].into_iter().zip(&l.bias) {
                if let Some(b) = b {
                    be.add_bias(val.modify(hm, n, &mut cx)?, b, n)?;
                }
            }
            let freqs = self.rope_freqs[hm].as_ref();
            let (nh, nkv, hd) = (hp.n_head, hp.n_head_kv, hp.head_dim);
            be.rope(
                a.q.modify(hm, n, &mut cx)?,
                n,
                nh,
                hd,
                pos0,
                &hp.rope,
                freqs,
            )?;
            be.rope(
                a.k.modify(hm, n, &mut cx)?,
                n,
                nkv,
                hd,
                pos0,
                &hp.rope,
                freqs,
            )?;
            a.v.need(hm, n, &mut cx)?;
            let call = AttnCall {
                shape,
                n_tok: n,
                pos0,
            };
            be.attention(
                call,
                a.q.get(hm)?,
                a.k.get(hm)?,
                a.v.get(hm)?,
                &mut l.cache_k,
                &mut l.cache_v,
                a.att.out(hm, n, be)?,
            )?;
            matmul_group(&mut cx, &mut a.att, n, &l.w[3..4], [&mut a.o])?;
            a.o.need(hm, n, &mut cx)?;
            be.add(a.x.modify(hm, n, &mut cx)?, a.o.get(hm)?, n * e)?;

            be.rms_norm(
                a.x.get(hm)?,
                0,
                n,
                &l.ffn_norm,
                hp.rms_eps,
                a.h.out(hm, n, be)?,
            )?;
            matmul_group(&mut cx, &mut a.h, n, &l.w[4..6], [&mut a.g, &mut a.u])?;
            a.u.need(hm, n, &mut cx)?;
            be.swiglu(a.g.modify(hm, n, &mut cx)?, a.u.get(hm)?, n * ff)?;
            matmul_group(&mut cx, &mut a.g, n, &l.w[6..7], [&mut a.o])?;
            a.o.need(hm, n, &mut cx)?;
            be.add(a.x.modify(hm, n, &mut cx)?, a.o.get(hm)?, n * e)?;
            match self.layers.get_mut(il + 1) {
                Some(next) => fetch(&mut next.w, bes, file)?,
                None => fetch(std::slice::from_mut(&mut self.output), bes, file)?,
            }
            release(&mut self.layers[il].w, bes)?;
        }
        if n_layer == 0 {
            fetch(std::slice::from_mut(&mut self.output), bes, file)?;
        }
        let from = match want {
            Logits::Last => n - 1,
            Logits::All => 0,
            Logits::From(i) => i.min(n - 1),
        };
        let rows = n - from;
        let hh = self.head_home;
        let be = &*bes[hh];
        a.x.need(hh, n, &mut cx)?;
        be.rms_norm(
            a.x.get(hh)?,
            from,
            rows,
            &self.output_norm,
            hp.rms_eps,
            a.h.out(hh, rows, be)?,
        )?;
        matmul_group(
            &mut cx,
            &mut a.h,
            rows,
            std::slice::from_ref(&self.output),
            [&mut a.logits],
        )?;
        let od = self.output.dev;
        release(std::slice::from_mut(&mut self.output), bes)?;
        // The next call starts with layer 0: its streamed weights' copy starts now.
        if let Some(first) = self.layers.first_mut() {
            fetch(&mut first.w, bes, file)?;
        }
        let mut logits = vec![0f32; rows * hp.n_vocab];
        bes[od].read(a.logits.get(od)?, 0, &mut logits)?;
        self.n_past += n;
        Ok(logits)
    }
}

/// Runs the matrices `ws` (each on its backend) on the input `x` ([rows, k]) into `outs`: those on
/// one backend run as one call, so the input crosses to each backend once.
fn matmul_group<const N: usize>(
    cx: &mut Ctx,
    x: &mut Value,
    rows: usize,
    ws: &[Slot],
    mut outs: [&mut Value; N],
) -> Result<()> {
    let mut done = [false; N];
    for i in 0..N {
        if done[i] {
            continue;
        }
        let d = ws[i].dev;
        x.need(d, rows, cx)?;
        let be = &*cx.bes[d];
        let mut weights = Vec::with_capacity(N);
        let mut ys = Vec::with_capacity(N);
        for (j, out) in outs.iter_mut().enumerate() {
            if !done[j] && ws[j].dev == d {
                done[j] = true;
                weights.push(ws[j].weight()?);
                ys.push(out.out(d, rows, be)?);
            }
        }
        be.matmul(&weights, x.get(d)?, rows, &mut ys)?;
    }
    Ok(())
}

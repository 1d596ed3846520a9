//! The forward pass as an explicit plan: the model's operators in execution order, each on a
//! device, lowered from a device map for one batch size. The executor (`forward`) runs these
//! steps, `DeviceMap::crossings` counts the copies they imply, and the scheduler costs them, so
//! the three cannot disagree. Placement rule 2 (non-target operators where the fewest activation
//! bytes cross) is decided here, by [`place_non_target`], and nowhere else.

/// A backend, as an index into the session's backends (the scheduler uses 0 = CPU, 1 = GPU).
pub type Dev = usize;

/// The activations of a forward call. Each is written before it is read within one call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Val {
    /// The residual stream, [n, n_embd].
    X,
    /// A norm's output, the input of q/k/v, gate/up and the head, [n, n_embd].
    H,
    Q,
    K,
    V,
    /// Attention output, [n, n_head * v_head_dim] (`attn_output`'s input).
    Att,
    /// Gate, then silu(gate) * up, [n, n_ff].
    G,
    U,
    /// attn_output or ffn_down output, [n, n_embd].
    O,
    Logits,
    /// Multi-head latent attention: the compressed query, [n, q_lora], and it normed.
    Qa,
    Qn,
    /// The compressed key/value and the shared RoPE key, [n, kv_lora + rope].
    Kva,
    /// The compressed key/value normed, [n, kv_lora].
    Ckv,
    /// `attn_kv_b`'s output, [n, n_head, nope + v].
    Kv,
    /// Attention output with values padded to the key's head size, [n, n_head * head_dim].
    AttPad,
}

pub const N_VALS: usize = 16;

impl Val {
    pub fn index(self) -> usize {
        self as usize
    }
}

/// Widths (f32 elements per token) of the activations.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Widths {
    pub embd: usize,
    pub q: usize,
    pub kv: usize,
    pub ff: usize,
    pub vocab: usize,
    /// Attention output (`attn_output`'s input).
    pub att: usize,
    /// Multi-head latent attention's widths (0 without): q_lora, kv_lora + rope, kv_lora,
    /// n_head * (nope + v).
    pub q_lora: usize,
    pub kv_a: usize,
    pub kv_lora: usize,
    pub kv_b: usize,
}

impl Widths {
    pub fn of(v: Val, w: &Widths) -> usize {
        match v {
            Val::X | Val::H | Val::O => w.embd,
            Val::Q | Val::AttPad => w.q,
            Val::Att => w.att,
            Val::K | Val::V => w.kv,
            Val::G | Val::U => w.ff,
            Val::Logits => w.vocab,
            Val::Qa | Val::Qn => w.q_lora,
            Val::Kva => w.kv_a,
            Val::Ckv => w.kv_lora,
            Val::Kv => w.kv_b,
        }
    }
}

impl Widths {
    /// f32 elements per token of latent attention's activations beyond q/k/v attention's (0
    /// without it): the compressed query and its norm, the compressed key/value and its norm,
    /// `attn_kv_b`'s output, and the padded attention output.
    pub fn latent_extra(&self) -> usize {
        if self.kv_b == 0 {
            return 0;
        }
        2 * self.q_lora + self.kv_a + self.kv_lora + self.kv_b + self.q
    }
}

pub use crate::model::{N_SLOTS, slot};

/// Target weights of a layer by slot (`model::SLOT_KINDS`); the head is slot [`HEAD`].
pub const HEAD: usize = N_SLOTS;

/// What a step computes.
#[derive(Clone, Debug, PartialEq)]
pub enum OpKind {
    /// Embedding rows from the memory map into X (on the CPU).
    Embed,
    AttnNorm,
    FfnNorm,
    /// The output norm, over the rows whose logits are wanted.
    HeadNorm,
    /// Target matmuls reading one input: for each device, the weight slots it runs there and the
    /// value each writes, in the order given (devices other than the CPU first: their work is
    /// queued before the CPU computes, placement rule 6). The input crosses once to each device.
    Matmul {
        parts: Vec<(Dev, Vec<(usize, Val)>)>,
    },
    /// q, k or v bias (0, 1, 2), in place.
    Bias(usize),
    RopeQ,
    RopeK,
    /// KV store and causal attention.
    Attention,
    /// X += O.
    Residual,
    /// O *= the residual scale (MiniCPM3), before `Residual`.
    ResidualScale,
    /// G = silu(G) * U.
    Swiglu,
    /// Multi-head latent attention: Qn = rms_norm(Qa) * attn_q_a_norm.
    QaNorm,
    /// Ckv = rms_norm(Kva's first kv_lora columns) * attn_kv_a_norm.
    KvaNorm,
    /// RoPE on the shared key in Kva's last columns, in place.
    RopeKpe,
    /// K = each head's non-RoPE key from Kv, then the shared RoPE key from Kva.
    MlaK,
    /// V = each head's value from Kv, padded to the key's head size with K's first columns.
    MlaV,
    /// Att = AttPad without each head's padding.
    AttnCompact,
}

/// One step of a plan: an operator on a device, reading and writing activations. A value in
/// both `reads` and `writes` is changed in place.
#[derive(Clone, Debug, PartialEq)]
pub struct Step {
    pub dev: Dev,
    pub op: OpKind,
    pub reads: Vec<Val>,
    pub writes: Vec<Val>,
}

/// Devices of one layer's non-target operators (placement rule 2). `attn` holds the KV cache,
/// RoPE, biases and attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerDevs {
    pub attn: Dev,
    pub attn_norm: Dev,
    pub attn_add: Dev,
    pub ffn_norm: Dev,
    pub swiglu: Dev,
    pub ffn_add: Dev,
}

/// What a crossing of the link costs, for the rule-2 decision and the scheduler's prediction:
/// a fixed part per copy plus the bytes over the bandwidth of its direction.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CrossCost {
    pub fixed_us: f64,
    pub h2d_gbps: f64,
    pub d2h_gbps: f64,
}

impl Default for CrossCost {
    /// Nominal figures for a PCIe 4/5 GPU, used when nothing was measured.
    fn default() -> Self {
        CrossCost {
            fixed_us: 20.0,
            h2d_gbps: 25.0,
            d2h_gbps: 25.0,
        }
    }
}

impl CrossCost {
    /// Microseconds for copy `c` of `n_tok` rows of its value.
    pub fn of(&self, c: Copy, n_tok: usize, widths: &Widths, cpu: Dev) -> f64 {
        self.copy_us(4 * n_tok * Widths::of(c.val, widths), c.from, c.to, cpu)
    }

    /// Microseconds to copy `bytes` from device `from` to `to` (`cpu` is host memory; a copy
    /// between two non-CPU devices goes through the host, both directions).
    pub fn copy_us(&self, bytes: usize, from: Dev, to: Dev, cpu: Dev) -> f64 {
        let b = bytes as f64 / 1e3; // GB/s = 1e3 bytes/us
        let h2d = b / self.h2d_gbps.max(1e-3);
        let d2h = b / self.d2h_gbps.max(1e-3);
        if from == to {
            0.0
        } else if from == cpu {
            self.fixed_us + h2d
        } else if to == cpu {
            self.fixed_us + d2h
        } else {
            2.0 * self.fixed_us + h2d + d2h
        }
    }
}

/// One layer's placement inputs: the device of each target weight (by slot; absent slots are
/// ignored) and of its attention (KV cache); whether it has q/k/v biases, multi-head latent
/// attention, and scaled residual branches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerTargets {
    pub w: [Dev; N_SLOTS],
    pub attn: Dev,
    pub bias: [bool; 3],
    pub mla: bool,
    pub res_scale: bool,
}

impl LayerTargets {
    /// The slots this layer has: q/k/v attention's 0..7, or latent attention's 3..11.
    pub fn slots(&self) -> std::ops::Range<usize> {
        if self.mla {
            slot::O..N_SLOTS
        } else {
            0..slot::Q_A
        }
    }

    /// The devices of the target weights this layer has.
    pub fn used_devs(&self) -> impl Iterator<Item = Dev> + '_ {
        self.slots().map(|s| self.w[s])
    }
}

fn matmul_step(input: Val, slots: &[(usize, Val)], w: &[Dev], cpu: Dev) -> Step {
    let mut parts: Vec<(Dev, Vec<(usize, Val)>)> = Vec::new();
    for &(s, v) in slots {
        match parts.iter_mut().find(|p| p.0 == w[s]) {
            Some(p) => p.1.push((s, v)),
            None => parts.push((w[s], vec![(s, v)])),
        }
    }
    // Devices other than the CPU first (their work is queued, then the CPU computes).
    parts.sort_by_key(|p| p.0 == cpu);
    Step {
        dev: parts[0].0,
        op: OpKind::Matmul { parts },
        reads: vec![input],
        writes: slots.iter().map(|&(_, v)| v).collect(),
    }
}

fn step(dev: Dev, op: OpKind, reads: &[Val], writes: &[Val]) -> Step {
    Step {
        dev,
        op,
        reads: reads.to_vec(),
        writes: writes.to_vec(),
    }
}

/// The attention half of a layer (norm, q/k/v, biases, RoPE, attention, attn_output, residual).
fn attn_block(t: &LayerTargets, d: &LayerDevs, cpu: Dev) -> Vec<Step> {
    use Val::*;
    let mut s = vec![step(d.attn_norm, OpKind::AttnNorm, &[X], &[H])];
    if t.mla {
        s.extend(mla_steps(t, d, cpu));
    } else {
        s.push(matmul_step(
            H,
            &[(slot::Q, Q), (slot::K, K), (slot::V, V)],
            &t.w,
            cpu,
        ));
        for (i, v) in [Q, K, V].into_iter().enumerate() {
            if t.bias[i] {
                s.push(step(d.attn, OpKind::Bias(i), &[v], &[v]));
            }
        }
        s.extend([
            step(d.attn, OpKind::RopeQ, &[Q], &[Q]),
            step(d.attn, OpKind::RopeK, &[K], &[K]),
            step(d.attn, OpKind::Attention, &[Q, K, V], &[Att]),
        ]);
    }
    s.push(matmul_step(Att, &[(slot::O, O)], &t.w, cpu));
    s.extend(residual(t, d.attn_add));
    s
}

/// Multi-head latent attention from the normed input H to the attention output Att: the
/// compressed query and key/value, their norms and expansions, RoPE, the keys and values of
/// every head, attention. The non-target operators run with the attention (its device holds
/// the KV cache and RoPE).
fn mla_steps(t: &LayerTargets, d: &LayerDevs, cpu: Dev) -> Vec<Step> {
    use Val::*;
    vec![
        matmul_step(H, &[(slot::Q_A, Qa), (slot::KV_A, Kva)], &t.w, cpu),
        step(d.attn, OpKind::QaNorm, &[Qa], &[Qn]),
        step(d.attn, OpKind::KvaNorm, &[Kva], &[Ckv]),
        matmul_step(Qn, &[(slot::Q_B, Q)], &t.w, cpu),
        matmul_step(Ckv, &[(slot::KV_B, Kv)], &t.w, cpu),
        step(d.attn, OpKind::RopeQ, &[Q], &[Q]),
        step(d.attn, OpKind::RopeKpe, &[Kva], &[Kva]),
        step(d.attn, OpKind::MlaK, &[Kv, Kva], &[K]),
        step(d.attn, OpKind::MlaV, &[Kv, K], &[V]),
        step(d.attn, OpKind::Attention, &[Q, K, V], &[AttPad]),
        step(d.attn, OpKind::AttnCompact, &[AttPad], &[Att]),
    ]
}

/// X += O on `dev`, O scaled first where the layer scales its residual branches.
fn residual(t: &LayerTargets, dev: Dev) -> Vec<Step> {
    use Val::*;
    let mut s = Vec::with_capacity(2);
    if t.res_scale {
        s.push(step(dev, OpKind::ResidualScale, &[O], &[O]));
    }
    s.push(step(dev, OpKind::Residual, &[X, O], &[X]));
    s
}

/// The FFN half of a layer (norm, gate/up, SwiGLU, down, residual).
fn ffn_block(t: &LayerTargets, d: &LayerDevs, cpu: Dev) -> Vec<Step> {
    use Val::*;
    let mut s = vec![
        step(d.ffn_norm, OpKind::FfnNorm, &[X], &[H]),
        matmul_step(H, &[(slot::GATE, G), (slot::UP, U)], &t.w, cpu),
        step(d.swiglu, OpKind::Swiglu, &[G, U], &[G]),
        matmul_step(G, &[(slot::DOWN, O)], &t.w, cpu),
    ];
    s.extend(residual(t, d.ffn_add));
    s
}

/// A layer's steps.
pub fn layer_steps(t: &LayerTargets, d: &LayerDevs, cpu: Dev) -> Vec<Step> {
    let mut s = attn_block(t, d, cpu);
    s.extend(ffn_block(t, d, cpu));
    s
}

/// The head's steps: the output norm on `norm`, the output matmul on `out`.
pub fn head_steps(norm: Dev, out: Dev, cpu: Dev) -> Vec<Step> {
    let mut w = [cpu; HEAD + 1];
    w[HEAD] = out;
    vec![
        step(norm, OpKind::HeadNorm, &[Val::X], &[Val::H]),
        matmul_step(Val::H, &[(HEAD, Val::Logits)], &w, cpu),
    ]
}

/// Whether `steps` compute both on the CPU `cpu` (the embedding's rows aside: a copy, not a
/// pool job) and on another device: a hybrid forward pass, whose CPU jobs come between waits for
/// the other device.
pub fn hybrid<'a>(steps: impl IntoIterator<Item = &'a Step>, cpu: Dev) -> bool {
    let (mut on_cpu, mut elsewhere) = (false, false);
    let mut mark = |d: Dev| {
        *(if d == cpu {
            &mut on_cpu
        } else {
            &mut elsewhere
        }) = true
    };
    for s in steps {
        match &s.op {
            OpKind::Embed => {}
            OpKind::Matmul { parts } => parts.iter().for_each(|p| mark(p.0)),
            _ => mark(s.dev),
        }
    }
    on_cpu && elsewhere
}

/// A copy the plan implies: value, rows' width, from, to.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Copy {
    pub val: Val,
    pub from: Dev,
    pub to: Dev,
}

/// Where each activation is valid (a bit per device), as the executor's lazy copies track it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Validity([u64; N_VALS]);

impl Validity {
    pub fn only(v: Val, dev: Dev) -> Self {
        let mut s = Validity::default();
        s.0[v.index()] = 1 << dev;
        s
    }

    pub fn on(&self, v: Val, dev: Dev) -> bool {
        self.0[v.index()] & (1 << dev) != 0
    }

    /// The lowest device holding `v`.
    pub fn source(&self, v: Val) -> Option<Dev> {
        let b = self.0[v.index()];
        (b != 0).then(|| b.trailing_zeros() as Dev)
    }

    /// Runs `s` with the executor's rule: each read is copied to the device that reads it (from
    /// the lowest device that holds it) unless already there; each write leaves the value only
    /// on the writer. Calls `copy` for every copy, in order.
    pub fn run(&mut self, s: &Step, mut copy: impl FnMut(Copy)) {
        let devs: Vec<Dev> = match &s.op {
            OpKind::Matmul { parts } => parts.iter().map(|p| p.0).collect(),
            _ => vec![s.dev],
        };
        for &d in &devs {
            for &r in &s.reads {
                if !self.on(r, d) {
                    if let Some(from) = self.source(r) {
                        copy(Copy {
                            val: r,
                            from,
                            to: d,
                        });
                    }
                    self.0[r.index()] |= 1 << d;
                }
            }
        }
        match &s.op {
            OpKind::Matmul { parts } => {
                for (d, outs) in parts {
                    for (_, w) in outs {
                        self.0[w.index()] = 1 << d;
                    }
                }
            }
            _ => {
                for w in &s.writes {
                    self.0[w.index()] = 1 << s.dev;
                }
            }
        }
    }
}

/// Cost of the copies `steps` imply from `start`, with `rows(val)` rows of each value; returns
/// the validity after and the cost.
fn copies_cost(
    steps: &[Step],
    start: Validity,
    widths: &Widths,
    n_tok: usize,
    cost: &CrossCost,
    cpu: Dev,
) -> (Validity, f64) {
    let mut v = start;
    let mut total = 0.0;
    for s in steps {
        v.run(s, |c| total += cost.of(c, n_tok, widths, cpu));
    }
    (v, total)
}

/// Every assignment of `n` operators to `devs`, the GPU-most (fewest on `cpu`) first so that
/// ties go to the GPU.
fn assignments(n: usize, devs: &[Dev], cpu: Dev) -> Vec<Vec<Dev>> {
    let mut out: Vec<Vec<Dev>> = vec![vec![]];
    for _ in 0..n {
        out = out
            .into_iter()
            .flat_map(|a| {
                devs.iter().map(move |&d| {
                    let mut b = a.clone();
                    b.push(d);
                    b
                })
            })
            .collect();
    }
    out.sort_by_key(|a| a.iter().filter(|&&d| d == cpu).count());
    out
}

/// Placement rule 2: the device of every non-target operator of each layer, and of the output
/// norm, such that the activation copies of a forward call of `n_tok` tokens cost the least
/// (ties to the GPU), given the target weights' devices and each layer's attention device.
/// The residual stream starts on `x_start` (`cpu` for a forward call: the embedding lookup).
/// Exact over the chain of layers (a dynamic programme over where the residual stream is
/// between the halves of each layer).
pub fn place_non_target(
    layers: &[LayerTargets],
    head_out: Dev,
    widths: &Widths,
    n_tok: usize,
    cost: &CrossCost,
    cpu: Dev,
    x_start: Dev,
) -> (Vec<LayerDevs>, Dev) {
    let mut devs: Vec<Dev> = layers
        .iter()
        .flat_map(|l| l.used_devs().chain([l.attn]))
        .chain([cpu, head_out, x_start])
        .collect();
    devs.sort_unstable();
    devs.dedup();
    let nd = devs.iter().max().map_or(1, |m| m + 1);
    let two = assignments(2, &devs, cpu);
    let three = assignments(3, &devs, cpu);
    // best[d] = (cost so far, choices) with the residual stream on device d.
    let mut best: Vec<Option<(f64, Vec<LayerDevs>)>> = vec![None; nd];
    best[x_start] = Some((0.0, Vec::new()));
    // A tiny penalty per CPU choice keeps exact ties on the GPU.
    let tie = |a: &[Dev]| 1e-9 * a.iter().filter(|&&d| d == cpu).count() as f64;
    for l in layers {
        let mut next: Vec<Option<(f64, Vec<LayerDevs>)>> = vec![None; nd];
        for (x_at, b) in best.iter().enumerate() {
            let Some((c0, chosen)) = b else { continue };
            for a in &two {
                let d_attn = LayerDevs {
                    attn: l.attn,
                    attn_norm: a[0],
                    attn_add: a[1],
                    ffn_norm: a[1],
                    swiglu: a[1],
                    ffn_add: a[1],
                };
                let (v1, c1) = copies_cost(
                    &attn_block(l, &d_attn, cpu),
                    Validity::only(Val::X, x_at),
                    widths,
                    n_tok,
                    cost,
                    cpu,
                );
                for f in &three {
                    let d = LayerDevs {
                        ffn_norm: f[0],
                        swiglu: f[1],
                        ffn_add: f[2],
                        ..d_attn
                    };
                    let (_, c2) = copies_cost(&ffn_block(l, &d, cpu), v1, widths, n_tok, cost, cpu);
                    let c = c0 + c1 + c2 + tie(a) + tie(f);
                    if next[f[2]].as_ref().is_none_or(|(bc, _)| c < *bc) {
                        let mut ch = chosen.clone();
                        ch.push(d);
                        next[f[2]] = Some((c, ch));
                    }
                }
            }
        }
        best = next;
    }
    let mut winner: Option<(f64, Vec<LayerDevs>, Dev)> = None;
    for (x_at, b) in best.into_iter().enumerate() {
        let Some((c0, chosen)) = b else { continue };
        for &norm in &devs {
            let (_, c) = copies_cost(
                &head_steps(norm, head_out, cpu),
                Validity::only(Val::X, x_at),
                widths,
                n_tok,
                cost,
                cpu,
            );
            let c = c0 + c + tie(&[norm]);
            if winner.as_ref().is_none_or(|w| c < w.0) {
                winner = Some((c, chosen.clone(), norm));
            }
        }
    }
    let (_, chosen, norm) = winner.unwrap_or((0.0, Vec::new(), cpu));
    (chosen, norm)
}

/// A whole forward call's steps (embedding, layers, head) for the devices given.
pub fn forward_steps(
    layers: &[LayerTargets],
    devs: &[LayerDevs],
    head_norm: Dev,
    head_out: Dev,
    cpu: Dev,
) -> Vec<Step> {
    let mut s = vec![step(cpu, OpKind::Embed, &[], &[Val::X])];
    for (t, d) in layers.iter().zip(devs) {
        s.extend(layer_steps(t, d, cpu));
    }
    s.extend(head_steps(head_norm, head_out, cpu));
    s
}

/// The copies a forward call's steps make, in order.
pub fn copies(steps: &[Step]) -> Vec<Copy> {
    let mut v = Validity::default();
    let mut out = Vec::new();
    for s in steps {
        v.run(s, |c| out.push(c));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const W: Widths = Widths {
        embd: 4096,
        q: 4096,
        kv: 1024,
        ff: 14336,
        vocab: 128256,
        att: 4096,
        q_lora: 0,
        kv_a: 0,
        kv_lora: 0,
        kv_b: 0,
    };

    fn layer(w7: [Dev; 7]) -> LayerTargets {
        let mut w = [0; N_SLOTS];
        w[..7].copy_from_slice(&w7);
        LayerTargets {
            w,
            attn: 1,
            bias: [false; 3],
            mla: false,
            res_scale: false,
        }
    }

    #[test]
    fn an_ffn_on_the_cpu_costs_one_crossing_in_and_one_out() {
        // Attention weights on the GPU, the whole FFN on the CPU: x goes out once and comes back
        // once per layer (not five copies as with every non-target operator on the GPU).
        let layers = vec![layer([1, 1, 1, 1, 0, 0, 0]); 4];
        let (devs, norm) = place_non_target(&layers, 1, &W, 1, &CrossCost::default(), 0, 0);
        for d in &devs {
            // SwiGLU with its producers and consumer; the attention half on the GPU.
            assert_eq!(d.swiglu, 0, "{d:?}");
            assert_eq!((d.attn_norm, d.attn_add), (1, 1), "{d:?}");
        }
        assert_eq!(norm, 1);
        let steps = forward_steps(&layers, &devs, norm, 1, 0);
        let c = copies(&steps);
        // Embedding in, then per layer one n_embd-wide activation to the CPU and one back (the
        // normed input and the FFN's output: a tie with the residual stream's, so on the GPU);
        // the n_ff-wide gate and up never cross.
        assert_eq!(c.len(), 1 + 4 * 2, "{c:?}");
        assert!(
            c.iter().all(|c| matches!(c.val, Val::X | Val::H | Val::O)),
            "{c:?}"
        );
        assert_eq!(c.iter().filter(|c| c.to == 0).count(), 4, "{c:?}");
    }

    /// Only a plan that computes on the CPU (the embedding aside) and elsewhere is hybrid: all
    /// on the GPU, all on the CPU, and the GPU with only the embedding on the CPU are not.
    #[test]
    fn hybrid_needs_work_on_both() {
        let at = |w7: [Dev; 7], attn: Dev, out: Dev| {
            let layers = vec![LayerTargets { attn, ..layer(w7) }; 3];
            let (devs, norm) = place_non_target(&layers, out, &W, 1, &CrossCost::default(), 0, 0);
            hybrid(&forward_steps(&layers, &devs, norm, out, 0), 0)
        };
        assert!(!at([0; 7], 0, 0));
        assert!(!at([1; 7], 1, 1));
        assert!(at([0; 7], 1, 0), "attention on the GPU");
        assert!(at([1; 7], 1, 0), "the head on the CPU");
        assert!(at([1, 1, 1, 1, 0, 0, 0], 1, 1));
        let embed_only = [
            step(0, OpKind::Embed, &[], &[Val::X]),
            step(1, OpKind::AttnNorm, &[Val::X], &[Val::H]),
        ];
        assert!(!hybrid(&embed_only, 0));
    }

    #[test]
    fn everything_on_one_device_crosses_only_for_the_embedding() {
        let layers = vec![layer([1; 7]); 3];
        let (devs, norm) = place_non_target(&layers, 1, &W, 64, &CrossCost::default(), 0, 0);
        let c = copies(&forward_steps(&layers, &devs, norm, 1, 0));
        assert_eq!(c.len(), 1);
        assert!(devs.iter().all(|d| d.attn_norm == 1 && d.ffn_add == 1));
    }

    #[test]
    fn the_choice_is_never_worse_than_everything_at_the_attention_device() {
        // Random target placements: rule 2's copies cost at most those of the old rule (every
        // non-target operator at the layer's attention device).
        let mut seed = 0x5eedu64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed & 1) as Dev
        };
        let cost = CrossCost::default();
        for n_tok in [1, 64] {
            for _ in 0..50 {
                let layers: Vec<LayerTargets> = (0..5)
                    .map(|_| layer(std::array::from_fn(|_| next())))
                    .collect();
                let out = next();
                let (devs, norm) = place_non_target(&layers, out, &W, n_tok, &cost, 0, 0);
                let old: Vec<LayerDevs> = layers
                    .iter()
                    .map(|l| LayerDevs {
                        attn: l.attn,
                        attn_norm: l.attn,
                        attn_add: l.attn,
                        ffn_norm: l.attn,
                        swiglu: l.attn,
                        ffn_add: l.attn,
                    })
                    .collect();
                let total = |d: &[LayerDevs], norm| {
                    copies(&forward_steps(&layers, d, norm, out, 0))
                        .iter()
                        .map(|c| cost.of(*c, n_tok, &W, 0))
                        .sum::<f64>()
                };
                let new = total(&devs, norm);
                assert!(new <= total(&old, 1) + 1e-6, "{new} vs {}", total(&old, 1));
            }
        }
    }

    /// Every non-target operator on device 1.
    const ALL_ON_1: LayerDevs = LayerDevs {
        attn: 1,
        attn_norm: 1,
        attn_add: 1,
        ffn_norm: 1,
        swiglu: 1,
        ffn_add: 1,
    };

    /// MiniCPM3-4B's widths.
    const MLA_W: Widths = Widths {
        embd: 2560,
        q: 3840,
        kv: 3840,
        ff: 6400,
        vocab: 73448,
        att: 2560,
        q_lora: 768,
        kv_a: 288,
        kv_lora: 256,
        kv_b: 5120,
    };

    fn mla_layer(w: [Dev; N_SLOTS]) -> LayerTargets {
        LayerTargets {
            w,
            attn: 1,
            bias: [false; 3],
            mla: true,
            res_scale: true,
        }
    }

    #[test]
    fn latent_attention_steps_read_only_what_was_written() {
        let t = mla_layer([1; N_SLOTS]);
        let d = ALL_ON_1;
        let steps = layer_steps(&t, &d, 0);
        let mut written = vec![Val::X];
        let mut slots = Vec::new();
        for s in &steps {
            for r in &s.reads {
                assert!(
                    written.contains(r),
                    "{:?} reads {r:?} before it is written",
                    s.op
                );
            }
            written.extend(&s.writes);
            if let OpKind::Matmul { parts } = &s.op {
                slots.extend(parts.iter().flat_map(|p| p.1.iter().map(|x| x.0)));
            }
        }
        // The latent projections, attn_output and the FFN, once each; no q/k/v slot.
        slots.sort();
        assert_eq!(slots, (slot::O..N_SLOTS).collect::<Vec<_>>());
        // Both residual branches are scaled before they are added.
        let ops: Vec<&OpKind> = steps.iter().map(|s| &s.op).collect();
        assert_eq!(
            ops.iter().filter(|o| ***o == OpKind::ResidualScale).count(),
            2
        );
        assert_eq!(
            MLA_W.latent_extra(),
            2 * 768 + 288 + 256 + 5120 + 3840,
            "extra activations per token"
        );
        assert_eq!(W.latent_extra(), 0);
    }

    #[test]
    fn latent_attention_on_one_device_crosses_only_for_the_embedding() {
        let layers = vec![mla_layer([1; N_SLOTS]); 3];
        let (devs, norm) = place_non_target(&layers, 1, &MLA_W, 64, &CrossCost::default(), 0, 0);
        assert_eq!(copies(&forward_steps(&layers, &devs, norm, 1, 0)).len(), 1);
        // attn_q_a on the CPU: the normed input goes out and the compressed query comes back.
        let mut w = [1; N_SLOTS];
        w[slot::Q_A] = 0;
        let layers = vec![mla_layer(w)];
        let (devs, norm) = place_non_target(&layers, 1, &MLA_W, 1, &CrossCost::default(), 0, 0);
        let c = copies(&forward_steps(&layers, &devs, norm, 1, 0));
        assert_eq!(
            c.iter().map(|c| c.val).collect::<Vec<_>>(),
            [Val::X, Val::H, Val::Qa],
            "{c:?}"
        );
    }

    #[test]
    fn shared_inputs_cross_once_per_device() {
        // q on the GPU, k and v on the CPU: the norm's output goes to the CPU once.
        let t = layer([1, 0, 0, 1, 1, 1, 1]);
        let d = ALL_ON_1;
        let mut v = Validity::only(Val::X, 1);
        let mut c = Vec::new();
        for s in layer_steps(&t, &d, 0) {
            v.run(&s, |x| c.push(x));
        }
        // H out once, K and V back.
        assert_eq!(c.len(), 3, "{c:?}");
        assert_eq!(c[0].val, Val::H);
        // The GPU part of the q/k/v group comes first.
        let s = matmul_step(Val::H, &[(0, Val::Q), (1, Val::K), (2, Val::V)], &t.w, 0);
        assert_eq!(
            s.op,
            OpKind::Matmul {
                parts: vec![(1, vec![(0, Val::Q)]), (0, vec![(1, Val::K), (2, Val::V)])]
            }
        );
    }
}

//! A placement for people and for llama.cpp: a table of every operator with the numbers and the
//! rule that placed it, and the same placement as `-ngl` / `-ot` arguments.

use std::collections::BTreeSet;
use std::fmt::Write;

use crate::profiler::layer_of;

use super::Policy;
use super::cost::mib;
use super::placement::{Device, OrderEntry, Placement};

/// The placement as a table: one row per target operator (best first) with its size, benefit,
/// affinity, device and rule; then the totals, reservations, budget, cap, rounds and predicted
/// times.
pub fn render_table(p: &Placement) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} plan for {} (P={}, G={}, ctx {})",
        p.policy,
        p.model.file,
        p.workload.prompt_tokens,
        p.workload.gen_tokens,
        p.workload.ctx_tokens
    );
    let op_width = p.order.iter().map(|e| e.op.len()).max().unwrap_or(0).max(8);
    let _ = writeln!(
        out,
        "{:>4}  {:<op_width$}  {:>9}  {:>14}  {:>8}  {:<6}  rule",
        "#", "operator", "MiB", "benefit us/MiB", "affinity", "device"
    );
    let streamed: BTreeSet<&str> = p.prefill_stream.iter().map(String::as_str).collect();
    for (rank, e) in p.order.iter().enumerate() {
        // Prefill streaming (rule 5): a CPU weight computed on the GPU for prompt batches.
        let device = if e.device == Device::Cpu && streamed.contains(e.tensor.as_str()) {
            "stream".to_string()
        } else {
            e.device.to_string()
        };
        let _ = writeln!(
            out,
            "{:>4}  {:<op_width$}  {:>9.3}  {:>14.2}  {:>8.3}  {:<6}  {}",
            rank + 1,
            e.op,
            e.weight_bytes as f64 / super::MIB,
            e.benefit_us_per_mib,
            e.affinity,
            device,
            e.rule
        );
    }
    if !p.prefill_stream.is_empty() {
        let _ = writeln!(
            out,
            "\nstream: {} CPU operators copied to the GPU and computed there for prompt batches of \
             {} tokens or more (rule 5); decode computes them on the CPU",
            p.prefill_stream.len(),
            p.stream_min_tokens
                .map_or("no".to_string(), |n| n.to_string())
        );
    }
    let count = |d: Device| p.order.iter().filter(|e| e.device == d).count();
    let gpu_label = if p.policy == Policy::Flexgen {
        ("resident", "streamed")
    } else {
        ("GPU", "CPU")
    };
    let _ = writeln!(
        out,
        "\n{}: {} ops, {}; {}: {} ops, {}",
        gpu_label.0,
        count(Device::Gpu),
        mib(p.gpu_weight_bytes),
        gpu_label.1,
        count(Device::Cpu),
        mib(p.cpu_weight_bytes)
    );
    let b = &p.budget;
    let streamed = if b.stream_bytes > 0 {
        format!(" + two streamed layers {}", mib(b.stream_bytes))
    } else {
        String::new()
    };
    let _ = writeln!(
        out,
        "reserved: KV cache {} + workspace {} + non-target weights {}{streamed} = {}",
        mib(b.kv_bytes),
        mib(b.workspace_bytes),
        mib(b.other_weight_bytes),
        mib(b.reserved_bytes)
    );
    match b.percent {
        Some(pct) => {
            let _ = writeln!(
                out,
                "budget: {pct}% of the target weights: cap {}; reported budget reserved + cap / \
                 {:.2} = {}",
                mib(b.cap_bytes),
                b.cap_fraction,
                mib(b.vram_budget_bytes)
            );
        }
        None => {
            let _ = writeln!(
                out,
                "budget: {}; cap {} ({:.2} of what the reservations leave)",
                mib(b.vram_budget_bytes),
                mib(b.cap_bytes),
                b.cap_fraction
            );
        }
    }
    let _ = writeln!(out, "rounds: {}", p.rounds);
    let _ = writeln!(
        out,
        "predicted: TTFT {:.2} ms, TPOT {:.3} ms",
        p.predicted.ttft_ms, p.predicted.tpot_ms
    );
    for note in &p.notes {
        let _ = writeln!(out, "note: {note}");
    }
    out
}

/// The placement as llama.cpp arguments: `-ngl 999 -ot "^(…)$=CPU"` with one anchored
/// alternation of exactly the CPU-placed target weights (dots escaped), `-ngl 999` when none is
/// on the CPU, `-ngl 0` when all are. A `layer-split` placement is llama.cpp's own `-ngl N`.
pub fn llama_ot(p: &Placement) -> String {
    let on_cpu: BTreeSet<String> = p
        .order
        .iter()
        .filter(|e| e.device == Device::Cpu)
        .map(OrderEntry::tensor_name)
        .collect();
    if !p.order.is_empty() && on_cpu.len() == p.order.len() {
        return "-ngl 0".to_string();
    }
    if on_cpu.is_empty() {
        return "-ngl 999".to_string();
    }
    if p.policy == Policy::LayerSplit {
        let gpu_layers: BTreeSet<usize> = p
            .order
            .iter()
            .filter(|e| e.device == Device::Gpu)
            .filter_map(entry_layer)
            .collect();
        return format!("-ngl {}", gpu_layers.len());
    }
    let names: Vec<String> = on_cpu.iter().map(|n| escape_regex(n)).collect();
    format!("-ngl 999 -ot \"^({})$=CPU\"", names.join("|"))
}

/// An entry's layer, from the field or (older files) from a `blk.N.` op id.
fn entry_layer(e: &OrderEntry) -> Option<usize> {
    e.layer.or_else(|| layer_of(&e.op))
}

/// `name` with the characters that mean something in a regular expression escaped.
fn escape_regex(name: &str) -> String {
    let mut out = String::with_capacity(name.len() + 8);
    for c in name.chars() {
        if "\\.^$|?*+()[]{}".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

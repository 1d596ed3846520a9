//! Tests of the scheduler on hand-made profiles whose numbers give known placements.

use std::collections::BTreeMap;

use super::*;
use crate::profiler::profile::{
    GpuInfo, HostInfo, LinkInfo, ModelInfo, OtherTensor, PROFILE_SCHEMA, ProfileEntry,
};

const MIB_BYTES: u64 = 1 << 20;

/// One target operator of a test profile. Times are per pass at batch 1 (batch 64 scales them
/// linearly); with the test link (latency 0, 0.001 GB/s) one activation byte costs 1 us.
#[derive(Clone)]
struct TestOp {
    op: &'static str,
    weight_bytes: u64,
    cpu_us: f64,
    gpu_us: f64,
    in_bytes: u64,
    out_bytes: u64,
    k: usize,
    n: usize,
}

/// `name` is the op id (`blk.N.kind` or `output`); the weight is in MiB.
fn op(name: &'static str, weight_mib: u64, cpu_us: f64, gpu_us: f64) -> TestOp {
    TestOp {
        op: name,
        weight_bytes: weight_mib * MIB_BYTES,
        cpu_us,
        gpu_us,
        in_bytes: 0,
        out_bytes: 0,
        k: 0,
        n: 0,
    }
}

impl TestOp {
    /// Activation bytes per token in and out.
    fn io(mut self, in_bytes: u64, out_bytes: u64) -> TestOp {
        self.in_bytes = in_bytes;
        self.out_bytes = out_bytes;
        self
    }

    fn shape(mut self, k: usize, n: usize) -> TestOp {
        self.k = k;
        self.n = n;
        self
    }

    fn entry(&self) -> ProfileEntry {
        let layer = self
            .op
            .strip_prefix("blk.")
            .and_then(|rest| rest.split('.').next())
            .and_then(|l| l.parse().ok());
        let kind = self.op.rsplit('.').next().unwrap_or(self.op).to_string();
        let table = |t: f64| -> BTreeMap<String, f64> {
            [("1".to_string(), t), ("64".to_string(), 64.0 * t)].into()
        };
        ProfileEntry {
            op: self.op.to_string(),
            tensor: format!("{}.weight", self.op),
            layer,
            kind,
            dtype: "Q4_0".to_string(),
            k: self.k,
            n: self.n,
            weight_bytes: self.weight_bytes,
            in_bytes_per_token: self.in_bytes,
            out_bytes_per_token: self.out_bytes,
            cpu_us: table(self.cpu_us),
            gpu_us: Some(table(self.gpu_us)),
            stream_us: None,
        }
    }
}

/// A profile of `ops` on a large GPU with a 1-byte-per-microsecond link and nothing reserved
/// (no KV cache, non-target weights or workspace: shapes are 0 unless set).
fn profile(ops: &[TestOp]) -> Profile {
    Profile {
        schema: PROFILE_SCHEMA.to_string(),
        model: ModelInfo {
            file: "test.gguf".to_string(),
            bytes: 0,
            arch: "llama".to_string(),
            n_layer: ops
                .iter()
                .filter_map(|o| o.entry().layer)
                .max()
                .map_or(0, |l| l + 1),
            fingerprint: "0123456789abcdef".to_string(),
            kv_bytes_per_token: 0,
            other_weight_bytes: 0,
            other_tensors: Vec::new(),
            n_embd: 0,
            n_vocab: 0,
        },
        host: HostInfo {
            cpu: "test cpu".to_string(),
            threads: 1,
            isa: "scalar".to_string(),
            job_us: None,
        },
        gpu: Some(GpuInfo {
            name: "test gpu".to_string(),
            total_bytes: 1 << 40,
            free_bytes: 1 << 40,
        }),
        link: Some(LinkInfo {
            h2d_gbps: 0.001,
            d2h_gbps: 0.001,
            latency_us: 0.0,
            pinned_h2d_gbps: None,
            pinned_d2h_gbps: None,
            crossing_us: None,
            act_h2d_gbps: None,
        }),
        batches: vec![1, 64],
        operators: ops.iter().map(TestOp::entry).collect(),
        non_target_us: Default::default(),
        profiling_s: 0.0,
    }
}

/// The smallest workload, so times are easy: P=1, G=1 (each time counts twice), ctx 2.
fn request(policy: Policy, budget: Budget) -> PlanRequest {
    PlanRequest {
        policy,
        budget,
        prompt_tokens: 1,
        gen_tokens: 1,
        ctx_tokens: 2,
        stream: false,
    }
}

fn order_of(p: &Placement) -> Vec<&str> {
    p.order.iter().map(|e| e.op.as_str()).collect()
}

fn device(p: &Placement, op: &str) -> Device {
    p.order
        .iter()
        .find(|e| e.op == op)
        .map(|e| e.device)
        .unwrap_or_else(|| panic!("{op} not in the order"))
}

fn rule<'a>(p: &'a Placement, op: &str) -> &'a str {
    &p.order.iter().find(|e| e.op == op).expect("op").rule
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * (1.0 + a.abs().max(b.abs()))
}

#[test]
fn benefit_is_time_saved_per_mib_with_the_link_correction() {
    // The paper's workload: Tc = cpu(64) + 32 cpu(1), Tg likewise.
    let mut prof = profile(&[op("blk.0.ffn_down", 1, 0.0, 0.0).io(1000, 2000)]);
    let e = &mut prof.operators[0];
    e.cpu_us = [("1".to_string(), 10.0), ("64".to_string(), 100.0)].into();
    e.gpu_us = Some([("1".to_string(), 2.0), ("64".to_string(), 5.0)].into());
    prof.link = Some(LinkInfo {
        h2d_gbps: 1.0,
        d2h_gbps: 1.0,
        latency_us: 5.0,
        pinned_h2d_gbps: None,
        pinned_d2h_gbps: None,
        crossing_us: None,
        act_h2d_gbps: None,
    });
    let req = PlanRequest::new(Policy::OatoPaper, Budget::Percent(100.0));
    let p = plan(&prof, &req).unwrap();
    // Round 1: (100 + 32*10 - 5 - 32*2) = 351 us over 1 MiB. Round 2 adds the copies: input
    // 1000 B/token at 1 GB/s is 1 us/token: (5 + 64) + 32 (5 + 1) = 261; output 2 us/token:
    // (5 + 128) + 32 (5 + 2) = 357. The order cannot change: converged in round 2.
    assert_eq!(p.rounds, 2);
    assert!(close(p.order[0].benefit_us_per_mib, 351.0 + 261.0 + 357.0));
    assert_eq!(p.order[0].affinity, 1.0);
    assert_eq!(device(&p, "blk.0.ffn_down"), Device::Gpu);
    // The written prediction costs the executor's steps for this placement.
    assert_plan_prediction(&prof, &req, &p);
    assert_eq!(p.workload.prompt_tokens, 64);
    assert_eq!(p.workload.gen_tokens, 32);
}

#[test]
fn fill_stops_at_the_first_misfit() {
    // Benefits per MiB: 495, 295, 180, 80. Cap 50% of 10 MiB = 5 MiB: the first (4 MiB) fits,
    // the second does not (8 MiB): stop. The third (1 MiB) would fit (5 MiB) but stays.
    let prof = profile(&[
        op("blk.2.attn_output", 1, 100.0, 10.0),
        op("output", 1, 50.0, 10.0),
        op("blk.1.ffn_down", 4, 600.0, 10.0),
        op("blk.0.ffn_down", 4, 1000.0, 10.0),
    ]);
    let p = plan(&prof, &request(Policy::OatoPaper, Budget::Percent(50.0))).unwrap();
    assert_eq!(
        order_of(&p),
        [
            "blk.0.ffn_down",
            "blk.1.ffn_down",
            "blk.2.attn_output",
            "output"
        ]
    );
    assert_eq!(p.budget.cap_bytes, 5 * MIB_BYTES);
    assert_eq!(device(&p, "blk.0.ffn_down"), Device::Gpu);
    assert_eq!(device(&p, "blk.1.ffn_down"), Device::Cpu);
    assert_eq!(device(&p, "blk.2.attn_output"), Device::Cpu);
    assert_eq!(device(&p, "output"), Device::Cpu);
    assert_eq!(rule(&p, "blk.0.ffn_down"), "fits (cum 4.0 MiB ≤ cap)");
    assert_eq!(
        rule(&p, "blk.1.ffn_down"),
        "first misfit (cum 8.0 MiB > cap): stop"
    );
    assert_eq!(rule(&p, "blk.2.attn_output"), "after stop");
    assert_eq!(p.gpu_weight_bytes, 4 * MIB_BYTES);
    assert_eq!(p.cpu_weight_bytes, 6 * MIB_BYTES);
    assert!(close(p.order[0].benefit_us_per_mib, 495.0));
    assert!(close(p.order[3].benefit_us_per_mib, 80.0));
    assert_eq!(p.order[0].affinity, 1.0);
    assert_eq!(p.order[3].affinity, 0.0);
    assert!(close(p.order[1].affinity, (295.0 - 80.0) / (495.0 - 80.0)));
    // No transfers in this profile: round 2 gives the same order.
    assert_eq!(p.rounds, 2);
    // Predicted: 10 (GPU) + 600 + 100 + 50 (CPU) per pass.
    assert!(close(p.predicted.ttft_ms, 0.760));
    assert!(close(p.predicted.tpot_ms, 0.760));
}

#[test]
fn ties_go_by_tensor_name() {
    let prof = profile(&[
        op("blk.1.ffn_down", 1, 30.0, 10.0),
        op("blk.0.attn_output", 1, 30.0, 10.0),
    ]);
    let p = plan(&prof, &request(Policy::OatoPaper, Budget::Percent(50.0))).unwrap();
    assert_eq!(order_of(&p), ["blk.0.attn_output", "blk.1.ffn_down"]);
    assert!(p.order.iter().all(|e| e.affinity == 1.0));
    assert_eq!(device(&p, "blk.0.attn_output"), Device::Gpu);
    assert_eq!(device(&p, "blk.1.ffn_down"), Device::Cpu);
}

#[test]
fn the_transfer_correction_changes_the_order() {
    // Round 1: attn_output saves 400 us/MiB, ffn_down 200. Round 2 adds ffn_down's output copy
    // (500 B/token, 2 x 500 us): 1200 > 400, so ffn_down goes first; round 3 repeats it.
    let prof = profile(&[
        op("blk.0.attn_output", 1, 300.0, 100.0),
        op("blk.0.ffn_down", 1, 200.0, 100.0).io(0, 500),
    ]);
    let p = plan(&prof, &request(Policy::OatoPaper, Budget::Percent(50.0))).unwrap();
    assert_eq!(p.rounds, 3);
    assert_eq!(order_of(&p), ["blk.0.ffn_down", "blk.0.attn_output"]);
    assert!(close(p.order[0].benefit_us_per_mib, 1200.0));
    assert!(close(p.order[1].benefit_us_per_mib, 400.0));
    assert_eq!(device(&p, "blk.0.ffn_down"), Device::Gpu);
    assert_eq!(device(&p, "blk.0.attn_output"), Device::Cpu);
    assert!(p.notes.is_empty(), "{:?}", p.notes);
    // Round one alone (the cpu policy writes it) had the other order.
    let first = plan(&prof, &request(Policy::Cpu, Budget::Percent(50.0))).unwrap();
    assert_eq!(order_of(&first), ["blk.0.attn_output", "blk.0.ffn_down"]);
}

#[test]
fn an_oscillating_order_ends_with_the_best_placement_seen() {
    // q and k read one input (50 B/token: 100 us over the workload); one of them fits.
    // Round 1 (no copies): q saves 10, k 5 -> q on the GPU. Round 2: k pays the input and its
    // output (20): 125 > q's 10 -> k on the GPU. Round 3: now q pays the input: 110 > k's 25 ->
    // round 1's order again: a cycle. Predicted over the workload: q on the GPU
    // 20 + 25 + 100 + 20 = 165 us, k on the GPU 20 + 30 + 100 + 0 = 150 us: keep round 2.
    let prof = profile(&[
        op("blk.0.attn_q", 1, 15.0, 10.0).io(50, 0),
        op("blk.0.attn_k", 1, 12.5, 10.0).io(50, 10),
    ]);
    let p = plan(&prof, &request(Policy::OatoPaper, Budget::Percent(50.0))).unwrap();
    assert_eq!(p.rounds, 3);
    assert!(p.rounds <= MAX_ROUNDS);
    assert_eq!(order_of(&p), ["blk.0.attn_k", "blk.0.attn_q"]);
    assert_eq!(device(&p, "blk.0.attn_k"), Device::Gpu);
    assert_eq!(device(&p, "blk.0.attn_q"), Device::Cpu);
    assert!(close(p.order[0].benefit_us_per_mib, 125.0));
    assert!(close(p.order[1].benefit_us_per_mib, 10.0));
    assert_plan_prediction(
        &prof,
        &request(Policy::OatoPaper, Budget::Percent(50.0)),
        &p,
    );
    assert!(
        p.notes
            .iter()
            .any(|n| n.contains("cycles (round 3 repeats round 1)")),
        "{:?}",
        p.notes
    );
}

#[test]
fn the_kept_placement_of_a_cycle_is_the_fastest_of_all_rounds() {
    // The same cycle with the times the other way round: keeping round 1 is now right.
    let prof = profile(&[
        op("blk.0.attn_q", 1, 40.0, 10.0).io(50, 0),
        op("blk.0.attn_k", 1, 12.5, 10.0).io(50, 10),
    ]);
    // Round 1: q 60 > k 5. Round 2: k 125 > q 60. Round 3: q 160 > k 25: cycle.
    // q on the GPU: 20 + 25 + 120 = 165; k on the GPU: 20 + 80 + 100 = 200.
    let p = plan(&prof, &request(Policy::OatoPaper, Budget::Percent(50.0))).unwrap();
    assert_eq!(p.rounds, 3);
    assert_eq!(order_of(&p), ["blk.0.attn_q", "blk.0.attn_k"]);
    assert_eq!(device(&p, "blk.0.attn_q"), Device::Gpu);
}

#[test]
fn zero_and_negative_benefits_stay_on_the_cpu() {
    let prof = profile(&[
        op("blk.0.ffn_down", 1, 20.0, 10.0),
        op("blk.0.ffn_up", 1, 10.0, 10.0),
        op("blk.0.ffn_gate", 1, 5.0, 10.0),
    ]);
    let p = plan(&prof, &request(Policy::OatoPaper, Budget::Percent(100.0))).unwrap();
    assert_eq!(device(&p, "blk.0.ffn_down"), Device::Gpu);
    assert_eq!(device(&p, "blk.0.ffn_up"), Device::Cpu);
    assert_eq!(device(&p, "blk.0.ffn_gate"), Device::Cpu);
    assert_eq!(rule(&p, "blk.0.ffn_up"), "benefit ≤ 0");
    assert_eq!(rule(&p, "blk.0.ffn_gate"), "benefit ≤ 0");
    assert!(close(p.order[2].benefit_us_per_mib, -10.0));
}

/// A profile with every reservation: KV cache 1 KiB/token, 2 MiB of non-target weights and
/// shapes that make the workspace `2 * 64 * 256 + 4 * P * (4 * 64 + 2 * 128 + 256 + 128)` bytes
/// and the split-K partials `4 * 8 * P * 256`.
fn reserving_profile() -> Profile {
    let mut prof = profile(&[
        op("blk.0.attn_q", 1, 30.0, 10.0).shape(64, 64),
        op("blk.0.ffn_up", 2, 30.0, 10.0).shape(64, 128),
        op("output", 3, 30.0, 10.0).shape(64, 256),
    ]);
    prof.model.kv_bytes_per_token = 1024;
    prof.model.other_weight_bytes = 2 * MIB_BYTES;
    prof.model.n_embd = 64;
    prof.model.n_vocab = 256;
    prof
}

#[test]
fn reservations_come_off_the_budget_before_the_cap() {
    let prof = reserving_profile();
    let req = PlanRequest::new(Policy::OatoPaper, Budget::Bytes(10 * MIB_BYTES));
    let p = plan(&prof, &req).unwrap();
    let workspace = 2 * 64 * 256 + 4 * 64 * (4 * 64 + 2 * 128 + 256 + 128) + 4 * 8 * 64 * 256;
    assert_eq!(p.budget.workspace_bytes, workspace);
    assert_eq!(p.budget.kv_bytes, MIB_BYTES);
    assert_eq!(p.budget.other_weight_bytes, 2 * MIB_BYTES);
    let reserved = workspace + 3 * MIB_BYTES;
    assert_eq!(p.budget.reserved_bytes, reserved);
    assert_eq!(p.budget.vram_budget_bytes, 10 * MIB_BYTES);
    assert_eq!(
        p.budget.cap_bytes,
        (0.9 * (10 * MIB_BYTES - reserved) as f64).floor() as u64
    );
    assert_eq!(p.budget.cap_fraction, 0.9);
    // n_embd and n_vocab fall back to the attn_q input and the head output.
    let mut bare = prof.clone();
    bare.model.n_embd = 0;
    bare.model.n_vocab = 0;
    assert_eq!(plan(&bare, &req).unwrap().budget.workspace_bytes, workspace);
}

#[test]
fn a_budget_below_the_reservations_is_refused_with_the_numbers() {
    let prof = reserving_profile();
    let req = PlanRequest::new(Policy::OatoPaper, Budget::Bytes(3 * MIB_BYTES));
    let err = plan(&prof, &req).unwrap_err();
    assert!(matches!(err, Error::Usage(_)), "{err:?}");
    let msg = err.to_string();
    assert_eq!(
        msg,
        "--vram-budget 3.0 MiB leaves no room for weights after the reservations: KV cache for \
         1024 tokens 1.0 MiB + workspace 0.8 MiB + non-target weights 2.0 MiB = 3.8 MiB"
    );
    // A budget past the GPU's free memory is planned within the free memory.
    let mut small_gpu = prof.clone();
    small_gpu.gpu.as_mut().unwrap().free_bytes = 3 * MIB_BYTES;
    let req = PlanRequest::new(Policy::OatoPaper, Budget::Bytes(100 * MIB_BYTES));
    let msg = plan(&small_gpu, &req).unwrap_err().to_string();
    assert!(msg.contains("(the GPU has 3.0 MiB free)"), "{msg}");
}

#[test]
fn a_percentage_budget_caps_that_share_of_the_target_weights() {
    let prof = reserving_profile();
    let mut req = PlanRequest::new(Policy::OatoPaper, Budget::Percent(50.0));
    let p = plan(&prof, &req).unwrap();
    // 6 MiB of target weights: cap 3 MiB; the budget reported is reserved + cap / 0.9.
    assert_eq!(p.budget.cap_bytes, 3 * MIB_BYTES);
    assert_eq!(p.budget.percent, Some(50.0));
    let reserved = p.budget.reserved_bytes;
    assert_eq!(
        p.budget.vram_budget_bytes,
        reserved + (3.0 * MIB_BYTES as f64 / 0.9).round() as u64
    );
    assert!(p.gpu_weight_bytes <= 3 * MIB_BYTES);
    assert!(p.notes.is_empty(), "{:?}", p.notes);

    // Past the free memory: the cap is clamped to 90% of what is free after the reservations,
    // with a note; past the total: refused.
    let mut tight = prof.clone();
    let gpu = tight.gpu.as_mut().unwrap();
    gpu.free_bytes = reserved + MIB_BYTES;
    gpu.total_bytes = reserved + 4 * MIB_BYTES;
    let p = plan(&tight, &req).unwrap();
    assert_eq!(p.budget.cap_bytes, (0.9 * MIB_BYTES as f64).floor() as u64);
    assert!(p.gpu_weight_bytes <= p.budget.cap_bytes);
    assert!(p.notes[0].contains("cap clamped"), "{:?}", p.notes);
    req.budget = Budget::Percent(100.0);
    let msg = plan(&tight, &req).unwrap_err().to_string();
    assert!(msg.contains("exceed the GPU's memory"), "{msg}");
}

#[test]
fn budgets_parse_with_binary_units_and_percentages() {
    let good = [
        ("12G", Budget::Bytes(12 << 30)),
        ("800M", Budget::Bytes(800 << 20)),
        ("1.5G", Budget::Bytes(3 << 29)),
        ("512K", Budget::Bytes(512 << 10)),
        ("12GiB", Budget::Bytes(12 << 30)),
        ("12gb", Budget::Bytes(12 << 30)),
        ("2T", Budget::Bytes(2 << 40)),
        ("123456", Budget::Bytes(123456)),
        ("0.5K", Budget::Bytes(512)),
        (" 8 G ", Budget::Bytes(8 << 30)),
        ("75%", Budget::Percent(75.0)),
        ("100%", Budget::Percent(100.0)),
        ("12.5%", Budget::Percent(12.5)),
    ];
    for (text, want) in good {
        assert_eq!(parse_budget(text).unwrap(), want, "{text}");
    }
    let bad = [
        ("12X", "unknown unit \"X\""),
        ("", "empty"),
        ("G", "no number"),
        ("-1G", "negative"),
        ("0%", "above 0"),
        ("101%", "at most 100"),
        ("abc%", "not a number"),
        ("1.2.3G", "not a number"),
        ("12.5", "whole number"),
        ("99999999999T", "too large"),
    ];
    for (text, why) in bad {
        let err = parse_budget(text).unwrap_err();
        assert!(matches!(err, Error::Usage(_)));
        let msg = err.to_string();
        assert!(
            msg.starts_with(&format!("--vram-budget {text:?}: ")),
            "{msg}"
        );
        assert!(msg.contains(why), "{text}: {msg}");
    }
    assert_eq!(parse_budget("24G").unwrap(), Budget::Bytes(24 << 30));
}

#[test]
fn policies_parse_by_name() {
    let parse = |name: &str| <Policy as clap::ValueEnum>::from_str(name, false);
    for p in Policy::ALL {
        assert_eq!(parse(p.name()).unwrap(), p);
        assert_eq!(parse(&p.to_string()).unwrap(), p);
    }
    assert_eq!(parse("layer-split").unwrap(), Policy::LayerSplit);
    // `--policy` refuses an unknown name, listing every policy.
    let cli = clap::Command::new("oato").arg(
        clap::Arg::new("policy")
            .long("policy")
            .value_parser(clap::value_parser!(Policy)),
    );
    let msg = cli
        .try_get_matches_from(["oato", "--policy", "fast"])
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("'fast'")
            && msg.contains("[possible values: oato, oato-paper, layer-split, flexgen, cpu, gpu]"),
        "{msg}"
    );
}

/// Four layers of 2 MiB (attn_q, ffn_down), a 1 MiB head; per layer a 1 KiB norm and 256 KiB of
/// KV cache (ctx 256); a 1 KiB output norm, a 512-byte rope table and the embedding table.
fn layered_profile() -> Profile {
    let mut ops = Vec::new();
    for name in [
        "blk.0.attn_q",
        "blk.0.ffn_down",
        "blk.1.attn_q",
        "blk.1.ffn_down",
        "blk.2.attn_q",
        "blk.2.ffn_down",
        "blk.3.attn_q",
        "blk.3.ffn_down",
        "output",
    ] {
        ops.push(op(name, 1, 20.0, 10.0));
    }
    let mut prof = profile(&ops);
    prof.model.kv_bytes_per_token = 4096;
    let mut others: Vec<OtherTensor> = (0..4)
        .map(|l| OtherTensor {
            name: format!("blk.{l}.attn_norm.weight"),
            layer: Some(l),
            bytes: 1024,
        })
        .collect();
    for (name, bytes) in [
        ("output_norm.weight", 1024),
        ("rope_freqs.weight", 512),
        ("token_embd.weight", 5 * MIB_BYTES),
    ] {
        others.push(OtherTensor {
            name: name.to_string(),
            layer: None,
            bytes,
        });
    }
    prof.model.other_weight_bytes = 4 * 1024 + 1024 + 512;
    prof.model.other_tensors = others;
    prof
}

fn layered_request(policy: Policy, budget: Budget) -> PlanRequest {
    PlanRequest {
        ctx_tokens: 256,
        ..request(policy, budget)
    }
}

#[test]
fn layer_split_takes_the_last_layers_and_the_head_only_after_all() {
    let prof = layered_profile();
    // 50% of 9 MiB: 4.5 MiB holds the last two layers (4 MiB), not a third.
    let p = plan(
        &prof,
        &layered_request(Policy::LayerSplit, Budget::Percent(50.0)),
    )
    .unwrap();
    for l in 0..4 {
        let want = if l >= 2 { Device::Gpu } else { Device::Cpu };
        assert_eq!(device(&p, &format!("blk.{l}.attn_q")), want, "layer {l}");
        assert_eq!(device(&p, &format!("blk.{l}.ffn_down")), want, "layer {l}");
        assert_eq!(p.tensors[&format!("blk.{l}.attn_norm.weight")], want);
    }
    assert_eq!(device(&p, "output"), Device::Cpu);
    assert_eq!(rule(&p, "blk.3.attn_q"), "layer 3 (last 2 fit)");
    assert_eq!(
        rule(&p, "blk.1.attn_q"),
        "layer 1: first misfit (cum 6.0 MiB > cap)"
    );
    assert_eq!(rule(&p, "blk.0.attn_q"), "layer 0: below the last 2");
    assert_eq!(rule(&p, "output"), "head: not all layers on GPU");
    assert_eq!(p.tensors["output_norm.weight"], Device::Cpu);
    assert_eq!(p.tensors["token_embd.weight"], Device::Cpu);
    assert_eq!(p.tensors["rope_freqs.weight"], Device::Gpu);
    assert_eq!(p.rounds, 1);
    assert_eq!(p.gpu_weight_bytes, 4 * MIB_BYTES);
    assert_eq!(llama_ot(&p), "-ngl 2");

    // Bytes: each layer takes 2 MiB + 1 KiB + 256 KiB against 0.9 x (budget - 512 B). 10.5 MiB
    // holds all four layers (9 MiB + 4 KiB) but not the head after them (+ 1 MiB + 1 KiB).
    let budget = Budget::Bytes(10 * MIB_BYTES + MIB_BYTES / 2);
    let p = plan(&prof, &layered_request(Policy::LayerSplit, budget)).unwrap();
    assert!((0..4).all(|l| device(&p, &format!("blk.{l}.ffn_down")) == Device::Gpu));
    assert_eq!(device(&p, "output"), Device::Cpu);
    assert!(rule(&p, "output").starts_with("head: does not fit"));
    assert_eq!(p.budget.kv_bytes, MIB_BYTES);
    assert_eq!(p.budget.other_weight_bytes, 4 * 1024 + 512);
    assert_eq!(llama_ot(&p), "-ngl 4");

    // Everything fits: the head goes too, with its norm.
    let p = plan(
        &prof,
        &layered_request(Policy::LayerSplit, Budget::Percent(100.0)),
    )
    .unwrap();
    assert_eq!(device(&p, "output"), Device::Gpu);
    assert_eq!(p.tensors["output_norm.weight"], Device::Gpu);
    assert_eq!(p.tensors["token_embd.weight"], Device::Cpu);
    assert_eq!(p.gpu_weight_bytes, 9 * MIB_BYTES);
    assert_eq!(llama_ot(&p), "-ngl 999");
}

#[test]
fn flexgen_keeps_weights_resident_in_layer_order() {
    let prof = layered_profile();
    // 50% of 9 MiB: layers 0 and 1 resident (4 MiB), layer 2's attn_q would make 5 MiB.
    let p = plan(
        &prof,
        &layered_request(Policy::Flexgen, Budget::Percent(50.0)),
    )
    .unwrap();
    for l in 0..4 {
        let want = if l < 2 { Device::Gpu } else { Device::Cpu };
        assert_eq!(device(&p, &format!("blk.{l}.attn_q")), want, "layer {l}");
    }
    assert_eq!(device(&p, "output"), Device::Cpu);
    assert!(rule(&p, "blk.2.attn_q").starts_with("streamed: first misfit"));
    assert_eq!(rule(&p, "blk.3.attn_q"), "streamed");
    // All compute is on the GPU: the non-target tensors are there.
    assert_eq!(p.tensors["blk.3.attn_norm.weight"], Device::Gpu);
    // Per pass: the resident layers 0 and 1 add 40 us of GPU compute; layers 2, 3 and the head are bound
    // by their uploads (2 MiB at 1 B/us is far longer than their compute).
    let upload = 2.0 * MIB_BYTES as f64 + 2.0 * MIB_BYTES as f64 + MIB_BYTES as f64;
    assert!(p.predicted.ttft_ms >= upload / 1e3, "{:?}", p.predicted);
    assert!(
        p.predicted.ttft_ms < (40.0 + upload) / 1e3 * 1.5,
        "{:?}",
        p.predicted
    );
}

#[test]
fn gpu_and_cpu_policies_place_everything_on_one_side() {
    let prof = reserving_profile();
    let req = PlanRequest::new(Policy::Gpu, Budget::Bytes(12 * MIB_BYTES));
    let p = plan(&prof, &req).unwrap();
    assert!(p.order.iter().all(|e| e.device == Device::Gpu));
    assert_eq!(p.gpu_weight_bytes, 6 * MIB_BYTES);
    assert_eq!(llama_ot(&p), "-ngl 999");

    let req = PlanRequest::new(Policy::Gpu, Budget::Bytes(8 * MIB_BYTES));
    let msg = plan(&prof, &req).unwrap_err().to_string();
    assert!(
        msg.starts_with("--policy gpu: the target weights 6.0 MiB + reservations (KV cache"),
        "{msg}"
    );
    assert!(
        msg.ends_with("= 9.8 MiB exceed --vram-budget 8.0 MiB"),
        "{msg}"
    );

    let req = PlanRequest::new(Policy::Cpu, Budget::Bytes(0));
    let p = plan(&prof, &req).unwrap();
    assert!(p.order.iter().all(|e| e.device == Device::Cpu));
    assert_eq!(p.budget.reserved_bytes, 0);
    assert_eq!(p.cpu_weight_bytes, 6 * MIB_BYTES);
    assert_eq!(llama_ot(&p), "-ngl 0");
    // 3 ops x 30 us at batch 1, x 64 at the prompt's batch, except the head, which computes
    // the last token's logits only (one row); no copies.
    assert!(
        close(p.predicted.ttft_ms, 2.0 * 1.92 + 0.03),
        "{}",
        p.predicted.ttft_ms
    );
    assert!(close(p.predicted.tpot_ms, 0.09));
}

#[test]
fn without_gpu_timings_only_the_cpu_policy_plans() {
    let mut prof = reserving_profile();
    prof.gpu = None;
    prof.link = None;
    for e in &mut prof.operators {
        e.gpu_us = None;
    }
    for policy in [
        Policy::OatoPaper,
        Policy::LayerSplit,
        Policy::Flexgen,
        Policy::Gpu,
    ] {
        let err = plan(&prof, &PlanRequest::new(policy, Budget::Percent(50.0))).unwrap_err();
        assert!(
            err.to_string().contains("the profile has no GPU timings"),
            "{err}"
        );
    }
    let p = plan(&prof, &PlanRequest::new(Policy::Cpu, Budget::Percent(50.0))).unwrap();
    assert!(
        p.order
            .iter()
            .all(|e| e.benefit_us_per_mib == 0.0 && e.affinity == 1.0)
    );
    assert_eq!(order_of(&p), ["blk.0.attn_q", "blk.0.ffn_up", "output"]);
}

#[test]
fn tensors_name_every_weight_and_the_embedding_stays_on_the_cpu() {
    let mut prof = layered_profile();
    let p = plan(
        &prof,
        &layered_request(Policy::OatoPaper, Budget::Percent(50.0)),
    )
    .unwrap();
    assert_eq!(p.tensors.len(), 9 + 7);
    assert_eq!(p.tensors["token_embd.weight"], Device::Cpu);
    assert_eq!(p.tensors["blk.0.attn_norm.weight"], Device::Gpu);
    assert_eq!(p.tensors["output_norm.weight"], Device::Gpu);
    for e in &p.order {
        assert_eq!(p.tensors[&e.tensor], e.device);
    }

    // A tied head: its weight is the embedding table, on the GPU when the head is.
    prof.model
        .other_tensors
        .retain(|t| t.name != "token_embd.weight");
    let head = prof
        .operators
        .iter_mut()
        .find(|e| e.op == "output")
        .unwrap();
    head.tensor = "token_embd.weight".to_string();
    head.cpu_us = [("1".to_string(), 1000.0)].into();
    let p = plan(
        &prof,
        &layered_request(Policy::OatoPaper, Budget::Percent(50.0)),
    )
    .unwrap();
    assert_eq!(p.order[0].op, "output");
    assert_eq!(p.tensors["token_embd.weight"], Device::Gpu);
    assert!(!p.tensors.contains_key("output.weight"));

    // Nothing on the GPU: nothing else there either.
    let p = plan(&prof, &layered_request(Policy::Cpu, Budget::Percent(50.0))).unwrap();
    assert!(p.tensors.values().all(|&d| d == Device::Cpu));
}

#[test]
fn placement_json_round_trips_and_is_deterministic() {
    let prof = layered_profile();
    let req = layered_request(Policy::OatoPaper, Budget::Percent(50.0));
    let p = plan(&prof, &req).unwrap();
    let text = p.to_json().unwrap();
    assert_eq!(text, plan(&prof, &req).unwrap().to_json().unwrap());
    let back = Placement::from_json(&text, "placement.json").unwrap();
    assert_eq!(back, p);
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["schema"], "oato.placement/v1");
    assert_eq!(v["policy"], "oato-paper");
    assert_eq!(v["budget"]["cap_fraction"], 0.9);
    assert_eq!(v["tensors"]["token_embd.weight"], "cpu");
    assert!(v["order"][0]["benefit_us_per_mib"].is_number());
    assert!(v["predicted"]["ttft_ms"].is_number());
    let ls = plan(
        &prof,
        &layered_request(Policy::LayerSplit, Budget::Percent(50.0)),
    )
    .unwrap();
    let v: serde_json::Value = serde_json::from_str(&ls.to_json().unwrap()).unwrap();
    assert_eq!(v["policy"], "layer-split");
}

#[test]
fn placement_from_json_names_what_is_wrong() {
    let p = plan(
        &layered_profile(),
        &layered_request(Policy::OatoPaper, Budget::Percent(50.0)),
    )
    .unwrap();
    let text = p.to_json().unwrap();
    let err = |text: &str| {
        Placement::from_json(text, "plan.json")
            .unwrap_err()
            .to_string()
    };
    assert!(err("{not json").starts_with("plan.json: not valid JSON: "));
    assert_eq!(
        err(&text.replace("oato.placement/v1", "oato.placement/v2")),
        "plan.json: schema \"oato.placement/v2\", expected \"oato.placement/v1\""
    );
    assert_eq!(
        err(&text.replace("\"schema\"", "\"schemata\"")),
        "plan.json: no \"schema\" field"
    );
    assert_eq!(
        err(&text.replace(
            "\"token_embd.weight\": \"cpu\"",
            "\"token_embd.weight\": \"npu\""
        )),
        "plan.json: tensor token_embd.weight: device \"npu\", expected \"gpu\" or \"cpu\""
    );
    let missing = text.replace("\"rounds\"", "\"laps\"");
    assert!(
        err(&missing).starts_with("plan.json: not a valid oato.placement/v1 file: "),
        "{}",
        err(&missing)
    );
}

#[test]
fn llama_ot_lists_exactly_the_cpu_weights() {
    let prof = profile(&[
        op("blk.2.attn_output", 1, 100.0, 10.0),
        op("output", 1, 50.0, 10.0),
        op("blk.1.ffn_down", 4, 600.0, 10.0),
        op("blk.0.ffn_down", 4, 1000.0, 10.0),
    ]);
    let p = plan(&prof, &request(Policy::OatoPaper, Budget::Percent(50.0))).unwrap();
    assert_eq!(
        llama_ot(&p),
        r#"-ngl 999 -ot "^(blk\.1\.ffn_down\.weight|blk\.2\.attn_output\.weight|output\.weight)$=CPU""#
    );
}

#[test]
fn the_table_shows_every_operator_and_the_budget() {
    let p = plan(
        &reserving_profile(),
        &PlanRequest::new(Policy::OatoPaper, Budget::Bytes(10 * MIB_BYTES)),
    )
    .unwrap();
    let table = render_table(&p);
    for op in ["blk.0.attn_q", "blk.0.ffn_up", "output"] {
        assert!(table.contains(op), "{table}");
    }
    assert!(
        table.contains("reserved: KV cache 1.0 MiB + workspace 0.8 MiB"),
        "{table}"
    );
    assert!(table.contains("budget: 10.0 MiB; cap"), "{table}");
    assert!(table.contains(&format!("rounds: {}", p.rounds)), "{table}");
    assert!(table.contains("predicted: TTFT"), "{table}");
}

#[test]
fn a_larger_percentage_never_gets_a_smaller_cap() {
    let mut prof = reserving_profile();
    let probe = plan(
        &prof,
        &PlanRequest::new(Policy::OatoPaper, Budget::Percent(10.0)),
    )
    .unwrap();
    let reserved = probe.budget.reserved_bytes;
    // 4 MiB free after the reservations: at most 3.6 MiB of the 6 MiB of weights.
    prof.gpu.as_mut().unwrap().free_bytes = reserved + 4 * MIB_BYTES;
    let limit = (0.9 * (4 * MIB_BYTES) as f64).floor() as u64;
    let mut last = 0;
    for pct in [10.0, 30.0, 50.0, 59.0, 61.0, 70.0, 90.0, 100.0] {
        let p = plan(
            &prof,
            &PlanRequest::new(Policy::OatoPaper, Budget::Percent(pct)),
        )
        .unwrap();
        assert!(
            p.budget.cap_bytes >= last,
            "{pct}%: cap {} < {last}",
            p.budget.cap_bytes
        );
        assert!(
            p.budget.cap_bytes <= limit,
            "{pct}%: cap {}",
            p.budget.cap_bytes
        );
        assert_eq!(
            p.notes.iter().any(|n| n.contains("clamped")),
            pct > 60.0,
            "{pct}%"
        );
        last = p.budget.cap_bytes;
    }
    assert_eq!(last, limit);
}

#[test]
fn layer_split_with_a_percentage_stays_within_free_memory() {
    let mut prof = layered_profile();
    // Each layer takes 2 MiB of weights + 1 KiB of tensors + 0.25 MiB of KV cache (256 tokens);
    // the non-layer tensors (rope_freqs) 512 bytes; no workspace. Free memory for 2.5 layers.
    let per_layer = 2 * MIB_BYTES + 1024 + MIB_BYTES / 4;
    prof.gpu.as_mut().unwrap().free_bytes = 512 + ((2.5 * per_layer as f64) / 0.9).ceil() as u64;
    let p = plan(
        &prof,
        &layered_request(Policy::LayerSplit, Budget::Percent(100.0)),
    )
    .unwrap();
    let gpu_layers: Vec<&str> = p
        .order
        .iter()
        .filter(|e| e.device == Device::Gpu)
        .map(|e| e.op.as_str())
        .collect();
    assert_eq!(gpu_layers.len(), 4, "{gpu_layers:?}");
    assert!(
        gpu_layers
            .iter()
            .all(|o| o.starts_with("blk.2.") || o.starts_with("blk.3."))
    );
    assert!(
        p.notes.iter().any(|n| n.contains("free memory")),
        "{:?}",
        p.notes
    );
}

#[test]
fn flexgen_reserves_its_two_largest_streamed_layers() {
    let prof = layered_profile();
    let p = plan(
        &prof,
        &layered_request(Policy::Flexgen, Budget::Percent(50.0)),
    )
    .unwrap();
    // The two largest stages: two layers of 2 MiB.
    assert_eq!(p.budget.stream_bytes, 4 * MIB_BYTES);
    assert_eq!(
        p.budget.reserved_bytes,
        p.budget.kv_bytes + p.budget.workspace_bytes + p.budget.other_weight_bytes + 4 * MIB_BYTES
    );
    assert!(p.to_json().unwrap().contains("\"stream_bytes\""));
}

/// The placement's predicted times equal the plan costing of its devices (attention on the GPU).
fn assert_plan_prediction(prof: &Profile, req: &PlanRequest, p: &Placement) {
    let model = super::cost::CostModel::new(prof, req).unwrap();
    let devices: Vec<Device> = model.ops.iter().map(|o| p.tensors[&o.tensor]).collect();
    let (want, copies) = super::oato::predict_with_crossings(&model, &devices);
    assert!(
        close(p.predicted.ttft_ms, want.prefill / 1e3),
        "{:?} vs {want:?}",
        p.predicted
    );
    assert!(
        close(p.predicted.tpot_ms, want.decode / 1e3),
        "{:?} vs {want:?}",
        p.predicted
    );
    assert_eq!(
        [p.predicted.prefill_crossings, p.predicted.decode_crossings],
        copies
    );
    assert!(want.prefill > 0.0 && want.decode > 0.0);
}

/// Rule 5's choice on hand-made profiles: two CPU-resident operators of 1 MiB, 100 us each on the
/// CPU at batch 1 (6.4 ms at P=64) and 1 us on the GPU: a fast link streams both, a slow link
/// neither, and measured stream times that differ stream only the one whose copy is cheaper than
/// its CPU time.
#[test]
fn prefill_streaming_is_chosen_per_operator_from_the_link() {
    let ops = [
        op("blk.0.attn_q", 1, 100.0, 1.0),
        op("blk.0.ffn_up", 1, 100.0, 1.0),
    ];
    let req = PlanRequest {
        prompt_tokens: 64,
        ctx_tokens: 128,
        stream: true,
        ..request(Policy::Oato, Budget::Percent(50.0))
    };
    let devices = vec![Device::Cpu; 2];
    let attn = vec![Device::Gpu; 1];
    let with_link = |gbps: f64, stream_us: [Option<f64>; 2]| {
        let mut prof = profile(&ops);
        let link = prof.link.as_mut().unwrap();
        (link.h2d_gbps, link.d2h_gbps) = (gbps, gbps);
        for (e, s) in prof.operators.iter_mut().zip(stream_us) {
            e.stream_us = s;
        }
        CostModel::new(&prof, &req).unwrap()
    };

    let choice = |m: &CostModel| {
        let (pass, _, chosen, min_tokens) = m.predict_streaming(&devices, &attn, true);
        // The prediction returned is the chosen plan's.
        assert_eq!(pass, m.predict_plan(&devices, &attn, false, &chosen).0);
        (chosen, min_tokens)
    };

    // 100 GB/s: 1 MiB in about 10 us, far below 6.4 ms.
    let fast = with_link(100.0, [None, None]);
    let (chosen, min_tokens) = choice(&fast);
    assert_eq!(chosen, [true, true]);
    assert!((2..=64).contains(&min_tokens), "{min_tokens}");
    let streamed = fast.predict_plan(&devices, &attn, false, &chosen).0.prefill;
    let resident_cpu = fast.predict_plan(&devices, &attn, false, &[]).0.prefill;
    assert!(streamed < resident_cpu, "{streamed} vs {resident_cpu}");
    // Decode never streams.
    assert_eq!(
        fast.predict_plan(&devices, &attn, false, &chosen).0.decode,
        fast.predict_plan(&devices, &attn, false, &[]).0.decode
    );

    // 0.001 GB/s: a second per MiB.
    let slow = with_link(0.001, [None, None]);
    let (chosen, min_tokens) = choice(&slow);
    assert!(!chosen.contains(&true), "{chosen:?}");
    assert_eq!(min_tokens, usize::MAX);

    // Measured copies: 100 us for attn_q (streams), 20 ms for ffn_up (stays on the CPU).
    let mixed = with_link(100.0, [Some(100.0), Some(20_000.0)]);
    assert_eq!(choice(&mixed).0, [true, false]);
}

/// The `oato` and `layer-split` placements list the streamed CPU tensors and the threshold;
/// `--no-stream`, `oato-paper` and `flexgen` never stream, and the plan table marks them.
#[test]
fn placements_carry_prefill_stream() {
    let ops = [
        op("blk.0.attn_q", 1, 100.0, 1.0),
        op("blk.0.ffn_up", 1, 100.0, 1.0),
        op("blk.1.attn_q", 1, 100.0, 1.0),
        op("blk.1.ffn_up", 1, 100.0, 1.0),
    ];
    let mut prof = profile(&ops);
    let link = prof.link.as_mut().unwrap();
    (link.h2d_gbps, link.d2h_gbps) = (100.0, 100.0);
    let req = |policy, stream| PlanRequest {
        prompt_tokens: 64,
        ctx_tokens: 128,
        stream,
        ..request(policy, Budget::Percent(50.0))
    };
    for policy in [Policy::Oato, Policy::LayerSplit] {
        let p = plan(&prof, &req(policy, true)).unwrap();
        let cpu: Vec<&str> = p
            .order
            .iter()
            .filter(|e| e.device == Device::Cpu)
            .map(|e| e.tensor.as_str())
            .collect();
        assert!(!cpu.is_empty(), "{policy}");
        let mut streamed: Vec<&str> = p.prefill_stream.iter().map(String::as_str).collect();
        streamed.sort();
        let mut want = cpu.clone();
        want.sort();
        assert_eq!(streamed, want, "{policy}");
        assert!(p.stream_min_tokens.is_some_and(|n| (2..=64).contains(&n)));
        assert!(p.budget.stream_bytes > 0, "{policy}: no room reserved");
        let table = render_table(&p);
        assert!(table.contains("stream"), "{table}");
        let back = Placement::from_json(&p.to_json().unwrap(), "test").unwrap();
        assert_eq!(back.prefill_stream, p.prefill_stream);

        let off = plan(&prof, &req(policy, false)).unwrap();
        assert!(off.prefill_stream.is_empty() && off.stream_min_tokens.is_none());
        assert_eq!(off.budget.stream_bytes, 0);
        assert!(off.predicted.ttft_ms > p.predicted.ttft_ms);
    }
    for policy in [Policy::OatoPaper, Policy::Flexgen] {
        let p = plan(&prof, &req(policy, true)).unwrap();
        assert!(p.prefill_stream.is_empty(), "{policy}");
    }
}

/// Four layers of gate and up of one shape, up costlier on the CPU, a free link; 75% of the
/// bytes fit.
fn gate_up_profile(job_us: Option<f64>) -> Profile {
    let mut ops = Vec::new();
    for l in 0..4 {
        let name = |kind: &str| -> &'static str { Box::leak(format!("blk.{l}.{kind}").into()) };
        ops.push(op(name("ffn_gate"), 1, 100.0, 10.0).shape(64, 64));
        ops.push(op(name("ffn_up"), 1, 120.0, 10.0).shape(64, 64));
    }
    let mut prof = profile(&ops);
    prof.host.job_us = job_us;
    // A link so fast that copies cost nothing: the CPU's jobs alone decide.
    if let Some(l) = prof.link.as_mut() {
        l.h2d_gbps = 1e9;
        l.d2h_gbps = 1e9;
    }
    prof
}

/// The layers whose gate and up are both on the CPU.
fn paired_layers(p: &Placement) -> Vec<usize> {
    (0..4)
        .filter(|l| {
            device(p, &format!("blk.{l}.ffn_gate")) == Device::Cpu
                && device(p, &format!("blk.{l}.ffn_up")) == Device::Cpu
        })
        .collect()
}

/// A CPU part of several weights is one job: its time is their sum less `job_us` for each
/// weight after the first, in both passes; the GPU's parts are not jobs of the pool.
#[test]
fn a_cpu_job_of_several_weights_costs_one_fixed_cost() {
    let req = request(Policy::Cpu, Budget::Percent(0.0));
    let at = |job_us: Option<f64>, dev: Device| {
        let m = super::cost::CostModel::new(&gate_up_profile(job_us), &req).unwrap();
        let devices = vec![dev; m.ops.len()];
        m.predict_plan(&devices, &vec![dev; m.n_layer], false, &[])
            .0
    };
    let (plain, joined) = (at(None, Device::Cpu), at(Some(30.0), Device::Cpu));
    // Four layers, each gate + up in one job: 4 x 30 us less in each pass.
    assert!(
        close(plain.decode - joined.decode, 120.0),
        "{plain:?} {joined:?}"
    );
    assert!(
        close(plain.prefill - joined.prefill, 120.0),
        "{plain:?} {joined:?}"
    );
    let (gpu, gpu_j) = (at(None, Device::Gpu), at(Some(30.0), Device::Gpu));
    assert_eq!(gpu, gpu_j);
}

/// Lone gates on the CPU in two layers (as the per-operator order leaves them): with a job's
/// fixed cost in the profile, the improved policy's swap puts one layer's gate and up on the
/// CPU together and the other layer wholly on the GPU (the same bytes each side, one CPU job
/// fewer), predicted faster; without it (the GPU's up beside the CPU's gate is faster) no swap.
/// The whole policy ends with one layer's pair on the CPU too (here by layer-split's placement,
/// which is as fast with its attention beside that layer's weights, and is kept).
#[test]
fn the_oato_policy_pairs_weights_that_share_an_input_when_jobs_cost() {
    let req = request(Policy::Oato, Budget::Percent(75.0));
    let lone = |job_us: Option<f64>| {
        let m = super::cost::CostModel::new(&gate_up_profile(job_us), &req)
            .unwrap()
            .with_shared_costs();
        let mut d: Vec<Device> = m
            .ops
            .iter()
            .map(|o| {
                let lone_gate = o.op == "blk.2.ffn_gate" || o.op == "blk.3.ffn_gate";
                if lone_gate { Device::Cpu } else { Device::Gpu }
            })
            .collect();
        let before = super::oato::predict_resident(&m, &d);
        let swaps = super::oato::pair_cpu_operators(&m, &mut d);
        let after = super::oato::predict_resident(&m, &d);
        let paired: Vec<&str> = m
            .ops
            .iter()
            .zip(&d)
            .filter(|(_, d)| **d == Device::Cpu)
            .map(|(o, _)| o.op.as_str())
            .collect();
        (swaps, before, after, paired.join(" "))
    };
    let (swaps, before, after, cpu) = lone(None);
    assert_eq!((swaps, before), (0, after), "{cpu}");
    let (swaps, before, after, cpu) = lone(Some(50.0));
    assert_eq!(swaps, 1);
    assert_eq!(cpu, "blk.2.ffn_gate blk.2.ffn_up");
    // The CPU's 100 + 100 us in two jobs became 100 + 120 - 50 in one; the GPU's 10 us beside
    // layer 2's gate moved to layer 3: 200 -> 170 + 20 a pass.
    assert!(
        close(before.decode - after.decode, 10.0),
        "{before:?} {after:?}"
    );

    let none = plan(&gate_up_profile(None), &req).unwrap();
    assert!(paired_layers(&none).is_empty(), "{:?}", none.notes);
    let prof = gate_up_profile(Some(50.0));
    let p = plan(&prof, &req).unwrap();
    assert_eq!(paired_layers(&p).len(), 1, "{:?}", p.notes);
    assert_eq!(
        p.order.iter().filter(|e| e.device == Device::Cpu).count(),
        2
    );
    assert!(p.predicted.tpot_ms < none.predicted.tpot_ms);
}

/// The streamed pass's timeline: copies queue back to back ahead of the work while the host is
/// free; a layer waits for its own copy; a layer with a host step holds the next copies back.
#[test]
fn streamed_copies_run_ahead_of_the_work_unless_the_host_waits() {
    use super::cost::Pipeline;
    let run = |prefill: bool, layers: &[(f64, f64, bool)]| {
        let mut p = Pipeline::new(prefill);
        for &(u, c, h) in layers {
            p.layer(u, c, h);
        }
        p.done
    };
    // No copies: the sum of the layers.
    assert_eq!(run(true, &[(0.0, 5.0, false), (0.0, 7.0, true)]), 12.0);
    // Copy-bound: every copy after the last, then the last layer's work (the drain).
    assert_eq!(run(true, &[(10.0, 1.0, false); 4]), 41.0);
    // Compute-bound: the first copy (the fill), then the work back to back.
    assert_eq!(run(true, &[(1.0, 10.0, false); 4]), 41.0);
    // Copies run ahead through unstreamed layers: two layers of 10 without copies, then two
    // streamed ones whose copies of 8 were done during them (the host queued both at once).
    assert_eq!(
        run(
            true,
            &[
                (0.0, 10.0, false),
                (0.0, 10.0, false),
                (8.0, 1.0, false),
                (8.0, 1.0, false)
            ]
        ),
        22.0
    );
    // A layer with a host step: in a prefill the host queues layer 2's copy when it starts
    // layer 1, i.e. when layer 0 (its own step) is done at 10; the copy ends at 18, layer 2 at 19.
    assert_eq!(
        run(
            true,
            &[(0.0, 10.0, true), (0.0, 1.0, true), (8.0, 1.0, false)]
        ),
        19.0
    );
    // In a streamed decode the next layer's copy is queued once the host has left the layer:
    // layer 1 done at 11, the copy of layer 2 from 11 to 19, layer 2 done at 20.
    assert_eq!(
        run(
            false,
            &[(0.0, 10.0, true), (0.0, 1.0, true), (8.0, 1.0, false)]
        ),
        20.0
    );
}

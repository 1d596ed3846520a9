//! The OATO pipeline through the binary, without a GPU: a CPU-backed test device
//! (`OATO_TEST_DEVICE`) stands in for it. profile → plan → run gives the all-CPU tokens under
//! every policy and budget; bad placement files and budgets fail cleanly.

mod common;

use std::path::Path;
use std::process::Output;

use common::{model_path, oato, oato_env, ok, text, tmp_dir};

const DEVICE: (&str, &str) = ("OATO_TEST_DEVICE", "2000000000");

fn fails(out: &Output, want: &str) {
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(err.contains(want), "stderr lacks {want:?}: {err}");
}

/// A greedy `oato run --json` of the test model on two threads: `prompt` (its flags) and `extra`;
/// the JSON and the standard error.
fn run_json(
    dir: &Path,
    prompt: &[&str],
    extra: &[&str],
    env: &[(&str, &str)],
) -> (serde_json::Value, String) {
    let model = model_path();
    let mut args = vec!["run", model.to_str().unwrap()];
    args.extend_from_slice(prompt);
    args.extend_from_slice(&["--temp", "0", "-t", "2", "--json"]);
    args.extend_from_slice(extra);
    let out = oato_env(&args, dir, env);
    (serde_json::from_str(&ok(&out)).unwrap(), text(&out.stderr))
}

/// output_ids of a greedy `oato run --json` with extra flags.
fn run_ids(dir: &Path, extra: &[&str], env: &[(&str, &str)]) -> Vec<u64> {
    let prompt = ["-p", "The capital of France is", "-n", "8"];
    let (v, _) = run_json(dir, &prompt, extra, env);
    v["output_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

/// `oato profile` of the test model, one repetition on two threads, with extra flags.
fn profile(dir: &Path, out_file: &str, extra: &[&str], env: &[(&str, &str)]) -> Output {
    let model = model_path();
    let mut args = vec![
        "profile",
        model.to_str().unwrap(),
        "--reps",
        "1",
        "-t",
        "2",
        "-o",
        out_file,
    ];
    args.extend_from_slice(extra);
    oato_env(&args, dir, env)
}

#[test]
fn profile_plan_run_matches_the_cpu_under_every_policy_and_budget() {
    let dir = tmp_dir("pipeline", "ok");
    let cache = dir.join("cache");
    let cache = cache.to_str().unwrap();
    let env = [DEVICE, ("OATO_CACHE_DIR", cache)];
    let want = run_ids(&dir, &["--device", "cpu"], &[]);

    let out = profile(&dir, "p.json", &[], &env);
    ok(&out);
    assert!(
        text(&out.stderr).contains("profiled"),
        "{}",
        text(&out.stderr)
    );
    let prof: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("p.json")).unwrap()).unwrap();
    assert_eq!(prof["schema"], "oato.profile/v1");
    assert_eq!(prof["operators"].as_array().unwrap().len(), 30 * 7 + 1);
    assert_eq!(prof["model"]["kv_bytes_per_token"], 23040);
    assert!(prof["operators"][0]["gpu_us"]["64"].as_f64().unwrap() > 0.0);
    // The CPU's fixed cost of a matmul job (gate and up apart and as one job), in us.
    let job = prof["host"]["job_us"].as_f64().expect("host.job_us");
    assert!(job.is_finite() && job >= 0.0, "{job}");
    // A second profile comes from the cache.
    let again = profile(&dir, "p2.json", &[], &env);
    assert!(
        text(&again.stderr).contains("cached profile"),
        "{}",
        text(&again.stderr)
    );

    let out = oato(
        &[
            "plan",
            "--profile",
            "p.json",
            "--vram-budget",
            "50%",
            "-o",
            "pl.json",
            "--llama-ot",
        ],
        &dir,
    );
    let table = ok(&out);
    assert!(
        table.contains("rounds:") && table.contains("-ngl 999"),
        "{table}"
    );
    let got = run_ids(&dir, &["--placement", "pl.json"], &env);
    assert_eq!(got, want, "--placement pl.json");

    for policy in ["oato", "layer-split", "flexgen"] {
        for budget in ["25%", "50%", "75%"] {
            let got = run_ids(&dir, &["--vram-budget", budget, "--policy", policy], &env);
            assert_eq!(got, want, "--policy {policy} --vram-budget {budget}");
        }
    }

    // Prefill streaming (rule 5): layer-split at 25% streams its CPU weights for the prompt on
    // a profile where the device computes a prompt batch ten times faster than the CPU and a
    // weight's copy costs as much (the test device's own times are the CPU's, so whether
    // streaming wins there is noise); the table marks them, --llama-ot says llama.cpp cannot,
    // and --no-stream turns it off. Tokens are the same with it, without it, and from 2 tokens on.
    let mut fast = prof.clone();
    for o in fast["operators"].as_array_mut().unwrap() {
        let cpu64 = o["cpu_us"]["64"].as_f64().unwrap();
        o["gpu_us"]["64"] = (cpu64 / 10.0).into();
        o["stream_us"] = (cpu64 / 10.0).into();
    }
    std::fs::write(dir.join("fast.json"), fast.to_string()).unwrap();
    // layer-split at 25% on that profile, written to `out`, with one more flag.
    let plan_ls = |out: &str, flag: &str| {
        oato(
            &[
                "plan",
                "--profile",
                "fast.json",
                "--vram-budget",
                "25%",
                "--policy",
                "layer-split",
                "-o",
                out,
                flag,
            ],
            &dir,
        )
    };
    let table = ok(&plan_ls("ls.json", "--llama-ot"));
    assert!(
        table.contains("  stream  ") && table.contains("llama.cpp has no per-operator streaming"),
        "{table}"
    );
    let ls: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("ls.json")).unwrap()).unwrap();
    assert!(!ls["prefill_stream"].as_array().unwrap().is_empty());
    assert!(!ok(&plan_ls("ls-off.json", "--no-stream")).contains("  stream  "));
    for extra in [
        &["--placement", "ls.json"][..],
        &["--placement", "ls.json", "--stream-min-tokens", "2"],
        &[
            "--placement",
            "ls.json",
            "--stream-min-tokens",
            "2",
            "--ubatch",
            "2",
        ],
        &[
            "--vram-budget",
            "25%",
            "--policy",
            "layer-split",
            "--no-stream",
        ],
    ] {
        assert_eq!(run_ids(&dir, extra, &env), want, "{extra:?}");
    }
}

/// A test's folder, its profile cache inside it, and the test model.
fn setup(name: &str) -> (std::path::PathBuf, String, std::path::PathBuf) {
    let dir = tmp_dir("pipeline", name);
    let cache = dir.join("cache").to_str().unwrap().to_string();
    (dir, cache, model_path())
}

#[test]
fn bad_placements_and_budgets_fail_cleanly() {
    let (dir, cache, model) = setup("bad");
    let env = [DEVICE, ("OATO_CACHE_DIR", cache.as_str())];
    let m = model.to_str().unwrap();
    ok(&oato_env(
        &["profile", m, "--reps", "1", "-t", "2", "-o", "p.json"],
        &dir,
        &env,
    ));
    ok(&oato(
        &[
            "plan",
            "--profile",
            "p.json",
            "--vram-budget",
            "50%",
            "-o",
            "pl.json",
        ],
        &dir,
    ));
    let good: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("pl.json")).unwrap()).unwrap();

    let run_with = |name: &str, v: &str| -> Output {
        std::fs::write(dir.join(name), v).unwrap();
        oato_env(
            &[
                "run",
                m,
                "--placement",
                name,
                "-p",
                "hi",
                "-n",
                "2",
                "-t",
                "2",
            ],
            &dir,
            &env,
        )
    };
    let edit = |f: &dyn Fn(&mut serde_json::Value)| -> String {
        let mut v = good.clone();
        f(&mut v);
        v.to_string()
    };
    fails(
        &run_with(
            "unknown.json",
            &edit(&|v| {
                v["tensors"]["blk.99.ffn_up.weight"] = "gpu".into();
            }),
        ),
        "\"blk.99.ffn_up.weight\", which",
    );
    fails(
        &run_with(
            "missing.json",
            &edit(&|v| {
                v["tensors"]
                    .as_object_mut()
                    .unwrap()
                    .remove("blk.4.attn_v.weight");
            }),
        ),
        "no device for tensor \"blk.4.attn_v.weight\"",
    );
    fails(
        &run_with(
            "over.json",
            &edit(&|v| {
                // The plan may place nothing (on a noisy machine the CPU-backed device's
                // benefits can all come out negative): put one operator there whatever it chose.
                v["tensors"]["blk.4.attn_v.weight"] = "gpu".into();
                v["budget"]["cap_bytes"] = 1000.into();
            }),
        ),
        "over its cap of 0.0 MiB",
    );
    fails(
        &run_with(
            "stream.json",
            &edit(&|v| {
                v["prefill_stream"] = serde_json::json!(["blk.99.ffn_up.weight"]);
            }),
        ),
        "streams tensor \"blk.99.ffn_up.weight\" in prefill, which",
    );
    fails(
        &run_with("malformed.json", "{\"schema\": \"oato.placement/v1\", "),
        "not valid JSON",
    );
    fails(
        &run_with(
            "schema.json",
            &edit(&|v| v["schema"] = "oato.profile/v1".into()),
        ),
        "schema",
    );
    // Budgets.
    fails(
        &oato(
            &["plan", "--profile", "p.json", "--vram-budget", "10M"],
            &dir,
        ),
        "reserv",
    );
    fails(
        &oato(
            &["plan", "--profile", "p.json", "--vram-budget", "12X"],
            &dir,
        ),
        "--vram-budget \"12X\"",
    );
    fails(
        &oato(
            &["plan", "--profile", "missing.json", "--vram-budget", "1G"],
            &dir,
        ),
        "missing.json",
    );
    // Without a GPU (no test device), a GPU placement is refused with the reason.
    if oato::runtime::cuda_backend::probe().is_err() {
        std::fs::write(
            dir.join("one.json"),
            edit(&|v| v["tensors"]["blk.4.attn_v.weight"] = "gpu".into()),
        )
        .unwrap();
        fails(
            &oato(
                &["run", m, "--placement", "one.json", "-p", "hi", "-n", "2"],
                &dir,
            ),
            "there is no GPU",
        );
    }
}

#[test]
fn a_model_too_big_for_the_device_is_refused_or_run_on_the_cpu() {
    let dir = tmp_dir("pipeline", "big");
    let small = [("OATO_TEST_DEVICE", "100000000")];
    let model = model_path();
    let m = model.to_str().unwrap();
    let args = ["run", m, "-p", "hi", "-n", "2", "-t", "2", "--temp", "0"];
    let mut gpu = args.to_vec();
    gpu.extend(["--device", "gpu"]);
    fails(&oato_env(&gpu, &dir, &small), "the model needs");
    let out = oato_env(&args, &dir, &small);
    ok(&out);
    let err = text(&out.stderr);
    assert!(
        err.contains("running on the CPU (split it with --vram-budget)"),
        "{err}"
    );
}

/// A batch above 64 (a long prompt's) is timed on one operator per kind, type and shape and
/// shared by the group, on the CPU and the device; the head is not timed there; the non-target
/// operators are timed at that length.
#[test]
fn long_prompt_batches_are_sampled_per_group() {
    let dir = tmp_dir("pipeline", "sampled");
    let cache = dir.join("cache");
    let env = [DEVICE, ("OATO_CACHE_DIR", cache.to_str().unwrap())];
    let out = profile(&dir, "p.json", &["--batches", "1,64,96"], &env);
    ok(&out);
    let prof: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("p.json")).unwrap()).unwrap();
    let ops = prof["operators"].as_array().unwrap();
    for dev in ["cpu_us", "gpu_us"] {
        let mut by_group: std::collections::BTreeMap<String, Vec<f64>> = Default::default();
        for o in ops {
            let t = &o[dev];
            assert!(t["1"].as_f64().unwrap() > 0.0 && t["64"].as_f64().unwrap() > 0.0);
            if o["layer"].is_null() {
                assert!(t.get("96").is_none(), "the head at 96: {o}");
                continue;
            }
            let key = format!("{}/{}/{}x{}", o["kind"], o["dtype"], o["k"], o["n"]);
            by_group
                .entry(key)
                .or_default()
                .push(t["96"].as_f64().unwrap());
        }
        assert_eq!(by_group.len(), 7, "{dev}: {by_group:?}");
        for (g, times) in &by_group {
            assert_eq!(times.len(), 30, "{dev} {g}");
            assert!(
                times.iter().all(|&t| t == times[0] && t > 0.0),
                "{dev} {g}: {times:?}"
            );
        }
    }
    for dev in ["cpu", "gpu"] {
        let att = &prof["non_target_us"][dev]["attention"];
        assert!(att["96"].as_f64().unwrap() > 0.0, "{dev}: {att}");
    }
}

/// llama.cpp's `-ngl N` on the test device, counted as llama.cpp counts it (the output head, then
/// the last N - 1 layers): no profile, the CPU's tokens for every N, with a 40-token prompt
/// (op-offload streaming of the CPU's weights from 32 tokens) and without streaming; the JSON
/// says `ngl` and the bytes placed; too many layers for the device's memory fail cleanly; without
/// a GPU it runs on the CPU.
#[test]
fn ngl_puts_the_head_and_the_last_layers_on_the_device() {
    let (dir, cache, model) = setup("ngl");
    let env = [DEVICE, ("OATO_CACHE_DIR", cache.as_str())];
    let m = model.to_str().unwrap();
    let long = ["-f", "README.md", "--prompt-tokens", "40", "-n", "6"];
    let run = |extra: &[&str], env: &[(&str, &str)]| run_json(&common::repo(), &long, extra, env);
    let (cpu, _) = run(&["--device", "cpu"], &[]);
    let info = oato(&["inspect", m, "--json"], &dir);
    let info: serde_json::Value = serde_json::from_str(&ok(&info)).unwrap();
    let n_layer = info["hparams"]["n_layer"].as_u64().unwrap() as usize;
    let layer_bytes = |layers: std::ops::Range<usize>| -> u64 {
        info["tensors"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|t| {
                let name = t["name"].as_str().unwrap();
                let target = [
                    "attn_q.",
                    "attn_k.",
                    "attn_v.",
                    "attn_output.",
                    "ffn_gate.",
                    "ffn_up.",
                    "ffn_down.",
                ]
                .iter()
                .any(|k| name.contains(k));
                target && oato::profiler::layer_of(name).is_some_and(|l| layers.contains(&l))
            })
            .map(|t| t["bytes"].as_u64().unwrap())
            .sum()
    };
    for (flags, n) in [
        (&["-ngl", "0"][..], 0),
        (&["-ngl", "10"][..], 10),
        (&["--n-gpu-layers", "10", "--no-stream"][..], 10),
        (&["--ngl", "30"][..], 30),
        (&["-ngl", "31"][..], 31),
        (&["-ngl", "99"][..], 99),
    ] {
        let (v, err) = run(flags, &env);
        assert_eq!(v["output_ids"], cpu["output_ids"], "{flags:?}: {err}");
        assert_eq!(v["policy"], "ngl", "{flags:?}");
        assert!(!err.contains("profile"), "{flags:?} profiled: {err}");
        let gpu = v["gpu_weight_bytes"].as_u64().unwrap();
        let all = v["target_weight_bytes"].as_u64().unwrap();
        let head = all - layer_bytes(0..n_layer);
        let want = match n {
            0 => 0,
            _ => head + layer_bytes((n_layer + 1).saturating_sub(n)..n_layer),
        };
        assert_eq!(gpu, want, "{flags:?}");
        assert_eq!(n > n_layer, gpu == all, "{flags:?}");
        // 40 tokens stream the CPU's weights (llama.cpp's op offload from 32): the activations
        // of the CPU's layers cross for each streamed product.
        let prefill = v["crossings_prefill"].as_u64().unwrap();
        let streams = n <= n_layer && !flags.contains(&"--no-stream");
        assert_eq!(
            prefill > 2,
            streams,
            "{flags:?}: {prefill} prefill crossings"
        );
    }
    let small = [("OATO_TEST_DEVICE", "30000000")];
    let out = oato_env(
        &["run", m, "-p", "hi", "-n", "2", "-ngl", "99"],
        &dir,
        &small,
    );
    fails(&out, "-ngl 99: the model needs");
    let out = oato_env(
        &["run", m, "-p", "hi", "-n", "2", "-ngl", "10"],
        &dir,
        &small,
    );
    fails(&out, "give fewer layers");
    let out = oato(
        &["run", m, "-p", "hi", "-ngl", "3", "--vram-budget", "50%"],
        &dir,
    );
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    if oato::runtime::cuda_backend::probe().is_err() {
        let (v, err) = run(&["-ngl", "10"], &[]);
        assert_eq!(v["output_ids"], cpu["output_ids"]);
        assert!(err.contains("running on the CPU"), "{err}");
    }
}

/// `fits_layers` (llama.cpp's -ngl count) on a device too small for anything: the weights and KV
/// cache it names grow with N from none at 0, reach the whole model's at n_layer + 1, and stay
/// there past it.
#[test]
fn ngl_memory_grows_with_the_layers() {
    let model = oato::model::Model::open(model_path()).unwrap();
    let tiny = oato::runtime::test_device::TestDevice::new(1 << 20);
    let n_layer = model.hp.n_layer;
    // (weights MiB, KV MiB) from the refusal's text.
    let parts = |n: usize| -> (f64, f64) {
        let why = oato::engine::fits_layers(&model, n, 256, 8, &tiny).unwrap_err();
        let num = |unit: &str| -> f64 {
            let end = why
                .find(unit)
                .unwrap_or_else(|| panic!("{unit:?} in {why}"));
            why[..end]
                .rsplit(['(', '+'])
                .next()
                .unwrap()
                .trim()
                .parse()
                .unwrap()
        };
        (num(" MiB of weights"), num(" MiB of KV cache"))
    };
    let all: Vec<(f64, f64)> = (0..=n_layer + 3).map(parts).collect();
    assert_eq!(all[0], (0.0, 0.0), "-ngl 0 puts nothing on the device");
    assert!(
        all[1].0 > 0.0 && all[1].1 == 0.0,
        "-ngl 1: the head only: {:?}",
        all[1]
    );
    for w in all.windows(2) {
        assert!(w[1].0 >= w[0].0 && w[1].1 >= w[0].1, "{all:?}");
    }
    assert_eq!(all[n_layer + 1], all[n_layer + 3]);
    // The whole model's check is the same count at n_layer + 1.
    let whole = oato::engine::fits_whole(&model, 256, 8, &tiny).unwrap_err();
    let at = oato::engine::fits_layers(&model, n_layer + 1, 256, 8, &tiny).unwrap_err();
    assert_eq!(whole, at);
    assert!(whole.starts_with("the model needs"), "{whole}");
}

//! `oato bench` end to end on the real model with tiny settings: the markdown table, CSV and
//! JSON (llama-bench's field names and arithmetic), and clean failures on bad flags.

mod common;

use std::process::{Command, Output};

use common::{model_path, repo};

fn bench(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_oato"))
        .arg("bench")
        .args(args)
        .current_dir(repo())
        .env_remove("OATO_MODEL")
        .env_remove("OATO_CPU_ISA")
        .output()
        .expect("the oato binary runs")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

const TINY: &[&str] = &["-p", "8", "-n", "4", "-r", "2", "-t", "1"];

fn ok(out: &Output) -> String {
    assert!(out.status.success(), "failed: {}", text(&out.stderr));
    text(&out.stdout)
}

#[test]
fn markdown_table_has_one_row_per_test() {
    // No model argument: the default model, as `oato run`.
    let s = ok(&bench(TINY));
    let rows: Vec<&str> = s.lines().filter(|l| l.starts_with('|')).collect();
    assert_eq!(rows.len(), 4, "header, rule, pp8, tg4:\n{s}");
    for col in [
        "model", "size", "params", "backend", "isa", "threads", "test", "t/s",
    ] {
        assert!(rows[0].contains(col), "header lacks {col}: {}", rows[0]);
    }
    assert!(
        !rows[0].contains("ngl"),
        "an ngl column without -ngl: {}",
        rows[0]
    );
    assert!(
        rows[2].contains("llama 135M Q4_1") && rows[2].contains(" pp8 "),
        "{}",
        rows[2]
    );
    assert!(
        rows[2].contains("92.10 MiB") && rows[2].contains("134.52 M"),
        "{}",
        rows[2]
    );
    assert!(
        rows[3].contains(" tg4 ") && rows[3].contains(" ± "),
        "{}",
        rows[3]
    );
    assert!(s.contains("\nbuild: "), "{s}");
}

/// Models named with llama-bench's `-m` (repeatable), after those given as arguments: one row
/// per model and test.
#[test]
fn dash_m_names_models_as_llama_bench() {
    let m = model_path();
    let m = m.to_str().unwrap();
    let mut args = vec!["-m", m, "-m", m];
    args.extend_from_slice(TINY);
    let s = ok(&bench(&args));
    let rows: Vec<&str> = s.lines().filter(|l| l.starts_with('|')).collect();
    assert_eq!(rows.len(), 6, "header, rule, pp8 and tg4 twice:\n{s}");
    assert!(
        rows[2..].iter().all(|r| r.contains("llama 135M Q4_1")),
        "{s}"
    );
}

#[test]
fn csv_has_a_header_and_one_row_per_test() {
    let m = model_path();
    let mut args = vec![m.to_str().unwrap(), "--csv"];
    args.extend(TINY);
    let s = ok(&bench(&args));
    let lines: Vec<&str> = s.lines().collect();
    assert_eq!(lines.len(), 3, "{s}");
    let header: Vec<&str> = lines[0].split(',').collect();
    for f in [
        "build_commit",
        "model_type",
        "n_prompt",
        "n_gen",
        "avg_ts",
        "isa",
        "device",
    ] {
        assert!(header.contains(&f), "no {f} in {}", lines[0]);
    }
    let col = |name: &str, line: &str| {
        let i = header.iter().position(|h| *h == name).unwrap();
        line.split(',')
            .nth(i)
            .unwrap()
            .trim_matches('"')
            .to_string()
    };
    assert_eq!(
        (col("n_prompt", lines[1]), col("n_gen", lines[1])),
        ("8".into(), "0".into())
    );
    assert_eq!(
        (col("n_prompt", lines[2]), col("n_gen", lines[2])),
        ("0".into(), "4".into())
    );
    assert_eq!(col("device", lines[1]), "cpu");
}

#[test]
fn json_uses_llama_bench_fields_and_arithmetic() {
    let m = model_path();
    let mut args = vec![m.to_str().unwrap(), "--json"];
    args.extend(TINY);
    let s = ok(&bench(&args));
    let v: serde_json::Value = serde_json::from_str(&s).expect("one JSON document");
    let tests = v.as_array().expect("an array");
    assert_eq!(tests.len(), 2);
    for t in tests {
        for f in [
            "build_commit",
            "build_number",
            "cpu_info",
            "gpu_info",
            "backends",
            "model_filename",
            "model_type",
            "model_size",
            "model_n_params",
            "n_threads",
            "n_gpu_layers",
            "n_prompt",
            "n_gen",
            "n_depth",
            "test_time",
            "avg_ns",
            "stddev_ns",
            "avg_ts",
            "stddev_ts",
            "samples_ns",
            "samples_ts",
            "isa",
            "device",
        ] {
            assert!(t.get(f).is_some(), "no {f} in {t}");
        }
        assert_eq!(t["model_type"], "llama 135M Q4_1");
        assert_eq!(
            t["model_size"], 96_576_768,
            "bytes of all tensors, as llama-bench"
        );
        assert_eq!(t["model_n_params"], 134_515_008);
        assert_eq!(t["n_threads"], 1);
        assert_eq!(t["n_gpu_layers"], 0, "the whole model on the CPU");
        assert_eq!(t["backends"], "CPU");
        assert_eq!(t["device"], "cpu");
        let n = (t["n_prompt"].as_u64().unwrap() + t["n_gen"].as_u64().unwrap()) as f64;
        let ns: Vec<u64> = t["samples_ns"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect();
        let ts: Vec<f64> = t["samples_ts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        assert_eq!(ns.len(), 2, "one sample per repetition");
        assert_eq!(ts.len(), 2);
        for (&t_ns, &r) in ns.iter().zip(&ts) {
            assert!(
                (r - n * 1e9 / t_ns as f64).abs() <= 1e-9 * r,
                "{r} vs {t_ns} ns"
            );
        }
        let avg_ns = t["avg_ns"].as_u64().unwrap();
        assert_eq!(avg_ns, ns.iter().sum::<u64>() / 2);
        let avg_ts = t["avg_ts"].as_f64().unwrap();
        assert!((avg_ts - (ts[0] + ts[1]) / 2.0).abs() <= 1e-9 * avg_ts);
        // The mean of rates is at least the rate of the mean time (AM-HM), and close to it.
        // (From the exact mean time: avg_ns is truncated to whole nanoseconds.)
        let rate_of_mean = n / (ns.iter().sum::<u64>() as f64 / 2.0 / 1e9);
        assert!(
            avg_ts >= rate_of_mean * (1.0 - 1e-9) && avg_ts < rate_of_mean * 2.0,
            "avg_ts {avg_ts} vs n / avg_ns {rate_of_mean}"
        );
        let sd = t["stddev_ts"].as_f64().unwrap();
        assert!((sd - (ts[0] - ts[1]).abs() / 2f64.sqrt()).abs() <= 1e-9 * sd.max(1.0));
    }
    assert_eq!(tests[0]["n_prompt"], 8);
    assert_eq!(tests[0]["n_gen"], 0);
    assert_eq!(tests[1]["n_prompt"], 0);
    assert_eq!(tests[1]["n_gen"], 4);
    // Decode on the CPU also gives the weight bytes a token reads (the matmuls' weights: the
    // file's size less the embedding table, norms and such) and the memory's rates measured
    // after the warm-up and after each run; prefill neither.
    assert!(tests[0].get("weight_bytes_per_token").is_none());
    assert!(tests[0].get("membw_gbps").is_none());
    let per_token = tests[1]["weight_bytes_per_token"].as_u64().unwrap();
    assert!(
        per_token > 96_576_768 / 2 && per_token < 96_576_768,
        "{per_token}"
    );
    let rates = tests[1]["membw_gbps"].as_array().unwrap();
    assert_eq!(rates.len(), 3, "one before the runs, one after each of two");
    assert!(rates.iter().all(|r| r.as_f64().unwrap() > 0.0), "{rates:?}");
    // And, after the timed runs, each of its tokens (up to 32) set against plain reads of as
    // many bytes just before and after it.
    assert!(tests[0].get("membw_paired_fractions").is_none());
    let paired = tests[1]["membw_paired_fractions"].as_array().unwrap();
    assert_eq!(paired.len(), 4, "one per generated token");
    assert!(
        paired.iter().all(|f| f.as_f64().unwrap() > 0.0),
        "{paired:?}"
    );
}

#[test]
fn bad_flags_fail_cleanly() {
    for (args, want) in [
        (&["-r", "0"][..], "-r 0"),
        (&["-p", "abc"], "\"abc\" is not a whole number"),
        (&["-n", "4,"], "empty item"),
        (&["-t", ""], "empty item"),
        (&["-p", "0", "-n", "0"], "nothing to run"),
        (&["no-such-model.gguf", "-p", "8"], "no-such-model.gguf"),
        (&["Cargo.toml", "-p", "8"], "not a GGUF file"),
        (&["-pg", "8"], "not two comma-separated numbers"),
        (&["--pg", "8,4,2"], "not two comma-separated numbers"),
        (&["-pg", "0,0"], "both lengths are 0"),
        (&["-pg", "8,x"], "\"x\" is not a whole number"),
        (&["-d", "16,x"], "-d \"16,x\""),
        (&["-ngl", "1,y"], "-ngl \"1,y\""),
    ] {
        let out = bench(args);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: stderr lacks {want:?}: {err}");
        assert!(out.stdout.is_empty(), "{args:?} printed results");
    }
}

/// `--membw` measures the read bandwidth per thread count and refuses sizes the caches hold; a
/// generation test on the CPU reports the weights' read rate as a fraction of it.
#[test]
fn membw_and_decode_fraction() {
    let s = ok(&bench(&["--membw", "64M", "-t", "1,2"]));
    let rows: Vec<&str> = s.lines().filter(|l| l.starts_with("| ")).collect();
    assert_eq!(rows.len(), 3, "header and two thread counts:\n{s}");
    for row in &rows[1..] {
        let gbps: f64 = row.split('|').nth(2).unwrap().trim().parse().unwrap();
        assert!(gbps > 0.0, "{row}");
    }
    let out = bench(&["--membw", "1M"]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("at least 64M"),
        "{}",
        text(&out.stderr)
    );
    let out = bench(&["--membw", "lots"]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("--membw"),
        "{}",
        text(&out.stderr)
    );

    let out = bench(&[
        "--device", "cpu", "-p", "0", "-n", "2", "-r", "1", "-t", "1",
    ]);
    ok(&out);
    let err = text(&out.stderr);
    assert!(
        err.contains("tg2 reads") && err.contains("GB/s this machine reads at 1 threads"),
        "{err}"
    );
}

/// llama-bench's prompt+generation test (`-pg PP,TG`, timed together, PP + TG tokens over the
/// time) and depth (`-d N`: N tokens in the cache before each run, untimed, "@ dN" in the test's
/// name, `n_depth` in the JSON), alone and crossed with -p / -n.
#[test]
fn prompt_plus_generation_and_depth() {
    let m = model_path();
    let args = [
        m.to_str().unwrap(),
        "--json",
        "-p",
        "0",
        "-n",
        "2",
        "-pg",
        "8,2",
        "-d",
        "0,16",
        "-r",
        "1",
        "-t",
        "1",
    ];
    let s = ok(&bench(&args));
    let v: serde_json::Value = serde_json::from_str(&s).expect("one JSON document");
    let tests = v.as_array().expect("an array");
    let got: Vec<(u64, u64, u64)> = tests
        .iter()
        .map(|t| {
            let f = |k: &str| t[k].as_u64().unwrap();
            (f("n_prompt"), f("n_gen"), f("n_depth"))
        })
        .collect();
    assert_eq!(got, [(0, 2, 0), (0, 2, 16), (8, 2, 0), (8, 2, 16)]);
    for t in tests {
        // Rates over the test's own tokens, not the depth's.
        let n = (t["n_prompt"].as_u64().unwrap() + t["n_gen"].as_u64().unwrap()) as f64;
        let ns = t["samples_ns"][0].as_u64().unwrap() as f64;
        let ts = t["samples_ts"][0].as_f64().unwrap();
        assert!((ts - n * 1e9 / ns).abs() <= 1e-9 * ts, "{t}");
    }
    // Decode's weight fraction only at depth 0, where the weights are what it reads.
    assert!(tests[0].get("membw_gbps").is_some());
    assert!(tests[1].get("membw_gbps").is_none());

    let md = ok(&bench(&[
        m.to_str().unwrap(),
        "-p",
        "4",
        "-n",
        "0",
        "-pg",
        "4,1",
        "-d",
        "8",
        "-r",
        "1",
        "-t",
        "1",
    ]));
    let rows: Vec<&str> = md.lines().filter(|l| l.starts_with('|')).collect();
    assert_eq!(rows.len(), 4, "header, rule, two tests:\n{md}");
    assert!(rows[2].contains(" pp4 @ d8 "), "{}", rows[2]);
    assert!(rows[3].contains(" pp4+tg1 @ d8 "), "{}", rows[3]);
}

/// llama-bench's `-ngl` list on the test device: each value's tests in turn, its `ngl` column and
/// `n_gpu_layers` field; the weights placed as `oato run -ngl` places them (its tests check the
/// tokens); a split too big for the device fails before any timing.
#[test]
fn ngl_runs_each_split_in_turn() {
    let run = |args: &[&str], device: &str| {
        Command::new(env!("CARGO_BIN_EXE_oato"))
            .arg("bench")
            .args(args)
            .current_dir(repo())
            .env_remove("OATO_MODEL")
            .env("OATO_TEST_DEVICE", device)
            .output()
            .expect("the oato binary runs")
    };
    let m = model_path();
    let m = m.to_str().unwrap();
    let s = ok(&run(
        &[
            m, "-ngl", "0,10", "-p", "40", "-n", "2", "-r", "1", "-t", "1",
        ],
        "4000000000",
    ));
    let rows: Vec<&str> = s.lines().filter(|l| l.starts_with('|')).collect();
    assert_eq!(rows.len(), 6, "header, rule, 2 x (pp40, tg2):\n{s}");
    assert!(rows[0].contains(" ngl "), "{}", rows[0]);
    let ngl: Vec<&str> = rows[2..]
        .iter()
        .map(|r| r.split('|').nth(5).unwrap().trim())
        .collect();
    assert_eq!(ngl, ["0", "0", "10", "10"], "{s}");
    let j = ok(&run(
        &[
            m,
            "--n-gpu-layers",
            "3",
            "-p",
            "0",
            "-n",
            "2",
            "-r",
            "1",
            "-t",
            "1",
            "--json",
        ],
        "4000000000",
    ));
    let v: serde_json::Value = serde_json::from_str(&j).unwrap();
    assert_eq!(v[0]["n_gpu_layers"], 3);
    let out = run(
        &[m, "-ngl", "99", "-p", "8", "-n", "0", "-r", "1"],
        "30000000",
    );
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("-ngl 99: the model needs"), "{err}");
    assert!(
        out.stdout.iter().filter(|&&b| b == b'\n').count() <= 2,
        "timed before failing"
    );
}

//! The `oato` binary end to end: inspect, run, perplexity on the real model, and clear errors
//! (non-zero exit, a message naming the problem, no panic) on bad files and flags.

mod common;

use std::process::Output;

use oato::gguf::{GgufWriter, Value};
use oato::quant::GgmlType;

use common::{golden, golden_dir, ids, model_path, oato, oato_env, repo, text, tmp_dir};

/// Asserts a clean failure: exit code 1 or 2, `want` in stderr, no panic.
fn assert_fails(out: &Output, want: &str) {
    let err = text(&out.stderr);
    assert!(!out.status.success(), "succeeded; stderr: {err}");
    assert!(
        matches!(out.status.code(), Some(1 | 2)),
        "exit {:?}: {err}",
        out.status.code()
    );
    assert!(!err.contains("panicked"), "panicked: {err}");
    assert!(err.contains(want), "stderr lacks {want:?}: {err}");
}

#[test]
fn inspect_prints_tables_and_json() {
    let m = model_path();
    let out = oato(&["inspect", m.to_str().unwrap()], &repo());
    assert!(out.status.success(), "{}", text(&out.stderr));
    let s = text(&out.stdout);
    for want in [
        "architecture: llama",
        "n_layer 30",
        "gpt2",
        "blk.0.attn_q.weight",
        "[576, 576]",
        "Q4_1",
        "272 tensors",
    ] {
        assert!(s.contains(want), "inspect output lacks {want:?}:\n{s}");
    }

    let out = oato(&["inspect", "--json", m.to_str().unwrap()], &repo());
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["arch"], "llama");
    assert_eq!(v["metadata"]["llama.block_count"], 30);
    assert_eq!(v["metadata"]["tokenizer.ggml.tokens"]["len"], 49152);
    let tensors = v["tensors"].as_array().unwrap();
    assert_eq!(tensors.len(), 272);
    let embd = tensors
        .iter()
        .find(|t| t["name"] == "token_embd.weight")
        .unwrap();
    assert_eq!(embd["shape"], serde_json::json!([576, 49152]));
    assert_eq!(embd["type"], "Q8_0");
    assert_eq!(embd["bytes"], 30081024);
    let total: u64 = tensors.iter().map(|t| t["bytes"].as_u64().unwrap()).sum();
    assert_eq!(v["totals"]["bytes"], total);
}

#[test]
fn run_streams_the_golden_text_and_reports_timings() {
    let g = golden();
    let p = &g["prompts"][0];
    let out = oato(
        &[
            "run",
            "-p",
            p["prompt"].as_str().unwrap(),
            "-n",
            "32",
            "--temp",
            "0",
        ],
        &repo(),
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout).trim_end_matches('\n'),
        p["output_text"].as_str().unwrap()
    );
    let err = text(&out.stderr);
    for want in ["load:", "TTFT", "TPOT", "tokens/s", "5 tokens"] {
        assert!(err.contains(want), "stderr lacks {want:?}: {err}");
    }
}

/// `run --json` on golden prompt 1, with `extra` flags: the parsed output after checking the ids.
fn run_golden_json(extra: &[&str]) -> serde_json::Value {
    let g = golden();
    let p = &g["prompts"][1];
    let mut args = vec![
        "run",
        "--json",
        "-p",
        p["prompt"].as_str().unwrap(),
        "-n",
        "6",
        "--temp",
        "0",
    ];
    args.extend_from_slice(extra);
    let out = oato(&args, &repo());
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(ids(&v["prompt_ids"]), ids(&p["prompt_ids"]));
    assert_eq!(ids(&v["output_ids"]), ids(&p["output_ids"])[..6].to_vec());
    v
}

/// `--no-mmap` reads the model into memory, `--mmap` maps it, and both compute the same tokens;
/// the two together are a usage error.
#[test]
fn run_with_and_without_mmap_gives_the_golden_ids() {
    run_golden_json(&["--no-mmap"]);
    run_golden_json(&["--mmap"]);
    let out = oato(&["run", "--mmap", "--no-mmap", "-p", "x"], &repo());
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(err.contains("--mmap") && err.contains("--no-mmap"), "{err}");
}

/// The model named as llama.cpp's tools take it (`-m`) runs as when named as the argument; both
/// at once is a usage error naming the two.
#[test]
fn run_takes_the_model_with_dash_m() {
    let m = model_path();
    let m = m.to_str().unwrap();
    run_golden_json(&["-m", m]);
    let out = oato(&["run", m, "-m", m, "-p", "x"], &repo());
    assert_fails(&out, "--model");
    assert!(
        text(&out.stderr).contains("[MODEL]"),
        "{}",
        text(&out.stderr)
    );
}

/// `--no-warmup` skips the untimed first run of the prompt and says so; the tokens are the same
/// (the warm-up's reset leaves nothing behind). The step trace counts the prompt's forward calls:
/// two with the warm-up, one without.
#[test]
fn run_without_warmup_gives_the_golden_ids() {
    assert_eq!(run_golden_json(&["--no-warmup"])["warmup"], false);
    let g = golden();
    let p = &g["prompts"][1];
    let n_prompt = ids(&p["prompt_ids"]).len();
    let prefills = |extra: &[&str]| {
        let mut args = vec![
            "run",
            "-p",
            p["prompt"].as_str().unwrap(),
            "-n",
            "2",
            "--temp",
            "0",
        ];
        args.extend_from_slice(extra);
        let out = oato_env(&args, &repo(), &[("OATO_TRACE_STEPS", "1")]);
        assert!(out.status.success(), "{}", text(&out.stderr));
        let err = text(&out.stderr);
        let head = format!("n={n_prompt} ");
        err.lines()
            .find(|l| l.contains("(whole forward)") && l.trim_start().starts_with(&head))
            .unwrap_or_else(|| panic!("no whole-forward line for {n_prompt} tokens:\n{err}"))
            .to_string()
    };
    let twice = prefills(&[]);
    assert!(twice.ends_with("(2 calls)"), "{twice}");
    let once = prefills(&["--no-warmup"]);
    assert!(once.ends_with("(1 calls)"), "{once}");
}

#[test]
fn run_json_gives_ids_text_and_timings() {
    let v = run_golden_json(&[]);
    assert_eq!(v["warmup"], true);
    for key in ["load_ms", "ttft_ms", "tpot_ms", "e2e_ms"] {
        assert!(v[key].as_f64().unwrap() > 0.0, "{key} = {}", v[key]);
    }
    let e2e = v["e2e_ms"].as_f64().unwrap();
    let want_tpot = (e2e - v["ttft_ms"].as_f64().unwrap()) / 5.0;
    assert!((v["tpot_ms"].as_f64().unwrap() - want_tpot).abs() < 1e-6);
}

#[test]
fn chat_output_ends_with_the_end_of_generation_token() {
    let out = oato(
        &[
            "run",
            "--json",
            "--chat",
            "-p",
            "Say only the word yes.",
            "--temp",
            "0",
            "-n",
            "40",
        ],
        &repo(),
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    // ChatML around the prompt: <|im_start|> is id 1 in SmolLM2's vocabulary.
    assert_eq!(v["prompt_ids"][0], 1);
    assert_eq!(v["stopped_on_eog"], true);
    // <|im_end|> (id 2) closes the answer, as llama.cpp's output would show it.
    assert_eq!(v["output_ids"].as_array().unwrap().last().unwrap(), 2);
    assert!(
        v["text"].as_str().unwrap().to_lowercase().contains("yes"),
        "{}",
        v["text"]
    );
}

#[test]
fn perplexity_json_on_a_short_text() {
    let dir = tmp_dir("cli", "ppl");
    let full = std::fs::read_to_string(golden_dir().join("gpl3_2000w.txt")).unwrap();
    let short: String = full.chars().take(1200).collect();
    let f = dir.join("short.txt");
    std::fs::write(&f, short).unwrap();
    let m = model_path();
    let out = oato(
        &[
            "perplexity",
            m.to_str().unwrap(),
            "-f",
            f.to_str().unwrap(),
            "--ctx",
            "64",
            "--json",
        ],
        &repo(),
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let tokens = v["tokens"].as_u64().unwrap();
    assert!(tokens > 128, "{tokens} tokens");
    assert_eq!(v["windows"].as_u64().unwrap(), tokens / 64);
    assert_eq!(v["scored"].as_u64().unwrap(), tokens / 64 * 31);
    let ppl = v["ppl"].as_f64().unwrap();
    // A 135M model on licence text with 32 tokens of context: far better than chance (49152).
    assert!(ppl > 1.0 && ppl < 500.0, "ppl {ppl}");

    let out = oato(
        &[
            "perplexity",
            m.to_str().unwrap(),
            "-f",
            f.to_str().unwrap(),
            "--ctx",
            "4096",
        ],
        &repo(),
    );
    assert_fails(&out, "fewer than one window");
}

#[test]
fn missing_default_model_names_the_fetch_command() {
    let dir = tmp_dir("cli", "empty");
    let out = oato(&["run", "-p", "hi"], &dir);
    assert_fails(&out, "scripts/fetch-models.sh");
}

#[test]
fn bad_files_and_flags_fail_cleanly() {
    let dir = tmp_dir("cli", "bad");
    let m = std::fs::read(model_path()).unwrap();
    let truncated = dir.join("truncated.gguf");
    std::fs::write(&truncated, &m[..10_000_000]).unwrap();
    for cmd in ["inspect", "run"] {
        let mut args = vec![cmd, truncated.to_str().unwrap()];
        if cmd == "run" {
            args.extend(["-p", "hi"]);
        }
        assert_fails(&oato(&args, &dir), "runs past the end of the file");
    }
    let not_gguf = dir.join("text.gguf");
    std::fs::write(&not_gguf, b"hello, this is not a model").unwrap();
    assert_fails(
        &oato(&["inspect", not_gguf.to_str().unwrap()], &dir),
        "wrong magic",
    );
    assert_fails(
        &oato(&["inspect", "/nonexistent.gguf"], &dir),
        "/nonexistent.gguf",
    );

    // A model whose weight has a type oato cannot read.
    let mut w = GgufWriter::new();
    w.set("general.architecture", Value::String("llama".into()));
    w.add_tensor_raw("token_embd.weight", &[256, 4], 16, vec![0; 4 * 66]);
    let iq = dir.join("iq.gguf");
    w.write(&iq).unwrap();
    assert_fails(
        &oato(&["run", iq.to_str().unwrap(), "-p", "hi"], &dir),
        "IQ2_XXS",
    );

    // A runnable header without the tensors a llama model needs.
    let mut w = GgufWriter::new();
    w.set("general.architecture", Value::String("llama".into()));
    for (k, v) in [
        ("embedding_length", 64),
        ("block_count", 1),
        ("attention.head_count", 4),
        ("feed_forward_length", 128),
    ] {
        w.set(&format!("llama.{k}"), Value::U32(v));
    }
    w.add_tensor(
        "token_embd.weight",
        &[64, 8],
        GgmlType::F32,
        vec![0; 64 * 8 * 4],
    )
    .unwrap();
    let partial = dir.join("partial.gguf");
    w.write(&partial).unwrap();
    assert_fails(
        &oato(&["run", partial.to_str().unwrap(), "-p", "hi"], &dir),
        "output_norm.weight",
    );

    let mut w = GgufWriter::new();
    w.set("general.architecture", Value::String("mamba".into()));
    let arch = dir.join("arch.gguf");
    w.write(&arch).unwrap();
    assert_fails(
        &oato(&["run", arch.to_str().unwrap(), "-p", "hi"], &dir),
        "\"mamba\" is not supported",
    );

    let mp = model_path();
    let m = mp.to_str().unwrap();
    assert_fails(
        &oato(&["run", m, "-p", "hi", "--temp", "-1"], &dir),
        "--temp",
    );
    assert_fails(
        &oato(&["run", m, "-p", "hi", "--top-p", "0"], &dir),
        "--top-p",
    );
    assert_fails(&oato(&["run", m], &dir), "-p TEXT");
    assert_fails(
        &oato(&["run", m, "-p", "hi", "-n", "100", "--ctx", "50"], &dir),
        "exceed --ctx 50",
    );
    // -c 0 is the model's training context (llama.cpp's reading): the test model's 8192.
    assert_fails(
        &oato(&["run", m, "-p", "hi", "-n", "9000", "-c", "0"], &dir),
        "exceed --ctx 8192",
    );
    assert_fails(&oato(&["run", "--bogus"], &dir), "--bogus");
    assert_fails(&oato(&["inspect"], &dir), "FILE");
}

//! `oato synth`: the real shapes' tensor tables and llama-quantize type mixes (from the library,
//! without writing their gigabytes), and on the hidden `tiny` shapes, files that `oato inspect`
//! reads back, that run with finite logits, give the same greedy tokens on the CPU and placed on the
//! CPU-backed test device, and that the seed alone decides.

mod common;

use oato::gguf::GgufFile;
use oato::model::Model;
use oato::model::synth::{SynthShape, SynthTensor, SynthType, tensor_table, write_synth};
use oato::quant::{GgmlType, dequantize_row};
use oato::runtime::forward::{Logits, Session};

use common::{ids, oato, oato_env, ok, text, tmp_dir};
use serde_json::json;

fn table(shape: SynthShape, ty: SynthType) -> Vec<SynthTensor> {
    tensor_table(&shape.spec(), ty).unwrap()
}

fn find<'a>(t: &'a [SynthTensor], name: &str) -> &'a SynthTensor {
    t.iter()
        .find(|t| t.entry.name == name)
        .unwrap_or_else(|| panic!("no tensor {name}"))
}

/// Layers whose `suffix` tensor has type `ty`.
fn layers_of(t: &[SynthTensor], suffix: &str, ty: GgmlType) -> Vec<usize> {
    t.iter()
        .filter(|t| t.ty == ty)
        .filter_map(|t| t.entry.name.strip_suffix(suffix)?.strip_prefix("blk."))
        .map(|i| i.trim_end_matches('.').parse().unwrap())
        .collect()
}

#[test]
fn real_shapes_have_the_published_tensor_tables() {
    // (shape, tensors, parameters as their model cards give them, an output.weight)
    for (shape, n_tensors, params, untied) in [
        (SynthShape::Llama3_8B, 291, 8_030_261_248u64, true),
        (SynthShape::Llama3_2_1B, 146, 1_235_814_400, false),
        (SynthShape::QwQ32B, 771, 32_763_876_352, true),
    ] {
        let t = table(shape, SynthType::Q4_K_M);
        assert_eq!(t.len(), n_tensors, "{shape:?}");
        let p: u64 = t.iter().map(|t| t.entry.dims.iter().product::<u64>()).sum();
        assert_eq!(p, params, "{shape:?}");
        assert_eq!(
            t.iter().any(|t| t.entry.name == "output.weight"),
            untied,
            "{shape:?}"
        );
    }
    let t = table(SynthShape::Llama3_8B, SynthType::F16);
    assert_eq!(find(&t, "token_embd.weight").entry.dims, [4096, 128256]);
    assert_eq!(find(&t, "blk.31.attn_k.weight").entry.dims, [4096, 1024]);
    assert_eq!(find(&t, "blk.31.ffn_down.weight").entry.dims, [14336, 4096]);
    assert_eq!(find(&t, "output_norm.weight").ty, GgmlType::F32);
    assert!(
        t.iter()
            .all(|t| t.ty == GgmlType::F16 || t.entry.dims.len() == 1)
    );
    let t = table(SynthShape::QwQ32B, SynthType::Q8_0);
    assert_eq!(find(&t, "blk.63.attn_q.bias").entry.dims, [5120]);
    assert_eq!(find(&t, "blk.63.attn_v.bias").ty, GgmlType::F32);
    assert_eq!(find(&t, "blk.0.ffn_up.weight").entry.dims, [5120, 27648]);
    assert_eq!(find(&t, "output.weight").ty, GgmlType::Q8_0);
}

#[test]
fn quantised_types_mix_as_llama_quantize_mixes_them() {
    let more_bits_32 = [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31];
    let t = table(SynthShape::Llama3_8B, SynthType::Q4_K_M);
    assert_eq!(
        layers_of(&t, ".attn_v.weight", GgmlType::Q6_K),
        more_bits_32
    );
    assert_eq!(
        layers_of(&t, ".ffn_down.weight", GgmlType::Q6_K),
        more_bits_32
    );
    assert_eq!(find(&t, "output.weight").ty, GgmlType::Q6_K);
    assert_eq!(find(&t, "token_embd.weight").ty, GgmlType::Q4_K);
    let q6: Vec<_> = t.iter().filter(|t| t.ty == GgmlType::Q6_K).collect();
    assert_eq!(q6.len(), 33);
    assert!(layers_of(&t, ".attn_q.weight", GgmlType::Q4_K).len() == 32);
    // Tied embeddings are the head: llama-quantize gives them the head's type.
    let t = table(SynthShape::Llama3_2_1B, SynthType::Q4_K_M);
    assert_eq!(find(&t, "token_embd.weight").ty, GgmlType::Q6_K);
    assert_eq!(
        layers_of(&t, ".ffn_down.weight", GgmlType::Q6_K),
        [0, 1, 4, 7, 10, 13, 14, 15]
    );
    // Q4_0: Q6_K head, Q4_0 for every other matrix.
    let t = table(SynthShape::Llama3_8B, SynthType::Q4_0);
    assert_eq!(find(&t, "output.weight").ty, GgmlType::Q6_K);
    assert_eq!(find(&t, "token_embd.weight").ty, GgmlType::Q4_0);
    assert_eq!(layers_of(&t, ".ffn_down.weight", GgmlType::Q4_0).len(), 32);
    // Q5_K_M: Q4_K_M's Q6_K layers, Q5_K elsewhere.
    let t = table(SynthShape::Llama3_8B, SynthType::Q5_K_M);
    assert_eq!(
        layers_of(&t, ".attn_v.weight", GgmlType::Q6_K),
        more_bits_32
    );
    assert_eq!(layers_of(&t, ".ffn_up.weight", GgmlType::Q5_K).len(), 32);
    assert_eq!(find(&t, "output.weight").ty, GgmlType::Q6_K);
    // Q3_K_M (llama-quantize on the Llama-3.2-1B shape: 16 layers).
    let t = table(SynthShape::Llama3_2_1B, SynthType::Q3_K_M);
    assert_eq!(layers_of(&t, ".attn_v.weight", GgmlType::Q5_K), [0, 1]);
    assert_eq!(layers_of(&t, ".ffn_down.weight", GgmlType::Q5_K), [0]);
    assert_eq!(layers_of(&t, ".ffn_down.weight", GgmlType::Q4_K).len(), 15);
    assert_eq!(
        layers_of(&t, ".attn_output.weight", GgmlType::Q4_K).len(),
        16
    );
    assert_eq!(layers_of(&t, ".ffn_gate.weight", GgmlType::Q3_K).len(), 16);
    assert_eq!(find(&t, "token_embd.weight").ty, GgmlType::Q6_K);
    // Q2_K: 4 query heads per key/value head give attn_v Q4_K.
    let t = table(SynthShape::Llama3_2_1B, SynthType::Q2_K);
    assert_eq!(layers_of(&t, ".attn_v.weight", GgmlType::Q4_K).len(), 16);
    assert_eq!(layers_of(&t, ".ffn_down.weight", GgmlType::Q3_K).len(), 16);
    assert_eq!(layers_of(&t, ".attn_q.weight", GgmlType::Q2_K).len(), 16);
    // IQ4_XS, IQ4_NL without an importance matrix: attn_v Q5_K (4 query heads per key/value
    // head), ffn_down Q5_K in the first eighth of the layers, Q6_K head.
    for (ty, g) in [
        (SynthType::IQ4_XS, GgmlType::IQ4_XS),
        (SynthType::IQ4_NL, GgmlType::IQ4_NL),
    ] {
        let t = table(SynthShape::Llama3_2_1B, ty);
        assert_eq!(layers_of(&t, ".attn_v.weight", GgmlType::Q5_K).len(), 16);
        assert_eq!(layers_of(&t, ".ffn_down.weight", GgmlType::Q5_K), [0, 1]);
        assert_eq!(layers_of(&t, ".ffn_down.weight", g).len(), 14);
        assert_eq!(layers_of(&t, ".attn_q.weight", g).len(), 16);
        assert_eq!(find(&t, "token_embd.weight").ty, GgmlType::Q6_K);
    }
    // Q6_K: every matrix.
    let t = table(SynthShape::Llama3_8B, SynthType::Q6_K);
    assert!(
        t.iter()
            .all(|t| t.ty == GgmlType::Q6_K || t.entry.dims.len() == 1)
    );
}

#[test]
fn tiny_synth_inspects_and_runs_alike_on_the_cpu_and_a_placed_test_device() {
    let dir = tmp_dir("synth", "run");
    let out = oato(
        &[
            "synth", "--shape", "tiny", "--type", "Q4_K_M", "--layers", "8", "-o", "t.gguf",
        ],
        &dir,
    );
    ok(&out);
    let err = text(&out.stderr);
    assert!(
        err.contains("t.gguf") && err.contains("Q4_K_M") && err.contains("75 tensors"),
        "{err}"
    );

    let v: serde_json::Value =
        serde_json::from_str(&ok(&oato(&["inspect", "t.gguf", "--json"], &dir))).unwrap();
    assert_eq!(v["arch"], "llama");
    assert_eq!(v["hparams"]["n_layer"], 8);
    assert_eq!(v["hparams"]["n_vocab"], 512);
    assert_eq!(v["metadata"]["general.file_type"], 15);
    let tok = v["tokenizer"].as_str().unwrap();
    assert!(
        tok.starts_with("llama SentencePiece, 512 tokens, bos 1 \"<s>\", eos 2 \"</s>\""),
        "{tok}"
    );
    let type_of = |name: &str| {
        v["tensors"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["name"] == name)
            .unwrap_or_else(|| panic!("no {name}"))["type"]
            .clone()
    };
    // 8 layers: the first and last eighth (0, 7) and every third from 1 (3, 6) get more bits.
    for i in 0..8 {
        let want = if [0, 3, 6, 7].contains(&i) {
            "Q6_K"
        } else {
            "Q4_K"
        };
        assert_eq!(
            type_of(&format!("blk.{i}.attn_v.weight")),
            want,
            "layer {i}"
        );
        assert_eq!(
            type_of(&format!("blk.{i}.ffn_down.weight")),
            want,
            "layer {i}"
        );
        assert_eq!(type_of(&format!("blk.{i}.ffn_up.weight")), "Q4_K");
    }
    assert_eq!(type_of("output.weight"), "Q6_K");
    assert_eq!(type_of("output_norm.weight"), "F32");

    same_greedy_on_cpu_and_test_device(&dir, "t.gguf");
}

/// A Q4_0 model gives the same perplexity, to the last digit, with its weights interleaved for
/// the AVX-512 or AVX2 kernels (the default there), in the file's layout (`OATO_CPU_REPACK=0`),
/// its head alone in the file's layout or interleaved (`OATO_CPU_HEAD_ROWS=1` / `0`),
/// mapped and read in, under AVX2 and the scalar kernels; and the same greedy ids on the CPU and a placed test device (which keeps the
/// file's layout).
#[test]
fn q4_0_interleaved_or_not_gives_the_same_numbers() {
    interleaved_or_not("Q4_0");
}

/// As for Q4_0, a Q4_K_M model (its Q4_K and Q6_K weights interleaved, 64-token windows through
/// the panels unpacked from the interleaved groups).
#[test]
fn q4_k_m_interleaved_or_not_gives_the_same_numbers() {
    interleaved_or_not("Q4_K_M");
}

fn interleaved_or_not(ty: &str) {
    let dir = tmp_dir("synth", &format!("interleaved-{ty}"));
    ok(&oato(
        &[
            "synth", "--shape", "tiny", "--type", ty, "--layers", "3", "-o", "q.gguf",
        ],
        &dir,
    ));
    let words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex ";
    std::fs::write(dir.join("text.txt"), words.repeat(40)).unwrap();
    let ppl = |extra: &[&str], env: &[(&str, &str)]| -> serde_json::Value {
        let mut args = vec![
            "perplexity",
            "q.gguf",
            "-f",
            "text.txt",
            "-c",
            "64",
            "-t",
            "2",
            "--json",
        ];
        args.extend_from_slice(extra);
        serde_json::from_str(&ok(&oato_env(&args, &dir, env))).unwrap()
    };
    let base = ppl(&[], &[]);
    assert!(base["ppl"].as_f64().is_some_and(|p| p > 1.0), "{base}");
    for (extra, env) in [
        (&[][..], &[("OATO_CPU_REPACK", "0")][..]),
        // The output head in the file's layout, or interleaved, whatever the CPU's default.
        (&[][..], &[("OATO_CPU_HEAD_ROWS", "1")][..]),
        (&[][..], &[("OATO_CPU_HEAD_ROWS", "0")][..]),
        (&["--mmap"][..], &[][..]),
        (&["--no-mmap"][..], &[][..]),
        (&["--mmap"][..], &[("OATO_CPU_ISA", "avx2")][..]),
        (&[][..], &[("OATO_CPU_ISA", "scalar")][..]),
    ] {
        assert_eq!(ppl(extra, env)["ppl"], base["ppl"], "{extra:?} {env:?}");
    }
    same_greedy_on_cpu_and_test_device(&dir, "q.gguf");
}

/// `oato run`'s greedy ids of `file` (in `dir`): on the CPU, then planned under 30% and 70% budgets
/// of the CPU-backed test device; all equal. Returns the CPU's.
fn same_greedy_on_cpu_and_test_device(dir: &std::path::Path, file: &str) -> Vec<u32> {
    let cache = dir.join("cache");
    let run = |extra: &[&str], env: &[(&str, &str)]| -> Vec<u32> {
        let mut args = vec![
            "run",
            file,
            "-p",
            "The capital of France is",
            "-n",
            "6",
            "--temp",
            "0",
            "--ignore-eos",
            "-t",
            "2",
            "--json",
        ];
        args.extend_from_slice(extra);
        let v: serde_json::Value = serde_json::from_str(&ok(&oato_env(&args, dir, env))).unwrap();
        ids(&v["output_ids"])
    };
    let cpu = run(&["--device", "cpu"], &[]);
    assert_eq!(cpu.len(), 6);
    assert!(cpu.iter().all(|&id| id < 512), "{cpu:?}");
    let env = [
        ("OATO_TEST_DEVICE", "2000000000"),
        ("OATO_CACHE_DIR", cache.to_str().unwrap()),
    ];
    for budget in ["30%", "70%"] {
        assert_eq!(run(&["--vram-budget", budget], &env), cpu, "{budget}");
    }
    cpu
}

/// MiniCPM3-4B as llama.cpp's loader and converter describe it (62 layers, hidden 2560, 40 heads,
/// ffn 6400, vocab 73448, q_lora_rank 768, kv_lora_rank 256, key 64 + 32, value 64), and
/// llama-quantize's Q4_K_M mix: `attn_kv_b` counts as an `attn_v`.
#[test]
fn minicpm3_has_its_latent_attention_tensors_and_type_mix() {
    let t = table(SynthShape::MiniCpm3_4B, SynthType::Q4_K_M);
    // Two LongRoPE factor vectors, the embeddings, 12 per layer, the output norm and head.
    assert_eq!(t.len(), 2 + 1 + 62 * 12 + 2);
    for (name, dims) in [
        ("rope_factors_long.weight", vec![16]),
        ("token_embd.weight", vec![2560, 73448]),
        ("blk.61.attn_q_a.weight", vec![2560, 768]),
        ("blk.61.attn_q_a_norm.weight", vec![768]),
        ("blk.61.attn_q_b.weight", vec![768, 40 * 96]),
        ("blk.61.attn_kv_a_mqa.weight", vec![2560, 256 + 32]),
        ("blk.61.attn_kv_a_norm.weight", vec![256]),
        ("blk.61.attn_kv_b.weight", vec![256, 40 * (64 + 64)]),
        ("blk.61.attn_output.weight", vec![40 * 64, 2560]),
        ("blk.61.ffn_down.weight", vec![6400, 2560]),
        ("output.weight", vec![2560, 73448]),
    ] {
        assert_eq!(find(&t, name).entry.dims, dims, "{name}");
    }
    let p: u64 = t.iter().map(|t| t.entry.dims.iter().product::<u64>()).sum();
    assert_eq!(p, 4_261_902_880, "parameters, from the dimensions above");
    // use_more_bits over 62 layers: 0..7, 54..62, and 9, 12, ..., 51.
    let mut more: Vec<usize> = (0..7).chain(54..62).collect();
    more.extend((9..54).step_by(3));
    more.sort();
    assert_eq!(layers_of(&t, ".attn_kv_b.weight", GgmlType::Q6_K), more);
    assert_eq!(layers_of(&t, ".ffn_down.weight", GgmlType::Q6_K), more);
    for m in [
        "attn_q_a",
        "attn_q_b",
        "attn_kv_a_mqa",
        "attn_output",
        "ffn_up",
    ] {
        assert_eq!(
            layers_of(&t, &format!(".{m}.weight"), GgmlType::Q4_K).len(),
            62,
            "{m}"
        );
    }
    assert_eq!(find(&t, "output.weight").ty, GgmlType::Q6_K);
    assert_eq!(find(&t, "token_embd.weight").ty, GgmlType::Q4_K);
    assert_eq!(find(&t, "rope_factors_short.weight").ty, GgmlType::F32);
}

#[test]
fn tiny_minicpm3_inspects_and_runs_alike_on_the_cpu_and_a_placed_test_device() {
    let dir = tmp_dir("synth", "minicpm3");
    ok(&oato(
        &[
            "synth",
            "--shape",
            "tiny-minicpm3",
            "--type",
            "Q4_K_M",
            "--layers",
            "4",
            "-o",
            "m.gguf",
        ],
        &dir,
    ));
    let v: serde_json::Value =
        serde_json::from_str(&ok(&oato(&["inspect", "m.gguf", "--json"], &dir))).unwrap();
    assert_eq!(v["arch"], "minicpm3");
    assert_eq!(v["hparams"]["n_layer"], 4);
    assert_eq!(v["hparams"]["head_dim"], 96);
    assert_eq!(v["metadata"]["minicpm3.attention.kv_lora_rank"], 256);
    let mla = &v["hparams"]["mla"];
    assert_eq!(
        (
            &mla["q_lora_rank"],
            &mla["qk_nope"],
            &mla["qk_rope"],
            &mla["v_head_dim"]
        ),
        (&json!(256), &json!(64), &json!(32), &json!(64)),
        "{mla}"
    );
    assert_eq!(v["hparams"]["scales"]["embedding"], 12.0);
    same_greedy_on_cpu_and_test_device(&dir, "m.gguf");
}

/// The mean and spread of a tensor's values, read back from the file.
fn stats(f: &GgufFile, name: &str) -> (f64, f64) {
    let t = f.tensor(name).unwrap();
    let mut x = vec![0f32; t.n_elements as usize];
    dequantize_row(t.ty, f.data_of(t), &mut x).unwrap();
    let n = x.len() as f64;
    let mean = x.iter().map(|&v| v as f64).sum::<f64>() / n;
    let var = x.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n;
    (mean, var.sqrt())
}

#[test]
fn every_type_and_both_architectures_give_finite_spread_logits() {
    let dir = tmp_dir("synth", "types");
    for shape in [
        SynthShape::Tiny,
        SynthShape::TinyQwen2,
        SynthShape::TinyMiniCpm3,
    ] {
        for ty in [
            SynthType::Q2_K,
            SynthType::Q3_K_M,
            SynthType::Q4_0,
            SynthType::Q4_K_M,
            SynthType::Q5_K_M,
            SynthType::Q6_K,
            SynthType::Q8_0,
            SynthType::F16,
            SynthType::BF16,
            SynthType::IQ4_NL,
            SynthType::IQ4_XS,
        ] {
            let what = format!("{shape:?} {ty:?}");
            let path = dir.join(format!("{shape:?}-{ty:?}.gguf"));
            let sum = write_synth(&path, &shape.spec(), ty, 7, 2).unwrap();
            assert_eq!(sum.bytes, std::fs::metadata(&path).unwrap().len(), "{what}");

            let f = GgufFile::open(&path).unwrap();
            let (mean, std) = stats(&f, "blk.1.ffn_up.weight");
            assert!(
                mean.abs() < 1e-3 && (std / 0.02 - 1.0).abs() < 0.05,
                "{what}: ffn_up mean {mean} std {std}"
            );
            let (mean, std) = stats(&f, "blk.1.ffn_norm.weight");
            assert!(
                (mean - 1.0).abs() < 0.02 && std > 0.03 && std < 0.08,
                "{what}: ffn_norm mean {mean} std {std}"
            );

            let model = Model::from_gguf(f).unwrap();
            assert_eq!(model.layers[1].bq.is_some(), shape == SynthShape::TinyQwen2);
            let mut s = Session::new(&model, 64).unwrap();
            let logits = s.forward(&[1, 300, 301, 302, 77], Logits::All).unwrap();
            assert_eq!(logits.len(), 5 * 512);
            assert!(logits.iter().all(|x| x.is_finite()), "{what}");
            let last = &logits[4 * 512..];
            let m = last.iter().sum::<f32>() / 512.0;
            let sd = (last.iter().map(|x| (x - m) * (x - m)).sum::<f32>() / 512.0).sqrt();
            // W_out's rows have spread 0.02 over 256 unit-rms inputs: logits spread ~0.32.
            assert!(sd > 0.2 && sd < 0.5, "{what}: logit spread {sd}");
        }
    }
}

#[test]
fn the_seed_alone_decides_the_weights() {
    let dir = tmp_dir("synth", "seed");
    for (name, seed) in [("a.gguf", "5"), ("b.gguf", "5"), ("c.gguf", "6")] {
        ok(&oato(
            &[
                "synth",
                "--shape",
                "tiny-qwen2",
                "--type",
                "q4_0",
                "--seed",
                seed,
                "-t",
                if name == "b.gguf" { "1" } else { "2" },
                "-o",
                name,
            ],
            &dir,
        ));
    }
    let read = |n: &str| std::fs::read(dir.join(n)).unwrap();
    assert!(read("a.gguf") == read("b.gguf"), "same seed, other bytes");
    let (a, c) = (
        GgufFile::open(dir.join("a.gguf")).unwrap(),
        GgufFile::open(dir.join("c.gguf")).unwrap(),
    );
    for t in &a.tensors {
        assert_ne!(
            a.data_of(t),
            c.data_of(c.tensor(&t.name).unwrap()),
            "{} is the same under seeds 5 and 6",
            t.name
        );
    }
}

#[test]
fn bad_shapes_types_and_paths_fail_cleanly() {
    let dir = tmp_dir("synth", "bad");
    // `oato synth --shape S --type T -o O`, its exit code and stderr.
    let synth = |shape: &str, ty: &str, out: &str, extra: &[&str]| {
        let mut args = vec!["synth", "--shape", shape, "--type", ty, "-o", out];
        args.extend_from_slice(extra);
        let o = oato(&args, &dir);
        (o.status.code(), text(&o.stderr))
    };
    let (code, err) = synth("llama3-9b", "Q4_0", "x.gguf", &[]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("'llama3-9b'") && err.contains("llama3-8b, llama3.2-1b, qwq-32b"),
        "{err}"
    );
    let (code, err) = synth("tiny", "Q5_K", "x.gguf", &[]);
    assert!(code == Some(2) && err.contains("'Q5_K'"), "{err}");
    let (code, err) = synth("tiny", "Q4_0", "x.gguf", &["--layers", "0"]);
    assert!(code == Some(2) && err.contains("--layers"), "{err}");

    let (code, err) = synth("tiny", "Q4_0", "no-such-dir/x.gguf", &[]);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("no-such-dir/x.gguf") && !err.contains("panicked"),
        "{err}"
    );
    assert!(!dir.join("x.gguf").exists());
}

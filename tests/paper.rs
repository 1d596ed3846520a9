//! The paper's experiments (issue 14): every config's small CPU-only variant runs through
//! experiments/paper.py (the test device standing in for the GPU) and `oato plot`, and each
//! figure comes out with every policy's marks in its plot areas; a broken config is refused with
//! its file and line.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The policies' colours in src/cli/plot/draw.rs.
const POLICY_COLOURS: [(&str, [u8; 3]); 4] = [
    ("oato", [31, 119, 180]),
    ("oato-paper", [255, 127, 14]),
    ("layer-split", [44, 160, 44]),
    ("flexgen", [214, 39, 40]),
];

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("oato-paper-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn paper(args: &[&str], tmp: &Path) -> Output {
    Command::new("python3")
        .arg("experiments/paper.py")
        .args(args)
        .env("OATO_BIN", env!("CARGO_BIN_EXE_oato"))
        .env("OATO_PAPER_MODELS", tmp.join("models"))
        .env("OATO_CACHE_DIR", tmp.join("cache"))
        .env_remove("LLAMA_BIN")
        .output()
        .expect("python3 runs")
}

/// The PNG's size and, per policy, how many of its pixels have that policy's colour.
fn policy_pixels(png_path: &Path) -> ((u32, u32), Vec<usize>) {
    let dec = png::Decoder::new(std::io::BufReader::new(
        std::fs::File::open(png_path).unwrap(),
    ));
    let mut reader = dec.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut buf).unwrap();
    assert_eq!(
        info.color_type,
        png::ColorType::Rgb,
        "{}",
        png_path.display()
    );
    let px = &buf[..info.buffer_size()];
    let counts = POLICY_COLOURS
        .iter()
        .map(|(_, c)| px.chunks_exact(3).filter(|p| p == c).count())
        .collect();
    ((info.width, info.height), counts)
}

#[test]
fn small_variants_run_and_plot() {
    let tmp = scratch("small");
    let (res, figs) = (tmp.join("results"), tmp.join("figures"));
    // (figure, CSV rows: policies x budgets x prompt lengths x generated tokens x models x reps,
    // the least pixels of each policy's colour: more than its legend swatch, 12 x 10 for bars,
    // 16 x 2 for lines, whose series may overlap but keep their own r = 5 marks, two per line)
    let figures = [
        ("fig7", 4 * 2, 400),
        ("fig8", 4 * 2, 120),
        ("fig9", 4 * 2, 120),
        ("fig10", 4 * 3, 400),
    ];
    for (fig, rows, least) in figures {
        let out = paper(
            &[
                &format!("configs/{fig}.toml"),
                "--small",
                "--res",
                res.to_str().unwrap(),
                "--figures",
                figs.to_str().unwrap(),
            ],
            &tmp,
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{fig}: {err}");
        let csv = std::fs::read_to_string(res.join(format!("{fig}.csv"))).unwrap();
        let mut lines = csv.lines();
        assert!(
            lines.next().unwrap().starts_with(
                "date,commit,device,host_cpu,threads,model,model_dtype,policy,vram_budget_bytes,\
                 gpu_weight_fraction,prompt_tokens,gen_tokens,rep,load_ms,ttft_ms,tpot_ms,e2e_ms,\
                 tokens_per_s,"
            ),
            "{fig}: DESIGN.md's columns first"
        );
        let body: Vec<&str> = lines.collect();
        assert_eq!(body.len(), rows, "{fig}: rows\n{csv}");
        assert!(
            body.iter()
                .all(|l| l.contains(",test device (CPU-backed),")),
            "{fig}: the test device stands in for the GPU\n{csv}"
        );
        let png = figs.join(format!("{fig}.png"));
        let ((w, h), counts) = policy_pixels(&png);
        assert!(w >= 1000 && h >= 500, "{fig}: {w}x{h}");
        for ((policy, _), n) in POLICY_COLOURS.iter().zip(&counts) {
            assert!(*n > least, "{fig}: {n} pixels of {policy}'s colour");
        }
        let svg = std::fs::read_to_string(figs.join(format!("{fig}.svg"))).unwrap();
        assert!(svg.starts_with("<svg") && svg.len() > 5_000, "{fig}: SVG");
        assert!(svg.contains("test device (CPU-backed)"), "{fig}: caption");
    }
    std::fs::remove_dir_all(&tmp).ok();
}

#[test]
fn broken_configs_name_file_and_line() {
    let tmp = scratch("broken");
    let good = std::fs::read_to_string("configs/fig10.toml").unwrap();
    let cases = [
        // (replace, with, expected message)
        (
            "reps = 1\n",
            "reps = 0\n",
            ":28: reps: needs a whole number >= 1 (got 0)",
        ),
        (
            "plot = \"budgets\"",
            "plot = \"pie\"",
            ":6: plot: needs one of budgets, e2e, gen-tokens, prompt-lengths",
        ),
        (
            "[run]\n",
            "[run\n",
            "invalid TOML: Expected ']' at the end of a table declaration (at line 9",
        ),
    ];
    for (from, to, want) in cases {
        assert!(good.contains(from), "{from}");
        let bad = tmp.join("bad.toml");
        std::fs::write(&bad, good.replacen(from, to, 1)).unwrap();
        let out = paper(&[bad.to_str().unwrap(), "--small"], &tmp);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success());
        assert!(
            err.contains(&format!("{}{want}", bad.display())) || err.contains(want),
            "{err}"
        );
        assert!(err.contains("bad.toml"), "{err}");
    }
    std::fs::remove_dir_all(&tmp).ok();
}

#[test]
fn tied_policies_each_keep_their_marks() {
    // Every policy with the same TPOT at each point: the lines lie on one another, and each
    // policy must still show more than its legend swatch (the bound the small runs are held to).
    let tmp = scratch("tied");
    let mut csv = String::from(
        "date,commit,device,host_cpu,threads,model,model_dtype,policy,vram_budget_bytes,\
         gpu_weight_fraction,prompt_tokens,gen_tokens,rep,load_ms,ttft_ms,tpot_ms,e2e_ms,\
         tokens_per_s,budget\n",
    );
    for (policy, _) in POLICY_COLOURS {
        for (g, tpot) in [(32, 20.0), (64, 21.0), (128, 23.0)] {
            csv += &format!(
                "2026-11-23T10:00:00Z,abc1234,dev,cpu,2,m.gguf,Q4_0,{policy},1,0.5,64,{g},1,1,\
                 50,{tpot},100,50,50%\n"
            );
        }
    }
    let path = tmp.join("tied.csv");
    std::fs::write(&path, csv).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_oato"))
        .args(["plot", "--kind", "gen-tokens", "-o"])
        .arg(tmp.join("tied"))
        .arg(&path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (_, counts) = policy_pixels(&tmp.join("tied.png"));
    for ((policy, _), n) in POLICY_COLOURS.iter().zip(&counts) {
        assert!(*n > 120, "{n} pixels of {policy}'s colour");
    }
    std::fs::remove_dir_all(&tmp).ok();
}

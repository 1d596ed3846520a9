//! `oato plot`: the paper's figure kinds (TTFT against prompt length, TPOT against generated tokens,
//! TTFT/TPOT bars at each budget, end-to-end bars) from results CSVs in DESIGN.md's format, as PNG
//! and SVG, with min–max error bars over repetitions, the device and commit in the caption, and the
//! paper's claims (a CSV of ratios) as a reference series where they apply.

mod draw;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use clap::{Args, ValueEnum};

use oato::error::{Error, Result};

#[derive(Args)]
pub struct PlotArgs {
    /// Results CSVs (DESIGN.md's columns; experiments/paper.py adds `budget`).
    #[arg(required = true)]
    pub csv: Vec<PathBuf>,
    /// Which figure to draw.
    #[arg(long, value_enum)]
    pub kind: Kind,
    /// The figure's title.
    #[arg(long)]
    pub title: Option<String>,
    /// The figure's key in the claims file (fig7, fig8, …).
    #[arg(long)]
    pub figure: Option<String>,
    /// The paper's claims (paper-figures/paper-claims.csv): drawn where model and budget match.
    #[arg(long)]
    pub claims: Option<PathBuf>,
    /// Output path without extension: writes OUTPUT.png and OUTPUT.svg.
    #[arg(short = 'o', long)]
    pub output: PathBuf,
}

/// The paper's figure kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Kind {
    /// End-to-end time per model (Fig. 7): bars per policy.
    E2e,
    /// TTFT against prompt length (Fig. 8): a line per policy.
    PromptLengths,
    /// TPOT against the number of generated tokens (Fig. 9): a line per policy.
    GenTokens,
    /// TTFT and TPOT at each budget (Fig. 10): bars per policy.
    Budgets,
}

/// One measured run: the columns a figure needs.
#[derive(Clone, Debug, PartialEq)]
pub struct Run {
    pub device: String,
    pub host_cpu: String,
    pub commit: String,
    pub date: String,
    pub threads: String,
    pub model: String,
    pub policy: String,
    /// The budget asked for (`50%`), or the measured GPU weight share when the file has no
    /// `budget` column.
    pub budget: String,
    pub prompt_tokens: u64,
    pub gen_tokens: u64,
    pub ttft_ms: f64,
    pub tpot_ms: f64,
    pub e2e_ms: f64,
}

/// Median and range of one metric over repetitions.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Stat {
    pub min: f64,
    pub median: f64,
    pub max: f64,
    pub n: usize,
}

impl Stat {
    pub fn of(values: &[f64]) -> Option<Stat> {
        let mut v: Vec<f64> = values.to_vec();
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let median = match n {
            0 => return None,
            _ if n % 2 == 1 => v[n / 2],
            _ => (v[n / 2 - 1] + v[n / 2]) / 2.0,
        };
        Some(Stat {
            min: v[0],
            median,
            max: v[n - 1],
            n,
        })
    }
}

/// One claim of the paper: oato's `metric` is `speedup` times better than `baseline`'s.
#[derive(Clone, Debug, PartialEq)]
pub struct Claim {
    pub figure: String,
    /// The synth shape the claim is about (`llama3-8b`), `unstated` when the paper's text does not
    /// say.
    pub model: String,
    pub budget: String,
    /// `ttft`, `tpot`, `e2e`, or `unstated`.
    pub metric: String,
    /// `llama.cpp` (our `llama.cpp -ngl` peer rows, else the `layer-split` policy) or `flexgen`.
    pub baseline: String,
    pub speedup: f64,
    /// `at` (at that point) or `up-to` (the largest gain over the figure's x axis).
    pub bound: String,
    pub text: String,
}

/// A minimal RFC 4180 reader (quoted fields, no line breaks inside them): rows of fields with
/// their 1-based line numbers, the header first.
fn read_csv(path: &Path) -> Result<Vec<(usize, Vec<String>)>> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    let mut rows = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let (mut fields, mut cur, mut quoted, mut chars) =
            (Vec::new(), String::new(), false, line.chars().peekable());
        while let Some(c) = chars.next() {
            match (c, quoted) {
                ('"', true) if chars.peek() == Some(&'"') => {
                    cur.push('"');
                    chars.next();
                }
                ('"', _) => quoted = !quoted,
                (',', false) => fields.push(std::mem::take(&mut cur)),
                _ => cur.push(c),
            }
        }
        if quoted {
            return Err(Error::Msg(format!(
                "{}:{}: unterminated quoted field",
                path.display(),
                i + 1
            )));
        }
        fields.push(cur);
        rows.push((i + 1, fields));
    }
    if rows.is_empty() {
        return Err(Error::Msg(format!("{}: empty CSV file", path.display())));
    }
    Ok(rows)
}

/// A CSV's rows as named fields, each checked for the header's width.
struct Table<'a> {
    path: &'a Path,
    header: Vec<String>,
    rows: Vec<(usize, Vec<String>)>,
}

impl<'a> Table<'a> {
    fn read(path: &'a Path) -> Result<Self> {
        let mut rows = read_csv(path)?;
        let (_, header) = rows.remove(0);
        for (line, r) in &rows {
            if r.len() != header.len() {
                return Err(Error::Msg(format!(
                    "{}:{line}: {} fields, the header has {}",
                    path.display(),
                    r.len(),
                    header.len()
                )));
            }
        }
        Ok(Table { path, header, rows })
    }

    fn col(&self, name: &str) -> Result<usize> {
        self.header
            .iter()
            .position(|h| h == name)
            .ok_or_else(|| Error::Msg(format!("{}:1: no column `{name}`", self.path.display())))
    }

    fn num<T: std::str::FromStr>(&self, line: usize, row: &[String], col: usize) -> Result<T> {
        row[col]
            .trim()
            .parse()
            .map_err(|_| self.bad(line, row, col, "is not a number"))
    }

    /// A time or ratio: finite and not negative.
    fn value(&self, line: usize, row: &[String], col: usize) -> Result<f64> {
        let v: f64 = self.num(line, row, col)?;
        if v.is_finite() && v >= 0.0 {
            Ok(v)
        } else {
            Err(self.bad(line, row, col, "is not a finite number >= 0"))
        }
    }

    fn bad(&self, line: usize, row: &[String], col: usize, what: &str) -> Error {
        Error::Msg(format!(
            "{}:{line}: column `{}`: `{}` {what}",
            self.path.display(),
            self.header[col],
            row[col]
        ))
    }
}

/// Reads a results CSV (DESIGN.md's columns; any others are ignored).
pub fn read_runs(path: &Path) -> Result<Vec<Run>> {
    let t = Table::read(path)?;
    let c = |n| t.col(n);
    let (device, host, commit, date, threads, model, policy) = (
        c("device")?,
        c("host_cpu")?,
        c("commit")?,
        c("date")?,
        c("threads")?,
        c("model")?,
        c("policy")?,
    );
    let (share, pt, gt, ttft, tpot, e2e) = (
        c("gpu_weight_fraction")?,
        c("prompt_tokens")?,
        c("gen_tokens")?,
        c("ttft_ms")?,
        c("tpot_ms")?,
        c("e2e_ms")?,
    );
    let budget = t.col("budget").ok();
    let mut out = Vec::with_capacity(t.rows.len());
    for (line, r) in &t.rows {
        let line = *line;
        let budget = match budget {
            Some(b) if !r[b].is_empty() => r[b].clone(),
            _ => format!("{:.0}%", t.value(line, r, share)? * 100.0),
        };
        out.push(Run {
            device: r[device].clone(),
            host_cpu: r[host].clone(),
            commit: r[commit].clone(),
            date: r[date].clone(),
            threads: r[threads].clone(),
            model: r[model].clone(),
            policy: r[policy].clone(),
            budget,
            prompt_tokens: t.num(line, r, pt)?,
            gen_tokens: t.num(line, r, gt)?,
            ttft_ms: t.value(line, r, ttft)?,
            tpot_ms: t.value(line, r, tpot)?,
            e2e_ms: t.value(line, r, e2e)?,
        });
    }
    Ok(out)
}

/// Reads the paper's claims.
pub fn read_claims(path: &Path) -> Result<Vec<Claim>> {
    let t = Table::read(path)?;
    let cols = [
        "figure", "model", "budget", "metric", "baseline", "speedup", "bound", "claim",
    ]
    .map(|n| t.col(n));
    let [
        figure,
        model,
        budget,
        metric,
        baseline,
        speedup,
        bound,
        claim,
    ] = cols;
    let (figure, model, budget, metric, baseline, speedup, bound, claim) = (
        figure?, model?, budget?, metric?, baseline?, speedup?, bound?, claim?,
    );
    let mut out = Vec::new();
    for (line, r) in &t.rows {
        let s = t.value(*line, r, speedup)?;
        if s <= 0.0 || !["at", "up-to"].contains(&r[bound].as_str()) {
            return Err(Error::Msg(format!(
                "{}:{line}: a claim needs a speedup > 0 and a bound of `at` or `up-to`",
                path.display()
            )));
        }
        out.push(Claim {
            figure: r[figure].clone(),
            model: r[model].clone(),
            budget: r[budget].clone(),
            metric: r[metric].clone(),
            baseline: r[baseline].clone(),
            speedup: s,
            bound: r[bound].clone(),
            text: r[claim].clone(),
        });
    }
    Ok(out)
}

/// Which metric of a run a panel shows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Metric {
    Ttft,
    Tpot,
    E2e,
}

impl Metric {
    pub fn key(self) -> &'static str {
        match self {
            Metric::Ttft => "ttft",
            Metric::Tpot => "tpot",
            Metric::E2e => "e2e",
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Metric::Ttft => "TTFT (ms)",
            Metric::Tpot => "TPOT (ms)",
            Metric::E2e => "end-to-end (ms)",
        }
    }

    fn of(self, r: &Run) -> f64 {
        match self {
            Metric::Ttft => r.ttft_ms,
            Metric::Tpot => r.tpot_ms,
            Metric::E2e => r.e2e_ms,
        }
    }
}

/// One chart: x groups, a series per policy (median and range per group), and the paper's
/// reference values where a claim applies.
#[derive(Clone, Debug)]
pub struct Panel {
    pub title: String,
    pub x_label: String,
    pub metric: Metric,
    pub lines: bool,
    pub groups: Vec<String>,
    pub series: Vec<(String, Vec<Option<Stat>>)>,
    /// Per claim: its legend label and the reference value per group.
    pub reference: Vec<(String, Vec<Option<f64>>)>,
}

/// The model name a claim's shape matches: the file name starts with it (`llama3-8b-Q4_0-s42.gguf`).
fn model_matches(file: &str, shape: &str) -> bool {
    !shape.is_empty()
        && file
            .to_ascii_lowercase()
            .starts_with(&shape.to_ascii_lowercase())
}

/// Groups runs into panels for a figure kind.
pub fn panels(kind: Kind, runs: &[Run], claims: &[Claim]) -> Vec<Panel> {
    // Order of first appearance, so the CSV's order (the config's) is the figure's.
    fn uniq<T: PartialEq + Clone>(it: impl Iterator<Item = T>) -> Vec<T> {
        let mut v = Vec::new();
        for x in it {
            if !v.contains(&x) {
                v.push(x);
            }
        }
        v
    }
    let models = uniq(runs.iter().map(|r| r.model.clone()));
    let mut out = Vec::new();
    let mut push = |title: String,
                    x_label: &str,
                    metric,
                    lines,
                    sel: Vec<&Run>,
                    x: &dyn Fn(&Run) -> String| {
        let groups = uniq(sel.iter().map(|r| x(r)));
        let policies = uniq(sel.iter().map(|r| r.policy.clone()));
        let stat = |p: &str, g: &str| {
            let v: Vec<f64> = sel
                .iter()
                .filter(|r| r.policy == p && x(r) == g)
                .map(|r| metric_of(metric, r))
                .collect();
            Stat::of(&v)
        };
        let series: Vec<(String, Vec<Option<Stat>>)> = policies
            .iter()
            .map(|p| (p.clone(), groups.iter().map(|g| stat(p, g)).collect()))
            .collect();
        let model = sel.first().map_or("", |r| r.model.as_str());
        let budget = sel.first().map_or("", |r| r.budget.as_str());
        let reference = claims
            .iter()
            .filter(|c| c.metric == Metric::key(metric) && model_matches(model, &c.model))
            .filter(|c| c.budget.is_empty() || kind == Kind::Budgets || c.budget == budget)
            .filter_map(|c| {
                let (base_name, base) = baseline_series(&series, &c.baseline)?;
                let vals: Vec<Option<f64>> = groups
                    .iter()
                    .zip(base.iter())
                    .map(|(g, s)| {
                        let at_budget = kind != Kind::Budgets || c.budget == *g;
                        s.filter(|_| at_budget).map(|s| s.median / c.speedup)
                    })
                    .collect();
                vals.iter().any(Option::is_some).then(|| {
                    let how = if c.bound == "up-to" { "up to " } else { "" };
                    (format!("paper: {base_name} / {how}{:.2}", c.speedup), vals)
                })
            })
            .collect();
        out.push(Panel {
            title,
            x_label: x_label.to_string(),
            metric,
            lines,
            groups,
            series,
            reference,
        });
    };
    match kind {
        Kind::E2e => {
            let sel: Vec<&Run> = runs.iter().collect();
            push(
                "end-to-end".into(),
                "model @ budget (P, G)",
                Metric::E2e,
                false,
                sel,
                &|r| {
                    format!(
                        "{} @ {} ({}, {})",
                        short(&r.model),
                        r.budget,
                        r.prompt_tokens,
                        r.gen_tokens
                    )
                },
            );
        }
        Kind::PromptLengths | Kind::GenTokens => {
            let (metric, x_label) = if kind == Kind::PromptLengths {
                (Metric::Ttft, "prompt tokens")
            } else {
                (Metric::Tpot, "generated tokens")
            };
            for m in &models {
                let budgets = uniq(
                    runs.iter()
                        .filter(|r| &r.model == m)
                        .map(|r| r.budget.clone()),
                );
                for b in budgets {
                    let sel: Vec<&Run> = runs
                        .iter()
                        .filter(|r| &r.model == m && r.budget == b)
                        .collect();
                    let title = format!("{} @ {b}", short(m));
                    if kind == Kind::PromptLengths {
                        push(title, x_label, metric, true, sel, &|r| {
                            r.prompt_tokens.to_string()
                        });
                    } else {
                        push(title, x_label, metric, true, sel, &|r| {
                            r.gen_tokens.to_string()
                        });
                    }
                }
            }
        }
        Kind::Budgets => {
            for m in &models {
                for metric in [Metric::Ttft, Metric::Tpot] {
                    let sel: Vec<&Run> = runs.iter().filter(|r| &r.model == m).collect();
                    let title = format!("{} {}", short(m), metric.label());
                    push(title, "budget", metric, false, sel, &|r| r.budget.clone());
                }
            }
        }
    }
    out
}

fn metric_of(m: Metric, r: &Run) -> f64 {
    m.of(r)
}

/// The series a claim's baseline means: llama.cpp's own runs when measured, else our
/// reimplementation of its layer split.
fn baseline_series<'a>(
    series: &'a [(String, Vec<Option<Stat>>)],
    baseline: &str,
) -> Option<&'a (String, Vec<Option<Stat>>)> {
    let names: &[&str] = match baseline {
        "llama.cpp" => &["llama.cpp -ngl", "layer-split"],
        other => &[other][..],
    };
    names
        .iter()
        .find_map(|n| series.iter().find(|(p, _)| p == n))
}

/// A model file's name without the extension.
fn short(model: &str) -> &str {
    model.strip_suffix(".gguf").unwrap_or(model)
}

/// The caption: where and when the numbers were measured, what the bars mean, the paper's claims.
pub fn caption(runs: &[Run], claims: &[Claim], figure: Option<&str>) -> Vec<String> {
    let join = |f: &dyn Fn(&Run) -> &str| {
        let mut v: Vec<&str> = runs.iter().map(f).filter(|s| !s.is_empty()).collect();
        v.sort();
        v.dedup();
        v.join(" + ")
    };
    let reps: BTreeMap<(String, String, String, u64, u64), usize> =
        runs.iter().fold(BTreeMap::new(), |mut m, r| {
            let k = (
                r.model.clone(),
                r.policy.clone(),
                r.budget.clone(),
                r.prompt_tokens,
                r.gen_tokens,
            );
            *m.entry(k).or_default() += 1;
            m
        });
    let (lo, hi) = (
        reps.values().min().copied().unwrap_or(0),
        reps.values().max().copied().unwrap_or(0),
    );
    let n = if lo == hi {
        lo.to_string()
    } else {
        format!("{lo}-{hi}")
    };
    let mut lines = vec![
        format!(
            "Measured on {} with {} ({} threads); commit {}; {}.",
            join(&|r| &r.device),
            join(&|r| &r.host_cpu),
            join(&|r| &r.threads),
            join(&|r| &r.commit),
            join(&|r| r.date.get(..10).unwrap_or(&r.date)),
        ),
        format!("Marks: median of {n} repetitions; error bars: min-max."),
    ];
    let mine: Vec<&Claim> = claims
        .iter()
        .filter(|c| figure.is_some_and(|f| f == c.figure))
        .collect();
    if !mine.is_empty() {
        lines.push("Paper (RTX 4090 + Xeon 4314; ratios only, drawn as our baseline / ratio where model and budget match):".into());
        for c in mine {
            lines.push(format!("  {}", c.text));
        }
    } else if let Some(f) = figure {
        lines.push(format!(
            "Paper: no numbers for {f} in the claims file (the issue states none)."
        ));
    }
    lines
}

pub fn run(a: PlotArgs) -> Result<()> {
    let mut runs = Vec::new();
    for p in &a.csv {
        runs.extend(read_runs(p)?);
    }
    if runs.is_empty() {
        return Err(Error::Usage(format!(
            "{}: no rows to plot",
            a.csv[0].display()
        )));
    }
    let claims = match &a.claims {
        Some(p) => read_claims(p)?,
        None => Vec::new(),
    };
    let mine: Vec<Claim> = claims
        .iter()
        .filter(|c| a.figure.as_deref() == Some(c.figure.as_str()))
        .cloned()
        .collect();
    let panels = panels(a.kind, &runs, &mine);
    let caption = caption(&runs, &claims, a.figure.as_deref());
    let title = a.title.clone().unwrap_or_else(|| format!("{:?}", a.kind));
    let fig = draw::Figure {
        title: &title,
        panels: &panels,
        caption: &caption,
    };
    let png = a.output.with_extension("png");
    let svg = a.output.with_extension("svg");
    if let Some(dir) = png.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    }
    draw::png(&fig, &png)?;
    draw::svg(&fig, &svg)?;
    eprintln!(
        "plot: {} panels from {} runs: wrote {} and {}",
        panels.len(),
        runs.len(),
        png.display(),
        svg.display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(name: &str, text: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("oato-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    const HEADER: &str = "date,commit,device,host_cpu,threads,model,model_dtype,policy,vram_budget_bytes,gpu_weight_fraction,prompt_tokens,gen_tokens,rep,load_ms,ttft_ms,tpot_ms,e2e_ms,tokens_per_s,budget";

    fn row(policy: &str, budget: &str, p: u64, ttft: f64) -> String {
        format!(
            "2026-11-23T10:00:00Z,abc1234,\"dev, 1\",cpu,2,llama3-8b-Q4_0-s42.gguf,Q4_0,{policy},1,0.5,{p},4,1,1,{ttft},2,{},100,{budget}",
            ttft + 6.0
        )
    }

    #[test]
    fn stat_takes_median_and_range() {
        assert_eq!(
            Stat::of(&[3.0, 1.0, 2.0]),
            Some(Stat {
                min: 1.0,
                median: 2.0,
                max: 3.0,
                n: 3
            })
        );
        assert_eq!(Stat::of(&[4.0, 1.0]).map(|s| s.median), Some(2.5));
        assert_eq!(Stat::of(&[]), None);
    }

    #[test]
    fn reads_quoted_fields_and_names_bad_lines() {
        let good = write(
            "good.csv",
            &format!("{HEADER}\n{}\n", row("oato", "50%", 16, 10.0)),
        );
        let runs = read_runs(&good).unwrap();
        assert_eq!(runs[0].device, "dev, 1");
        assert_eq!(runs[0].e2e_ms, 16.0);
        assert_eq!(runs[0].budget, "50%");
        let bad_row = row("x", "50%", 16, 1.0).replace(",16,4,1,1,1,", ",16,4,1,1,zz,");
        let bad = write(
            "bad.csv",
            &format!("{HEADER}\n{}\n{bad_row}\n", row("oato", "50%", 16, 10.0)),
        );
        let e = read_runs(&bad).unwrap_err().to_string();
        assert!(
            e.ends_with("bad.csv:3: column `ttft_ms`: `zz` is not a number"),
            "{e}"
        );
        let inf_row = row("x", "50%", 16, 1.0).replace(",16,4,1,1,1,", ",16,4,1,1,inf,");
        let inf = write("inf.csv", &format!("{HEADER}\n{inf_row}\n"));
        let e = read_runs(&inf).unwrap_err().to_string();
        assert!(
            e.ends_with("inf.csv:2: column `ttft_ms`: `inf` is not a finite number >= 0"),
            "{e}"
        );
        let short = write("short.csv", &format!("{HEADER}\na,b\n"));
        let e = read_runs(&short).unwrap_err().to_string();
        assert!(
            e.contains("short.csv:2: 2 fields, the header has 19"),
            "{e}"
        );
        let missing = write("missing.csv", "date,commit\n1,2\n");
        let e = read_runs(&missing).unwrap_err().to_string();
        assert!(e.contains("missing.csv:1: no column `device`"), "{e}");
    }

    #[test]
    fn panels_group_by_x_and_apply_claims_to_the_baseline() {
        let text = [
            HEADER.to_string(),
            row("oato", "25%", 32, 10.0),
            row("oato", "25%", 32, 14.0),
            row("oato", "25%", 32, 12.0),
            row("layer-split", "25%", 32, 30.0),
            row("layer-split", "25%", 64, 50.0),
            row("oato", "25%", 64, 20.0),
        ]
        .join("\n");
        let runs = read_runs(&write("p.csv", &text)).unwrap();
        let claims = vec![Claim {
            figure: "fig8".into(),
            model: "llama3-8b".into(),
            budget: "25%".into(),
            metric: "ttft".into(),
            baseline: "llama.cpp".into(),
            speedup: 2.0,
            bound: "at".into(),
            text: "x".into(),
        }];
        let ps = panels(Kind::PromptLengths, &runs, &claims);
        assert_eq!(ps.len(), 1);
        let p = &ps[0];
        assert_eq!(p.groups, ["32", "64"]);
        assert_eq!(p.series[0].0, "oato");
        assert_eq!(
            p.series[0].1[0],
            Some(Stat {
                min: 10.0,
                median: 12.0,
                max: 14.0,
                n: 3
            })
        );
        // llama.cpp's claim falls back on layer-split: 30 / 2 and 50 / 2.
        assert_eq!(p.reference[0].1, [Some(15.0), Some(25.0)]);
        assert_eq!(p.reference[0].0, "paper: layer-split / 2.00");
        // Another model or budget: no reference.
        let other = Claim {
            budget: "75%".into(),
            ..claims[0].clone()
        };
        assert!(
            panels(Kind::PromptLengths, &runs, &[other])[0]
                .reference
                .is_empty()
        );
    }

    #[test]
    fn claims_file_checks_its_values() {
        let p = write(
            "claims.csv",
            "figure,model,budget,metric,baseline,speedup,bound,claim,source\nfig7,llama3-8b,50%,e2e,llama.cpp,1.174,at,\"+17.4%, e2e\",issue\nfig7,x,50%,e2e,flexgen,0,at,y,z\n",
        );
        let e = read_claims(&p).unwrap_err().to_string();
        assert!(
            e.contains("claims.csv:3: a claim needs a speedup > 0"),
            "{e}"
        );
    }
}

//! `oato bench [MODEL…] -p 512 -n 128 -r 5 -t N`: prompt-processing and generation throughput as
//! llama.cpp's llama-bench measures and reports it, so the two can be put side by side.
//!
//! What is measured, as llama-bench (tools/llama-bench/llama-bench.cpp) does it:
//! - `ppN`: N token ids (the first BOS when the model adds one, the rest random in 0..n_vocab)
//!   run as one batch from an empty cache, last token's logits only; t/s = N / time.
//! - `tgN`: N single-token forward passes from an empty cache (the first token BOS or random, each
//!   later one random; nothing sampled); t/s = N / time of all N.
//! - Per test: one warm-up run (the whole prompt for pp, a single token for tg), then `-r` timed
//!   repetitions, the cache emptied before each. Models, then thread counts, then pp tests, then tg
//!   tests are walked in llama-bench's order.
//! - `avg_ns`/`stddev_ns` are the mean and sample standard deviation of the repetitions' times,
//!   `avg_ts`/`stddev_ts` those of the per-repetition rates (so avg_ts is not n / avg_ns).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use clap::Args;
use serde_json::{Value, json};

use oato::error::{Error, Result};
use oato::gguf::GgufFile;
use oato::model::Model;
use oato::quant::GgmlType;
use oato::rng::SplitMix64;
use oato::runtime::backend::{Backend, DeviceKind};
use oato::runtime::forward::{DeviceMap, Logits, Session, target_weights};
use oato::tokenizer::Tokenizer;

/// Largest prompt or generation length accepted: beyond this the cache and activations would not
/// fit in any machine's memory.
const MAX_TOKENS: usize = 1 << 20;

#[derive(Args)]
pub struct BenchArgs {
    /// GGUF models (default: models/SmolLM2-135M-Instruct.Q4_1.gguf, or $OATO_MODEL).
    pub models: Vec<PathBuf>,
    /// GGUF models as llama-bench takes them (`-m a.gguf -m b.gguf`, repeatable), after any
    /// given as MODELS.
    #[arg(short = 'm', long = "model", value_name = "MODEL")]
    pub model_flags: Vec<PathBuf>,
    /// Prompt lengths to test, comma-separated (repeatable; 0 skips prompt tests) [default: 512].
    #[arg(short = 'p', long = "n-prompt", value_name = "N,…")]
    pub n_prompt: Vec<String>,
    /// Generation lengths to test, comma-separated (repeatable; 0 skips generation tests)
    /// [default: 128].
    #[arg(short = 'n', long = "n-gen", value_name = "N,…")]
    pub n_gen: Vec<String>,
    /// Prompt-then-generation tests, PP,TG (repeatable; llama-bench's -pg, which oato bench also
    /// takes): a prompt of PP tokens then TG generated, timed together as "ppPP+tgTG".
    #[arg(long = "pg", value_name = "PP,TG")]
    pub pg: Vec<String>,
    /// Tokens already in the cache when each test starts, comma-separated (repeatable; as
    /// llama-bench's -d): processed before every run, untimed, so "tg128 @ d4096" times decode
    /// deep in a context [default: 0].
    #[arg(short = 'd', long = "n-depth", value_name = "N,…")]
    pub depth: Vec<String>,
    /// Timed repetitions of each test, after one warm-up run.
    #[arg(
        short = 'r',
        long = "repetitions",
        default_value = "5",
        value_name = "N"
    )]
    pub reps: String,
    /// Thread counts, comma-separated (repeatable; 0: all cores) [default: 0].
    #[arg(short = 't', long = "threads", value_name = "N,…")]
    pub threads: Vec<String>,
    /// Seed of the random token ids.
    #[arg(long, default_value_t = 1234)]
    pub seed: u64,
    /// Print CSV (one row per test, llama-bench's columns) instead of a markdown table.
    #[arg(long, conflicts_with = "json")]
    pub csv: bool,
    /// Print a JSON array (one object per test, llama-bench's field names).
    #[arg(long)]
    pub json: bool,
    /// Run the whole model on the CPU, the GPU, or the GPU when there is one (auto).
    #[arg(long, value_enum, default_value = "auto")]
    pub device: super::DeviceArg,
    /// Layers on the GPU as llama-bench's -ngl counts them (the output head, then the last N-1
    /// layers; `oato run -ngl`), comma-separated (repeatable); prompt batches of 32+ tokens
    /// multiply the CPU's weights on the GPU, as llama.cpp's op offload does [default: the whole
    /// model on the device].
    #[arg(long = "ngl", visible_alias = "n-gpu-layers", value_name = "N,…")]
    pub ngl: Vec<String>,
    #[command(flatten)]
    pub load: super::LoadArgs,
    /// Measure this machine's memory read bandwidth at each -t thread count (a buffer of the given
    /// size, default 2 GiB, far larger than the caches) instead of running models.
    #[arg(long, value_name = "SIZE", num_args = 0..=1, default_missing_value = "2G")]
    pub membw: Option<String>,
}

/// The flags, checked.
struct Plan {
    models: Vec<PathBuf>,
    n_prompt: Vec<usize>,
    n_gen: Vec<usize>,
    /// -pg's (prompt, generated) pairs.
    pg: Vec<(usize, usize)>,
    depths: Vec<usize>,
    reps: usize,
    threads: Vec<usize>,
    /// -ngl's values; `[None]`: the whole model on the device.
    ngl: Vec<Option<usize>>,
}

/// Parses `--pg 512,128` values: each exactly two whole numbers, not both 0.
fn parse_pg(given: &[String]) -> Result<Vec<(usize, usize)>> {
    given
        .iter()
        .map(|s| {
            let bad = |why: &str| {
                Error::Usage(format!(
                    "-pg {s:?}: {why}; give a prompt and a generation length, e.g. -pg 512,128"
                ))
            };
            let items: Vec<&str> = s.split(',').map(str::trim).collect();
            let [p, g] = items.as_slice() else {
                return Err(bad("not two comma-separated numbers"));
            };
            let num = |v: &str| -> Result<usize> {
                let n: usize = v
                    .parse()
                    .map_err(|_| bad(&format!("{v:?} is not a whole number")))?;
                if n > MAX_TOKENS {
                    return Err(bad(&format!(
                        "more than the {MAX_TOKENS} this command accepts"
                    )));
                }
                Ok(n)
            };
            match (num(p)?, num(g)?) {
                (0, 0) => Err(bad("both lengths are 0")),
                pair => Ok(pair),
            }
        })
        .collect()
}

/// Parses `-p 64,512 -p 1024` style values: every item a whole number, no empty list or item.
fn parse_list(flag: &str, given: &[String], default: usize) -> Result<Vec<usize>> {
    let example = if flag == "-t" { "1,2" } else { "64,512" };
    if given.is_empty() {
        return Ok(vec![default]);
    }
    let mut out = Vec::new();
    for s in given {
        for item in s.split(',') {
            let item = item.trim();
            if item.is_empty() {
                return Err(Error::Usage(format!(
                    "{flag} {s:?}: empty item; give comma-separated whole numbers, e.g. {flag} {example}"
                )));
            }
            let v: usize = item.parse().map_err(|_| {
                Error::Usage(format!(
                    "{flag} {s:?}: {item:?} is not a whole number; give e.g. {flag} {example}"
                ))
            })?;
            if v > MAX_TOKENS {
                return Err(Error::Usage(format!(
                    "{flag} {v}: more than the {MAX_TOKENS} this command accepts"
                )));
            }
            out.push(v);
        }
    }
    Ok(out)
}

impl Plan {
    fn from_args(a: &BenchArgs) -> Result<Plan> {
        let n_prompt = parse_list("-p", &a.n_prompt, 512)?;
        let n_gen = parse_list("-n", &a.n_gen, 128)?;
        let pg = parse_pg(&a.pg)?;
        let depths = parse_list("-d", &a.depth, 0)?;
        let threads = parse_list("-t", &a.threads, 0)?;
        let ngl = match a.ngl.is_empty() {
            true => vec![None],
            false => parse_list("-ngl", &a.ngl, 0)?
                .into_iter()
                .map(Some)
                .collect(),
        };
        let reps: usize = a.reps.trim().parse().map_err(|_| {
            Error::Usage(format!(
                "-r {:?}: not a whole number of repetitions",
                a.reps
            ))
        })?;
        if reps == 0 {
            return Err(Error::Usage(
                "-r 0: at least one repetition is needed".into(),
            ));
        }
        if n_prompt.iter().chain(&n_gen).all(|&n| n == 0) && pg.is_empty() {
            return Err(Error::Usage(
                "nothing to run: every -p and -n value is 0 and there is no -pg".into(),
            ));
        }
        let all_cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let threads = threads
            .into_iter()
            .map(|t| if t == 0 { all_cores } else { t })
            .collect();
        let named: Vec<PathBuf> = a.models.iter().chain(&a.model_flags).cloned().collect();
        let models = if named.is_empty() {
            vec![super::model_path(None)?]
        } else {
            named
        };
        // Refuse a missing file before spending minutes on the ones before it.
        for m in &models {
            if !m.is_file() {
                return Err(Error::Usage(format!("{}: no such model file", m.display())));
            }
        }
        Ok(Plan {
            models,
            n_prompt,
            n_gen,
            pg,
            depths,
            reps,
            threads,
            ngl,
        })
    }
}

/// What the host and the build say about themselves, once per run.
struct Host {
    build_commit: &'static str,
    build_number: u64,
    cpu_info: String,
    isa: &'static str,
    /// The GPU's name when the model runs there, else empty (llama-bench's gpu_info).
    gpu_info: String,
}

impl Host {
    /// llama-bench's `backends` value and oato's `device`.
    fn backend(&self) -> (&'static str, &'static str) {
        if self.gpu_info.is_empty() {
            ("CPU", "cpu")
        } else {
            ("CUDA", "gpu")
        }
    }
}

/// A model as llama-bench describes it.
struct ModelInfo {
    filename: String,
    /// "arch size-label file-type", e.g. "llama 135M Q4_1".
    model_type: String,
    /// Bytes of all tensors (llama_model_size), not of the file.
    size: u64,
    /// Elements of all tensors (llama_model_n_params).
    n_params: u64,
}

impl ModelInfo {
    fn of(path: &Path, model: &Model) -> ModelInfo {
        let f = &model.file;
        let size = f.tensors.iter().map(|t| t.n_bytes).sum();
        let n_params = f.tensors.iter().map(|t| t.n_elements).sum();
        let label = f
            .get_str("general.size_label")
            .map(str::to_string)
            .unwrap_or_else(|| params_label(n_params));
        ModelInfo {
            filename: path.display().to_string(),
            model_type: format!("{} {label} {}", model.hp.arch.name(), ftype_name(f)),
            size,
            n_params,
        }
    }
}

/// "135M", "8B", "1.5B": a parameter count as model names write it.
fn params_label(n: u64) -> String {
    if n >= 1_000_000_000 {
        let b = format!("{:.1}", n as f64 / 1e9);
        format!("{}B", b.strip_suffix(".0").unwrap_or(&b))
    } else {
        format!("{}M", (n as f64 / 1e6).round())
    }
}

/// llama.cpp's name for a `general.file_type` value (llama_ftype_name), for the file types whose
/// tensors oato can read.
fn llama_ftype_name(ftype: u64) -> Option<&'static str> {
    Some(match ftype {
        0 => "all F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        7 => "Q8_0",
        8 => "Q5_0",
        9 => "Q5_1",
        10 => "Q2_K - Medium",
        11 => "Q3_K - Small",
        12 => "Q3_K - Medium",
        13 => "Q3_K - Large",
        14 => "Q4_K - Small",
        15 => "Q4_K - Medium",
        16 => "Q5_K - Small",
        17 => "Q5_K - Medium",
        18 => "Q6_K",
        21 => "Q2_K - Small",
        25 => "IQ4_NL - 4.5 bpw",
        30 => "IQ4_XS - 4.25 bpw",
        32 => "BF16",
        _ => return None,
    })
}

/// The file type: `general.file_type` when the file has it, else guessed as llama.cpp guesses it
/// (the type most tensors have, ties to the first in name order), marked "(guessed)".
fn ftype_name(f: &GgufFile) -> String {
    if let Ok(Some(v)) = f.get_u64("general.file_type") {
        return llama_ftype_name(v)
            .map(str::to_string)
            .unwrap_or_else(|| "unknown, may not work".into());
    }
    let mut tensors: Vec<_> = f.tensors.iter().collect();
    tensors.sort_by(|a, b| a.name.cmp(&b.name));
    let mut counts: Vec<(GgmlType, usize)> = Vec::new();
    let (mut best, mut best_n) = (GgmlType::F32, 0);
    for t in tensors {
        let n = match counts.iter_mut().find(|(ty, _)| *ty == t.ty) {
            Some((_, n)) => {
                *n += 1;
                *n
            }
            None => {
                counts.push((t.ty, 1));
                1
            }
        };
        if n > best_n {
            (best, best_n) = (t.ty, n);
        }
    }
    use GgmlType::*;
    let ftype = match best {
        F16 => 1,
        BF16 => 32,
        Q4_0 => 2,
        Q4_1 => 3,
        Q5_0 => 8,
        Q5_1 => 9,
        Q8_0 => 7,
        Q2_K => 10,
        Q3_K => 12,
        Q4_K => 15,
        Q5_K => 17,
        Q6_K => 18,
        IQ4_NL => 25,
        IQ4_XS => 30,
        _ => 0,
    };
    format!(
        "(guessed) {}",
        llama_ftype_name(ftype).expect("every guessed file type has a name")
    )
}

/// Seeded token ids (their values do not affect timing).
struct TokenRng(SplitMix64);

impl TokenRng {
    /// `n` ids: the first `bos` when given, the rest random in 0..n_vocab.
    fn tokens(&mut self, n: usize, n_vocab: usize, bos: Option<u32>) -> Vec<u32> {
        (0..n)
            .map(|i| match bos {
                Some(b) if i == 0 => b,
                _ => self.0.below(n_vocab as u64) as u32,
            })
            .collect()
    }
}

/// One test's settings and timings.
struct TestResult<'a> {
    model: &'a ModelInfo,
    n_threads: usize,
    /// Layers on the GPU as llama-bench counts them: -ngl's value, else the model's layers and
    /// its head (n_layer + 1) on a GPU, 0 on the CPU.
    n_gpu_layers: usize,
    n_prompt: usize,
    n_gen: usize,
    /// Tokens in the cache before the timed part (-d).
    n_depth: usize,
    /// RFC 3339, UTC, when the test started.
    test_time: String,
    samples_ns: Vec<u64>,
    /// Decode on the CPU: the weight bytes each token reads, the memory's read rates measured
    /// around the runs (one before the first, one after each; `experiments/cpu-vs-llamacpp.sh`
    /// takes both engines' fractions from them) and the paired tokens' fractions, for the JSON
    /// output.
    decode: Option<(usize, Vec<f64>, Vec<f64>)>,
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

/// Sample standard deviation (n - 1), 0 for fewer than two values, as llama-bench.
fn stdev(v: &[f64]) -> f64 {
    if v.len() < 2 {
        return 0.0;
    }
    let m = mean(v);
    (v.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / (v.len() - 1) as f64).sqrt()
}

impl TestResult<'_> {
    fn name(&self) -> String {
        let test = match (self.n_prompt, self.n_gen) {
            (p, 0) => format!("pp{p}"),
            (0, g) => format!("tg{g}"),
            (p, g) => format!("pp{p}+tg{g}"),
        };
        // llama-bench's form for a test after -d tokens.
        match self.n_depth {
            0 => test,
            d => format!("{test} @ d{d}"),
        }
    }

    fn samples_ts(&self) -> Vec<f64> {
        let n = (self.n_prompt + self.n_gen) as f64;
        self.samples_ns
            .iter()
            .map(|&t| 1e9 * n / t.max(1) as f64)
            .collect()
    }

    fn avg_ns(&self) -> u64 {
        self.samples_ns.iter().sum::<u64>() / self.samples_ns.len().max(1) as u64
    }

    fn stddev_ns(&self) -> u64 {
        let ns: Vec<f64> = self.samples_ns.iter().map(|&t| t as f64).collect();
        stdev(&ns) as u64
    }

    /// The fields in llama-bench's order and meaning, then oato's own (`isa`, `device`), then the
    /// samples (JSON only, as in llama-bench).
    fn fields(&self, host: &Host) -> Vec<(&'static str, Value)> {
        let ts = self.samples_ts();
        vec![
            ("build_commit", json!(host.build_commit)),
            ("build_number", json!(host.build_number)),
            ("cpu_info", json!(host.cpu_info)),
            ("gpu_info", json!(host.gpu_info)),
            ("backends", json!(host.backend().0)),
            ("model_filename", json!(self.model.filename)),
            ("model_type", json!(self.model.model_type)),
            ("model_size", json!(self.model.size)),
            ("model_n_params", json!(self.model.n_params)),
            ("n_threads", json!(self.n_threads)),
            ("n_gpu_layers", json!(self.n_gpu_layers)),
            ("n_prompt", json!(self.n_prompt)),
            ("n_gen", json!(self.n_gen)),
            ("n_depth", json!(self.n_depth)),
            ("test_time", json!(self.test_time)),
            ("avg_ns", json!(self.avg_ns())),
            ("stddev_ns", json!(self.stddev_ns())),
            ("avg_ts", json!(mean(&ts))),
            ("stddev_ts", json!(stdev(&ts))),
            ("isa", json!(host.isa)),
            ("device", json!(host.backend().1)),
            ("samples_ns", json!(self.samples_ns)),
            ("samples_ts", json!(ts)),
        ]
    }
}

/// Seconds since the epoch as RFC 3339 UTC ("2025-01-31T12:00:00Z").
fn rfc3339(secs: u64) -> String {
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (H. Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

fn now_rfc3339() -> String {
    rfc3339(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
    )
}

/// Where a test runs the model, and its `n_gpu_layers` as llama-bench reports it: with -ngl `n`,
/// llama.cpp's split ([`DeviceMap::last_layers`], its op offload's prefill streaming from 32
/// tokens; all on the CPU without a GPU), checked against the GPU's free memory; else the whole
/// model on `dev` (n_layer + 1 on a GPU, 0 on the CPU).
fn bench_map(
    model: &Model,
    backends: &[Arc<dyn Backend>],
    dev: usize,
    ngl: Option<usize>,
    n_ctx: usize,
    n_prompt: usize,
) -> Result<(DeviceMap, usize)> {
    match ngl {
        None => Ok((
            DeviceMap::uniform(model, dev),
            if dev == 0 { 0 } else { model.hp.n_layer + 1 },
        )),
        Some(n) => {
            let stream = Some(oato::engine::OP_OFFLOAD_MIN_BATCH);
            let map =
                oato::engine::ngl_map(model, n, backends, dev, n_ctx, n_prompt.max(1), stream)?;
            Ok((map, n))
        }
    }
}

/// Runs one test on the kernels' thread pool as it is set, the model on backend `dev`: a
/// warm-up, then `reps` timed runs.
#[allow(clippy::too_many_arguments)]
fn time_test(
    backends: &[Arc<dyn Backend>],
    map: &DeviceMap,
    model: &Model,
    n_depth: usize,
    n_prompt: usize,
    n_gen: usize,
    reps: usize,
    bos: Option<u32>,
    rng: &mut TokenRng,
    between: &mut dyn FnMut() -> Result<()>,
    paired: Option<&mut Paired>,
) -> Result<Vec<u64>> {
    let n_vocab = model.hp.n_vocab;
    let n_ctx = n_depth + n_prompt + n_gen;
    let mut session = Session::with_devices(model, n_ctx, backends.to_vec(), map)?;
    let mut run = |session: &mut Session, n_prompt: usize, n_gen: usize| -> Result<u64> {
        // Each part starts with BOS, as each of llama-bench's does.
        let depth = rng.tokens(n_depth, n_vocab, bos);
        let prompt = rng.tokens(n_prompt, n_vocab, bos);
        let gen_tokens = rng.tokens(n_gen, n_vocab, bos);
        session.reset();
        if n_depth > 0 {
            session.forward(&depth, Logits::Last)?;
        }
        let t0 = Instant::now();
        if n_prompt > 0 {
            session.forward(&prompt, Logits::Last)?;
        }
        for tok in &gen_tokens {
            session.forward(std::slice::from_ref(tok), Logits::Last)?;
        }
        Ok(t0.elapsed().as_nanos().max(1) as u64)
    };
    // Warm-up, as llama-bench: the whole prompt, or one generated token.
    run(&mut session, n_prompt, n_gen.min(1))?;
    between()?;
    let samples = (0..reps)
        .map(|_| {
            let ns = run(&mut session, n_prompt, n_gen)?;
            between()?;
            Ok(ns)
        })
        .collect::<Result<Vec<u64>>>()?;
    if let Some(p) = paired {
        // After the timed runs: token by token from position 0, each token followed by the
        // plain read.
        session.reset();
        // The first read after the timed runs reads several times slower (1B Q4_0: 65 ms
        // against 13): not counted.
        p.read();
        p.read_secs.clear();
        p.read();
        for tok in rng.tokens(p.tokens, n_vocab, bos) {
            let t0 = Instant::now();
            session.forward(&[tok], Logits::Last)?;
            p.token_secs.push(t0.elapsed().as_secs_f64());
            p.read();
        }
    }
    Ok(samples)
}

/// Most bytes [`Paired`] reads after each token.
const PAIRED_BYTES: usize = 1 << 30;

/// Decode tokens each between two plain reads of as many bytes as a token's weights (up to
/// [`PAIRED_BYTES`]) on the same thread pool, after the timed runs: the token and the reads
/// meet the same moment of the memory, whose rate on a shared machine can move within a run
/// (the rates measured around whole runs then mislead); `examples/decode_mix PLAIN=1` does the
/// same with the very bytes of the weights.
struct Paired {
    map: memmap2::MmapMut,
    at: usize,
    len: usize,
    tokens: usize,
    /// Each token's seconds.
    token_secs: Vec<f64>,
    /// Each read's seconds: one before the first token and one after each.
    read_secs: Vec<f64>,
}

impl Paired {
    /// A buffer for a model whose tokens read `per_token` bytes of weights, written once so its
    /// pages exist (in huge pages where the system gives them, as the weights' copies are).
    fn new(per_token: usize, tokens: usize) -> Result<Paired> {
        let len = per_token.clamp(8, PAIRED_BYTES) / 8 * 8;
        let (mut map, at) = oato::kernels::cpu::repack::huge_anon(len).map_err(|e| {
            Error::Msg(format!(
                "oato bench: could not map {len} bytes to read: {e}"
            ))
        })?;
        map[at..at + len].fill(1);
        Ok(Paired {
            map,
            at,
            len,
            tokens,
            token_secs: Vec::new(),
            read_secs: Vec::new(),
        })
    }

    /// One timed plain read of the buffer.
    fn read(&mut self) {
        let t0 = Instant::now();
        std::hint::black_box(oato::kernels::cpu::plain_read(
            &self.map[self.at..self.at + self.len],
        ));
        self.read_secs.push(t0.elapsed().as_secs_f64());
    }

    /// Each token's rate of weights (`per_token` bytes) over the reads' around it.
    fn fractions(&self, per_token: usize) -> Vec<f64> {
        paired_fractions(per_token, self.len, &self.token_secs, &self.read_secs)
    }
}

/// Per token (its seconds in `tokens`): `per_token` bytes over its time, against the mean rate
/// of the reads of `read` bytes just before and just after it (`reads`: one more than the
/// tokens), as [`Fraction`] sets runs against the rates around them (each token a run of one).
fn paired_fractions(per_token: usize, read: usize, tokens: &[f64], reads: &[f64]) -> Vec<f64> {
    let ts: Vec<f64> = tokens.iter().map(|s| 1.0 / s).collect();
    let bws: Vec<f64> = reads.iter().map(|s| read as f64 / s / 1e9).collect();
    Fraction::of(per_token, &ts, &bws).runs
}

/// The median of `v` (0 when empty).
fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// What `oato bench` prints of the paired tokens' fractions.
fn paired_line(fractions: &[f64], read: usize) -> String {
    let lo = fractions.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = fractions.iter().copied().fold(0.0, f64::max);
    format!(
        "{} tokens, each between two plain reads of {:.0} MiB on the same threads, read {:.2} \
         of those reads' rate (median; {lo:.2}-{hi:.2})",
        fractions.len(),
        read as f64 / (1 << 20) as f64,
        median(fractions),
    )
}

/// Where the results go: a markdown table or CSV row by row, or one JSON array at the end.
enum Printer {
    /// With an `ngl` column when -ngl was given.
    Markdown {
        ngl: bool,
    },
    Csv {
        header_done: bool,
    },
    Json(Vec<String>),
}

/// (column, width): negative widths are left-aligned, as llama-bench's markdown printer.
const MD_COLUMNS: &[(&str, i32)] = &[
    ("model", -30),
    ("size", 10),
    ("params", 10),
    ("backend", -10),
    ("isa", -10),
    ("threads", 7),
    ("test", 15),
    ("t/s", 20),
];

/// The markdown table's columns: [`MD_COLUMNS`], with llama-bench's `ngl` after the backend when
/// -ngl was given.
fn md_columns(ngl: bool) -> Vec<(&'static str, i32)> {
    let mut c = MD_COLUMNS.to_vec();
    if ngl {
        c.insert(4, ("ngl", 5));
    }
    c
}

fn pad(s: &str, width: i32) -> String {
    let w = width.unsigned_abs() as usize;
    if width < 0 {
        format!("{s:<w$}")
    } else {
        format!("{s:>w$}")
    }
}

fn csv_quote(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

/// A JSON value as CSV text: strings bare, numbers as JSON writes them.
fn csv_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

impl Printer {
    fn header(&mut self, out: &mut impl Write) -> std::io::Result<()> {
        if let &mut Printer::Markdown { ngl } = self {
            let columns = md_columns(ngl);
            let names: Vec<String> = columns.iter().map(|&(c, w)| pad(c, w)).collect();
            let rules: Vec<String> = columns
                .iter()
                .map(|&(_, w)| {
                    let dashes = "-".repeat(w.unsigned_abs() as usize - 1);
                    format!("{dashes}{}", if w > 0 { ':' } else { '-' })
                })
                .collect();
            writeln!(out, "| {} |", names.join(" | "))?;
            writeln!(out, "| {} |", rules.join(" | "))?;
        }
        out.flush()
    }

    fn row(&mut self, out: &mut impl Write, t: &TestResult, host: &Host) -> std::io::Result<()> {
        match self {
            &mut Printer::Markdown { ngl } => {
                let size = if t.model.size < 1 << 30 {
                    format!("{:.2} MiB", t.model.size as f64 / (1u64 << 20) as f64)
                } else {
                    format!("{:.2} GiB", t.model.size as f64 / (1u64 << 30) as f64)
                };
                let params = if t.model.n_params < 1_000_000_000 {
                    format!("{:.2} M", t.model.n_params as f64 / 1e6)
                } else {
                    format!("{:.2} B", t.model.n_params as f64 / 1e9)
                };
                let ts = t.samples_ts();
                let mut cells = vec![
                    t.model.model_type.clone(),
                    size,
                    params,
                    host.backend().0.into(),
                ];
                if ngl {
                    cells.push(t.n_gpu_layers.to_string());
                }
                cells.extend([
                    host.isa.into(),
                    t.n_threads.to_string(),
                    t.name(),
                    format!("{:.2} ± {:.2}", mean(&ts), stdev(&ts)),
                ]);
                let cells: Vec<String> = cells
                    .iter()
                    .zip(md_columns(ngl))
                    .map(|(c, (_, w))| pad(c, w))
                    .collect();
                writeln!(out, "| {} |", cells.join(" | "))?;
            }
            Printer::Csv { header_done } => {
                let fields: Vec<_> = t
                    .fields(host)
                    .into_iter()
                    .filter(|(k, _)| !k.starts_with("samples_"))
                    .collect();
                if !*header_done {
                    let names: Vec<&str> = fields.iter().map(|(k, _)| *k).collect();
                    writeln!(out, "{}", names.join(","))?;
                    *header_done = true;
                }
                let values: Vec<String> = fields
                    .iter()
                    .map(|(_, v)| csv_quote(&csv_text(v)))
                    .collect();
                writeln!(out, "{}", values.join(","))?;
            }
            Printer::Json(objects) => {
                let mut fields = t.fields(host);
                // JSON only (the CSV's columns stay llama-bench's and the same for every test).
                if let Some((per_token, bws, paired)) = &t.decode {
                    fields.push(("weight_bytes_per_token", json!(per_token)));
                    fields.push(("membw_gbps", json!(bws)));
                    fields.push(("membw_paired_fractions", json!(paired)));
                }
                let lines: Vec<String> = fields
                    .iter()
                    .map(|(k, v)| format!("    \"{k}\": {v}"))
                    .collect();
                objects.push(format!("  {{\n{}\n  }}", lines.join(",\n")));
            }
        }
        out.flush()
    }

    fn footer(&mut self, out: &mut impl Write, host: &Host) -> std::io::Result<()> {
        match self {
            Printer::Markdown { .. } => writeln!(
                out,
                "\nbuild: {} ({})",
                host.build_commit, host.build_number
            )?,
            Printer::Csv { .. } => {}
            Printer::Json(objects) => writeln!(out, "[\n{}\n]", objects.join(",\n"))?,
        }
        out.flush()
    }
}

pub fn run(a: BenchArgs) -> Result<()> {
    if let Some(size) = &a.membw {
        return membw(size, &a.threads);
    }
    let plan = Plan::from_args(&a)?;
    let isa = oato::kernels::cpu::check_isa_env().map_err(Error::Usage)?;
    let (backends, dev) = super::open_backends(a.device)?;
    let gpu = &backends[dev];
    let host = Host {
        build_commit: env!("OATO_BUILD_COMMIT"),
        build_number: env!("OATO_BUILD_NUMBER").parse().unwrap_or(0),
        cpu_info: oato::kernels::cpu::cpu_name(),
        isa: isa.name(),
        gpu_info: if gpu.kind() == DeviceKind::Gpu {
            gpu.device_name()
        } else {
            String::new()
        },
    };
    let mut printer = if a.json {
        Printer::Json(Vec::new())
    } else if a.csv {
        Printer::Csv { header_done: false }
    } else {
        Printer::Markdown {
            ngl: !a.ngl.is_empty(),
        }
    };
    let stdout_err = |e: std::io::Error| Error::Msg(format!("writing the results: {e}"));

    let tests: Vec<(usize, usize, usize)> = (plan.n_prompt.iter().map(|&p| (p, 0)))
        .chain(plan.n_gen.iter().map(|&g| (0, g)))
        .chain(plan.pg.iter().copied())
        .filter(|&(p, g)| p + g > 0)
        .flat_map(|(p, g)| plan.depths.iter().map(move |&d| (d, p, g)))
        .collect();
    let total = plan.models.len() * plan.threads.len() * plan.ngl.len() * tests.len();
    let mut rng = TokenRng(SplitMix64::new(a.seed));
    let mut done = 0;
    // Open every model first, so a bad file fails before any timing (read in or mapped, as
    // --mmap / --no-mmap or the file's size say).
    a.load.apply();
    let models = plan
        .models
        .iter()
        .map(|p| Model::open(p).map(|m| (ModelInfo::of(p, &m), m)))
        .collect::<Result<Vec<_>>>()?;
    let mut stdout = std::io::stdout().lock();
    printer.header(&mut stdout).map_err(stdout_err)?;
    for (info, model) in &models {
        // The BOS id llama-bench puts first, when the model's tokenizer adds one.
        let bos = Tokenizer::from_gguf(&model.file)
            .ok()
            .filter(|t| t.add_bos())
            .and_then(|t| t.bos());
        for &n_threads in &plan.threads {
            // The kernels' thread pool, resized for this thread count.
            let n_threads = super::init_threads(n_threads)?;
            // llama-bench's order: each -ngl value's tests in turn.
            let runs = plan
                .ngl
                .iter()
                .flat_map(|&n| tests.iter().map(move |&t| (n, t)));
            for (ngl, (n_depth, n_prompt, n_gen)) in runs {
                done += 1;
                let (map, n_gpu_layers) = bench_map(
                    model,
                    &backends,
                    dev,
                    ngl,
                    n_depth + n_prompt + n_gen,
                    n_prompt,
                )?;
                let mut t = TestResult {
                    model: info,
                    n_threads,
                    n_gpu_layers,
                    n_prompt,
                    n_gen,
                    n_depth,
                    test_time: now_rfc3339(),
                    samples_ns: Vec::new(),
                    decode: None,
                };
                eprintln!(
                    "oato bench {done}/{total}: {} {}, {n_threads} threads, {isa}: warm-up + {} runs",
                    info.filename,
                    t.name(),
                    plan.reps,
                    isa = host.isa,
                );
                // Decode against the memory: its read bandwidth at these threads after the
                // warm-up and after each run, so each run has its own (a shared machine's memory
                // rate moves within seconds).
                // Not deep in a context, where the cache's reads join the weights'.
                let decode = n_gen > 0 && n_prompt == 0 && n_depth == 0 && host.gpu_info.is_empty();
                let mut bws = Vec::new();
                let mut probe = || -> Result<()> {
                    if decode {
                        bws.push(read_bandwidth(MEMBW_BYTES, n_threads)?);
                    }
                    Ok(())
                };
                let per_token: usize = target_weights(model).iter().map(|w| w.n_bytes).sum();
                let mut paired = match decode {
                    true => match Paired::new(per_token, n_gen.min(PAIRED_TOKENS)) {
                        Ok(p) => Some(p),
                        Err(e) => {
                            eprintln!("oato bench: no paired reads: {e}");
                            None
                        }
                    },
                    false => None,
                };
                t.samples_ns = time_test(
                    &backends,
                    &map,
                    model,
                    n_depth,
                    n_prompt,
                    n_gen,
                    plan.reps,
                    bos,
                    &mut rng,
                    &mut probe,
                    paired.as_mut(),
                )?;
                let ts = t.samples_ts();
                eprintln!(
                    "oato bench {done}/{total}: {} {:.2} ± {:.2} t/s",
                    t.name(),
                    mean(&ts),
                    stdev(&ts)
                );
                if decode {
                    eprintln!(
                        "oato bench: {}",
                        Fraction::of(per_token, &ts, &bws).line(&t.name(), n_threads)
                    );
                    let fractions = paired.map_or(Vec::new(), |p| {
                        let f = p.fractions(per_token);
                        eprintln!("oato bench: {}", paired_line(&f, p.len));
                        f
                    });
                    t.decode = Some((per_token, bws, fractions));
                }
                printer.row(&mut stdout, &t, &host).map_err(stdout_err)?;
            }
        }
    }
    printer.footer(&mut stdout, &host).map_err(stdout_err)
}

/// Decode's weight read rate against the memory's, run by run.
struct Fraction {
    /// Mean GB/s of weights over the runs.
    gbps: f64,
    /// Mean of the memory's read rates measured.
    bw: f64,
    /// Each run's GB/s of weights over the mean of the rates measured just before and just
    /// after it.
    runs: Vec<f64>,
    /// Runs (from 1) whose two rates differ by more than a tenth.
    moved: Vec<usize>,
}

impl Fraction {
    /// `per_token` weight bytes, each run's tokens per second `ts`, and `bws`: the memory's rate
    /// before the first run and after each (one more than the runs).
    fn of(per_token: usize, ts: &[f64], bws: &[f64]) -> Fraction {
        assert_eq!(
            bws.len(),
            ts.len() + 1,
            "one rate before the runs and one after each"
        );
        let rate = |t: f64| per_token as f64 * t / 1e9;
        let runs = ts
            .iter()
            .zip(bws.windows(2))
            .map(|(&t, w)| rate(t) / ((w[0] + w[1]) / 2.0))
            .collect();
        let moved = (bws.windows(2).enumerate())
            .filter(|(_, w)| w[0].max(w[1]) > 1.1 * w[0].min(w[1]))
            .map(|(i, _)| i + 1)
            .collect();
        Fraction {
            gbps: rate(mean(ts)),
            bw: mean(bws),
            runs,
            moved,
        }
    }

    /// The median of the runs' fractions.
    fn median(&self) -> f64 {
        median(&self.runs)
    }

    /// What `oato bench` prints for test `name` at `threads`.
    fn line(&self, name: &str, threads: usize) -> String {
        let runs: Vec<String> = self.runs.iter().map(|f| format!("{f:.2}")).collect();
        let moved = match self.moved.as_slice() {
            [] => String::new(),
            m => {
                let m: Vec<String> = m.iter().map(|r| r.to_string()).collect();
                format!(
                    "; the memory's rate moved by more than 10% during run {}",
                    m.join(", ")
                )
            }
        };
        format!(
            "{name} reads {:.1} GB/s of weights = {:.2} of the {:.1} GB/s this machine reads at \
             {threads} threads (the median of the runs, each over the rate oato bench --membw's \
             loop measured just before and just after it: {}{moved})",
            self.gbps,
            self.median(),
            self.bw,
            runs.join(" / "),
        )
    }
}

/// Decode tokens paired with a plain read each ([`Paired`]), at most.
const PAIRED_TOKENS: usize = 32;

/// Buffer `oato bench` reads to measure the memory's bandwidth for decode's fraction (four times
/// the last-level cache of this project's 2-core EPYC, 32 MiB).
const MEMBW_BYTES: usize = 128 << 20;

/// `oato bench --membw`: read bandwidth of a buffer far larger than the caches, each thread
/// reading the part it first touched (so pages sit near it), best of five passes per thread count.
fn membw(size: &str, threads: &[String]) -> Result<()> {
    let bytes = match oato::scheduler::parse_budget(size) {
        Ok(oato::scheduler::Budget::Bytes(b)) => usize::try_from(b).unwrap_or(usize::MAX),
        _ => {
            return Err(Error::Usage(format!(
                "--membw {size:?}: give a size with a unit, e.g. 2G"
            )));
        }
    };
    if bytes < (64 << 20) {
        return Err(Error::Usage(format!(
            "--membw {size}: give at least 64M, far more than the caches hold"
        )));
    }
    let threads = parse_list("-t", threads, 0)?;
    let all = std::thread::available_parallelism().map_or(1, |n| n.get());
    let words = bytes / 8;
    println!("| threads | read GB/s |");
    println!("|---:|---:|");
    for t in threads {
        let t = if t == 0 { all } else { t };
        let gbps = read_bandwidth(words, t)?;
        println!("| {t} | {gbps:.1} |");
    }
    Ok(())
}

/// GB/s reading `words` u64s with `t` threads: each thread allocates and first touches its share,
/// then all read their shares together (released by a barrier); the best of five passes.
fn read_bandwidth(words: usize, t: usize) -> Result<f64> {
    let t = t.max(1);
    let per = words.div_ceil(t);
    let barrier = std::sync::Barrier::new(t);
    let best = std::sync::Mutex::new(f64::MAX);
    let failed = std::sync::Mutex::new(None);
    std::thread::scope(|s| {
        for i in 0..t {
            let (barrier, best, failed) = (&barrier, &best, &failed);
            s.spawn(move || {
                let n = per.min(words.saturating_sub(i * per));
                // In huge pages, as the weights are: in 4 KiB pages this loop read about 10%
                // less at 1 EPYC thread (29.9-31.5 against 33.6-35.5 GB/s for matmul_dram's
                // read of arena copies, alternated), which made decode's fractions look that
                // much better.
                let mut map = oato::kernels::cpu::repack::huge_anon(n * 8).ok();
                if map.is_none() {
                    // Still meets the barriers, with nothing to read.
                    *failed.lock().unwrap() = Some(n * 8);
                }
                let v: &mut [u64] = map.as_mut().map_or(&mut [], |(m, at)| {
                    // SAFETY: the map holds `at + 8 n` bytes, `at` is 2 MiB aligned in it, u64
                    // has no invalid bit patterns, and the slice is the map's only user.
                    unsafe { std::slice::from_raw_parts_mut(m.as_mut_ptr().add(*at).cast(), n) }
                });
                v.fill(i as u64 + 1);
                for _ in 0..5 {
                    barrier.wait();
                    let t0 = Instant::now();
                    let sum = sum_words(v);
                    barrier.wait();
                    let dt = t0.elapsed().as_secs_f64();
                    std::hint::black_box(sum);
                    let mut b = best.lock().unwrap();
                    *b = b.min(dt);
                }
            });
        }
    });
    if let Some(n) = failed.into_inner().unwrap() {
        return Err(Error::Msg(format!("--membw: could not allocate {n} bytes")));
    }
    let dt = best.into_inner().unwrap();
    Ok((words * 8) as f64 / dt / 1e9)
}

/// A sum over eight independent lanes (the compiler vectorises it), so the loop is bound by
/// memory, not by one addition chain.
fn sum_words(v: &[u64]) -> u64 {
    let mut acc = [0u64; 8];
    let chunks = v.chunks_exact(8);
    let tail: u64 = chunks.remainder().iter().fold(0, |a, &x| a.wrapping_add(x));
    for c in chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a = a.wrapping_add(x);
        }
    }
    acc.iter().fold(tail, |a, &x| a.wrapping_add(x))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_parse_and_refuse_bad_items() {
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        assert_eq!(parse_list("-p", &s(&[]), 512).unwrap(), vec![512]);
        assert_eq!(
            parse_list("-p", &s(&["64,512", "0"]), 1).unwrap(),
            vec![64, 512, 0]
        );
        for bad in ["abc", "", "64,", ",", "-1", "1.5"] {
            let e = parse_list("-p", &s(&[bad]), 1).unwrap_err().to_string();
            assert!(e.contains("-p"), "{bad:?}: {e}");
        }
    }

    #[test]
    fn decode_fraction_takes_each_run_against_its_own_rates() {
        // 1 GB a token: runs at 30 and 20 t/s between rates 40, 20 and 20 GB/s.
        let f = Fraction::of(1_000_000_000, &[30.0, 20.0], &[40.0, 20.0, 20.0]);
        assert_eq!(f.runs, vec![1.0, 1.0]);
        assert_eq!(f.moved, vec![1]);
        assert_eq!(f.median(), 1.0);
        assert_eq!(f.gbps, 25.0);
        let line = f.line("tg2", 2);
        assert!(line.contains("= 1.00 of the 26.7 GB/s"), "{line}");
        assert!(
            line.contains("1.00 / 1.00") && line.contains("during run 1"),
            "{line}"
        );
        let f = Fraction::of(1_000_000_000, &[10.0, 20.0, 30.0], &[40.0; 4]);
        assert_eq!((f.median(), f.moved.len()), (0.5, 0));
    }

    #[test]
    fn paired_fractions_set_each_token_against_its_own_read() {
        // 2 GB a token in 0.1 s (20 GB/s) and 0.05 s (40 GB/s); 1 GB reads at 20, 30 and 50
        // GB/s around them (means 25 and 40 GB/s).
        let f = paired_fractions(
            2_000_000_000,
            1_000_000_000,
            &[0.1, 0.05],
            &[0.05, 0.1 / 3.0, 0.02],
        );
        assert!(
            (f[0] - 0.8).abs() < 1e-12 && (f[1] - 1.0).abs() < 1e-12,
            "{f:?}"
        );
        assert_eq!(median(&[0.9, 0.7, 0.8]), 0.8);
        assert_eq!(median(&[0.9, 0.7]), 0.8);
        assert_eq!(median(&[]), 0.0);
        let line = paired_line(&[0.8, 1.0, 0.9], 512 << 20);
        assert!(
            line.starts_with("3 tokens, each between two plain reads of 512 MiB")
                && line.contains("read 0.90 of those reads' rate (median; 0.80-1.00)"),
            "{line}"
        );
    }

    #[test]
    fn stats_match_llama_bench() {
        // Sample standard deviation (n - 1): of 2, 4, 4, 4, 5, 5, 7, 9 it is sqrt(32 / 7).
        let v = [2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0];
        assert_eq!(mean(&v), 5.0);
        assert!((stdev(&v) - (32.0f64 / 7.0).sqrt()).abs() < 1e-12);
        assert_eq!(stdev(&[3.0]), 0.0);
    }

    #[test]
    fn dates_are_rfc3339_utc() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_735_689_599), "2024-12-31T23:59:59Z");
    }

    #[test]
    fn params_labels_read_like_model_names() {
        assert_eq!(params_label(134_515_008), "135M");
        assert_eq!(params_label(8_030_261_248), "8B");
        assert_eq!(params_label(1_543_714_304), "1.5B");
    }
}

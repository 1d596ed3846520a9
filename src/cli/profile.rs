//! `oato profile [MODEL] [--batches 1,64] [--reps N] [-o profile.json] [--force]`: time every target
//! operator on the CPU and the GPU (when present) and the link between them.

use std::path::PathBuf;

use clap::Args;

use oato::error::{Error, Result};
use oato::model::Model;
use oato::profiler::{ProfileOptions, load_or_profile};

use super::DeviceArg;

#[derive(Args)]
pub struct ProfileArgs {
    #[command(flatten)]
    pub model: super::ModelArg,
    /// Batch sizes to time each operator at, comma-separated (1 is decode; the prompt length is
    /// prefill). Those above 64 are timed on the middle layer's operator of each kind, type and
    /// shape and given to the others; the largest also sets the non-target operators' prompt
    /// (attention over it, decode at that position).
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 64])]
    pub batches: Vec<usize>,
    /// Timed repetitions per measurement, after warm-up (the median is kept).
    #[arg(long, default_value_t = 5)]
    pub reps: usize,
    /// Where to write the profile.
    #[arg(short = 'o', long, default_value = "profile.json")]
    pub output: PathBuf,
    /// Measure again even when a cached profile exists.
    #[arg(long)]
    pub force: bool,
    /// CPU threads (0: all cores).
    #[arg(short = 't', long, default_value_t = 0)]
    pub threads: usize,
    /// Profile on the CPU only, or also on the GPU (auto: when there is one).
    #[arg(long, value_enum, default_value = "auto")]
    pub device: DeviceArg,
}

pub fn run(a: ProfileArgs) -> Result<()> {
    let path = a.model.path()?;
    let threads = super::init_threads(a.threads)?;
    if a.reps == 0 {
        return Err(Error::Usage("--reps must be at least 1".into()));
    }
    let (backends, dev) = super::open_backends(a.device)?;
    let model = Model::open(&path)?;
    let name = super::file_name(&path);
    let gpu = (dev != 0).then(|| &*backends[dev]);
    let opts = ProfileOptions {
        batches: a.batches.clone(),
        reps: a.reps,
        progress: true,
    };
    let (prof, cached) =
        load_or_profile(&model, &name, &*backends[0], gpu, threads, &opts, a.force)?;
    let text = serde_json::to_string_pretty(&prof).map_err(|e| Error::Msg(e.to_string()))?;
    std::fs::write(&a.output, text + "\n").map_err(|e| Error::io(&a.output, e))?;
    let sum = |f: &dyn Fn(&oato::profiler::profile::ProfileEntry) -> Option<f64>| -> f64 {
        prof.operators.iter().filter_map(f).sum::<f64>() / 1e3
    };
    let b1 = |t: &std::collections::BTreeMap<String, f64>| t.get("1").copied();
    eprintln!(
        "{} operators of {name} on {}{}: {} ({:.1} s{})",
        prof.operators.len(),
        backends[0].describe(),
        gpu.map(|g| format!(" and {}", g.describe()))
            .unwrap_or_default(),
        if cached { "cached profile" } else { "profiled" },
        prof.profiling_s,
        if cached {
            ", when measured; --force re-profiles"
        } else {
            ""
        },
    );
    eprintln!(
        "decode step, all target operators: cpu {:.2} ms{}",
        sum(&|o| b1(&o.cpu_us)),
        if prof.gpu.is_some() {
            format!(", gpu {:.2} ms", sum(&|o| o.gpu_us.as_ref().and_then(b1)))
        } else {
            String::new()
        }
    );
    if let Some(l) = &prof.link {
        let of = |got: f64, pinned: Option<f64>| match pinned {
            Some(p) if p > 0.0 => format!(" ({:.0}% of a pinned copy's {p:.1})", 100.0 * got / p),
            _ => String::new(),
        };
        let act = l.act_h2d_gbps.map_or(String::new(), |a| {
            format!(", activations {a:.1} GB/s{}", of(a, l.pinned_h2d_gbps))
        });
        eprintln!(
            "link: host→device {:.1} GB/s{}{act}, device→host {:.1} GB/s{}, latency {:.1} us, \
             crossing {} us",
            l.h2d_gbps,
            of(l.h2d_gbps, l.pinned_h2d_gbps),
            l.d2h_gbps,
            of(l.d2h_gbps, l.pinned_d2h_gbps),
            l.latency_us,
            l.crossing_us.map_or("?".to_string(), |c| format!("{c:.1}"))
        );
    }
    if let Some(j) = prof.host.job_us {
        eprintln!(
            "cpu: a decode matmul job's fixed cost {j:.1} us ({} threads; what gate and up save \
             as one job)",
            prof.host.threads
        );
    }
    if let Some(g) = gpu {
        for line in g.choices() {
            eprintln!("gpu: {line}");
        }
    }
    eprintln!("wrote {}", a.output.display());
    Ok(())
}

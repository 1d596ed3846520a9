//! Subcommand implementations and the options they share.

pub mod bench;
pub mod inspect;
pub mod perplexity;
pub mod plan;
pub mod profile;
pub mod run;
pub mod selftest;
pub mod synth;

use std::path::PathBuf;
use std::sync::Arc;

use oato::error::{Error, Result};
use oato::runtime::backend::Backend;
use oato::runtime::cpu_backend::CpuBackend;
use oato::runtime::cuda_backend::{self, CudaBackend};
use oato::runtime::test_device::TestDevice;

/// The model `oato run` uses when none is named.
pub const DEFAULT_MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

/// The model path to use: the one given, else `$OATO_MODEL`, else the default test model.
pub fn model_path(given: Option<PathBuf>) -> Result<PathBuf> {
    if let Some(p) = given {
        return Ok(p);
    }
    if let Some(p) = std::env::var_os("OATO_MODEL") {
        return Ok(PathBuf::from(p));
    }
    let p = PathBuf::from(DEFAULT_MODEL);
    if p.exists() {
        Ok(p)
    } else {
        Err(Error::Usage(format!(
            "no model given and the default model {DEFAULT_MODEL} is missing: fetch it with \
             scripts/fetch-models.sh, or pass a GGUF file"
        )))
    }
}

/// The file name of a path, for reports.
pub fn file_name(p: &std::path::Path) -> String {
    p.file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Sets up the CPU thread pool: `threads` threads, or every core when 0. Also checks
/// `OATO_CPU_ISA`, so a bad value is an error before any work.
pub fn init_threads(threads: usize) -> Result<usize> {
    oato::kernels::cpu::check_isa_env().map_err(Error::Usage)?;
    let n = if threads == 0 {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    } else {
        threads
    };
    Ok(oato::kernels::cpu::pool::set_threads(n))
}

/// `--device`: where a whole model or a test runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DeviceArg {
    /// The GPU when one is usable, else the CPU (saying why in one line).
    Auto,
    Cpu,
    Gpu,
}

/// The backends for `dev` (the CPU first, then the GPU when one is used) and the index of the
/// one that computes. `--device gpu` without a usable GPU is an error naming the reason.
///
/// `OATO_TEST_DEVICE=<bytes>` stands a CPU-backed test device of that size in for the GPU, so
/// the placement pipeline can be exercised on machines without one.
pub fn open_backends(dev: DeviceArg) -> Result<(Vec<Arc<dyn Backend>>, usize)> {
    let cpu: Arc<dyn Backend> = Arc::new(CpuBackend::new());
    if dev != DeviceArg::Cpu
        && let Some(v) = std::env::var_os("OATO_TEST_DEVICE")
    {
        let bytes = v.to_string_lossy().parse::<usize>().map_err(|_| {
            Error::Usage(format!(
                "OATO_TEST_DEVICE={v:?}: give the test device's size in bytes"
            ))
        })?;
        return Ok((vec![cpu, Arc::new(TestDevice::new(bytes))], 1));
    }
    let want_gpu = match dev {
        DeviceArg::Cpu => false,
        DeviceArg::Gpu => {
            cuda_backend::probe().map_err(|why| Error::Usage(format!("--device gpu: {why}")))?;
            true
        }
        DeviceArg::Auto => match cuda_backend::probe() {
            Ok(_) => true,
            Err(why) => {
                eprintln!("oato: no GPU ({why}); running on the CPU");
                false
            }
        },
    };
    if !want_gpu {
        return Ok((vec![cpu], 0));
    }
    match CudaBackend::new(0) {
        Ok(g) => Ok((vec![cpu, Arc::new(g)], 1)),
        Err(e) if dev == DeviceArg::Auto => {
            eprintln!("oato: GPU unusable ({e}); running on the CPU");
            Ok((vec![cpu], 0))
        }
        Err(e) => Err(e),
    }
}

/// Whether the whole model fits in `be`'s free memory: its target and non-target weights (not the
/// embedding table, which stays in the memory map unless it is also the output head), the KV cache
/// for `ctx` tokens and the scheduler's workspace for a `prompt_tokens` prefill. The reason, with
/// the numbers, when not.
pub fn fits_whole(
    model: &oato::model::Model,
    ctx: usize,
    prompt_tokens: usize,
    be: &dyn Backend,
) -> Result<(), String> {
    use oato::runtime::forward::target_weights;
    let hp = &model.hp;
    let targets = target_weights(model);
    let tied = model.output.name == "token_embd.weight";
    let weights: usize = model
        .file
        .tensors
        .iter()
        .filter(|t| tied || t.name != "token_embd.weight")
        .map(|t| t.n_bytes as usize)
        .sum();
    let kv = oato::runtime::kv_cache::bytes_per_token(hp.n_layer, hp.kv_dim()) * ctx;
    let largest = targets
        .iter()
        .map(|w| (w.k * w.n) as u64)
        .max()
        .unwrap_or(0);
    let workspace = oato::scheduler::workspace_for(
        largest,
        hp.n_embd as u64,
        hp.n_ff as u64,
        hp.n_vocab as u64,
        prompt_tokens,
    ) as usize;
    let need = weights + kv + workspace;
    let free = be.memory().map_err(|e| e.to_string())?.free;
    if need > free {
        let mib = |b: usize| b as f64 / (1u64 << 20) as f64;
        return Err(format!(
            "the model needs {:.0} MiB on {} ({:.0} MiB of weights + {:.0} MiB of KV cache for \
             {ctx} tokens + {:.0} MiB workspace), {:.0} MiB are free",
            mib(need),
            be.device_name(),
            mib(weights),
            mib(kv),
            mib(workspace),
            mib(free)
        ));
    }
    Ok(())
}

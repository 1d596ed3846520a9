//! Subcommand implementations and the options they share.

pub mod bench;
pub mod chat;
pub mod inspect;
pub mod options;
pub mod perplexity;
pub mod plan;
pub mod plot;
pub mod profile;
pub mod run;
pub mod selftest;
pub mod serve;
pub mod synth;

use std::path::PathBuf;

use oato::error::{Error, Result};

/// The model `oato run` uses when none is named.
pub const DEFAULT_MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

/// The model of `run`, `chat`, `perplexity`, `profile` and `serve`: the argument or, as
/// llama.cpp's tools take it, `-m` (one or the other).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct ModelArg {
    /// GGUF model (default: models/SmolLM2-135M-Instruct.Q4_1.gguf, or $OATO_MODEL).
    #[arg(value_name = "MODEL")]
    pub model: Option<PathBuf>,
    /// The GGUF model as llama.cpp's tools take it (`-m model.gguf`): the same as MODEL, which
    /// it replaces.
    #[arg(
        short = 'm',
        long = "model",
        value_name = "MODEL",
        conflicts_with = "model"
    )]
    pub flag: Option<PathBuf>,
}

impl ModelArg {
    /// The model to load ([`model_path`] of the one named either way).
    pub fn path(&self) -> Result<PathBuf> {
        model_path(self.model.clone().or(self.flag.clone()))
    }
}

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

/// How a command that runs a model holds the file: `--no-mmap`, `--mmap`, or neither (map it;
/// for a file of at least 64 MiB that takes at most half of the available memory, the CPU copies
/// the weights it runs into huge pages of its own).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct LoadArgs {
    /// Read the whole model into memory backed by huge pages instead of mapping the file, as
    /// llama.cpp's --no-mmap: more memory and a slower start. By default the file is mapped and,
    /// when it takes at most half of the available memory, the CPU copies only the weights it
    /// runs into huge pages (Q4_0 interleaved for the AVX-512 and AVX2 kernels in any case)
    #[arg(long = "no-mmap", conflicts_with = "mmap")]
    pub no_mmap: bool,
    /// Map the model file and read the CPU's weights from the map (Q4_0 weights the AVX-512 or AVX2
    /// kernels interleave are still copies)
    #[arg(long)]
    pub mmap: bool,
}

impl LoadArgs {
    /// Tells the GGUF reader.
    pub fn apply(&self) {
        use oato::gguf::{Load, set_load};
        set_load(match (self.no_mmap, self.mmap) {
            (true, _) => Load::Copy,
            (_, true) => Load::Map,
            _ => Load::Auto,
        });
    }
}

/// `-c/--ctx` as llama.cpp reads it: 0 is the model's training context (its
/// `{arch}.context_length`, 2048 where the file has none), any other value itself.
pub fn ctx_or_model(ctx: usize, hp: &oato::model::hparams::HParams) -> usize {
    if ctx == 0 { hp.n_ctx_train.max(1) } else { ctx }
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
pub use oato::engine::DeviceChoice as DeviceArg;
pub use oato::engine::{file_name, open_backends};

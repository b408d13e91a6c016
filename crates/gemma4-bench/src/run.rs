//! A whole benchmark: observe the server, prepare prompts, warm up, sweep the
//! concurrency levels, run the probes, and assemble the report.

use std::path::{Path, PathBuf};
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{json, Value};
use tokio::sync::watch;

use crate::client::{CallError, Endpoint};
use crate::cost::{cost_block, ApiPrice};
use crate::error::{BenchError, Result};
use crate::loadgen::{run_level, summarize, PlannedRequest};
use crate::observe::{self, ServerInfo};
use crate::prompts::{read_jsonl, Prompt, RandomPrompts, TokenCounter};
use crate::report::{
    Hardware, LoadEntry, Pricing, Report, Run, SweepRow, Throughput, Workload, SCHEMA_VERSION,
};
use crate::{plots, probes, schema};

/// The path of the sweep's requests.
pub const COMPLETIONS_PATH: &str = "v1/completions";
/// Largest concurrency level accepted.
pub const MAX_CONCURRENCY: u32 = 4096;
/// Warm-up requests generate at most this many tokens.
const WARMUP_MAX_TOKENS: u32 = 16;

/// Where prompts come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Dataset {
    /// Random words of exactly `input_len` tokens.
    Random,
    /// A JSONL file of `{"prompt", "output_len"?}` objects, used in order and
    /// cycled when the run needs more prompts than it has.
    File(PathBuf),
}

impl std::str::FromStr for Dataset {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.trim() {
            "" => Err("the dataset is empty; use 'random' or a JSONL file".to_owned()),
            "random" => Ok(Dataset::Random),
            path => Ok(Dataset::File(PathBuf::from(path))),
        }
    }
}

/// Everything `gemma4 bench serve` takes.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    pub url: String,
    pub model: String,
    pub concurrency: Vec<u32>,
    pub num_prompts: u32,
    pub input_len: u32,
    pub output_len: u32,
    pub dataset: Dataset,
    pub seed: u64,
    pub api_key: Option<String>,
    /// A checkpoint directory or GGUF file whose tokenizer measures prompts
    /// when the server has no `/tokenize`.
    pub tokenizer: Option<PathBuf>,
    pub warmup: u32,
    pub request_timeout: Duration,
    pub probes: bool,
    pub price_per_hour: Option<f64>,
    pub api_price: Option<ApiPrice>,
    pub accelerator: Option<String>,
    pub chips: Option<u32>,
    pub run_id: Option<String>,
    pub run_notes: Option<String>,
    /// Draw a progress bar per level on stderr.
    pub progress: bool,
}

impl BenchOptions {
    /// Options with the defaults of the command line.
    pub fn new(url: &str, model: &str) -> Self {
        BenchOptions {
            url: url.to_owned(),
            model: model.to_owned(),
            concurrency: vec![1, 8, 32],
            num_prompts: 100,
            input_len: 1024,
            output_len: 128,
            dataset: Dataset::Random,
            seed: 0,
            api_key: None,
            tokenizer: None,
            warmup: 2,
            request_timeout: Duration::from_secs(600),
            probes: false,
            price_per_hour: None,
            api_price: None,
            accelerator: None,
            chips: None,
            run_id: None,
            run_notes: None,
            progress: false,
        }
    }

    fn check(&self) -> Result<()> {
        let bad = |m: &str| Err(BenchError::InvalidArgument(m.to_owned()));
        if self.concurrency.is_empty() {
            return bad("at least one concurrency level is needed");
        }
        if let Some(c) = self
            .concurrency
            .iter()
            .find(|c| **c == 0 || **c > MAX_CONCURRENCY)
        {
            return Err(BenchError::InvalidArgument(format!(
                "concurrency {c} is out of range 1..={MAX_CONCURRENCY}"
            )));
        }
        if self.num_prompts == 0 {
            return bad("--num-prompts must be at least 1");
        }
        if self.input_len == 0 || self.output_len == 0 {
            return bad("--input-len and --output-len must be at least 1");
        }
        if self.model.trim().is_empty() {
            return bad("--model must name the served model");
        }
        if self
            .price_per_hour
            .is_some_and(|p| !(p.is_finite() && p >= 0.0))
        {
            return bad("--price-per-hour must be a non-negative number");
        }
        Ok(())
    }
}

/// Parses `1,8,32` into concurrency levels: positive integers separated by
/// commas, each at most [`MAX_CONCURRENCY`].
pub fn parse_concurrency(text: &str) -> Result<Vec<u32>> {
    parse_levels(text)
        .map_err(|why| BenchError::InvalidArgument(format!("--concurrency '{text}': {why}")))
}

/// [`parse_concurrency`] with the bare reason as the error, for argument parsers
/// that name the flag and value themselves.
pub fn parse_levels(text: &str) -> std::result::Result<Vec<u32>, String> {
    text.split(',')
        .map(|part| {
            let part = part.trim();
            if part.is_empty() {
                return Err(
                    "empty entry; expected positive integers separated by commas, e.g. 1,8,32"
                        .to_owned(),
                );
            }
            match part.parse::<u32>() {
                Ok(0) => Err("0 is not a concurrency level; levels start at 1".to_owned()),
                Ok(n) if n > MAX_CONCURRENCY => {
                    Err(format!("{n} is above the maximum {MAX_CONCURRENCY}"))
                }
                Ok(n) => Ok(n),
                Err(_) => Err(format!(
                    "'{part}' is not a positive integer; expected e.g. 1,8,32"
                )),
            }
        })
        .collect()
}

/// Which optional request fields the server accepts.
#[derive(Debug, Clone, Copy)]
struct Extras {
    ignore_eos: bool,
    usage: bool,
}

impl Extras {
    fn names(self) -> Vec<String> {
        let mut names = Vec::new();
        if self.ignore_eos {
            names.push("ignore_eos".to_owned());
            names.push("min_tokens".to_owned());
        }
        if self.usage {
            names.push("stream_options.include_usage".to_owned());
        }
        names
    }
}

fn completion_body(model: &str, prompt: &str, max_tokens: u32, extras: Extras) -> Value {
    let mut body = json!({
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": true,
    });
    if extras.usage {
        body["stream_options"] = json!({"include_usage": true});
    }
    if extras.ignore_eos {
        body["ignore_eos"] = json!(true);
        body["min_tokens"] = json!(max_tokens);
    }
    body
}

fn is_rejection(e: &Option<CallError>) -> bool {
    matches!(
        e,
        Some(CallError::Status {
            status: 400 | 422,
            ..
        })
    )
}

fn progress_bar(show: bool, len: u64, prefix: String) -> ProgressBar {
    if !show {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(len);
    if let Ok(style) =
        ProgressStyle::with_template("{prefix:>7} [{bar:40}] {pos}/{len} requests, {elapsed}")
    {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_prefix(prefix);
    bar
}

fn run_nonce() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    nanos ^ (u64::from(std::process::id()) << 32)
}

fn load_tokenizer(path: &Path) -> Result<gemma4_text::Tokenizer> {
    let loaded = if path.is_dir() {
        gemma4_text::Tokenizer::from_dir(path)
    } else {
        gemma4_text::Tokenizer::from_gguf(path)
    };
    loaded.map_err(|e| BenchError::Tokenizer(format!("loading {}: {e}", path.display())))
}

/// Prompts for the warm-up and every level, in that order.
async fn prepare_prompts(
    opts: &BenchOptions,
    counter: &mut TokenCounter,
    total: usize,
    notes: &mut Vec<String>,
    cancel: &watch::Receiver<bool>,
) -> Result<(Vec<Prompt>, bool)> {
    match &opts.dataset {
        Dataset::Random => {
            let mut gen =
                RandomPrompts::new(opts.seed, run_nonce(), opts.input_len, opts.output_len);
            let mut prompts = Vec::with_capacity(total);
            let mut all_exact = true;
            for i in 0..total {
                if *cancel.borrow() {
                    break;
                }
                let built = match gen.build(i as u64, counter).await {
                    Ok(b) => b,
                    Err(e) => {
                        notes.push(format!("Prompt token counting failed ({e}); the remaining prompts are approximate."));
                        *counter = TokenCounter::Approximate;
                        gen.build(i as u64, counter).await?
                    }
                };
                all_exact &= built.1;
                prompts.push(built.0);
            }
            Ok((prompts, all_exact))
        }
        Dataset::File(path) => {
            let lines = read_jsonl(path, opts.output_len)?;
            if lines.len() < total {
                notes.push(format!(
                    "The dataset has {} prompts and the run needs {total}; prompts repeat, so a prefix cache may serve repeats.",
                    lines.len()
                ));
            }
            let mut counted = Vec::with_capacity(lines.len().min(total));
            for p in lines.iter().take(total) {
                let tokens = if counter.is_exact() {
                    counter
                        .count(&p.text)
                        .await
                        .ok()
                        .and_then(|n| u32::try_from(n).ok())
                } else {
                    None
                };
                counted.push(Prompt {
                    tokens,
                    ..p.clone()
                });
            }
            let prompts = (0..total)
                .filter_map(|i| counted.get(i % counted.len().max(1)).cloned())
                .collect();
            Ok((prompts, false))
        }
    }
}

/// Runs the benchmark. Only bad options (URL, dataset, tokenizer) are errors;
/// failed requests are recorded in the report. When `cancel` turns true the
/// run stops and the report holds what was measured so far.
pub async fn run_bench(opts: &BenchOptions, cancel: watch::Receiver<bool>) -> Result<Report> {
    opts.check()?;
    let endpoint = Endpoint::new(&opts.url, opts.api_key.clone(), opts.request_timeout)?;
    if let Dataset::File(path) = &opts.dataset {
        read_jsonl(path, opts.output_len)?;
    }
    let local_tokenizer = opts.tokenizer.as_deref().map(load_tokenizer).transpose()?;
    let is_cancelled = || *cancel.borrow();
    let mut notes: Vec<String> = Vec::new();

    let info = ServerInfo::gather(&endpoint, &opts.model).await;
    if let Some(e) = &info.models_error {
        notes.push(format!("GET /v1/models failed: {e}"));
    } else if info.model_card.is_none() && !info.listed_models.is_empty() {
        notes.push(format!(
            "The server lists {} but not '{}'.",
            info.listed_models.join(", "),
            opts.model
        ));
    }

    let mut counter = TokenCounter::detect(&endpoint, &opts.model, local_tokenizer).await;
    match &counter {
        TokenCounter::Server { .. } => notes.push("Prompt lengths measured with the server's /tokenize.".to_owned()),
        TokenCounter::Local(_) => notes.push("Prompt lengths measured with the local tokenizer (--tokenizer).".to_owned()),
        TokenCounter::Approximate => notes.push(
            "Prompt lengths are approximate: the server has no /tokenize and no --tokenizer was given; each random prompt has input_len common words (about one token each)."
                .to_owned(),
        ),
    }

    let levels = opts.concurrency.len();
    let per_level = opts.num_prompts as usize;
    let total = opts.warmup as usize + per_level * levels;
    if opts.progress {
        eprintln!("preparing {total} prompts (lengths: {})", counter.source());
    }
    let (prompts, all_exact) =
        prepare_prompts(opts, &mut counter, total, &mut notes, &cancel).await?;
    let prompt_tokens_source = counter.source().to_owned();

    // Warm-up, which also finds out which optional request fields the server accepts.
    let mut extras = Extras {
        ignore_eos: true,
        usage: true,
    };
    let mut warmup_errors = Vec::new();
    for p in prompts.iter().take(opts.warmup as usize) {
        if is_cancelled() {
            break;
        }
        let max = p.output_len.min(WARMUP_MAX_TOKENS);
        let mut timing = endpoint
            .stream(
                COMPLETIONS_PATH,
                &completion_body(&opts.model, &p.text, max, extras),
            )
            .await;
        // Drop one optional field at a time while the server rejects the request.
        type Fallback = (fn(Extras) -> bool, fn(Extras) -> Extras, &'static str);
        let fallbacks: [Fallback; 2] = [
            (
                |e| e.ignore_eos,
                |e| Extras { ignore_eos: false, ..e },
                "The server rejected ignore_eos/min_tokens; requests send max_tokens only, so outputs may stop early at end-of-sequence.",
            ),
            (
                |e| e.usage,
                |e| Extras { usage: false, ..e },
                "The server rejected stream_options.include_usage; output tokens are counted from stream chunks.",
            ),
        ];
        for (enabled, without, note) in fallbacks {
            if !(is_rejection(&timing.error) && enabled(extras)) {
                continue;
            }
            let fewer = without(extras);
            let retry = endpoint
                .stream(
                    COMPLETIONS_PATH,
                    &completion_body(&opts.model, &p.text, max, fewer),
                )
                .await;
            if retry.error.is_none() {
                notes.push(note.to_owned());
                extras = fewer;
            }
            timing = retry;
        }
        if let Some(e) = timing.error {
            warmup_errors.push(e.to_string());
        }
    }
    if !warmup_errors.is_empty() {
        notes.push(format!(
            "{} of {} warm-up requests failed: {}",
            warmup_errors.len(),
            opts.warmup,
            warmup_errors.first().cloned().unwrap_or_default()
        ));
    }

    let mut sweep: Vec<SweepRow> = Vec::new();
    let mut rest = prompts.iter().skip(opts.warmup as usize);
    for &concurrency in &opts.concurrency {
        if is_cancelled() {
            break;
        }
        let plan: Vec<PlannedRequest> = rest
            .by_ref()
            .take(per_level)
            .map(|p| PlannedRequest {
                body: completion_body(&opts.model, &p.text, p.output_len, extras),
                input_tokens: p.tokens.filter(|_| counter.is_exact()),
                input_tokens_estimate: p.tokens,
            })
            .collect();
        let bar = progress_bar(opts.progress, plan.len() as u64, format!("c={concurrency}"));
        let level = run_level(
            &endpoint,
            COMPLETIONS_PATH,
            plan,
            concurrency,
            cancel.clone(),
            bar,
        )
        .await;
        sweep.push(summarize(&level));
    }

    let capabilities = if opts.probes && !is_cancelled() {
        notes.push(
            "Capability probes ran through /v1/chat/completions, one request each at temperature 0, \
             judged by the fixed rules of gemma4-bench's probes.rs: the verdicts describe the model \
             and its chat template as this server serves them."
                .to_owned(),
        );
        probes::run_probes(&endpoint, &opts.model, opts.request_timeout).await
    } else {
        if !opts.probes {
            notes.push("Capability probes not run (enable with --probes).".to_owned());
        }
        Vec::new()
    };

    let after = observe::metrics_of(&endpoint).await;
    let metrics = if after.is_empty() {
        &info.metrics
    } else {
        &after
    };
    let memory = observe::memory(metrics);
    let startup = observe::startup(metrics);
    let interrupted = is_cancelled();

    sweep_notes(&sweep, opts, &mut notes);
    if interrupted {
        notes.push("Interrupted: the report holds what was measured before the stop.".to_owned());
    }
    let server_here = endpoint.is_loopback();
    notes.push(if server_here {
        "hardware.host describes this machine, which also runs the server (loopback URL)."
            .to_owned()
    } else {
        "hardware.host describes the machine that ran the benchmark, not the server's.".to_owned()
    });

    let software = info.software();
    let completed: u32 = sweep.iter().filter_map(|r| r.completed).sum();
    let first_error = sweep
        .iter()
        .flat_map(|r| &r.error_samples)
        .map(|e| e.message.clone())
        .next();
    let load_matrix = if completed > 0 || info.model_card.is_some() {
        vec![LoadEntry {
            model_id: opts.model.clone(),
            backend: software.backend.clone().or_else(|| software.engine.clone()),
            verdict: "loads".to_owned(),
            ..LoadEntry::default()
        }]
    } else if info.models_error.is_none() && first_error.is_some() {
        vec![LoadEntry {
            model_id: opts.model.clone(),
            backend: software.engine.clone(),
            verdict: "fails".to_owned(),
            error: first_error,
            issue: None,
        }]
    } else {
        Vec::new()
    };

    let (date, time) = crate::report::utc_date_time();
    let slug: String = opts
        .model
        .rsplit('/')
        .next()
        .unwrap_or(&opts.model)
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect();
    let time_to_healthy = startup.as_ref().and_then(|s| s.time_to_healthy_s);
    let cost = opts
        .price_per_hour
        .map(|price| cost_block(price, &sweep, opts.api_price.as_ref(), time_to_healthy));

    Ok(Report {
        schema_version: SCHEMA_VERSION.to_owned(),
        run: Run {
            id: opts
                .run_id
                .clone()
                .unwrap_or_else(|| format!("{date}-{slug}-{time}")),
            date,
            source: Some("gemma4 bench serve".to_owned()),
            notes: Some(opts.run_notes.clone().unwrap_or_else(|| {
                "Single run per concurrency level; warm-up requests excluded from the figures."
                    .to_owned()
            })),
            interrupted: interrupted.then_some(true),
        },
        hardware: Hardware {
            accelerator: opts.accelerator.clone(),
            chips: opts.chips,
            hbm_gb_per_chip: None,
            machine_type: None,
            host: Some(observe::this_host(server_here)),
            pricing: opts.price_per_hour.map(|price| Pricing {
                currency: "USD".to_owned(),
                rate_per_chip_hour: opts.chips.filter(|c| *c > 0).map(|c| price / f64::from(c)),
                rate_per_hour: Some(price),
                source: None,
            }),
        },
        model: info.model(&opts.model),
        software,
        load_matrix,
        throughput: Throughput {
            workload: Workload {
                tool: "gemma4 bench serve".to_owned(),
                dataset: match &opts.dataset {
                    Dataset::Random => "random".to_owned(),
                    Dataset::File(p) => p.display().to_string(),
                },
                input_len: (opts.dataset == Dataset::Random).then_some(opts.input_len),
                output_len: Some(opts.output_len),
                num_prompts: Some(opts.num_prompts),
                runs_per_point: Some(1),
                noise_floor_pct: None,
                url: Some(endpoint.base()),
                endpoint: Some(format!("/{COMPLETIONS_PATH}")),
                seed: Some(opts.seed),
                temperature: Some(0.0),
                warmup_requests: Some(opts.warmup),
                request_extras: Some(extras.names()),
                prompt_tokens_source: Some(prompt_tokens_source),
                prompt_len_exact: (opts.dataset == Dataset::Random).then_some(all_exact),
            },
            sweep,
        },
        capabilities,
        memory,
        startup,
        cost,
        issues: Vec::new(),
        notes,
    })
}

/// Notes about the sweep's figures: errors, early stops, counted tokens.
fn sweep_notes(sweep: &[SweepRow], opts: &BenchOptions, notes: &mut Vec<String>) {
    let errors: u32 = sweep.iter().filter_map(|r| r.errors).sum();
    let sent: u32 = sweep
        .iter()
        .map(|r| r.completed.unwrap_or(0) + r.errors.unwrap_or(0))
        .sum();
    if errors > 0 {
        let first = sweep
            .iter()
            .flat_map(|r| &r.error_samples)
            .next()
            .map(|e| format!(" First error: {}", e.message))
            .unwrap_or_default();
        notes.push(format!("{errors} of {sent} requests failed.{first}"));
    }
    if sweep
        .iter()
        .any(|r| matches!(r.output_tokens_source.as_deref(), Some("counted" | "mixed")))
    {
        notes.push("Some output token counts come from counting stream chunks (no usage in the stream); a chunk is taken as one token.".to_owned());
    }
    if opts.dataset == Dataset::Random {
        let (completed, out): (u64, u64) = sweep.iter().fold((0, 0), |(c, o), r| {
            (
                c + u64::from(r.completed.unwrap_or(0)),
                o + r.output_tokens.unwrap_or(0),
            )
        });
        if completed > 0 {
            let mean = out as f64 / completed as f64;
            if mean < 0.95 * f64::from(opts.output_len) {
                notes.push(format!(
                    "Requests averaged {mean:.1} output tokens of the {} asked for; the server stops at end-of-sequence despite ignore_eos.",
                    opts.output_len
                ));
            }
        }
    }
}

/// Validates the report against the committed schema, then writes the JSON and
/// the SVG plots next to it. Returns every path written.
pub fn write_outputs(report: &Report, path: &Path) -> Result<Vec<PathBuf>> {
    let value = serde_json::to_value(report)?;
    schema::validate_report(&value)?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|source| BenchError::Write {
            path: dir.to_path_buf(),
            source,
        })?;
    }
    let mut text = serde_json::to_string_pretty(&value)?;
    text.push('\n');
    std::fs::write(path, text).map_err(|source| BenchError::Write {
        path: path.to_path_buf(),
        source,
    })?;
    let mut written = vec![path.to_path_buf()];
    written.extend(plots::write_plots(report, path)?);
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn concurrency_lists() {
        assert_eq!(parse_concurrency("1,8,32").ok(), Some(vec![1, 8, 32]));
        assert_eq!(parse_concurrency(" 4 ").ok(), Some(vec![4]));
        for bad in ["", "1,,2", "1,x", "0", "-1", "1.5", "8;16", "99999"] {
            let e = parse_concurrency(bad).map_err(|e| e.to_string());
            assert!(
                matches!(&e, Err(m) if m.contains("--concurrency")),
                "{bad}: {e:?}"
            );
        }
        let e = parse_concurrency("1,eight").map_err(|e| e.to_string());
        assert!(
            matches!(&e, Err(m) if m.contains("'eight' is not a positive integer")),
            "{e:?}"
        );
    }

    #[test]
    fn datasets() {
        assert_eq!("random".parse::<Dataset>(), Ok(Dataset::Random));
        assert_eq!(
            "a.jsonl".parse::<Dataset>(),
            Ok(Dataset::File(PathBuf::from("a.jsonl")))
        );
        assert!("".parse::<Dataset>().is_err());
    }

    #[test]
    fn request_bodies() {
        let all = completion_body(
            "m",
            "p",
            8,
            Extras {
                ignore_eos: true,
                usage: true,
            },
        );
        assert_eq!(all["max_tokens"], 8);
        assert_eq!(all["min_tokens"], 8);
        assert_eq!(all["ignore_eos"], true);
        assert_eq!(all["stream_options"]["include_usage"], true);
        assert_eq!(all["temperature"], 0);
        let bare = completion_body(
            "m",
            "p",
            8,
            Extras {
                ignore_eos: false,
                usage: false,
            },
        );
        assert!(bare.get("ignore_eos").is_none() && bare.get("stream_options").is_none());
    }

    #[test]
    fn options_are_checked() {
        let mut o = BenchOptions::new("http://127.0.0.1:1", "m");
        assert!(o.check().is_ok());
        o.num_prompts = 0;
        assert!(o.check().is_err());
        let mut o = BenchOptions::new("http://127.0.0.1:1", "m");
        o.concurrency = vec![];
        assert!(o.check().is_err());
    }
}

//! `gemma4 bench speculative`: decoding with drafts against decoding
//! without, on a set of prompts, in one run on one engine.
//!
//! Every prompt runs greedy twice per round, once decoding plainly (the
//! request turns drafting off) and once drafting, in alternating order, so
//! both see the same machine. A prompt's decode rate is its tokens after
//! the first over the time from the first to the last. With several
//! streams, each stream takes every n-th prompt; the rate is each stream's
//! decode rate as above, and all streams' tokens over the wall time are
//! compared too. The two outputs of a prompt must be
//! the same tokens; the run fails if they are not.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use gemma4_engine::{
    DraftCounts, EngineConfig, EngineEvent, EngineHandle, FinishReason, GenerationRequest,
    SamplingParams,
};
use serde::{Deserialize, Serialize};

use crate::model_io::ModelArgs;
use crate::speculative::{self, SpeculativeArgs};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    speculative: SpeculativeArgs,
    /// Prompts, one JSON object per line: `{"name", "kind", "prompt"}`.
    #[arg(long, default_value = "benches/speculative/prompts.jsonl")]
    prompts: PathBuf,
    /// Tokens generated per prompt.
    #[arg(short = 'n', long, default_value_t = 128)]
    max_tokens: usize,
    /// Concurrent streams to measure at, e.g. `1,4`.
    #[arg(long, value_delimiter = ',', default_value = "1,4")]
    streams: Vec<usize>,
    /// Rounds (after one untimed warm-up round); medians are reported.
    #[arg(short = 'r', long, default_value_t = 3)]
    rounds: usize,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

#[derive(Deserialize)]
struct Prompt {
    name: String,
    /// What the answer does: copies a passage of the prompt, or not.
    kind: String,
    prompt: String,
}

/// One request's run.
struct Run {
    ids: Vec<u32>,
    submitted: Instant,
    first: Instant,
    last: Instant,
    drafts: DraftCounts,
}

/// Rates of one prompt (or one set of prompts), plain and drafted, per round.
#[derive(Serialize, Default)]
struct Row {
    name: String,
    streams: usize,
    plain_tok_s: Vec<f64>,
    drafted_tok_s: Vec<f64>,
    /// Median drafted over median plain.
    ratio: f64,
    /// The same for all streams' tokens over the wall time (several streams).
    #[serde(skip_serializing_if = "Option::is_none")]
    wall_ratio: Option<f64>,
    draft_tokens: u64,
    accepted_tokens: u64,
    /// Steps that verified drafts.
    draft_steps: u64,
    /// Median milliseconds per decode step, plain and drafted (a drafted
    /// step verifies its drafts, drafts the next ones and yields the
    /// accepted tokens and one more).
    plain_step_ms: f64,
    drafted_step_ms: f64,
}

/// What the measured step times imply at acceptance rates the drafts
/// here did not reach (random weights accept nothing).
#[derive(Serialize)]
struct Implied {
    /// Tokens drafted per step.
    drafts_per_step: f64,
    /// Milliseconds the assistant took per drafting step (all its drafts).
    draft_ms_per_step: f64,
    /// `(acceptance, speed-up)`: `(1 − a^(K+1)) / (1 − a)` tokens a step
    /// (each draft accepted with probability a after the one before it),
    /// at the drafted step's time against the plain step's.
    speedups: Vec<(f64, f64)>,
}

#[derive(Serialize)]
struct Report {
    model: String,
    kernels: String,
    threads: usize,
    max_tokens: usize,
    rows: Vec<Row>,
    #[serde(skip_serializing_if = "Option::is_none")]
    implied: Option<Implied>,
}

pub fn run(args: Args) -> Result<ExitCode> {
    let Some(config) = args.speculative.config()? else {
        bail!("name the drafting to measure, e.g. --speculative ngram");
    };
    if args.rounds == 0 || args.max_tokens < 2 {
        bail!("-r must be at least 1 and -n at least 2");
    }
    let prompts = read_prompts(&args.prompts)?;
    let loaded = args.model.load()?;
    let tokenizer = Arc::new(loaded.tokenizer);
    let encoded: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| tokenizer.encode(&p.prompt, true))
        .collect::<Result<_, _>>()
        .context("cannot tokenize a prompt")?;
    let longest = encoded.iter().map(Vec::len).max().unwrap_or(1);
    let max_streams = args.streams.iter().copied().max().unwrap_or(1).max(1);
    let executor = args
        .speculative
        .executor(loaded.model, args.model.policy())?;
    let engine = gemma4_engine::start_with(
        Box::new(executor),
        tokenizer,
        EngineConfig {
            max_num_seqs: max_streams,
            max_queue: max_streams,
            max_model_len: longest + args.max_tokens + 1,
            prefix_caching: false,
            speculative: Some(config),
            ..EngineConfig::default()
        },
    )
    .context("cannot start the engine")?;
    let before = engine.stats();
    let mut rows = Vec::new();
    for &streams in &args.streams {
        if streams <= 1 {
            rows.extend(measure_solo(&engine, &prompts, &encoded, &args)?);
        } else {
            let set: Vec<&[u32]> = encoded.iter().map(Vec::as_slice).collect();
            let runs = rounds(&engine, &set, streams, &args)
                .with_context(|| format!("{streams} streams"))?;
            rows.push(row("all".into(), streams, &runs));
        }
    }
    let after = engine.stats();
    // Every drafted request's steps, warm-up rounds included.
    let drafting_ms_per_step = (after.drafting_ns - before.drafting_ns) as f64 * 1e-6
        / (after.speculation.drafts - before.speculation.drafts).max(1) as f64;
    let implied = (config.method == gemma4_engine::DraftMethod::Assistant)
        .then(|| implied(&rows, drafting_ms_per_step))
        .flatten();
    let report = Report {
        model: loaded.path.display().to_string(),
        kernels: gemma4_kernels::describe(),
        threads: gemma4_kernels::pool::global().threads(),
        max_tokens: args.max_tokens,
        rows,
        implied,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_table(&report);
    }
    Ok(ExitCode::SUCCESS)
}

/// The speed-ups the one-stream set's step times imply at acceptance 0.6,
/// 0.7 and 0.8, with the assistant's time per drafting step.
fn implied(rows: &[Row], draft_ms_per_step: f64) -> Option<Implied> {
    let all = rows.iter().find(|r| r.streams <= 1 && r.name == "all")?;
    if all.draft_steps == 0 || all.drafted_step_ms <= 0.0 {
        return None;
    }
    let k = all.draft_tokens as f64 / all.draft_steps as f64;
    let speedups = [0.6, 0.7, 0.8]
        .iter()
        .map(|&a: &f64| {
            let tokens = (1.0 - a.powf(k + 1.0)) / (1.0 - a);
            (a, tokens * all.plain_step_ms / all.drafted_step_ms)
        })
        .collect();
    Some(Implied {
        drafts_per_step: k,
        draft_ms_per_step,
        speedups,
    })
}

fn read_prompts(path: &PathBuf) -> Result<Vec<Prompt>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the prompts {}", path.display()))?;
    let prompts: Vec<Prompt> = text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l).with_context(|| format!("{}:{}", path.display(), i + 1))
        })
        .collect::<Result<_>>()?;
    if prompts.is_empty() {
        bail!("{} holds no prompt", path.display());
    }
    Ok(prompts)
}

/// One set's run in one mode: tokens, the seconds they took, the drafts.
#[derive(Clone, Copy, Default)]
struct Sample {
    tokens: usize,
    secs: f64,
    wall_tokens: usize,
    wall_secs: f64,
    drafts: DraftCounts,
}

impl Sample {
    fn add(&mut self, other: &Sample) {
        self.tokens += other.tokens;
        self.secs += other.secs;
        self.wall_tokens += other.wall_tokens;
        self.wall_secs += other.wall_secs;
        self.drafts.drafts += other.drafts.drafts;
        self.drafts.draft_tokens += other.drafts.draft_tokens;
        self.drafts.accepted_tokens += other.drafts.accepted_tokens;
    }

    /// Milliseconds per decode step: the tokens after the first, less the
    /// accepted drafts (which came with the step before them).
    fn step_ms(&self) -> f64 {
        let steps = self
            .tokens
            .saturating_sub(self.drafts.accepted_tokens as usize);
        1e3 * self.secs / steps.max(1) as f64
    }

    fn rate(&self) -> f64 {
        self.tokens as f64 / self.secs.max(f64::MIN_POSITIVE)
    }

    fn wall_rate(&self) -> f64 {
        self.wall_tokens as f64 / self.wall_secs.max(f64::MIN_POSITIVE)
    }
}

/// Runs `set` both ways, alternating which goes first each round, and
/// checks the outputs agree; per timed round, `[drafted, plain]`.
fn rounds(
    engine: &EngineHandle,
    set: &[&[u32]],
    streams: usize,
    args: &Args,
) -> Result<Vec<[Sample; 2]>> {
    let mut out = Vec::new();
    for round in 0..=args.rounds {
        let order = if round % 2 == 0 {
            [true, false]
        } else {
            [false, true]
        };
        let mut pair = [Sample::default(); 2];
        let mut outputs: [Vec<Vec<u32>>; 2] = Default::default();
        for plain in order {
            let (sample, ids) = run_set(engine, set, streams, args.max_tokens, plain)?;
            pair[usize::from(plain)] = sample;
            outputs[usize::from(plain)] = ids;
        }
        if outputs[0] != outputs[1] {
            bail!("the drafted output differs from the plain one");
        }
        if round > 0 {
            out.push(pair);
        }
    }
    Ok(out)
}

fn row(name: String, streams: usize, rounds: &[[Sample; 2]]) -> Row {
    let drafted: Vec<f64> = rounds.iter().map(|r| r[0].rate()).collect();
    let plain: Vec<f64> = rounds.iter().map(|r| r[1].rate()).collect();
    let wall = |k: usize| median(&rounds.iter().map(|r| r[k].wall_rate()).collect::<Vec<_>>());
    Row {
        name,
        streams,
        ratio: median(&drafted) / median(&plain),
        wall_ratio: (streams > 1).then(|| wall(0) / wall(1)),
        draft_tokens: rounds.iter().map(|r| r[0].drafts.draft_tokens).sum(),
        accepted_tokens: rounds.iter().map(|r| r[0].drafts.accepted_tokens).sum(),
        draft_steps: rounds.iter().map(|r| r[0].drafts.drafts).sum(),
        plain_step_ms: median(&rounds.iter().map(|r| r[1].step_ms()).collect::<Vec<_>>()),
        drafted_step_ms: median(&rounds.iter().map(|r| r[0].step_ms()).collect::<Vec<_>>()),
        plain_tok_s: plain,
        drafted_tok_s: drafted,
    }
}

/// At one stream: each prompt's decode rate, then each kind's and the
/// whole set's (their tokens over their decode time, per round).
fn measure_solo(
    engine: &EngineHandle,
    prompts: &[Prompt],
    encoded: &[Vec<u32>],
    args: &Args,
) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    let mut groups: BTreeMap<String, Vec<[Sample; 2]>> = BTreeMap::new();
    for (p, ids) in prompts.iter().zip(encoded) {
        let runs = rounds(engine, &[ids.as_slice()], 1, args)
            .with_context(|| format!("prompt {}", p.name))?;
        for key in [format!("all {}", p.kind), "all".to_string()] {
            let group = groups
                .entry(key)
                .or_insert_with(|| vec![Default::default(); runs.len()]);
            for (g, r) in group.iter_mut().zip(&runs) {
                g[0].add(&r[0]);
                g[1].add(&r[1]);
            }
        }
        rows.push(row(format!("{} ({})", p.name, p.kind), 1, &runs));
    }
    rows.extend(groups.into_iter().map(|(name, runs)| row(name, 1, &runs)));
    Ok(rows)
}

/// Runs `set` over `streams` concurrent streams. The sample is decode
/// only (each request's tokens after its first, over the time from its
/// first to its last: the rate one stream sees), and every token over the
/// wall time, prefills included (the rate of all streams together). The
/// outputs come in `set` order.
fn run_set(
    engine: &EngineHandle,
    set: &[&[u32]],
    streams: usize,
    max_tokens: usize,
    plain: bool,
) -> Result<(Sample, Vec<Vec<u32>>)> {
    let mut runs: Vec<Option<Run>> = (0..set.len()).map(|_| None).collect();
    std::thread::scope(|s| -> Result<()> {
        let handles: Vec<_> = (0..streams.min(set.len()))
            .map(|stream| {
                s.spawn(move || -> Result<Vec<(usize, Run)>> {
                    (stream..set.len())
                        .step_by(streams)
                        .map(|i| Ok((i, one_run(engine, set[i], max_tokens, plain)?)))
                        .collect()
                })
            })
            .collect();
        for h in handles {
            let done = h
                .join()
                .map_err(|_| anyhow::anyhow!("a stream panicked"))??;
            for (i, run) in done {
                runs[i] = Some(run);
            }
        }
        Ok(())
    })?;
    let runs: Vec<Run> = runs.into_iter().flatten().collect();
    let mut sample = Sample::default();
    for r in &runs {
        sample.drafts.drafts += r.drafts.drafts;
        sample.drafts.draft_tokens += r.drafts.draft_tokens;
        sample.drafts.accepted_tokens += r.drafts.accepted_tokens;
    }
    sample.tokens = runs.iter().map(|r| r.ids.len() - 1).sum();
    sample.secs = runs.iter().map(|r| (r.last - r.first).as_secs_f64()).sum();
    let start = runs.iter().map(|r| r.submitted).min();
    let end = runs.iter().map(|r| r.last).max();
    if let (Some(a), Some(b)) = (start, end) {
        sample.wall_tokens = runs.iter().map(|r| r.ids.len()).sum();
        sample.wall_secs = (b - a).as_secs_f64();
    }
    Ok((sample, runs.into_iter().map(|r| r.ids).collect()))
}

/// One greedy request of exactly `max_tokens` tokens (stop tokens ignored).
fn one_run(engine: &EngineHandle, prompt: &[u32], max_tokens: usize, plain: bool) -> Result<Run> {
    let submitted = Instant::now();
    let mut stream = engine
        .submit(GenerationRequest {
            prompt_ids: prompt.to_vec(),
            params: SamplingParams {
                max_tokens,
                plain_decoding: plain,
                ..SamplingParams::default()
            },
            deadline: None,
            soft_prompt: None,
            reading: Default::default(),
            adapter: None,
        })
        .context("the engine refused a prompt")?;
    let mut ids = Vec::new();
    let mut first = None;
    let mut last = submitted;
    while let Some(event) = stream.blocking_next() {
        match event {
            EngineEvent::PromptLogprobs(_) => {}
            EngineEvent::Token { id, .. } => {
                last = Instant::now();
                first.get_or_insert(last);
                ids.push(id);
            }
            EngineEvent::Finished { reason, usage, .. } => {
                if let FinishReason::Error(e) = reason {
                    bail!("a request failed: {e}");
                }
                if ids.len() != max_tokens {
                    bail!("a request gave {} of {max_tokens} tokens", ids.len());
                }
                return Ok(Run {
                    ids,
                    submitted,
                    first: first.unwrap_or(last),
                    last,
                    drafts: usage.speculation,
                });
            }
        }
    }
    bail!("the engine stopped mid-request")
}

fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

fn print_table(r: &Report) {
    println!("model: {}", r.model);
    println!("kernels: {} ({} threads)", r.kernels, r.threads);
    println!("decode tok/s of each stream (tokens after the first over the time from the first to the last); with several streams, the ratio of all tokens over the wall time too");
    println!("| streams | prompts | plain tok/s | drafted tok/s | drafted/plain | drafts |");
    println!("|---:|---|---:|---:|---:|---|");
    for row in &r.rows {
        let counts = DraftCounts {
            drafts: 0,
            draft_tokens: row.draft_tokens,
            accepted_tokens: row.accepted_tokens,
        };
        let wall = row
            .wall_ratio
            .map_or(String::new(), |w| format!(" (wall {w:.2}×)"));
        println!(
            "| {} | {} | {:.1} | {:.1} | {:.2}×{wall} | {} |",
            row.streams,
            row.name,
            median(&row.plain_tok_s),
            median(&row.drafted_tok_s),
            row.ratio,
            speculative::describe(&counts)
        );
    }
    if let Some(i) = &r.implied {
        let all = r
            .rows
            .iter()
            .find(|row| row.streams <= 1 && row.name == "all");
        if let Some(all) = all {
            println!(
                "one stream, all prompts: plain step {:.2} ms; drafted step {:.2} ms (verifying {:.1} drafts and drafting the next, the assistant {:.2} ms of it)",
                all.plain_step_ms, all.drafted_step_ms, i.drafts_per_step, i.draft_ms_per_step
            );
        }
        let implied: Vec<String> = i
            .speedups
            .iter()
            .map(|(a, s)| format!("{s:.2}× at acceptance {a:.1}"))
            .collect();
        println!("implied decode speed-up: {}", implied.join(", "));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_of_odd_and_even_counts() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(median(&[]), 0.0);
    }
}

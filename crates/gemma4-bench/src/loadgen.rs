//! The load generator: keeps `concurrency` streaming requests in flight until
//! every prompt of a level has been sent, then turns the timings into one
//! sweep row.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use indicatif::ProgressBar;
use serde_json::Value;
use tokio::sync::watch;

use crate::client::{Endpoint, StreamTiming};
use crate::report::{ErrorSample, Latency, MedianOnly, RequestRow, SweepRow};
use crate::stats::{median, percentile, round, round_opt};

/// One request to send: its JSON body and the prompt's token count.
#[derive(Debug, Clone, Default)]
pub struct PlannedRequest {
    pub body: Value,
    /// The prompt's token count (without special tokens), measured exactly.
    pub input_tokens: Option<u32>,
    /// An estimate of it, used only when neither the exact count nor the
    /// server's usage is known.
    pub input_tokens_estimate: Option<u32>,
}

/// One finished request.
#[derive(Debug, Clone)]
pub struct RequestRecord {
    pub timing: StreamTiming,
    /// [`PlannedRequest::input_tokens`].
    pub input_tokens: Option<u32>,
    /// [`PlannedRequest::input_tokens_estimate`].
    pub input_tokens_estimate: Option<u32>,
}

/// What one level measured.
#[derive(Debug, Clone)]
pub struct LevelRun {
    pub concurrency: u32,
    pub num_prompts: u32,
    pub records: Vec<RequestRecord>,
    pub wall: Duration,
    /// Stopped by the cancel signal before every prompt was sent and finished.
    pub interrupted: bool,
}

/// Sends every request of `plan` to `path`, `concurrency` at a time. When
/// `cancel` turns true, requests in flight are abandoned (and not counted) and
/// no new ones start.
pub async fn run_level(
    endpoint: &Endpoint,
    path: &str,
    plan: Vec<PlannedRequest>,
    concurrency: u32,
    cancel: watch::Receiver<bool>,
    bar: ProgressBar,
) -> LevelRun {
    let num_prompts = u32::try_from(plan.len()).unwrap_or(u32::MAX);
    let plan = Arc::new(plan);
    let next = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..concurrency.max(1) {
        let (endpoint, plan, next, bar, path) = (
            endpoint.clone(),
            Arc::clone(&plan),
            Arc::clone(&next),
            bar.clone(),
            path.to_owned(),
        );
        let mut cancel = cancel.clone();
        workers.push(tokio::spawn(async move {
            let mut done = Vec::new();
            loop {
                if *cancel.borrow() {
                    break;
                }
                let Some(request) = plan.get(next.fetch_add(1, Ordering::SeqCst)) else {
                    break;
                };
                tokio::select! {
                    timing = endpoint.stream(&path, &request.body) => {
                        done.push(RequestRecord {
                            timing,
                            input_tokens: request.input_tokens,
                            input_tokens_estimate: request.input_tokens_estimate,
                        });
                        bar.inc(1);
                    }
                    _ = cancelled(&mut cancel) => break,
                }
            }
            done
        }));
    }
    let mut records = Vec::new();
    for worker in workers {
        match worker.await {
            Ok(done) => records.extend(done),
            Err(e) => records.push(RequestRecord {
                timing: StreamTiming {
                    error: Some(crate::client::CallError::Protocol(format!(
                        "request task failed: {e}"
                    ))),
                    ..StreamTiming::default()
                },
                input_tokens: None,
                input_tokens_estimate: None,
            }),
        }
    }
    let wall = start.elapsed();
    bar.finish();
    LevelRun {
        concurrency,
        num_prompts,
        interrupted: *cancel.borrow() && records.len() < plan.len(),
        records,
        wall,
    }
}

/// Resolves when the flag turns true; never when the sender is gone.
pub async fn cancelled(rx: &mut watch::Receiver<bool>) {
    loop {
        if *rx.borrow_and_update() {
            return;
        }
        if rx.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// The sweep row of a level: throughput over the level's wall time, latency
/// percentiles over its completed requests, and every request's record.
///
/// Per request: TTFT is the arrival of the first chunk with text; TPOT is
/// (latency − TTFT) / (output tokens − 1); inter-token latencies are the gaps
/// between chunks with text. Output tokens come from the stream's `usage` when
/// the server sends it, else from the number of chunks with text. Prompt tokens
/// are the prompt's exactly measured length (without BOS, as `input_len`
/// counts), else the server's `usage.prompt_tokens`, else the estimate.
pub fn summarize(level: &LevelRun) -> SweepRow {
    let secs = level.wall.as_secs_f64();
    let mut row = SweepRow {
        concurrency: level.concurrency,
        num_prompts: Some(level.num_prompts),
        duration_s: round(secs, 3),
        interrupted: level.interrupted.then_some(true),
        ..SweepRow::default()
    };
    let (mut ttfts, mut latencies, mut tpots, mut itls) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut input_total, mut output_total) = (0u64, 0u64);
    let (mut from_usage, mut counted) = (0u32, 0u32);
    let mut completed = 0u32;
    let mut samples: Vec<ErrorSample> = Vec::new();
    let mut retries = 0u32;
    for record in &level.records {
        let t = &record.timing;
        retries += u32::from(t.retried);
        let latency_ms = ms(t.latency);
        let ttft_ms = t.ttft().map(ms);
        let usage_out = t.usage.and_then(|u| u.completion_tokens);
        let output = usage_out.or((t.text_chunks > 0).then_some(t.text_chunks));
        let input = record
            .input_tokens
            .or(t.usage.and_then(|u| u.prompt_tokens))
            .or(record.input_tokens_estimate);
        if let Some(error) = &t.error {
            let message = error.to_string();
            match samples.iter_mut().find(|s| s.message == message) {
                Some(sample) => sample.count += 1,
                None => samples.push(ErrorSample {
                    message: message.clone(),
                    count: 1,
                }),
            }
            row.requests.push(RequestRow {
                ttft_ms: round_opt(ttft_ms, 3),
                latency_ms: round(latency_ms, 3).unwrap_or(0.0),
                input_tokens: input,
                output_tokens: output,
                error: Some(message),
                retried: t.retried,
            });
            continue;
        }
        completed += 1;
        if usage_out.is_some() {
            from_usage += 1;
        } else {
            counted += 1;
        }
        let out = output.unwrap_or(0);
        output_total += u64::from(out);
        input_total += u64::from(input.unwrap_or(0));
        latencies.push(latency_ms);
        if let Some(ttft) = ttft_ms {
            ttfts.push(ttft);
            if out > 1 {
                tpots.push((latency_ms - ttft) / f64::from(out - 1));
            }
        }
        itls.extend(
            t.chunk_times
                .windows(2)
                .map(|w| ms(w[1].saturating_sub(w[0]))),
        );
        row.requests.push(RequestRow {
            ttft_ms: round_opt(ttft_ms, 3),
            latency_ms: round(latency_ms, 3).unwrap_or(0.0),
            input_tokens: input,
            output_tokens: output,
            error: None,
            retried: t.retried,
        });
    }
    let errors = u32::try_from(level.records.len())
        .unwrap_or(u32::MAX)
        .saturating_sub(completed);
    row.completed = Some(completed);
    row.errors = Some(errors);
    row.connection_retries = (retries > 0).then_some(retries);
    row.error_samples = samples;
    if completed > 0 && secs > 0.0 {
        row.request_rate_rps = round(f64::from(completed) / secs, 3);
        row.output_tok_per_s = round(output_total as f64 / secs, 2);
        row.total_tok_per_s = round((input_total + output_total) as f64 / secs, 2);
        row.input_tokens = Some(input_total);
        row.output_tokens = Some(output_total);
        row.output_tokens_source = Some(
            match (from_usage, counted) {
                (_, 0) => "usage",
                (0, _) => "counted",
                _ => "mixed",
            }
            .to_owned(),
        );
    }
    row.ttft_ms = Latency {
        median: round_opt(median(&ttfts), 2),
        p99: round_opt(percentile(&ttfts, 99.0), 2),
    };
    let tpot_median = median(&tpots);
    row.tpot_ms = MedianOnly {
        median: round_opt(tpot_median, 3),
    };
    row.per_stream_tok_per_s = tpot_median
        .filter(|t| *t > 0.0)
        .and_then(|t| round(1000.0 / t, 2));
    if !itls.is_empty() {
        row.itl_ms = Some(Latency {
            median: round_opt(median(&itls), 3),
            p99: round_opt(percentile(&itls, 99.0), 3),
        });
    }
    if !latencies.is_empty() {
        row.latency_ms = Some(Latency {
            median: round_opt(median(&latencies), 2),
            p99: round_opt(percentile(&latencies, 99.0), 2),
        });
    }
    row
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::CallError;
    use crate::sse::Usage;

    fn ok(ttft: u64, gaps: &[u64], usage: Option<u32>) -> RequestRecord {
        let mut times = vec![Duration::from_millis(ttft)];
        let mut t = ttft;
        for g in gaps {
            t += g;
            times.push(Duration::from_millis(t));
        }
        RequestRecord {
            timing: StreamTiming {
                text_chunks: times.len() as u32,
                chunk_times: times,
                usage: usage.map(|c| Usage {
                    prompt_tokens: Some(10),
                    completion_tokens: Some(c),
                }),
                latency: Duration::from_millis(t + 1),
                saw_done: true,
                retried: false,
                error: None,
            },
            input_tokens: None,
            input_tokens_estimate: Some(9),
        }
    }

    fn failed(message: &str) -> RequestRecord {
        RequestRecord {
            timing: StreamTiming {
                error: Some(CallError::Transport(message.to_owned())),
                latency: Duration::from_millis(2),
                ..StreamTiming::default()
            },
            input_tokens: None,
            input_tokens_estimate: Some(9),
        }
    }

    #[test]
    fn a_level_adds_up() {
        let level = LevelRun {
            concurrency: 2,
            num_prompts: 4,
            records: vec![
                ok(100, &[10, 10, 10], Some(4)),
                ok(200, &[20, 20, 20], None),
                failed("refused"),
                failed("refused"),
            ],
            wall: Duration::from_secs(2),
            interrupted: false,
        };
        let row = summarize(&level);
        assert_eq!(row.completed, Some(2));
        assert_eq!(row.errors, Some(2));
        assert_eq!(
            row.error_samples,
            vec![ErrorSample {
                message: "refused".to_owned(),
                count: 2
            }]
        );
        assert_eq!(row.requests.len(), 4);
        assert_eq!(row.output_tokens, Some(8));
        // inputs: 10 from usage, 9 planned (no usage on the second request)
        assert_eq!(row.input_tokens, Some(19));
        assert_eq!(row.output_tokens_source.as_deref(), Some("mixed"));
        assert_eq!(row.request_rate_rps, Some(1.0));
        assert_eq!(row.output_tok_per_s, Some(4.0));
        assert_eq!(row.total_tok_per_s, Some(13.5));
        assert_eq!(row.ttft_ms.median, Some(150.0));
        // TPOT: (131 - 100) / 3 and (261 - 200) / 3
        let tpot = row.tpot_ms.median.unwrap_or(0.0);
        assert!((tpot - 15.333).abs() < 1e-3, "{tpot}");
        let per_stream = row.per_stream_tok_per_s.unwrap_or(0.0);
        assert!((per_stream - 65.22).abs() < 0.01, "{per_stream}");
        assert_eq!(row.itl_ms.map(|l| l.median), Some(Some(15.0)));
        for r in &row.requests {
            if let Some(t) = r.ttft_ms {
                assert!(t <= r.latency_ms);
            }
        }
    }

    #[test]
    fn an_exactly_measured_prompt_beats_usage() {
        let mut exact = ok(50, &[5], Some(2));
        exact.input_tokens = Some(7);
        let level = LevelRun {
            concurrency: 1,
            num_prompts: 1,
            records: vec![exact],
            wall: Duration::from_secs(1),
            interrupted: false,
        };
        let row = summarize(&level);
        assert_eq!(
            row.requests[0].input_tokens,
            Some(7),
            "usage says 10 (it counts BOS)"
        );
        assert_eq!(row.input_tokens, Some(7));
    }

    #[test]
    fn retried_requests_are_counted_apart_from_errors() {
        let mut retried = ok(10, &[5, 5], Some(3));
        retried.timing.retried = true;
        let level = LevelRun {
            concurrency: 1,
            num_prompts: 2,
            records: vec![ok(10, &[5, 5], Some(3)), retried],
            wall: Duration::from_secs(1),
            interrupted: false,
        };
        let row = summarize(&level);
        assert_eq!(row.errors, Some(0));
        assert_eq!(row.completed, Some(2));
        assert_eq!(row.connection_retries, Some(1));
        assert_eq!(
            row.requests.iter().map(|r| r.retried).collect::<Vec<_>>(),
            [false, true]
        );
    }

    #[test]
    fn a_level_with_only_errors_has_null_figures() {
        let level = LevelRun {
            concurrency: 1,
            num_prompts: 1,
            records: vec![failed("HTTP 500: boom")],
            wall: Duration::from_millis(5),
            interrupted: false,
        };
        let row = summarize(&level);
        assert_eq!(row.completed, Some(0));
        assert_eq!(row.errors, Some(1));
        assert_eq!(row.output_tok_per_s, None);
        assert_eq!(row.ttft_ms, Latency::default());
        assert_eq!(row.per_stream_tok_per_s, None);
    }
}

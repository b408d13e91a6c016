//! Full sweeps against an in-test mock server, an unreachable address and a
//! server that fails: the report must validate and its counts must add up.

mod mock;

use std::path::PathBuf;
use std::time::Duration;

use gemma4_bench::report::{Report, Verdict};
use gemma4_bench::schema::validate_report;
use gemma4_bench::{run_bench, write_outputs, BenchOptions};
use tokio::sync::watch;

fn options(url: &str, levels: &[u32], prompts: u32, input: u32, output: u32) -> BenchOptions {
    let mut o = BenchOptions::new(url, "mock-model");
    o.concurrency = levels.to_vec();
    o.num_prompts = prompts;
    o.input_len = input;
    o.output_len = output;
    o.warmup = 1;
    o.request_timeout = Duration::from_secs(20);
    o
}

async fn bench(opts: &BenchOptions) -> Report {
    let (_keep, cancel) = watch::channel(false);
    match run_bench(opts, cancel).await {
        Ok(r) => r,
        Err(e) => panic!("run_bench: {e}"),
    }
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("gemma4-bench-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    if let Err(e) = std::fs::create_dir_all(&dir) {
        panic!("creating {}: {e}", dir.display());
    }
    dir
}

/// Checks what every report must satisfy and returns its JSON value.
fn check_report(report: &Report, num_prompts: u32) -> serde_json::Value {
    let value = match serde_json::to_value(report) {
        Ok(v) => v,
        Err(e) => panic!("serializing: {e}"),
    };
    if let Err(e) = validate_report(&value) {
        panic!("report does not validate: {e}\n{value:#}");
    }
    for row in &report.throughput.sweep {
        let (completed, errors) = (row.completed.unwrap_or(0), row.errors.unwrap_or(0));
        assert_eq!(
            completed + errors,
            num_prompts,
            "c={}: {completed} + {errors}",
            row.concurrency
        );
        assert_eq!(row.requests.len() as u32, num_prompts);
        let counted: u32 = row.error_samples.iter().map(|e| e.count).sum();
        assert_eq!(counted, errors, "error samples add up");
        for r in &row.requests {
            if let Some(ttft) = r.ttft_ms {
                assert!(
                    ttft <= r.latency_ms,
                    "TTFT {ttft} > latency {}",
                    r.latency_ms
                );
            }
            assert_eq!(
                r.error.is_none(),
                r.ttft_ms.is_some(),
                "completed requests have a TTFT"
            );
        }
    }
    value
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sweep_against_the_mock_adds_up_and_validates() {
    let addr = mock::start(mock::Behaviour::default()).await;
    let opts = options(&format!("http://{addr}/v1"), &[1, 4], 8, 24, 6);
    let report = bench(&opts).await;
    check_report(&report, 8);

    let w = &report.throughput.workload;
    assert_eq!(w.prompt_tokens_source.as_deref(), Some("server-tokenize"));
    assert_eq!(
        w.prompt_len_exact,
        Some(true),
        "prompts must reach exactly 24 mock tokens"
    );
    assert_eq!(w.url.as_deref(), Some(format!("http://{addr}").as_str()));
    assert_eq!(report.throughput.sweep.len(), 2);
    for row in &report.throughput.sweep {
        assert_eq!(row.completed, Some(8));
        assert_eq!(row.output_tokens, Some(8 * 6));
        assert_eq!(
            row.input_tokens,
            Some(8 * 24),
            "usage prompt_tokens count the mock's way"
        );
        assert_eq!(row.output_tokens_source.as_deref(), Some("usage"));
        assert!(row.output_tok_per_s.is_some_and(|t| t > 0.0));
        assert!(row.total_tok_per_s > row.output_tok_per_s);
        assert!(row.per_stream_tok_per_s.is_some_and(|t| t > 0.0));
        assert!(row.ttft_ms.median.is_some() && row.ttft_ms.p99 >= row.ttft_ms.median);
        assert!(row.tpot_ms.median.is_some_and(|t| t > 0.0));
        for r in &row.requests {
            assert_eq!(r.input_tokens, Some(24));
            assert_eq!(r.output_tokens, Some(6));
        }
    }
    assert_eq!(report.software.engine.as_deref(), Some("mock"));
    assert_eq!(report.model.max_model_len, Some(4096));
    assert_eq!(
        report.load_matrix.first().map(|l| l.verdict.as_str()),
        Some("loads")
    );
    assert!(report
        .memory
        .as_ref()
        .and_then(|m| m.resident_memory_gib)
        .is_some_and(|g| g > 0.0));
    assert!(report.cost.is_none() && report.capabilities.is_empty());

    let dir = temp_dir("mock");
    let path = dir.join("report.json");
    let written = match write_outputs(&report, &path) {
        Ok(w) => w,
        Err(e) => panic!("write_outputs: {e}"),
    };
    assert_eq!(written.len(), 3);
    let reread = Report::load(&path).map(|r| r.throughput.sweep.len());
    assert_eq!(reread.ok(), Some(2));
    let svg = std::fs::read_to_string(dir.join("report.throughput.svg")).unwrap_or_default();
    assert!(svg.contains("<polyline"), "the throughput plot has lines");
    assert!(dir.join("report.latency.svg").is_file());
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_errors_are_counted_not_fatal() {
    let addr = mock::start(mock::Behaviour {
        fail_every: Some(3),
        ..mock::Behaviour::default()
    })
    .await;
    let mut opts = options(&format!("http://{addr}"), &[2], 9, 8, 3);
    opts.price_per_hour = Some(1.0);
    let report = bench(&opts).await;
    check_report(&report, 9);
    let row = &report.throughput.sweep[0];
    assert!(row.errors.is_some_and(|e| e >= 2), "{:?}", row.errors);
    assert!(row.completed.is_some_and(|c| c >= 5));
    assert!(row
        .error_samples
        .iter()
        .any(|e| e.message.contains("HTTP 500") && e.message.contains("engine exploded")));
    assert!(report.notes.iter().any(|n| n.contains("requests failed")));
    let cost = report.cost.as_ref().map(|c| c.per_m_output_tokens.len());
    assert_eq!(cost, Some(1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_usage_or_tokenize_tokens_are_counted_and_lengths_approximate() {
    let addr = mock::start(mock::Behaviour {
        usage: false,
        tokenize: false,
        ..mock::Behaviour::default()
    })
    .await;
    let opts = options(&format!("http://{addr}"), &[3], 5, 10, 4);
    let report = bench(&opts).await;
    check_report(&report, 5);
    let row = &report.throughput.sweep[0];
    assert_eq!(row.output_tokens_source.as_deref(), Some("counted"));
    assert_eq!(row.output_tokens, Some(20));
    assert_eq!(
        report.throughput.workload.prompt_tokens_source.as_deref(),
        Some("approximate")
    );
    assert_eq!(report.throughput.workload.prompt_len_exact, Some(false));
    assert!(report.notes.iter().any(|n| n.contains("approximate")));
    assert!(report
        .notes
        .iter()
        .any(|n| n.contains("counting stream chunks")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_url_gives_a_report_of_errors() {
    // A port that was just free: nothing listens there any more.
    let port = match std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()) {
        Ok(a) => a.port(),
        Err(e) => panic!("{e}"),
    };
    let mut opts = options(&format!("http://127.0.0.1:{port}"), &[1, 2], 3, 8, 4);
    opts.probes = true;
    let report = bench(&opts).await;
    check_report(&report, 3);
    for row in &report.throughput.sweep {
        assert_eq!(row.completed, Some(0));
        assert_eq!(row.errors, Some(3));
        assert_eq!(row.output_tok_per_s, None);
        assert!(row.error_samples.iter().all(|e| !e.message.is_empty()));
    }
    assert!(report.load_matrix.is_empty());
    assert!(report.notes.iter().any(|n| n.contains("/v1/models failed")));
    for c in &report.capabilities {
        assert_eq!(c.verdict, Verdict::NotTested, "{}", c.domain);
        for p in &c.probes {
            assert!(p.observed.contains("unreachable"), "{}", p.observed);
        }
    }
    assert_eq!(report.capabilities.len(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probes_against_a_server_without_chat_fail_with_the_http_error() {
    let addr = mock::start(mock::Behaviour::default()).await;
    let mut opts = options(&format!("http://{addr}"), &[1], 1, 4, 2);
    opts.probes = true;
    let report = bench(&opts).await;
    check_report(&report, 1);
    let names: Vec<&str> = report
        .capabilities
        .iter()
        .map(|c| c.domain.as_str())
        .collect();
    assert_eq!(names, ["tool_calling", "structured_output", "reasoning"]);
    let probes: usize = report.capabilities.iter().map(|c| c.probes.len()).sum();
    assert_eq!(probes, 10);
    for c in &report.capabilities {
        assert_eq!(c.verdict, Verdict::Fail);
        for p in &c.probes {
            assert_eq!(p.verdict, Verdict::Fail);
            assert!(p.observed.contains("HTTP 404"), "{}", p.observed);
            assert!(p.latency_ms.is_some());
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_keeps_what_was_measured() {
    let (stop, cancel) = watch::channel(false);
    // Request 1 is the warm-up; the stop comes as request 4 (the third of the
    // first level) arrives, so exactly two requests of that level finished.
    let addr = mock::start(mock::Behaviour {
        token_delay: Duration::from_millis(20),
        stop_at: Some((4, std::sync::Arc::new(stop))),
        ..mock::Behaviour::default()
    })
    .await;
    let opts = options(&format!("http://{addr}"), &[1, 2], 6, 4, 5);
    let report = match run_bench(&opts, cancel).await {
        Ok(r) => r,
        Err(e) => panic!("{e}"),
    };
    assert_eq!(report.run.interrupted, Some(true));
    assert_eq!(
        report.throughput.sweep.len(),
        1,
        "the second level never starts"
    );
    let row = &report.throughput.sweep[0];
    assert_eq!(row.interrupted, Some(true));
    assert_eq!(row.completed, Some(2));
    assert_eq!(row.errors, Some(0), "abandoned requests are not errors");
    assert_eq!(row.requests.len(), 2);
    assert!(report.notes.iter().any(|n| n.starts_with("Interrupted")));
    let value = serde_json::to_value(&report).unwrap_or_default();
    assert!(validate_report(&value).is_ok());
}

#[test]
fn bad_options_are_errors_with_clear_messages() {
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => panic!("{e}"),
    };
    let run = |opts: BenchOptions| {
        rt.block_on(async {
            let (_keep, cancel) = watch::channel(false);
            run_bench(&opts, cancel)
                .await
                .map(|_| ())
                .map_err(|e| e.to_string())
        })
    };
    let e = run(options("https://127.0.0.1:1", &[1], 1, 4, 4));
    assert!(
        matches!(&e, Err(m) if m.contains("https is not supported")),
        "{e:?}"
    );
    let e = run(options("127.0.0.1:1", &[1], 1, 4, 4));
    assert!(matches!(&e, Err(m) if m.contains("invalid URL")), "{e:?}");
    let mut o = options("http://127.0.0.1:1", &[1], 1, 4, 4);
    o.dataset = gemma4_bench::Dataset::File(PathBuf::from("/nonexistent/prompts.jsonl"));
    let e = run(o);
    assert!(
        matches!(&e, Err(m) if m.contains("/nonexistent/prompts.jsonl")),
        "{e:?}"
    );
    let mut o = options("http://127.0.0.1:1", &[1], 1, 4, 4);
    o.tokenizer = Some(PathBuf::from("/nonexistent/tokenizer-dir"));
    let e = run(o);
    assert!(matches!(&e, Err(m) if m.contains("tokenizer")), "{e:?}");
}

//! Two reports side by side: one Markdown table per concurrency level present
//! in either, with B/A ratios, then capability verdicts.

use std::collections::BTreeSet;
use std::fmt::Write as _;

use crate::report::{Report, SweepRow};
use crate::summary::fmt_num;

/// B / A, when both are known and A is not zero.
pub fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if a != 0.0 && a.is_finite() && b.is_finite() => Some(b / a),
        _ => None,
    }
}

fn fmt_ratio(r: Option<f64>) -> String {
    r.map_or_else(|| "-".to_owned(), |r| format!("{r:.2}×"))
}

type Metric = (&'static str, fn(&SweepRow) -> Option<f64>, bool);

/// The compared figures, and whether higher is better.
const METRICS: &[Metric] = &[
    ("output tok/s", |r| r.output_tok_per_s, true),
    ("total tok/s", |r| r.total_tok_per_s, true),
    ("per-stream tok/s", |r| r.per_stream_tok_per_s, true),
    ("req/s", |r| r.request_rate_rps, true),
    ("TTFT median ms", |r| r.ttft_ms.median, false),
    ("TTFT p99 ms", |r| r.ttft_ms.p99, false),
    ("TPOT median ms", |r| r.tpot_ms.median, false),
];

/// A Markdown comparison of `a` and `b`.
pub fn markdown(a: &Report, b: &Report) -> String {
    let mut out = String::new();
    let (la, lb) = (a.label(), b.label());
    let _ = writeln!(out, "## A: {la}  vs  B: {lb}\n");
    let _ = writeln!(out, "| | A | B |");
    let _ = writeln!(out, "|---|---|---|");
    let text = |v: Option<&str>| v.unwrap_or("-").replace('|', "\\|");
    let rows: [(&str, String, String); 6] = [
        ("run", a.run.id.clone(), b.run.id.clone()),
        (
            "engine",
            text(a.software.engine.as_deref()),
            text(b.software.engine.as_deref()),
        ),
        (
            "version",
            text(a.software.version.as_deref()),
            text(b.software.version.as_deref()),
        ),
        (
            "model",
            text(a.model.id.as_deref()),
            text(b.model.id.as_deref()),
        ),
        (
            "accelerator",
            text(a.hardware.accelerator.as_deref()),
            text(b.hardware.accelerator.as_deref()),
        ),
        ("workload", workload(a), workload(b)),
    ];
    for (name, va, vb) in rows {
        let _ = writeln!(out, "| {name} | {va} | {vb} |");
    }
    let levels: BTreeSet<u32> = a
        .throughput
        .sweep
        .iter()
        .chain(&b.throughput.sweep)
        .map(|r| r.concurrency)
        .collect();
    let _ = writeln!(out, "\n| concurrency | metric | A | B | B/A | better |");
    let _ = writeln!(out, "|---:|---|---:|---:|---:|:---:|");
    for c in levels {
        let ra = a.throughput.sweep.iter().find(|r| r.concurrency == c);
        let rb = b.throughput.sweep.iter().find(|r| r.concurrency == c);
        for (name, get, higher_better) in METRICS {
            let va = ra.and_then(get);
            let vb = rb.and_then(get);
            let r = ratio(va, vb);
            let better = match r {
                Some(r) if (r > 1.0) == *higher_better && r != 1.0 => "B",
                Some(r) if r != 1.0 => "A",
                Some(_) => "=",
                None => "",
            };
            let _ = writeln!(
                out,
                "| {c} | {name} | {} | {} | {} | {better} |",
                fmt_num(va),
                fmt_num(vb),
                fmt_ratio(r)
            );
        }
    }
    let mut probes: Vec<(String, String)> = Vec::new();
    for c in a.capabilities.iter().chain(&b.capabilities) {
        for p in &c.probes {
            let key = (c.domain.clone(), p.name.clone());
            if !probes.contains(&key) {
                probes.push(key);
            }
        }
    }
    if !probes.is_empty() {
        let verdict = |r: &Report, domain: &str, name: &str| {
            r.capabilities
                .iter()
                .filter(|c| c.domain == domain)
                .flat_map(|c| &c.probes)
                .find(|p| p.name == name)
                .map_or("-", |p| p.verdict.as_str())
        };
        let _ = writeln!(out, "\n| capability | probe | A | B |");
        let _ = writeln!(out, "|---|---|---|---|");
        for (domain, name) in &probes {
            let _ = writeln!(
                out,
                "| {domain} | {name} | {} | {} |",
                verdict(a, domain, name),
                verdict(b, domain, name)
            );
        }
    }
    out
}

fn workload(r: &Report) -> String {
    let w = &r.throughput.workload;
    let n = |v: Option<u32>| v.map_or_else(|| "-".to_owned(), |v| v.to_string());
    format!(
        "{} in={} out={} n={}",
        w.dataset,
        n(w.input_len),
        n(w.output_len),
        n(w.num_prompts)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::{Latency, MedianOnly};

    fn report(engine: &str, rows: &[(u32, f64, f64)]) -> Report {
        let mut r = Report::default();
        r.software.engine = Some(engine.to_owned());
        r.throughput.sweep = rows
            .iter()
            .map(|(c, tok, ttft)| SweepRow {
                concurrency: *c,
                output_tok_per_s: Some(*tok),
                ttft_ms: Latency {
                    median: Some(*ttft),
                    p99: None,
                },
                tpot_ms: MedianOnly::default(),
                ..SweepRow::default()
            })
            .collect();
        r
    }

    #[test]
    fn ratios() {
        assert_eq!(ratio(Some(2.0), Some(3.0)), Some(1.5));
        assert_eq!(ratio(Some(0.0), Some(3.0)), None);
        assert_eq!(ratio(None, Some(3.0)), None);
    }

    #[test]
    fn side_by_side_with_ratios_and_winners() {
        let a = report("gemma4", &[(1, 100.0, 20.0), (8, 400.0, 40.0)]);
        let b = report("vllm", &[(1, 150.0, 10.0), (32, 900.0, 90.0)]);
        let md = markdown(&a, &b);
        assert!(md.contains("| engine | gemma4 | vllm |"), "{md}");
        assert!(
            md.contains("| 1 | output tok/s | 100 | 150 | 1.50× | B |"),
            "{md}"
        );
        assert!(
            md.contains("| 1 | TTFT median ms | 20.0 | 10.0 | 0.50× | B |"),
            "{md}"
        );
        assert!(md.contains("| 8 | output tok/s | 400 | - | - |  |"), "{md}");
        assert!(
            md.contains("| 32 | output tok/s | - | 900 | - |  |"),
            "{md}"
        );
    }

    #[test]
    fn the_example_against_itself() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/bench/report-example.json");
        let r = Report::load(&path).unwrap_or_default();
        let md = markdown(&r, &r);
        assert!(
            md.contains("| 64 | output tok/s | 2140 | 2140 | 1.00× | = |"),
            "{md}"
        );
        assert!(md.contains("| vision | scene | pass | pass |"));
    }
}

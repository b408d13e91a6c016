//! The Markdown summary printed after a run.

use std::fmt::Write as _;

use crate::report::Report;

/// A number for a table: `-` when unknown, fewer decimals for larger values.
pub fn fmt_num(value: Option<f64>) -> String {
    match value {
        None => "-".to_owned(),
        Some(v) if !v.is_finite() => "-".to_owned(),
        Some(v) if v.abs() >= 100.0 => format!("{v:.0}"),
        Some(v) if v.abs() >= 10.0 => format!("{v:.1}"),
        Some(v) => format!("{v:.2}"),
    }
}

fn fmt_count(value: Option<u32>) -> String {
    value.map_or_else(|| "-".to_owned(), |v| v.to_string())
}

/// Markdown: what was measured, the sweep table, capabilities, cost and notes.
pub fn markdown(report: &Report) -> String {
    let mut out = String::new();
    let w = &report.throughput.workload;
    let _ = writeln!(out, "## {}", report.label());
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "Run `{}` ({}); dataset {}, input {} tokens, output {} tokens, {} prompts per level{}.",
        report.run.id,
        report.run.date,
        w.dataset,
        w.input_len
            .map_or_else(|| "-".to_owned(), |v| v.to_string()),
        w.output_len
            .map_or_else(|| "-".to_owned(), |v| v.to_string()),
        w.num_prompts
            .map_or_else(|| "-".to_owned(), |v| v.to_string()),
        w.url
            .as_deref()
            .map(|u| format!(", server {u}"))
            .unwrap_or_default()
    );
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "| concurrency | completed | errors | req/s | output tok/s | total tok/s | per-stream tok/s | TTFT median ms | TTFT p99 ms | TPOT median ms |"
    );
    let _ = writeln!(out, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in &report.throughput.sweep {
        let flag = if r.interrupted == Some(true) {
            " (interrupted)"
        } else {
            ""
        };
        let _ = writeln!(
            out,
            "| {}{flag} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            r.concurrency,
            fmt_count(r.completed),
            fmt_count(r.errors),
            fmt_num(r.request_rate_rps),
            fmt_num(r.output_tok_per_s),
            fmt_num(r.total_tok_per_s),
            fmt_num(r.per_stream_tok_per_s),
            fmt_num(r.ttft_ms.median),
            fmt_num(r.ttft_ms.p99),
            fmt_num(r.tpot_ms.median)
        );
    }
    for r in &report.throughput.sweep {
        for e in &r.error_samples {
            let _ = writeln!(out, "\nc={}: {} × {}", r.concurrency, e.count, e.message);
        }
    }
    if !report.capabilities.is_empty() {
        let _ = writeln!(
            out,
            "\n| domain | probe | verdict | latency ms | observed |"
        );
        let _ = writeln!(out, "|---|---|---|---:|---|");
        for c in &report.capabilities {
            let _ = writeln!(
                out,
                "| **{}** | | **{}** | | |",
                c.domain,
                c.verdict.as_str()
            );
            for p in &c.probes {
                let _ = writeln!(
                    out,
                    "| | {} | {} | {} | {} |",
                    p.name,
                    p.verdict.as_str(),
                    fmt_num(p.latency_ms),
                    p.observed.replace('|', "\\|")
                );
            }
        }
    }
    if let Some(cost) = &report.cost {
        let _ = writeln!(
            out,
            "\n| operating point | output tok/s | $ per M output tokens |"
        );
        let _ = writeln!(out, "|---|---:|---:|");
        for p in &cost.per_m_output_tokens {
            let _ = writeln!(
                out,
                "| {} | {} | {:.3} |",
                p.operating_point,
                fmt_num(Some(p.output_tok_per_s)),
                p.usd
            );
        }
        if let Some(notes) = &cost.notes {
            let _ = writeln!(out, "\n{notes}");
        }
    }
    if !report.notes.is_empty() {
        let _ = writeln!(out);
        for n in &report.notes {
            let _ = writeln!(out, "- {n}");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers() {
        assert_eq!(fmt_num(None), "-");
        assert_eq!(fmt_num(Some(f64::NAN)), "-");
        assert_eq!(fmt_num(Some(2215.4)), "2215");
        assert_eq!(fmt_num(Some(17.54)), "17.5");
        assert_eq!(fmt_num(Some(4.7)), "4.70");
    }

    #[test]
    fn the_example_summarises() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/bench/report-example.json");
        let report = Report::load(&path).unwrap_or_default();
        let md = markdown(&report);
        assert!(
            md.contains("| 100 | - | - | 17.3 | 2215 | 19938 | 27.0 | 833 | 1573 | 36.8 |"),
            "{md}"
        );
        assert!(md.contains("| | json_schema-thinking-off | fail |"));
        assert!(md.contains("| saturation | 2215 | 0.170 |"));
    }
}

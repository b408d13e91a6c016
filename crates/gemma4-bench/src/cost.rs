//! Cost per million output tokens at each operating point of a sweep, and the
//! break-even throughput against a per-token API price.

use crate::report::{Cost, CostComparison, CostPoint, SweepRow};
use crate::stats::round;

/// Dollars per million output tokens for a machine at `price_per_hour` that
/// sustains `output_tok_per_s`.
pub fn usd_per_million(price_per_hour: f64, output_tok_per_s: f64) -> Option<f64> {
    (output_tok_per_s > 0.0 && price_per_hour >= 0.0)
        .then(|| price_per_hour / (output_tok_per_s * 3600.0) * 1e6)
}

/// Output tokens per second at which the machine costs as much as an API
/// charging `api_usd_per_million`.
pub fn breakeven_tok_per_s(price_per_hour: f64, api_usd_per_million: f64) -> Option<f64> {
    (api_usd_per_million > 0.0).then(|| price_per_hour * 1e6 / (3600.0 * api_usd_per_million))
}

/// A named per-token API price.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiPrice {
    pub name: String,
    pub usd_per_m_output_tokens: f64,
    pub source: Option<String>,
}

/// The `cost` block. Operating points are the sweep's levels, sorted by output
/// throughput (highest first); the fastest is named `saturation` and
/// concurrency 1 `single-stream`, the others `c=N`. `time_to_healthy_s`, when
/// known, prices the cold start.
pub fn cost_block(
    price_per_hour: f64,
    sweep: &[SweepRow],
    api: Option<&ApiPrice>,
    time_to_healthy_s: Option<f64>,
) -> Cost {
    let mut rows: Vec<(u32, f64)> = sweep
        .iter()
        .filter_map(|r| {
            r.output_tok_per_s
                .filter(|t| *t > 0.0)
                .map(|t| (r.concurrency, t))
        })
        .collect();
    rows.sort_by(|a, b| b.1.total_cmp(&a.1));
    let mut points = Vec::new();
    for (i, (concurrency, tok_s)) in rows.iter().enumerate() {
        let name = if i == 0 && *concurrency != 1 {
            "saturation".to_owned()
        } else if *concurrency == 1 {
            "single-stream".to_owned()
        } else {
            format!("c={concurrency}")
        };
        if let Some(usd) = usd_per_million(price_per_hour, *tok_s).and_then(|u| round(u, 3)) {
            points.push(CostPoint {
                operating_point: name,
                output_tok_per_s: *tok_s,
                usd,
            });
        }
    }
    let mut notes = vec![format!(
        "Machine price ${price_per_hour}/hour; cost = price / (output tok/s × 3600) × 1e6."
    )];
    let mut comparisons = Vec::new();
    if let Some(api) = api {
        let breakeven = breakeven_tok_per_s(price_per_hour, api.usd_per_m_output_tokens)
            .and_then(|b| round(b, 1));
        if let Some(b) = breakeven {
            let reached = rows.iter().filter(|(_, t)| *t >= b).map(|(c, _)| *c).min();
            let tail = match reached {
                Some(c) => format!(" (reached at c={c} in this sweep)"),
                None => " (not reached in this sweep)".to_owned(),
            };
            notes.push(format!(
                "Breakeven vs {} at ~{b} sustained output tok/s{tail}.",
                api.name
            ));
        }
        comparisons.push(CostComparison {
            name: api.name.clone(),
            usd_per_m_output_tokens: api.usd_per_m_output_tokens,
            source: api.source.clone(),
            breakeven_output_tok_per_s: breakeven,
        });
    }
    Cost {
        per_m_output_tokens: points,
        cold_start_usd: time_to_healthy_s.and_then(|s| round(price_per_hour * s / 3600.0, 3)),
        comparisons,
        notes: Some(notes.join(" ")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(c: u32, tok: f64) -> SweepRow {
        SweepRow {
            concurrency: c,
            output_tok_per_s: Some(tok),
            ..SweepRow::default()
        }
    }

    #[test]
    fn matches_the_study_figures() {
        // $1.35/h at 2215 tok/s is $0.17 per million; breakeven vs $0.40/M is ~940 tok/s.
        let usd = usd_per_million(1.35, 2215.0).unwrap_or(0.0);
        assert!((usd - 0.1693).abs() < 1e-3, "{usd}");
        let b = breakeven_tok_per_s(1.35, 0.4).unwrap_or(0.0);
        assert!((b - 937.5).abs() < 1e-9, "{b}");
        assert_eq!(usd_per_million(1.0, 0.0), None);
        assert_eq!(breakeven_tok_per_s(1.0, 0.0), None);
    }

    #[test]
    fn operating_points_are_named_and_sorted() {
        let sweep = [
            row(1, 209.0),
            row(8, 1209.0),
            row(64, 2140.0),
            row(100, 2215.0),
            SweepRow::default(),
        ];
        let api = ApiPrice {
            name: "flash-lite".to_owned(),
            usd_per_m_output_tokens: 0.4,
            source: None,
        };
        let cost = cost_block(1.35, &sweep, Some(&api), Some(640.0));
        let names: Vec<&str> = cost
            .per_m_output_tokens
            .iter()
            .map(|p| p.operating_point.as_str())
            .collect();
        assert_eq!(names, ["saturation", "c=64", "c=8", "single-stream"]);
        assert_eq!(cost.per_m_output_tokens[3].usd, 1.794);
        assert_eq!(cost.comparisons[0].breakeven_output_tok_per_s, Some(937.5));
        assert_eq!(cost.cold_start_usd, Some(0.24));
        assert!(cost.notes.is_some_and(|n| n.contains("reached at c=8")));
    }
}

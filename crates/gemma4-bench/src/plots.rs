//! Hand-written SVG line charts of a sweep: throughput (output tok/s and
//! per-stream tok/s) and latency (TTFT median and p99, TPOT median) against
//! concurrency.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use crate::error::{BenchError, Result};
use crate::report::Report;

const PANEL_W: f64 = 460.0;
const PANEL_H: f64 = 320.0;
const HEADER_H: f64 = 36.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 58.0;
const BOTTOM: f64 = 52.0;
const TICKS: usize = 5;

/// One line of a chart.
#[derive(Debug, Clone)]
pub struct Series {
    pub name: String,
    pub color: &'static str,
    pub values: Vec<Option<f64>>,
}

/// One chart: a title, a y-axis label and its lines.
#[derive(Debug, Clone)]
pub struct Panel {
    pub title: String,
    pub y_label: String,
    pub series: Vec<Series>,
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A round axis maximum at or above `max`, and its tick step.
fn nice_axis(max: f64) -> (f64, f64) {
    if !(max.is_finite() && max > 0.0) {
        return (1.0, 1.0 / TICKS as f64);
    }
    let raw = max / TICKS as f64;
    let magnitude = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * magnitude)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * magnitude);
    ((max / step).ceil() * step, step)
}

fn tick_label(v: f64, step: f64) -> String {
    if step >= 1.0 {
        format!("{v:.0}")
    } else if step >= 0.1 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

/// Draws one panel with its top-left corner at `(x0, y0)`.
fn panel(svg: &mut String, x0: f64, y0: f64, x_labels: &[String], x_title: &str, p: &Panel) {
    let (plot_w, plot_h) = (PANEL_W - LEFT - RIGHT, PANEL_H - TOP - BOTTOM);
    let (left, top) = (x0 + LEFT, y0 + TOP);
    let bottom = top + plot_h;
    let _ = write!(
        svg,
        r#"<text x="{:.1}" y="{:.1}" font-size="15" font-weight="bold" text-anchor="middle">{}</text>"#,
        x0 + PANEL_W / 2.0,
        y0 + 22.0,
        escape(&p.title)
    );
    let max = p
        .series
        .iter()
        .flat_map(|s| s.values.iter().flatten())
        .copied()
        .filter(|v| v.is_finite())
        .fold(0.0f64, f64::max);
    let (y_max, step) = nice_axis(max);
    for i in 0..=TICKS {
        let v = step * i as f64;
        if v > y_max + step / 2.0 {
            break;
        }
        let y = bottom - v / y_max * plot_h;
        let _ = write!(
            svg,
            r##"<line x1="{left:.1}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#e3e3e3"/><text x="{:.1}" y="{:.1}" font-size="11" text-anchor="end">{}</text>"##,
            left + plot_w,
            left - 6.0,
            y + 4.0,
            tick_label(v, step)
        );
    }
    let n = x_labels.len();
    let x_at = |i: usize| {
        if n <= 1 {
            left + plot_w / 2.0
        } else {
            left + plot_w * (0.05 + 0.9 * i as f64 / (n - 1) as f64)
        }
    };
    for (i, label) in x_labels.iter().enumerate() {
        let _ = write!(
            svg,
            r#"<text x="{:.1}" y="{:.1}" font-size="11" text-anchor="middle">{}</text>"#,
            x_at(i),
            bottom + 16.0,
            escape(label)
        );
    }
    let _ = write!(
        svg,
        r##"<line x1="{left:.1}" y1="{bottom:.1}" x2="{:.1}" y2="{bottom:.1}" stroke="#444"/><line x1="{left:.1}" y1="{top:.1}" x2="{left:.1}" y2="{bottom:.1}" stroke="#444"/>"##,
        left + plot_w
    );
    let _ = write!(
        svg,
        r#"<text x="{:.1}" y="{:.1}" font-size="12" text-anchor="middle">{}</text>"#,
        left + plot_w / 2.0,
        bottom + 38.0,
        escape(x_title)
    );
    let _ = write!(
        svg,
        r#"<text x="{:.1}" y="{:.1}" font-size="12" text-anchor="middle" transform="rotate(-90 {:.1} {:.1})">{}</text>"#,
        x0 + 16.0,
        top + plot_h / 2.0,
        x0 + 16.0,
        top + plot_h / 2.0,
        escape(&p.y_label)
    );
    if max <= 0.0 {
        let _ = write!(
            svg,
            r##"<text x="{:.1}" y="{:.1}" font-size="13" fill="#888" text-anchor="middle">no data</text>"##,
            left + plot_w / 2.0,
            top + plot_h / 2.0
        );
    }
    for (k, s) in p.series.iter().enumerate() {
        let points: Vec<(f64, f64)> = s
            .values
            .iter()
            .enumerate()
            .filter_map(|(i, v)| {
                v.filter(|v| v.is_finite())
                    .map(|v| (x_at(i), bottom - v / y_max * plot_h))
            })
            .collect();
        if points.len() > 1 {
            let path: Vec<String> = points
                .iter()
                .map(|(x, y)| format!("{x:.1},{y:.1}"))
                .collect();
            let _ = write!(
                svg,
                r#"<polyline fill="none" stroke="{}" stroke-width="2" points="{}"/>"#,
                s.color,
                path.join(" ")
            );
        }
        for (x, y) in &points {
            let _ = write!(
                svg,
                r#"<circle cx="{x:.1}" cy="{y:.1}" r="3.5" fill="{}"/>"#,
                s.color
            );
        }
        // Legend in a row above the plot, where it cannot hide a point.
        let ly = top - 12.0;
        let lx = left + 4.0 + 110.0 * k as f64;
        let _ = write!(
            svg,
            r#"<rect x="{lx:.1}" y="{:.1}" width="14" height="4" fill="{}"/><text x="{:.1}" y="{:.1}" font-size="11">{}</text>"#,
            ly - 2.0,
            s.color,
            lx + 20.0,
            ly + 4.0,
            escape(&s.name)
        );
    }
}

/// A figure of panels side by side sharing the x axis (concurrency levels).
pub fn figure(title: &str, x_labels: &[String], x_title: &str, panels: &[Panel]) -> String {
    let width = PANEL_W * panels.len().max(1) as f64;
    let height = PANEL_H + HEADER_H;
    let mut svg = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0}" height="{height:.0}" viewBox="0 0 {width:.0} {height:.0}" font-family="sans-serif">"#
    );
    let _ = write!(
        svg,
        r##"<rect width="100%" height="100%" fill="#ffffff"/><text x="{:.1}" y="24" font-size="16" text-anchor="middle">{}</text>"##,
        width / 2.0,
        escape(title)
    );
    for (i, p) in panels.iter().enumerate() {
        panel(&mut svg, PANEL_W * i as f64, HEADER_H, x_labels, x_title, p);
    }
    svg.push_str("</svg>\n");
    svg
}

fn series(name: &str, color: &'static str, values: Vec<Option<f64>>) -> Series {
    Series {
        name: name.to_owned(),
        color,
        values,
    }
}

/// Output tok/s and per-stream tok/s against concurrency.
pub fn throughput_svg(report: &Report) -> String {
    let sweep = &report.throughput.sweep;
    let x: Vec<String> = sweep.iter().map(|r| r.concurrency.to_string()).collect();
    figure(
        &format!("Throughput — {}", report.label()),
        &x,
        "concurrency",
        &[
            Panel {
                title: "Output tokens/s".to_owned(),
                y_label: "tokens/s".to_owned(),
                series: vec![series(
                    "output",
                    "#1f77b4",
                    sweep.iter().map(|r| r.output_tok_per_s).collect(),
                )],
            },
            Panel {
                title: "Per-stream tokens/s".to_owned(),
                y_label: "tokens/s per stream".to_owned(),
                series: vec![series(
                    "per stream",
                    "#2ca02c",
                    sweep.iter().map(|r| r.per_stream_tok_per_s).collect(),
                )],
            },
        ],
    )
}

/// TTFT (median, p99) and TPOT (median) against concurrency.
pub fn latency_svg(report: &Report) -> String {
    let sweep = &report.throughput.sweep;
    let x: Vec<String> = sweep.iter().map(|r| r.concurrency.to_string()).collect();
    figure(
        &format!("Latency — {}", report.label()),
        &x,
        "concurrency",
        &[
            Panel {
                title: "Time to first token".to_owned(),
                y_label: "ms".to_owned(),
                series: vec![
                    series(
                        "median",
                        "#1f77b4",
                        sweep.iter().map(|r| r.ttft_ms.median).collect(),
                    ),
                    series(
                        "p99",
                        "#d62728",
                        sweep.iter().map(|r| r.ttft_ms.p99).collect(),
                    ),
                ],
            },
            Panel {
                title: "Time per output token".to_owned(),
                y_label: "ms".to_owned(),
                series: vec![series(
                    "median",
                    "#9467bd",
                    sweep.iter().map(|r| r.tpot_ms.median).collect(),
                )],
            },
        ],
    )
}

/// Writes `<stem>.throughput.svg` and `<stem>.latency.svg` next to `json_path`.
pub fn write_plots(report: &Report, json_path: &Path) -> Result<Vec<PathBuf>> {
    let stem = json_path
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or("report");
    let dir = json_path.parent().unwrap_or_else(|| Path::new(""));
    let mut written = Vec::new();
    for (suffix, svg) in [
        ("throughput", throughput_svg(report)),
        ("latency", latency_svg(report)),
    ] {
        let path = dir.join(format!("{stem}.{suffix}.svg"));
        std::fs::write(&path, svg).map_err(|source| BenchError::Write {
            path: path.clone(),
            source,
        })?;
        written.push(path);
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn axes_are_round() {
        assert_eq!(nice_axis(2215.0), (2500.0, 500.0));
        assert_eq!(nice_axis(17.3), (20.0, 5.0));
        assert_eq!(nice_axis(0.0), (1.0, 0.2));
        assert_eq!(nice_axis(1.0), (1.0, 0.2));
    }

    #[test]
    fn the_example_plots() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/bench/report-example.json");
        let report = Report::load(&path).unwrap_or_default();
        let svg = throughput_svg(&report);
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>\n"));
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert_eq!(svg.matches("<circle").count(), 10);
        let latency = latency_svg(&report);
        assert_eq!(latency.matches("<polyline").count(), 3);
        assert!(latency.contains(">100<"), "x labels carry the concurrency");
    }

    #[test]
    fn missing_values_and_text_are_safe() {
        let svg = figure(
            "a <b> & \"c\"",
            &["1".to_owned(), "2".to_owned()],
            "x",
            &[Panel {
                title: "t".to_owned(),
                y_label: "y".to_owned(),
                series: vec![series("s", "#000", vec![None, None])],
            }],
        );
        assert!(svg.contains("a &lt;b&gt; &amp; &quot;c&quot;"));
        assert!(svg.contains("no data"));
        assert!(!svg.contains("NaN"));
    }
}

//! The benchmark report, schema version 1.0.
//!
//! Field names and nesting follow the published Gemma 4 serving study's report
//! (`tests/fixtures/bench/report-example.json`). Unknown values are written as
//! `null`, never guessed. Fields this tool adds beyond that example (per-request
//! records, error counts, where token counts came from) are all optional, so
//! reports written by other tools still load for [`crate::compare`].

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{BenchError, Result};

/// The schema version this crate writes.
pub const SCHEMA_VERSION: &str = "1.0";

/// A whole report.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Report {
    pub schema_version: String,
    pub run: Run,
    pub hardware: Hardware,
    pub model: Model,
    pub software: Software,
    pub load_matrix: Vec<LoadEntry>,
    pub throughput: Throughput,
    pub capabilities: Vec<Capability>,
    pub memory: Option<Memory>,
    pub startup: Option<Startup>,
    pub cost: Option<Cost>,
    pub issues: Vec<Issue>,
    pub notes: Vec<String>,
}

impl Report {
    /// Reads a report from a JSON file (any tool's, as long as it has this shape).
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| BenchError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        serde_json::from_str(&text).map_err(|e| BenchError::Parse {
            path: path.to_path_buf(),
            message: e.to_string(),
        })
    }

    /// A short label for tables: engine and model, else the run id.
    pub fn label(&self) -> String {
        match (&self.software.engine, &self.model.id) {
            (Some(engine), Some(model)) => format!("{engine} · {model}"),
            (Some(engine), None) => engine.clone(),
            (None, Some(model)) => model.clone(),
            (None, None) => self.run.id.clone(),
        }
    }
}

/// `run`: identity of this measurement.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Run {
    pub id: String,
    pub date: String,
    pub source: Option<String>,
    pub notes: Option<String>,
    /// True when the run was stopped (Ctrl-C) before it finished.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub interrupted: Option<bool>,
}

/// `hardware`: what the server runs on, as far as it can be observed.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Hardware {
    pub accelerator: Option<String>,
    pub chips: Option<u32>,
    pub hbm_gb_per_chip: Option<f64>,
    pub machine_type: Option<String>,
    pub host: Option<Host>,
    pub pricing: Option<Pricing>,
}

/// `hardware.host`. The study's example records cloud placement; this tool adds
/// the benchmarking machine's CPU and memory, and whether the server is on it.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Host {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cloud: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub zone: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub provisioning: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub instance_name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_run_duration_hours: Option<f64>,
    /// True when the server URL is a loopback address, so the CPU and memory
    /// below are the server's too.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub server_on_this_host: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_model: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_cores: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_gib: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub os: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kernel: Option<String>,
}

/// `hardware.pricing`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Pricing {
    pub currency: String,
    pub rate_per_chip_hour: Option<f64>,
    /// The whole machine's hourly price (what `--price-per-hour` gives).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rate_per_hour: Option<f64>,
    pub source: Option<String>,
}

/// `model`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Model {
    pub id: Option<String>,
    pub family: Option<String>,
    pub parameters_b: Option<f64>,
    pub weights_dtype: Option<String>,
    pub quantization: Option<String>,
    pub kv_cache_dtype: Option<String>,
    pub max_model_len: Option<u64>,
    pub architecture_notes: Option<String>,
}

/// `software`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Software {
    pub engine: Option<String>,
    pub version: Option<String>,
    pub container_image: Option<String>,
    pub backend: Option<String>,
    pub tensor_parallel_size: Option<u32>,
    pub serve_args: Option<Vec<String>>,
}

/// One row of `load_matrix`: did this model load on this backend.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct LoadEntry {
    pub model_id: String,
    pub backend: Option<String>,
    /// `loads` or `fails`.
    pub verdict: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub issue: Option<String>,
}

/// `throughput`: the workload and one row per concurrency level.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Throughput {
    pub workload: Workload,
    pub sweep: Vec<SweepRow>,
}

/// `throughput.workload`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Workload {
    pub tool: String,
    pub dataset: String,
    pub input_len: Option<u32>,
    pub output_len: Option<u32>,
    pub num_prompts: Option<u32>,
    pub runs_per_point: Option<u32>,
    pub noise_floor_pct: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warmup_requests: Option<u32>,
    /// Which request fields beyond `max_tokens` the server accepted
    /// (`ignore_eos`, `min_tokens`, `stream_options`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub request_extras: Option<Vec<String>>,
    /// How prompt lengths were measured: `server-tokenize`, `local-tokenizer`,
    /// `approximate`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_tokens_source: Option<String>,
    /// True when every random prompt has exactly `input_len` tokens.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_len_exact: Option<bool>,
}

/// Median and p99 of a latency, in milliseconds.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct Latency {
    pub median: Option<f64>,
    pub p99: Option<f64>,
}

/// The median of a latency, in milliseconds (the study reports TPOT this way).
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct MedianOnly {
    pub median: Option<f64>,
}

/// One concurrency level of the sweep.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct SweepRow {
    pub concurrency: u32,
    /// Completed requests per second over the level's wall time.
    pub request_rate_rps: Option<f64>,
    /// Output tokens per second over the level's wall time.
    pub output_tok_per_s: Option<f64>,
    /// Prompt plus output tokens per second over the level's wall time.
    pub total_tok_per_s: Option<f64>,
    /// One stream's decode speed: 1000 / median TPOT.
    pub per_stream_tok_per_s: Option<f64>,
    pub ttft_ms: Latency,
    pub tpot_ms: MedianOnly,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub itl_ms: Option<Latency>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub latency_ms: Option<Latency>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub num_prompts: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub completed: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub errors: Option<u32>,
    /// Requests sent twice because the load generator's pooled connection
    /// was found closed before any response; not errors of the server.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub connection_retries: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub duration_s: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub input_tokens: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub output_tokens: Option<u64>,
    /// `usage` (the server's counts), `counted` (stream chunks with text) or `mixed`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub output_tokens_source: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub interrupted: Option<bool>,
    /// Distinct error messages of this level with how often each occurred.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub error_samples: Vec<ErrorSample>,
    /// Every measured request of this level.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub requests: Vec<RequestRow>,
}

/// An error message and its count.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct ErrorSample {
    pub message: String,
    pub count: u32,
}

/// One measured request.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct RequestRow {
    pub ttft_ms: Option<f64>,
    pub latency_ms: f64,
    pub input_tokens: Option<u32>,
    pub output_tokens: Option<u32>,
    pub error: Option<String>,
    /// Sent a second time after its pooled connection was found closed.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub retried: bool,
}

/// A probe or domain verdict.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    Pass,
    Partial,
    Fail,
    #[default]
    NotTested,
}

impl Verdict {
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Pass => "pass",
            Verdict::Partial => "partial",
            Verdict::Fail => "fail",
            Verdict::NotTested => "not_tested",
        }
    }

    /// A domain's verdict from its probes': probes that were not tested do not
    /// count; all passed is `pass`, all failed is `fail`, anything else `partial`.
    pub fn combine(verdicts: &[Verdict]) -> Verdict {
        let tested: Vec<Verdict> = verdicts
            .iter()
            .copied()
            .filter(|v| *v != Verdict::NotTested)
            .collect();
        if tested.is_empty() {
            Verdict::NotTested
        } else if tested.iter().all(|v| *v == Verdict::Pass) {
            Verdict::Pass
        } else if tested.iter().all(|v| *v == Verdict::Fail) {
            Verdict::Fail
        } else {
            Verdict::Partial
        }
    }
}

/// One capability domain (`tool_calling`, `structured_output`, `reasoning`, ...).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Capability {
    pub domain: String,
    pub verdict: Verdict,
    pub conditions: Value,
    pub probes: Vec<Probe>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub notes: Option<String>,
}

/// One probe and what it showed.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Probe {
    pub name: String,
    pub verdict: Verdict,
    pub latency_ms: Option<f64>,
    pub observed: String,
}

/// `memory`, in the study's units (GiB, bytes per token, tokens).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Memory {
    pub usable_hbm_gib: Option<f64>,
    pub weights_gib: Option<f64>,
    pub kv_cache_gib: Option<f64>,
    pub workspace_gib: Option<f64>,
    pub kv_bytes_per_token: Option<f64>,
    pub resident_kv_tokens: Option<u64>,
    /// The server process's resident memory after the sweep (CPU servers).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resident_memory_gib: Option<f64>,
    pub notes: Option<String>,
}

/// `startup`, in seconds.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Startup {
    pub time_to_healthy_s: Option<f64>,
    pub engine_init_s: Option<f64>,
    pub compile_s: Option<f64>,
    pub notes: Option<String>,
}

/// `cost`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Cost {
    pub per_m_output_tokens: Vec<CostPoint>,
    pub cold_start_usd: Option<f64>,
    pub comparisons: Vec<CostComparison>,
    pub notes: Option<String>,
}

/// Dollars per million output tokens at one operating point.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct CostPoint {
    pub operating_point: String,
    pub output_tok_per_s: f64,
    pub usd: f64,
}

/// A per-token API price to compare with.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct CostComparison {
    pub name: String,
    pub usd_per_m_output_tokens: f64,
    pub source: Option<String>,
    /// Sustained output tokens per second above which the hourly machine is
    /// cheaper than the API.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub breakeven_output_tok_per_s: Option<f64>,
}

/// A known upstream issue.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Issue {
    pub url: Option<String>,
    pub summary: String,
    pub status: Option<String>,
}

/// Today's date (UTC) as `YYYY-MM-DD` and the time as `HHMMSS`, from the system clock.
pub fn utc_date_time() -> (String, String) {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let days = i64::try_from(secs / 86_400).unwrap_or(0);
    let rem = secs % 86_400;
    let (y, m, d) = civil_from_days(days);
    (
        format!("{y:04}-{m:02}-{d:02}"),
        format!("{:02}{:02}{:02}", rem / 3600, rem / 60 % 60, rem % 60),
    )
}

/// The proleptic Gregorian date of a day count since 1970-01-01.
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month as u32, day as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_from_day_counts() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(59), (1970, 3, 1));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
        assert_eq!(civil_from_days(20_655), (2026, 7, 21));
        assert_eq!(civil_from_days(-1), (1969, 12, 31));
    }

    #[test]
    fn verdicts_combine() {
        use Verdict::*;
        assert_eq!(Verdict::combine(&[Pass, Pass]), Pass);
        assert_eq!(Verdict::combine(&[Fail, Partial, Pass]), Partial);
        assert_eq!(Verdict::combine(&[NotTested, Pass]), Pass);
        assert_eq!(Verdict::combine(&[Fail, NotTested]), Fail);
        assert_eq!(Verdict::combine(&[NotTested]), NotTested);
        assert_eq!(Verdict::combine(&[]), NotTested);
    }

    #[test]
    fn the_study_example_loads() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/bench/report-example.json");
        let report = Report::load(&path).map_err(|e| e.to_string());
        let report = match report {
            Ok(r) => r,
            Err(e) => panic!("{e}"),
        };
        assert_eq!(report.schema_version, "1.0");
        assert_eq!(report.throughput.sweep.len(), 5);
        assert_eq!(report.throughput.sweep[0].ttft_ms.median, Some(16.0));
        assert_eq!(report.capabilities[1].probes[0].verdict, Verdict::Fail);
        assert_eq!(report.cost.map(|c| c.per_m_output_tokens.len()), Some(4));
    }
}

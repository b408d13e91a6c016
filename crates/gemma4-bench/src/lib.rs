//! Benchmarking for OpenAI-compatible servers: ours (`gemma4 serve`) and any other.
//!
//! `gemma4 bench serve` drives a concurrency sweep of streaming `/v1/completions`
//! requests, optionally runs capability probes (tool calling, structured output,
//! reasoning) against `/v1/chat/completions`, and records everything in a JSON
//! report (schema version 1.0) that is validated against the JSON Schema shipped
//! in `schema/` before it is written. SVG plots and a Markdown summary come with
//! it, and two reports can be compared side by side.
//!
//! Modules, one job each:
//! - [`run`]: the whole benchmark, from options to a [`report::Report`].
//! - [`loadgen`]: keeps N streaming requests in flight and times them.
//! - [`client`]: the HTTP side: endpoints, streaming completions, chat calls.
//! - [`sse`]: server-sent-event framing and OpenAI stream chunks.
//! - [`prompts`]: random prompts of an exact token length, and JSONL datasets.
//! - [`stats`]: percentiles and the per-level figures.
//! - [`report`]: the report types.
//! - [`schema`]: a validator for the JSON Schema subset the report schema uses.
//! - [`probes`]: capability probes judged by explicit rules.
//! - [`observe`]: what the server and this machine say about themselves.
//! - [`metrics`]: Prometheus text parsing.
//! - [`cost`]: dollars per million output tokens.
//! - [`plots`]: hand-written SVG charts.
//! - [`summary`] and [`compare`]: Markdown tables.

pub mod client;
pub mod compare;
pub mod cost;
pub mod error;
pub mod loadgen;
pub mod metrics;
pub mod observe;
pub mod plots;
pub mod probes;
pub mod prompts;
pub mod report;
pub mod run;
pub mod schema;
pub mod sse;
pub mod stats;
pub mod summary;

pub use error::{BenchError, Result};
pub use report::Report;
pub use run::{parse_concurrency, parse_levels, run_bench, write_outputs, BenchOptions, Dataset};

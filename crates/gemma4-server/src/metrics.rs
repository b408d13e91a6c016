//! `/metrics` in Prometheus text format: HTTP requests by route and status,
//! token counts, time to first token and inter-token latency, and a snapshot
//! of the engine (queue, running sequences, KV blocks, prefix-cache hits,
//! preemptions) and of the process (resident memory) taken at scrape time.
//!
//! Beside ours, the gauges a Kubernetes endpoint picker (llm-d, the Gateway
//! API Inference Extension) reads from every replica, by vLLM's names and
//! meanings and with its `model_name` label, so a fleet of gemma4 servers is
//! routed and scaled as a fleet of vLLM servers would be: among them
//! `vllm:lora_requests_info`, which names the LoRA adapters with running and
//! waiting requests, as the pickers' LoRA affinity reads it.

use std::sync::Mutex;
use std::time::Duration;

use gemma4_engine::{AdapterLoad, EngineStats};
use prometheus::{
    Encoder, Gauge, GaugeVec, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

/// Every metric the server exports.
pub struct Metrics {
    registry: Registry,
    requests: IntCounterVec,
    /// Generation requests per LoRA adapter.
    lora_requests: IntCounterVec,
    finished: IntCounterVec,
    prompt_tokens: IntCounter,
    generation_tokens: IntCounter,
    ttft: Histogram,
    inter_token: Histogram,
    duration: Histogram,
    queue_depth: IntGauge,
    running: IntGauge,
    kv_used: IntGauge,
    kv_sliding_used: IntGauge,
    kv_full_used: IntGauge,
    kv_sliding_peak: IntGauge,
    kv_free: IntGauge,
    kv_block_size: IntGauge,
    kv_cache_bytes: IntGauge,
    resident: IntGauge,
    active_http: IntGauge,
    open_connections: IntGauge,
    refused_connections: IntCounter,
    ready: IntGauge,
    prefix_hits: IntCounter,
    prefix_hit_tokens: IntCounter,
    preemptions: IntCounter,
    step_retries: IntCounter,
    contended_kernel_jobs: IntCounter,
    vllm: VllmGauges,
    /// Serializes mirroring the engine's counters into ours.
    mirror: Mutex<()>,
}

/// What the engine looks like at scrape time.
pub struct EngineSnapshot {
    pub stats: EngineStats,
    pub kv_cache_bytes: usize,
    /// Per LoRA adapter the engine holds.
    pub adapters: Vec<AdapterLoad>,
}

/// The vLLM-named gauges endpoint pickers read.
struct VllmGauges {
    waiting: IntGauge,
    running: IntGauge,
    /// The fraction of KV blocks in use, 0 to 1.
    kv_usage: Gauge,
    /// The same fraction by the name pickers built before vLLM renamed it.
    gpu_cache_usage: Gauge,
    /// 1, with the cache's shape in its labels.
    cache_config: IntGaugeVec,
    /// Speculative decoding: steps that verified drafts, drafted tokens
    /// verified, and those accepted.
    spec_drafts: IntCounter,
    spec_draft_tokens: IntCounter,
    spec_accepted_tokens: IntCounter,
    /// The time of the scrape, under labels naming the adapters with
    /// running and waiting requests (comma-separated) and how many adapters
    /// the server holds: vLLM's one current series.
    lora_info: GaugeVec,
}

impl VllmGauges {
    fn new(r: &Registry, model: &str) -> prometheus::Result<Self> {
        let opts = |name: &str, help: &str| Opts::new(name, help).const_label("model_name", model);
        let register = |c: Box<dyn prometheus::core::Collector>| r.register(c);
        let waiting = IntGauge::with_opts(opts(
            "vllm:num_requests_waiting",
            "Requests waiting to be scheduled (as vLLM counts them)",
        ))?;
        let running = IntGauge::with_opts(opts(
            "vllm:num_requests_running",
            "Requests being generated (as vLLM counts them)",
        ))?;
        let kv_usage = Gauge::with_opts(opts(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage as a fraction: 1 means every block is in use",
        ))?;
        let gpu_cache_usage = Gauge::with_opts(opts(
            "vllm:gpu_cache_usage_perc",
            "KV-cache usage as a fraction (the name older endpoint pickers read)",
        ))?;
        let cache_config = IntGaugeVec::new(
            opts(
                "vllm:cache_config_info",
                "Information of the KV cache: blocks of block_size tokens, num_gpu_blocks in all",
            ),
            &["block_size", "num_gpu_blocks"],
        )?;
        register(Box::new(waiting.clone()))?;
        register(Box::new(running.clone()))?;
        register(Box::new(kv_usage.clone()))?;
        register(Box::new(gpu_cache_usage.clone()))?;
        register(Box::new(cache_config.clone()))?;
        let lora_info = GaugeVec::new(
            opts(
                "vllm:lora_requests_info",
                "Running and waiting requests' LoRA adapters (labels); the value is the time of the update",
            ),
            &["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )?;
        register(Box::new(lora_info.clone()))?;
        let spec_counter = |name: &str, help: &str| -> prometheus::Result<IntCounter> {
            let c = IntCounter::with_opts(opts(name, help))?;
            register(Box::new(c.clone()))?;
            Ok(c)
        };
        Ok(Self {
            waiting,
            running,
            kv_usage,
            gpu_cache_usage,
            cache_config,
            lora_info,
            spec_drafts: spec_counter(
                "vllm:spec_decode_num_drafts_total",
                "Steps that verified drafted tokens (speculative decoding)",
            )?,
            spec_draft_tokens: spec_counter(
                "vllm:spec_decode_num_draft_tokens_total",
                "Drafted tokens verified (speculative decoding)",
            )?,
            spec_accepted_tokens: spec_counter(
                "vllm:spec_decode_num_accepted_tokens_total",
                "Drafted tokens accepted (speculative decoding)",
            )?,
        })
    }

    /// Brings the counters up to the engine's (under the mirror lock).
    fn mirror(&self, s: &EngineStats) {
        let up_to = |c: &IntCounter, v: u64| c.inc_by(v.saturating_sub(c.get()));
        up_to(&self.spec_drafts, s.speculation.drafts);
        up_to(&self.spec_draft_tokens, s.speculation.draft_tokens);
        up_to(&self.spec_accepted_tokens, s.speculation.accepted_tokens);
    }

    /// One series, labelled with the adapters now running and waiting.
    fn set_adapters(&self, adapters: &[AdapterLoad]) {
        let names = |busy: fn(&AdapterLoad) -> bool| {
            adapters
                .iter()
                .filter(|a| busy(a))
                .map(|a| a.name.as_str())
                .collect::<Vec<_>>()
                .join(",")
        };
        let (running, waiting) = (names(|a| a.running > 0), names(|a| a.waiting > 0));
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        self.lora_info.reset();
        self.lora_info
            .with_label_values(&[adapters.len().to_string().as_str(), &running, &waiting])
            .set(now);
    }

    fn set(&self, s: &EngineStats) {
        self.waiting.set(s.waiting as i64);
        self.running.set(s.running as i64);
        let usage = if s.kv_blocks_total == 0 {
            0.0
        } else {
            s.kv_blocks_used as f64 / s.kv_blocks_total as f64
        };
        self.kv_usage.set(usage);
        self.gpu_cache_usage.set(usage);
        // The cache's shape is fixed once the engine runs, so one series.
        let (block_size, blocks) = (s.kv_block_size.to_string(), s.kv_blocks_total.to_string());
        self.cache_config
            .with_label_values(&[block_size.as_str(), blocks.as_str()])
            .set(1);
    }
}

fn gauge(registry: &Registry, name: &str, help: &str) -> prometheus::Result<IntGauge> {
    let g = IntGauge::new(name, help)?;
    registry.register(Box::new(g.clone()))?;
    Ok(g)
}

fn counter(registry: &Registry, name: &str, help: &str) -> prometheus::Result<IntCounter> {
    let c = IntCounter::new(name, help)?;
    registry.register(Box::new(c.clone()))?;
    Ok(c)
}

fn histogram(
    registry: &Registry,
    name: &str,
    help: &str,
    buckets: Vec<f64>,
) -> prometheus::Result<Histogram> {
    let h = Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets))?;
    registry.register(Box::new(h.clone()))?;
    Ok(h)
}

fn counter_vec(
    registry: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> prometheus::Result<IntCounterVec> {
    let c = IntCounterVec::new(Opts::new(name, help), labels)?;
    registry.register(Box::new(c.clone()))?;
    Ok(c)
}

const LATENCY_BUCKETS: [f64; 16] = [
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];
const DURATION_BUCKETS: [f64; 12] = [
    0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];

impl Metrics {
    /// Every metric, the vLLM-named ones labelled with `model_name`.
    pub fn new(model_name: &str) -> prometheus::Result<Self> {
        let r = Registry::new();
        Ok(Self {
            vllm: VllmGauges::new(&r, model_name)?,
            requests: counter_vec(
                &r,
                "gemma4_http_requests_total",
                "HTTP requests by route and status code",
                &["route", "status"],
            )?,
            lora_requests: counter_vec(
                &r,
                "gemma4_lora_requests_total",
                "Generation requests run with each LoRA adapter",
                &["adapter"],
            )?,
            finished: counter_vec(
                &r,
                "gemma4_requests_finished_total",
                "Generation requests by finish reason",
                &["reason"],
            )?,
            prompt_tokens: counter(
                &r,
                "gemma4_prompt_tokens_total",
                "Prompt tokens of finished generation requests",
            )?,
            generation_tokens: counter(&r, "gemma4_generation_tokens_total", "Generated tokens")?,
            ttft: histogram(
                &r,
                "gemma4_time_to_first_token_seconds",
                "From arrival of the request to its first generated token",
                LATENCY_BUCKETS.to_vec(),
            )?,
            inter_token: histogram(
                &r,
                "gemma4_inter_token_latency_seconds",
                "Time between consecutive generated tokens of a request",
                LATENCY_BUCKETS.to_vec(),
            )?,
            duration: histogram(
                &r,
                "gemma4_request_duration_seconds",
                "From arrival of a generation request to its last token",
                DURATION_BUCKETS.to_vec(),
            )?,
            queue_depth: gauge(
                &r,
                "gemma4_queue_depth",
                "Requests waiting for a sequence slot",
            )?,
            running: gauge(&r, "gemma4_running_sequences", "Sequences being generated")?,
            kv_used: gauge(
                &r,
                "gemma4_kv_blocks_used",
                "KV-cache blocks in use (all cache groups)",
            )?,
            kv_sliding_used: gauge(
                &r,
                "gemma4_kv_sliding_blocks_used",
                "KV-cache blocks in use by sliding-window layers",
            )?,
            kv_full_used: gauge(
                &r,
                "gemma4_kv_full_blocks_used",
                "KV-cache blocks in use by full-attention layers",
            )?,
            kv_sliding_peak: gauge(
                &r,
                "gemma4_kv_sliding_blocks_per_sequence_peak",
                "Most sliding-window blocks one sequence has held at once",
            )?,
            kv_free: gauge(
                &r,
                "gemma4_kv_blocks_free",
                "KV-cache blocks free (all cache groups)",
            )?,
            kv_block_size: gauge(
                &r,
                "gemma4_kv_block_size_tokens",
                "Tokens per KV-cache block",
            )?,
            kv_cache_bytes: gauge(
                &r,
                "gemma4_kv_cache_bytes",
                "Memory allocated to the KV cache",
            )?,
            resident: gauge(
                &r,
                "gemma4_resident_memory_bytes",
                "Resident memory of the server process",
            )?,
            active_http: gauge(
                &r,
                "gemma4_active_http_requests",
                "Requests being handled, streams included",
            )?,
            open_connections: gauge(
                &r,
                "gemma4_open_connections",
                "Open HTTP connections (at most --max-connections)",
            )?,
            refused_connections: counter(
                &r,
                "gemma4_refused_connections_total",
                "Connections refused with 503 because --max-connections were open",
            )?,
            ready: gauge(
                &r,
                "gemma4_ready",
                "1 when the model is loaded and requests are admitted",
            )?,
            prefix_hits: counter(
                &r,
                "gemma4_prefix_cache_hits_total",
                "Sequences admitted with a prompt prefix reused from the prefix cache",
            )?,
            prefix_hit_tokens: counter(
                &r,
                "gemma4_prefix_cache_hit_tokens_total",
                "Prompt tokens whose KV was reused from the prefix cache",
            )?,
            preemptions: counter(
                &r,
                "gemma4_preemptions_total",
                "Sequences preempted to free KV-cache blocks",
            )?,
            step_retries: counter(
                &r,
                "gemma4_engine_step_retries_total",
                "Model steps that failed as a batch and were rerun one sequence at a time",
            )?,
            contended_kernel_jobs: counter(
                &r,
                "gemma4_kernel_pool_contended_jobs_total",
                "Kernel jobs that found the thread pool busy (a media encoder beside a model step) and ran on one thread",
            )?,
            mirror: Mutex::new(()),
            registry: r,
        })
    }

    pub fn record_request(&self, route: &str, status: u16) {
        self.requests
            .with_label_values(&[route, &status.to_string()])
            .inc();
    }

    pub fn connection_opened(&self) {
        self.open_connections.inc();
    }

    pub fn connection_closed(&self) {
        self.open_connections.dec();
    }

    pub fn record_refused_connection(&self) {
        self.refused_connections.inc();
    }

    pub fn record_first_token(&self, since_arrival: Duration) {
        self.ttft.observe(since_arrival.as_secs_f64());
    }

    pub fn record_inter_token(&self, gap: Duration) {
        self.inter_token.observe(gap.as_secs_f64());
    }

    pub fn record_finished(
        &self,
        reason: &str,
        prompt_tokens: usize,
        completion_tokens: usize,
        duration: Duration,
    ) {
        self.finished.with_label_values(&[reason]).inc();
        self.prompt_tokens.inc_by(prompt_tokens as u64);
        self.generation_tokens.inc_by(completion_tokens as u64);
        self.duration.observe(duration.as_secs_f64());
    }

    /// Tokens generated by finished requests since the server started.
    pub fn generated_tokens(&self) -> u64 {
        self.generation_tokens.get()
    }

    /// Decode speed of one stream since the server started (tokens per
    /// second, from the gaps between tokens); `None` before the second token.
    pub fn stream_decode_rate(&self) -> Option<f64> {
        let (gaps, seconds) = (
            self.inter_token.get_sample_count(),
            self.inter_token.get_sample_sum(),
        );
        (gaps > 0 && seconds > 0.0).then(|| gaps as f64 / seconds)
    }

    /// The text exposition, after refreshing the gauges.
    pub fn render(
        &self,
        engine: Option<EngineSnapshot>,
        active_http: usize,
        ready: bool,
    ) -> String {
        self.active_http.set(active_http as i64);
        self.ready.set(i64::from(ready));
        if let Some(rss) = resident_memory_bytes() {
            self.resident.set(rss as i64);
        }
        if let Some(e) = engine {
            let s = e.stats;
            self.queue_depth.set(s.waiting as i64);
            self.running.set(s.running as i64);
            self.kv_used.set(s.kv_blocks_used as i64);
            self.kv_sliding_used.set(s.kv_sliding_blocks_used as i64);
            self.kv_full_used.set(s.kv_full_blocks_used as i64);
            self.kv_sliding_peak
                .set(s.kv_sliding_blocks_per_seq_peak as i64);
            self.kv_free
                .set(s.kv_blocks_total.saturating_sub(s.kv_blocks_used) as i64);
            self.kv_block_size.set(s.kv_block_size as i64);
            self.kv_cache_bytes.set(e.kv_cache_bytes as i64);
            self.vllm.set(&s);
            if !e.adapters.is_empty() {
                self.vllm.set_adapters(&e.adapters);
            }
            if let Ok(_lock) = self.mirror.lock() {
                for a in &e.adapters {
                    let c = self.lora_requests.with_label_values(&[a.name.as_str()]);
                    c.inc_by(a.requests.saturating_sub(c.get()));
                }
                self.prefix_hits
                    .inc_by(s.prefix_cache_hits.saturating_sub(self.prefix_hits.get()));
                self.prefix_hit_tokens.inc_by(
                    s.prefix_cache_hit_tokens
                        .saturating_sub(self.prefix_hit_tokens.get()),
                );
                self.preemptions
                    .inc_by(s.preemptions.saturating_sub(self.preemptions.get()));
                self.step_retries
                    .inc_by(s.step_retries.saturating_sub(self.step_retries.get()));
                self.contended_kernel_jobs.inc_by(
                    s.contended_kernel_jobs
                        .saturating_sub(self.contended_kernel_jobs.get()),
                );
                self.vllm.mirror(&s);
            }
        }
        let mut out = Vec::new();
        if let Err(e) = TextEncoder::new().encode(&self.registry.gather(), &mut out) {
            tracing::warn!("cannot encode metrics: {e}");
        }
        String::from_utf8_lossy(&out).into_owned()
    }
}

/// Resident set size from `/proc/self/statm` (Linux); `None` elsewhere.
fn resident_memory_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * page_size())
}

fn page_size() -> u64 {
    // SAFETY: sysconf only reads a system constant; it has no preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(size).ok().filter(|&s| s > 0).unwrap_or(4096)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposition_has_every_family() {
        let m = Metrics::new("gemma4").expect("metrics register");
        m.record_request("/v1/completions", 200);
        m.record_first_token(Duration::from_millis(5));
        m.record_inter_token(Duration::from_millis(2));
        m.record_finished("stop", 7, 3, Duration::from_millis(30));
        let stats = EngineStats {
            running: 2,
            waiting: 1,
            kv_blocks_total: 10,
            kv_blocks_used: 4,
            kv_sliding_blocks_used: 3,
            kv_full_blocks_used: 1,
            kv_block_size: 16,
            prefix_cache_hits: 5,
            preemptions: 1,
            speculation: gemma4_engine::DraftCounts {
                drafts: 3,
                draft_tokens: 9,
                accepted_tokens: 7,
            },
            ..Default::default()
        };
        let adapters = vec![
            AdapterLoad {
                name: "tone".into(),
                running: 1,
                waiting: 0,
                requests: 4,
            },
            AdapterLoad {
                name: "legal".into(),
                running: 1,
                waiting: 2,
                requests: 3,
            },
            AdapterLoad {
                name: "idle".into(),
                ..AdapterLoad::default()
            },
        ];
        let text = m.render(
            Some(EngineSnapshot {
                stats,
                kv_cache_bytes: 1024,
                adapters: adapters.clone(),
            }),
            1,
            true,
        );
        for needle in [
            "gemma4_http_requests_total{route=\"/v1/completions\",status=\"200\"} 1",
            "gemma4_prompt_tokens_total 7",
            "gemma4_generation_tokens_total 3",
            "gemma4_time_to_first_token_seconds_count 1",
            "gemma4_inter_token_latency_seconds_count 1",
            "gemma4_queue_depth 1",
            "gemma4_running_sequences 2",
            "gemma4_kv_blocks_used 4",
            "gemma4_kv_blocks_free 6",
            "gemma4_kv_sliding_blocks_used 3",
            "gemma4_kv_full_blocks_used 1",
            "gemma4_prefix_cache_hits_total 5",
            "gemma4_preemptions_total 1",
            "gemma4_resident_memory_bytes",
            "gemma4_open_connections 0",
            "gemma4_refused_connections_total 0",
            "vllm:num_requests_waiting{model_name=\"gemma4\"} 1",
            "vllm:spec_decode_num_drafts_total{model_name=\"gemma4\"} 3",
            "vllm:spec_decode_num_draft_tokens_total{model_name=\"gemma4\"} 9",
            "vllm:spec_decode_num_accepted_tokens_total{model_name=\"gemma4\"} 7",
            "vllm:num_requests_running{model_name=\"gemma4\"} 2",
            "vllm:kv_cache_usage_perc{model_name=\"gemma4\"} 0.4",
            "vllm:gpu_cache_usage_perc{model_name=\"gemma4\"} 0.4",
            "vllm:cache_config_info{block_size=\"16\",model_name=\"gemma4\",num_gpu_blocks=\"10\"} 1",
            "vllm:lora_requests_info{max_lora=\"3\",model_name=\"gemma4\",running_lora_adapters=\"tone,legal\",waiting_lora_adapters=\"legal\"} ",
            "gemma4_lora_requests_total{adapter=\"tone\"} 4",
            "gemma4_lora_requests_total{adapter=\"legal\"} 3",
        ] {
            assert!(text.contains(needle), "missing {needle} in\n{text}");
        }
        // Mirrored counters follow the engine's totals, not the number of scrapes.
        let text = m.render(
            Some(EngineSnapshot {
                stats,
                kv_cache_bytes: 1024,
                adapters,
            }),
            0,
            true,
        );
        assert!(text.contains("gemma4_prefix_cache_hits_total 5"));
        assert!(text.contains("gemma4_lora_requests_total{adapter=\"tone\"} 4"));
        // One current series: the labels of the last scrape only.
        assert_eq!(text.matches("vllm:lora_requests_info{").count(), 1);
    }

    #[test]
    fn resident_memory_is_plausible() {
        if let Some(rss) = resident_memory_bytes() {
            assert!(rss > 1 << 20, "rss {rss}");
        }
    }
}

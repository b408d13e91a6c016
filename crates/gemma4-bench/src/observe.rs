//! What can be observed about the server and this machine: `/v1/models`,
//! `/version` (vLLM), `/props` (llama.cpp), `/metrics` (Prometheus text) and
//! `/proc`. Whatever is not observed stays `None` (written as null).

use std::time::Duration;

use serde_json::Value;

use crate::client::Endpoint;
use crate::metrics::{self, Sample};
use crate::report::{Host, Memory, Model, Software, Startup};
use crate::stats::round;

const INFO_TIMEOUT: Duration = Duration::from_secs(10);
const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// The server's self-description, gathered once.
#[derive(Debug, Clone, Default)]
pub struct ServerInfo {
    /// The `/v1/models` entry for the benchmarked model (or the only one).
    pub model_card: Option<Value>,
    /// Model ids the server lists.
    pub listed_models: Vec<String>,
    /// Why `/v1/models` could not be read, if it could not.
    pub models_error: Option<String>,
    pub version: Option<Value>,
    pub props: Option<Value>,
    pub metrics: Vec<Sample>,
}

impl ServerInfo {
    /// Asks the server; every part is optional and failures only leave gaps.
    pub async fn gather(endpoint: &Endpoint, model: &str) -> Self {
        let mut info = ServerInfo::default();
        match endpoint.get_json("v1/models", INFO_TIMEOUT).await {
            Ok(list) => {
                let cards: Vec<Value> = list
                    .get("data")
                    .and_then(Value::as_array)
                    .cloned()
                    .unwrap_or_default();
                info.listed_models = cards
                    .iter()
                    .filter_map(|c| c.get("id").and_then(Value::as_str).map(str::to_owned))
                    .collect();
                info.model_card = cards
                    .iter()
                    .find(|c| c.get("id").and_then(Value::as_str) == Some(model))
                    .or_else(|| (cards.len() == 1).then(|| cards.first()).flatten())
                    .cloned();
            }
            Err(e) => info.models_error = Some(e.to_string()),
        }
        info.version = endpoint
            .get_json("version", INFO_TIMEOUT)
            .await
            .ok()
            .filter(|v| v.get("version").is_some());
        info.props = endpoint
            .get_json("props", INFO_TIMEOUT)
            .await
            .ok()
            .filter(Value::is_object);
        info.metrics = metrics_of(endpoint).await;
        info
    }

    fn owned_by(&self) -> Option<&str> {
        self.model_card.as_ref()?.get("owned_by")?.as_str()
    }

    /// The serving engine, recognised from what it says about itself.
    pub fn engine(&self) -> Option<String> {
        let has_gemma4_metrics = self.metrics.iter().any(|s| s.name.starts_with("gemma4_"));
        let has_vllm_metrics = self.metrics.iter().any(|s| s.name.starts_with("vllm:"));
        match self.owned_by() {
            Some("gemma4") => Some("gemma4".to_owned()),
            Some("vllm") => Some("vllm".to_owned()),
            Some("llamacpp") => Some("llama.cpp".to_owned()),
            _ if has_gemma4_metrics => Some("gemma4".to_owned()),
            _ if has_vllm_metrics => Some("vllm".to_owned()),
            _ if self
                .props
                .as_ref()
                .is_some_and(|p| p.get("build_info").is_some()) =>
            {
                Some("llama.cpp".to_owned())
            }
            Some(other)
                if !other.is_empty() && other != "system" && other != "organization-owner" =>
            {
                Some(other.to_owned())
            }
            _ => None,
        }
    }

    /// The `software` block.
    pub fn software(&self) -> Software {
        let version = self
            .version
            .as_ref()
            .and_then(|v| v.get("version"))
            .and_then(Value::as_str)
            .or_else(|| self.props.as_ref()?.get("build_info")?.as_str())
            .map(str::to_owned);
        Software {
            engine: self.engine(),
            version,
            ..Software::default()
        }
    }

    /// The `model` block for `id`.
    pub fn model(&self, id: &str) -> Model {
        let card = self.model_card.as_ref();
        let max_model_len = card
            .and_then(|c| c.get("max_model_len"))
            .and_then(Value::as_u64)
            .or_else(|| card?.get("meta")?.get("n_ctx_train")?.as_u64())
            .or_else(|| {
                let p = self.props.as_ref()?;
                p.get("n_ctx")
                    .or_else(|| p.get("default_generation_settings")?.get("n_ctx"))?
                    .as_u64()
            });
        let parameters_b = card
            .and_then(|c| c.get("meta")?.get("n_params")?.as_f64())
            .and_then(|n| round(n / 1e9, 2));
        let lower = id.to_lowercase();
        let family = if lower.contains("gemma-4") || lower.contains("gemma4") {
            Some("gemma-4".to_owned())
        } else {
            None
        };
        Model {
            id: Some(id.to_owned()),
            family,
            parameters_b,
            max_model_len,
            ..Model::default()
        }
    }
}

/// The samples of `/metrics`, or none when it is absent or not Prometheus text.
pub async fn metrics_of(endpoint: &Endpoint) -> Vec<Sample> {
    match endpoint.get_text("metrics", INFO_TIMEOUT).await {
        Ok(text) => metrics::parse(&text),
        Err(_) => Vec::new(),
    }
}

/// The `memory` block from metrics (ours: `gemma4_*`; vLLM's cache info), or
/// `None` when the server exposes nothing about memory.
pub fn memory(samples: &[Sample]) -> Option<Memory> {
    let mut m = Memory {
        kv_cache_gib: metrics::value(samples, "gemma4_kv_cache_bytes")
            .and_then(|b| round(b / GIB, 3)),
        resident_memory_gib: metrics::first_of(
            samples,
            &[
                "gemma4_resident_memory_bytes",
                "process_resident_memory_bytes",
            ],
        )
        .and_then(|b| round(b / GIB, 3)),
        weights_gib: metrics::value(samples, "gemma4_weights_bytes")
            .and_then(|b| round(b / GIB, 3)),
        kv_bytes_per_token: metrics::value(samples, "gemma4_kv_bytes_per_token"),
        resident_kv_tokens: metrics::value(samples, "gemma4_kv_capacity_tokens").map(|t| t as u64),
        ..Memory::default()
    };
    let mut notes = Vec::new();
    let used = metrics::value(samples, "gemma4_kv_blocks_used");
    let free = metrics::value(samples, "gemma4_kv_blocks_free");
    let block = metrics::value(samples, "gemma4_kv_block_size_tokens");
    if let (Some(used), Some(free)) = (used, free) {
        let size = block.map(|b| format!(" of {b} tokens")).unwrap_or_default();
        notes.push(format!(
            "KV blocks after the sweep: {used} used, {free} free (all cache groups), blocks{size}"
        ));
    }
    if let Some(info) = samples.iter().find(|s| s.name == "vllm:cache_config_info") {
        let num = |k: &str| info.label(k).and_then(|v| v.parse::<u64>().ok());
        if let (Some(blocks), Some(size)) = (num("num_gpu_blocks"), num("block_size")) {
            m.resident_kv_tokens = Some(blocks * size);
        }
        if let Some(dtype) = info.label("cache_dtype") {
            notes.push(format!("vLLM KV cache dtype: {dtype}"));
        }
    }
    if m.resident_memory_gib.is_some() {
        notes.push("resident_memory_gib is the server process's RSS from /metrics".to_owned());
    }
    let observed = m.kv_cache_gib.is_some()
        || m.resident_memory_gib.is_some()
        || m.weights_gib.is_some()
        || m.kv_bytes_per_token.is_some()
        || m.resident_kv_tokens.is_some()
        || !notes.is_empty();
    if !observed {
        return None;
    }
    m.notes = (!notes.is_empty()).then(|| notes.join("; "));
    Some(m)
}

/// The `startup` block from metrics, when the server reports load times.
pub fn startup(samples: &[Sample]) -> Option<Startup> {
    let s = Startup {
        time_to_healthy_s: metrics::first_of(
            samples,
            &["gemma4_startup_seconds", "gemma4_time_to_ready_seconds"],
        ),
        engine_init_s: metrics::value(samples, "gemma4_engine_init_seconds"),
        compile_s: metrics::value(samples, "gemma4_compile_seconds"),
        notes: None,
    };
    (s.time_to_healthy_s.is_some() || s.engine_init_s.is_some() || s.compile_s.is_some())
        .then_some(s)
}

/// This machine's CPU, memory and OS from `/proc` and `/etc/os-release`.
pub fn this_host(server_on_this_host: bool) -> Host {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu_model = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim().to_owned());
    let cpu_cores = std::thread::available_parallelism()
        .ok()
        .and_then(|n| u32::try_from(n.get()).ok());
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let memory_gib = meminfo
        .lines()
        .find(|l| l.starts_with("MemTotal:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse::<f64>().ok())
        .and_then(|kb| round(kb * 1024.0 / GIB, 2));
    let os = std::fs::read_to_string("/etc/os-release")
        .ok()
        .and_then(|text| {
            text.lines()
                .find_map(|l| l.strip_prefix("PRETTY_NAME="))
                .map(|v| v.trim_matches('"').to_owned())
        });
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .ok()
        .map(|k| k.trim().to_owned())
        .filter(|k| !k.is_empty());
    Host {
        server_on_this_host: Some(server_on_this_host),
        cpu_model,
        cpu_cores,
        memory_gib,
        os,
        kernel,
        ..Host::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn our_metrics_fill_memory() {
        let samples = metrics::parse(
            "gemma4_kv_blocks_used 3\ngemma4_kv_blocks_free 61\ngemma4_kv_block_size_tokens 16\n\
             gemma4_kv_cache_bytes 1073741824\ngemma4_resident_memory_bytes 2147483648\n",
        );
        let m = memory(&samples);
        assert_eq!(m.as_ref().and_then(|m| m.kv_cache_gib), Some(1.0));
        assert_eq!(m.as_ref().and_then(|m| m.resident_memory_gib), Some(2.0));
        assert_eq!(
            m.as_ref().and_then(|m| m.resident_kv_tokens),
            None,
            "not derivable across cache groups"
        );
        assert!(m
            .and_then(|m| m.notes)
            .is_some_and(|n| n.contains("3 used")));
        assert!(memory(&[]).is_none());
        assert!(startup(&samples).is_none());
    }

    #[test]
    fn vllm_cache_info_gives_kv_tokens() {
        let samples = metrics::parse("vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"1000\",cache_dtype=\"fp8_e5m2\"} 1\n");
        let m = memory(&samples);
        assert_eq!(m.as_ref().and_then(|m| m.resident_kv_tokens), Some(16_000));
    }

    #[test]
    fn engines_are_recognised() {
        let mut info = ServerInfo {
            model_card: Some(json!({"id": "m", "owned_by": "vllm", "max_model_len": 4096})),
            ..ServerInfo::default()
        };
        assert_eq!(info.engine().as_deref(), Some("vllm"));
        assert_eq!(
            info.model("google/gemma-4-E2B-it").max_model_len,
            Some(4096)
        );
        assert_eq!(
            info.model("google/gemma-4-E2B-it").family.as_deref(),
            Some("gemma-4")
        );
        assert_eq!(info.model("other").family, None);
        info.model_card = Some(
            json!({"id": "m", "owned_by": "llamacpp", "meta": {"n_params": 2_000_000_000u64}}),
        );
        assert_eq!(info.engine().as_deref(), Some("llama.cpp"));
        assert_eq!(info.model("m").parameters_b, Some(2.0));
        info.model_card = None;
        assert_eq!(info.engine(), None);
    }

    #[test]
    fn this_machine_is_described() {
        let host = this_host(true);
        assert_eq!(host.server_on_this_host, Some(true));
        if std::path::Path::new("/proc/meminfo").exists() {
            assert!(host.memory_gib.is_some_and(|g| g > 0.0));
        }
        assert!(host.cpu_cores.is_some_and(|c| c > 0));
    }
}

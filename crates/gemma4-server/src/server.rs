//! The server object: its state (loading, ready, draining), the loaded model
//! with its chat template and stop tokens, and the router.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::Router;
use gemma4_engine::EngineHandle;
use gemma4_text::{ChatTemplate, TextError};
use serde_json::json;
use tower_http::cors::{AllowOrigin, CorsLayer};

use crate::config::ServerConfig;
use crate::drain::{Active, ActiveGuard};
use crate::error::ApiError;
use crate::grammar::Grammars;
use crate::metrics::{EngineSnapshot, Metrics};
use crate::routes;

/// How often the server looks at the engine's health.
const ENGINE_POLL: Duration = Duration::from_millis(100);

/// An admitted request: its body, the model, its place in the drain, and
/// when it arrived.
pub struct Admitted {
    pub bytes: axum::body::Bytes,
    pub model: Arc<ModelContext>,
    pub guard: ActiveGuard,
    pub arrival: std::time::Instant,
}

/// What the served checkpoint is, as model listings show it.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    /// `gguf` or `safetensors`.
    pub format: String,
    /// The config's `model_type` (`gemma4`, `gemma3`, …).
    pub family: String,
    /// The weights' bytes on disk.
    pub size_bytes: u64,
    /// When the weights were written.
    pub modified: std::time::SystemTime,
}

impl Default for ModelInfo {
    fn default() -> Self {
        Self {
            format: String::new(),
            family: String::new(),
            size_bytes: 0,
            modified: UNIX_EPOCH,
        }
    }
}

/// What a loaded model can be asked for, as listings and the chat page show it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities {
    /// It has a chat template.
    pub chat: bool,
    /// Its template declares tools.
    pub tools: bool,
    /// Its template can open a thought channel (`enable_thinking`).
    pub thinking: bool,
    /// It has a vision encoder (images and video).
    pub images: bool,
    /// It has an audio encoder.
    pub audio: bool,
}

/// A loaded model, ready to serve.
pub struct ModelContext {
    pub engine: EngineHandle,
    /// The chat template, or why chat requests cannot be served (shown to clients).
    pub chat_template: Result<ChatTemplate, String>,
    /// Default stop tokens: the tokenizer's stop tokens plus the model config's EOS ids.
    pub stop_token_ids: Vec<u32>,
    /// The grammar compiler, built on the first structured-output request.
    grammars: OnceLock<Result<Grammars, String>>,
    /// The checkpoint's media encoders, when it has any (image and audio
    /// parts are refused otherwise).
    pub media: Option<Arc<crate::media::Media>>,
    pub info: ModelInfo,
}

impl ModelContext {
    /// `config_eos_ids` are the model config's `eos_token_id`s; a missing chat
    /// template is kept as an error for chat requests, not a startup failure.
    pub fn new(
        engine: EngineHandle,
        chat_template: Result<ChatTemplate, TextError>,
        config_eos_ids: &[u32],
    ) -> Self {
        let mut stop_token_ids = engine.tokenizer().stop_token_ids();
        for &id in config_eos_ids {
            if !stop_token_ids.contains(&id) {
                stop_token_ids.push(id);
            }
        }
        Self {
            engine,
            chat_template: chat_template.map_err(|e| e.to_string()),
            stop_token_ids,
            grammars: OnceLock::new(),
            media: None,
            info: ModelInfo::default(),
        }
    }

    /// Describes the checkpoint for model listings.
    pub fn with_info(mut self, info: ModelInfo) -> Self {
        self.info = info;
        self
    }

    /// Serves images and audio with these encoders and settings.
    pub fn with_media(mut self, media: crate::media::Media) -> Self {
        self.media = Some(Arc::new(media));
        self
    }

    /// The grammar compiler for this model's vocabulary (slow the first time:
    /// call it on the blocking pool).
    pub fn grammars(&self) -> Result<&Grammars, ApiError> {
        self.grammars
            .get_or_init(|| Grammars::new(self.engine.tokenizer().clone()))
            .as_ref()
            .map_err(|e| ApiError::internal(format!("structured output is unavailable: {e}")))
    }

    pub fn capabilities(&self) -> Capabilities {
        let template = self.chat_template.as_ref().ok().map(|t| t.source());
        let facts = self.media.as_ref().map(|m| &m.facts);
        Capabilities {
            chat: template.is_some(),
            tools: template.is_some_and(|t| t.contains("tools")),
            thinking: template.is_some_and(|t| t.contains("enable_thinking")),
            images: facts.is_some_and(|f| f.image.is_some()),
            audio: facts.is_some_and(|f| f.audio.is_some()),
        }
    }

    pub fn max_model_len(&self) -> usize {
        self.engine.config().max_model_len
    }
}

/// Where the server is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Loading,
    Ready,
    Draining,
    /// The engine failed and cannot recover; the process is about to exit.
    Failed,
}

impl Phase {
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Loading => "loading",
            Phase::Ready => "ready",
            Phase::Draining => "draining",
            Phase::Failed => "failed",
        }
    }
}

/// State shared by all handlers.
pub struct AppState {
    pub config: ServerConfig,
    pub metrics: Metrics,
    pub created: u64,
    model: OnceLock<Arc<ModelContext>>,
    draining: AtomicBool,
    active: Arc<Active>,
    next_id: AtomicU64,
    /// Cancelled once the drain has let running requests finish: ends the
    /// streams that outlive requests (MCP sessions' event streams).
    pub(crate) closing: tokio_util::sync::CancellationToken,
}

impl AppState {
    /// A request's body, within the configured size limit and read deadline.
    pub async fn read_body(&self, body: axum::body::Body) -> Result<axum::body::Bytes, ApiError> {
        crate::admission::read_body(
            body,
            self.config.max_body_bytes,
            self.config.body_read_timeout,
        )
        .await
    }

    /// A generating request's body read in full, then the request admitted:
    /// it counts as running (and holds a drain) only once its body is in.
    pub async fn admit_body(&self, body: axum::body::Body) -> Result<Admitted, ApiError> {
        let arrival = std::time::Instant::now();
        let bytes = self.read_body(body).await?;
        let (model, guard) = self.admit()?;
        Ok(Admitted {
            bytes,
            model,
            guard,
            arrival,
        })
    }

    pub fn phase(&self) -> Phase {
        if self.engine_failure().is_some() {
            Phase::Failed
        } else if self.draining.load(Ordering::SeqCst) {
            Phase::Draining
        } else if self.model.get().is_some() {
            Phase::Ready
        } else {
            Phase::Loading
        }
    }

    /// Why the engine cannot go on, if it cannot.
    pub fn engine_failure(&self) -> Option<String> {
        self.model.get().and_then(|m| m.engine.health().err())
    }

    /// Liveness, `/health`: 200 while the process can go on (loading,
    /// ready or draining), 503 with the reason once the engine has failed,
    /// the one state a restart mends.
    pub fn health(&self) -> (StatusCode, serde_json::Value) {
        self.probe(|phase| phase != Phase::Failed)
    }

    /// Readiness, `/ready`: 200 only while requests are admitted (loaded,
    /// engine healthy, not draining); 503 otherwise, so a load balancer
    /// sends nothing to a replica that is loading or shutting down.
    pub fn ready(&self) -> (StatusCode, serde_json::Value) {
        self.probe(|phase| phase == Phase::Ready)
    }

    fn probe(&self, passes: impl Fn(Phase) -> bool) -> (StatusCode, serde_json::Value) {
        let phase = self.phase();
        let mut body = json!({ "status": phase.as_str(), "model": self.config.served_model_name });
        if let Some(reason) = self.engine_failure() {
            body["reason"] = reason.into();
        }
        let status = if passes(phase) {
            StatusCode::OK
        } else {
            StatusCode::SERVICE_UNAVAILABLE
        };
        (status, body)
    }

    pub fn model(&self) -> Option<&Arc<ModelContext>> {
        self.model.get()
    }

    /// Admits a request for the model: 503 while loading or draining.
    pub fn admit(&self) -> Result<(Arc<ModelContext>, ActiveGuard), ApiError> {
        let guard = self.active.enter();
        match (self.phase(), self.model.get()) {
            (Phase::Ready, Some(model)) => Ok((model.clone(), guard)),
            (Phase::Draining, _) => Err(draining()),
            (Phase::Failed, _) => Err(ApiError::unavailable(
                format!(
                    "{}; the server is exiting",
                    self.engine_failure().unwrap_or_default()
                ),
                "engine_failed",
            )),
            _ => Err(ApiError::unavailable(
                "the model is still loading; retry when GET /ready returns 200",
                "model_loading",
            )),
        }
    }

    /// A new response id such as `chatcmpl-…`.
    pub fn response_id(&self, prefix: &str) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        format!("{prefix}-{:x}{n:06x}", self.created)
    }

    /// The `/metrics` text.
    pub fn render_metrics(&self) -> String {
        let engine = self.model.get().map(|m| EngineSnapshot {
            stats: m.engine.stats(),
            kv_cache_bytes: m.engine.kv_plan().total_bytes,
            adapters: m.engine.adapter_load(),
        });
        self.metrics
            .render(engine, self.active.count(), self.phase() == Phase::Ready)
    }
}

pub fn draining() -> ApiError {
    ApiError::unavailable(
        "the server is shutting down and accepts no new requests; retry against another instance",
        "server_draining",
    )
}

/// An OpenAI-compatible server for one model. Cheap to clone.
#[derive(Clone)]
pub struct Server {
    state: Arc<AppState>,
}

impl Server {
    /// A server whose `/ready` answers 503 "loading" until [`Server::set_ready`].
    pub fn new(config: ServerConfig) -> Result<Self, prometheus::Error> {
        let created = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let metrics = Metrics::new(&config.served_model_name)?;
        Ok(Self {
            state: Arc::new(AppState {
                config,
                metrics,
                created,
                model: OnceLock::new(),
                draining: AtomicBool::new(false),
                active: Arc::new(Active::default()),
                next_id: AtomicU64::new(1),
                closing: tokio_util::sync::CancellationToken::new(),
            }),
        })
    }

    pub fn config(&self) -> &ServerConfig {
        &self.state.config
    }

    /// Installs the loaded model and starts admitting requests. Logs the model,
    /// its KV plan and a ready line. A second call is ignored.
    pub fn set_ready(&self, model: ModelContext) {
        let plan = model.engine.kv_plan();
        let engine = model.engine.config();
        for (kind, layers, bytes_per_token, blocks) in &plan.groups {
            tracing::info!(
                group = %kind,
                layers,
                bytes_per_token,
                blocks,
                "KV cache group"
            );
        }
        tracing::info!(
            block_size = plan.block_size,
            total_mib = format_args!("{:.1}", plan.total_bytes as f64 / (1024.0 * 1024.0)),
            max_model_len = engine.max_model_len,
            max_num_seqs = engine.max_num_seqs,
            max_queue = engine.max_queue,
            "KV cache plan"
        );
        if let Err(why) = &model.chat_template {
            tracing::warn!("chat completions are disabled: {why}");
        }
        if self.state.model.set(Arc::new(model)).is_ok() {
            tracing::info!(model = %self.state.config.served_model_name, "ready");
        }
    }

    /// Stops admitting requests; running ones continue.
    pub fn begin_drain(&self) {
        self.state.draining.store(true, Ordering::SeqCst);
        if let Some(m) = self.state.model.get() {
            m.engine.start_draining();
        }
    }

    pub fn phase(&self) -> Phase {
        self.state.phase()
    }

    /// Ends every request the engine runs or queues; their responses end with an error.
    pub fn cancel_running(&self) {
        if let Some(m) = self.state.model.get() {
            m.engine.cancel_all();
        }
    }

    /// Ends the streams that outlive requests (MCP sessions), so that their
    /// connections close at once.
    pub fn close_streams(&self) {
        self.state.closing.cancel();
    }

    /// Requests being handled, response streams included.
    pub fn active_requests(&self) -> usize {
        self.state.active.count()
    }

    /// Resolves once the engine has failed beyond recovery, with the reason.
    pub async fn engine_failed(&self) -> String {
        loop {
            if let Some(reason) = self.state.engine_failure() {
                return reason;
            }
            tokio::time::sleep(ENGINE_POLL).await;
        }
    }

    /// Waits until no request is being handled, or `limit` passes; true when idle.
    pub async fn wait_idle(&self, limit: Duration) -> bool {
        self.state.active.wait_idle(limit).await
    }

    pub(crate) fn state(&self) -> Arc<AppState> {
        self.state.clone()
    }

    pub fn router(&self) -> Router {
        let router = routes::router(self.state.clone());
        match cors_layer(&self.state.config.cors_allow_origins) {
            Some(cors) => router.layer(cors),
            None => router,
        }
    }
}

/// Answers browsers' preflight requests and adds the CORS headers for the
/// configured origins; `None` when no origin is allowed. Origins that are not
/// valid header values are left out with a warning.
fn cors_layer(origins: &[String]) -> Option<CorsLayer> {
    if origins.is_empty() {
        return None;
    }
    let allow = if origins.iter().any(|o| o == "*") {
        AllowOrigin::any()
    } else {
        let valid: Vec<HeaderValue> = origins
            .iter()
            .filter_map(|o| {
                let v = HeaderValue::from_str(o.trim_end_matches('/')).ok();
                if v.is_none() {
                    tracing::warn!("--cors-allow-origin {o:?} is not a valid origin; ignoring it");
                }
                v
            })
            .collect();
        AllowOrigin::list(valid)
    };
    Some(
        CorsLayer::new()
            .allow_origin(allow)
            .allow_methods([Method::GET, Method::POST])
            .allow_headers([header::AUTHORIZATION, header::CONTENT_TYPE])
            .expose_headers([header::RETRY_AFTER])
            .max_age(Duration::from_secs(600)),
    )
}
